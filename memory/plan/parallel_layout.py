"""Which GPU holds what under balanced placement, and each GPU's phases.

Balanced placement (the seed's `device_map="balanced"`) puts whole components on different GPUs so
nothing is offloaded: GPU 0 holds the text encoder(s), the image encoder and the VAE (they compute
before and after the loop, never beside the transformer), the transformers take the other GPUs in
turn (Wan 2.2 A14B on three GPUs: one expert each; on two, both experts share GPU 1). Each phase
is a component's traced call replayed with every weight its GPU holds resident; only the latents and
embeddings cross between GPUs (kilobytes to megabytes, not modelled).
"""

from __future__ import annotations

from dataclasses import replace

from .allocator import replay
from .stages import component_weights, phase, piece_counts
from .types import Allocator, Call, ModelLayout, Phase, PlannerModel, PlanOptions, StagePlan, VideoShape
from .costs import CUDA_CONTEXT_BYTES
from ..strategy import MemoryStrategy
from ..vae_tiles import auto_tiling


def balanced_placement(layout: ModelLayout, gpus: int) -> tuple[tuple[str, ...], ...]:
    """Components per GPU: encoders and the VAE on GPU 0, the denoisers round-robin over the rest."""
    first = tuple(n for n in layout.all if n not in layout.denoisers)
    others: list[list[str]] = [[] for _ in range(max(gpus - 1, 1))]
    for index, name in enumerate(layout.denoisers):
        others[index % len(others)].append(name)
    return (first, *(tuple(names) for names in others))[:gpus] if gpus > 1 else (layout.all,)


def balanced_stages(model: PlannerModel, shape: VideoShape, strategy: MemoryStrategy, names: tuple[str, ...],
                    options: PlanOptions) -> tuple[StagePlan, ...]:
    """text_encode, denoise and decode as the GPU holding `names` sees them (no phase: idle)."""
    resident = [t for name in names for t in component_weights(model, name, options).tensors]
    layout = model.layout
    encode = [phase(model, Call("text_encode", n, shape), resident, options, n)
              for n in layout.text_encoders if n in names]
    denoise = [phase(model, Call("condition", n, shape), resident, options, f"{n} (image)")
               for n in layout.conditioning if n in names]
    denoise += [phase(model, Call("denoise", n, shape), resident, options, n) for n in layout.denoisers if n in names]
    decode = []
    if layout.vae in names:
        latent = model.latent_shape(shape)
        z = model.dtype_bytes(layout.vae)
        for dim in latent:
            z *= dim
        for piece, count in piece_counts(model, shape, strategy).items():
            label = f"{layout.vae} decode {'x'.join(map(str, piece[2:]))} ({count} calls)"
            decode.append(phase(model, Call("decode", layout.vae, shape, piece), [*resident, z], options, label))
    return (StagePlan("text_encode", tuple(encode), 0), StagePlan("denoise", tuple(denoise), 0),
            StagePlan("decode", tuple(decode), 0))


def with_resident(stage: StagePlan, extra: tuple[int, ...], options: PlanOptions) -> StagePlan:
    """`stage` with `extra` bytes held on the device through every phase (NCCL's buffers)."""
    return replace(stage, phases=tuple(_phase_with(p, extra, options) for p in stage.phases))


def _phase_with(p: Phase, extra: tuple[int, ...], options: PlanOptions) -> Phase:
    tensors = (*p.resident, *extra)
    peak = replay(tensors, p.events)
    footprint = peak.reserved if options.allocator.resolved() is Allocator.NATIVE else peak.allocated
    return replace(p, peak=peak, device_bytes=CUDA_CONTEXT_BYTES + footprint, resident=tensors)


def balanced_tiling(model: PlannerModel, shape: VideoShape, strategy: MemoryStrategy, names: tuple[str, ...],
                    options: PlanOptions, vram: int, attempts: int = 4) -> MemoryStrategy:
    """Untiled if the decode fits beside the other weights on its GPU, else the cheapest tiling that does.

    The rule of the single-GPU planner (`planner._tiling_that_fits`), on this GPU's decode stage."""
    untiled = balanced_stages(model, shape, strategy, names, options)[2]
    if not untiled.phases or untiled.fits(vram):
        return strategy
    phase = untiled.peak_phase
    fixed = CUDA_CONTEXT_BYTES + sum(phase.resident)
    latent = model.latent_shape(shape)
    pixels = model.geometry.frames(latent[2]) * latent[3] * latent[4] * model.geometry.spatial_factor ** 2
    per_pixel = max(phase.peak.allocated - sum(phase.resident), 1) / pixels
    free, tiled = vram - fixed, strategy
    for _ in range(attempts):
        tiling = auto_tiling(max(free, 1), latent, model.geometry, per_pixel)
        tiled = replace(strategy, vae_tiling=tiling)
        if tiling is None or balanced_stages(model, shape, tiled, names, options)[2].fits(vram):
            break
        free = int(free * 0.6)
    return tiled
