"""HunyuanVideo 1.5 single files: Comfy-Org's repackaged transformers (and Tencent's own), read by their tensors.

Comfy-Org's files (HunyuanVideo_1.5_repackaged: hunyuanvideo1.5_720p_t2v_fp16.safetensors,
..._480p_i2v_..._fp8_scaled...) hold the transformer under Tencent's original names, unprefixed
(`double_blocks.0.img_mod.linear.weight`, `txt_in.individual_token_refiner.blocks.0.norm1.weight`),
with each double block's image and text attention fused into one `img_attn_qkv` / `txt_attn_qkv`
matrix as ComfyUI's model holds them; Tencent's own checkpoint keeps `img_attn_q/_k/_v` apart.
Both are read, and files saved by ComfyUI (`model.diffusion_model.` prefix) or in diffusers' names.

diffusers 0.42.1 ships no single-file converter for this model (only the conversion script
scripts/convert_hunyuan_video1_5_to_diffusers.py, not installed), so the mapping is written here
once, as data, from the two model definitions (Tencent's / ComfyUI's and diffusers'
HunyuanVideo15Transformer3DModel): renames, three fused matrices split by rows into q, k, v
(views of the file's mapping, never copies), and the final modulation, which Tencent orders
(shift, scale) and diffusers' AdaLayerNormContinuous (scale, shift): its two halves trade places
(a copy of one small matrix). The reverse (`original_tensors`) writes files in Comfy-Org's layout
for tests and benches; tests/test_comfy_files_hy15.py round-trips a model through both.

What the tensors cannot tell: T2V from I2V, and 480p from 720p. Every HunyuanVideo 1.5
transformer has the image projection (`vision_in`) and 65 input channels; `task_type` and
`target_size` are config values only (diffusers' model reads neither), so the folder's
transformer config decides them. The step-distilled 480p I2V model has a second time embedder
(`time_r_in`, `use_meanflow`), which the tensors do show.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ...memory.storage import StoredTensor
from ..family import ModelError
from .keys import COMFY_PREFIX, KeyLayout, count_blocks

# ComfyUI's own detection key of a HunyuanVideo transformer (comfy/model_detection.py), and what
# only version 1.5 has (the per-source token embedding; 1.0 has single-stream blocks and CLIP's vector_in).
MARKER = "txt_in.individual_token_refiner.blocks.0.norm1.weight"
V15_MARKER = "cond_type_embedding.weight"
DIFFUSERS_MARKERS = ("context_embedder.token_refiner.refiner_blocks.0.norm1.weight", "cond_type_embed.weight")

# Tencent / ComfyUI name stem -> diffusers name stem, for the names outside the numbered blocks.
_TOP = (
    ("img_in.proj", "x_embedder.proj"),
    ("time_in.mlp.0", "time_embed.timestep_embedder.linear_1"),
    ("time_in.mlp.2", "time_embed.timestep_embedder.linear_2"),
    ("time_r_in.mlp.0", "time_embed.timestep_embedder_r.linear_1"),  # step-distilled (meanflow) models only
    ("time_r_in.mlp.2", "time_embed.timestep_embedder_r.linear_2"),
    ("txt_in.t_embedder.mlp.0", "context_embedder.time_text_embed.timestep_embedder.linear_1"),
    ("txt_in.t_embedder.mlp.2", "context_embedder.time_text_embed.timestep_embedder.linear_2"),
    ("txt_in.c_embedder.linear_1", "context_embedder.time_text_embed.text_embedder.linear_1"),
    ("txt_in.c_embedder.linear_2", "context_embedder.time_text_embed.text_embedder.linear_2"),
    ("txt_in.input_embedder", "context_embedder.proj_in"),
    ("byt5_in.layernorm", "context_embedder_2.norm"),
    ("byt5_in.fc1", "context_embedder_2.linear_1"),
    ("byt5_in.fc2", "context_embedder_2.linear_2"),
    ("byt5_in.fc3", "context_embedder_2.linear_3"),
    ("vision_in.proj.0", "image_embedder.norm_in"),
    ("vision_in.proj.1", "image_embedder.linear_1"),
    ("vision_in.proj.3", "image_embedder.linear_2"),
    ("vision_in.proj.4", "image_embedder.norm_out"),
    ("cond_type_embedding", "cond_type_embed"),
    ("final_layer.adaLN_modulation.1", "norm_out.linear"),
    ("final_layer.linear", "proj_out"),
)
# Inside `txt_in.individual_token_refiner.blocks.N.` -> `context_embedder.token_refiner.refiner_blocks.N.`
_REFINER = (
    ("norm1", "norm1"), ("norm2", "norm2"),
    ("self_attn_q", "attn.to_q"), ("self_attn_k", "attn.to_k"), ("self_attn_v", "attn.to_v"),
    ("self_attn_proj", "attn.to_out.0"),
    ("mlp.fc1", "ff.net.0.proj"), ("mlp.fc2", "ff.net.2"),
    ("adaLN_modulation.1", "norm_out.linear"),
)
# Inside `double_blocks.N.` -> `transformer_blocks.N.`
_DOUBLE = (
    ("img_mod.linear", "norm1.linear"), ("txt_mod.linear", "norm1_context.linear"),
    ("img_attn_q", "attn.to_q"), ("img_attn_k", "attn.to_k"), ("img_attn_v", "attn.to_v"),
    ("img_attn_q_norm", "attn.norm_q"), ("img_attn_k_norm", "attn.norm_k"), ("img_attn_proj", "attn.to_out.0"),
    ("txt_attn_q", "attn.add_q_proj"), ("txt_attn_k", "attn.add_k_proj"), ("txt_attn_v", "attn.add_v_proj"),
    ("txt_attn_q_norm", "attn.norm_added_q"), ("txt_attn_k_norm", "attn.norm_added_k"),
    ("txt_attn_proj", "attn.to_add_out"),
    ("img_mlp.fc1", "ff.net.0.proj"), ("img_mlp.fc2", "ff.net.2"),
    ("txt_mlp.fc1", "ff_context.net.0.proj"), ("txt_mlp.fc2", "ff_context.net.2"),
)
# (block prefix in the file, in diffusers, table); `{}` is the block index; top-level names have none.
_GROUPS = (
    ("double_blocks.{}.", "transformer_blocks.{}.", dict(_DOUBLE)),
    ("txt_in.individual_token_refiner.blocks.{}.", "context_embedder.token_refiner.refiner_blocks.{}.", dict(_REFINER)),
    ("", "", dict(_TOP)),
)
# A fused matrix (rows q, k, v) in Comfy-Org's and Tencent's files -> the three stems above it splits into.
FUSED = {"img_attn_qkv": ("img_attn_q", "img_attn_k", "img_attn_v"),
         "txt_attn_qkv": ("txt_attn_q", "txt_attn_k", "txt_attn_v"),
         "self_attn_qkv": ("self_attn_q", "self_attn_k", "self_attn_v")}
# Comfy-Org fuses the double blocks' attention; the token refiner is fused in every release.
_WRITTEN_FUSED = ("img_attn_qkv", "txt_attn_qkv", "self_attn_qkv")
SWAPPED = "final_layer.adaLN_modulation.1"  # (shift, scale) in the file, (scale, shift) in diffusers


def transformer_layout(names: Iterable[str]) -> KeyLayout | None:
    """ORIGINAL: Comfy-Org's / Tencent's names; PREFIXED: under `model.diffusion_model.`;
    DIFFUSERS: diffusers' own; None: no HunyuanVideo 1.5 transformer (see `is_version_1`)."""
    names = set(names)
    if all(marker in names for marker in DIFFUSERS_MARKERS):
        return KeyLayout.DIFFUSERS
    for layout, prefix in ((KeyLayout.ORIGINAL, ""), (KeyLayout.PREFIXED, COMFY_PREFIX)):
        if prefix + MARKER in names and prefix + V15_MARKER in names:
            return layout
    return None


def is_version_1(names: Iterable[str]) -> bool:
    """A HunyuanVideo (1.0) transformer: ComfyUI's HunyuanVideo key without 1.5's token-type embedding."""
    names = set(names)
    return any(prefix + MARKER in names and prefix + V15_MARKER not in names for prefix in ("", COMFY_PREFIX))


def transformer_tensors(tensors: Mapping[str, Any], layout: KeyLayout, file_name: str) -> dict[str, Any]:
    """The transformer's tensors under diffusers' names. Renamed and row-split views of the file's
    tensors; only the final modulation (a few MB at full size) is copied. ModelError naming the
    file for a name the table does not know, so nothing is loaded half-mapped."""
    if layout is KeyLayout.DIFFUSERS:
        return dict(tensors)
    prefix = COMFY_PREFIX if layout is KeyLayout.PREFIXED else ""
    out, unknown = {}, []
    for name, tensor in tensors.items():
        if not name.startswith(prefix):
            unknown.append(name)
            continue
        try:
            mapped = _to_diffusers(name[len(prefix):], tensor)
        except ModelError as error:
            raise ModelError(f"'{file_name}': '{name}' {error}") from None
        if mapped is None:
            unknown.append(name)
        else:
            out.update(mapped)
    if unknown:
        raise ModelError(
            f"'{file_name}' is a HunyuanVideo 1.5 transformer with tensors vidmem's name table does not map "
            f"({', '.join(sorted(unknown)[:5])}{', ...' if len(unknown) > 5 else ''}): a variant vidmem does not read "
            "(e.g. the super-resolution models). Use Comfy-Org's hunyuanvideo1.5_{480p,720p}_{t2v,i2v}*.safetensors, "
            "or load the model from its diffusers folder with transformer_file empty."
        )
    return out


def _to_diffusers(name: str, tensor) -> dict[str, Any] | None:
    stem, dot, leaf = name.rpartition(".")
    if not dot or leaf not in ("weight", "bias"):
        return None
    block, rest, (_, target, table) = _block_of(stem, _GROUPS)
    base = target.format(block)
    if rest in FUSED:
        parts = [table.get(part) for part in FUSED[rest]]
        return None if None in parts else {f"{base}{part}.{leaf}": rows for part, rows in zip(parts, split_rows(tensor, 3))}
    if rest in table:
        return {f"{base}{table[rest]}.{leaf}": swap_halves(tensor) if stem == SWAPPED else tensor}
    return None


def _block_of(stem: str, groups) -> tuple[str, str, tuple]:
    """(block index, the stem inside the block, the group) of the first group whose prefix `stem` has."""
    for group in groups:
        pattern = re.escape(group[0]).replace(re.escape("{}"), r"(\d+)")
        m = re.match(pattern, stem) if group[0] else None
        if m:
            return m.group(1), stem[m.end():], group
    return "", stem, groups[-1]


def split_rows(tensor, parts: int) -> list:
    """`tensor` cut into `parts` equal row ranges: views for plain tensors; for stored ones (fp8,
    fp8 scaled, GGUF held row by row) StoredTensors over row ranges of the same data, a per-tensor
    scale shared, a per-row scale cut with its rows."""
    rows, rest = divmod(tensor.shape[0], parts)
    if rest:
        raise ModelError(f"has {tensor.shape[0]} rows, which do not split into {parts} equal parts: the file is damaged; "
                         "download it again.")
    if not isinstance(tensor, StoredTensor):
        return list(tensor.split(rows, dim=0))
    if tensor.data.shape[0] != tensor.shape[0]:
        raise ModelError(f"is stored as {tensor!r}, flattened before quantizing, so its fused rows cannot be taken apart; "
                         "use an fp16/bf16 or fp8 file, or a GGUF file that keeps its matrices' rows.")
    return [StoredTensor(tensor.data[i * rows:(i + 1) * rows], tensor.format, (rows, *tensor.shape[1:]),
                         _scale_rows(tensor.scale, tensor.shape[0], slice(i * rows, (i + 1) * rows)))
            for i in range(parts)]


def swap_halves(tensor):
    """The two row halves of `tensor` exchanged (a copy): Tencent's (shift, scale) as diffusers' (scale, shift)."""
    if not isinstance(tensor, StoredTensor):
        first, second = tensor.chunk(2, dim=0)
        return torch.cat([second, first], dim=0)
    first, second = split_rows(tensor, 2)
    scale = None if tensor.scale is None else (tensor.scale if first.scale is tensor.scale else
                                               torch.cat([second.scale, first.scale], dim=0))
    return StoredTensor(torch.cat([second.data, first.data], dim=0), tensor.format, tensor.shape, scale)


def _scale_rows(scale, rows: int, index: slice):
    if scale is None or scale.dim() == 0 or scale.shape[0] != rows:
        return scale  # per tensor (or per column): the same for every row
    return scale[index]


# --- the reverse, for writing files in Comfy-Org's layout ------------------------------------------

def original_tensors(tensors: Mapping[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    """Plain diffusers-named transformer tensors under Comfy-Org's names (`prefix` before each):
    q, k and v fused by rows, the final modulation's halves back in Tencent's order (copies)."""
    reverse = tuple((target, source, {new: old for old, new in table.items()}) for source, target, table in _GROUPS)
    out, fused = {}, {}
    for name, tensor in tensors.items():
        stem, _, leaf = name.rpartition(".")
        block, rest, (source, target, table) = _block_of(stem, reverse)
        if rest not in table:
            raise ModelError(f"'{name}' has no HunyuanVideo 1.5 original name; update pipelines/comfy_files/hy15.py.")
        original, base = table[rest], target.format(block)
        whole = next((f for f in _WRITTEN_FUSED if original in FUSED[f]), None)
        if whole is not None:
            fused.setdefault(f"{base}{whole}.{leaf}", {})[FUSED[whole].index(original)] = tensor
        else:
            out[f"{base}{original}.{leaf}"] = swap_halves(tensor) if base + original == SWAPPED else tensor
    for name, parts in fused.items():
        out[name] = torch.cat([parts[i] for i in range(3)], dim=0)
    return {prefix + name: tensor for name, tensor in out.items()}


# --- what the shapes fix --------------------------------------------------------------------------

def transformer_fields(t: Mapping[str, Any]) -> dict[str, Any]:
    """HunyuanVideo15Transformer3DModel config fields fixed by the tensors (diffusers names)."""
    patch = t["x_embedder.proj.weight"].shape  # Conv3d [inner, in_channels, pt, p, p]
    inner = patch[0]
    return {
        "inner_dim": inner, "in_channels": patch[1], "patch_size": patch[3], "patch_size_t": patch[2],
        "out_channels": t["proj_out.weight"].shape[0] // (patch[2] * patch[3] * patch[4]),
        "attention_head_dim": t["transformer_blocks.0.attn.norm_q.weight"].shape[0],
        "ffn_dim": t["transformer_blocks.0.ff.net.0.proj.weight"].shape[0],
        "num_layers": count_blocks(t, r"transformer_blocks\.(\d+)\."),
        "num_refiner_layers": count_blocks(t, r"context_embedder\.token_refiner\.refiner_blocks\.(\d+)\."),
        "text_embed_dim": t["context_embedder.proj_in.weight"].shape[1],
        "text_embed_2_dim": t["context_embedder_2.norm.weight"].shape[0],
        "image_embed_dim": t["image_embedder.norm_in.weight"].shape[0],
        "use_meanflow": "time_embed.timestep_embedder_r.linear_1.weight" in t,
    }


def transformer_config_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """The same fields from a HunyuanVideo15Transformer3DModel config (its constructor defaults filled in)."""
    get = lambda key, default: config.get(key) if config.get(key) is not None else default  # noqa: E731
    head_dim = get("attention_head_dim", 128)
    inner = get("num_attention_heads", 16) * head_dim
    return {
        "inner_dim": inner, "in_channels": get("in_channels", 65), "patch_size": get("patch_size", 1),
        "patch_size_t": get("patch_size_t", 1), "out_channels": get("out_channels", 32),
        "attention_head_dim": head_dim, "ffn_dim": int(inner * get("mlp_ratio", 4.0)),
        "num_layers": get("num_layers", 54), "num_refiner_layers": get("num_refiner_layers", 2),
        "text_embed_dim": get("text_embed_dim", 3584), "text_embed_2_dim": get("text_embed_2_dim", 1472),
        "image_embed_dim": get("image_embed_dim", 1152), "use_meanflow": bool(get("use_meanflow", False)),
    }


def is_transformer(tensors: Mapping[str, Any]) -> bool:
    """Whether diffusers-named transformer tensors are HunyuanVideo 1.5's."""
    return "cond_type_embed.weight" in tensors


def is_transformer_config(config: Mapping[str, Any]) -> bool:
    return config.get("_class_name") == "HunyuanVideo15Transformer3DModel" or "text_embed_2_dim" in config
