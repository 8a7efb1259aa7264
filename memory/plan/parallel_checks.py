"""What context parallelism can split, and what it sends: refusals that name what works, and bytes.

What can be split, with which mode, is memory.context_parallel's (the runtime asks the same rules);
here they are asked of the meta model, and each refusal raises `ParallelError` in those words,
before anything is traced.

Bytes per rank and forward pass (the denoiser's dtype, B videos, S tokens, H heads of D, L blocks):
- Ulysses: q, k, v and the attention output each go through one all-to-all per block; a rank's
  tensor is B*(S/N)*H*D elements and it keeps 1/N of it, so it sends 4*L*(N-1)/N of that tensor.
- Ring (all-gather rotation, diffusers' only one): k and v are all-gathered once per block; a rank
  receives the other N-1 ranks' shares, 2*L*(N-1) local tensors.
- Both: `proj_out`'s output (B*(S/N)*C_out) is all-gathered once at the end of the forward.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .parallel_trace import RING, ULYSSES
from .planner import PlanError, PlannerModel, VideoShape
from .stages import sequence_tokens, transformer_config
from .. import context_parallel as rules

__all__ = ["RING", "ULYSSES", "CommBytes", "ParallelError", "check_context_parallel", "comm_bytes",
           "context_parallel_refusal", "sequence_tokens"]


class ParallelError(PlanError):
    """A multi-GPU request the runtime would refuse; the message says what would work."""


@dataclass(frozen=True)
class CommBytes:
    """What one rank sends per denoiser forward pass, and in how many collectives."""

    attention_bytes: int
    gather_bytes: int
    collectives: int

    @property
    def total(self) -> int:
        return self.attention_bytes + self.gather_bytes


def context_parallel_refusal(model: PlannerModel, mode: str = ULYSSES) -> str | None:
    """Why `model` cannot run context-parallel in diffusers (None when it can)."""
    for name in model.layout.denoisers:
        module = model.module(name)
        refusal = rules.plan_refusal(mode, getattr(model, "pipeline_class", type(module).__name__),
                                     bool(getattr(type(module), "_cp_plan", None)))
        if refusal:
            return refusal
    return None


def check_context_parallel(model: PlannerModel, shape: VideoShape, gpus: int, mode: str) -> None:
    """ParallelError unless `gpus` ranks can split `model` at `shape` evenly (mode: ulysses | ring)."""
    if gpus < 1:
        raise ParallelError(f"gpus={gpus} must be at least 1.")
    if gpus == 1:
        return
    denoiser = model.layout.denoisers[0]
    refusal = (context_parallel_refusal(model, mode)
               or rules.heads_refusal(mode, transformer_config(model, denoiser).num_attention_heads, gpus)
               or rules.tokens_refusal(mode, gpus, (shape.width, shape.height, shape.frames), _tokens_at(model, shape),
                                       _size_step(model), model.geometry.temporal_factor))
    if refusal:
        raise ParallelError(refusal)


def _tokens_at(model: PlannerModel, shape: VideoShape) -> rules.TokensAt:
    return lambda width, height, frames: sequence_tokens(model, replace(shape, width=width, height=height, frames=frames))


def _size_step(model: PlannerModel) -> int:
    config = transformer_config(model, model.layout.denoisers[0])
    patch = config.patch_size[-1] if isinstance(config.patch_size, (list, tuple)) else config.patch_size
    return model.geometry.spatial_factor * patch


def comm_bytes(model: PlannerModel, shape: VideoShape, denoiser: str, gpus: int, mode: str) -> CommBytes:
    """Bytes one rank sends per forward pass of `denoiser` across `gpus` ranks (see the module notes)."""
    if gpus <= 1:
        return CommBytes(0, 0, 0)
    config = transformer_config(model, denoiser)
    itemsize, batch = model.dtype_bytes(denoiser), shape.batch
    local_tokens = sequence_tokens(model, shape, denoiser) // gpus
    local = batch * local_tokens * config.num_attention_heads * config.attention_head_dim * itemsize
    layers = model.weights(denoiser).block_count
    if mode == ULYSSES:
        attention, per_block = layers * 4 * local * (gpus - 1) // gpus, 4
    else:
        attention, per_block = layers * 2 * local * (gpus - 1), 1
    patch = config.patch_size if isinstance(config.patch_size, (list, tuple)) else (1, config.patch_size, config.patch_size)
    out_features = (config.out_channels or config.in_channels) * patch[0] * patch[1] * patch[2]
    gather = batch * local_tokens * out_features * itemsize * (gpus - 1)
    return CommBytes(attention, gather, layers * per_block + 1)
