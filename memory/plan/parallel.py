"""Plans per GPU: context parallelism (Ulysses or ring, degree N) and balanced placement.

How it works. Context parallelism (diffusers' `ContextParallelConfig`, one rank per GPU, every rank
running the whole pipeline as diffusers' examples do): each rank holds all the weights, under its own
offload tier (the single-GPU residency, unchanged), and runs the text encoder and the decode as one
GPU would. Only the denoiser's forward is split: its per-rank allocation stream is traced on meta with
the sequence split as diffusers splits it and the collective's own buffers (`parallel_trace.py`), and
replayed through the allocator model with the resident weights, so the figure is traced, not a
single-GPU peak divided by N. NCCL's communicator buffers sit beside it (`NCCL_BYTES`). Time: each
rank's compute is its traced FLOPs (1/N of the sequence's, plus what every rank repeats: embeddings,
the text keys and values); the all-to-all bytes (`parallel_checks.comm_bytes`) cross the interconnect
with compute stopped, as diffusers waits on every collective at once.

Balanced placement (`device_map="balanced"`): no parallelism, whole components on different GPUs
(`balanced_placement`): each GPU's peak is its own components' weights plus the largest call among
them; nothing is offloaded, and the time is one GPU's with everything resident.

    plan = plan_parallel(load_model("wan2.1-t2v-14b"), VideoShape(1280, 720, 81), MemoryStrategy(), MultiGpu(4))
    print(plan.describe())
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum

from .parallel_checks import (RING, ULYSSES, CommBytes, ParallelError, check_context_parallel, comm_bytes,
                              context_parallel_refusal, sequence_tokens)
from .parallel_layout import balanced_placement, balanced_stages, balanced_tiling, with_resident
from .parallel_trace import RankCall, context_parallel_trace
from .planner import Plan, PlannerModel, PlanOptions, StagePlan, VideoShape, candidate_plans, plan_run, recommended
from .stages import phase
from .types import Call
from ..strategy import MemoryStrategy, OffloadTier, TextEncoderPlacement
from ..units import GiB, MiB

__all__ = ["INTERCONNECTS", "NCCL_BYTES", "CommBytes", "GpuPlan", "Interconnect", "MultiGpu", "Parallelism",
           "ParallelError", "ParallelPlan", "balanced_placement", "check_context_parallel", "comm_bytes",
           "context_parallel_refusal", "parallel_candidates", "parallel_recommended", "plan_parallel", "plan_seconds",
           "sequence_tokens"]


class Parallelism(str, Enum):
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
    mode: Parallelism = Parallelism.ULYSSES
    interconnect: Interconnect = INTERCONNECTS["pcie4"]

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", Parallelism(self.mode))
        if self.gpus < 1:
            raise ParallelError(f"gpus={self.gpus} must be at least 1.")
        if self.mode is Parallelism.BALANCED and self.gpus < 2:
            raise ParallelError("balanced placement needs at least 2 GPUs; with one GPU, plan without --gpus.")
        if not self.interconnect.bytes_per_s > 0:
            raise ParallelError(f"interconnect bandwidth {self.interconnect.bytes_per_s} must be positive (bytes/s).")


@dataclass(frozen=True)
class GpuPlan:
    """One GPU: the components it holds, its stages (a context-parallel rank runs every stage)."""

    index: int
    components: tuple[str, ...]
    stages: tuple[StagePlan, ...]
    comm_bytes: int = 0  # NCCL's buffers, counted in every stage's device figure

    @property
    def peak_bytes(self) -> int:
        return max((s.device_bytes for s in self.stages), default=0)

    def stage(self, name: str) -> StagePlan:
        return next(s for s in self.stages if s.name == name)

    @property
    def weights_bytes(self) -> int:
        """Weights on the GPU while the denoiser computes (the heaviest denoiser phase; 0 if none here)."""
        return max((p.weights_bytes for p in self.stage("denoise").phases), default=0)

    @property
    def denoise_activation_bytes(self) -> int:
        """Traced bytes of the denoise call at its peak (activations and collective buffers)."""
        phases = self.stage("denoise").phases
        return max((p.peak.allocated - sum(p.resident) for p in phases), default=0)

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
            "page_cache_bytes": self.page_cache_bytes, "fits": self.fits,
            "ranks": [{"gpu": g.index, "components": list(g.components), "peak_bytes": g.peak_bytes,
                       "denoise_weights_bytes": g.weights_bytes, "denoise_activation_bytes": g.denoise_activation_bytes,
                       "nccl_bytes": g.comm_bytes, "stages": {st.name: st.device_bytes for st in g.stages}}
                      for g in self.gpus],
        }


def plan_parallel(model: PlannerModel, shape: VideoShape, strategy: MemoryStrategy, layout: MultiGpu,
                  options: PlanOptions = PlanOptions(), vram_budget_bytes: int | None = None,
                  ram_budget_bytes: int | None = None, reference: Plan | None = None) -> ParallelPlan:
    """Each GPU's peak and the run's time for `model` at `shape` on `layout.gpus` GPUs.

    `reference` is the one-GPU plan the speedup is measured against (default: `strategy` on one GPU).
    One GPU under context parallelism is the single-GPU plan, unchanged."""
    if layout.mode is not Parallelism.BALANCED:  # refused before anything is traced
        check_context_parallel(model, shape, layout.gpus, layout.mode.value)
    single = plan_run(model, shape, strategy, options)
    reference = single if reference is None else reference
    budgets = (vram_budget_bytes, ram_budget_bytes)
    if layout.mode is Parallelism.BALANCED:
        return _balanced(model, shape, strategy, layout, options, budgets, reference)
    return _context_parallel(model, shape, strategy, layout, options, budgets, single, reference)


def _context_parallel(model, shape, strategy, layout, options, budgets, single: Plan, reference: Plan) -> ParallelPlan:
    vram, ram = budgets
    n, nccl = layout.gpus, NCCL_BYTES(layout.gpus)
    per_rank_ram = None if ram is None else ram // n
    if n == 1:
        rank = plan_run(model, shape, strategy, options, vram, ram)
        stages, comm, comm_s = rank.stages, CommBytes(0, 0, 0), 0.0
    else:
        stages = tuple(with_resident(_rank_stage(model, shape, st, layout, options), (nccl,), options).within(vram)
                       for st in single.stages)
        rank = Plan(model.name, shape, strategy, stages, single.baseline_seconds, vram, per_rank_ram, options)
        comm, comm_s = _comm(model, shape, rank, layout)
    # every rank holds every component and runs every stage
    ranks = tuple(GpuPlan(i, model.layout.all, stages, nccl) for i in range(n))
    anon = rank.peak_ram_bytes * n  # one process per rank, each with its own copy (page cache is shared)
    return ParallelPlan(model.name, shape, layout, strategy, ranks, plan_seconds(rank) + comm_s,
                        plan_seconds(reference) if reference.fits is not False else None, comm, comm_s, anon,
                        rank.peak_page_cache_bytes, vram, ram)


def _rank_stage(model, shape, stage: StagePlan, layout: MultiGpu, options: PlanOptions) -> StagePlan:
    """The single-GPU stage with each denoiser's phase and FLOPs as one rank runs them."""
    if stage.name != "denoise":
        return stage
    denoisers = model.layout.denoisers
    phases, scale = [], {}
    for p in stage.phases:
        if p.label not in denoisers:
            phases.append(p)
            continue
        call = RankCall("denoise", p.label, shape, degree=layout.gpus, mode=layout.mode.value)
        with context_parallel_trace(model.traced_module(p.label), layout.gpus, layout.mode.value):
            ranked = phase(model, call, list(p.resident[1:]), options, p.label)  # resident[0]: cuBLAS workspace
        whole = model.trace(Call("denoise", p.label, shape), options.attention).flops
        scale[p.label] = model.trace(call, options.attention).flops / whole if whole else 1.0
        phases.append(ranked)
    work = list(stage.work)
    for index, name in zip(range(len(work) - len(denoisers), len(work)), denoisers):
        work[index] = replace(work[index], flops=work[index].flops * scale[name])
    return replace(stage, phases=tuple(phases), work=tuple(work))


def _comm(model, shape, rank: Plan, layout: MultiGpu) -> tuple[CommBytes, float]:
    """Bytes per pass of the heaviest denoiser, and the whole run's collective time."""
    stage = rank.stage("denoise")
    denoisers = model.layout.denoisers
    works = stage.work[len(stage.work) - len(denoisers):]
    link, seconds, heaviest = layout.interconnect, 0.0, CommBytes(0, 0, 0)
    for name, work in zip(denoisers, works):
        sent = comm_bytes(model, shape, name, layout.gpus, layout.mode.value)
        seconds += work.passes * (sent.total / link.bytes_per_s + sent.collectives * link.latency_s)
        heaviest = max(heaviest, sent, key=lambda c: c.total)
    return heaviest, seconds


def plan_seconds(plan: Plan) -> float:
    """Estimated wall time of a plan's stages (what est_slowdown divides by the baseline)."""
    return sum(s.seconds(plan.disk_read(s)) for s in plan.stages)


def _balanced(model, shape, strategy, layout, options, budgets, reference: Plan) -> ParallelPlan:
    vram, ram = budgets
    resident = replace(strategy, offload=OffloadTier.NONE, blocks_to_swap=0, text_encoder=TextEncoderPlacement.DEVICE)
    placement = balanced_placement(model.layout, layout.gpus)
    if vram is not None:
        holder = next(names for names in placement if model.layout.vae in names)
        resident = balanced_tiling(model, shape, resident, holder, options, vram)
    whole = plan_run(model, shape, resident, options, None, ram)  # the same work, nothing offloaded
    gpus = tuple(GpuPlan(i, names, tuple(st.within(vram) for st in balanced_stages(model, shape, resident, names, options)))
                 for i, names in enumerate(placement))
    return ParallelPlan(model.name, shape, layout, resident, gpus, plan_seconds(whole),
                        plan_seconds(reference) if reference.fits is not False else None,
                        host_bytes=whole.peak_ram_bytes, page_cache_bytes=whole.peak_page_cache_bytes,
                        vram_budget_bytes=vram, ram_budget_bytes=ram)


def parallel_candidates(model: PlannerModel, shape: VideoShape, vram_budget_bytes: int, ram_budget_bytes: int,
                        layout: MultiGpu, base: MemoryStrategy = MemoryStrategy(),
                        options: PlanOptions = PlanOptions()) -> tuple[list[ParallelPlan], Plan | None]:
    """One plan per tier on `layout` (each rank's fewest swapped blocks), and the one-GPU plan the
    speedup is measured against (the recommended single-GPU plan; None when nothing fits one GPU)."""
    if layout.mode is not Parallelism.BALANCED:
        check_context_parallel(model, shape, layout.gpus, layout.mode.value)
    singles = candidate_plans(model, shape, vram_budget_bytes, ram_budget_bytes, base, options)
    best = recommended(singles)
    reference = singles[best] if best is not None else singles[0]
    budgets = (vram_budget_bytes, ram_budget_bytes)
    if layout.mode is Parallelism.BALANCED:
        return [plan_parallel(model, shape, base, layout, options, *budgets, reference)], singles[best] if best is not None else None
    rank_vram = vram_budget_bytes - NCCL_BYTES(layout.gpus)
    per_rank = candidate_plans(model, shape, rank_vram, ram_budget_bytes // layout.gpus, base, options)
    plans = []
    for single in per_rank:
        strategy = single.strategy
        if strategy.offload is OffloadTier.BLOCK_SWAP:
            strategy = _fewest_rank_blocks(model, shape, strategy, layout, single.options, vram_budget_bytes)
        plan = plan_parallel(model, shape, strategy, layout, single.options, *budgets, reference)
        plans.append(plan if best is not None else replace(plan, single_seconds=None))
    return plans, singles[best] if best is not None else None


def _fewest_rank_blocks(model, shape, strategy: MemoryStrategy, layout: MultiGpu, options, vram: int) -> MemoryStrategy:
    """Binary search over each rank's denoise stage: its activations are smaller than one GPU's."""
    low, high = 1, strategy.blocks_to_swap
    while low < high:
        middle = (low + high) // 2
        candidate = replace(strategy, blocks_to_swap=middle)
        plan = plan_parallel(model, shape, candidate, layout, options, vram)
        low, high = (low, middle) if plan.gpus[0].stage("denoise").fits(vram) else (middle + 1, high)
    return replace(strategy, blocks_to_swap=low)


def parallel_recommended(plans: list[ParallelPlan]) -> int | None:
    """The fitting plan with the least estimated time, the earlier on a tie."""
    fitting = [(round(p.seconds, 1), i) for i, p in enumerate(plans) if p.fits]
    return min(fitting)[1] if fitting else None


def _gib(nbytes: int) -> str:
    return f"{nbytes / GiB:.1f} GiB"

