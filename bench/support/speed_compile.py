"""bench/speed.py, compiled blocks (issue 24 part 2): per tier, the denoise step time of compiled
blocks against eager, the recompilations of a second run, and the first run's compile time.

Per tier (none, block_swap of half and of all the blocks, sequential; speed_runs.tiers; `--compile-tiers`
picks some, e.g. at 832x480x81, where each tier costs a compile and seven sampler calls; a tier named with
`+lora`, e.g. `none+lora`, is that tier with a random LoRA of `--lora-rank` on every linear layer of every
block, loaded from a real file as the Load LoRA node does: its eager and compiled calls both carry it, so
its ratio is what compiled blocks give a user who samples with a LoRA, its hooks traced into the graphs):
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

import dataclasses
import statistics
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from vidmem.memory import MemoryStrategy
from vidmem.pipelines.compile import CompileSettings
from vidmem.pipelines.lora.spec import load_lora, with_lora
from vidmem.pipelines.sample import sample
from vidmem.pipelines.speed import AttentionKernel, Speed
from vidmem.pipelines.step_cache import StepCache

from .lora_files import write_lora
from .speed_runs import SpeedConfig, tiers

LORA = "+lora"  # a tier name's suffix: that tier with a random LoRA beside every block's linear layers
LORA_RANK = 32


def compile_rows(loaded, config: SpeedConfig, settings: CompileSettings = CompileSettings(on=True),
                 log=print, tier_names: Sequence[str] = (), lora_rank: int = LORA_RANK,
                 on_row: Callable[[dict], None] = lambda found: None) -> dict:
    """{"step_time_ratio", "recompiles_second_run", "compile_seconds"} (each tier -> value), with the
    settings, each tier's step times, latent difference, graph breaks and any fallback message.
    `tier_names`: the tiers measured, in their order (default every one of speed_runs.tiers; `+lora` tiers run
    with a random LoRA of `lora_rank`). `on_row` is given what is found so far after each tier (a lease's time
    limit may cut the part short). A tier that raises is a result too (`failed`: tier -> the error); the
    others still run."""
    rows, failed = {}, {}
    lora: dict = {}
    with tempfile.TemporaryDirectory(prefix="vidmem-speed-lora-") as folder:
        styled = None
        for tier, strategy in chosen_tiers(config.blocks, tier_names).items():
            try:
                if tier.endswith(LORA) and styled is None:
                    styled = with_random_lora(loaded, config, Path(folder), lora_rank)
                    lora = {"lora": {"rank": lora_rank, "layers": sum(map(len, styled.loras[0].layers.values())),
                                     "skipped": len(styled.loras[0].skipped)}}
                rows[tier] = _logged_row(tier, styled if tier.endswith(LORA) else loaded, config, strategy, settings,
                                         log)
            except Exception as error:  # noqa: BLE001 - one tier's failure on this model or device is a finding
                failed[tier] = f"{type(error).__name__}: {str(error)[:300]}"
                log(f"  compile {tier:<16} FAILED: {failed[tier]}")
            on_row(_found(rows, settings, config, lora, failed))
    return _found(rows, settings, config, lora, failed)


def _found(rows: dict, settings: CompileSettings, config: SpeedConfig, lora: dict, failed: dict) -> dict:
    keys = ("step_time_ratio", "recompiles_second_run", "compile_seconds", "eager_step_s", "compiled_step_s",
            "max_abs_diff", "graph_breaks", "fallback")
    found = {key: {tier: row[key] for tier, row in rows.items()} for key in keys}
    return {**found, "settings": settings.describe(), "runs": config.runs, **lora, **({"failed": failed} if failed else {})}


def with_random_lora(loaded, config: SpeedConfig, folder: Path, rank: int):
    """`loaded` with a random rank-`rank` LoRA on every linear layer of its `config.blocks` blocks, at strength 1."""
    path = write_lora(loaded.pipe.transformer, config.blocks, folder / f"rank{rank}.safetensors", rank)
    return with_lora(loaded, load_lora(path, loaded.pipe, 1.0, name=path.name))


def _logged_row(tier: str, loaded, config: SpeedConfig, strategy, settings: CompileSettings, log) -> dict:
    row = _tier_row(loaded, config, strategy, settings)
    ratio = f"x{row['step_time_ratio']:.2f}" if row["step_time_ratio"] is not None else "untimed"
    # logged as each tier ends: a lease's time limit that cuts the part short keeps the tiers done in its log
    log(f"  compile {tier:<14} step {ratio}  recompiles {row['recompiles_second_run']}  "
        f"compile {row['compile_seconds']:.1f} s  diff {row['max_abs_diff']:.2e}" +
        (f"  FALLBACK: {row['fallback']}" if row["fallback"] else ""))
    return row


def chosen_tiers(blocks: int, names: Sequence[str] = (), lora: bool = True) -> dict[str, MemoryStrategy]:
    """speed_runs.tiers(blocks), or those named, in the order named (with `lora`, each also as `<tier>+lora`); an
    unknown name is refused with the choices."""
    every = tiers(blocks)
    choices = [*every, *(f"{tier}{LORA}" for tier in every if lora)]
    unknown = [name for name in names if name not in choices]
    if unknown:
        raise ValueError(f"--compile-tiers: {', '.join(unknown)} not among this part's tiers at {blocks} blocks "
                         f"({', '.join(choices)})")
    return {name: every[name.removesuffix(LORA)] for name in names} if names else every


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
    """One cold `sample()` call (warm device copies released, as in speed_runs.call) with a Speed node that
    compiles the blocks under `settings` (the Sampler's route: a LoRA's hooks traced into the graphs);
    (latents, receipt with the compile report under "compile")."""
    loaded.release_warm()
    request = dataclasses.replace(config.request(StepCache()), speed=Speed(AttentionKernel.AUTO, settings))
    result = sample(loaded, strategy, request, device=torch.device(config.device))
    return result.latent["samples"], {**result.receipt, "compile": result.receipt.get("speed", {}).get("compile", {})}


def step_seconds(receipt: dict, config: SpeedConfig) -> float:
    """The denoise stage's seconds (the receipt's; prompt encoding excluded) over the steps."""
    denoise = next(stage for stage in receipt["stages"] if stage["stage"] == "denoise")
    return denoise["seconds"] / config.steps
