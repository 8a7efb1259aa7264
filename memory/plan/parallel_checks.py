"""What context parallelism can split, and what it sends: refusals that name what works, and bytes.

diffusers splits a transformer's sequence only where the class declares a context-parallel plan
(`_cp_plan`; Wan has one, CogVideoX none), in equal shares (`EquipartitionSharder`: the token count
must divide by the degree), and Ulysses also hands each rank an equal share of the attention heads.
Each check raises `ParallelError` naming the sizes or GPU counts that do work, before anything runs.

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

__all__ = ["RING", "ULYSSES", "CommBytes", "ParallelError", "check_context_parallel", "comm_bytes",
           "context_parallel_refusal", "sequence_tokens", "uneven_message"]
NEARBY = 3  # sizes suggested for each input, as the runtime does


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


def transformer_config(model: PlannerModel, denoiser: str):
    return model.module(denoiser).config


def sequence_tokens(model: PlannerModel, shape: VideoShape, denoiser: str | None = None) -> int:
    """Tokens the transformer blocks see for one video: latent frames x rows x columns, per patch."""
    config = transformer_config(model, denoiser or model.layout.denoisers[0])
    _, _, frames, height, width = model.latent_shape(shape)
    patch = config.patch_size if isinstance(config.patch_size, (list, tuple)) else (1, config.patch_size, config.patch_size)
    frames += (-frames) % patch[0]
    return (frames // patch[0]) * (height // patch[1]) * (width // patch[2])


def context_parallel_refusal(model: PlannerModel, mode: str = ULYSSES) -> str | None:
    """Why `model` cannot run context-parallel in diffusers (None when it can), in the runtime's words
    (vidmem.pipelines.parallel.checks, which the tests hold this to)."""
    for name in model.layout.denoisers:
        if not getattr(type(model.module(name)), "_cp_plan", None):
            pipeline = getattr(model, "pipeline_class", type(model.module(name)).__name__)
            return (f"context_parallel={mode}: {pipeline} has no context-parallel plan in diffusers (splitting "
                    "its joint text+video attention naively gives wrong frames without any error). Set "
                    "context_parallel to off; with two or more GPUs listed, whole components are then placed on "
                    "different GPUs instead.")
    return None


def check_context_parallel(model: PlannerModel, shape: VideoShape, gpus: int, mode: str) -> None:
    """ParallelError unless `gpus` ranks can split `model` at `shape` evenly (mode: ulysses | ring)."""
    if gpus < 1:
        raise ParallelError(f"gpus={gpus} must be at least 1.")
    if gpus == 1:
        return
    refusal = context_parallel_refusal(model, mode)
    if refusal:
        raise ParallelError(refusal)
    denoiser = model.layout.denoisers[0]
    heads = transformer_config(model, denoiser).num_attention_heads
    if mode == ULYSSES and heads % gpus:
        working = [d for d in range(2, heads + 1) if heads % d == 0 and d <= 16]
        raise ParallelError(
            f"context_parallel=ulysses with degree {gpus}: this transformer has {heads} attention heads, which "
            f"do not divide between {gpus} ranks; use a degree of {', '.join(map(str, working))}, or ring.")
    tokens = sequence_tokens(model, shape, denoiser)
    if tokens % gpus:
        raise ParallelError(f"context_parallel={mode}, degree {gpus}: {uneven_message(model, shape, gpus, tokens)}")


def uneven_message(model: PlannerModel, shape: VideoShape, gpus: int, tokens: int) -> str:
    """The runtime's words (pipelines.parallel.checks.sequence_problem): nearby widths, heights and
    frame counts, one input changed, whose tokens divide by `gpus`."""
    step = _size_step(model)
    nearby = {"width": _near(model, shape, "width", step, gpus), "height": _near(model, shape, "height", step, gpus),
              "frames": _near(model, shape, "frames", model.geometry.temporal_factor, gpus)}
    options = "; ".join(f"{name} {', '.join(map(str, values))}" for name, values in nearby.items() if values)
    return (f"{shape.width}x{shape.height}x{shape.frames} makes {tokens} video tokens, which does not divide between "
            f"{gpus} ranks (context parallelism splits the tokens evenly). Sizes that work, changing one input: "
            f"{options}.")


def _size_step(model: PlannerModel) -> int:
    config = transformer_config(model, model.layout.denoisers[0])
    patch = config.patch_size[-1] if isinstance(config.patch_size, (list, tuple)) else config.patch_size
    return model.geometry.spatial_factor * patch


def _near(model: PlannerModel, shape: VideoShape, field: str, step: int, gpus: int) -> list[int]:
    """The NEARBY closest values of `field` (alternating below and above) whose tokens divide by `gpus`."""
    value, low = getattr(shape, field), 1 if field == "frames" else step
    found = [v for k in range(1, 64) for v in (value - k * step, value + k * step)
             if v >= low and sequence_tokens(model, replace(shape, **{field: v})) % gpus == 0]
    return sorted(found[:NEARBY])


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
