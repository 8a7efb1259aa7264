"""Each family's own training objective: how a clean latent becomes a noisy input, and the loss.

- Wan (2.1, 2.2): flow matching, as diffusers' FlowMatchEulerDiscreteScheduler defines it:
  x_t = (1 - sigma) x0 + sigma noise, timestep = 1000 sigma, target = noise - x0, MSE on the
  transformer's prediction. sigma = shift(u) with u uniform and the pipeline's own `flow_shift`
  (the noise levels its sampler spends steps on). Wan 2.2 A14B trains one expert at a time on its
  own noise range: the high-noise expert above the boundary (boundary_ratio x 1000), the
  low-noise expert below it.
- CogVideoX: v-prediction on the DDPM schedule of the pipeline's scheduler, as CogVideoX-Factory
  and finetrainers train it: t uniform in [0, 1000), x_t = scheduler.add_noise(x0, noise, t), the
  prediction turned into x0 by scheduler.get_velocity, loss weighted by 1 / (1 - alpha_bar_t).

Latents are given as the sampler returns them (the LATENT form, [B, C, T, h, w]: Wan normalised
by the VAE's mean/std, CogVideoX scaled by its scaling factor). Randomness comes only from the
`generator` passed in, on the CPU, so a step's noise is the same on any device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from .errors import TrainingError

WAN_TRAIN_TIMESTEPS = 1000
DEFAULT_FLOW_SHIFT = 3.0  # Wan's own default when a scheduler config names none


@dataclass(frozen=True)
class Batch:
    latents: torch.Tensor  # [B, C, T, h, w], LATENT form
    prompt_embeds: torch.Tensor  # [B, L, D]


class Objective(Protocol):
    def loss(self, model: torch.nn.Module, batch: Batch, generator: torch.Generator, device: torch.device) -> torch.Tensor:
        """The scalar float32 loss of one batch (its graph reaches the LoRA parameters)."""


@dataclass(frozen=True)
class FlowMatching:
    shift: float
    sigma_low: float = 0.0  # noise levels trained: (sigma_low, sigma_high]
    sigma_high: float = 1.0

    def sigmas(self, count: int, generator: torch.Generator) -> torch.Tensor:
        """shift(u) = s u / (1 + (s - 1) u) for u uniform over the preimage of the trained range."""
        low, high = _unshift(self.sigma_low, self.shift), _unshift(self.sigma_high, self.shift)
        u = low + (high - low) * torch.rand(count, generator=generator, dtype=torch.float64)
        return (self.shift * u / (1 + (self.shift - 1) * u)).float()

    def loss(self, model, batch, generator, device):
        x0 = batch.latents.float()
        sigma = self.sigmas(x0.shape[0], generator)
        noise = torch.randn(x0.shape, generator=generator, dtype=torch.float32)
        s = sigma.view(-1, 1, 1, 1, 1)
        noisy = (1 - s) * x0 + s * noise
        dtype = model.dtype
        pred = model(hidden_states=noisy.to(device, dtype), timestep=(sigma * WAN_TRAIN_TIMESTEPS).to(device),
                     encoder_hidden_states=batch.prompt_embeds.to(device, dtype), return_dict=False)[0]
        return F.mse_loss(pred.float(), (noise - x0).to(device))


def _unshift(sigma: float, shift: float) -> float:
    return sigma / (shift - (shift - 1) * sigma)


@dataclass(frozen=True)
class VPrediction:
    pipe: object  # the CogVideoX pipeline: its scheduler and rotary embeddings

    def loss(self, model, batch, generator, device):
        scheduler = self.pipe.scheduler
        x0 = _pad_frames(batch.latents.permute(0, 2, 1, 3, 4).float(), model.config.patch_size_t)  # [B, T, C, h, w]
        count = x0.shape[0]
        t = torch.randint(0, scheduler.config.num_train_timesteps, (count,), generator=generator)
        noise = torch.randn(x0.shape, generator=generator, dtype=torch.float32)
        noisy = scheduler.add_noise(x0, noise, t)
        dtype = model.dtype
        output = model(hidden_states=noisy.to(device, dtype), encoder_hidden_states=batch.prompt_embeds.to(device, dtype),
                       timestep=t.to(device), image_rotary_emb=self._rotary(x0.shape, device), return_dict=False)[0]
        pred_x0 = scheduler.get_velocity(output.float(), noisy.to(device), t.to(device))
        weights = (1 / (1 - scheduler.alphas_cumprod.to(device)[t.to(device)])).view(-1, 1, 1, 1, 1)
        per_sample = (weights * (pred_x0 - x0.to(device)) ** 2).reshape(count, -1).mean(dim=1)
        return per_sample.mean()

    def _rotary(self, shape: torch.Size, device: torch.device):
        if not self.pipe.transformer.config.use_rotary_positional_embeddings:
            return None
        spatial = self.pipe.vae_scale_factor_spatial
        return self.pipe._prepare_rotary_positional_embeddings(shape[3] * spatial, shape[4] * spatial, shape[1], device)


def _pad_frames(latents: torch.Tensor, patch_t: int | None) -> torch.Tensor:
    """CogVideoX 1.5 patches 2 latent frames at a time: repeat the first frame in front, as its
    pipeline pads with leading frames, so every clip of 8k+1 frames fits."""
    if not patch_t or latents.shape[1] % patch_t == 0:
        return latents
    extra = patch_t - latents.shape[1] % patch_t
    return torch.cat([latents[:, :1].expand(-1, extra, -1, -1, -1), latents], dim=1)


EXPERT_COMPONENTS = {"both": "transformer", "high_noise": "transformer", "low_noise": "transformer_2"}


def denoiser_for(loaded, expert: str) -> str:
    """The component trained: Wan 2.2 A14B trains one expert per run; other models their transformer."""
    pipe = loaded.pipe
    two_experts = getattr(pipe, "transformer_2", None) is not None and getattr(pipe, "transformer", None) is not None
    if expert not in EXPERT_COMPONENTS:
        raise TrainingError(f"expert='{expert}' is not one of {', '.join(EXPERT_COMPONENTS)}.")
    if two_experts and expert == "both":
        raise TrainingError("this Wan 2.2 A14B pipeline has two experts, trained one at a time on their own noise "
                            "levels; set expert to 'high_noise' or 'low_noise' (and load the LoRA on that expert).")
    if not two_experts and expert != "both":
        raise TrainingError(f"expert='{expert}' needs a two-expert model (Wan 2.2 A14B); this pipeline has one "
                            "transformer. Set expert to 'both'.")
    return EXPERT_COMPONENTS[expert]


def objective_for(loaded, component: str) -> Objective:
    """The family's objective for training `component` of `loaded`."""
    pipe, name = loaded.pipe, loaded.spec.name
    if loaded.needs_image:
        raise TrainingError(f"{loaded.class_name} is image-to-video; vidmem trains text-to-video LoRAs only. "
                            "Train on the text-to-video model of the same family.")
    if name == "cogvideox":
        return VPrediction(pipe)
    if name == "wan":
        shift = float(pipe.scheduler.config.get("flow_shift") or pipe.scheduler.config.get("shift") or DEFAULT_FLOW_SHIFT)
        boundary = pipe.config.get("boundary_ratio")
        if boundary is None or getattr(pipe, "transformer_2", None) is None:
            return FlowMatching(shift)
        return FlowMatching(shift, boundary, 1.0) if component == "transformer" else FlowMatching(shift, 0.0, boundary)
    raise TrainingError(f"training is not available for the {name} family.")
