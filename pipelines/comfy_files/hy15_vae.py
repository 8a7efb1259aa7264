"""HunyuanVideo 1.5's VAE as Comfy-Org ships it (split_files/vae/hunyuanvideo15_vae_fp16.safetensors).

The file is Tencent's own VAE checkpoint, unprefixed, under Tencent's names, which ComfyUI reads
with comfy/ldm/hunyuan_video/vae_refiner.py (its Encoder / Decoder: `down.N.block.M`, `mid.block_1`,
`mid.attn_1.q`, RMS norms' `gamma`, each causal convolution's inner `conv.`). diffusers'
AutoencoderKLHunyuanVideo15 holds the same tensors under other names; its conversion script
(scripts/convert_hunyuan_video1_5_to_diffusers.py, not installed) renames them one by one with no
reshaping, so the mapping is a few name rules, written here once as data and used both ways
(`diffusers_name` reads a file, `original_name` writes one for tests).

The same names come from ComfyUI's Save VAE (with the mid-block time projections ComfyUI builds and
never uses: COMFY_UNUSED, dropped) and, behind a prefix (`vae.`, `first_stage_model.`), from a VAE cut
out of a checkpoint: `find_vae` finds the prefix before the marker, as Wan's VAE branch does.

Told apart from the other VAEs by its tensors: HunyuanVideo's causal convolutions keep an inner
`conv.` (Wan's are Conv3d subclasses: `decoder.conv_in.weight`), and its norms are RMS norms with a
`gamma` (HunyuanVideo 1.0's VAE has GroupNorm `weight`s). ComfyUI tells it the same way
(comfy/sd.py: `decoder.conv_in.conv.weight` with 32 latent channels).
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Mapping

from ..family import ModelError
from . import detect
from .keys import KeyLayout

CLASS_NAME = "AutoencoderKLHunyuanVideo15"
CONV_IN = "decoder.conv_in.conv.weight"  # in both layouts; its input channels are the latent channels
ORIGINAL_MARKER = "decoder.mid.block_1.norm1.gamma"
DIFFUSERS_MARKER = "decoder.mid_block.resnets.0.norm1.gamma"
# ComfyUI's vae_refiner builds its mid-block resnets with ResnetBlock's default temb_channels=512, so
# a VAE saved from ComfyUI (Save VAE writes vae.get_sd()) carries their time-embedding projections
# (512 -> channels), which no forward uses (ComfyUI loads the file with strict=False) and diffusers'
# VAE does not have. Exactly these are dropped: any other stray tensor still refuses the file.
COMFY_UNUSED = frozenset(f"{side}.mid.block_{n}.temb_proj.{w}"
                         for side in ("encoder", "decoder") for n in (1, 2) for w in ("weight", "bias"))

# (Tencent's name, diffusers' name) per rule, in the order they apply (the attention's q/k/v before
# the rest of it); each `{slot}` stands for what `_SLOTS` matches and is carried over, in order.
# Read forward to load a file, backward to write one.
_RULES = (
    ("encoder.down.{n}.block.{n}.", "encoder.down_blocks.{n}.resnets.{n}."),
    ("encoder.down.{n}.downsample.", "encoder.down_blocks.{n}.downsamplers.0."),
    ("decoder.up.{n}.block.{n}.", "decoder.up_blocks.{n}.resnets.{n}."),
    ("decoder.up.{n}.upsample.", "decoder.up_blocks.{n}.upsamplers.0."),
    ("{side}.mid.block_1.", "{side}.mid_block.resnets.0."),
    ("{side}.mid.block_2.", "{side}.mid_block.resnets.1."),
    ("{side}.mid.attn_1.{qkv}.", "{side}.mid_block.attentions.0.to_{qkv}."),
    ("{side}.mid.attn_1.", "{side}.mid_block.attentions.0."),
)
_SLOTS = {"n": r"(\d+)", "side": "(encoder|decoder)", "qkv": "([qkv])"}


def _rule(source: str, target: str) -> tuple[re.Pattern, str]:
    """A name prefix `source` as an anchored pattern, and `target` as its replacement."""
    pieces = re.split(r"\{(\w+)\}", source)
    pattern = "".join(_SLOTS[piece] if i % 2 else re.escape(piece) for i, piece in enumerate(pieces))  # odd: slot names
    groups = iter(range(1, len(pieces)))
    return re.compile("^" + pattern), re.sub(r"\{\w+\}", lambda _: f"\\g<{next(groups)}>", target)


_FORWARD = tuple(_rule(original, diffusers) for original, diffusers in _RULES)
_BACK = tuple(_rule(diffusers, original) for original, diffusers in _RULES)


def _renamed(name: str, rules: tuple[tuple[re.Pattern, str], ...]) -> str:
    for pattern, replacement in rules:
        renamed, count = pattern.subn(replacement, name)
        if count:
            return renamed
    return name


def diffusers_name(name: str) -> str:
    """The diffusers name of a Tencent VAE tensor name (names without a rule are the same in both)."""
    return _renamed(name, _FORWARD)


def original_name(name: str) -> str:
    """The Tencent (Comfy-Org file) name of a diffusers VAE tensor name: `diffusers_name` reversed."""
    return _renamed(name, _BACK)


def find_vae(names: Iterable[str]) -> tuple[str, KeyLayout] | None:
    """(prefix, layout) of a HunyuanVideo 1.5 VAE: the prefix '' (Comfy-Org's file, ComfyUI's Save VAE)
    or what stands before its names (`vae.`, `first_stage_model.`: a VAE cut from a checkpoint); None
    when the names are no HunyuanVideo 1.5 VAE's."""
    names = tuple(names)
    prefix = detect.find_prefix(names, CONV_IN)
    if prefix is None:
        return None
    layout = vae_layout(name[len(prefix):] for name in names if name.startswith(prefix))
    return None if layout is None else (prefix, layout)


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
    """The file's tensors under diffusers' names (the same tensors: renamed, never copied), without
    the projections ComfyUI's own VAE carries unused (COMFY_UNUSED)."""
    if layout is KeyLayout.DIFFUSERS:
        return dict(tensors)
    return {diffusers_name(name): tensor for name, tensor in tensors.items() if name not in COMFY_UNUSED}


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
