"""The planner's vocabulary: shapes, calls, the model protocol, options, phases and stage plans."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Protocol

from torch import nn

from ..accounting import Attention, Trace
from .allocator import AllocatorPeak, WeightTimeline, replay
from .costs import CPU_RATES, CUDA_CONTEXT_BYTES, GPU_RATES, NVME_BYTES_PER_S, DeviceRates, DiskRead, MeasuredSpeed, Work
from .schedule import ComponentWeights, Order, Streaming
from ..storage import storage_format
from ..strategy import TextEncoderPlacement
from ..vae_tiles import VaeGeometry


class Allocator(str, Enum):
    NATIVE = "native"  # PyTorch's caching allocator (torch default): what it reserves
    ASYNC = "cudaMallocAsync"  # ComfyUI's default backend: live bytes (the driver pool is not modelled)
    AUTO = "auto"  # the backend this process runs (probed when a phase is planned; native without CUDA)

    def resolved(self) -> "Allocator":
        """NATIVE or ASYNC: AUTO asks torch which backend this process runs (PYTORCH_CUDA_ALLOC_CONF)."""
        if self is not Allocator.AUTO:
            return self
        from ..telemetry import allocator_backend  # probed at plan time, never at import

        return Allocator(allocator_backend())


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
    # Context windows (memory/windows.py), in video frames; 0: off. The denoiser sees `window`
    # frames at a time, so its activations follow the window; latents, conditioning and decode
    # stay the whole clip's.
    window: int = 0
    window_overlap: int = 0

    @property
    def windowed(self) -> bool:
        return 0 < self.window < self.frames

    def one_window(self) -> "VideoShape":
        """The shape one denoiser pass sees: the window's frames (the whole clip when not windowed)."""
        return replace(self, frames=self.window, window=0, window_overlap=0) if self.windowed else self


@dataclass(frozen=True)
class Call:
    """One traced call: `kind` in text_encode | condition | denoise | decode | decode_context | decode_stream |
    postprocess ("decode": `vae.decode` on a piece; the other two: a family's staged decode, `stages.decode_calls`)."""

    kind: str
    component: str
    shape: VideoShape
    piece: tuple[int, ...] | None = None  # decode: latent piece [b, C, t, h, w]
    vae_tiling: bool = False  # decode with the VAE's own (diffusers) tiling
    chunks: int = 1  # denoise: token slices per block (MemoryStrategy.activation_chunks, resolved)
    parked: bool = False  # decode_context: its output goes to the host as it is made (a decode in several pieces)


@dataclass(frozen=True)
class ModelLayout:
    """Which components a model has and the role each plays in a run."""

    text_encoders: tuple[str, ...]
    denoisers: tuple[str, ...]
    vae: str = "vae"
    placed_encoders: tuple[str, ...] = ()  # encode conditioning only (FamilySpec.encoders); see stage_components
    conditioning: tuple[str, ...] = ()  # run before the loop for image-to-video (image encoder, VAE)
    call_encoders: tuple[str, ...] = ()  # run by every call before the loop (LTX-2's text connectors)

    @property
    def all(self) -> tuple[str, ...]:
        names = (*self.text_encoders, *self.placed_encoders, *self.conditioning, *self.call_encoders, *self.denoisers,
                 self.vae)
        return tuple(dict.fromkeys(names))

    def stored_as(self, storage: str) -> dict[str, str]:
        """`storage` for the transformer(s) and the text encoder(s), as `--weights` applies it; the
        VAE and image encoder stay at their dtype (their files are small and ship at 16 bits)."""
        return {name: storage for name in (*self.text_encoders, *self.denoisers)}


class PlannerModel(Protocol):
    """What the planner needs from a model; `vidmem.pipelines.configs.load_model` builds one."""

    name: str
    dtype_name: str
    layout: ModelLayout
    geometry: VaeGeometry
    vae_stream_batch: int | None  # the decode's chunks stream the VAE's caches (no context frames); None: vae.decode per piece
    vae_shared_context: bool  # the staged decode runs frame-wide layers once on the whole latent before its pieces
    vae_min_tile: int  # the family's smallest decode tile in px (FamilySpec.min_decode_tile; 0: none)

    def check_shape(self, shape: VideoShape) -> None: ...  # raise ValueError naming the fix
    def weights(self, component: str, storage: str | None = None) -> ComponentWeights: ...  # as stored
    def dtype_bytes(self, component: str) -> int: ...  # bytes per element of the dtype it computes in
    def module(self, component: str) -> nn.Module: ...  # full size, on meta
    def blocks(self, component: str) -> nn.ModuleList | None: ...  # the swappable blocks (denoisers)
    def stream_order(self, call: Call) -> Order | None: ...  # the module order `call` ran in, once traced
    def trace(self, call: Call, attention: Attention) -> Trace: ...  # memoised by the model
    def latent_shape(self, shape: VideoShape) -> tuple[int, int, int, int, int]: ...  # as the VAE decodes
    def forward_passes(self, shape: VideoShape) -> int: ...  # denoiser forwards per step
    # The components the sampling stage places on the device, as the engine applies the strategy
    # to them (vidmem.pipelines.stages: one declaration for both); encode_text=False: cached prompts.
    def stage_components(self, text_encoder: TextEncoderPlacement, encode_text: bool = True) -> tuple[str, ...]: ...


@dataclass(frozen=True)
class CacheState:
    """What a step cache keeps on the device between one denoiser's passes, per cache context (each
    guidance branch, each context window), from its first pass to the end of its last: `hidden`
    tensors of the blocks' hidden states (every token at the blocks' width, in the compute dtype:
    MagCache's head input and residual, First Block Cache's head output and the two residuals) and
    `output` float32 tensors of the denoiser's output (TaylorSeer's factors, one per order and one)."""

    hidden: int = 0
    output: int = 0


@dataclass(frozen=True)
class PlanOptions:
    """How the run is set up beyond the strategy: kernels, allocator, and how weights are stored.

    `storage` maps components to a StorageFormat name (a Mapping is accepted and kept as sorted
    pairs); components not named are counted at the compute dtype. `on_disk`: the weights stay
    memory-mapped in their files (the disk tier): page cache instead of anonymous RAM, read again
    from the disk at `disk_bytes_per_s` when the page cache cannot keep them. `device` is the torch
    device type the run computes on: on "cpu" nothing is copied to a device, so memory-mapped
    weights are used in place (page cache, not device bytes) and compute, copies and upcasts
    run at the CPU's rates. `speed`: the Speed node's choices as measured on this device, which the
    denoiser's time estimate follows (1.0 where nothing is measured). `cache_state`: what the step
    cache keeps on the device per denoiser (pairs, as `storage`; a denoiser not named keeps nothing).
    """

    attention: Attention = Attention.FUSED
    allocator: Allocator = Allocator.AUTO  # follows the process's allocator backend unless told
    runtime: Runtime = Runtime.VIDMEM
    steps: int = 50
    storage: tuple[tuple[str, str], ...] = ()
    on_disk: bool = False
    disk_bytes_per_s: float = NVME_BYTES_PER_S
    device: str = "cuda"
    speed: MeasuredSpeed = MeasuredSpeed()
    cache_state: tuple[tuple[str, CacheState], ...] = ()

    def __post_init__(self) -> None:
        pairs = self.storage.items() if isinstance(self.storage, Mapping) else self.storage
        pairs = tuple(sorted((str(component), str(name)) for component, name in pairs))
        for _, name in pairs:
            storage_format(name)  # ValueError naming the formats vidmem reads
        object.__setattr__(self, "storage", pairs)
        kept = self.cache_state.items() if isinstance(self.cache_state, Mapping) else self.cache_state
        object.__setattr__(self, "cache_state", tuple(sorted((str(name), state) for name, state in kept)))
        if not self.disk_bytes_per_s > 0:
            raise ValueError(f"disk_bytes_per_s={self.disk_bytes_per_s} must be positive, e.g. 3e9 for an NVMe SSD.")

    @property
    def on_cpu(self) -> bool:
        return self.device == "cpu"

    @property
    def rates(self) -> DeviceRates:
        return CPU_RATES if self.on_cpu else GPU_RATES

    @property
    def weights_in_place(self) -> bool:
        """Weights computed where they lie: memory-mapped files on a CPU device are no device bytes."""
        return self.on_cpu and self.on_disk

    def storage_of(self, component: str) -> str | None:
        return dict(self.storage).get(component)

    def cache_state_of(self, denoiser: str) -> CacheState:
        return dict(self.cache_state).get(denoiser, CacheState())

    def compute_budget(self, vram: int | None, ram: int | None) -> int | None:
        """The bytes the compute may hold. On a CPU device the compute's memory is the RAM that the
        process's anonymous bytes share, so its budget is the RAM budget (the VRAM budget only stands
        in where no RAM budget is given): a CPU run needs about the sum of both (StagePlan.ram_bytes)."""
        if self.on_cpu:
            return ram if ram is not None else vram
        return vram

    def disk(self, cache_bytes: int | None, cold: bool = False) -> DiskRead | None:
        """How weights are read when on disk, with `cache_bytes` of page cache for them."""
        return DiskRead(self.disk_bytes_per_s, cache_bytes, cold) if self.on_disk else None


@dataclass(frozen=True)
class Phase:
    """One component computing inside a stage, with what is resident meanwhile."""

    label: str
    weights_bytes: int
    peak: AllocatorPeak
    device_bytes: int  # CUDA context + allocator footprint
    resident: tuple[int, ...] = field(repr=False, default=())
    events: tuple[int, ...] = field(repr=False, default=())
    held: tuple[int, ...] = field(repr=False, default=())  # evicted, still read by the GPU: reserved only
    streaming: Streaming | None = field(repr=False, default=None)  # what the sequential tier streams meanwhile
    timeline: WeightTimeline | None = field(repr=False, default=None)  # where it comes and goes among `events`
    # Of `weights_bytes`, the host tensors themselves, already in the stage's host_bytes: on a CPU device
    # CpuBackend.copy_group hands the compute the host copies (no copy), so they are counted once.
    in_host_bytes: int = 0

    def fits(self, budget: int) -> bool:
        return self.within(budget).device_bytes <= budget

    def within(self, budget: int) -> "Phase":
        """This phase on a device of `budget` bytes: near the limit the allocator releases its cached
        segments and retries, so a run can fit although its unlimited reservation would not."""
        if self.device_bytes <= budget or CUDA_CONTEXT_BYTES + self.peak.allocated > budget:
            return self
        capped = replay(self.resident, self.events, budget - CUDA_CONTEXT_BYTES, self.held, self.timeline)
        if capped.out_of_memory:
            return self
        return replace(self, peak=capped, device_bytes=CUDA_CONTEXT_BYTES + capped.reserved)


@dataclass(frozen=True)
class StagePlan:
    """One stage: its device phases, its RAM, and the work that sets its time.

    `host_bytes` is anonymous memory (the process's own: runtime, weights copied at load, pinned
    buffers, activations on the CPU): what must fit the RAM budget. `page_cache_bytes` are weights
    memory-mapped from their files (the disk tier): the kernel reclaims them under pressure, so
    they never decide a fit; what the budget cannot keep of them is read again (see `seconds`).
    `on_cpu`: the phases compute on the CPU, in the same RAM as `host_bytes` (see `ram_bytes`).
    """

    name: str
    phases: tuple[Phase, ...]
    host_bytes: int
    page_cache_bytes: int = 0
    work: tuple[Work, ...] = ()
    on_cpu: bool = False

    def seconds(self, disk: DiskRead | None = None) -> float:
        return sum(w.seconds(disk) for w in self.work)

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

    @property
    def ram_bytes(self) -> int:
        """Anonymous RAM the stage needs. On a CPU device its compute holds RAM too: the worst phase's
        bytes beyond the weights `host_bytes` already counts (Phase.in_host_bytes) come on top."""
        if not self.on_cpu:
            return self.host_bytes
        return self.host_bytes + max((p.device_bytes - p.in_host_bytes for p in self.phases), default=0)

    def footprint(self, budget: int | None) -> int:
        """What the stage needs of a compute device of `budget` bytes (PlanOptions.compute_budget): on a
        GPU its worst phase near that limit (Phase.within); on a CPU the RAM of compute and process together."""
        if self.on_cpu:
            return self.ram_bytes
        return max((p.within(budget).device_bytes for p in self.phases), default=0)

    def fits(self, budget: int | None) -> bool:
        """Whether the stage fits a compute device of `budget` bytes: VRAM on a GPU (every phase near
        that limit); on a CPU the RAM, which its compute shares with the process (PlanOptions.compute_budget)."""
        return budget is None or self.footprint(budget) <= budget

    def within(self, vram: int | None) -> "StagePlan":
        return self if vram is None else replace(self, phases=tuple(p.within(vram) for p in self.phases))
