"""CogVideoX (2b, 5b, 1.5; T2V and I2V) declared for the engine.

The pipeline returns latents as [B, T, C, h, w] scaled by the VAE's scaling factor, and for
CogVideoX 1.5 with leading padding frames so T is a multiple of the transformer's temporal patch.
Our LATENT is [B, C, T, h, w] without the padding: exactly what the VAE decodes, times the scale.
"""

from __future__ import annotations

import torch

from .cogvideox_vae import cogvideox_stream
from .family import FamilySpec, PositionLimits, SamplerDefaults


def _padding_frames(pipe, frames: int) -> int:
    latent_frames = (frames - 1) // pipe.vae_scale_factor_temporal + 1
    patch_t = pipe.transformer.config.patch_size_t
    return (-latent_frames) % patch_t if patch_t else 0


def _to_comfy_latent(pipe, raw: torch.Tensor, frames: int) -> torch.Tensor:
    return raw[:, _padding_frames(pipe, frames) :].permute(0, 2, 1, 3, 4).contiguous()


def _positions(config) -> PositionLimits | None:
    """CogVideoX 1.5 (temporal patches, rotary embedding) slices its rotary table, sample_height x sample_width
    latent pixels, and cannot grow it (diffusers' get_3d_rotary_pos_embed, grid_type 'slice'): beyond it the run
    fails mid-way with a bare tensor size mismatch. CogVideoX 1.0 crops its grid to any size; time is not sliced."""
    if not (config.get("use_rotary_positional_embeddings") and config.get("patch_size_t")):
        return None
    patch = config["patch_size"]
    return PositionLimits(config["sample_height"] // patch, config["sample_width"] // patch, None)


def _to_vae_latent(pipe, latent: torch.Tensor) -> torch.Tensor:
    # Same op order as CogVideoXPipeline.decode_latents, so frames match it bit for bit.
    return 1 / pipe.vae.config.scaling_factor * latent


COGVIDEOX = FamilySpec(
    name="cogvideox",
    pipeline_classes=("CogVideoXPipeline", "CogVideoXImageToVideoPipeline"),
    image_conditioned=("CogVideoXImageToVideoPipeline",),
    denoisers=("transformer",),
    blocks_attr="transformer_blocks",
    encoders=("text_encoder",),
    frame_step=8,
    to_comfy_latent=_to_comfy_latent,
    to_vae_latent=_to_vae_latent,
    max_sequence_length=226,  # the pipeline's own __call__ default
    single_file_transformer=None,  # diffusers has no single-file loader for CogVideoX
    vae_stages=cogvideox_stream,
    cfg_as_batch=True,  # CogVideoXPipeline concatenates cond and uncond into one batch
    # CogVideoX ships CogVideoXDDIMScheduler (2b) or CogVideoXDPMScheduler (5b, 1.5); both are
    # v-prediction, not flow matching, so `shift` does not apply. UniPC and DPM-Solver++ read the
    # same betas but not CogVideoX's snr_shift_scale: pipelines/schedulers.py refuses them when it is not 1.
    sampler=SamplerDefaults(flow_matching=False, schedulers=("unipc", "dpmpp_2m"), cfg=6.0, steps=50),
    max_positions=_positions,
)
