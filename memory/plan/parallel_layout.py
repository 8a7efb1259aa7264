"""Which GPU holds what under balanced placement, and the prompt encoder's stage on its own GPU.

Balanced placement (the seed's `device_map="balanced"`, vidmem.pipelines.parallel.balanced): no
parallelism; the transformers (Wan 2.2 A14B's two experts together) run on the first listed GPU
(GPU 0 here) under the strategy's offload tier, with the image encoder and the image VAE of
image-to-video, as one GPU would; the prompt encoder runs whole on the second (GPU 1), so the two
never leave room for each other; more GPUs stay idle. The decode runs afterwards on ComfyUI's
device, GPU 0. The runtime places them the same way.
"""

from __future__ import annotations

from dataclasses import replace

from .allocator import replay
from .costs import CUDA_CONTEXT_BYTES, Traffic, Work
from .stages import component_weights, phase
from .types import Allocator, Call, ModelLayout, Phase, PlannerModel, PlanOptions, StagePlan, VideoShape


def balanced_placement(layout: ModelLayout, gpus: int) -> tuple[tuple[str, ...], ...]:
    """Components per GPU: every one but the prompt encoder(s) on GPU 0, the prompt encoder(s) on GPU 1."""
    encoders = tuple(layout.text_encoders)
    home = tuple(name for name in layout.all if name not in encoders)
    return (home, encoders, *(() for _ in range(gpus - 2)))


def encoder_stage(model: PlannerModel, shape: VideoShape, options: PlanOptions) -> StagePlan:
    """The prompt encoder(s), whole, computing on their own GPU (moved there once for the run)."""
    phases, work = [], []
    for name in model.layout.text_encoders:
        weights = component_weights(model, name, options)
        call = Call("text_encode", name, shape)
        phases.append(phase(model, call, list(weights.tensors), options, name))
        work.append(Work(model.trace(call, options.attention).flops, 1, Traffic(once_bytes=weights.nbytes)))
    return StagePlan("text_encode", tuple(phases), 0, 0, tuple(work))


def with_resident(stage: StagePlan, extra: tuple[int, ...], options: PlanOptions) -> StagePlan:
    """`stage` with `extra` bytes held on the device through every phase (NCCL's buffers)."""
    return replace(stage, phases=tuple(_phase_with(p, extra, options) for p in stage.phases))


def _phase_with(p: Phase, extra: tuple[int, ...], options: PlanOptions) -> Phase:
    tensors = (*p.resident, *extra)
    peak = replay(tensors, p.events, timeline=p.timeline)
    footprint = peak.reserved if options.allocator.resolved() is Allocator.NATIVE else peak.active
    return replace(p, peak=peak, device_bytes=CUDA_CONTEXT_BYTES + footprint, resident=tensors)
