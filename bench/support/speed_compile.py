"""bench/speed.py, compiled blocks (issue 24 part 2): per tier, the denoise step time of compiled
blocks against eager, the recompilations of a second run, and the first run's compile time.

Per tier (none, block_swap of half and of all the blocks, sequential; speed_runs.tiers; `--compile-tiers`
picks some, e.g. at 832x480x81, where each tier costs a compile and seven sampler calls):
- dynamo's caches are reset, so each tier's first compiled call compiles from nothing (inductor's
  on-disk kernel cache, shared by every run on the machine, still serves kernels it has seen:
  `compile_seconds` is dynamo + AOT + whatever inductor could not reuse);
- a first compiled call (`compile_seconds` from its report) and a second one
  (`recompiles_second_run`: frames dynamo compiled during it, which must be 0);
- `runs` interleaved rounds of one eager and one compiled call, after those two; a step's time is the
  denoise stage's seconds (the receipt's, prompt encoding excluded) over the steps, its ratio the
  median compiled step over the median eager step (below 1: compiling pays);
- `max_abs_diff`: compiled latents against eager ones (inductor reorders float32 reductions; a
  value far above 1e-3 of the latents' range means a wrong result, not rounding).

On the CPU at the bench's tiny widths the blocks are too small for fused kernels to matter much; the
GPU rows are the ones that tell. Under sequential every streamed leaf is a graph break, so its
compiled code is many small graphs (`graph_breaks` in the first run's report).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import torch

from vidmem.memory import MemoryStrategy
from vidmem.pipelines.compile import CompileSettings, compiled_blocks
from vidmem.pipelines.family import denoiser_blocks
from vidmem.pipelines.sample import sample
from vidmem.pipelines.step_cache import StepCache

from .speed_runs import SpeedConfig, tiers


def compile_rows(loaded, config: SpeedConfig, settings: CompileSettings = CompileSettings(on=True),
                 log=print, tier_names: Sequence[str] = ()) -> dict:
    """{"step_time_ratio", "recompiles_second_run", "compile_seconds"} (each tier -> value), with the
    settings, each tier's step times, latent difference, graph breaks and any fallback message.
    `tier_names`: the tiers measured, in their order (default every one of speed_runs.tiers)."""
    rows = {}
    for tier, strategy in chosen_tiers(config.blocks, tier_names).items():
        rows[tier] = row = _tier_row(loaded, config, strategy, settings)
        ratio = f"x{row['step_time_ratio']:.2f}" if row["step_time_ratio"] is not None else "untimed"
        # logged as each tier ends: a lease's time limit that cuts the part short keeps the tiers done in its log
        log(f"  compile {tier:<14} step {ratio}  recompiles {row['recompiles_second_run']}  "
            f"compile {row['compile_seconds']:.1f} s  diff {row['max_abs_diff']:.2e}" +
            (f"  FALLBACK: {row['fallback']}" if row["fallback"] else ""))
    keys = ("step_time_ratio", "recompiles_second_run", "compile_seconds", "eager_step_s", "compiled_step_s",
            "max_abs_diff", "graph_breaks", "fallback")
    found = {key: {tier: row[key] for tier, row in rows.items()} for key in keys}
    return {**found, "settings": settings.describe(), "runs": config.runs}


def chosen_tiers(blocks: int, names: Sequence[str] = ()) -> dict[str, MemoryStrategy]:
    """speed_runs.tiers(blocks), or those named, in the order named; an unknown name is refused with the choices."""
    every = tiers(blocks)
    unknown = [name for name in names if name not in every]
    if unknown:
        raise ValueError(f"--compile-tiers: {', '.join(unknown)} not among this bench's tiers at {blocks} blocks "
                         f"({', '.join(every)})")
    return {name: every[name] for name in names} if names else every


def _tier_row(loaded, config: SpeedConfig, strategy, settings: CompileSettings) -> dict:
    torch._dynamo.reset()
    first, first_report = _call(loaded, config, strategy, settings)
    second, second_report = _call(loaded, config, strategy, settings)
    eager, eager_receipt = _call(loaded, config, strategy, CompileSettings())  # the reference, and a warm-up
    eager_steps, compiled_steps = [], []
    for _ in range(config.runs):  # interleaved: machine load lands on both alike
        eager_steps.append(step_seconds(_call(loaded, config, strategy, CompileSettings())[1], config))
        compiled_steps.append(step_seconds(_call(loaded, config, strategy, settings)[1], config))
    eager_step = statistics.median(eager_steps) if eager_steps else None
    compiled_step = statistics.median(compiled_steps) if compiled_steps else None
    return {"step_time_ratio": round(compiled_step / eager_step, 4) if eager_steps else None,
            "recompiles_second_run": second_report["compile"]["frames_compiled"],
            "compile_seconds": first_report["compile"]["compile_seconds"],
            "eager_step_s": eager_step, "compiled_step_s": compiled_step,
            "max_abs_diff": max((first - eager).abs().max().item(), (second - eager).abs().max().item()),
            "graph_breaks": first_report["compile"]["graph_breaks"],
            "fallback": first_report["compile"]["fallback"] or second_report["compile"]["fallback"]}


def _call(loaded, config: SpeedConfig, strategy, settings: CompileSettings) -> tuple[torch.Tensor, dict]:
    """One cold `sample()` call (warm device copies released, as in speed_runs.call) under `settings`;
    (latents, receipt with the compile report under "compile")."""
    loaded.release_warm()
    with compiled_blocks(denoiser_blocks(loaded.pipe, loaded.spec), settings) as compiled:
        result = sample(loaded, strategy, config.request(StepCache()), device=torch.device(config.device))
    return result.latent["samples"], {**result.receipt, "compile": compiled.as_dict()}


def step_seconds(receipt: dict, config: SpeedConfig) -> float:
    """The denoise stage's seconds (the receipt's; prompt encoding excluded) over the steps."""
    denoise = next(stage for stage in receipt["stages"] if stage["stage"] == "denoise")
    return denoise["seconds"] / config.steps
