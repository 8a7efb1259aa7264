"""What context parallelism can run, checked in the coordinator before any rank starts.

The rules and their words are memory.context_parallel's (the planner asks the same); here they are
asked of the loaded pipeline. Tokens for Wan: latent frames x (height / 8 / 2) x (width / 8 / 2)
(16 px for Wan 2.2 TI2V-5B's VAE). diffusers would stop with "must be divisible by mesh size" from
inside a rank; here the message names the sizes that work instead.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ...memory import context_parallel as rules
from ...memory.strategy import CHUNKS_OFF, ContextParallel, MemoryStrategy, Parallelism
from ..attention import AttentionError, AttentionKernel, _keeps_parallel_backend
from ..family import ModelError, first_denoiser, spatial_multiple


@dataclass(frozen=True)
class TokenGrid:
    """How pixels become tokens for one model: `unit` px per token side, `frame_step` frames per latent frame."""

    unit: int
    frame_step: int
    patch_t: int = 1

    def tokens(self, width: int, height: int, frames: int) -> int:
        latent_frames = (frames - 1) // self.frame_step + 1
        return -(-latent_frames // self.patch_t) * (height // self.unit) * (width // self.unit)


def sequence_problem(grid: TokenGrid, width: int, height: int, frames: int, degree: int) -> str | None:
    return rules.uneven_tokens((width, height, frames), degree, grid.tokens, grid.unit, grid.frame_step)


def token_grid(pipe, spec) -> TokenGrid:
    denoiser = first_denoiser(pipe)
    patch = denoiser.config.patch_size
    patch_t = patch[0] if isinstance(patch, (tuple, list)) else 1
    return TokenGrid(spatial_multiple(pipe), spec.frame_step, patch_t)


def check_context_parallel(loaded, width: int, height: int, frames: int, parallel: Parallelism, degree: int,
                           device_type: str) -> None:
    """ModelError naming the input and its fix when this run cannot be split `degree` ways."""
    mode = parallel.context_parallel.value
    denoisers = [getattr(loaded.pipe, name) for name in loaded.spec.denoisers if getattr(loaded.pipe, name, None) is not None]
    refusal = (rules.plan_refusal(mode, loaded.class_name, all(getattr(d, "_cp_plan", None) is not None for d in denoisers))
               or rules.device_refusal(mode, device_type)
               or rules.heads_refusal(mode, denoisers[0].config.num_attention_heads, degree))
    if not refusal:
        grid = token_grid(loaded.pipe, loaded.spec)
        refusal = rules.tokens_refusal(mode, degree, (width, height, frames), grid.tokens, grid.unit, grid.frame_step)
    if refusal:
        raise ModelError(refusal)


def rank_strategy(strategy: MemoryStrategy) -> MemoryStrategy:
    """The strategy the ranks run: activation_chunks auto resolved to off (a rank's blocks hold their
    share of the tokens already); ModelError naming both inputs for a chunk count."""
    refusal = rules.chunks_refusal(strategy.parallel.context_parallel.value, strategy)
    if refusal:
        raise ModelError(refusal)
    return replace(strategy, activation_chunks=CHUNKS_OFF)


# Backends vidmem can set that diffusers runs split but whose forward cannot return the log-sum-exp
# ring merges by: its `_native_attention_forward_op` raises for return_lse=True (0.42.1).
NO_LOG_SUM_EXP = ("native",)


def check_parallel_attention(resolved_speed, denoiser_names, mode: str) -> None:
    """AttentionError, in the rank's words, for a Speed kernel with no context-parallel version: the
    rank's own check (diffusers' registry of backends that support it), asked here before any rank loads.
    Under ring also a kernel set explicitly that returns no log-sum-exp (auto keeps ring's cuDNN)."""
    attention = resolved_speed.attention
    _keeps_parallel_backend(attention, next(iter(denoiser_names), "transformer"),
                            also_refused=NO_LOG_SUM_EXP if mode == ContextParallel.RING else ())
    if mode == ContextParallel.RING and attention.requested is not AttentionKernel.AUTO \
            and attention.backend in NO_LOG_SUM_EXP:
        raise AttentionError(f"attention={attention.requested.value!r} with context_parallel=ring: the dispatcher's "
                             f"'{attention.backend}' returns no log-sum-exp, which ring merges its partial results by; "
                             "choose 'auto' (ring's cuDNN attention), 'cudnn' or 'flash', or context_parallel=ulysses.")
