"""The tiny Wan pipelines of `pipelines.tiny` as ComfyUI model files, with no diffusers folder.

The same tiny models as Comfy-Org's repackaged files: original Wan key names (or ComfyUI's
`model.diffusion_model.` prefix, or diffusers' names), an umt5 file with its SentencePiece model
embedded, bf16 / fp16 / fp8 / fp8-scaled / GGUF storage, the Wan VAE in its original layout; and
each tiny model's config in the shipped schema, so the single-file loader recognises it. Tests
compare against the diffusers twin written alongside; pointed at a ComfyUI models folder, the
files serve the live host.

    out = save_tiny_comfy_files("wan2.2-a14b", "/path/ComfyUI/models", "fp8_scaled", reference=False)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from .tiny import _CLIP_VISION, _TEXT_ENCODER, TINY_SPECS, build_tiny_pipeline, build_tiny_tokenizer, tiny_spec
CONFIGS_FOLDER = "vidmem_configs"  # under a ComfyUI models folder: extra model configs the loader node reads


def tiny_spiece_model() -> bytes:
    """The tiny tokenizer's vocabulary as a SentencePiece Unigram model (what Comfy-Org embeds).

    transformers reads it back into a tokenizer that gives the same ids as `build_tiny_tokenizer`
    (the vocabulary lists a few pieces twice, as the in-code one does; transformers keeps the last).
    """
    from sentencepiece import sentencepiece_model_pb2 as spm

    vocab = json.loads(build_tiny_tokenizer().backend_tokenizer.to_str())["model"]["vocab"]
    piece_types = {"<pad>": spm.ModelProto.SentencePiece.CONTROL, "</s>": spm.ModelProto.SentencePiece.CONTROL,
                   "<unk>": spm.ModelProto.SentencePiece.UNKNOWN}
    model = spm.ModelProto()
    model.trainer_spec.model_type = spm.TrainerSpec.UNIGRAM
    model.trainer_spec.pad_id, model.trainer_spec.eos_id, model.trainer_spec.unk_id, model.trainer_spec.bos_id = 0, 1, 2, -1
    model.normalizer_spec.name = "identity"
    model.normalizer_spec.add_dummy_prefix = True
    for piece, score in vocab:
        entry = model.pieces.add()
        entry.piece, entry.score = piece, score
        entry.type = piece_types.get(piece, spm.ModelProto.SentencePiece.NORMAL)
    return model.SerializeToString()


def tiny_model_config(variant: str) -> dict[str, Any]:
    """Tiny Wan `variant` as a model config in the shipped schema (pipelines/configs/models), named
    "tiny-<variant>", with its scheduler and image processor: what the single-file loader matches."""
    spec = tiny_spec(variant)
    components = {
        "transformer": _config_entry("diffusers", spec.transformer, spec.transformer_config),
        "vae": _config_entry("diffusers", spec.vae, spec.vae_config),
        "text_encoder": _config_entry("transformers", spec.text_encoder,
                                      dict(_TEXT_ENCODER, vocab_size=len(build_tiny_tokenizer()))),
    }
    if spec.two_experts:
        components["transformer_2"] = components["transformer"]
    if spec.image_encoder:
        components["image_encoder"] = _config_entry("transformers", "CLIPVisionModel", _CLIP_VISION)
    return {
        "name": f"tiny-{variant}", "pipeline": spec.pipeline, "dtype": "fp32",
        "source": "vidmem.pipelines.tiny (diffusers' fast-test configs)",
        "pipeline_config": dict(spec.pipeline_config), "components": components,
        "scheduler": {"class": spec.scheduler, "config": dict(spec.scheduler_config)},
        "image_processor": {"crop_size": spec.width, "size": spec.width} if spec.image_encoder else {},
    }


def _config_entry(library: str, class_name: str, config: Mapping[str, Any]) -> dict[str, Any]:
    plain = {k: list(v) if isinstance(v, tuple) else v for k, v in config.items()}
    return {"library": library, "class": class_name, "config": plain}


def tiny_wan_variants() -> tuple[str, ...]:
    return tuple(v for v, spec in TINY_SPECS.items() if spec.pipeline in ("WanPipeline", "WanImageToVideoPipeline"))


def tiny_catalogue() -> tuple:
    """The tiny Wan variants as model entries, for `load_model_files(..., catalogue=...)`."""
    from .comfy_files.catalogue import entry_from_json

    return tuple(entry_from_json(tiny_model_config(variant)) for variant in tiny_wan_variants())


@dataclass(frozen=True)
class TinyComfyFiles:
    files: Any  # comfy_files.ModelFiles
    reference: Path | None  # a diffusers folder holding the files' weights, dequantized to fp32


_ROLES = {"model": ("transformer", "diffusion_models"), "model_2": ("transformer_2", "diffusion_models"),
          "text_encoder": ("text_encoder", "text_encoders"), "vae": ("vae", "vae"), "clip_vision": ("image_encoder", "clip_vision")}


def save_tiny_comfy_files(variant: str, folder: str | Path, storage: str = "bf16", layout: str = "original",
                          seed: int = 0, with_tokenizer: bool = True, reference: bool = True,
                          file_names: Mapping[str, str] | None = None) -> TinyComfyFiles:
    """Write tiny `variant` as ComfyUI model folders under `folder`, plus its diffusers twin.

    Transformer(s) and text encoder are stored in `storage` (a StorageFormat name; a GGUF text
    encoder is not a Comfy-Org format, so GGUF runs keep it in bf16); VAE and CLIP vision stay
    plain (`storage` when it is plain, else fp32). `layout`: "original", "prefixed" or
    "diffusers" transformer names. `file_names` renames files by loader input ("model",
    "model_2", "text_encoder", "vae", "clip_vision"), e.g. to give a template's real file names
    to tiny files on a test host. The reference folder holds exactly the values the files
    dequantize to, so a pipeline loaded from either computes the same (`reference=False`: skipped).
    The tiny model's config goes to `folder/vidmem_configs/tiny-<variant>.json`: pointed at a
    ComfyUI models folder, this makes the files loadable by the Load Video Model Files node.
    """
    from .comfy_files.load import ModelFiles
    from .comfy_files.write import dequantized, store_tensors

    folder = Path(folder)
    pipe = build_tiny_pipeline(variant, seed)
    storages = _component_storage(variant, storage)
    stored = {component: store_tensors(getattr(pipe, component), fmt) for component, fmt in storages.items()}
    names = {**_default_names(variant, storage, storages), **(file_names or {})}
    paths = {role: _write(role, stored[_ROLES[role][0]], folder / _ROLES[role][1] / names[role], layout, with_tokenizer)
             for role in names if _ROLES[role][0] in stored}
    config = folder / CONFIGS_FOLDER / f"tiny-{variant}.json"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(json.dumps(tiny_model_config(variant), indent=2))
    if not reference:
        return TinyComfyFiles(ModelFiles(**paths), None)
    for component, tensors in stored.items():
        getattr(pipe, component).load_state_dict(dequantized(tensors))
    twin = folder / "diffusers" / f"{variant}-{storage}"
    pipe.save_pretrained(twin, safe_serialization=True)
    return TinyComfyFiles(ModelFiles(**paths), twin)


def _component_storage(variant: str, storage: str) -> dict[str, str]:
    from ..memory.storage import storage_format

    fmt = storage_format(storage)
    plain = storage if fmt.gguf_type is None and not fmt.quantized else "fp32"
    spec = tiny_spec(variant)
    storages = {"transformer": storage, "text_encoder": "bf16" if fmt.gguf_type else storage, "vae": plain}
    if spec.two_experts:
        storages["transformer_2"] = storage
    if spec.image_encoder:
        storages["image_encoder"] = plain
    return storages


def _default_names(variant: str, storage: str, storages: dict[str, str]) -> dict[str, str]:
    from ..memory.storage import storage_format

    suffix = ".gguf" if storage_format(storage).gguf_type else ".safetensors"
    return {
        "model": f"tiny_{variant}_{storage}{suffix}",
        "model_2": f"tiny_{variant}_low_noise_{storage}{suffix}",
        "text_encoder": f"tiny_umt5_{storages['text_encoder']}.safetensors",
        "vae": f"tiny_{variant}_vae.safetensors",
        "clip_vision": f"tiny_clip_vision_{storages.get('image_encoder', 'fp32')}.safetensors",
    }


def _write(role: str, tensors: dict, path: Path, layout: str, with_tokenizer: bool) -> Path:
    from .comfy_files.keys import KeyLayout
    from .comfy_files.write import write_clip_vision, write_text_encoder, write_transformer, write_vae

    if role in ("model", "model_2"):
        return write_transformer(tensors, path, KeyLayout(layout))
    if role == "text_encoder":
        return write_text_encoder(tensors, path, tiny_spiece_model() if with_tokenizer else None)
    if role == "clip_vision":  # Comfy-Org's clip_vision_h layout: vision_model. names and the projection head
        return write_clip_vision(tensors, path, _CLIP_VISION["projection_dim"])
    return write_vae(tensors, path)
