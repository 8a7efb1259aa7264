"""One plan per offload tier, each fitted to the budgets: the candidates `planner.choose_strategy` picks from.

`plan_run` predicts one strategy's stages; `candidate_plans` fits one strategy per tier (the fewest
swapped blocks, the text encoder placement and the least redundant VAE tiling that fit), and
`recommended` says which of them to run. How the prediction works: `planner.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .costs import CUDA_CONTEXT_BYTES, TIME_RESOLUTION, GiB, DiskRead
from .stages import compute_seconds, decode_stage, denoise_stage, text_encode_stage
from .types import PlannerModel, PlanOptions, StagePlan, VideoShape
from ..strategy import MemoryStrategy, OffloadTier, StrategyError, TextEncoderPlacement
from ..vae_tiles import auto_tiling, peak_call_pixels

__all__ = ["CHUNK_STEPS", "Plan", "PlanError", "candidate_plans", "fewest_chunks", "plan_run", "recommended",
           "times_differ"]

TIER_ORDER = (OffloadTier.NONE, OffloadTier.MODEL, OffloadTier.BLOCK_SWAP, OffloadTier.SEQUENTIAL)
# Token slices activation_chunks=auto tries, fewest first (pipelines/activation_chunks.py); past 16 the
# allocated peak of 720p Wan 14B no longer falls (the model's own output norm, outside the blocks, is
# then the peak; docs/activation-chunks.md).
CHUNK_STEPS = (1, 2, 4, 8, 16, 32)
STAGE_WORDS = {"text_encode": "text encode", "denoise": "denoise", "decode": "decode"}  # as people read them


class PlanError(ValueError):
    """Nothing fits, or the request cannot be planned; the message says what would fit instead."""


@dataclass(frozen=True)
class Plan:
    model: str
    shape: VideoShape
    strategy: MemoryStrategy
    stages: tuple[StagePlan, ...]
    baseline_seconds: float  # the same run with everything resident: no streaming, no tiling
    vram_budget_bytes: int | None = None  # the compute's budget: on a CPU device the RAM's (PlanOptions.compute_budget)
    ram_budget_bytes: int | None = None
    options: PlanOptions = PlanOptions()  # storage, disk tier and disk rate the plan assumed

    def stage(self, name: str) -> StagePlan:
        return next(s for s in self.stages if s.name == name)

    @property
    def on_disk(self) -> bool:
        return self.options.on_disk

    @property
    def peak_vram_bytes(self) -> int:
        return max(s.device_bytes for s in self.stages)

    @property
    def peak_ram_bytes(self) -> int:
        """Peak anonymous RAM: what must fit the RAM budget (page cache is reclaimable); on a CPU device with its
        compute's (StagePlan.ram_bytes), which lives in the same RAM."""
        return max(s.ram_bytes for s in self.stages)

    @property
    def peak_page_cache_bytes(self) -> int:
        """Weights memory-mapped from files (disk tier): kept in RAM only as far as the budget allows."""
        return max(s.page_cache_bytes for s in self.stages)

    def disk_read(self, stage: StagePlan) -> DiskRead | None:
        """The page cache a stage leaves for memory-mapped weights: the RAM budget less its anonymous bytes
        (on a CPU device its compute's too: StagePlan.ram_bytes)."""
        cache = None if self.ram_budget_bytes is None else max(0, self.ram_budget_bytes - stage.ram_bytes)
        return self.options.disk(cache, cold=cache is not None and stage.page_cache_bytes > cache)

    @property
    def disk_reread_bytes_per_pass(self) -> int:
        """Streamed weight bytes the page cache cannot keep, read from the disk every denoiser pass."""
        stage = self.stage("denoise")
        disk = self.disk_read(stage)
        return 0 if disk is None else max((disk.reread_bytes(w.traffic)[0] for w in stage.work), default=0)

    @property
    def est_slowdown(self) -> float:
        seconds = self.seconds_with_denoise_share(1.0)
        return round(max(seconds / self.baseline_seconds, 1.0), 2) if self.baseline_seconds else 1.0

    def seconds_with_denoise_share(self, share: float) -> float:
        """The modelled seconds of every stage, the denoiser's per-step work scaled by `share` (a step
        cache that computes that share of the passes; 1.0: the plan as it is). Work done once in the
        denoise stage (an image encoder, LTX-2's connectors) is not skipped by a cache."""
        return sum(w.seconds(self.disk_read(s)) * (share if s.name == "denoise" and w.passes > 1 else 1.0)
                   for s in self.stages for w in s.work)

    def over_budget(self) -> list[str]:
        """One short line per stage over a budget ("denoise: VRAM 9.1 > 8.0 GiB, RAM 39.0 > 32.0 GiB");
        empty when it fits (or no budget is set). `advice.over_budget_lines` adds the fix to each."""
        return [f"{STAGE_WORDS.get(stage.name, stage.name)}: {', '.join(over)}"
                for stage, over in self.stages_over() if over]

    def stages_over(self) -> list[tuple[StagePlan, list[str]]]:
        """Each stage with what it needs beyond the budgets ("VRAM 9.1 > 8.0 GiB"), empty where it fits.
        On a CPU device compute and process share the RAM: one test, of their sum ("RAM 6.8 > 4.5 GiB")."""
        found = []
        for s in self.stages:
            over = []
            if self.options.on_cpu:  # the compute budget is the RAM budget (compute_budget): one test covers both
                if not s.fits(self.vram_budget_bytes):
                    over.append(f"RAM {_over(s.ram_bytes, self.vram_budget_bytes)}")
            else:
                if not s.fits(self.vram_budget_bytes):
                    over.append(f"VRAM {_over(s.device_bytes, self.vram_budget_bytes)}")
                if self.ram_budget_bytes is not None and s.host_bytes > self.ram_budget_bytes:
                    over.append(f"RAM {_over(s.host_bytes, self.ram_budget_bytes)}")
            found.append((s, over))
        return found

    @property
    def fits(self) -> bool | None:
        if self.vram_budget_bytes is None and self.ram_budget_bytes is None:
            return None
        return not self.over_budget()

    def describe_storage(self) -> str:
        """"weights fp8_scaled (transformer, text_encoder), on disk" or "weights as loaded"."""
        by_format: dict[str, list[str]] = {}
        for component, name in self.options.storage:
            by_format.setdefault(name, []).append(component)
        text = "; ".join(f"{name} ({', '.join(parts)})" for name, parts in by_format.items())
        text = f"weights {text}" if text else "weights at the compute dtype"
        return text + (", memory-mapped from disk" if self.on_disk else "")

    def describe(self) -> str:
        head = (f"{self.model} {self.shape.width}x{self.shape.height}x{self.shape.frames}: {self.strategy.describe()}; "
                f"{self.describe_storage()}")
        rows = [f"  {s.name:<12} VRAM {_gib(s.device_bytes):>9}  RAM {_gib(s.host_bytes):>9}"
                + (f" + {_gib(s.page_cache_bytes)} page cache" if s.page_cache_bytes else "")
                + f"  peak: {s.peak_phase.label if s.phases else 'on the CPU'}" for s in self.stages]
        tail = f"  estimated slowdown x{self.est_slowdown:.2f}"
        if self.on_disk:
            tail += (f" (disk at {self.options.disk_bytes_per_s / 1e9:g} GB/s; page cache is reclaimable, so only "
                     f"anonymous RAM must fit; {_gib(self.disk_reread_bytes_per_pass)} re-read per pass)")
        if self.fits is not None:
            tail += "; fits" if self.fits else "; does not fit: " + "; ".join(self.over_budget())
        return "\n".join([head, *rows, tail])

    def as_dict(self) -> dict:
        s = self.strategy
        return {
            "tier": s.offload.value, "blocks_to_swap": s.blocks_to_swap, "vae_tiling": s.vae_tiling is not None,
            "text_encoder": s.text_encoder.value, "activation_chunks": s.activation_chunks,
            "peak_vram_bytes": self.peak_vram_bytes,
            "peak_ram_bytes": self.peak_ram_bytes, "stages": {st.name: st.device_bytes for st in self.stages},
            # ram_bytes: anon_bytes and, on a CPU, the compute's beyond them (what peak_ram_bytes is the largest of)
            "host": {st.name: {"anon_bytes": st.host_bytes, "ram_bytes": st.ram_bytes,
                               "page_cache_bytes": st.page_cache_bytes} for st in self.stages},
            "peak_anon_bytes": self.peak_ram_bytes, "peak_page_cache_bytes": self.peak_page_cache_bytes,
            "storage": dict(self.options.storage), "on_disk": self.on_disk,
            "disk_bytes_per_s": self.options.disk_bytes_per_s if self.on_disk else None,
            "disk_reread_bytes_per_pass": self.disk_reread_bytes_per_pass,
            "est_slowdown": self.est_slowdown, "fits": self.fits,
        }


def plan_run(
    model: PlannerModel,
    shape: VideoShape,
    strategy: MemoryStrategy,
    options: PlanOptions = PlanOptions(),
    vram_budget_bytes: int | None = None,
    ram_budget_bytes: int | None = None,
) -> Plan:
    """Predicted device and host peaks per stage for one run of `model` at `shape` under `strategy`.

    activation_chunks=auto is resolved as the run resolves it: the fewest slices whose denoise fits
    `vram_budget_bytes` (none without a budget); the plan's strategy carries the count. On a CPU device
    the compute fits the RAM budget instead (PlanOptions.compute_budget), with the process's own bytes."""
    _check(model, shape, strategy, options)
    vram_budget_bytes = options.compute_budget(vram_budget_bytes, ram_budget_bytes)
    if strategy.chunks_auto:
        strategy = fewest_chunks(model, shape, strategy, options, vram_budget_bytes)
    stages = tuple(build(model, shape, strategy, options).within(vram_budget_bytes)
                   for build in (text_encode_stage, denoise_stage, decode_stage))
    baseline = compute_seconds(model, shape, strategy, options)
    return Plan(model.name, shape, strategy, stages, baseline, vram_budget_bytes, ram_budget_bytes, options)


def candidate_plans(
    model: PlannerModel,
    shape: VideoShape,
    vram_budget_bytes: int,
    ram_budget_bytes: int,
    base: MemoryStrategy = MemoryStrategy(),
    options: PlanOptions = PlanOptions(),
    consider_disk: bool = True,
) -> list[Plan]:
    """One plan per tier, in speed order, each with the fewest swapped blocks, the text encoder
    placement and the least redundant VAE tiling that fit (or, if nothing does, the leanest).

    With `consider_disk`, when a plan with the weights in RAM overruns the RAM budget, the same
    tiers follow with the weights memory-mapped from disk (`options.on_disk`). The storage format
    is never changed here: lowering precision is the user's choice. On a CPU device the compute's
    budget is the RAM budget (PlanOptions.compute_budget).
    """
    _check(model, shape, base, options)
    vram_budget_bytes = options.compute_budget(vram_budget_bytes, ram_budget_bytes)
    plans = [_tier_plan(model, shape, tier, base, options, (vram_budget_bytes, ram_budget_bytes)) for tier in TIER_ORDER]
    if consider_disk and not options.on_disk and any(_over_ram(p) for p in plans):
        on_disk = replace(options, on_disk=True)
        plans += [_tier_plan(model, shape, tier, base, on_disk, (vram_budget_bytes, ram_budget_bytes)) for tier in TIER_ORDER]
    return plans


def _tier_plan(model, shape, tier: OffloadTier, base: MemoryStrategy, options: PlanOptions, budgets) -> Plan:
    vram, _ = budgets
    strategy = replace(base, offload=tier, blocks_to_swap=1 if tier is OffloadTier.BLOCK_SWAP else 0, vae_tiling=None)
    # Chunks before blocks: a slice costs compute that nothing hides (costs.CHUNK_COMPUTE_SHARE), a swapped block a copy
    # that mostly hides behind the previous block's compute; so the fewest slices first, at the leanest block count.
    if base.chunks_auto:
        strategy = fewest_chunks(model, shape, strategy, options, vram, leanest_blocks=True)
    if tier is OffloadTier.BLOCK_SWAP:
        strategy = _fewest_blocks(model, shape, strategy, options, vram)
    strategy = _text_encoder_that_fits(model, shape, strategy, options, budgets)
    strategy = tiling_that_fits(model, shape, strategy, options, vram)
    return plan_run(model, shape, strategy, options, *budgets)


def _over_ram(plan: Plan) -> bool:
    return plan.ram_budget_bytes is not None and max(s.ram_bytes for s in plan.stages) > plan.ram_budget_bytes


def recommended(plans: list[Plan]) -> int | None:
    """Index of the plan to run: the fitting one with the least estimated time, earlier tier on a tie.

    Tier order is speed order for the denoiser; the estimate also weighs what a tier changed to
    fit (a text encoder on the CPU, a tiled decode), so `none` with a CPU text encoder does not
    beat `model` with the encoder on the GPU.
    """
    fitting = [(round(p.est_slowdown, 2), i) for i, p in enumerate(plans) if p.fits]
    return min(fitting)[1] if fitting else None


def times_differ(plans: list[Plan]) -> bool:
    """Whether the plans' estimated times differ by more than the time model can tell
    (`costs.TIME_RESOLUTION`); when they do not, a time column would only repeat one figure."""
    times = [p.est_slowdown for p in plans]
    return bool(times) and max(times) > min(times) * (1 + TIME_RESOLUTION)


def _check(model: PlannerModel, shape: VideoShape, strategy: MemoryStrategy, options: PlanOptions) -> None:
    unknown = [name for name, _ in options.storage if name not in model.layout.all]
    if unknown:
        raise PlanError(f"storage names {', '.join(map(repr, unknown))}, which {model.name} does not have; "
                        f"name its components: {', '.join(model.layout.all)}.")
    try:
        model.check_shape(shape)
        for name in model.layout.denoisers:
            strategy.check_against_model(model.weights(name).block_count, f"{model.name} {name}")
    except StrategyError:
        raise
    except ValueError as error:
        raise PlanError(str(error)) from error


def _fewest_blocks(model, shape, strategy, options, vram: int) -> MemoryStrategy:
    """Binary search: swapped blocks lower the denoise peak monotonically."""
    blocks = min(model.weights(name).block_count for name in model.layout.denoisers)
    if blocks == 0:
        raise PlanError(f"{model.name} has no transformer blocks to swap.")
    low, high = 1, blocks
    while low < high:
        middle = (low + high) // 2
        stage = denoise_stage(model, shape, replace(strategy, blocks_to_swap=middle), options)
        low, high = (low, middle) if stage.fits(vram) else (middle + 1, high)
    return replace(strategy, blocks_to_swap=low)


def fewest_chunks(model, shape, strategy: MemoryStrategy, options: PlanOptions, vram: int | None,
                  leanest_blocks: bool = False) -> MemoryStrategy:
    """`strategy` with the fewest CHUNK_STEPS token slices under which its denoise fits `vram` (the compute's
    budget, PlanOptions.compute_budget; block swap: at the strategy's own blocks_to_swap, or with
    `leanest_blocks` with every block swapped, the tier's leanest, for a planner that chooses the blocks
    afterwards); when none
    does, the count that needs the least under that budget (StagePlan.footprint: near the limit the allocator
    releases its cache, so where one phase of a stage fits and another does not, as with Wan 2.2's two
    denoisers, the lowest unlimited reservation is not always the closest to fitting).
    The tier's weights are what they are: chunking lowers activations only."""
    if vram is None:
        return replace(strategy, activation_chunks=1)
    probe = strategy
    if leanest_blocks and strategy.offload is OffloadTier.BLOCK_SWAP:
        probe = replace(strategy, blocks_to_swap=min(model.weights(n).block_count for n in model.layout.denoisers))
    leanest = None
    for chunks in CHUNK_STEPS:
        try:
            stage = denoise_stage(model, shape, replace(probe, activation_chunks=chunks), options)
        except ValueError:
            if chunks == 1:
                raise
            break  # a family whose blocks cannot be chunked (the run leaves auto off for it too)
        need = stage.footprint(vram)  # one allocator replay per phase: fits(vram) is need <= vram
        if need <= vram:
            return replace(strategy, activation_chunks=chunks)
        if leanest is None or need < leanest[1]:
            leanest = (chunks, need)
    return replace(strategy, activation_chunks=leanest[0])


def _text_encoder_that_fits(model, shape, strategy, options, budgets) -> MemoryStrategy:
    vram, ram = budgets
    if text_encode_stage(model, shape, strategy, options).fits(vram):
        return strategy
    on_cpu = replace(strategy, text_encoder=TextEncoderPlacement.CPU)
    return on_cpu if text_encode_stage(model, shape, on_cpu, options).ram_bytes <= ram else strategy


def tiling_that_fits(model, shape, strategy, options, vram: int, attempts: int = 4) -> MemoryStrategy:
    """Untiled if the whole decode fits; else the cheapest tiling whose traced peak fits."""
    untiled = decode_stage(model, shape, strategy, options)
    if untiled.fits(vram):
        return strategy
    phase = untiled.peak_phase
    fixed = CUDA_CONTEXT_BYTES + sum(phase.resident)  # context, workspace, VAE weights, the latent
    if untiled.on_cpu:  # no context; the process's RAM and the weights not already in it
        fixed = untiled.host_bytes + sum(phase.resident) - phase.in_host_bytes
    activation = max(phase.peak.allocated - sum(phase.resident), 1)
    latent = model.latent_shape(shape)
    pixels = peak_call_pixels(latent, model.geometry, None, model.vae_stream_batch)  # what the untiled peak scales with
    free = vram - fixed
    tiled = strategy
    for _ in range(attempts):
        tiling = auto_tiling(max(free, 1), latent, model.geometry, activation / pixels, model.vae_min_tile,
                             model.vae_stream_batch)
        tiled = replace(strategy, vae_tiling=tiling)
        if tiling is None or decode_stage(model, shape, tiled, options).fits(vram):
            break
        free = int(free * 0.6)
    return tiled


def _over(need: int, budget: int) -> str:
    """"9.1 > 8.0 GiB"; with two decimals where one would print the need equal to the budget ("1.04 > 1.00")."""
    if f"{need / GiB:.1f}" == f"{budget / GiB:.1f}":
        return f"{need / GiB:.2f} > {budget / GiB:.2f} GiB"
    return f"{need / GiB:.1f} > {_gib(budget)}"


def tiles_text(tiling, frames: int) -> str:
    """A plan's VAE tiling as its tables show it: "256px/32f", or "256px/all" where one temporal tile holds the whole
    clip (the plan rounds it up to the VAE's 4-frame grid, and "124f" for a 121-frame clip read as a mistake);
    "-" untiled."""
    if tiling is None:
        return "-"
    return f"{tiling.tile_size}px/" + ("all" if tiling.temporal_size >= frames else f"{tiling.temporal_size}f")


def _gib(nbytes: int | None) -> str:
    """"8.0 GiB"; below 0.05 GiB three significant digits ("0.001 GiB"), so a tiny budget never reads 0.0."""
    if nbytes is None:
        return "-"
    return f"{nbytes / GiB:.3g} GiB" if 0 < nbytes < GiB // 20 else f"{nbytes / GiB:.1f} GiB"
