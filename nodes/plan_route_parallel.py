"""The live plan over several GPUs: what GET /vidmem/plan answers when the Strategy's gpus and
context_parallel ask for more than one GPU. No ComfyUI imports.

The Sampler resolves `gpus` and `context_parallel` (nodes/strategy.py parse_parallel) as follows,
and so does the plan: gpus=auto with context_parallel off is ComfyUI's one GPU (the route's
one-GPU plan, unchanged); GPUs listed with context_parallel off are balanced placement (whole
components on different GPUs); with context_parallel on, one rank per listed GPU, or for gpus=auto
every GPU this machine shows. A ComfyUI that plans without those GPUs (on the CPU, say) plans the
GPUs the user listed, as CUDA devices: that is where the run will go. gpus=cpu:N is the runtime's
test mode and is refused here by name. The rows are `memory.plan.parallel`'s, as `vidmem plan
--gpus N --cp MODE` prints them: per GPU (the fullest GPU's VRAM), the RAM of every process
together, and the time as a speedup against the recommended one-GPU plan, over an assumed PCIe 4.0
link (`PLANNED_LINK`, said in the answer).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..memory import StrategyError
from ..memory.plan.candidates import STAGE_WORDS
from ..memory.plan.costs import TIME_RESOLUTION
from ..memory.plan.parallel import (INTERCONNECTS, RANK_STORAGE, GpuSharing, MultiGpu, ParallelPlan,
                                    context_parallel_refusal, parallel_candidates, parallel_recommended, plan_parallel)
from ..memory.plan.planner import PlanOptions, plan_run
from ..memory.strategy import MemoryStrategy
from ..memory.units import GiB
from .strategy import parse_parallel

PLANNED_LINK = "pcie4"  # the interconnect the all-to-all time assumes (the CLI's --interconnect default)
PARALLEL_DEVICE = "cuda"  # ranks and balanced placement run on CUDA GPUs, whatever ComfyUI plans on


def planned_layout(gpus: str, context_parallel: str, visible_gpus: int) -> MultiGpu | None:
    """The GPUs the Sampler would use, as the planner's layout; None for one GPU (the plan as before).

    `visible_gpus`: the CUDA GPUs this machine shows (what gpus=auto means with context_parallel on).
    StrategyError naming gpus or context_parallel where the Sampler would refuse, or for cpu:N."""
    parallel = parse_parallel(gpus, context_parallel)
    link = INTERCONNECTS[PLANNED_LINK]
    mode = parallel.context_parallel.value
    if parallel.degree:  # cpu:N
        raise StrategyError(f"gpus={gpus!r} runs {parallel.degree} CPU processes to test context parallelism without "
                            "GPUs; this plan is for GPUs: list the GPUs to plan for (e.g. 0,1). The Sampler's receipt "
                            "shows what the CPU processes used.")
    if not parallel.context_parallel_on:
        return MultiGpu(len(parallel.gpus), GpuSharing.BALANCED, link) if parallel.balanced else None
    if parallel.gpus is None and visible_gpus == 0:
        raise StrategyError(f"gpus={gpus!r} with context_parallel={mode} uses every GPU the machine shows, and this one "
                            "shows none, so the plan cannot count them: list the GPUs the run will use (e.g. 0,1).")
    listed = parallel.gpus if parallel.gpus is not None else tuple(range(visible_gpus))
    if len(listed) < 2:  # as the runtime (pipelines.parallel.resolve_ranks) refuses it
        raise StrategyError(f"gpus={gpus!r}: context_parallel={mode} needs two or more GPUs; only GPU {listed[0]} is "
                            "used. List more in gpus, or set context_parallel to off.")
    return MultiGpu(len(listed), mode, link)


def check_parallel(model, layout: MultiGpu, options: PlanOptions) -> None:
    """The refusals the Sampler makes before its ranks start, in the node's words with the fix
    (a model that cannot split; storage the ranks cannot reopen). The size's own refusals (heads,
    tokens) come from the planner, worded as the runtime words them."""
    if layout.mode is GpuSharing.BALANCED:
        return
    refusal = context_parallel_refusal(model, layout.mode.value)
    if refusal:
        raise StrategyError(refusal)
    if options.on_disk or options.storage:
        raise StrategyError(f"context_parallel={layout.mode.value}: {RANK_STORAGE}. Load the model with Load Video "
                            "Pipeline at weight_dtype default, or set context_parallel to off.")


@dataclass(frozen=True)
class GpuPlans:
    """The rows over several GPUs, the chosen one, and the one-GPU plan the speedups are against."""

    layout: MultiGpu
    plans: tuple[ParallelPlan, ...]
    labels: tuple[str, ...]
    chosen: int | None
    one_gpu: object | None  # memory.plan.planner.Plan: the recommended one-GPU row; None when nothing fits one GPU
    baseline_seconds: float  # one GPU with every weight resident: what est_slowdown divides by


def plan_gpus(model, shape, layout: MultiGpu, vram: int, ram: int, base: MemoryStrategy, options: PlanOptions,
              strategy: MemoryStrategy | None = None) -> GpuPlans:
    """One row per tier on `layout` (the Sampler's offload=auto chooses among them: pipelines.parallel
    choose_parallel), and with `strategy` (not auto) the user's own settings last, chosen."""
    check_parallel(model, layout, options)
    options = replace(options, device=PARALLEL_DEVICE)
    plans, one_gpu = parallel_candidates(model, shape, vram, ram, layout, base, options)
    labels = [_label(plan, options) for plan in plans]
    chosen = parallel_recommended(plans, on_disk=options.on_disk)  # as choose_parallel: the weights as loaded
    if strategy is not None:
        plans.append(plan_parallel(model, shape, strategy, layout, options, vram, ram, reference=one_gpu))
        labels.append("your settings")
        chosen = len(plans) - 1
    baseline = (one_gpu or plan_run(model, shape, base, options)).baseline_seconds
    return GpuPlans(layout, tuple(plans), tuple(labels), chosen, one_gpu, baseline)


def _label(plan: ParallelPlan, options: PlanOptions) -> str:
    """As the one-GPU rows: "block_swap 14", "chunks 4", "+disk" where the planner put weights on disk."""
    s = plan.strategy
    blocks = f" {s.blocks_to_swap}" if s.blocks_to_swap else ""
    chunks = f" chunks {s.activation_chunks}" if s.activation_chunks != 1 else ""
    return s.offload.value + blocks + chunks + (" +disk" if plan.page_cache_bytes and not options.on_disk else "")


def gpu_rows(found: GpuPlans) -> list[dict]:
    """The rows in the one-GPU rows' shape (the chart draws them unchanged): VRAM the fullest GPU's,
    RAM every process's together, plus the speedup and the planner's own figures per GPU."""
    return [_row(label, plan, found.baseline_seconds) for label, plan in zip(found.labels, found.plans)]


def _row(label: str, plan: ParallelPlan, baseline: float) -> dict:
    return {
        "label": label, "strategy": plan.strategy.describe(), "fits": plan.fits, "on_disk": bool(plan.page_cache_bytes),
        "est_slowdown": round(plan.seconds / baseline, 2) if baseline else 1.0, "speedup": plan.speedup,
        "peak_vram_bytes": plan.per_gpu_peak_bytes, "peak_ram_bytes": plan.host_bytes,
        # Every process keeps its copy of the weights for the whole run: the RAM is the same at every stage.
        "stages": [{"name": name, "vram_bytes": max(g.stage(name).device_bytes for g in plan.gpus),
                    "ram_bytes": plan.host_bytes} for name in ("text_encode", "denoise", "decode")],
        "over_budget": _over_budget(plan),
        "parallel": plan.as_dict(),  # the rows of `vidmem plan --gpus N --json`, GPU by GPU
    }


def _over_budget(plan: ParallelPlan) -> list[str]:
    """One line per stage over the VRAM budget on any GPU, and one for the RAM, each with its fix."""
    vram, ram, lines = plan.vram_budget_bytes, plan.ram_budget_bytes, []
    for name, words in STAGE_WORDS.items():
        over = [g for g in plan.gpus if not g.stage(name).fits(vram)]
        if over:
            worst = max(g.stage(name).device_bytes for g in over)
            lines.append(f"{words}: VRAM {worst / GiB:.1f} > {vram / GiB:.1f} GiB on GPU "
                         f"{', '.join(str(g.index) for g in over)}: a leaner offload tier (auto picks one)")
    if ram is not None and plan.host_bytes > ram:
        processes = "ComfyUI's process" if plan.layout.mode is GpuSharing.BALANCED else \
            f"{plan.layout.gpus + 1} processes (one per GPU and ComfyUI's), each with its own copy of the weights"
        lines.append(f"RAM {plan.host_bytes / GiB:.1f} > {ram / GiB:.1f} GiB for {processes}: raise ram_budget_gb, "
                     "use fewer GPUs, or set context_parallel to off")
    return lines


def gpu_summary(found: GpuPlans) -> dict:
    """What the chart's title line says: per GPU, how many, how they share the run, the link assumed,
    and the chosen row's speedup against one GPU."""
    layout, link = found.layout, found.layout.interconnect
    chosen = found.plans[found.chosen] if found.chosen is not None else None
    one = found.one_gpu
    return {
        "mode": layout.mode.value, "gpus": layout.gpus,
        "interconnect": {"name": link.name, "gbps": link.bytes_per_s / 1e9, "assumed": PLANNED_LINK},
        "speedup": None if chosen is None else chosen.speedup,
        "one_gpu": None if one is None else {"label": _single_label(one.strategy), "peak_vram_bytes": one.peak_vram_bytes,
                                             "peak_ram_bytes": one.peak_ram_bytes},
        "lines": _summary_lines(found, chosen),
    }


def _single_label(strategy: MemoryStrategy) -> str:
    return strategy.offload.value + (f" {strategy.blocks_to_swap}" if strategy.blocks_to_swap else "")


def _summary_lines(found: GpuPlans, chosen: ParallelPlan | None) -> list[str]:
    layout, link = found.layout, found.layout.interconnect
    if layout.mode is GpuSharing.BALANCED:
        how = (f"per GPU, {layout.gpus} GPUs, balanced: the transformers and VAE on GPU 0, the text encoder on GPU 1; "
               "nothing is split")
    else:
        how = (f"per GPU, {layout.gpus} GPUs, {layout.mode.value} over {link.name} ({link.bytes_per_s / 1e9:g} GB/s per "
               "GPU, assumed); every GPU holds all the weights")
    one = found.one_gpu
    if one is None:
        against = "one GPU: nothing fits, so no speedup"
    else:
        speed = f"x{chosen.speedup:.2f} " if chosen is not None and chosen.speedup else ""
        against = f"speedup {speed}against one GPU ({_single_label(one.strategy)}, {one.peak_vram_bytes / GiB:.1f} GiB)"
    return [how, against]


def gpu_time(found: GpuPlans) -> dict:
    """The time column over several GPUs: each row's speedup against the one-GPU plan."""
    speedups = [p.speedup for p in found.plans if p.speedup]
    times = [round(p.seconds / found.baseline_seconds, 2) if found.baseline_seconds else 1.0 for p in found.plans]
    one = found.one_gpu
    return {"shown": bool(speedups), "resolution": TIME_RESOLUTION, "range": [min(times), max(times)],
            "speedup": True,
            "relative_to": (f"one GPU ({_single_label(one.strategy)}, its recommended row), estimated"
                            if one is not None else "one GPU, where nothing fits")}
