"""The Sampler's plans for a context-parallel run: the per-GPU planner, not the one-GPU one.

A context-parallel run holds one copy of the pipeline in every rank's process and one in the
coordinator's (ComfyUI's), so its RAM is (ranks + 1) copies, and each GPU's peak is a rank's
(memory.plan.parallel). offload=auto chooses from `parallel_candidates` under those figures; an
explicit strategy gets `plan_parallel` as advice. Balanced placement is planned per GPU too, with
the rows the chart shows (one process: the transformers on the first GPU, the encoder on the second).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ...memory.plan.parallel import GpuSharing, MultiGpu, ParallelPlan, parallel_candidates, parallel_recommended, plan_parallel
from ...memory.plan.parallel_checks import ParallelError
from ...memory.plan.planner import PlanError, PlanOptions
from ...memory.plan.stages import VideoShape
from ...memory.strategy import MemoryStrategy, Parallelism
from ...memory.units import GiB
from ..loader import LoadedPipeline
from ..planning import plan_options, sampling_model
from .balanced import component_bytes
from .ranks import Ranks


def layout_of(strategy: MemoryStrategy, ranks: Ranks) -> MultiGpu:
    return MultiGpu(ranks.degree, strategy.parallel.context_parallel.value)


def rank_device(ranks: Ranks) -> str:
    return "cuda" if ranks.gpus else "cpu"


def choose_parallel(loaded: LoadedPipeline, shape: VideoShape, base: MemoryStrategy, ranks: Ranks,
                    vram_budget_bytes: int, ram_budget_bytes: int, options: PlanOptions = PlanOptions()) -> ParallelPlan:
    """The fastest per-GPU plan that fits every GPU and the RAM of every process; PlanError otherwise. `options`:
    the attention and speed the Sampler plans with (the pipeline's storage and the ranks' device are filled in)."""
    return _fastest(loaded, shape, base, layout_of(base, ranks), rank_device(ranks), vram_budget_bytes,
                    ram_budget_bytes, options)


def choose_balanced(loaded: LoadedPipeline, shape: VideoShape, base: MemoryStrategy, gpus: int, vram_budget_bytes: int,
                    ram_budget_bytes: int, options: PlanOptions = PlanOptions()) -> ParallelPlan:
    """Balanced placement's fastest fitting plan over `gpus` GPUs, from the rows the chart shows
    (`parallel_candidates`: each tier on the transformers' GPU, the prompt encoder whole on the
    second); PlanError otherwise. The budgets are the transformers' GPU's and this process's RAM."""
    return _fastest(loaded, shape, base, MultiGpu(gpus, GpuSharing.BALANCED), "cuda", vram_budget_bytes,
                    ram_budget_bytes, options)


def _fastest(loaded: LoadedPipeline, shape: VideoShape, base: MemoryStrategy, layout: MultiGpu, device: str,
             vram_budget_bytes: int, ram_budget_bytes: int, options: PlanOptions) -> ParallelPlan:
    """The recommended row of the chart's candidates for `layout` (each tier from `base`'s copy settings, planned
    for one process); PlanError naming what does not fit when none does."""
    options = plan_options(loaded, options, device=device)
    one_process = replace(base, offload="model", blocks_to_swap=0, parallel=Parallelism())
    plans, _ = parallel_candidates(sampling_model(loaded), shape, vram_budget_bytes, ram_budget_bytes, layout,
                                   one_process, options)
    best = parallel_recommended(plans, on_disk=options.on_disk)
    if best is None:
        raise PlanError(nothing_fits(plans, layout, vram_budget_bytes, ram_budget_bytes))
    return plans[best]


def plan_balanced(loaded: LoadedPipeline, shape: VideoShape, strategy: MemoryStrategy, gpus: int,
                  vram_budget_bytes: int, ram_budget_bytes: int, options: PlanOptions = PlanOptions()) -> ParallelPlan:
    """The balanced prediction for a strategy the user set (advice, as plan_explicit's)."""
    return plan_parallel(sampling_model(loaded), shape, replace(strategy, parallel=Parallelism()),
                         MultiGpu(gpus, GpuSharing.BALANCED), plan_options(loaded, options, device="cuda"),
                         vram_budget_bytes, ram_budget_bytes)


def plan_explicit(loaded: LoadedPipeline, shape: VideoShape, strategy: MemoryStrategy, ranks: Ranks,
                  vram_budget_bytes: int, ram_budget_bytes: int, options: PlanOptions = PlanOptions()) -> ParallelPlan:
    """The per-GPU prediction for a strategy the user set (advice: the run goes ahead either way); `options` as
    choose_parallel's."""
    return plan_parallel(sampling_model(loaded), shape, replace(strategy, parallel=Parallelism()),
                         layout_of(strategy, ranks), plan_options(loaded, options, device=rank_device(ranks)),
                         vram_budget_bytes, ram_budget_bytes)


@dataclass(frozen=True)
class RankRoom:
    """What one rank's GPU must have free before the ranks load: `total_bytes` (weights and
    activations), of which `weight_bytes` are the weights its warm store may keep."""

    device: torch.device
    total_bytes: int
    weight_bytes: int


def run_plan(loaded: LoadedPipeline, strategy: MemoryStrategy, request, ranks: Ranks) -> ParallelPlan | None:
    """The per-GPU plan of the run the ranks are about to make; None when the planner cannot model
    this pipeline."""
    guided = request.cfg > 1 or (request.cfg_2 or 0) > 1
    shape = VideoShape(request.width, request.height, request.frames, cfg=guided)
    try:
        return plan_explicit(loaded, shape, strategy, ranks, None, None)
    except ValueError:
        return None


def check_parallel_ram(plan: ParallelPlan | None) -> None:
    """ParallelError when the processes' copies of the pipeline together exceed this machine's RAM and
    swap: every rank loads its own copy beside the coordinator's, and a rank the out-of-memory killer
    ends mid-load tells the user only its exit code. (A budget the user set is the planner's to weigh;
    this is the run that can never finish, whatever the tier was set to.)"""
    import psutil

    ram, swap = psutil.virtual_memory().total, psutil.swap_memory().total
    if plan is not None and plan.host_bytes > ram + swap:
        raise ParallelError(
            f"context parallelism over {plan.layout.gpus} ranks with {plan.strategy.describe()} needs "
            f"{_gib(plan.host_bytes)} of RAM: each rank and this process hold their own copy of the pipeline, and "
            f"this machine has {_gib(ram)} of RAM and {_gib(swap)} of swap. Use fewer GPUs (gpus), keep the weights "
            "mapped from their files (the disk tier: the folder's own weight_dtype, or weights_on_disk on Load Video "
            "Files), or set context_parallel to off.")


def rank_rooms(loaded: LoadedPipeline, plan: ParallelPlan | None, ranks: Ranks) -> list[RankRoom]:
    """Each rank GPU's room (for the host's make_room, which inside ComfyUI unloads its own models):
    the per-GPU plan's (`run_plan`) peak and weights, or when the planner cannot model this pipeline,
    the whole pipeline's weights (every rank opens all of them)."""
    if plan is not None:
        rooms = [(g.peak_bytes, g.weights_bytes) for g in plan.gpus]
    else:
        whole = sum(component_bytes(loaded.pipe).values())
        rooms = [(whole, whole)] * ranks.degree
    return [RankRoom(torch.device("cuda", gpu), peak, weights) for gpu, (peak, weights) in zip(ranks.gpus, rooms)]


def nothing_fits(plans: list[ParallelPlan], layout: MultiGpu, vram: int, ram: int) -> str:
    leanest = min(plans, key=lambda p: (p.host_bytes, p.per_gpu_peak_bytes))
    balanced = layout.mode is GpuSharing.BALANCED
    short = []
    if leanest.host_bytes > ram:
        holders = "this process" if balanced else \
            f"{layout.gpus} ranks and this process, each with its own copy of the pipeline"
        short.append(f"RAM {_gib(leanest.host_bytes)} for {holders} (ram_budget_gb: {_gib(ram)})")
    if not all(g.fits(vram) for g in leanest.gpus):
        short.append(f"{_gib(leanest.per_gpu_peak_bytes)} per GPU (vram_budget_gb: {_gib(vram)})")
    fix = "list the roomiest GPU first in gpus" if balanced else "use fewer GPUs, or set context_parallel to off"
    return (f"offload=auto: no tier fits {layout.gpus}-way {layout.mode.value} at {leanest.shape.width}x"
            f"{leanest.shape.height}x{leanest.shape.frames}: the leanest ({leanest.strategy.describe()}) needs "
            + " and ".join(short) + f". Raise the budget, or {fix}.")


def parallel_plan_line(plan: ParallelPlan) -> str:
    fits = "" if plan.fits is None else ("; fits" if plan.fits else "; over budget")
    if plan.layout.mode is GpuSharing.BALANCED:
        return (f"{plan.strategy.describe()} on the transformers' GPU, the text encoder on the second, balanced over "
                f"{plan.layout.gpus} GPUs; peak per GPU {_gib(plan.per_gpu_peak_bytes)}, RAM {_gib(plan.host_bytes)}"
                f"{fits}")
    return (f"{plan.strategy.describe()} per rank, {plan.layout.gpus}-way {plan.layout.mode.value}; peak per GPU "
            f"{_gib(plan.per_gpu_peak_bytes)}, RAM {_gib(plan.host_bytes)} for all processes{fits}")


def _gib(nbytes: int) -> str:
    return f"{nbytes / GiB:.2f} GiB"
