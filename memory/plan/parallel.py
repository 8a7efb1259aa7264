"""Plans per GPU: context parallelism (Ulysses or ring, degree N) and balanced placement.

How it works. Context parallelism (diffusers' `ContextParallelConfig`; vidmem.pipelines.parallel runs
one rank process per GPU, each with its own copy of the pipeline and vidmem's ordinary sampler): each
rank holds all the weights under its own offload tier (the single-GPU residency, unchanged) and
encodes the prompt as one GPU would. Only the denoiser's forward is split: its per-rank allocation
stream is traced on meta with the sequence split as diffusers splits it and the collective's own
buffers (`parallel_trace.py`), and replayed through the allocator model with the resident weights,
so the figure is traced, not a one-GPU peak divided by N. NCCL's communicator buffers sit beside it
(`NCCL_BYTES`). The decode runs once, in the coordinating process (ComfyUI's), on GPU 0, beside rank
0's idle process. Time: each rank's compute is its traced FLOPs (1/N of the sequence's, plus what
every rank repeats: embeddings, the text keys and values); the all-to-all bytes
(`parallel_checks.comm_bytes`) cross the interconnect with compute stopped, as diffusers waits on
every collective at once. One GPU is the single-GPU plan, unchanged.

Balanced placement (`device_map="balanced"`, `parallel_layout`): no parallelism; the transformers run
on one GPU under the strategy's tier without the prompt encoder, which runs whole on another GPU;
the time is one GPU's, less the prompt encoder's coming and going.

    plan = plan_parallel(load_model("wan2.1-t2v-14b"), VideoShape(1280, 720, 81), MemoryStrategy(), MultiGpu(4))
    print(plan.describe())
"""

from __future__ import annotations

from dataclasses import replace

from .parallel_checks import (CommBytes, ParallelError, check_context_parallel, comm_bytes, context_parallel_refusal,
                              sequence_tokens)
from .parallel_layout import balanced_placement, encoder_stage, with_resident
from .parallel_trace import TRACED_PARTS, RankCall, context_parallel_trace
from .parallel_types import INTERCONNECTS, NCCL_BYTES, GpuPlan, Interconnect, MultiGpu, GpuSharing, ParallelPlan
from .costs import CUDA_CONTEXT_BYTES
from .planner import Plan, PlannerModel, PlanOptions, StagePlan, VideoShape, candidate_plans, plan_run, recommended
from .stages import phase
from .types import Call
from ..context_parallel import RANK_STORAGE, chunks_refusal
from ..strategy import CHUNKS_OFF, MemoryStrategy, OffloadTier, TextEncoderPlacement

__all__ = ["INTERCONNECTS", "NCCL_BYTES", "CommBytes", "GpuPlan", "Interconnect", "MultiGpu", "GpuSharing",
           "ParallelError", "ParallelPlan", "RANK_STORAGE", "balanced_placement", "check_context_parallel",
           "check_rank_storage", "comm_bytes",
           "context_parallel_refusal", "parallel_candidates", "parallel_recommended", "plan_parallel", "plan_seconds",
           "check_traceable", "rank_strategy",
           "sequence_tokens"]


def plan_parallel(model: PlannerModel, shape: VideoShape, strategy: MemoryStrategy, layout: MultiGpu,
                  options: PlanOptions = PlanOptions(), vram_budget_bytes: int | None = None,
                  ram_budget_bytes: int | None = None, reference: Plan | None = None) -> ParallelPlan:
    """Each GPU's peak and the run's time for `model` at `shape` on `layout.gpus` GPUs.

    `reference` is the one-GPU plan the speedup is measured against (default: `strategy` on one GPU).
    One GPU under context parallelism is the single-GPU plan, unchanged."""
    if layout.mode is not GpuSharing.BALANCED:  # refused before anything is traced
        check_context_parallel(model, shape, layout.gpus, layout.mode.value)
        check_rank_storage(options, layout)
        strategy = rank_strategy(strategy, layout)
    single = plan_run(model, shape, strategy, options)
    reference = single if reference is None else reference
    budgets = (vram_budget_bytes, ram_budget_bytes)
    if layout.mode is GpuSharing.BALANCED:
        return _balanced(model, shape, strategy, layout, options, budgets, reference)
    return _context_parallel(model, shape, strategy, layout, options, budgets, single, reference)


def _context_parallel(model, shape, strategy, layout, options, budgets, single: Plan, reference: Plan) -> ParallelPlan:
    vram, ram = budgets
    n, nccl = layout.gpus, NCCL_BYTES(layout.gpus)
    if n == 1:
        rank = plan_run(model, shape, strategy, options, vram, ram)
        gpus = (GpuPlan(0, model.layout.all, rank.stages, denoisers=model.layout.denoisers),)
        return ParallelPlan(model.name, shape, layout, strategy, gpus, plan_seconds(rank), _seconds(reference),
                            host_bytes=rank.peak_ram_bytes, page_cache_bytes=rank.peak_page_cache_bytes,
                            vram_budget_bytes=vram, ram_budget_bytes=ram)
    encode, denoise, decode = single.stages
    ranked = tuple(with_resident(st, (nccl,), options).within(vram)
                   for st in (encode, _rank_stage(model, shape, denoise, layout, options)))
    # The coordinator (the ComfyUI process) decodes on GPU 0 beside rank 0's idle process: its CUDA
    # context and NCCL buffers stay; its weights went back to the host when its run ended.
    on_gpu0 = with_resident(decode, (CUDA_CONTEXT_BYTES, nccl), options).within(vram)
    elsewhere = StagePlan("decode", (), 0)
    gpus = tuple(GpuPlan(i, model.layout.all, (*ranked, on_gpu0 if i == 0 else elsewhere), nccl, model.layout.denoisers)
                 for i in range(n))
    rank = Plan(model.name, shape, strategy, (*ranked, on_gpu0), single.baseline_seconds, vram, _share(ram, n), options)
    comm, comm_s = _comm(model, shape, rank, layout)
    # RAM: each rank's process holds its own copy of the pipeline, and so does the coordinator
    # (memory-mapped files on disk are shared page cache, counted once).
    host = max(encode.host_bytes, denoise.host_bytes) * n + single.peak_ram_bytes
    return ParallelPlan(model.name, shape, layout, strategy, gpus, plan_seconds(rank) + comm_s, _seconds(reference),
                        comm, comm_s, host, single.peak_page_cache_bytes, vram, ram)


def _share(ram: int | None, gpus: int) -> int | None:
    """Each of the ranks' and the coordinator's processes' share of the RAM budget."""
    return None if ram is None else ram // (gpus + 1)


def _seconds(reference: Plan) -> float | None:
    return plan_seconds(reference) if reference.fits is not False else None


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
        check_traceable(model.traced_module(p.label), layout.mode.value)
        call = RankCall("denoise", p.label, shape, degree=layout.gpus, mode=layout.mode.value)
        with context_parallel_trace(model.traced_module(p.label), layout.gpus, layout.mode.value):
            ranked = phase(model, call, list(p.resident[1:]), options, p.label, streaming=p.streaming)  # resident[0]: cuBLAS
            rank_flops = model.trace(call, options.attention).flops  # memoised by the line above
        whole = model.trace(Call("denoise", p.label, shape), options.attention).flops
        scale[p.label] = rank_flops / whole if whole else 1.0
        phases.append(ranked)
    work = list(stage.work)
    for index, name in zip(range(len(work) - len(denoisers), len(work)), denoisers):
        work[index] = replace(work[index], flops=work[index].flops * scale[name])
    return replace(stage, phases=tuple(phases), work=tuple(work))


def check_traceable(transformer, mode: str) -> None:
    """ParallelError for a denoiser the per-rank trace cannot follow (the refusal rules let only the Wan
    family through; this keeps any other model from an AttributeError mid-trace)."""
    missing = [name for name in TRACED_PARTS if not hasattr(transformer, name)]
    if not missing and all(hasattr(block, "attn1") for block in transformer.blocks):
        return
    raise ParallelError(f"context_parallel={mode}: {type(transformer).__name__} cannot be planned per rank (the "
                        f"per-rank trace follows Wan's {', '.join(TRACED_PARTS)} and each block's attn1; missing: "
                        f"{', '.join(missing) or 'attn1'}). Set context_parallel to off.")


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
    """The transformers' GPU runs the strategy's tier without the prompt encoder (as the runtime calls
    the sampler: text_encoder=cpu, the encoder being elsewhere), then the decode; the encoder's GPU
    encodes the prompt."""
    vram, ram = budgets
    home_strategy = replace(strategy, text_encoder=TextEncoderPlacement.CPU)
    home = plan_run(model, shape, home_strategy, options, vram, ram)
    encoders = encoder_stage(model, shape, options).within(vram)
    idle = tuple(StagePlan(name, (), 0) for name in ("text_encode", "denoise", "decode"))
    stages = [(idle[0], home.stage("denoise"), home.stage("decode")), (encoders, *idle[1:])]
    gpus = tuple(GpuPlan(i, names, stages[i] if i < 2 else idle, denoisers=model.layout.denoisers)
                 for i, names in enumerate(balanced_placement(model.layout, layout.gpus)))
    seconds = plan_seconds(home) - home.stage("text_encode").seconds(home.disk_read(home.stage("text_encode")))
    host = max(home.stage(name).host_bytes for name in ("denoise", "decode"))  # nothing encodes on the CPU
    resolved = replace(strategy, activation_chunks=home.strategy.activation_chunks)  # auto as the plan resolved it
    return ParallelPlan(model.name, shape, layout, resolved, gpus, seconds + encoders.seconds(), _seconds(reference),
                        host_bytes=host, page_cache_bytes=home.peak_page_cache_bytes,
                        vram_budget_bytes=vram, ram_budget_bytes=ram)


def parallel_candidates(model: PlannerModel, shape: VideoShape, vram_budget_bytes: int, ram_budget_bytes: int,
                        layout: MultiGpu, base: MemoryStrategy = MemoryStrategy(),
                        options: PlanOptions = PlanOptions()) -> tuple[list[ParallelPlan], Plan | None]:
    """One plan per tier on `layout` (each rank's fewest swapped blocks), and the one-GPU plan the
    speedup is measured against (the recommended single-GPU plan; None when nothing fits one GPU)."""
    if layout.mode is not GpuSharing.BALANCED:
        check_context_parallel(model, shape, layout.gpus, layout.mode.value)
        check_rank_storage(options, layout)
    singles = candidate_plans(model, shape, vram_budget_bytes, ram_budget_bytes, base, options)
    best = recommended(singles)
    one_gpu = singles[best] if best is not None else None
    reference = one_gpu or singles[0]  # when nothing fits one GPU, the speedups are None (_seconds)
    budgets = (vram_budget_bytes, ram_budget_bytes)
    if layout.mode is GpuSharing.BALANCED:  # one row per tier on the transformers' GPU, the encoder elsewhere
        on_home = candidate_plans(model, shape, vram_budget_bytes, ram_budget_bytes,
                                  replace(base, text_encoder=TextEncoderPlacement.CPU), options)
        return [plan_parallel(model, shape, replace(p.strategy, text_encoder=base.text_encoder), layout, p.options,
                              *budgets, reference) for p in on_home], one_gpu
    rank_vram = vram_budget_bytes - NCCL_BYTES(layout.gpus)
    # No disk rows: ranks reopen the folder with their weights in RAM (check_rank_storage).
    # Ranks run unchunked (rank_strategy): the one-GPU rows would pick slices of one GPU's whole sequence.
    per_rank = candidate_plans(model, shape, rank_vram, _share(ram_budget_bytes, layout.gpus),
                               rank_strategy(base, layout), options, consider_disk=False)
    plans = []
    for single in per_rank:
        strategy = single.strategy
        if strategy.offload is OffloadTier.BLOCK_SWAP:
            strategy = _fewest_rank_blocks(model, shape, strategy, layout, single.options, vram_budget_bytes)
        plans.append(plan_parallel(model, shape, strategy, layout, single.options, *budgets, reference))
    return plans, one_gpu


def check_rank_storage(options: PlanOptions, layout: MultiGpu) -> None:
    """Plan only what the ranks run: pipelines.parallel.source reopens a folder at its own dtype."""
    if layout.gpus > 1 and (options.on_disk or options.storage):
        raise ParallelError(f"{RANK_STORAGE}; drop --disk/--weights (or weight_dtype) to plan it, or plan "
                            "--cp balanced, which runs the pipeline as loaded.")


def rank_strategy(strategy: MemoryStrategy, layout: MultiGpu) -> MemoryStrategy:
    """The strategy each rank runs: unchunked (activation_chunks auto is off there; a count is refused)."""
    if layout.gpus == 1:
        return strategy
    refusal = chunks_refusal(layout.mode.value, strategy)
    if refusal:
        raise ParallelError(refusal)
    return replace(strategy, activation_chunks=CHUNKS_OFF)


def _fewest_rank_blocks(model, shape, strategy: MemoryStrategy, layout: MultiGpu, options, vram: int) -> MemoryStrategy:
    """Binary search over each rank's denoise stage: its activations are smaller than one GPU's."""
    low, high = 1, strategy.blocks_to_swap
    while low < high:
        middle = (low + high) // 2
        candidate = replace(strategy, blocks_to_swap=middle)
        plan = plan_parallel(model, shape, candidate, layout, options, vram)
        low, high = (low, middle) if plan.gpus[0].stage("denoise").fits(vram) else (middle + 1, high)
    return replace(strategy, blocks_to_swap=low)


def parallel_recommended(plans: list[ParallelPlan], on_disk: bool | None = None) -> int | None:
    """The fitting plan with the least estimated time, the earlier on a tie. With `on_disk` (how the loader
    holds the weights), only plans that hold them so: balanced mode runs the pipeline as loaded, so a row
    with the weights memory-mapped is a suggestion for the loader, never one to run weights held in RAM by."""
    fitting = [(round(p.seconds, 1), i) for i, p in enumerate(plans)
               if p.fits and (on_disk is None or p.on_disk == on_disk)]
    return min(fitting)[1] if fitting else None
