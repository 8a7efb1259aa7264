"""Open one weight file for the loader: by content, scales folded, names made diffusers' own.

The order matters: `open_weights` sniffs the file's first bytes before anything parses it, so a
pickle under a .safetensors name is refused unread; a truncated file fails on its header. Then
the file's kind is read from its tensor names, and the names are brought to the layout diffusers
and transformers load (the VAE's original names need the model's own key set: `vae_tensors`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch

from ...memory.storage import StorageError, fold_scaled_fp8, open_weights
from ...memory.storage.files import SafetensorsFile
from ..family import ModelError
from . import detect, gguf_names, hy15, hy15_vae, ltx2, text_encoders
from .gguf_names import TOKENIZER_KEY
from .keys import COMFY_PREFIX, KeyLayout, transformer_layout, transformer_to_diffusers, vae_original_names


@dataclass(frozen=True)
class WeightFile:
    """A file's tensors under the names its model class loads (the VAE: still original, see layout)."""

    path: Path
    kind: str  # detect.TRANSFORMER / VAE / TEXT_ENCODER / CLIP_VISION
    layout: KeyLayout
    storage: str  # StorageFormat name of most of its weight matrices
    tensors: Mapping[str, Any]
    fields: Mapping[str, Any]  # config fields its shapes fix (detect.*_fields)
    tokenizer_model: bytes | None = field(default=None, repr=False)  # embedded spiece.model bytes
    llama_cpp: str | None = None  # the architecture of a llama.cpp-named GGUF (gguf_names), else None

    @property
    def name(self) -> str:
        return self.path.name


def read_weight_file(path: str | Path, role: str, expected: str, takes: str = "") -> WeightFile:
    """Open `path` (the loader input `role`), check it holds an `expected` kind of model (`takes`: what
    the input takes, for the message; default the kind's name)."""
    path = Path(path)
    where = f"{role} '{path.name}'"
    opened, llama_cpp = _open(path, role)
    kind, layout, tensors, extra = _classify(path, role, opened)
    if kind != expected:
        raise ModelError(
            f"{role}: '{path.name}' holds {_held(kind, layout, tensors, where)}, but this input takes "
            f"{takes or detect.KIND_NAMES[expected]}; "
            f"pick the matching file from the {expected.replace('_', ' ')} list."
        )
    if kind == detect.TRANSFORMER and hy15.transformer_layout(tensors) is not None:
        tensors = _hy15_transformer(path, role, layout, tensors)
    return WeightFile(path, kind, layout, _storage_name(path, role, tensors), tensors,
                      _fields(kind, layout, tensors, where), extra, llama_cpp)


def _storage_name(path: Path, role: str, tensors: Mapping[str, Any]) -> str:
    """detect.storage_name; a matrix in no format vidmem reads (an integer one) refused naming `role` and the
    file, as `_open` names what it refuses."""
    try:
        return detect.storage_name(tensors)
    except StorageError as error:
        raise ModelError(f"{role}: '{path.name}': {error}") from None


def _held(kind: str, layout: KeyLayout, tensors: Mapping[str, Any], where: str) -> str:
    """What a file of `kind` holds, for messages: a transformer by its family."""
    if kind == detect.VAE and hy15_vae.is_vae(tensors):
        return "a HunyuanVideo 1.5 VAE"
    language_model = text_encoders.class_of(tensors) if kind == detect.TEXT_ENCODER else None
    if language_model is not None:
        return text_encoders.HELD[language_model]
    if kind != detect.TRANSFORMER:
        return detect.KIND_NAMES[kind]
    if hy15.transformer_layout(tensors) is not None:  # still under the file's names: see _classify
        return "a HunyuanVideo 1.5 transformer"
    return detect.a_family_transformer(_fields(kind, layout, tensors, where))


def _hy15_transformer(path: Path, role: str, layout: KeyLayout, tensors: Mapping[str, Any]) -> dict[str, Any]:
    """A HunyuanVideo 1.5 transformer's tensors under diffusers' names, once the file is known to be
    one in the right input; the super-resolution models (which map fully) refused by name."""
    try:
        mapped = hy15.transformer_tensors(tensors, layout, path.name)
    except ModelError as error:
        raise ModelError(f"{role}: {error}") from None
    patch = mapped.get("x_embedder.proj.weight")  # absent: _fields names the missing tensor
    if patch is not None and len(patch.shape) > 1 and patch.shape[1] == hy15.SR_IN_CHANNELS:  # other ranks: _fields
        raise ModelError(
            f"{role}: '{path.name}' is a HunyuanVideo 1.5 super-resolution transformer ({hy15.SR_IN_CHANNELS} input "
            "channels: it upscales another model's latents), which vidmem does not run; use Comfy-Org's "
            "hunyuanvideo1.5_{480p,720p}_{t2v,i2v}*.safetensors."
        )
    return mapped


def _open_tensors(path: Path, role: str) -> dict[str, Any]:
    """The file's tensors, fp8 scales folded; ModelError naming `role` and the file when unreadable."""
    return _open(path, role)[0]


def _open(path: Path, role: str) -> tuple[dict[str, Any], str | None]:
    """(`_open_tensors`, the llama.cpp architecture of a llama.cpp-named GGUF or None)."""
    try:
        opened = open_weights(path)
        if isinstance(opened, SafetensorsFile):
            # fold_scaled_fp8 checks ComfyUI's `<layer>.comfy_quant` records (float8 layers are read, weight x
            # `weight_scale`, like fp8 scaled; any other format or a damaged record is named) and drops them
            # with the markers, keeping the layers they mark for full-precision matmul; the header has records too.
            return fold_scaled_fp8(opened.tensors, opened.metadata), None
        if gguf_names.is_llama_cpp(opened.tensors):  # llama.cpp's text-encoder names: brought to the readers' own
            where = f"{role}: '{path.name}'"
            arch = gguf_names.layout_of(opened.tensors, opened.metadata, where).archs[0]
            return gguf_names.file_tensors(opened.tensors, opened.metadata, where), arch
        return dict(opened.tensors), None
    except StorageError as error:
        named = str(error) if path.name in str(error) else f"'{path.name}': {error}"
        raise ModelError(f"{role}: {named}") from None


def _classify(path: Path, role: str, tensors: dict) -> tuple[str, KeyLayout, dict, bytes | None]:
    names = tuple(tensors)
    if ltx2.is_ltx2(names):
        return _ltx2_transformer(path, role, tensors)
    if hy15.is_all_in_one(names):
        raise ModelError(
            f"{role}: '{path.name}' is an all-in-one HunyuanVideo 1.5 checkpoint (the transformer under "
            f"'{COMFY_PREFIX}' with 'vae.' and 'text_encoders.' beside it); vidmem reads the transformer alone. Use "
            "Comfy-Org's hunyuanvideo1.5_*.safetensors, or save the model alone from ComfyUI (Load Checkpoint, then ModelSave)."
        )
    layout = hy15.transformer_layout(names)
    if layout is not None:  # mapped to diffusers' names once the input is known to take it (read_weight_file)
        return detect.TRANSFORMER, layout, tensors, None
    if hy15.is_version_1(names):
        raise ModelError(
            f"{role}: '{path.name}' is a HunyuanVideo 1.0 or HunyuanImage 2.1 transformer (no 'cond_type_embedding'), "
            "which vidmem does not run; use a HunyuanVideo 1.5 file (Comfy-Org's hunyuanvideo1.5_*.safetensors) over a "
            "HunyuanVideo 1.5 diffusers folder."
        )
    layout = transformer_layout(names)
    if layout is not None:
        return detect.TRANSFORMER, layout, transformer_to_diffusers(tensors, layout), None
    if text_encoders.is_language_model(names):  # before CLIP's: Gemma 3's vision tower has CLIP's names
        llm = text_encoders.layout_of(names, path.name, role)
        mapped = text_encoders.model_tensors(llm, {n: t for n, t in tensors.items() if n != TOKENIZER_KEY})
        return detect.TEXT_ENCODER, KeyLayout.ORIGINAL, mapped, _embedded_tokenizer(tensors)
    prefix = detect.find_prefix(names, detect.TEXT_MARKER)
    if prefix is not None:
        stripped = _strip(tensors, prefix, keep=lambda name: name != TOKENIZER_KEY)
        return detect.TEXT_ENCODER, KeyLayout.DIFFUSERS, stripped, _embedded_tokenizer(tensors)
    prefix = detect.find_prefix(names, detect.CLIP_MARKER)
    if prefix is not None and prefix + "embeddings.patch_embedding.weight" in tensors:  # the projection head is not used by Wan's CLIPVisionModel (hidden states only)
        return detect.CLIP_VISION, KeyLayout.DIFFUSERS, _strip(tensors, prefix, keep=lambda n: n.startswith(detect.CLIP_PARTS)), None
    found = hy15_vae.find_vae(names)  # before Wan's: its diffusers names share Wan's marker
    if found is not None:
        prefix, layout = found
        mapped = hy15_vae.vae_tensors(_strip(tensors, prefix), layout)
        hy15_vae.check_names(mapped, f"{role}: '{path.name}'")
        return detect.VAE, KeyLayout.DIFFUSERS, mapped, None
    for marker, vae_layout in zip(detect.VAE_MARKERS, (KeyLayout.ORIGINAL, KeyLayout.DIFFUSERS)):
        prefix = detect.find_prefix(names, marker)
        if prefix is not None:
            return detect.VAE, vae_layout, _strip(tensors, prefix), None
    _refuse_folder_only_vae(path, role, names)
    sample = ", ".join(names[:5])
    raise ModelError(
        f"{role}: '{path.name}' has a key layout vidmem does not know (first names: {sample}). vidmem reads Wan "
        "transformers (original, model.diffusion_model. or diffusers names), LTX-2 checkpoints, HunyuanVideo 1.5 "
        "transformers (Comfy-Org's or Tencent's names, saved by ComfyUI under model.model., or diffusers names), Wan and "
        "HunyuanVideo 1.5 VAEs, T5/UMT5 text encoders (transformers names, or llama.cpp's in GGUF), Qwen2.5-VL 7B "
        "and Gemma 3 12B text encoders (ComfyUI's names, or llama.cpp's in GGUF) and CLIP vision encoders; use "
        "Comfy-Org's repackaged files."
    )


def _embedded_tokenizer(tensors: Mapping[str, Any]) -> bytes | None:
    """The SentencePiece model a text encoder file embeds (Comfy-Org's `spiece_model` tensor), or None."""
    spiece = tensors.get(TOKENIZER_KEY)
    return None if spiece is None else bytes(spiece.cpu().numpy().tobytes())


VAE_INPUTS = ("vae", "vae_file")  # Load Video Model Files' and Load Video Pipeline's VAE inputs


def _ltx2_transformer(path: Path, role: str, tensors: dict) -> tuple[str, KeyLayout, dict, None]:
    """An LTX-2 checkpoint read as its transformer (its VAEs are read apart: `ltx2_part`)."""
    ltx2.check_variant(tensors, path.name)
    parts = ltx2.parts_in(tensors)
    if "transformer" not in parts and role in VAE_INPUTS:
        raise ModelError(
            f"{role}: '{path.name}' is LTX-2's video VAE (it holds only LTX-2's {' and '.join(parts)}); "
            "vae_file takes Wan and HunyuanVideo 1.5 VAEs, and LTX-2's VAE comes with its checkpoint: pick the LTX-2 "
            "checkpoint that carries it (ltx-2-19b-dev*.safetensors) as Load Video Pipeline's transformer_file over an "
            "LTX-2 diffusers folder, and leave vae_file at (from the folder)."
        )
    if "transformer" not in parts:
        raise ModelError(
            f"{role}: '{path.name}' holds only LTX-2's {' and '.join(parts)} (no "
            f"'{ltx2.TRANSFORMER_PREFIX}' tensors); pick the LTX-2 checkpoint that carries the transformer "
            "(ltx-2-19b-dev*.safetensors, or a transformer-only file)."
        )
    layout = ltx2.transformer_layout(tensors)
    return detect.TRANSFORMER, layout, ltx2.transformer_tensors(tensors, layout), None


def _refuse_folder_only_vae(path: Path, role: str, names: tuple[str, ...]) -> None:
    """The VAEs vidmem reads only from a diffusers folder (or LTX-2's checkpoint), named as such
    rather than called a key layout vidmem does not know."""
    if detect.find_prefix(names, detect.COGVIDEOX_VAE_MARKER) is not None:
        raise ModelError(
            f"{role}: '{path.name}' is CogVideoX's VAE, which vidmem reads from its diffusers folder only (vae/); "
            "load the CogVideoX folder with Load Video Pipeline and leave vae_file at (from the folder)."
        )
    if ltx2.AUDIO_VAE_MARKER in names:
        raise ModelError(
            f"{role}: '{path.name}' is LTX-2's audio VAE, which only Decode Audio reads: from the LTX-2 checkpoint "
            "(Load Video Pipeline's transformer_file, ltx-2-19b-dev*.safetensors) or the diffusers folder's audio_vae/; "
            "it is no input's single file."
        )


def ltx2_part(path: str | Path, part: str, role: str) -> dict[str, Any]:
    """One part ("vae", "audio_vae") of an LTX-2 checkpoint under diffusers' names, mapped from the file."""
    return ltx2.part_tensors(_open_tensors(Path(path), role), part)


def ltx2_parts(path: str | Path, role: str) -> tuple[str, ...]:
    """The LTX-2 parts ("transformer", "vae", "audio_vae") the file at `path` holds, read as the loader
    reads it (safetensors or GGUF: only its header and index)."""
    return ltx2.parts_in(_open_tensors(Path(path), role))


def _strip(tensors: dict, prefix: str, keep=lambda name: True) -> dict:
    return {name[len(prefix):]: t for name, t in tensors.items() if name.startswith(prefix) and keep(name[len(prefix):])}


def _fields(kind: str, layout: KeyLayout, tensors: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The config fields the shapes fix; ModelError naming `where` (the input and its file) for a missing tensor."""
    try:
        if kind == detect.TRANSFORMER and ltx2.is_transformer(tensors):
            return ltx2.transformer_fields(tensors)
        if kind == detect.TRANSFORMER and hy15.is_transformer(tensors):
            return hy15.transformer_fields(tensors)
        if kind == detect.VAE and hy15_vae.is_vae(tensors):
            return hy15_vae.vae_fields(tensors)
        if kind == detect.VAE:
            return detect.vae_fields(tensors, original=layout is KeyLayout.ORIGINAL)
        language_model = text_encoders.class_of(tensors) if kind == detect.TEXT_ENCODER else None
        if language_model is not None:
            return text_encoders.fields(tensors, language_model)
        reader = {detect.TRANSFORMER: detect.transformer_fields, detect.TEXT_ENCODER: detect.text_encoder_fields,
                  detect.CLIP_VISION: detect.clip_vision_fields}[kind]
        return reader(tensors)
    except (KeyError, IndexError) as error:
        # Not a transformer's _held: it reads _fields.
        shown = _held(kind, layout, tensors, where) if kind == detect.VAE else detect.KIND_NAMES[kind]
        # An IndexError is a reader indexing a dimension the tensor lacks (a 1-D matrix): its text names nothing.
        problem = f"lacks the tensor {error}" if isinstance(error, KeyError) else "has a tensor with fewer dimensions than it should"
        raise ModelError(f"{shown} file {problem}: {where} is incomplete or of another variant; "
                         "download it again or pick the matching file.") from None


def model_tensors(file: WeightFile, model_names) -> dict[str, Any]:
    """The file's tensors under the names of the built model with `model_names`.

    The VAE's original names depend on the model's stage sizes; CLIP's names carry a
    `vision_model.` prefix in transformers 4 and none in 5.
    """
    if file.kind == detect.VAE:
        return vae_tensors(file, model_names)
    if file.kind == detect.CLIP_VISION and any(n.startswith("vision_model.") for n in model_names):
        return {"vision_model." + name: t for name, t in file.tensors.items()}
    return dict(file.tensors)


def vae_tensors(file: WeightFile, model_names) -> dict[str, Any]:
    """The VAE file's tensors under the diffusers names of a model with `model_names`."""
    if file.layout is KeyLayout.DIFFUSERS:
        return dict(file.tensors)
    to_diffusers = {original: name for name, original in vae_original_names(model_names).items()}
    return {to_diffusers.get(name, name): tensor for name, tensor in file.tensors.items()}


# --- a diffusers folder's components replaced from one file (LTX-2) -------------------------------

def ltx2_replaced_components(path, folder) -> tuple[str, ...]:
    """The components of `folder` a single file at `path` replaces: its transformer, and an LTX-2
    checkpoint's video VAE when it carries one (read from its header, nothing loaded). A file
    without the VAE needs the folder's VAE weights: refused here, naming both, when they are absent."""
    path, folder = Path(path), Path(folder)
    names = _open_tensors(path, "transformer_file")
    if not ltx2.is_ltx2(names):
        return ("transformer",)
    if "vae" in ltx2.parts_in(names):
        return ("transformer", "vae")
    if not any((folder / "vae").glob("*.safetensors")):
        raise ModelError(
            f"transformer_file '{path.name}' is an LTX-2 transformer without its video VAE (no '{ltx2.VAE_PREFIX}' tensors), "
            f"and '{folder / 'vae'}' has no weights either. Use the full checkpoint that carries the VAE "
            "(ltx-2-19b-dev*.safetensors), or put the VAE's diffusion_pytorch_model.safetensors in that folder."
        )
    return ("transformer",)


def check_ltx2_vae_config(path, config: Mapping[str, Any] | None, folder) -> None:
    """An LTX-2 checkpoint's video VAE needs the folder's vae/config.json: refused by name where it lists none."""
    if config is None:
        raise ModelError(f"'{Path(path).name}' carries LTX-2's video VAE, but '{Path(folder) / 'model_index.json'}' lists "
                         "no vae; use an LTX-2 diffusers folder (its vae/config.json configures the file's VAE).")


def load_ltx2_vae(path, config: Mapping[str, Any] | None, folder, dtype: torch.dtype):
    """The video VAE of the LTX-2 checkpoint at `path`, configured by `folder`'s vae/config.json and
    used in place from the file's mapping where already in `dtype`. Returns (module, held format, report)."""
    from ..configs.meta import ComponentConfig
    from ..weight_storage import DEFAULT_WEIGHTS, hold
    from .build import build_empty

    path, folder = Path(path), Path(folder)
    check_ltx2_vae_config(path, config, folder)
    component = ComponentConfig("vae", "diffusers", "AutoencoderKLLTX2Video", config, str(folder / "vae" / "config.json"))
    module = build_empty(component)
    report, _ = hold(module, ltx2_part(path, "vae", "transformer_file"), dtype, DEFAULT_WEIGHTS,
                     copy_to_ram=False, source=path.name)
    # Its convolutions are cast to `dtype` at load (as load.py's VAEs): report what it is held in.
    return module, report.formats[0].format, report
