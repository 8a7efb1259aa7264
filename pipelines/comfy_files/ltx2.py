"""LTX-2 single files: Lightricks' and Comfy-Org's checkpoints for ComfyUI, read by their tensors.

An LTX-2 checkpoint holds up to four parts under one prefix each, all in one file
(ltx-2-19b-dev*.safetensors) or the transformer alone (Comfy-Org's transformer-only files):

    model.diffusion_model.*        the audio-video transformer (and the text connectors, which
                                   diffusers keeps apart: they come from the diffusers folder)
    vae.*                          the video VAE
    audio_vae.*                    the audio VAE (a video-only run never loads it)
    vocoder.*, text_embedding_projection.*   not read by vidmem

Key mapping is diffusers' own (`convert_ltx2_transformer_to_diffusers`, `convert_ltx2_vae_to_diffusers`,
`convert_ltx2_audio_vae_to_diffusers`: renames, so the tensors stay the file's mapped views). The
reverse, for writing files in the same layout (tests, benches), is a short table per part that
`original_names` checks against those converters on every call: a wrong entry fails there.

Those converters are LTX-2.0's; LTX-2.3 checkpoints carry tensors they do not map (gated attention,
prompt modulation), so such a file is refused with its name and the way round rather than loaded
half-mapped.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from ..family import ModelError
from .keys import KeyLayout, count_blocks

TRANSFORMER_PREFIX, VAE_PREFIX, AUDIO_VAE_PREFIX = "model.diffusion_model.", "vae.", "audio_vae."
PARTS = {"transformer": TRANSFORMER_PREFIX, "vae": VAE_PREFIX, "audio_vae": AUDIO_VAE_PREFIX}

# A name each part always has (diffusers' own detection keys for "ltx2", CHECKPOINT_KEY_NAMES).
TRANSFORMER_MARKER = TRANSFORMER_PREFIX + "av_ca_a2v_gate_adaln_single.emb.timestep_embedder.linear_1.weight"
VAE_MARKER = VAE_PREFIX + "per_channel_statistics.mean-of-means"
AUDIO_VAE_MARKER = AUDIO_VAE_PREFIX + "per_channel_statistics.mean-of-means"
# Fragments only LTX-2.3 transformers have (diffusers: gated attention, prompt modulation), which
# the LTX-2.0 converter leaves unmapped.
NEWER_VARIANT_FRAGMENTS = ("to_gate_logits", "prompt_adaln", "prompt_scale_shift_table")


# A transformer saved alone may lack the prefix (the original names), or carry diffusers' names.
_UNPREFIXED_MARKER = TRANSFORMER_MARKER.removeprefix(TRANSFORMER_PREFIX)
_DIFFUSERS_MARKER = "av_cross_attn_video_a2v_gate.emb.timestep_embedder.linear_1.weight"


def is_ltx2(names: Iterable[str]) -> bool:
    """Whether the names are an LTX-2 checkpoint's (its transformer in any layout, or a VAE-only file's video VAE)."""
    names = set(names)
    return transformer_layout(names) is not None or VAE_MARKER in names


def transformer_layout(names: Iterable[str]) -> KeyLayout | None:
    """PREFIXED: Lightricks' checkpoint names; ORIGINAL: the same without `model.diffusion_model.`;
    DIFFUSERS: diffusers' own; None: no LTX-2 transformer."""
    names = set(names)
    markers = {KeyLayout.PREFIXED: TRANSFORMER_MARKER, KeyLayout.ORIGINAL: _UNPREFIXED_MARKER,
               KeyLayout.DIFFUSERS: _DIFFUSERS_MARKER}
    return next((layout for layout, marker in markers.items() if marker in names), None)


def transformer_tensors(tensors: Mapping[str, Any], layout: KeyLayout) -> dict[str, Any]:
    """The transformer's tensors under diffusers' names, from a file in `layout` (renamed, never copied)."""
    if layout is KeyLayout.DIFFUSERS:
        return dict(tensors)
    if layout is KeyLayout.ORIGINAL:  # a transformer-only file: every name is the transformer's
        tensors = {TRANSFORMER_PREFIX + name: t for name, t in tensors.items()}
    return part_tensors(tensors, "transformer")


def parts_in(names: Iterable[str]) -> tuple[str, ...]:
    """The parts ("transformer", "vae", "audio_vae") the file holds, in that order."""
    names = set(names)
    markers = {"vae": VAE_MARKER, "audio_vae": AUDIO_VAE_MARKER}
    found = tuple(part for part, marker in markers.items() if marker in names)
    return ("transformer",) + found if transformer_layout(names) is not None else found


def check_variant(tensors: Mapping[str, Any], file_name: str) -> None:
    """Refuse an LTX-2.3 (or any later) transformer: diffusers 0.42.1 maps only LTX-2.0's names.
    Told by its names and, should they be renamed, by its shapes: LTX-2.3 modulates the prompt
    too, so its timestep embedding makes 9 parameters per channel where LTX-2.0's makes 6."""
    newer = sorted({f"{fragment} tensors" for name in tensors if not name.startswith(("vae.", "audio_vae.", "vocoder."))
                    for fragment in NEWER_VARIANT_FRAGMENTS if fragment in name})
    modulation = _either(tensors, "adaln_single.linear.weight", "time_embed.linear.weight")
    width = _either(tensors, "patchify_proj.weight", "proj_in.weight")
    if modulation is not None and width is not None and modulation.shape[0] != 6 * width.shape[0]:
        newer.append(f"{modulation.shape[0] // width.shape[0]} modulation parameters per channel, not 6")
    if newer:
        raise ModelError(
            f"'{file_name}' is an LTX-2.3 (or newer) checkpoint (it has {', '.join(newer)}), and vidmem reads "
            "LTX-2.0 single files only (diffusers' converter maps LTX-2.0 names). Load that model from its diffusers "
            "folder with transformer_file empty, or use an LTX-2.0 file (ltx-2-19b-dev*.safetensors)."
        )


def _either(tensors: Mapping[str, Any], original: str, diffusers_name: str):
    """A transformer tensor by its checkpoint name (prefixed or not) or its diffusers name."""
    for name in (TRANSFORMER_PREFIX + original, original, diffusers_name):
        if name in tensors:
            return tensors[name]
    return None


def part_tensors(tensors: Mapping[str, Any], part: str) -> dict[str, Any]:
    """One part's tensors under diffusers' names (renamed, never copied)."""
    from diffusers.loaders.single_file_utils import (
        convert_ltx2_audio_vae_to_diffusers,
        convert_ltx2_transformer_to_diffusers,
        convert_ltx2_vae_to_diffusers,
    )

    convert = {"transformer": convert_ltx2_transformer_to_diffusers, "vae": convert_ltx2_vae_to_diffusers,
               "audio_vae": convert_ltx2_audio_vae_to_diffusers}[part]
    prefix = PARTS[part]
    # The converters pop from their argument and rename every key they are given: only this part's.
    return convert({name: t for name, t in tensors.items() if name.startswith(prefix)})


# --- the reverse, for writing files in the checkpoint layout --------------------------------------

# diffusers fragment -> original, applied in order (each is the inverse of one converter rule).
_TRANSFORMER_TO_ORIGINAL = (
    ("video_a2v_cross_attn_scale_shift_table", "scale_shift_table_a2v_ca_video"),
    ("audio_a2v_cross_attn_scale_shift_table", "scale_shift_table_a2v_ca_audio"),
    ("av_cross_attn_video_scale_shift", "av_ca_video_scale_shift_adaln_single"),
    ("av_cross_attn_video_a2v_gate", "av_ca_a2v_gate_adaln_single"),
    ("av_cross_attn_audio_scale_shift", "av_ca_audio_scale_shift_adaln_single"),
    ("av_cross_attn_audio_v2a_gate", "av_ca_v2a_gate_adaln_single"),
    ("proj_in", "patchify_proj"),  # audio_proj_in -> audio_patchify_proj as well
    ("norm_q", "q_norm"), ("norm_k", "k_norm"),
)
_TIME_EMBEDS = (("time_embed.", "adaln_single."), ("audio_time_embed.", "audio_adaln_single."))
_VAE_STATISTICS = (("latents_mean", "per_channel_statistics.mean-of-means"),
                   ("latents_std", "per_channel_statistics.std-of-means"))


def original_names(part: str, diffusers_names: Iterable[str]) -> dict[str, str]:
    """diffusers name -> checkpoint name (with the part's prefix), checked against diffusers' converter."""
    names = list(diffusers_names)
    rename = {"transformer": _transformer_original, "vae": _vae_original, "audio_vae": _audio_vae_original}[part]
    mapping = {name: PARTS[part] + rename(name) for name in names}
    back = part_tensors({original: name for name, original in mapping.items()}, part)
    wrong = [name for name, value in back.items() if name != value]
    if wrong or len(back) != len(names):
        raise ModelError(f"vidmem's LTX-2 {part} name table disagrees with diffusers' converter for {wrong[:3]}; "
                         "update pipelines/comfy_files/ltx2.py.")
    return mapping


def _transformer_original(name: str) -> str:
    for new, old in _TIME_EMBEDS:
        if name.startswith(new):
            return old + name[len(new):]
    for new, old in _TRANSFORMER_TO_ORIGINAL:
        name = name.replace(new, old)
    return name


def _vae_original(name: str) -> str:
    """The checkpoint's flat block lists: encoder stage i is down_blocks.2i and its downsampler
    2i+1, then the mid block; the decoder starts with its mid block, then upsampler and stage."""
    for new, old in _VAE_STATISTICS:
        if name == new:
            return old
    side, _, rest = name.partition(".")
    stages = 4  # the converter's table is for the released VAE: four encoder stages, three decoder stages
    if m := re.fullmatch(r"down_blocks\.(\d+)\.downsamplers\.0\.(.+)", rest):
        rest = f"down_blocks.{2 * int(m.group(1)) + 1}.{m.group(2)}"
    elif m := re.fullmatch(r"down_blocks\.(\d+)\.(.+)", rest):
        rest = f"down_blocks.{2 * int(m.group(1))}.{m.group(2)}"
    elif m := re.fullmatch(r"up_blocks\.(\d+)\.upsamplers\.0\.(.+)", rest):
        rest = f"up_blocks.{2 * int(m.group(1)) + 1}.{m.group(2)}"
    elif m := re.fullmatch(r"up_blocks\.(\d+)\.(.+)", rest):
        rest = f"up_blocks.{2 * int(m.group(1)) + 2}.{m.group(2)}"
    elif rest.startswith("mid_block."):
        rest = (f"down_blocks.{2 * stages}." if side == "encoder" else "up_blocks.0.") + rest[len("mid_block."):]
    return f"{side}.{rest.replace('resnets', 'res_blocks')}"


def _audio_vae_original(name: str) -> str:
    return dict(_VAE_STATISTICS).get(name, name)


# --- what the shapes fix --------------------------------------------------------------------------

def transformer_fields(t: Mapping[str, Any]) -> dict[str, Any]:
    """LTX2VideoTransformer3DModel config fields fixed by the tensors (diffusers names)."""
    proj_in, audio_in = t["proj_in.weight"].shape, t["audio_proj_in.weight"].shape
    caption = t.get("caption_projection.linear_1.weight")
    return {
        "inner_dim": proj_in[0], "in_channels": proj_in[1],
        "out_channels": t["proj_out.weight"].shape[0],
        "audio_inner_dim": audio_in[0], "audio_in_channels": audio_in[1],
        "audio_out_channels": t["audio_proj_out.weight"].shape[0],
        "num_layers": count_blocks(t, r"transformer_blocks\.(\d+)\."),
        "cross_attention_dim": t["transformer_blocks.0.attn2.to_k.weight"].shape[1],
        "caption_channels": None if caption is None else caption.shape[1],
    }


def transformer_config_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """The same fields from an LTX2VideoTransformer3DModel config (its constructor defaults filled in)."""
    get = lambda key, default: config.get(key, default) if config.get(key) is not None else default  # noqa: E731
    in_channels, audio_in = get("in_channels", 128), get("audio_in_channels", 128)
    return {  # proj_in / proj_out take the latent channels as they are (patch size 1 in every release)
        "inner_dim": get("num_attention_heads", 32) * get("attention_head_dim", 128), "in_channels": in_channels,
        "out_channels": get("out_channels", in_channels),
        "audio_inner_dim": get("audio_num_attention_heads", 32) * get("audio_attention_head_dim", 64),
        "audio_in_channels": audio_in, "audio_out_channels": get("audio_out_channels", audio_in),
        "num_layers": get("num_layers", 48), "cross_attention_dim": get("cross_attention_dim", 4096),
        "caption_channels": get("caption_channels", 3840) if get("use_prompt_embeddings", True) else None,
    }


def is_transformer(tensors: Mapping[str, Any]) -> bool:
    """Whether diffusers-named transformer tensors are LTX-2's (it has an audio branch; Wan has none)."""
    return "audio_proj_in.weight" in tensors


def is_transformer_config(config: Mapping[str, Any]) -> bool:
    return "audio_in_channels" in config or config.get("_class_name") == "LTX2VideoTransformer3DModel"
