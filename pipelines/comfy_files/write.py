"""Write model components as ComfyUI-style single files (tests, benches, the live host).

A component's tensors (diffusers / transformers names, any module or state dict) are stored the
way Comfy-Org's files are: `store_tensors` puts every Linear weight in the chosen storage format
(fp8, fp8 scaled with a per-tensor `scale_weight`, GGUF blocks) and leaves the rest as it is;
plain formats (bf16, fp16, fp32) convert every floating tensor. The writers then rename to the
original Wan layout where Comfy-Org's files use it (transformer, VAE) and write safetensors or,
for GGUF formats, a city96-style .gguf (tensors over four dimensions flattened, their shape kept
under `comfy.gguf.orig_shape.<name>`).
"""

from __future__ import annotations

from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

import numpy as np
import safetensors.torch
import torch

from ...memory.storage import StoredTensor, quantize, storage_format
from . import gguf_names, hy15, hy15_vae, ltx2, text_encoders
from .files import TOKENIZER_KEY
from .keys import COMFY_PREFIX, KeyLayout, original_transformer_names, vae_original_names

SCALED_FP8_MARKER = "scaled_fp8"
GGUF_ORIG_SHAPE = "comfy.gguf.orig_shape."


def store_tensors(module: torch.nn.Module, storage: str) -> dict[str, Any]:
    """`module`'s state under `storage`: Linear weights quantized; plain formats convert all floats."""
    linear = {f"{name}.weight" for name, m in module.named_modules() if isinstance(m, torch.nn.Linear)}
    return store_state({name: t.detach() for name, t in module.state_dict().items()}, linear, storage)


def store_state(state: Mapping[str, torch.Tensor], matrix_names, storage: str) -> dict[str, Any]:
    """`state` under `storage`: the tensors named in `matrix_names` quantized (a quantized format),
    every floating tensor converted (a plain one: bf16, fp16, fp32), the rest kept as it is.

    A GGUF format keeps a matrix whose rows do not split into whole blocks as it is (float32),
    as city96's converter does.
    """
    fmt = storage_format(storage)
    out = {}
    for name, tensor in state.items():
        if not tensor.is_floating_point():
            out[name] = tensor
        elif not fmt.quantized and fmt.gguf_type is None:
            out[name] = tensor.to(fmt.torch_dtype).contiguous()
        elif name in matrix_names and fmt.holds(tuple(tensor.shape)):
            out[name] = quantize(tensor, fmt)
        else:
            out[name] = tensor.contiguous()
    return out


def dequantized(tensors: Mapping[str, Any], dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The values a model holding `tensors` computes with, as plain `dtype` tensors."""
    return {n: t.dequantize(dtype) if isinstance(t, StoredTensor) else (t.to(dtype) if t.is_floating_point() else t)
            for n, t in tensors.items()}


def write_transformer(tensors: Mapping[str, Any], path: str | Path, layout: KeyLayout = KeyLayout.ORIGINAL) -> Path:
    """A Wan transformer file in the original (Comfy-Org), prefixed (ComfyUI) or diffusers layout."""
    if layout is KeyLayout.DIFFUSERS:
        names = {n: n for n in tensors}
    else:
        names = original_transformer_names(tensors, COMFY_PREFIX if layout is KeyLayout.PREFIXED else "")
    return _write({names[n]: t for n, t in tensors.items()}, path)


def write_vae(tensors: Mapping[str, Any], path: str | Path) -> Path:
    """A Wan VAE file in its original layout (wan_2.1_vae.safetensors / wan2.2_vae.safetensors)."""
    names = vae_original_names(tensors)
    return _write({names[n]: t for n, t in tensors.items()}, path)


def write_hy15_vae(tensors: Mapping[str, torch.Tensor], path: str | Path, dtype: torch.dtype = torch.float16) -> Path:
    """A HunyuanVideo 1.5 VAE from diffusers-named `tensors`, as Comfy-Org ships it
    (hunyuanvideo15_vae_fp16.safetensors: Tencent's names, unprefixed, every tensor in `dtype`)."""
    return _write({name: t.to(dtype) for name, t in hy15_vae.original_tensors(tensors).items()}, path)


def write_ltx2_checkpoint(parts: Mapping[str, Mapping[str, Any]], path: str | Path,
                          extras: Mapping[str, Any] = MappingProxyType({})) -> Path:
    """An LTX-2 checkpoint as Lightricks ships it (ltx-2-19b-dev*.safetensors): each part
    ("transformer", "vae", "audio_vae"; diffusers names) under its prefix and original names, the
    video VAE with the statistics the converter drops, plus `extras` as they are (file names)."""
    out = dict(extras)
    for part, tensors in parts.items():
        names = ltx2.original_names(part, tensors)
        out.update({names[name]: tensor for name, tensor in tensors.items()})
        if part == "vae":  # in the file, unused by diffusers (its converter removes them)
            mean = tensors["latents_mean"]
            out[ltx2.VAE_PREFIX + "per_channel_statistics.mean-of-stds"] = torch.ones_like(mean)
            out[ltx2.VAE_PREFIX + "per_channel_statistics.channel"] = torch.arange(mean.numel(), dtype=mean.dtype)
    return _write(out, path)


def write_hy15_transformer(tensors: Mapping[str, torch.Tensor], path: str | Path, storage: str = "bf16",
                           layout: KeyLayout = KeyLayout.ORIGINAL) -> Path:
    """A HunyuanVideo 1.5 transformer from plain diffusers-named `tensors`: as Comfy-Org ships it
    (`layout` ORIGINAL: hunyuanvideo1.5_*.safetensors, Tencent's names, q/k/v fused), as ComfyUI saves
    it (PREFIXED: `model.model.` and its model's names) or in diffusers' names (DIFFUSERS); then stored
    by `store_state`: each matrix (the token-type embedding aside, kept wide as ComfyUI keeps it) in
    `storage`, quantized after fusing, so a fused matrix has one scale as in Comfy-Org's fp8 files."""
    named = dict(tensors) if layout is KeyLayout.DIFFUSERS else hy15.original_tensors(tensors, layout)
    matrices = {name for name, t in named.items() if name.endswith(".weight") and t.dim() == 2 and "cond_type_embed" not in name}
    return _write(store_state(named, matrices, storage), path)


def write_text_encoder(tensors: Mapping[str, Any], path: str | Path, spiece_model: bytes | None) -> Path:
    """A T5/UMT5 encoder file (transformers names) with the SentencePiece model embedded, as Comfy-Org's."""
    tensors = dict(tensors)
    tensors.pop("encoder.embed_tokens.weight", None)  # tied to shared.weight, saved once as safetensors does
    if spiece_model is not None:
        tensors[TOKENIZER_KEY] = torch.frombuffer(bytearray(spiece_model), dtype=torch.uint8)
    return _write(tensors, path)


def write_language_model(tensors: Mapping[str, Any], path: str | Path, class_name: str,
                         extras: Mapping[str, Any] = MappingProxyType({})) -> Path:
    """A Qwen2.5-VL / Gemma 3 text encoder from its transformers-named `tensors` (plain or stored), as
    Comfy-Org ships it: ComfyUI's names (text_encoders.comfy_names), without the `lm_head` ComfyUI's model
    does not have (Gemma ties it to the embedding), plus `extras` as they are (e.g. a vision tower's
    names the text model has no place for, or the embedded `spiece_model`)."""
    layout = text_encoders.LAYOUTS[class_name]
    kept = {name: t for name, t in tensors.items() if not name.startswith("lm_head.")}
    names = text_encoders.comfy_names(layout, kept)
    return _write({**{names[name]: t for name, t in kept.items()}, **extras}, path)


def write_llama_cpp_text_encoder(tensors: Mapping[str, Any], path: str | Path, arch: str,
                                 tokenizer: Mapping[str, Any] = MappingProxyType({})) -> Path:
    """A text encoder as llama.cpp's converter (and city96's T5 files) write it: from its transformers-named
    `tensors` (plain or stored; T5 / UMT5, Qwen2.5-VL's text model or Gemma 3's language model), renamed by
    gguf_names' table for `arch` ("t5encoder", "qwen2vl", "gemma3"; Gemma's norms stored as 1 + weight),
    `general.architecture` set to `arch`, plus `tokenizer` metadata (tokenizer.ggml.* fields) as given.
    What llama.cpp's files lack is left out: the tied copies, the vision parts (mmproj files) and lm_head."""
    if arch in gguf_names.T5.archs:
        layout = gguf_names.T5 if any(n.endswith("wi_0.weight") for n in tensors) else gguf_names.T5_UNGATED
        named = {n: t for n, t in tensors.items() if n != "encoder.embed_tokens.weight"}
    else:
        layout = next(layout for layout in gguf_names.LAYOUTS if arch in layout.archs)
        class_name = "Gemma3ForConditionalGeneration" if layout is gguf_names.GEMMA3 else "Qwen2_5_VLTextModel"
        language = text_encoders.LAYOUTS[class_name].language
        kept = [n for n in tensors if n.startswith(language) and not n.startswith("lm_head.")]
        comfy = text_encoders.comfy_names(text_encoders.LAYOUTS[class_name], kept)
        named = {comfy[n]: tensors[n] for n in kept}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_gguf(gguf_names.llama_cpp_tensors(layout, named), path, arch, tokenizer)
    return path


def write_clip_vision(tensors: Mapping[str, Any], path: str | Path, projection_dim: int, seed: int = 0) -> Path:
    """A CLIP vision file as Comfy-Org's clip_vision_h.safetensors: ComfyUI's
    CLIPVisionModelWithProjection state, every name under `vision_model.` plus the
    `visual_projection.weight` head, which Wan does not use (it reads hidden states) but the file
    carries; it gets random values here, so a loader that used it would be caught."""
    names = {name: name if name.startswith("vision_model.") else "vision_model." + name for name in tensors}
    out = {names[name]: tensor for name, tensor in tensors.items()}
    width = out["vision_model.post_layernorm.weight"].shape[0]
    generator = torch.Generator().manual_seed(seed)
    dtype = out["vision_model.post_layernorm.weight"].dtype
    out["visual_projection.weight"] = torch.randn(projection_dim, width, generator=generator).to(dtype)
    return _write(out, path)


def _write(tensors: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    gguf_types = {t.format.gguf_type for t in tensors.values() if isinstance(t, StoredTensor) and t.format.gguf_type}
    if gguf_types:
        _write_gguf(tensors, path)
    else:
        safetensors.torch.save_file(_flat_safetensors(tensors), str(path))
    return path


def _flat_safetensors(tensors: dict[str, Any]) -> dict[str, torch.Tensor]:
    flat, scaled = {}, False
    for name, tensor in tensors.items():
        if isinstance(tensor, StoredTensor):
            flat[name] = tensor.data.contiguous()
            if tensor.scale is not None:
                flat[name.removesuffix("weight") + "scale_weight"] = tensor.scale.reshape(()).to(torch.float32)
                scaled = True
        else:
            flat[name] = tensor.contiguous()
    if scaled:  # Comfy's marker of an fp8-scaled file: an empty tensor of the fp8 type
        flat[SCALED_FP8_MARKER] = torch.empty(0, dtype=torch.float8_e4m3fn)
    return flat


def _write_gguf(tensors: dict[str, Any], path: Path, arch: str = "wan",
                metadata: Mapping[str, Any] = MappingProxyType({})) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch=arch)
    for key, value in metadata.items():
        _add_field(writer, key, value)
    for name, tensor in tensors.items():
        if isinstance(tensor, StoredTensor):
            qtype = gguf.GGMLQuantizationType[tensor.format.gguf_type]
            writer.add_tensor(name, tensor.data.numpy(), raw_dtype=qtype)
            continue
        # F16 stays F16 (as llama.cpp's and city96's converters keep it); other floats are written F32
        array = (tensor if tensor.dtype == torch.float16 else tensor.to(torch.float32)).numpy()
        if array.ndim > 4:  # GGUF holds at most four dimensions
            writer.add_array(GGUF_ORIG_SHAPE + name, list(array.shape))
            array = array.reshape(array.shape[0], -1)
        writer.add_tensor(name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add_field(writer, key: str, value) -> None:
    """One metadata field, typed by its Python value (a list's items by theirs)."""
    if isinstance(value, bytes):  # a UINT8 array, as gguf-py writes bytes (llama.cpp's precompiled_charsmap)
        writer.add_array(key, value)
    elif isinstance(value, (list, tuple)):
        writer.add_array(key, list(value))
    elif isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    else:
        writer.add_string(key, str(value))
