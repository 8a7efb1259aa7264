"""Key layouts of Wan single files, and the maps between them and diffusers' names.

A Wan transformer file comes in three layouts: the original Wan checkpoint names
(`blocks.0.self_attn.q.weight`, `head.modulation`), the same under ComfyUI's
`model.diffusion_model.` prefix, and diffusers' own names. Original -> diffusers is diffusers'
converter (`convert_wan_transformer_to_diffusers`): a rename of keys, so the tensors it moves are
the file's own views, never copies. The reverse (for writing Comfy-layout files) is a short table
that `original_transformer_names` checks against that converter on every call.

The Wan VAE's original names follow its nn.Sequential indices, which depend on the config (blocks
per stage, 2.1's flat lists or 2.2's nested residual stages), so diffusers' VAE converter only
fits the released 2.1 config. `vae_original_names` derives the map from the diffusers model's own
key set instead, and serves both directions and both VAEs.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from enum import Enum

from ..family import ModelError

COMFY_PREFIX = "model.diffusion_model."


class KeyLayout(str, Enum):
    ORIGINAL = "original"  # Wan's own checkpoint names (Comfy-Org's repackaged files, city96's GGUF)
    PREFIXED = "prefixed"  # the same under ComfyUI's prefix (`model.diffusion_model.`; HunyuanVideo 1.5's saved files: `model.model.`)
    DIFFUSERS = "diffusers"  # diffusers' WanTransformer3DModel / AutoencoderKLWan names


# --- transformer ----------------------------------------------------------------------------------

_TRANSFORMER_MARKERS = {
    KeyLayout.PREFIXED: (COMFY_PREFIX + "head.modulation", COMFY_PREFIX + "patch_embedding.weight"),
    KeyLayout.ORIGINAL: ("head.modulation", "patch_embedding.weight"),
    KeyLayout.DIFFUSERS: ("scale_shift_table", "patch_embedding.weight", "condition_embedder.time_proj.weight"),
}


def transformer_layout(names: Iterable[str]) -> KeyLayout | None:
    """The layout whose marker keys all appear in `names`; None when it is no Wan transformer."""
    names = set(names)
    for layout, markers in _TRANSFORMER_MARKERS.items():
        if all(marker in names for marker in markers):
            return layout
    return None


def transformer_to_diffusers(tensors: Mapping[str, object], layout: KeyLayout) -> dict[str, object]:
    """The same values under diffusers' names (values are moved, not copied)."""
    if layout is KeyLayout.DIFFUSERS:
        return dict(tensors)
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    converted = convert_wan_transformer_to_diffusers(dict(tensors))  # it pops from its argument: give it a copy
    # diffusers 0.42.1's single-file converter has no rule for Wan 2.1 FLF2V's image positions (its
    # conversion script, scripts/convert_wan_to_diffusers.py, has): without this the file would
    # load with `pos_embed` missing. A no-op once diffusers renames it itself.
    if _FLF2V_ORIGINAL in converted:
        converted[_FLF2V_DIFFUSERS] = converted.pop(_FLF2V_ORIGINAL)
    return converted


_FLF2V_ORIGINAL, _FLF2V_DIFFUSERS = "img_emb.emb_pos", "condition_embedder.image_embedder.pos_embed"


# diffusers name fragment -> original, applied in order. Image-embedder norms go before the block
# norms, and norm2/norm3 swap through a placeholder (the original block order is norm1, norm3, norm2).
_TO_ORIGINAL = (
    ("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
    ("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
    ("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
    ("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
    ("condition_embedder.time_proj", "time_projection.1"),
    ("condition_embedder.image_embedder.norm1", "img_emb.proj.0"),
    ("condition_embedder.image_embedder.ff.net.0.proj", "img_emb.proj.1"),
    ("condition_embedder.image_embedder.ff.net.2", "img_emb.proj.3"),
    ("condition_embedder.image_embedder.norm2", "img_emb.proj.4"),
    ("condition_embedder.image_embedder.pos_embed", "img_emb.emb_pos"),
    ("attn2", "cross_attn"), ("attn1", "self_attn"),
    (".add_k_proj.", ".k_img."), (".add_v_proj.", ".v_img."), (".norm_added_k.", ".norm_k_img."),
    (".to_out.0.", ".o."), (".to_q.", ".q."), (".to_k.", ".k."), (".to_v.", ".v."),
    ("ffn.net.0.proj", "ffn.0"), ("ffn.net.2", "ffn.2"),
    ("norm2", "norm__swap"), ("norm3", "norm2"), ("norm__swap", "norm3"),
    ("proj_out", "head.head"),
)


def original_transformer_names(diffusers_names: Iterable[str], prefix: str = "") -> dict[str, str]:
    """diffusers name -> original Wan name (with `prefix`), checked against diffusers' converter."""
    names = list(diffusers_names)
    mapping = {}
    for name in names:
        original = name
        for new, old in _TO_ORIGINAL:
            original = original.replace(new, old)
        original = "head.modulation" if original == "scale_shift_table" else original.replace("scale_shift_table", "modulation")
        mapping[name] = prefix + original
    back = transformer_to_diffusers({original: name for name, original in mapping.items()}, KeyLayout.ORIGINAL)
    wrong = [name for name, original in back.items() if name != original]
    if wrong or len(back) != len(names):
        raise ModelError(f"vidmem's original-name table disagrees with diffusers' converter for {wrong[:3]}; update keys._TO_ORIGINAL.")
    return mapping


# --- VAE ------------------------------------------------------------------------------------------

_RESNET = {"norm1": "residual.0", "conv1": "residual.2", "norm2": "residual.3", "conv2": "residual.6", "conv_shortcut": "shortcut"}
_MIDDLE = {"resnets.0": "middle.0", "attentions.0": "middle.1", "resnets.1": "middle.2"}
_WHOLE = {"quant_conv": "conv1", "post_quant_conv": "conv2", "conv_in": "conv1", "norm_out": "head.0", "conv_out": "head.2"}


def vae_original_names(diffusers_names: Iterable[str]) -> dict[str, str]:
    """diffusers AutoencoderKLWan name -> original Wan VAE name, for 2.1 and 2.2 (residual) VAEs.

    The stage sizes come from the names themselves, so any config maps (the tiny test VAEs too).
    """
    names = list(diffusers_names)
    residual = any(re.match(r"encoder\.down_blocks\.\d+\.resnets\.", n) for n in names)
    resnets = _count(names, r"decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.")
    down_resnets = _count(names, r"encoder\.down_blocks\.(\d+)\.resnets\.(\d+)\.")
    samplers = {int(m.group(1)) for n in names if (m := re.match(r"decoder\.up_blocks\.(\d+)\.upsamplers?\.", n))}
    starts, flat = {}, 0  # 2.1: the decoder's up blocks are one flat nn.Sequential
    for block in sorted(resnets):
        starts[block] = flat
        flat += resnets[block] + (block in samplers)
    mapping = {}
    for name in names:
        original = _vae_name(name, residual, resnets, down_resnets, starts)
        if original is None:
            raise ModelError(f"the Wan VAE parameter '{name}' has no known original name; this VAE config is not supported.")
        mapping[name] = original
    return mapping


def _count(names: list[str], pattern: str) -> dict[int, int]:
    counts: dict[int, int] = {}
    for name in names:
        if match := re.match(pattern, name):
            block, index = int(match.group(1)), int(match.group(2))
            counts[block] = max(counts.get(block, 0), index + 1)
    return counts


def _vae_name(name: str, residual: bool, resnets: dict, down_resnets: dict, starts: dict) -> str | None:
    module, param = name.rsplit(".", 1)
    side, _, rest = module.partition(".")
    if module in _WHOLE:
        return f"{_WHOLE[module]}.{param}"
    if rest in _WHOLE:
        return f"{side}.{_WHOLE[rest]}.{param}"
    if m := re.fullmatch(r"mid_block\.(resnets\.\d|attentions\.0)\.(.+)", rest):
        inner = _resnet_inner(m.group(2)) if m.group(1).startswith("resnets") else m.group(2)
        return f"{side}.{_MIDDLE[m.group(1)]}.{inner}.{param}"
    if residual:  # Wan 2.2: stages nest their blocks; the resampler follows the stage's resnets
        if m := re.fullmatch(r"(down|up)_blocks\.(\d+)\.resnets\.(\d+)\.(.+)", rest):
            kind = m.group(1) + "samples"
            return f"{side}.{kind}.{m.group(2)}.{kind}.{m.group(3)}.{_resnet_inner(m.group(4))}.{param}"
        if m := re.fullmatch(r"(down|up)_blocks\.(\d+)\.(down|up)sampler\.(.+)", rest):
            kind, block = m.group(1) + "samples", int(m.group(2))
            count = (down_resnets if kind == "downsamples" else resnets)[block]
            return f"{side}.{kind}.{block}.{kind}.{count}.{m.group(4)}.{param}"
        return None
    if m := re.fullmatch(r"down_blocks\.(\d+)\.(.+)", rest):  # Wan 2.1 encoder: one flat list
        inner = m.group(2)
        inner = inner if inner.startswith(("resample", "time_conv")) else _resnet_inner(inner)
        return f"{side}.downsamples.{m.group(1)}.{inner}.{param}"
    if m := re.fullmatch(r"up_blocks\.(\d+)\.resnets\.(\d+)\.(.+)", rest):
        return f"{side}.upsamples.{starts[int(m.group(1))] + int(m.group(2))}.{_resnet_inner(m.group(3))}.{param}"
    if m := re.fullmatch(r"up_blocks\.(\d+)\.upsamplers\.0\.(.+)", rest):
        block = int(m.group(1))
        return f"{side}.upsamples.{starts[block] + resnets[block]}.{m.group(2)}.{param}"
    return None


def _resnet_inner(inner: str) -> str:
    head, _, tail = inner.partition(".")
    return _RESNET.get(head, head) + (f".{tail}" if tail else "")


def count_blocks(names, pattern: str) -> int:
    """How many numbered blocks `pattern` (one group: the index) finds among `names`: the highest index + 1."""
    indices = {int(m.group(1)) for name in names if (m := re.match(pattern, name))}
    return max(indices) + 1 if indices else 0
