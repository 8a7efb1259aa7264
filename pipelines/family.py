"""What the engine needs to know about a model family, declared as data.

A `FamilySpec` says which diffusers pipeline classes belong to the family, where the
transformer blocks are, which components encode the conditioning, the frame-count rule, and how
to turn the pipeline's raw latents into the `LATENT` we hand to ComfyUI and back into what its
VAE decodes. The sampler and decoder never branch on the family; they read these fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


class ModelError(ValueError):
    """The model or a request for it is invalid; the message names the input and the fix."""


def _first_frame_only(pipe, last_image_given: bool) -> str | None:
    return "it conditions on a first frame only" if last_image_given else None


@dataclass(frozen=True)
class SamplerDefaults:
    """How a family samples, as data: which schedulers besides the model's own make sense, whether
    `shift` applies (flow matching), and the settings its authors recommend (tooltips, templates)."""

    flow_matching: bool = False  # the model predicts a flow: `shift` (the scheduler's flow_shift) applies
    schedulers: tuple[str, ...] = ()  # offered besides "default" (pipelines/schedulers.py names)
    # (minimum pixels per frame, shift) pairs, largest first: the authors' shift for that size
    recommended_shift: tuple[tuple[int, float], ...] = ()
    cfg: float = 6.0
    steps: int = 50

    def shift_for(self, width: int, height: int) -> float | None:
        """The recommended shift at this size (Wan: 5.0 from 720p up, 3.0 below), or None."""
        return next((shift for pixels, shift in self.recommended_shift if width * height >= pixels), None)


@dataclass(frozen=True)
class FamilySpec:
    name: str
    pipeline_classes: tuple[str, ...]  # model_index.json `_class_name` values we run
    image_conditioned: tuple[str, ...]  # the subset that needs an input image (I2V)
    denoisers: tuple[str, ...]  # components that run per step, in the order they may run
    blocks_attr: str  # the ModuleList of transformer blocks on each denoiser
    encoders: tuple[str, ...]  # components that only encode conditioning (placed like the text encoder)
    frame_step: int  # frames must be frame_step * k + 1
    to_comfy_latent: Callable[[object, torch.Tensor, int], torch.Tensor]  # (pipe, raw, frames) -> [B,C,T,h,w]
    to_vae_latent: Callable[[object, torch.Tensor], torch.Tensor]  # (pipe, [B,C,T,h,w]) -> VAE input
    max_sequence_length: int  # prompt tokens, as the pipeline's __call__ uses by default
    single_file_transformer: str | None  # diffusers class with from_single_file, if the family has one
    image_variant: Callable[[object], str | None] = lambda pipe: None  # I2V class for a T2V folder, if any
    # (image-to-video pipe, whether a last_image was given) -> why this model cannot run that way
    # (first-last-frame on a model not trained for it, or a model that needs a last frame without
    # one), or None. The default: no model of the family takes a last frame.
    last_frame_error: Callable[[object, bool], str | None] = _first_frame_only
    # (vae) -> the VAE's decode in stages: `context` (frame-wide layers run once on the whole
    # latent, or None), `stream()` (a decode that carries its causal caches across a tile's frame
    # chunks) and `frame_batch`; or None to decode every piece with `vae.decode`
    vae_stages: Callable[[object], object | None] = lambda vae: None
    sampler: SamplerDefaults = SamplerDefaults()
    # (denoiser config) -> the patch positions per axis its positional embedding covers, or None for
    # no limit (Wan's rotary table has rope_max_seq_len rows and CogVideoX 1.5 slices a fixed table:
    # beyond them diffusers fails mid-run with a bare shape error, so the size is refused by name
    # first: positions_error)
    max_positions: Callable[[object], "PositionLimits | None"] = lambda config: None
    # A mixin the loader puts in front of the diffusers class when the family's pipeline does not
    # take what the sampler passes (packed `prompt_embeds`, `guidance_scale`, `callback_on_step_end`;
    # see pipelines/hunyuan_video15.py). It may define `vidmem_encode_prompt(text, device) -> [1, L, D]`,
    # which pipelines/prompts.py then calls instead of the T5 families' `encode_prompt`.
    call_adapter: type | None = None
    # The denoiser's attention passes a mask (the text's padding), read from diffusers 0.42.1's
    # processors: LTX-2's cross-attention and HunyuanVideo 1.5's joint attention and token refiner
    # do; Wan's and CogVideoX's blocks do not. Kernels that take no mask (pipelines/attention.py
    # MASKLESS) are refused on these before anything moves.
    attention_masked: bool = False
    # cfg runs as one batch of two through the denoiser (CogVideoX), not as two passes (Wan,
    # HunyuanVideo 1.5): the planner counts forward passes and activations from it.
    cfg_as_batch: bool = False
    # Components the folder may have that a run never uses, so the loader neither checks nor loads
    # them (LTX-2's audio VAE and vocoder for video only); the call adapter copes with their absence.
    unloaded: tuple[str, ...] = ()
    # Encoders (of `encoders`) the pipeline's call runs before its first step, every run (LTX-2's
    # text connectors over the cached prompt): the planner traces them in the denoise stage.
    call_encoders: tuple[str, ...] = ()
    # The smallest decode tile (output px) that sees enough of the frame for this VAE; a tiling left
    # at its defaults is raised to it, a smaller one chosen by the user warns (memory.strategy.family_tiling).
    min_decode_tile: int = 0

    def frames_error(self, frames: int) -> str | None:
        if frames >= 1 and (frames - 1) % self.frame_step == 0:
            return None
        below = max(1, (frames - 1) // self.frame_step * self.frame_step + 1)
        return (
            f"frames={frames} is not valid for {self.name}: use {self.frame_step}k+1 frames "
            f"(e.g. {below} or {below + self.frame_step})."
        )


@dataclass(frozen=True)
class PositionLimits:
    """The patch positions a denoiser's positional embedding covers per axis (None: no limit there)."""

    height: int | None
    width: int | None
    frames: int | None

    @classmethod
    def every_axis(cls, positions: int) -> "PositionLimits":
        return cls(positions, positions, positions)


def positions_error(spec: FamilySpec, config, spatial_factor: int, temporal_factor: int, model: str,
                    width: int, height: int, frames: int) -> str | None:
    """Why the denoiser (its `config`) cannot place a width x height x frames video, naming the
    input and the largest value it takes; None when it can. Config only: no weights are read."""
    limits = spec.max_positions(config)
    if limits is None:
        return None
    patch = config.get("patch_size", (1, 2, 2))
    patch_t, patch_h, patch_w = patch if isinstance(patch, (list, tuple)) else (1, patch, patch)
    for label, value, per_position, limit in (("width", width, spatial_factor * patch_w, limits.width),
                                              ("height", height, spatial_factor * patch_h, limits.height)):
        if limit and value // per_position > limit:
            return (f"{label}={value} is more than {model} can place: its positional embedding covers {limit} "
                    f"patches of {per_position} px ({limit * per_position} px); use {label} {limit * per_position} or less.")
    if limits.frames and ((frames - 1) // temporal_factor + 1) // patch_t > limits.frames:
        most = (limits.frames * patch_t - 1) * temporal_factor + 1
        return (f"frames={frames} is more than {model} can place: its positional embedding covers {limits.frames} "
                f"latent frames; use frames {most} or less.")
    return None




def first_denoiser(pipe) -> torch.nn.Module:
    """The denoiser whose config describes the model (Wan 2.2 A14B's experts share one layout)."""
    return pipe.transformer if pipe.transformer is not None else pipe.transformer_2


def spatial_multiple(pipe) -> int:
    """Width and height must be multiples of VAE factor x transformer patch size."""
    patch = first_denoiser(pipe).config.patch_size
    patch = patch[-1] if isinstance(patch, (tuple, list)) else patch
    return pipe.vae_scale_factor_spatial * patch


def denoisers(pipe, spec: FamilySpec) -> dict[str, torch.nn.Module]:
    """The pipeline's denoisers by name (Wan 2.2 A14B: both experts), those it has."""
    return {name: getattr(pipe, name) for name in spec.denoisers if getattr(pipe, name, None) is not None}


def denoiser_blocks(pipe, spec: FamilySpec) -> dict[str, torch.nn.ModuleList]:
    return {
        name: getattr(getattr(pipe, name), spec.blocks_attr)
        for name in spec.denoisers
        if getattr(pipe, name, None) is not None
    }
