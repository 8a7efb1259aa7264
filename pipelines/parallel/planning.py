"""The Sampler's plans for a context-parallel run: the per-GPU planner, not the one-GPU one.

A context-parallel run holds one copy of the pipeline in every rank's process and one in the
coordinator's (ComfyUI's), so its RAM is (ranks + 1) copies, and each GPU's peak is a rank's
(memory.plan.parallel). offload=auto chooses from `parallel_candidates` under those figures; an
explicit strategy gets `plan_parallel` as advice.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ...memory.plan.parallel import MultiGpu, ParallelPlan, parallel_candidates, parallel_recommended, plan_parallel
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
    layout = layout_of(base, ranks)
    one_process = replace(base, offload="model", blocks_to_swap=0, parallel=Parallelism())
    options = plan_options(loaded, options, device=rank_device(ranks))
    plans, _ = parallel_candidates(sampling_model(loaded), shape, vram_budget_bytes, ram_budget_bytes, layout,
                                   one_process, options)
    best = parallel_recommended(plans, on_disk=options.on_disk)
    if best is None:
        raise PlanError(nothing_fits(plans, layout, vram_budget_bytes, ram_budget_bytes))
    return plans[best]


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


def rank_rooms(loaded: LoadedPipeline, strategy: MemoryStrategy, request, ranks: Ranks) -> list[RankRoom]:
    """Each rank GPU's room (for the host's make_room, which inside ComfyUI unloads its own models):
    the per-GPU plan's peak and weights, or when the planner cannot model this pipeline, the whole
    pipeline's weights (every rank opens all of them)."""
    guided = request.cfg > 1 or (request.cfg_2 or 0) > 1
    shape = VideoShape(request.width, request.height, request.frames, cfg=guided)
    try:
        rooms = [(g.peak_bytes, g.weights_bytes) for g in plan_explicit(loaded, shape, strategy, ranks, None, None).gpus]
    except ValueError:
        whole = sum(component_bytes(loaded.pipe).values())
        rooms = [(whole, whole)] * ranks.degree
    return [RankRoom(torch.device("cuda", gpu), peak, weights) for gpu, (peak, weights) in zip(ranks.gpus, rooms)]


def nothing_fits(plans: list[ParallelPlan], layout: MultiGpu, vram: int, ram: int) -> str:
    leanest = min(plans, key=lambda p: (p.host_bytes, p.per_gpu_peak_bytes))
    short = []
    if leanest.host_bytes > ram:
        short.append(f"RAM {_gib(leanest.host_bytes)} for {layout.gpus} ranks and this process, each with its own copy "
                     f"of the pipeline (ram_budget_gb: {_gib(ram)})")
    if not all(g.fits(vram) for g in leanest.gpus):
        short.append(f"{_gib(leanest.per_gpu_peak_bytes)} per GPU (vram_budget_gb: {_gib(vram)})")
    return (f"offload=auto: no tier fits {layout.gpus}-way {layout.mode.value} at {leanest.shape.width}x"
            f"{leanest.shape.height}x{leanest.shape.frames}: the leanest ({leanest.strategy.describe()}) needs "
            + " and ".join(short) + ". Raise the budget, use fewer GPUs, or set context_parallel to off.")


def parallel_plan_line(plan: ParallelPlan) -> str:
    fits = "" if plan.fits is None else ("; fits" if plan.fits else "; over budget")
    return (f"{plan.strategy.describe()} per rank, {plan.layout.gpus}-way {plan.layout.mode.value}; peak per GPU "
            f"{_gib(plan.per_gpu_peak_bytes)}, RAM {_gib(plan.host_bytes)} for all processes{fits}")


def _gib(nbytes: int) -> str:
    return f"{nbytes / GiB:.2f} GiB"
