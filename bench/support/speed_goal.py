"""bench/speed.py, the goal part (issue 24): the Speed node's fastest settings against what a user of a
Comfy-Org fp8 file runs without one, each a whole sampler call, side by side in one process.

The reference (`baseline`): no Speed node, so eager blocks, attention as the model has it (SDPA choosing
its kernel per call) and the transformer's linear layers stored fp8_scaled and upcast per forward. Each
row: compiled blocks with one attention kernel (`auto`; `sage` where sageattention is installed and
runs here) and fp8 matmul off or on (on where the device has it). A choice this device refuses is
listed with the refusal's reason, one that fails while sampling with its error.

Per row and tier (`none` and block swap of every block by default; `--compile-tiers` picks others):
`step_time_ratio` (median compiled step over the median baseline step at the same tier, rounds
interleaved one baseline call then one row call, after a compiling call and a second call), the second
call's `recompiles` (frames dynamo compiled during it; must be 0), `psnr_db` of the row's latents
against the baseline's at that tier (None: equal), and `compile_seconds`. Per row,
`block_swap_over_none`: its step under block swap over its own step at tier none (the copies' cost once
compute is faster).

Goals (`goals`): the fastest row at tier none at least 1.5x faster than the baseline (step_time_ratio at
most 1/1.5), and that row's block swap step within 3% of its tier none step.

A step is the denoise stage's seconds over the steps (the receipt's; prompt encoding excluded). On the
CPU the fused kernels and fp8 matmul do not exist (torch emulates `_scaled_mm`) and `sage` is refused:
the CPU run checks the part end to end, the GPU rows are the ones that tell.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Sequence

import torch

from vidmem.memory import MemoryStrategy
from vidmem.memory.strategy import StrategyError
from vidmem.pipelines.compile import CompileSettings
from vidmem.pipelines.family import denoisers
from vidmem.pipelines.loader import LoadedPipeline, torch_dtype
from vidmem.pipelines.sample import sample
from vidmem.pipelines.speed import NO_SPEED_NODE, Speed, resolve_speed
from vidmem.pipelines.step_cache import StepCache

from .speed_compile import chosen_tiers, step_seconds
from .speed_fp8 import with_stored_transformer
from .speed_runs import SpeedConfig, psnr_db

FORMAT = "fp8_scaled"
# (attention, fp8 matmul) per row, in the order measured: sage first, the kernel that could move the ratio at
# 32,760 tokens (attention is most of a step there), so that a lease's time limit cuts the least telling rows.
ROWS = (("sage", "off"), ("auto", "off"), ("sage", "on"), ("auto", "on"))
GOAL_SPEEDUP = 1.5
GOAL_SWAP_OVERHEAD = 1.03


def goal_rows(loaded: LoadedPipeline, config: SpeedConfig, settings: CompileSettings = CompileSettings(on=True),
              tier_names: Sequence[str] = (), log=print, on_row: Callable[[dict], None] = lambda found: None,
              row_names: Sequence[str] = ()) -> dict:
    """{"rows": {"<kernel>+fp8_<off|on>": {tier: {...}} or {"skipped"/"failed": reason}}, "goals", ...}:
    the module docstring's measurements on `loaded` with its transformer stored in FORMAT. `on_row` is given
    what is found so far after each row and tier (a lease's time limit may cut the part short). `row_names`:
    the rows to measure, by name, in the order given (default all of ROWS; `row_names_of` checks them)."""
    stored = with_stored_transformer(loaded, FORMAT)
    tiers = chosen_tiers(config.blocks, tier_names or ("none", f"block_swap_{config.blocks}"), lora=False)
    device = torch.device(config.device)
    judged = device.type == "cuda"  # the goals are a GPU's: a CPU's ratios only show the part runs
    rows: dict[str, dict] = {}
    found = {"format": FORMAT, "baseline": f"{NO_SPEED_NODE.describe()}, transformer {FORMAT}",
             "settings": settings.describe(), "runs": config.runs, "tiers": list(tiers), "rows": rows}
    for kernel, fp8 in row_names_of(row_names):
        name = f"{kernel}+fp8_{fp8}"
        speed = Speed(attention=kernel, compile=settings, fp8_matmul=fp8)
        refusal = _refusal(stored, speed, device)
        if refusal:
            rows[name] = {"skipped": refusal}
            log(f"  goal {name:<14} skipped: {refusal}")
            continue
        rows[name] = {}
        for tier, strategy in tiers.items():
            try:
                rows[name][tier] = row = _tier_row(stored, config, strategy, speed)
            except Exception as error:  # accepted, but failing on this model or shape: a result too
                rows[name]["failed"] = f"{tier}: {type(error).__name__}: {str(error)[:300]}"  # the tiers done stay
                log(f"  goal {name:<14} {tier:<14} FAILED: {rows[name]['failed']}")
                break
            log(f"  goal {name:<14} {tier:<14} step x{row['step_time_ratio']:.3f} of the baseline  "
                f"recompiles {row['recompiles']}  psnr {row['psnr_db']} dB  compile {row['compile_seconds']} s"
                + (f"  FALLBACK: {row['fallback']}" if row["fallback"] else ""))
            _add_swap_overhead(rows[name], tiers)
            found["goals"] = goals(rows, judged)  # a verdict on what is done, should the lease end here
            on_row(found)
    found["goals"] = goals(rows, judged)
    for line in found["goals"]["lines"]:
        log(f"  goal: {line}")
    return found


def row_names_of(names: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """ROWS named by `names` ("auto+fp8_on", ...), in the order named (a lease's time limit cuts the last named
    first, so the caller puts the row that decides first), each once; all of ROWS in their order for none.
    Raises ValueError naming the unknown ones and the known."""
    known = {f"{kernel}+fp8_{fp8}": (kernel, fp8) for kernel, fp8 in ROWS}
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(f"goal rows {', '.join(unknown)} unknown: choose among {', '.join(known)}")
    return tuple(known[name] for name in dict.fromkeys(names)) if names else ROWS


def _refusal(stored: LoadedPipeline, speed: Speed, device: torch.device) -> str:
    """Why the Sampler would refuse `speed` here ("" when it runs it), asked as the Sampler asks."""
    try:
        resolve_speed(speed, device, torch_dtype(stored.dtype_name), denoisers(stored.pipe, stored.spec))
    except StrategyError as error:
        return str(error)
    return ""


def _tier_row(stored: LoadedPipeline, config: SpeedConfig, strategy: MemoryStrategy, speed: Speed) -> dict:
    torch._dynamo.reset()  # each row compiles from nothing: its second call's recompiles are its own
    first, first_receipt = _call(stored, config, strategy, speed)
    second, second_receipt = _call(stored, config, strategy, speed)
    baseline, _ = _call(stored, config, strategy, NO_SPEED_NODE)  # the reference, and a warm-up
    baseline_steps, row_steps = [], []
    for _ in range(config.runs):  # interleaved: the machine's load lands on both alike
        baseline_steps.append(step_seconds(_call(stored, config, strategy, NO_SPEED_NODE)[1], config))
        row_steps.append(step_seconds(_call(stored, config, strategy, speed)[1], config))
    baseline_step, row_step = statistics.median(baseline_steps), statistics.median(row_steps)
    first_compile, second_compile = first_receipt["speed"]["compile"], second_receipt["speed"]["compile"]
    psnr = psnr_db(baseline, second)
    return {"step_time_ratio": round(row_step / baseline_step, 4), "baseline_step_s": baseline_step,
            "step_s": row_step, "recompiles": second_compile.get("frames_compiled", 0),
            "psnr_db": None if psnr is None else round(psnr, 2),
            "compile_seconds": first_compile.get("compile_seconds"),
            "same_latents_both_calls": torch.equal(first, second),
            "attention": second_receipt["speed"]["attention"].get("kernel"),
            "fp8_layers": second_receipt["speed"]["fp8_matmul"].get("fp8_layers"),
            "graph_breaks": first_compile.get("graph_breaks"),
            "fallback": first_compile.get("fallback") or second_compile.get("fallback") or ""}


def _call(stored: LoadedPipeline, config: SpeedConfig, strategy: MemoryStrategy, speed: Speed) -> tuple[torch.Tensor, dict]:
    """One cold `sample()` call (warm-run copies released, as every speed bench call) under `speed`."""
    stored.release_warm()
    request = dataclasses.replace(config.request(StepCache()), speed=speed)
    result = sample(stored, strategy, request, device=torch.device(config.device))
    return result.latent["samples"], result.receipt


def _add_swap_overhead(row: dict, tiers: dict) -> None:
    swapped = [tier for tier in tiers if tier.startswith("block_swap_") and tier in row]
    if "none" in row and swapped:
        row["block_swap_over_none"] = {tier: round(row[tier]["step_s"] / row["none"]["step_s"], 4) for tier in swapped}


def goals(rows: dict, judged: bool = True) -> dict:
    """The fastest row at tier none against GOAL_SPEEDUP, and its block swap overhead against GOAL_SWAP_OVERHEAD.
    Not `judged` (off a GPU): the figures without a verdict (met_* None)."""
    timed = {name: row for name, row in rows.items() if "none" in row}
    if not timed:
        return {"fastest": None, "met_speedup": None, "met_swap_overhead": None,
                "lines": ["no row ran at tier none: nothing to judge"]}
    name = min(timed, key=lambda n: timed[n]["none"]["step_time_ratio"])
    ratio = timed[name]["none"]["step_time_ratio"]
    overheads = timed[name].get("block_swap_over_none", {})
    worst = max(overheads.values()) if overheads else None
    met_speedup = ratio <= 1 / GOAL_SPEEDUP if judged else None
    met_swap = None if worst is None or not judged else worst <= GOAL_SWAP_OVERHEAD

    def verdict(met: bool | None) -> str:
        return "not judged off a GPU" if met is None else "met" if met else "not met"

    lines = [f"fastest {name}: x{ratio:.3f} of the baseline's step at tier none, {1 / ratio:.2f}x faster "
             f"(goal {GOAL_SPEEDUP}x): {verdict(met_speedup)}"]
    if worst is not None:
        lines.append(f"{name} under block swap: x{worst:.3f} of its own step at tier none (goal within "
                     f"{GOAL_SWAP_OVERHEAD - 1:.0%}): {verdict(met_swap)}")
    return {"fastest": name, "speedup": round(1 / ratio, 3), "met_speedup": met_speedup,
            "swap_overhead": worst, "met_swap_overhead": met_swap, "lines": lines}
