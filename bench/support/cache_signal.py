"""bench/cache_quality.py, the signal: a tiny Wan-shaped transformer trained here, briefly and
deterministically, with Wan's flow-matching objective on synthetic latent videos.

Why train at all: an output-driven step cache (First Block Cache) decides from how much the
denoiser's output changed between steps, and any cache's error is judged against what the model
would have computed. A random transformer has no velocity field: its outputs change arbitrarily from
step to step. A trained one has: early steps set the layout, late steps refine. The data are four
classes of smooth motion in latent space (a ball rolling right, a ball falling, waves drifting, a
ball circling), each with its own prompt (so conditioning and guidance mean something), its own
channel signature and random start, speed and phase (so each class is a family of videos, not one).

The training is a plain torch loop (training/ trains LoRAs through the sampler's engine; a full
training of a fresh model from a tensor generator does not fit it without contortion).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

CLASSES = (
    ("a red ball rolls to the right", "roll"),
    ("a blue ball falls down", "fall"),
    ("green waves drift across the water", "waves"),
    ("a white ball circles around", "circle"),
)
NEGATIVE = ""  # the unconditional prompt, as the sampler runs it with guidance
LATENT_CHANNELS = 16  # Wan 2.1's VAE
FAMILY_DRAWS = 256  # members of a class drawn to find the one nearest a sample


@dataclass(frozen=True)
class TrainConfig:
    """The training run: steps, batch, learning rate, the share of unconditional examples (so the
    model learns the unconditional velocity guidance subtracts), the shift of the timesteps drawn
    (the sampler's flow_shift, so training sees the noise levels sampling visits), and the seed."""

    steps: int = 600
    batch: int = 8
    lr: float = 2e-3
    uncond_share: float = 0.1
    shift: float = 3.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch < 1:
            raise ValueError(f"train steps={self.steps} and batch={self.batch} must be 1 or more.")
        if not 0.0 <= self.uncond_share < 1.0:
            raise ValueError(f"uncond_share={self.uncond_share} must be in [0, 1).")


def latent_shape(width: int, height: int, frames: int) -> tuple[int, int, int, int]:
    """[C, F, h, w] of Wan 2.1's latent for a video: 8x spatial, 4x temporal compression."""
    if width % 16 or height % 16 or (frames - 1) % 4:
        raise ValueError(f"video {width}x{height}x{frames}: width and height must be multiples of 16 and frames "
                         "4k+1 (Wan's VAE and patching).")
    return LATENT_CHANNELS, (frames - 1) // 4 + 1, height // 8, width // 8


def signatures(seed: int = 1234) -> torch.Tensor:
    """[classes, C]: each class's fixed channel loading (unit RMS), so a class shows in colour too."""
    generator = torch.Generator().manual_seed(seed)
    raw = torch.randn(len(CLASSES), LATENT_CHANNELS, generator=generator)
    return raw / raw.pow(2).mean(dim=1, keepdim=True).sqrt()


def _blob(ys: torch.Tensor, xs: torch.Tensor, cy: torch.Tensor, cx: torch.Tensor, radius: float) -> torch.Tensor:
    return torch.exp(-((ys - cy) ** 2 + (xs - cx) ** 2) / (2 * radius * radius))


def patterns(kind: str, n: int, shape: tuple[int, int, int, int], generator: torch.Generator) -> torch.Tensor:
    """[n, F, h, w] in 0..1: `n` random members of one class's motion, smooth in time."""
    _, frames, h, w = shape
    u = torch.rand(n, 4, generator=generator)
    t = torch.linspace(0, 1, frames).view(1, frames, 1, 1)
    ys = torch.arange(h, dtype=torch.float32).view(1, 1, h, 1)
    xs = torch.arange(w, dtype=torch.float32).view(1, 1, 1, w)
    col = lambda i: u[:, i].view(n, 1, 1, 1)  # noqa: E731
    radius = 0.12 * min(h, w)
    if kind == "roll":  # left to right at a random height and speed
        cx = (0.1 + 0.3 * col(0)) * w + (0.3 + 0.3 * col(1)) * w * t
        return _blob(ys, xs, (0.2 + 0.6 * col(2)) * h, cx, radius)
    if kind == "fall":  # top to bottom at a random column and speed
        cy = (0.1 + 0.3 * col(0)) * h + (0.3 + 0.3 * col(1)) * h * t
        return _blob(ys, xs, cy, (0.2 + 0.6 * col(2)) * w, radius)
    if kind == "waves":  # a plane wave of random direction and phase, drifting half a period
        angle, phase = col(0) * math.pi, col(1) * 2 * math.pi
        along = xs * torch.cos(angle) + ys * torch.sin(angle)
        return 0.5 + 0.5 * torch.sin(2 * math.pi * along / (0.6 * max(h, w)) + phase + math.pi * t)
    if kind == "circle":  # a quarter turn around the centre from a random angle
        angle = col(0) * 2 * math.pi + 0.5 * math.pi * t
        r = (0.2 + 0.1 * col(1)) * min(h, w)
        return _blob(ys, xs, h / 2 + r * torch.sin(angle), w / 2 + r * torch.cos(angle), radius)
    raise ValueError(f"pattern kind={kind!r} is not one of {', '.join(k for _, k in CLASSES)}.")


def clean_videos(labels: torch.Tensor, shape: tuple[int, int, int, int], generator: torch.Generator,
                 loading: torch.Tensor) -> torch.Tensor:
    """[n, C, F, h, w] clean latents for `labels`: each class's pattern times its channel loading,
    centred (-1..1) so the data have about unit scale, as flow matching's noise does."""
    out = torch.empty(len(labels), *shape)
    for index, (_, kind) in enumerate(CLASSES):
        rows = (labels == index).nonzero().flatten()
        if len(rows):
            found = 2 * patterns(kind, len(rows), shape, generator) - 1
            out[rows] = loading[index].view(1, -1, 1, 1, 1) * found.unsqueeze(1)
    return out


def prompt_embeddings(pipe, max_sequence_length: int) -> torch.Tensor:
    """[classes + 1, L, D]: each class prompt's embedding, then the negative prompt's, encoded as
    the sampler encodes them (pipelines/prompts.py encode_missing)."""
    with torch.no_grad():
        found = [pipe.encode_prompt(prompt=text, do_classifier_free_guidance=False, num_videos_per_prompt=1,
                                    max_sequence_length=max_sequence_length, device=torch.device("cpu"))[0]
                 for text in [p for p, _ in CLASSES] + [NEGATIVE]]
    return torch.cat(found)


def shifted(u: torch.Tensor, shift: float) -> torch.Tensor:
    """The flow sigma for uniform `u`, shifted as the sampler's schedule (flow_shift) is."""
    return shift * u / (1 + (shift - 1) * u)


def flow_loss(transformer, x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor,
              embeds: torch.Tensor) -> torch.Tensor:
    """Wan's flow-matching objective: x_s = (1 - s) x0 + s noise; the model predicts noise - x0."""
    s = sigma.view(-1, 1, 1, 1, 1)
    noisy = (1 - s) * x0 + s * noise
    pred = transformer(hidden_states=noisy, timestep=sigma * 1000, encoder_hidden_states=embeds, return_dict=False)[0]
    return torch.mean((pred.float() - (noise - x0)) ** 2)


@dataclass
class Batch:
    x0: torch.Tensor
    noise: torch.Tensor
    sigma: torch.Tensor
    embeds: torch.Tensor


def draw(config: TrainConfig, shape, generator: torch.Generator, loading: torch.Tensor, embeds: torch.Tensor) -> Batch:
    labels = torch.randint(len(CLASSES), (config.batch,), generator=generator)
    x0 = clean_videos(labels, shape, generator, loading)
    uncond = torch.rand(config.batch, generator=generator) < config.uncond_share
    text = embeds[torch.where(uncond, len(CLASSES), labels)]
    sigma = shifted(torch.rand(config.batch, generator=generator), config.shift)
    return Batch(x0, torch.randn(x0.shape, generator=generator), sigma, text)


def held_out_loss(transformer, batch: Batch) -> float:
    with torch.no_grad():
        return flow_loss(transformer, batch.x0, batch.noise, batch.sigma, batch.embeds).item()


def train(pipe, config: TrainConfig, video: tuple[int, int, int], max_sequence_length: int, log=print) -> dict:
    """Train `pipe.transformer` in place (then back in eval mode); returns the evidence that it
    learned: the training loss over the first and last tenth of the steps and a held-out batch's
    loss (its own draws, the same timesteps) before and after."""
    torch.manual_seed(config.seed)
    shape = latent_shape(*video)
    loading, embeds = signatures(), prompt_embeddings(pipe, max_sequence_length)
    transformer = pipe.transformer
    held_out = draw(config, shape, torch.Generator().manual_seed(config.seed + 1), loading, embeds)
    before = held_out_loss(transformer, held_out)
    generator = torch.Generator().manual_seed(config.seed)
    optimizer = torch.optim.AdamW(transformer.parameters(), lr=config.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, config.lr, total_steps=config.steps, pct_start=0.1)
    losses, start = [], time.perf_counter()
    transformer.train()
    try:
        for step in range(config.steps):
            batch = draw(config, shape, generator, loading, embeds)
            loss = flow_loss(transformer, batch.x0, batch.noise, batch.sigma, batch.embeds)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(transformer.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            losses.append(loss.item())
            if log and (step + 1) % max(1, config.steps // 10) == 0:
                elapsed = time.perf_counter() - start
                log(f"  train step {step + 1}/{config.steps}: loss {loss.item():.4f} ({elapsed:.0f} s)", flush=True)
    finally:
        transformer.eval()
        transformer.zero_grad(set_to_none=True)
    tenth = max(1, config.steps // 10)
    return {"steps": config.steps, "batch": config.batch, "lr": config.lr, "uncond_share": config.uncond_share,
            "shift": config.shift, "seed": config.seed, "seconds": round(time.perf_counter() - start, 1),
            "loss_first_tenth": sum(losses[:tenth]) / tenth, "loss_last_tenth": sum(losses[-tenth:]) / tenth,
            "held_out_loss_before": before, "held_out_loss_after": held_out_loss(transformer, held_out)}


def nearest_family_mse(latent: torch.Tensor, shape, loading: torch.Tensor, seed: int = 99) -> list[float]:
    """Per class: the mean squared distance from `latent` [C, F, h, w] to the nearest of
    FAMILY_DRAWS random members of that class (the same draws for every latent judged)."""
    generator = torch.Generator().manual_seed(seed)
    found = []
    for index in range(len(CLASSES)):
        members = clean_videos(torch.full((FAMILY_DRAWS,), index), shape, generator, loading)
        found.append(((members - latent.float().unsqueeze(0)) ** 2).mean(dim=(1, 2, 3, 4)).min().item())
    return found


def judged(latent: torch.Tensor, index: int, shape) -> dict:
    """How near `latent` [C, F, h, w] lies to class `index`'s videos, and whether no other class is nearer."""
    distances = nearest_family_mse(latent, shape, signatures())
    return {"mse_to_own_class": distances[index],
            "mse_to_nearest_other_class": min(d for i, d in enumerate(distances) if i != index),
            "nearest_class_is_prompted": min(range(len(distances)), key=distances.__getitem__) == index}


def denoises(samples: dict[int, torch.Tensor], shape, seed: int) -> dict:
    """Whether the uncached samples look like the data: per class, the nearest-member distance to
    its own class and to the nearest other class, and for a draw of pure noise to its own class."""
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    return {CLASSES[index][0]: {**judged(latent, index, shape),
                                "noise_mse_to_own_class": judged(noise, index, shape)["mse_to_own_class"]}
            for index, latent in samples.items()}
