"""HunyuanVideo 1.5's VAE as Comfy-Org ships it (split_files/vae/hunyuanvideo15_vae_fp16.safetensors).

The file is Tencent's own VAE checkpoint, unprefixed, under Tencent's names, which ComfyUI reads
with comfy/ldm/hunyuan_video/vae_refiner.py (its Encoder / Decoder: `down.N.block.M`, `mid.block_1`,
`mid.attn_1.q`, RMS norms' `gamma`, each causal convolution's inner `conv.`). diffusers'
AutoencoderKLHunyuanVideo15 holds the same tensors under other names; its conversion script
(scripts/convert_hunyuan_video1_5_to_diffusers.py, not installed) renames them one by one with no
reshaping, so the mapping is a few name rules, written here once as data and used both ways
(`diffusers_name` reads a file, `original_name` writes one for tests).

Told apart from the other VAEs by its tensors: HunyuanVideo's causal convolutions keep an inner
`conv.` (Wan's are Conv3d subclasses: `decoder.conv_in.weight`), and its norms are RMS norms with a
`gamma` (HunyuanVideo 1.0's VAE has GroupNorm `weight`s). ComfyUI tells it the same way
(comfy/sd.py: `decoder.conv_in.conv.weight` with 32 latent channels).
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Mapping

from ..family import ModelError
from .keys import KeyLayout

CLASS_NAME = "AutoencoderKLHunyuanVideo15"
CONV_IN = "decoder.conv_in.conv.weight"  # in both layouts; its input channels are the latent channels
ORIGINAL_MARKER = "decoder.mid.block_1.norm1.gamma"
DIFFUSERS_MARKER = "decoder.mid_block.resnets.0.norm1.gamma"

# (Tencent's pattern, diffusers' replacement), in the order they apply (the attention's q/k/v before
# the rest of it); `_BACK` below is the same table read the other way.
_RULES = (
    (r"^encoder\.down\.(\d+)\.block\.(\d+)\.", r"encoder.down_blocks.\1.resnets.\2."),
    (r"^encoder\.down\.(\d+)\.downsample\.", r"encoder.down_blocks.\1.downsamplers.0."),
    (r"^decoder\.up\.(\d+)\.block\.(\d+)\.", r"decoder.up_blocks.\1.resnets.\2."),
    (r"^decoder\.up\.(\d+)\.upsample\.", r"decoder.up_blocks.\1.upsamplers.0."),
    (r"^(encoder|decoder)\.mid\.block_1\.", r"\1.mid_block.resnets.0."),
    (r"^(encoder|decoder)\.mid\.block_2\.", r"\1.mid_block.resnets.1."),
    (r"^(encoder|decoder)\.mid\.attn_1\.([qkv])\.", r"\1.mid_block.attentions.0.to_\2."),
    (r"^(encoder|decoder)\.mid\.attn_1\.", r"\1.mid_block.attentions.0."),
)


def diffusers_name(name: str) -> str:
    """The diffusers name of a Tencent VAE tensor name (names without a rule are the same in both)."""
    for original, diffusers in _RULES:
        renamed, count = re.subn(original, diffusers, name)
        if count:
            return renamed
    return name


def original_name(name: str) -> str:
    """The Tencent (Comfy-Org file) name of a diffusers VAE tensor name: `diffusers_name` reversed."""
    for original, diffusers in _BACK:
        renamed, count = re.subn(original, diffusers, name)
        if count:
            return renamed
    return name


# The table read the other way: diffusers' side as patterns, Tencent's as replacements.
_BACK = (
    (r"^encoder\.down_blocks\.(\d+)\.resnets\.(\d+)\.", r"encoder.down.\1.block.\2."),
    (r"^encoder\.down_blocks\.(\d+)\.downsamplers\.0\.", r"encoder.down.\1.downsample."),
    (r"^decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.", r"decoder.up.\1.block.\2."),
    (r"^decoder\.up_blocks\.(\d+)\.upsamplers\.0\.", r"decoder.up.\1.upsample."),
    (r"^(encoder|decoder)\.mid_block\.resnets\.0\.", r"\1.mid.block_1."),
    (r"^(encoder|decoder)\.mid_block\.resnets\.1\.", r"\1.mid.block_2."),
    (r"^(encoder|decoder)\.mid_block\.attentions\.0\.to_([qkv])\.", r"\1.mid.attn_1.\2."),
    (r"^(encoder|decoder)\.mid_block\.attentions\.0\.", r"\1.mid.attn_1."),
)


def vae_layout(names: Iterable[str]) -> KeyLayout | None:
    """ORIGINAL (Comfy-Org's / Tencent's names) or DIFFUSERS for a HunyuanVideo 1.5 VAE; None otherwise."""
    names = set(names)
    if CONV_IN not in names:
        return None
    if ORIGINAL_MARKER in names:
        return KeyLayout.ORIGINAL
    if DIFFUSERS_MARKER in names:
        return KeyLayout.DIFFUSERS
    return None


def vae_tensors(tensors: Mapping[str, Any], layout: KeyLayout) -> dict[str, Any]:
    """The file's tensors under diffusers' names (the same tensors: renamed, never copied)."""
    if layout is KeyLayout.DIFFUSERS:
        return dict(tensors)
    return {diffusers_name(name): tensor for name, tensor in tensors.items()}


def original_tensors(tensors: Mapping[str, Any]) -> dict[str, Any]:
    """diffusers-named VAE tensors under Comfy-Org's file names (for writing test files)."""
    return {original_name(name): tensor for name, tensor in tensors.items()}


def is_vae(tensors: Iterable[str]) -> bool:
    """Whether diffusers-named VAE tensors are HunyuanVideo 1.5's."""
    return CONV_IN in tensors


def vae_fields(t: Mapping[str, Any]) -> dict[str, Any]:
    """AutoencoderKLHunyuanVideo15 config fields fixed by the tensors (diffusers names)."""
    stages = sorted({int(m.group(1)) for name in t if (m := re.match(r"encoder\.down_blocks\.(\d+)\.", name))})
    resnets = {int(m.group(1)) for name in t if (m := re.match(r"encoder\.down_blocks\.0\.resnets\.(\d+)\.", name))}
    return {
        "latent_channels": t[CONV_IN].shape[1],
        "in_channels": t["encoder.conv_in.conv.weight"].shape[1],
        "block_out_channels": [t[f"encoder.down_blocks.{i}.resnets.0.conv1.conv.weight"].shape[0] for i in stages],
        "layers_per_block": len(resnets),
    }


def vae_config_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """The same fields from an AutoencoderKLHunyuanVideo15 config (diffusers' defaults filled in)."""
    return {
        "latent_channels": config.get("latent_channels", 32),
        "in_channels": config.get("in_channels", 3),
        "block_out_channels": list(config.get("block_out_channels", (128, 256, 512, 1024, 1024))),
        "layers_per_block": config.get("layers_per_block", 2),
    }


def check_names(tensors: Mapping[str, Any], source: str) -> None:
    """A name the rules left in Tencent's form means another model's VAE under HunyuanVideo's names
    (`source`: the input and file, for the message)."""
    left = [name for name in tensors if re.match(r"^(encoder|decoder)\.(down|up|mid)\.", name)]
    if left:
        raise ModelError(f"{source} has VAE tensors vidmem cannot place (e.g. '{left[0]}'); it is not "
                         "HunyuanVideo 1.5's VAE: use Comfy-Org's hunyuanvideo15_vae_fp16.safetensors.")
