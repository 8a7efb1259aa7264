"""The planner's vocabulary (shapes, calls, the model protocol) and one function per stage.

Each stage is a list of phases, one per component that computes in it; a phase is the resident
weights (per the tier) plus that component's traced allocations, replayed through the allocator
model. The stage's device figure is its worst phase; its host figure adds what the run keeps in RAM.
The rules mirror vidmem.pipelines.sample / decode and vidmem.memory.offload; where they change,
change these.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Protocol

from torch import nn

from .accounting import Attention, Trace
from .planner_allocator import AllocatorPeak, replay
from .planner_costs import (CUBLAS_WORKSPACE_BYTES, CUDA_CONTEXT_BYTES, DEVICE_FLOPS_PER_S, HOST_FLOPS_PER_S,
                            HOST_RUNTIME_BYTES, Traffic, stage_seconds)
from .planner_schedule import ComponentWeights, Order, resident_tensors, streamed_unit_bytes
from .strategy import MemoryStrategy, OffloadTier, TextEncoderPlacement
from .vae_tiles import VaeGeometry, plan_tiles


class Allocator(str, Enum):
    NATIVE = "native"  # PyTorch's caching allocator (torch default): what it reserves
    ASYNC = "cudaMallocAsync"  # ComfyUI's default backend: live bytes (the driver pool is not modelled)


class Runtime(str, Enum):
    VIDMEM = "vidmem"  # vidmem's engine: its own VAE tiling, frames blended into host memory
    DIFFUSERS = "diffusers"  # a plain diffusers pipeline: the VAE's own tiling, frames stay on device


@dataclass(frozen=True)
class VideoShape:
    width: int
    height: int
    frames: int
    batch: int = 1  # videos per prompt
    cfg: bool = True  # classifier-free guidance (guidance scale > 1)


@dataclass(frozen=True)
class Call:
    """One traced call: `kind` in text_encode | condition | denoise | decode | postprocess."""

    kind: str
    component: str
    shape: VideoShape
    piece: tuple[int, ...] | None = None  # decode: latent piece [b, C, t, h, w]
    vae_tiling: bool = False  # decode with the VAE's own (diffusers) tiling


@dataclass(frozen=True)
class ModelLayout:
    """Which components a model has and the role each plays in a run."""

    text_encoders: tuple[str, ...]
    denoisers: tuple[str, ...]
    vae: str = "vae"
    placed_encoders: tuple[str, ...] = ()  # follow MemoryStrategy.text_encoder (FamilySpec.encoders)
    conditioning: tuple[str, ...] = ()  # run before the loop for image-to-video (image encoder, VAE)

    @property
    def all(self) -> tuple[str, ...]:
        names = (*self.text_encoders, *self.placed_encoders, *self.conditioning, *self.denoisers, self.vae)
        return tuple(dict.fromkeys(names))


class PlannerModel(Protocol):
    """What the planner needs from a model; `vidmem.pipelines.configs.load_model` builds one."""

    name: str
    dtype_name: str
    layout: ModelLayout
    geometry: VaeGeometry
    vae_stream_batch: int | None  # the decode's chunks stream the VAE's caches (no context frames)

    def check_shape(self, shape: VideoShape) -> None: ...  # raise ValueError naming the fix
    def weights(self, component: str) -> ComponentWeights: ...
    def module(self, component: str) -> nn.Module: ...  # full size, on meta
    def blocks(self, component: str) -> nn.ModuleList | None: ...  # the swappable blocks (denoisers)
    def stream_order(self, component: str) -> Order | None: ...  # one forward's module order, once traced
    def trace(self, call: Call, attention: Attention) -> Trace: ...  # memoised by the model
    def latent_shape(self, shape: VideoShape) -> tuple[int, int, int, int, int]: ...  # as the VAE decodes
    def forward_passes(self, shape: VideoShape) -> int: ...  # denoiser forwards per step


@dataclass(frozen=True)
class PlanOptions:
    attention: Attention = Attention.FUSED
    allocator: Allocator = Allocator.NATIVE
    runtime: Runtime = Runtime.VIDMEM
    steps: int = 50


@dataclass(frozen=True)
class Phase:
    """One component computing inside a stage, with what is resident meanwhile."""

    label: str
    weights_bytes: int
    peak: AllocatorPeak
    device_bytes: int  # CUDA context + allocator footprint
    resident: tuple[int, ...] = field(repr=False, default=())
    events: tuple[int, ...] = field(repr=False, default=())

    def fits(self, budget: int) -> bool:
        return self.within(budget).device_bytes <= budget

    def within(self, budget: int) -> "Phase":
        """This phase on a device of `budget` bytes: near the limit the allocator releases its cached
        segments and retries, so a run can fit although its unlimited reservation would not."""
        if self.device_bytes <= budget or CUDA_CONTEXT_BYTES + self.peak.allocated > budget:
            return self
        capped = replay(self.resident, self.events, budget - CUDA_CONTEXT_BYTES)
        if capped.out_of_memory:
            return self
        return replace(self, peak=capped, device_bytes=CUDA_CONTEXT_BYTES + capped.reserved)


@dataclass(frozen=True)
class StagePlan:
    name: str
    phases: tuple[Phase, ...]
    host_bytes: int
    seconds: float

    @property
    def peak_phase(self) -> Phase | None:
        return max(self.phases, key=lambda p: p.device_bytes, default=None)

    @property
    def device_bytes(self) -> int:
        return self.peak_phase.device_bytes if self.phases else 0

    @property
    def allocated_bytes(self) -> int:
        return max((p.peak.allocated for p in self.phases), default=0)

    @property
    def reserved_bytes(self) -> int:
        return max((p.peak.reserved for p in self.phases), default=0)

    def fits(self, vram: int | None) -> bool:
        return vram is None or all(p.fits(vram) for p in self.phases)

    def within(self, vram: int | None) -> "StagePlan":
        return self if vram is None else replace(self, phases=tuple(p.within(vram) for p in self.phases))


def text_encode_stage(model: PlannerModel, shape: VideoShape, strategy: MemoryStrategy, options: PlanOptions) -> StagePlan:
    host, phases, seconds = host_base(model), [], 0.0
    stage = sample_stage_components(model, strategy)
    for name in model.layout.text_encoders:
        call = Call("text_encode", name, shape)
        trace = model.trace(call, options.attention)
        if strategy.text_encoder is TextEncoderPlacement.CPU:
            host += trace.peak_bytes  # encodes in RAM; only the embeddings move
            seconds += trace.flops / HOST_FLOPS_PER_S
            continue
        phases.append(phase(model, call, tier_residency(model, name, strategy, stage), options, name))
        seconds += stage_seconds(trace.flops, 1, _traffic(model, name, strategy, stage))
    return StagePlan("text_encode", tuple(phases), host, seconds)


def denoise_stage(model: PlannerModel, shape: VideoShape, strategy: MemoryStrategy, options: PlanOptions) -> StagePlan:
    layout, phases, seconds = model.layout, [], 0.0
    stage = sample_stage_components(model, strategy)
    if strategy.text_encoder is TextEncoderPlacement.OFFLOAD_AFTER_ENCODING:  # evicted once prompts are encoded
        stage = [n for n in stage if n not in layout.text_encoders]
    host = host_base(model) + 2 * _numel(model.latent_shape(shape)) * 4  # CPU noise, the returned latent
    for name in layout.conditioning:
        call = Call("condition", name, shape)
        trace = model.trace(call, options.attention)
        if name not in stage:  # an image encoder placed on the CPU encodes there
            host += trace.peak_bytes
            seconds += trace.flops / HOST_FLOPS_PER_S
            continue
        phases.append(phase(model, call, tier_residency(model, name, strategy, stage), options, f"{name} (image)"))
        seconds += stage_seconds(trace.flops, 1, _traffic(model, name, strategy, stage))
    steps_per_denoiser = _split_steps(options.steps, len(layout.denoisers))
    for name, steps in zip(layout.denoisers, steps_per_denoiser):
        call = Call("denoise", name, shape)
        flops = model.trace(call, options.attention).flops * steps  # traced first: it records the module order
        phases.append(phase(model, call, tier_residency(model, name, strategy, stage), options, name))
        seconds += stage_seconds(flops, steps * model.forward_passes(shape), _traffic(model, name, strategy, stage))
    return StagePlan("denoise", tuple(phases), host, seconds)


def decode_stage(model: PlannerModel, shape: VideoShape, strategy: MemoryStrategy, options: PlanOptions) -> StagePlan:
    vae, latent = model.layout.vae, model.latent_shape(shape)
    itemsize = 2 if model.dtype_name in ("bf16", "fp16") else 4
    z = _numel(latent) * itemsize  # the latent on the device in the VAE's dtype, whole, during the decode
    if options.runtime is Runtime.DIFFUSERS:
        counts = Counter({latent: 1})
        calls = [Call("decode", vae, shape, latent, vae_tiling=strategy.vae_tiling is not None)]
    else:
        counts = piece_counts(model, shape, strategy)
        calls = [Call("decode", vae, shape, piece) for piece in counts]
    model.trace(calls[0], options.attention)  # traced first: it records the module order
    resident = tier_residency(model, vae, strategy, [vae])
    if options.runtime is Runtime.DIFFUSERS and strategy.offload is OffloadTier.NONE:
        resident = tier_residency(model, vae, strategy, list(model.layout.all))  # pipe.to("cuda"): all stay
    phases, flops, largest_piece = [], 0.0, 0
    for call in calls:
        label = f"{vae} decode {'x'.join(map(str, call.piece[2:]))} ({counts[call.piece]} calls)"
        phases.append(phase(model, call, [*resident, z], options, label))
        flops += model.trace(call, options.attention).flops * counts[call.piece]
        pixels = 3 * model.geometry.frames(call.piece[2]) * _numel(call.piece[3:]) * model.geometry.spatial_factor ** 2
        largest_piece = max(largest_piece, call.piece[0] * pixels * itemsize)  # copied to the host per piece
    host_frames = model.trace(Call("postprocess", vae, shape), options.attention).peak_bytes
    seconds = stage_seconds(flops, sum(counts.values()), _traffic(model, vae, strategy, [vae]))
    return StagePlan("decode", tuple(phases), host_base(model) + host_frames + largest_piece, seconds)


def phase(model: PlannerModel, call: Call, resident: list[int], options: PlanOptions, label: str) -> Phase:
    """Replay resident weights, then the call's allocations, through the allocator model."""
    trace = model.trace(call, options.attention)
    tensors = (CUBLAS_WORKSPACE_BYTES, *resident)
    peak = replay(tensors, trace.events)
    footprint = peak.reserved if options.allocator is Allocator.NATIVE else peak.allocated
    return Phase(label, sum(resident), peak, CUDA_CONTEXT_BYTES + footprint, tensors, trace.events)


def tier_residency(model: PlannerModel, active: str, strategy: MemoryStrategy, stage_names: list[str]) -> list[int]:
    """Weight tensors resident while `active` computes; under `none` every stage component is."""
    if strategy.offload is OffloadTier.NONE:
        return [t for name in dict.fromkeys([*stage_names, active]) for t in model.weights(name).tensors]
    return resident_tensors(model.module(active), model.blocks(active), strategy, model.stream_order(active))


def sample_stage_components(model: PlannerModel, strategy: MemoryStrategy) -> list[str]:
    """The components `sample()` applies the strategy to (vidmem.pipelines.sample.sample_stage)."""
    layout = model.layout
    if strategy.text_encoder is TextEncoderPlacement.CPU:  # encoders (text and image) stay on the CPU
        return [n for n in dict.fromkeys([*layout.conditioning, *layout.denoisers]) if n not in layout.placed_encoders]
    return list(dict.fromkeys([*layout.placed_encoders, *layout.text_encoders, *layout.conditioning, *layout.denoisers]))


def host_base(model: PlannerModel) -> int:
    """The loader keeps every component in RAM for the pipeline's lifetime."""
    return HOST_RUNTIME_BYTES + sum(model.weights(n).nbytes for n in model.layout.all)


def piece_counts(model: PlannerModel, shape: VideoShape, strategy: MemoryStrategy) -> Counter:
    """Distinct latent pieces a vidmem decode calls the VAE on, and how often each."""
    latent = model.latent_shape(shape)
    tiles = plan_tiles(latent, model.geometry, strategy.vae_tiling, stream_batch=model.vae_stream_batch)
    batch = 1 if strategy.vae_slicing else latent[0]
    counts: Counter = Counter()
    for frames in tiles.frames:
        for rows in tiles.rows:
            for cols in tiles.cols:
                t = frames.stop - frames.start + frames.context
                counts[(batch, latent[1], t, rows.stop - rows.start, cols.stop - cols.start)] += latent[0] // batch
    return counts


def compute_seconds(model: PlannerModel, shape: VideoShape, strategy: MemoryStrategy, options: PlanOptions) -> float:
    """Every stage's compute with nothing streamed and the decode untiled (its work, not its memory)."""
    attention, layout = options.attention, model.layout
    flops = sum(model.trace(Call("text_encode", n, shape), attention).flops for n in layout.text_encoders)
    flops += sum(model.trace(Call("condition", n, shape), attention).flops for n in layout.conditioning)
    for name, steps in zip(layout.denoisers, _split_steps(options.steps, len(layout.denoisers))):
        flops += model.trace(Call("denoise", name, shape), attention).flops * steps
    flops += decode_flops_untiled(model, shape, strategy, options)
    return flops / DEVICE_FLOPS_PER_S


def decode_flops_untiled(model: PlannerModel, shape: VideoShape, strategy: MemoryStrategy, options: PlanOptions) -> float:
    """Convolution FLOPs scale with decoded voxels: the tiled pieces' FLOPs less their overlaps."""
    if options.runtime is Runtime.DIFFUSERS:
        latent = model.latent_shape(shape)
        return model.trace(Call("decode", model.layout.vae, shape, latent, strategy.vae_tiling is not None), options.attention).flops
    geometry, latent = model.geometry, model.latent_shape(shape)
    decoded = flops = 0.0
    for piece, count in piece_counts(model, shape, strategy).items():
        flops += model.trace(Call("decode", model.layout.vae, shape, piece), options.attention).flops * count
        decoded += geometry.frames(piece[2]) * piece[3] * piece[4] * piece[0] * count
    return flops * geometry.frames(latent[2]) * latent[3] * latent[4] * latent[0] / decoded


def _traffic(model: PlannerModel, name: str, strategy: MemoryStrategy, stage: list[str]) -> Traffic:
    overlapped = strategy.prefetch_blocks > 0
    units = streamed_unit_bytes(model.module(name), model.blocks(name), strategy)
    resident = model.weights(name).nbytes - sum(units)
    if strategy.offload is OffloadTier.NONE:
        return Traffic()  # onloaded with the stage, as in the baseline
    return Traffic(sum(units), len(units), resident, overlapped)


def _split_steps(steps: int, denoisers: int) -> list[int]:
    """Steps per denoiser; Wan 2.2 A14B hands over at a boundary timestep, about halfway."""
    if denoisers <= 1:
        return [steps] * denoisers
    first = steps // 2
    return [first, steps - first]


def _numel(shape) -> int:
    count = 1
    for n in shape:
        count *= n
    return count
