"""The out-of-memory ladder for sampling: free, escalate to a leaner strategy, resume.

When denoising runs out of device memory, the strategy (and the LoRAs) are removed as after any
error, cached memory is returned (memory.cleanup.free_memory), and the run goes on under the next
rung from the last finished step: its latents, the scheduler's state and the random generator's
(pipelines/sample_call.py), so the result is the one an uninterrupted run under the final
strategy gives, bit for bit.

Which rung: the first strategy, in order of leanness (more blocks swapped, then sequential), that
the planner predicts to fit the device memory free after the cleanup, when the host says how much
is free and the planner can model the pipeline. Otherwise a fixed ladder: block swap with half the
blocks not yet swapped added, then every block, then sequential. Sequential is the last rung; an
out-of-memory error there is raised as `SamplingOutOfMemory`, saying what to change.
"""

from __future__ import annotations

import logging
import math
from ..memory.accounting import Attention
from dataclasses import dataclass, replace
from typing import Callable

from ..memory import MemoryStrategy, OffloadTier

log = logging.getLogger("vidmem")


class SamplingOutOfMemory(RuntimeError):
    """Out of device memory even under the last rung (sequential); the message says what to change."""


@dataclass(frozen=True)
class Rung:
    """One escalation, for the receipt."""

    failed: str  # the strategy that ran out of memory
    at_step: int  # 1-based step that was running (0: before the first step)
    resumed_from: int  # finished steps kept
    chosen: str  # the next strategy
    how: str  # "planner" or "fixed ladder"
    cleanup: dict  # memory.cleanup.FreeReceipt.as_dict(): device memory before and after freeing

    def as_dict(self) -> dict:
        return {"failed": self.failed, "at_step": self.at_step, "resumed_from_step": self.resumed_from,
                "next": self.chosen, "chosen_by": self.how, "cleanup": self.cleanup}


def fixed_ladder(strategy: MemoryStrategy, blocks: int) -> list[MemoryStrategy]:
    """The rungs above `strategy`: half the unswapped blocks added, every block, sequential."""
    if strategy.offload is OffloadTier.SEQUENTIAL:
        return []
    swapped = strategy.blocks_to_swap if strategy.offload is OffloadTier.BLOCK_SWAP else 0
    counts = sorted({swapped + math.ceil((blocks - swapped) / 2), blocks} - {swapped}) if blocks > swapped else []
    rungs = [replace(strategy, offload=OffloadTier.BLOCK_SWAP, blocks_to_swap=n) for n in counts if n > 0]
    return rungs + [replace(strategy, offload=OffloadTier.SEQUENTIAL, blocks_to_swap=0)]


def planned_rung(strategy: MemoryStrategy, blocks: int, fits: Callable[[MemoryStrategy], bool | None]) -> MemoryStrategy | None:
    """The leanest-needed rung the planner predicts to fit: the fewest swapped blocks above the
    current count that fit (the denoise peak falls as blocks are swapped), else sequential.
    None when the planner cannot say (then the fixed ladder is used)."""
    sequential = replace(strategy, offload=OffloadTier.SEQUENTIAL, blocks_to_swap=0)
    if strategy.offload is OffloadTier.SEQUENTIAL:
        return None
    low = (strategy.blocks_to_swap if strategy.offload is OffloadTier.BLOCK_SWAP else 0) + 1
    swap = lambda n: replace(strategy, offload=OffloadTier.BLOCK_SWAP, blocks_to_swap=n)  # noqa: E731
    if low > blocks:
        return sequential
    verdict = fits(swap(blocks))
    if verdict is None:
        return None
    if not verdict:
        return sequential
    high = blocks
    while low < high:
        middle = (low + high) // 2
        verdict = fits(swap(middle))
        if verdict is None:
            return None
        low, high = (low, middle) if verdict else (middle + 1, high)
    return swap(low)


def next_rung(strategy: MemoryStrategy, blocks: int, fits: Callable[[MemoryStrategy], bool | None] | None) -> tuple[MemoryStrategy, str] | None:
    """(next strategy, how it was chosen), or None when `strategy` is the last rung."""
    if fits is not None:
        try:
            planned = planned_rung(strategy, blocks, fits)
        except Exception as error:  # noqa: BLE001 - a failed prediction must not stop the ladder
            log.info("vidmem: no memory prediction for the OOM ladder: %s", error)
            planned = None
        if planned is not None:
            return planned, "planner"
    rungs = fixed_ladder(strategy, blocks)
    return (rungs[0], "fixed ladder") if rungs else None


def out_of_memory_message(strategy: MemoryStrategy, step: int, steps: int, rungs: list[Rung], error: BaseException) -> str:
    tried = " -> ".join([r.failed for r in rungs] + [strategy.describe()])
    return (
        f"out of device memory during denoising at step {step}/{steps} even with {strategy.describe()}, the leanest "
        f"strategy (tried: {tried}). Lower width, height or frames; load the transformer stored as fp8 or GGUF "
        f"(weight_dtype); or close other programs using the GPU. ({error})"
    )


def no_climb_message(strategy: MemoryStrategy, step: int, steps: int, error: BaseException) -> str:
    """Out of memory where the ladder may not climb (a rank of a context-parallel run)."""
    return (
        f"out of device memory during denoising at step {step}/{steps} under {strategy.describe()}; the ranks of a "
        f"context-parallel run keep the strategy they started with, so none climbs the ladder alone. Choose a leaner "
        f"offload tier on the Memory Strategy (each GPU applies it: block_swap, then sequential), or lower width, "
        f"height or frames. ({error})"
    )


def planner_fits(loaded, width: int, height: int, frames: int, steps: int, guided: bool,
                 budget: int | None, attention: Attention = Attention.FUSED) -> Callable[[MemoryStrategy], bool] | None:
    """Whether the planner predicts the denoise stage under a strategy to fit `budget` device bytes
    (the host's figure after the cleanup); None without a budget."""
    if budget is None:
        return None
    from ..memory.plan.stages import denoise_stage
    from ..memory.plan.types import PlanOptions, VideoShape
    from .planning import plan_options, planner_model

    def fits(strategy: MemoryStrategy) -> bool:
        model = planner_model(loaded)
        shape = VideoShape(width, height, frames, cfg=guided)
        return denoise_stage(model, shape, strategy, plan_options(loaded, PlanOptions(attention=attention, steps=steps))).fits(budget)

    return fits
