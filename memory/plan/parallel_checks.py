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
NEAREST = 2  # sizes suggested on each side of a refused one


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


def context_parallel_refusal(model: PlannerModel) -> str | None:
    """Why `model` cannot run context-parallel in diffusers (None when it can)."""
    for name in model.layout.denoisers:
        cls = type(model.module(name))
        if not getattr(cls, "_cp_plan", None):
            return (f"{model.name} cannot run with context parallelism: diffusers has no context-parallel plan for "
                    f"{cls.__name__} (splitting its joint text-and-video attention naively gives wrong frames "
                    f"without an error). Use balanced placement across the GPUs (whole components on different "
                    f"GPUs; vidmem plan --cp balanced) or one GPU.")
    return None


def check_context_parallel(model: PlannerModel, shape: VideoShape, gpus: int, mode: str) -> None:
    """ParallelError unless `gpus` ranks can split `model` at `shape` evenly (mode: ulysses | ring)."""
    if gpus < 1:
        raise ParallelError(f"gpus={gpus} must be at least 1.")
    if gpus == 1:
        return
    refusal = context_parallel_refusal(model)
    if refusal:
        raise ParallelError(refusal)
    denoiser = model.layout.denoisers[0]
    heads = transformer_config(model, denoiser).num_attention_heads
    if mode == ULYSSES and heads % gpus:
        counts = ", ".join(str(n) for n in range(2, heads + 1) if heads % n == 0 and n <= 16)
        raise ParallelError(f"Ulysses gives every GPU an equal share of {model.name}'s {heads} attention heads: "
                            f"{gpus} GPUs do not divide {heads}. Use {counts} GPUs, or ring attention (--cp ring).")
    tokens = sequence_tokens(model, shape, denoiser)
    if tokens % gpus:
        raise ParallelError(uneven_message(model, shape, gpus, tokens, heads if mode == ULYSSES else None))


def uneven_message(model: PlannerModel, shape: VideoShape, gpus: int, tokens: int, heads: int | None = None) -> str:
    """The sequence does not divide by `gpus`: the nearest frames and sizes that do, and a GPU count
    that does (one that also divides `heads`, for Ulysses)."""
    frames = _working(model, shape, gpus, "frames", 4)
    widths = _working(model, shape, gpus, "width", _size_step(model))
    heights = _working(model, shape, gpus, "height", _size_step(model))
    sizes = [f"--frames {' or '.join(map(str, frames))}"] if frames else []
    sizes += [f"--size {w}x{shape.height}" for w in widths] + [f"--size {shape.width}x{h}" for h in heights]
    counts = [n for n in range(2, gpus) if tokens % n == 0 and (heads is None or heads % n == 0)]
    more = f", or {counts[-1]} GPUs" if counts else ""
    return (f"{model.name} at {shape.width}x{shape.height}x{shape.frames} has {tokens} tokens per video, which do not "
            f"split evenly across {gpus} GPUs (diffusers' context parallelism gives every rank an equal share). "
            f"Sizes that do: {'; '.join(sizes) or 'none nearby'}{more}.")


def _size_step(model: PlannerModel) -> int:
    config = transformer_config(model, model.layout.denoisers[0])
    patch = config.patch_size[-1] if isinstance(config.patch_size, (list, tuple)) else config.patch_size
    return model.geometry.spatial_factor * patch


def _working(model: PlannerModel, shape: VideoShape, gpus: int, field: str, step: int) -> list[int]:
    """The nearest values of `field` (below and above) the model accepts and whose tokens split evenly."""
    found = []
    for direction in (-1, 1):
        for k in range(1, 64):
            value = getattr(shape, field) + direction * k * step
            if value <= 0:
                break
            candidate = replace(shape, **{field: value})
            try:
                model.check_shape(candidate)
            except ValueError:
                continue
            if sequence_tokens(model, candidate) % gpus == 0:
                found.append(value)
                break
    return sorted(found)[: NEAREST * 2]


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
