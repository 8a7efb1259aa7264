"""When a plan does not fit: say what would, computed by planning the alternatives, never guessed.

Per stage (`over_budget_lines`): what the stage needs beyond each budget and the one change that
makes that stage fit, found by planning the stage again with it: the text encoder on the CPU, more
swapped blocks, a lower tier, VAE tiling, the weights on disk, smaller stored weights.

For the whole run (`nothing_fits_message`), first activation chunks, when the run did not choose them
(the same video, same weights: the least change), and the run without its step cache where the cache's
state is what does not fit beside the activations; then two suggestions at most, each the first that fits: a
smaller storage format for the transformer(s) and the text encoder with the weights where they
are, and the weights memory-mapped from disk (as stored, if the search did not try that already,
else with smaller storage). When neither exists and the device is what runs out, a shorter or
smaller video. Each suggestion is a plan that fits the same budgets, never a guess.
"""

from __future__ import annotations

from dataclasses import replace

from .candidates import (STAGE_WORDS, Plan, PlanError, _fewest_blocks, _gib, tiling_that_fits, candidate_plans,
                         fewest_chunks, recommended)
from .stages import cache_state_bytes, decode_stage, denoise_stage, host_base, text_encode_stage
from .types import PlannerModel, PlanOptions, StagePlan, VideoShape
from ..storage import FORMATS, storage_format
from ..strategy import MemoryStrategy, OffloadTier, TextEncoderPlacement

# Smaller storage to suggest, best quality first: Comfy-Org ships fp8 scaled; the GGUF k-quants are
# what city96's files offer below it (gguf_q8_0 is larger than fp8 and would not fit where it does not).
SMALLER_STORAGE = ("fp8_scaled", "gguf_q6_k", "gguf_q5_k", "gguf_q4_k")


def nothing_fits_message(model: PlannerModel, shape: VideoShape, plans: list[Plan], base: MemoryStrategy,
                         options: PlanOptions, consider_disk: bool = True) -> str:
    """Why the leanest plan still fails, and which storage, tier or shape would fit."""
    leanest = plans[-1]
    vram, ram = leanest.vram_budget_bytes, leanest.ram_budget_bytes
    budgets = f"{_gib(ram)} RAM (the CPU computes)" if options.on_cpu else f"{_gib(vram)} VRAM / {_gib(ram)} RAM"
    lines = [f"nothing fits {model.name} at {shape.width}x{shape.height}x{shape.frames} in {budgets}; "
             f"even {leanest.strategy.describe()} ({leanest.describe_storage()}) is over:"]
    lines += [f"  {line}" for line in leanest.over_budget()]
    least_ram = min(plans, key=lambda p: p.peak_ram_bytes)
    if least_ram.peak_ram_bytes > ram:
        held = host_base(model, least_ram.options)[0]
        what = "runtime; the weights are page cache" if least_ram.on_disk else "weights + runtime"
        # named, so that "at least" is not read against the leanest row's figure above when another row needs less
        then = " and then fits" if not [line for line in least_ram.over_budget() if "VRAM" in line] else ""
        lines.append(f"The pipeline keeps {_gib(held)} of anonymous RAM ({what}); give at least "
                     f"{_gib(least_ram.peak_ram_bytes)} of RAM: {least_ram.strategy.describe()} "
                     f"({least_ram.describe_storage()}) needs the least{then}.")
    found = _with_chunks(model, shape, base, options, (vram, ram), consider_disk)
    found += _without_cache(model, shape, base, options, (vram, ram), consider_disk)
    found = found or _first_fitting(model, shape, base, options, (vram, ram), _in_ram(model, options))
    found += _first_fitting(model, shape, base, options, (vram, ram), _on_disk(model, options, consider_disk))
    lines.extend(found)
    if not found and host_base(model, options)[0] <= ram and all(s.fits(vram) for s in leanest.stages[:1]):
        lines.extend(_smaller_shape(model, shape, base, options, consider_disk, (vram, ram)))
    return "\n".join(lines)


_STAGES = {"text_encode": text_encode_stage, "denoise": denoise_stage, "decode": decode_stage}


def over_budget_lines(model: PlannerModel, plan: Plan) -> list[str]:
    """One short line per stage over a budget, each with the change that makes that stage fit:

        text encode: VRAM 11.2 > 8.0 GiB, RAM 39.0 > 32.0 GiB; fix: text encoder on the CPU, weights on disk
        denoise: VRAM 9.1 > 8.0 GiB; fix: blocks_to_swap 39

    Each fix is the first of a short list of changes (least change first) under which the stage,
    planned again, fits that budget; the fixes of different stages and budgets apply together.
    """
    lines = []
    for stage, over in plan.stages_over():
        if not over:
            continue
        fixes = []
        if not stage.fits(plan.vram_budget_bytes):
            fixes.append(_vram_fix(model, plan, stage.name))
        if plan.ram_budget_bytes is not None and stage.host_bytes > plan.ram_budget_bytes:
            fixes.append(_ram_fix(model, plan, stage.name))
        lines.append(f"{STAGE_WORDS.get(stage.name, stage.name)}: {', '.join(over)}; fix: {', '.join(fixes)}")
    return lines


def _stage(model: PlannerModel, plan: Plan, name: str, strategy: MemoryStrategy, options: PlanOptions) -> StagePlan:
    return _STAGES[name](model, plan.shape, strategy, options).within(plan.vram_budget_bytes)


def _vram_fix(model: PlannerModel, plan: Plan, name: str) -> str:
    """The least change to the strategy (or the stored weights) under which stage `name` fits the VRAM budget."""
    vram = plan.vram_budget_bytes
    for words, strategy, options in _vram_trials(model, plan, name):
        if _stage(model, plan, name, strategy, options).fits(vram):
            return words
    return "fewer frames or a smaller size"


def _vram_trials(model: PlannerModel, plan: Plan, name: str):
    s, options, tier = plan.strategy, plan.options, plan.strategy.offload
    cpu = replace(s, text_encoder=TextEncoderPlacement.CPU)
    if name == "text_encode" and s.text_encoder is not TextEncoderPlacement.CPU:
        yield "text encoder on the CPU", cpu, options
    if tier is OffloadTier.NONE:
        yield "offload model", replace(s, offload=OffloadTier.MODEL), options
        if name == "text_encode":
            yield "offload model, text encoder on the CPU", replace(cpu, offload=OffloadTier.MODEL), options
    if name == "denoise":
        chunked = fewest_chunks(model, plan.shape, s, options, plan.vram_budget_bytes)
        if chunked.activation_chunks > s.chunk_count:  # same tier, same weights: the least change
            yield f"activation_chunks {chunked.activation_chunks}", chunked, options
    if name == "denoise" and tier is not OffloadTier.SEQUENTIAL:
        swapping = replace(s, offload=OffloadTier.BLOCK_SWAP, blocks_to_swap=1)
        swap = _fewest_blocks(model, plan.shape, swapping, options, plan.vram_budget_bytes)
        words = f"blocks_to_swap {swap.blocks_to_swap}"
        yield (words if tier is OffloadTier.BLOCK_SWAP else f"offload block_swap, {words}"), swap, options
    if name == "decode":
        tiled = tiling_that_fits(model, plan.shape, replace(s, vae_tiling=None), options, plan.vram_budget_bytes)
        if tiled.vae_tiling is not None and tiled.vae_tiling != s.vae_tiling:
            t = tiled.vae_tiling
            yield f"VAE tiling, tile_size {t.tile_size}, temporal_size {t.temporal_size}", replace(s, vae_tiling=t), options
    if tier is not OffloadTier.SEQUENTIAL:
        yield "offload sequential", replace(s, offload=OffloadTier.SEQUENTIAL, blocks_to_swap=0), options
    for trial in _smaller_storage(model, options):
        yield f"weights stored as {trial.storage[0][1]}", s, trial


def _ram_fix(model: PlannerModel, plan: Plan, name: str) -> str:
    """The least change to how the weights are held under which stage `name` fits the RAM budget."""
    ram, options = plan.ram_budget_bytes, plan.options
    trials = [] if options.on_disk else [("weights on disk", replace(options, on_disk=True))]
    trials += [(f"weights stored as {t.storage[0][1]}" + (", on disk" if t.on_disk and not options.on_disk else ""), t)
               for t in _smaller_storage(model, options) + ([] if options.on_disk else _on_disk(model, options, True))]
    for words, trial in trials:
        if _stage(model, plan, name, plan.strategy, trial).ram_bytes <= ram:  # on a CPU with its compute's RAM
            return words
    stage = plan.stage(name)
    return f"more RAM (at least {_gib(stage.ram_bytes)})"


def _smaller_storage(model: PlannerModel, options: PlanOptions) -> list[PlanOptions]:
    """`options` with each smaller storage format for the transformer(s) and text encoder, best first."""
    current = min((storage_format(options.storage_of(n) or model.dtype_name).bytes_per_weight
                   for n in model.layout.denoisers), default=2.0)
    return [replace(options, storage=model.layout.stored_as(name))
            for name in SMALLER_STORAGE if FORMATS[name].bytes_per_weight < current]


def _in_ram(model: PlannerModel, options: PlanOptions) -> list[PlanOptions]:
    """Smaller storage, the disk tier as it is."""
    return _smaller_storage(model, options)


def _on_disk(model: PlannerModel, options: PlanOptions, consider_disk: bool) -> list[PlanOptions]:
    """The disk tier (if the search did not try it already), then smaller storage on disk."""
    if options.on_disk:
        return []
    on_disk = replace(options, on_disk=True)
    return ([] if consider_disk else [on_disk]) + _smaller_storage(model, on_disk)


def _first_fitting(model, shape, base, options, budgets, trials: list[PlanOptions]) -> list[str]:
    """One sentence for the first of `trials` with a plan that fits, or nothing."""
    vram, ram = budgets
    for trial in trials:
        plans = candidate_plans(model, shape, vram, ram, base, trial, consider_disk=False)
        best = recommended(plans)
        if best is not None:
            return [f"{_flags(trial, options)} it fits in {_gib(vram)} VRAM / {_gib(ram)} RAM: {_summary(plans[best])}."]
    return []


def _with_chunks(model, shape, base: MemoryStrategy, options, budgets, consider_disk: bool) -> list[str]:
    """The run with activation_chunks=auto, when the search had them off or fixed, if that fits."""
    if base.chunks_auto:
        return []
    plans = candidate_plans(model, shape, *budgets, replace(base, activation_chunks="auto"), options, consider_disk)
    best = recommended(plans)
    if best is None:
        return []
    vram, ram = budgets
    return [f"With activation_chunks auto (--activation-chunks auto; the same video, blocks computed in token slices) "
            f"it fits in {_gib(vram)} VRAM / {_gib(ram)} RAM: {_summary(plans[best])}."]


def _without_cache(model, shape, base: MemoryStrategy, options, budgets, consider_disk: bool) -> list[str]:
    """The run without the step cache's state on the device (PlanOptions.cache_state), if that fits."""
    kept = max((sum(cache_state_bytes(model, shape, name, options.cache_state_of(name))) for name in model.layout.denoisers),
               default=0)
    if not kept:
        return []
    plans = candidate_plans(model, shape, *budgets, base, replace(options, cache_state=()), consider_disk)
    best = recommended(plans)
    if best is None:
        return []
    vram, ram = budgets
    return [f"The step cache keeps {_gib(kept)} on the device through the denoise (its state for every guidance pass "
            f"and context window); with the cache off (--cache off; the Step Cache node's method off) it fits in "
            f"{_gib(vram)} VRAM / {_gib(ram)} RAM: {_summary(plans[best])}."]


def _smaller_shape(model, shape, base, options, consider_disk, budgets) -> list[str]:
    for smaller in _smaller_shapes(model, shape):
        try:
            plans = candidate_plans(model, smaller, *budgets, base, options, consider_disk)
        except (PlanError, ValueError):
            continue
        best = recommended(plans)
        if best is not None:
            return [f"What fits: {smaller.width}x{smaller.height}x{smaller.frames} with {_summary(plans[best])}."]
    return []


def _flags(trial: PlanOptions, current: PlanOptions) -> str:
    """The change in words and as `vidmem plan` flags."""
    parts, flags = [], []
    if trial.storage != current.storage:
        name = trial.storage[0][1]
        parts.append(f"weights stored as {name}")
        flags.append(f"--weights {name}")
    if trial.on_disk and not current.on_disk:
        parts.append("the weights memory-mapped from disk")
        flags.append("--disk")
    return f"With {' and '.join(parts)} ({' '.join(flags)})"


def _summary(plan: Plan) -> str:
    where = ", weights on disk" if plan.on_disk else ""
    peaks = (f"peak {_gib(plan.peak_ram_bytes)} RAM (the CPU computes, {_gib(plan.peak_vram_bytes)} of it)"
             if plan.options.on_cpu else f"peak {_gib(plan.peak_vram_bytes)} VRAM / {_gib(plan.peak_ram_bytes)} RAM")
    return f"{plan.strategy.describe()}{where}, {peaks}, estimated slowdown x{plan.est_slowdown:.2f}"


def _smaller_shapes(model, shape: VideoShape):
    """Fewer frames first (cheaper to lose), then lower resolutions, as the model accepts them."""
    candidates = [_fewer_frames(model, shape)]
    for scale in (0.75, 0.5):
        width, height = (max(64, int(v * scale) // 32 * 32) for v in (shape.width, shape.height))
        candidates.append(replace(shape, width=width, height=height))
    for candidate in candidates:
        try:
            model.check_shape(candidate)
        except ValueError:
            continue
        yield candidate


def _fewer_frames(model, shape: VideoShape) -> VideoShape:
    """About half the frames: the most, from half down, that the model's frame rule takes (its shape
    check: Wan's 4k+1, LTX-2's 8k+1), so the suggestion is a count the model runs; one frame at least."""
    for frames in range((shape.frames - 1) // 2 + 1, 1, -1):
        fewer = replace(shape, frames=frames)
        try:
            model.check_shape(fewer)
        except ValueError:
            continue
        return fewer
    return replace(shape, frames=1)


