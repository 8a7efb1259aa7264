"""What context parallelism can run, checked in the coordinator before any rank starts.

Ulysses splits the video's tokens between the ranks and exchanges attention heads, so both
must divide by the degree: tokens = latent frames x (height / 8 / 2) x (width / 8 / 2) for
Wan (16 px for Wan 2.2 TI2V-5B's VAE). diffusers would stop with "must be divisible by mesh
size" from inside a rank; here the message names the sizes that work instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...memory.strategy import ContextParallel, Parallelism
from ..family import ModelError, spatial_multiple

NEARBY = 3  # how many sizes to suggest on each side


@dataclass(frozen=True)
class TokenGrid:
    """How pixels become tokens for one model: `unit` px per token side, `frame_step` frames per latent frame."""

    unit: int
    frame_step: int
    patch_t: int = 1

    def tokens(self, width: int, height: int, frames: int) -> int:
        latent_frames = (frames - 1) // self.frame_step + 1
        return -(-latent_frames // self.patch_t) * (height // self.unit) * (width // self.unit)

    def sizes_that_divide(self, width: int, height: int, frames: int, degree: int) -> dict[str, list[int]]:
        """Nearby widths, heights and frame counts (the others unchanged) whose token count divides by `degree`."""
        def near(value: int, step: int, low: int, tokens_at) -> list[int]:
            found = [v for k in range(1, 64) for v in (value - k * step, value + k * step)
                     if v >= low and tokens_at(v) % degree == 0]
            return sorted(found[:NEARBY])

        return {
            "width": near(width, self.unit, self.unit, lambda w: self.tokens(w, height, frames)),
            "height": near(height, self.unit, self.unit, lambda h: self.tokens(width, h, frames)),
            "frames": near(frames, self.frame_step, 1, lambda f: self.tokens(width, height, f)),
        }


def sequence_problem(grid: TokenGrid, width: int, height: int, frames: int, degree: int) -> str | None:
    tokens = grid.tokens(width, height, frames)
    if tokens % degree == 0:
        return None
    nearby = grid.sizes_that_divide(width, height, frames, degree)
    options = "; ".join(f"{name} {', '.join(map(str, values))}" for name, values in nearby.items() if values)
    return (f"{width}x{height}x{frames} makes {tokens} video tokens, which does not divide between "
            f"{degree} ranks (context parallelism splits the tokens evenly). Sizes that work, changing one input: "
            f"{options}.")


def token_grid(pipe, spec) -> TokenGrid:
    denoiser = pipe.transformer if pipe.transformer is not None else pipe.transformer_2
    patch = denoiser.config.patch_size
    patch_t = patch[0] if isinstance(patch, (tuple, list)) else 1
    return TokenGrid(spatial_multiple(pipe), spec.frame_step, patch_t)


def check_context_parallel(loaded, width: int, height: int, frames: int, parallel: Parallelism, degree: int,
                           device_type: str) -> None:
    """ModelError naming the input and its fix when this run cannot be split `degree` ways."""
    mode = parallel.context_parallel
    denoisers = [getattr(loaded.pipe, name) for name in loaded.spec.denoisers if getattr(loaded.pipe, name, None) is not None]
    if any(getattr(d, "_cp_plan", None) is None for d in denoisers):
        raise ModelError(
            f"context_parallel={mode.value}: {loaded.class_name} has no context-parallel plan in diffusers (splitting "
            "its joint text+video attention naively gives wrong frames without any error). Set context_parallel to "
            "off; with two or more GPUs listed, whole components are then placed on different GPUs instead."
        )
    if mode is ContextParallel.RING and device_type != "cuda":
        raise ModelError(
            "context_parallel=ring needs an attention kernel that returns the log-sum-exp (cuDNN or flash attention "
            "on CUDA GPUs); none exists on the CPU. Use context_parallel=ulysses."
        )
    heads = denoisers[0].config.num_attention_heads
    if mode is ContextParallel.ULYSSES and heads % degree:
        working = [d for d in range(2, heads + 1) if heads % d == 0 and d <= 16]
        raise ModelError(
            f"context_parallel=ulysses with degree {degree}: this transformer has {heads} attention heads, which "
            f"do not divide between {degree} ranks; use a degree of {', '.join(map(str, working))}, or ring."
        )
    problem = sequence_problem(token_grid(loaded.pipe, loaded.spec), width, height, frames, degree)
    if problem:
        raise ModelError(f"context_parallel={mode.value}, degree {degree}: {problem}")
