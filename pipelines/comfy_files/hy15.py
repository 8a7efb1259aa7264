"""HunyuanVideo 1.5 single files: Comfy-Org's repackaged transformers (and Tencent's own), read by their tensors.

Comfy-Org's files (HunyuanVideo_1.5_repackaged: hunyuanvideo1.5_720p_t2v_fp16.safetensors,
..._480p_i2v_..._fp8_scaled...) hold the transformer under Tencent's original names, unprefixed
(`double_blocks.0.img_mod.linear.weight`, `txt_in.individual_token_refiner.blocks.0.norm1.weight`),
with each double block's image and text attention fused into one `img_attn_qkv` / `txt_attn_qkv`
matrix; Tencent's own checkpoint keeps `img_attn_q/_k/_v` apart. Files saved by ComfyUI itself
(its ModelSave / CheckpointSave) hold its model's names instead (`img_attn.qkv`, `img_mod.lin`,
`img_mlp.0`, `img_attn.norm.query_norm.scale`, `txt_in.t_embedder.in_layer`) under `model.model.`:
ComfyUI's own renaming rules (COMFY_RENAMES, which the LoRA naming in pipelines/lora/names.py uses
too) take them back to Tencent's. Files in diffusers' names are read as they are. An all-in-one
checkpoint (`model.diffusion_model.` beside `vae.` and `text_encoders.`) is refused by name; a
transformer alone under `model.diffusion_model.` (ComfyUI's checkpoint prefix) is read.

diffusers 0.42.1 ships no single-file converter for this model (only the conversion script
scripts/convert_hunyuan_video1_5_to_diffusers.py, not installed), so the mapping is written here
once, as data, from the two model definitions (Tencent's / ComfyUI's and diffusers'
HunyuanVideo15Transformer3DModel): renames, three fused matrices split by rows into q, k, v
(views of the file's mapping, never copies), and the final modulation, which Tencent orders
(shift, scale) and diffusers' AdaLayerNormContinuous (scale, shift): its two halves trade places
(a copy of one small matrix). The reverse (`original_tensors`) writes files in Comfy-Org's and ComfyUI's
layouts for tests and benches; tests/test_comfy_files_hy15.py round-trips a model through both.

What the tensors cannot tell: T2V from I2V, and 480p from 720p. Every HunyuanVideo 1.5
transformer but the super-resolution ones (98 input channels, refused by name) has the image
projection (`vision_in`) and 65 input channels; `task_type` and `target_size` are config values
only (diffusers' model reads neither), so the folder's transformer config decides them. The
step-distilled 480p I2V model has a second time embedder (`time_r_in`, `use_meanflow`), which the
tensors do show.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Iterable, Mapping
from dataclasses import replace
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
SR_IN_CHANNELS = 98  # the super-resolution models (ComfyUI: HunyuanVideo15_SR_Distilled, in_channels 98)
SWAPPED = "final_layer.adaLN_modulation.1"  # (shift, scale) in the file, (scale, shift) in diffusers

# ComfyUI's model names its layers Flux-style (`img_attn.qkv`, `img_mod.lin`, `img_mlp.0`,
# `t_embedder.in_layer`): HunyuanVideo.process_unet_state_dict (comfy/supported_models.py) renames
# Tencent's names with these replace rules, in this order, when it loads a file. Files ComfyUI saves
# (`process_unet_state_dict_for_saving`: SAVED_PREFIX before each name) and LoRAs made for ComfyUI
# use the renamed names; `tencent_name` takes them back. The rules for HunyuanVideo 1.0's single
# blocks (`.q_norm.`, `.modulation.`) match no 1.5 name but are kept: this is ComfyUI's list verbatim.
COMFY_RENAMES = (
    ("txt_in.t_embedder.mlp.0.", "txt_in.t_embedder.in_layer."), ("txt_in.t_embedder.mlp.2.", "txt_in.t_embedder.out_layer."),
    ("txt_in.c_embedder.linear_1.", "txt_in.c_embedder.in_layer."), ("txt_in.c_embedder.linear_2.", "txt_in.c_embedder.out_layer."),
    ("_mod.linear.", "_mod.lin."), ("_attn_qkv.", "_attn.qkv."),
    ("mlp.fc1.", "mlp.0."), ("mlp.fc2.", "mlp.2."),
    ("_attn_q_norm.weight", "_attn.norm.query_norm.scale"), ("_attn_k_norm.weight", "_attn.norm.key_norm.scale"),
    (".q_norm.weight", ".norm.query_norm.scale"), (".k_norm.weight", ".norm.key_norm.scale"),
    ("_attn_proj.", "_attn.proj."),
    (".modulation.linear.", ".modulation.lin."),
    ("_in.mlp.2.", "_in.out_layer."), ("_in.mlp.0.", "_in.in_layer."),
)
SAVED_PREFIX = "model.model."  # ComfyUI's HunyuanVideo.process_unet_state_dict_for_saving
_LEAVES = ("weight", "bias")


def comfy_name(name: str) -> str:
    """Tencent's parameter name as ComfyUI's model names it (its replace rules, run as it runs them)."""
    for old, new in COMFY_RENAMES:
        name = name.replace(old, new)
    return name


def _renamed_in_groups() -> tuple[dict[str, str], ...]:
    """Per group of _GROUPS: ComfyUI's name inside the block -> Tencent's, for every name the table
    maps. Derived by running the rules forward: the rules are substring replaces whose plain reverse
    would also hit names they never produced (`mlp.0.` inside `time_in.mlp.0.`)."""
    found = []
    for source, _, table in _GROUPS:
        block = source.format(0)
        stems = list(table) + [whole for whole, parts in FUSED.items() if all(p in table for p in parts)]
        pairs = {comfy_name(f"{block}{stem}.{leaf}").removeprefix(block): f"{stem}.{leaf}" for stem in stems for leaf in _LEAVES}
        found.append({renamed: tencent for renamed, tencent in pairs.items() if renamed != tencent})
    return tuple(found)


def tencent_name(name: str) -> str:
    """A parameter name in Tencent's layout, whether written so or as ComfyUI's model names it."""
    block, rest, group = _block_of(name, _GROUPS)
    tencent = _RENAMED[_GROUPS.index(group)].get(rest)
    return name if tencent is None else group[0].format(block) + tencent


def diffusers_targets(name: str) -> tuple[str, ...] | None:
    """The diffusers parameter name(s) a Tencent or ComfyUI parameter `name` holds (q, k, v for a
    fused matrix, whose rows they are in that order); None for a name outside the table."""
    stem, dot, leaf = tencent_name(name).rpartition(".")
    if not dot or leaf not in _LEAVES:
        return None
    block, rest, (_, target, table) = _block_of(stem, _GROUPS)
    parts = FUSED.get(rest, (rest,))
    if not all(part in table for part in parts):
        return None
    return tuple(f"{target.format(block)}{table[part]}.{leaf}" for part in parts)


def transformer_layout(names: Iterable[str]) -> KeyLayout | None:
    """ORIGINAL: Comfy-Org's / Tencent's names, unprefixed; PREFIXED: under a prefix (`model.model.`:
    saved by ComfyUI, names as its model has them; `model.diffusion_model.`: ComfyUI's checkpoint
    layout, see `is_all_in_one`); DIFFUSERS: diffusers' own; None: no HunyuanVideo 1.5 transformer
    (see `is_version_1`). The markers are the same in Tencent's and ComfyUI's names."""
    names = set(names)
    if all(marker in names for marker in DIFFUSERS_MARKERS):
        return KeyLayout.DIFFUSERS
    prefix = _prefix(names)
    if prefix is None:
        return None
    return KeyLayout.ORIGINAL if prefix == "" else KeyLayout.PREFIXED


def _prefix(names) -> str | None:
    return next((p for p in ("", SAVED_PREFIX, COMFY_PREFIX) if p + MARKER in names and p + V15_MARKER in names), None)


def is_version_1(names: Iterable[str]) -> bool:
    """ComfyUI's HunyuanVideo key without 1.5's token-type embedding: a HunyuanVideo 1.0 or
    HunyuanImage 2.1 transformer (ComfyUI reads all three as one model class)."""
    names = set(names)
    return any(p + MARKER in names and p + V15_MARKER not in names for p in ("", SAVED_PREFIX, COMFY_PREFIX))


def is_all_in_one(names: Iterable[str]) -> bool:
    """A checkpoint holding the transformer (`model.diffusion_model.`) with its VAE and text encoders."""
    names = set(names)
    return COMFY_PREFIX + MARKER in names and any(n.startswith(("vae.", "text_encoders.")) for n in names)


def transformer_tensors(tensors: Mapping[str, Any], layout: KeyLayout, file_name: str) -> dict[str, Any]:
    """The transformer's tensors under diffusers' names. Renamed and row-split views of the file's
    tensors; only the final modulation (a few MB at full size) is copied. ModelError naming the
    file for a name the table does not know, so nothing is loaded half-mapped."""
    if layout is KeyLayout.DIFFUSERS:
        return dict(tensors)
    prefix = _prefix(set(tensors)) or ""
    out, unknown = {}, []
    for name, tensor in tensors.items():
        targets = diffusers_targets(name[len(prefix):]) if name.startswith(prefix) else None
        if targets is None:
            unknown.append(name)
            continue
        try:
            out.update(zip(targets, _values(name[len(prefix):], tensor, len(targets))))
        except ModelError as error:
            raise ModelError(f"'{file_name}': '{name}' {error}") from None
    if unknown:
        raise ModelError(
            f"'{file_name}' is a HunyuanVideo 1.5 transformer with tensors vidmem's name table does not map "
            f"({', '.join(sorted(unknown)[:5])}{', ...' if len(unknown) > 5 else ''}): a variant vidmem does not read. "
            "Use Comfy-Org's hunyuanvideo1.5_{480p,720p}_{t2v,i2v}*.safetensors, or load the model from its diffusers "
            "folder with transformer_file empty."
        )
    return out


def _values(name: str, tensor, parts: int) -> list:
    if parts > 1:
        return split_rows(tensor, parts)
    return [swap_halves(tensor) if tencent_name(name).rpartition(".")[0] == SWAPPED else tensor]


def _block_of(stem: str, groups) -> tuple[str, str, tuple]:
    """(block index, the stem inside the block, the group) of the first group whose prefix `stem` has."""
    for group in groups:
        pattern = re.escape(group[0]).replace(re.escape("{}"), r"(\d+)")
        m = re.match(pattern, stem) if group[0] else None
        if m:
            return m.group(1), stem[m.end():], group
    return "", stem, groups[-1]


_RENAMED = _renamed_in_groups()


def split_rows(tensor, parts: int) -> list:
    """`tensor` cut into `parts` equal row ranges: views for plain tensors; for stored ones (fp8,
    fp8 scaled, GGUF held row by row) StoredTensor.row_range views of the same data."""
    rows, rest = divmod(tensor.shape[0], parts)
    if rest:
        raise ModelError(f"has {tensor.shape[0]} rows, which do not split into {parts} equal parts: the file is damaged; "
                         "download it again.")
    if not isinstance(tensor, StoredTensor):
        return list(tensor.split(rows, dim=0))
    _check_rows_kept(tensor, f"its {parts} row ranges cannot be taken apart")
    return [tensor.row_range(i * rows, (i + 1) * rows) for i in range(parts)]


def swap_halves(tensor):
    """The two row halves of `tensor` exchanged (a copy): Tencent's (shift, scale) as diffusers' (scale, shift)."""
    if not isinstance(tensor, StoredTensor):
        first, second = tensor.chunk(2, dim=0)
        return torch.cat([second, first], dim=0)
    _check_rows_kept(tensor, "its (shift, scale) halves cannot be swapped into diffusers' (scale, shift)")
    first, second = split_rows(tensor, 2)
    scale = tensor.scale if first.scale is tensor.scale else torch.cat([second.scale, first.scale], dim=0)
    return replace(tensor, data=torch.cat([second.data, first.data], dim=0), scale=scale)  # its other fields (a flag) kept


def _check_rows_kept(tensor: StoredTensor, what: str) -> None:
    if tensor.data.shape[0] != tensor.shape[0]:
        raise ModelError(f"is stored as {tensor!r}, flattened before quantizing, so {what}; use an fp16/bf16 or fp8 "
                         "file, or a GGUF file that keeps its matrices' rows.")


# --- the reverse, for writing files in Comfy-Org's and ComfyUI's layouts ---------------------------

def original_tensors(tensors: Mapping[str, torch.Tensor], layout: KeyLayout = KeyLayout.ORIGINAL) -> dict[str, torch.Tensor]:
    """Plain diffusers-named transformer tensors under Comfy-Org's names (ORIGINAL), or as ComfyUI
    saves them (PREFIXED: its model's names under `model.model.`): q, k and v fused by rows (Comfy-Org
    fuses the double blocks' attention, every release the refiner's), the final modulation's halves
    back in Tencent's order (copies)."""
    reverse = tuple((target, source, {new: old for old, new in table.items()}) for source, target, table in _GROUPS)
    out, fused = {}, {}
    for name, tensor in tensors.items():
        stem, _, leaf = name.rpartition(".")
        block, rest, (source, target, table) = _block_of(stem, reverse)
        if rest not in table:
            raise ModelError(f"'{name}' has no HunyuanVideo 1.5 original name; update pipelines/comfy_files/hy15.py.")
        original, base = table[rest], target.format(block)
        whole = next((f for f, parts in FUSED.items() if original in parts), None)
        if whole is not None:
            fused.setdefault(f"{base}{whole}.{leaf}", {})[FUSED[whole].index(original)] = tensor
        else:
            out[f"{base}{original}.{leaf}"] = swap_halves(tensor) if base + original == SWAPPED else tensor
    for name, parts in fused.items():
        out[name] = torch.cat([parts[i] for i in range(3)], dim=0)
    if layout is KeyLayout.PREFIXED:
        return {SAVED_PREFIX + comfy_name(name): tensor for name, tensor in out.items()}
    return out


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
    """The same fields from a HunyuanVideo15Transformer3DModel config, its constructor's defaults
    (read from diffusers, not restated) filling what the config leaves out."""
    config = {**_constructor_defaults(), **{key: value for key, value in config.items() if value is not None}}
    head_dim = config["attention_head_dim"]
    inner = config["num_attention_heads"] * head_dim
    return {
        "inner_dim": inner, "in_channels": config["in_channels"], "patch_size": config["patch_size"],
        "patch_size_t": config["patch_size_t"], "out_channels": config["out_channels"],
        "attention_head_dim": head_dim, "ffn_dim": int(inner * config["mlp_ratio"]),
        "num_layers": config["num_layers"], "num_refiner_layers": config["num_refiner_layers"],
        "text_embed_dim": config["text_embed_dim"], "text_embed_2_dim": config["text_embed_2_dim"],
        "image_embed_dim": config["image_embed_dim"], "use_meanflow": bool(config["use_meanflow"]),
    }


@functools.cache
def _constructor_defaults() -> dict[str, Any]:
    from diffusers import HunyuanVideo15Transformer3DModel

    parameters = inspect.signature(HunyuanVideo15Transformer3DModel.__init__).parameters.values()
    return {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}


# What a file's name may claim that its tensors cannot show: (word in the name, config key, its value).
_NAME_CLAIMS = (("t2v", "task_type", "t2v"), ("i2v", "task_type", "i2v"), ("480p", "target_size", 640), ("720p", "target_size", 960))


def name_disagreements(file_name: str, config: Mapping[str, Any]) -> list[str]:
    """What `file_name` says (t2v / i2v, 480p / 720p) that the folder's transformer `config`
    contradicts. The tensors have the same shapes either way, so this is worth a warning, not a
    refusal: the folder's config decides, and a renamed file may be right."""
    words = set(re.split(r"[^a-z0-9]+", file_name.lower()))
    return [f"its name says {word}, the folder's {key} is {config[key]!r}"
            for word, key, value in _NAME_CLAIMS if word in words and key in config and config[key] != value]


def is_transformer(tensors: Mapping[str, Any]) -> bool:
    """Whether diffusers-named transformer tensors are HunyuanVideo 1.5's."""
    return "cond_type_embed.weight" in tensors


def is_transformer_config(config: Mapping[str, Any]) -> bool:
    return config.get("_class_name") == "HunyuanVideo15Transformer3DModel" or "text_embed_2_dim" in config
