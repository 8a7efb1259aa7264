"""Wan 2.1 (T2V 1.3B/14B, I2V) and Wan 2.2 (TI2V-5B, A14B with two experts) declared for the engine.

The pipeline returns latents as [B, C, T, h, w], normalised per channel with the VAE's
`latents_mean`/`latents_std`; the VAE decodes `latent * std + mean`. A14B's second expert
(`transformer_2`) takes over below the boundary timestep inside the pipeline's own loop.
"""

from __future__ import annotations

import torch

from .family import FamilySpec, PositionLimits, SamplerDefaults, first_denoiser
from .wan_vae import wan_stages


def _to_comfy_latent(pipe, raw: torch.Tensor, frames: int) -> torch.Tensor:
    return raw


def _to_vae_latent(pipe, latent: torch.Tensor) -> torch.Tensor:
    config = pipe.vae.config
    shape = (1, config.z_dim, 1, 1, 1)
    mean = torch.tensor(config.latents_mean).view(shape).to(latent.device, latent.dtype)
    # Same op order as WanPipeline (divide by the reciprocal) so decoded frames match it bit for bit.
    inv_std = 1.0 / torch.tensor(config.latents_std).view(shape).to(latent.device, latent.dtype)
    return latent / inv_std + mean


def _image_variant(pipe) -> str | None:
    """Wan 2.2 TI2V-5B is one folder for both modes: with an image it runs as image-to-video."""
    return "WanImageToVideoPipeline" if pipe.config.get("expand_timesteps") else None


def _last_frame_error(pipe, last_image_given: bool) -> str | None:
    """Which Wan models take a last frame, read from the model itself.

    Wan 2.1 FLF2V 14B positions two CLIP images (its image embedder's `pos_embed` has 2 x 257 rows),
    so it needs both; diffusers' embedder cannot place one image in it. Wan 2.2 I2V A14B conditions
    on VAE latents only: the last frame's latent goes in the mask's last place (as ComfyUI core's
    WanFirstLastFrameToVideo). Wan 2.1 I2V 14B was trained on a first frame only, and TI2V-5B's
    first-frame conditioning has no place for a last one (diffusers ignores it there).
    """
    config = first_denoiser(pipe).config
    if config.get("pos_embed_seq_len"):
        return None if last_image_given else (
            "it is a first-last-frame model: its image embedding positions two images; to start from one image, "
            "load Wan 2.1 I2V 14B")
    if not last_image_given:
        return None
    if pipe.config.get("expand_timesteps"):
        return "Wan 2.2 TI2V-5B conditions on its first frame only: use Wan 2.2 I2V A14B for first-last-frame"
    if config.get("image_dim"):
        return ("Wan 2.1 I2V 14B was trained on a first frame only: use Wan 2.1 FLF2V 14B "
                "(wan2.1_flf2v_720p_14B) or Wan 2.2 I2V A14B for first-last-frame")
    return None


WAN = FamilySpec(
    name="wan",
    pipeline_classes=("WanPipeline", "WanImageToVideoPipeline"),
    image_conditioned=("WanImageToVideoPipeline",),
    denoisers=("transformer", "transformer_2"),
    blocks_attr="blocks",
    encoders=("text_encoder", "image_encoder"),
    frame_step=4,
    to_comfy_latent=_to_comfy_latent,
    to_vae_latent=_to_vae_latent,
    max_sequence_length=512,  # the pipeline's own __call__ default
    single_file_transformer="WanTransformer3DModel",  # original / ComfyUI-repackaged checkpoints
    image_variant=_image_variant,
    last_frame_error=_last_frame_error,
    vae_stages=wan_stages,
    # Wan's flow-matching UniPC is what the folders ship; diffusers' Wan docs: flow_shift 5.0 for
    # 720p, 3.0 for 480p (the folders ship one value; `shift` overrides it per run).
    sampler=SamplerDefaults(flow_matching=True, schedulers=("unipc", "dpmpp_2m", "flow_match_euler"),
                            recommended_shift=((1280 * 720, 5.0), (0, 3.0)), cfg=5.0, steps=50),
    max_positions=lambda config: PositionLimits.every_axis(config.get("rope_max_seq_len", 1024)),  # diffusers' default
)
