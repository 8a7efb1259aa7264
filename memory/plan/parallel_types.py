"""The vocabulary of plans per GPU: how the GPUs share a run, the link between them, each GPU's plan.

Every assumed figure is a named constant with where it comes from (no GPU was available here).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from .parallel_checks import RING, ULYSSES, CommBytes, ParallelError
from .planner import StagePlan, VideoShape
from ..strategy import MemoryStrategy
from ..units import GiB, MiB


class GpuSharing(str, Enum):
    ULYSSES = ULYSSES  # context parallel: heads exchanged by all-to-all, whole sequence per head
    RING = RING  # context parallel: keys and values gathered, attention in N chunks
    BALANCED = "balanced"  # no parallelism: whole components on different GPUs


@dataclass(frozen=True)
class Interconnect:
    name: str
    bytes_per_s: float  # what one GPU sends per second to its peers in an all-to-all
    latency_s: float = 25e-6  # per collective: NCCL launch + handshake (nccl-tests, small messages: 10-30 us)


# Assumed per-GPU bandwidths. Change with `vidmem plan --interconnect` / `--interconnect-gbps`.
# PCIe 4.0 x16: 31.5 GB/s raw per direction, ~25 GB/s measured with P2P; GeForce cards without P2P
# route through host memory at about half that; boards that split lanes x8/x8 halve it again.
# PCIe 5.0 x16: twice PCIe 4.0. NVLink: A100 NVLink 3 is 600 GB/s both directions (300 each way);
# H100 NVLink 4 is 900 GB/s (450 each way); NVSwitch gives every GPU its full NVLink bandwidth.
INTERCONNECTS = {
    "pcie4": Interconnect("PCIe 4.0 x16", 25e9),
    "pcie5": Interconnect("PCIe 5.0 x16", 50e9),
    "nvlink": Interconnect("NVLink 3 (A100)", 300e9),
}

# NCCL's communicator on each GPU, outside PyTorch's allocator: a fixed part (kernels, proxy
# state; ~200-300 MiB reported on PyTorch's forum for one process group) and per peer its
# NCCL_BUFFSIZE (4 MiB default, NCCL's environment docs) send + receive buffers on each of its
# channels (up to 8 on PCIe). An estimate, not a measurement: no GPU was available here.
NCCL_FIXED_BYTES = 256 * MiB
NCCL_BYTES_PER_PEER = 2 * 4 * MiB * 8


def NCCL_BYTES(gpus: int) -> int:  # noqa: N802 - a constant of the GPU count
    return 0 if gpus <= 1 else NCCL_FIXED_BYTES + (gpus - 1) * NCCL_BYTES_PER_PEER


@dataclass(frozen=True)
class MultiGpu:
    """How many GPUs, and how they share the run."""

    gpus: int
    mode: GpuSharing = GpuSharing.ULYSSES
    interconnect: Interconnect = INTERCONNECTS["pcie4"]

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", GpuSharing(self.mode))
        if self.gpus < 1:
            raise ParallelError(f"gpus={self.gpus} must be at least 1.")
        if self.mode is GpuSharing.BALANCED and self.gpus < 2:
            raise ParallelError("balanced placement needs at least 2 GPUs; with one GPU, plan without --gpus.")
        if not self.interconnect.bytes_per_s > 0:
            raise ParallelError(f"interconnect bandwidth {self.interconnect.bytes_per_s} must be positive (bytes/s).")

    @classmethod
    def of(cls, parallel, visible_gpus: int, interconnect: Interconnect = INTERCONNECTS["pcie4"]) -> "MultiGpu":
        """What a MemoryStrategy's `parallel` (vidmem.memory.strategy.Parallelism) asks for on a machine with
        `visible_gpus`: its listed GPUs, else its degree, else all of them; context parallel or balanced."""
        count = len(parallel.gpus) if parallel.gpus else (parallel.degree or visible_gpus)
        mode = parallel.context_parallel.value if parallel.context_parallel_on else GpuSharing.BALANCED
        return cls(count, mode, interconnect)


@dataclass(frozen=True)
class GpuPlan:
    """One GPU: the components it holds and its stages (a stage with no phase does not run there)."""

    index: int
    components: tuple[str, ...]
    stages: tuple[StagePlan, ...]
    comm_bytes: int = 0  # NCCL's buffers, counted in every stage's device figure
    denoisers: tuple[str, ...] = ()  # the transformer phases' labels (conditioning encoders also compute in denoise)

    @property
    def peak_bytes(self) -> int:
        return max((s.device_bytes for s in self.stages), default=0)

    def stage(self, name: str) -> StagePlan:
        return next(s for s in self.stages if s.name == name)

    @property
    def weights_bytes(self) -> int:
        """Weights on the GPU while a transformer computes (the heaviest; 0 if none computes here)."""
        return max((p.weights_bytes for p in self._transformer_phases()), default=0)

    @property
    def denoise_activation_bytes(self) -> int:
        """Traced bytes of a transformer call at its peak (activations and collective buffers)."""
        return max((p.peak.allocated - sum(p.resident) for p in self._transformer_phases()), default=0)

    def _transformer_phases(self):
        return [p for p in self.stage("denoise").phases if p.label in self.denoisers]

    def fits(self, vram: int | None) -> bool:
        return all(s.fits(vram) for s in self.stages)


@dataclass(frozen=True)
class ParallelPlan:
    model: str
    shape: VideoShape
    layout: MultiGpu
    strategy: MemoryStrategy
    gpus: tuple[GpuPlan, ...]
    seconds: float
    single_seconds: float | None  # the reference run on one GPU (None: nothing fits one GPU)
    comm: CommBytes = CommBytes(0, 0, 0)  # per rank and forward pass
    comm_seconds: float = 0.0  # the whole run's collectives
    host_bytes: int = 0  # anonymous RAM of every process together
    page_cache_bytes: int = 0  # memory-mapped files, shared between the ranks' processes
    vram_budget_bytes: int | None = None
    ram_budget_bytes: int | None = None

    @property
    def per_gpu_peak_bytes(self) -> int:
        return max(g.peak_bytes for g in self.gpus)

    @property
    def on_disk(self) -> bool:
        """Weights memory-mapped from their files (the disk tier): only such a plan holds page cache."""
        return self.page_cache_bytes > 0

    @property
    def speedup(self) -> float | None:
        return round(self.single_seconds / self.seconds, 2) if self.single_seconds and self.seconds else None

    @property
    def fits(self) -> bool | None:
        if self.vram_budget_bytes is None and self.ram_budget_bytes is None:
            return None
        ram_ok = self.ram_budget_bytes is None or self.host_bytes <= self.ram_budget_bytes
        return ram_ok and all(g.fits(self.vram_budget_bytes) for g in self.gpus)

    def describe(self) -> str:
        layout, s = self.layout, self.shape
        head = (f"{self.model} {s.width}x{s.height}x{s.frames} on {layout.gpus} GPUs, {layout.mode.value}: "
                f"{self.strategy.describe()} per GPU")
        rows = [f"  GPU {g.index}: peak {_gib(g.peak_bytes)} (denoise: weights {_gib(g.weights_bytes)}, activations "
                f"{_gib(g.denoise_activation_bytes)}, NCCL {_gib(g.comm_bytes)}) {', '.join(g.components)}"
                for g in self.gpus]
        speed = f"x{self.speedup:.2f} vs one GPU" if self.speedup else "one GPU: nothing fits"
        tail = f"  {self.seconds:.0f} s estimated, {speed}; RAM {_gib(self.host_bytes)} for all processes"
        return "\n".join([head, *rows, tail])

    def as_dict(self) -> dict:
        return {
            "gpus": self.layout.gpus, "cp": self.layout.mode.value, "tier": self.strategy.offload.value,
            "blocks_to_swap": self.strategy.blocks_to_swap, "text_encoder": self.strategy.text_encoder.value,
            "vae_tiling": self.strategy.vae_tiling is not None,
            "interconnect": {"name": self.layout.interconnect.name, "gbps": self.layout.interconnect.bytes_per_s / 1e9},
            "per_gpu_peak_bytes": self.per_gpu_peak_bytes, "seconds": round(self.seconds, 2),
            "single_gpu_seconds": None if self.single_seconds is None else round(self.single_seconds, 2),
            "speedup": self.speedup, "all_to_all_bytes_per_pass": self.comm.total,
            "comm_seconds": round(self.comm_seconds, 2), "ram_bytes": self.host_bytes,
            "page_cache_bytes": self.page_cache_bytes, "on_disk": self.on_disk, "fits": self.fits,
            "ranks": [{"gpu": g.index, "components": list(g.components), "peak_bytes": g.peak_bytes,
                       "denoise_weights_bytes": g.weights_bytes, "denoise_activation_bytes": g.denoise_activation_bytes,
                       "nccl_bytes": g.comm_bytes, "stages": {st.name: st.device_bytes for st in g.stages}}
                      for g in self.gpus],
        }


def _gib(nbytes: int) -> str:
    return f"{nbytes / GiB:.1f} GiB"
