"""The out-of-memory ladder for sampling: free, escalate to a leaner strategy, resume.

What it covers: an out-of-memory error while the strategy places the weights before the first step
(`offload=none` puts every component on the device at once), and one while denoising (the loop,
with its setup: an image-to-video model's image encoding, the prompt embeddings' move to the
device). The strategy (and the LoRAs) are removed as after any error, cached memory is returned
(memory.cleanup.free_memory), and the run goes on under the next rung from the last finished step
(from the start after a placement error: nothing was lost): its latents, the scheduler's state and
the random generator's (pipelines/sample_call.py), so the result is the one an uninterrupted run
under the final strategy gives, bit for bit. Not covered: the prompt encoder running out of memory
(the rungs stream the denoiser's blocks, not the encoder), which stops with a SamplingOutOfMemory
naming `text_encoder=cpu` (`text_encoder_message`).

Which rung: the first strategy, in order of leanness, that the planner predicts to fit the device
memory free after the cleanup, when the host says how much is free and the planner can model the
pipeline: more blocks swapped; then, where activations are the wall (not even every block swapped
fits), more activation chunks (each block's tokens in slices: pipelines/activation_chunks.py), with
the fewest blocks that fit at that count; then sequential with the fewest chunks that fit. Otherwise
a fixed ladder: block swap with half the blocks not yet swapped added, then every block, then
sequential, then sequential with the chunk count doubled up to the largest step. Chunk rungs are
only offered for blocks that can be chunked. The last rung's out-of-memory error is raised as
`SamplingOutOfMemory`, saying what to change.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from typing import Callable, Mapping

from ..memory import MemoryStrategy, OffloadTier, TextEncoderPlacement
from ..memory.accounting import Attention
from ..memory.plan.candidates import CHUNK_STEPS

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


def more_chunks(strategy: MemoryStrategy, chunks_ran: int = 1) -> list[int]:
    """The chunk counts above what the failed attempt ran with: the strategy's count, or what its
    `auto` resolved to (`chunks_ran`), whichever is larger."""
    return [count for count in CHUNK_STEPS if count > max(strategy.chunk_count, chunks_ran)]


def fixed_ladder(strategy: MemoryStrategy, blocks: int, chunkable: bool = False, chunks_ran: int = 1) -> list[MemoryStrategy]:
    """The rungs above `strategy`: half the unswapped blocks added, every block, sequential, then
    (`chunkable`) sequential with each chunk count above the one that ran."""
    sequential = replace(strategy, offload=OffloadTier.SEQUENTIAL, blocks_to_swap=0)
    chunked = [replace(sequential, activation_chunks=n) for n in more_chunks(strategy, chunks_ran)] if chunkable else []
    if strategy.offload is OffloadTier.SEQUENTIAL:
        return chunked
    swapped = strategy.blocks_to_swap if strategy.offload is OffloadTier.BLOCK_SWAP else 0
    counts = sorted({swapped + math.ceil((blocks - swapped) / 2), blocks} - {swapped}) if blocks > swapped else []
    rungs = [replace(strategy, offload=OffloadTier.BLOCK_SWAP, blocks_to_swap=n) for n in counts if n > 0]
    return rungs + [sequential] + chunked


Fits = Callable[[MemoryStrategy], "bool | None"]


def planned_rung(strategy: MemoryStrategy, blocks: int, fits: Fits, chunkable: bool = False,
                 chunks_ran: int = 1) -> MemoryStrategy | None:
    """The leanest-needed rung the planner predicts to fit: the fewest swapped blocks above the
    current count that fit (the denoise peak falls as blocks are swapped); where not even every
    block fits and the blocks can be chunked, the fewest chunks above the current count under which
    some block count fits, with the fewest such blocks; else sequential with the fewest chunks that
    fit (when nothing is predicted to fit, the leanest: it may still run). None when the planner
    cannot say (then the fixed ladder is used). `chunks_ran`: what the failed attempt's chunk count
    (auto's included) was; chunk rungs start above it."""
    larger = more_chunks(strategy, chunks_ran) if chunkable else []
    if strategy.offload is not OffloadTier.SEQUENTIAL:
        swapped = strategy.blocks_to_swap if strategy.offload is OffloadTier.BLOCK_SWAP else 0
        counts = [strategy.activation_chunks] + larger
        for index, count in enumerate(counts):
            # At the current count a rung needs one more block; at a larger count the same blocks are one.
            found = _fewest_blocks(replace(strategy, activation_chunks=count), swapped + (index == 0), blocks, fits)
            if found is not False:
                return found  # a rung, or None: the planner cannot say
    return _sequential_rung(strategy, fits, larger)


def _fewest_blocks(strategy: MemoryStrategy, low: int, blocks: int, fits: Fits) -> MemoryStrategy | None | bool:
    """Block swap of the fewest blocks from `low` up that fit; False when not even every block fits;
    None when the planner cannot say. A binary search: the denoise peak falls as blocks are swapped."""
    swap = lambda n: replace(strategy, offload=OffloadTier.BLOCK_SWAP, blocks_to_swap=n)  # noqa: E731
    if max(low, 1) > blocks:
        return False
    verdict = fits(swap(blocks))
    if not verdict:
        return verdict  # None (cannot say) or False
    low, high = max(low, 1), blocks
    while low < high:
        middle = (low + high) // 2
        verdict = fits(swap(middle))
        if verdict is None:
            return None
        low, high = (low, middle) if verdict else (middle + 1, high)
    return swap(low)


def _sequential_rung(strategy: MemoryStrategy, fits: Fits, larger: list[int]) -> MemoryStrategy | None:
    sequential = replace(strategy, offload=OffloadTier.SEQUENTIAL, blocks_to_swap=0)
    candidates = [] if strategy.offload is OffloadTier.SEQUENTIAL else [sequential]
    candidates += [replace(sequential, activation_chunks=count) for count in larger]
    for candidate in candidates:
        verdict = fits(candidate)
        if verdict is None:
            return None
        if verdict:
            return candidate
    return candidates[-1] if candidates else None


def next_rung(strategy: MemoryStrategy, blocks: int, fits: Fits | None,
              chunkable: bool = False, chunks_ran: int = 1) -> tuple[MemoryStrategy, str] | None:
    """(next strategy, how it was chosen), or None when `strategy` is the last rung. `chunkable`:
    the denoiser's blocks can run in activation chunks (and the attention kernel allows it);
    `chunks_ran`: the chunk count the failed attempt ran with."""
    if fits is not None:
        try:
            planned = planned_rung(strategy, blocks, fits, chunkable, chunks_ran)
        except Exception as error:  # noqa: BLE001 - a failed prediction must not stop the ladder
            log.info("vidmem: no memory prediction for the OOM ladder: %s", error)
            planned = None
        if planned is not None:
            return planned, "planner"
    rungs = fixed_ladder(strategy, blocks, chunkable, chunks_ran)
    return (rungs[0], "fixed ladder") if rungs else None


BEFORE_THE_STEPS = {  # where an attempt can run out of memory before its first step, for the messages
    "placing": "while placing the weights on the device (before the first step)",
    "image": "while encoding the start image (before the first step)",
}


def when_out_of_memory(step: int, steps: int, before: str = "") -> str:
    """Where the attempt was, for the messages: `before` the steps (a BEFORE_THE_STEPS key), or the
    1-based `step` of `steps`."""
    return BEFORE_THE_STEPS[before] if before else f"during denoising at step {step}/{steps}"


def out_of_memory_message(strategy: MemoryStrategy, when: str, rungs: list[Rung], error: BaseException,
                          hint: str = "", image: bool = False) -> str:
    """`when`: when_out_of_memory(...); `hint`: what else would let the ladder go on (e.g. the
    attention kernel that forbade chunk rungs); `image`: the start image's encoding ran out (the
    transformer's storage and chunks do not help there)."""
    tried = " -> ".join([r.failed for r in rungs] + [strategy.describe()])
    fix = ("Lower width or height (the start image is encoded at the video's size); " if image else
           "Lower width, height or frames; load the transformer stored as fp8 or GGUF (weight_dtype); " + hint)
    return (
        f"out of device memory {when} even with {strategy.describe()}, the leanest "
        f"strategy (tried: {tried}). {fix}or close other programs using the GPU. ({error})"
    )


def no_climb_message(strategy: MemoryStrategy, when: str, error: BaseException) -> str:
    """Out of memory where the ladder may not climb (a rank of a context-parallel run)."""
    return (
        f"out of device memory {when} under {strategy.describe()}; the ranks of a "
        f"context-parallel run keep the strategy they started with, so none climbs the ladder alone. Choose a leaner "
        f"offload tier on the Memory Strategy (each GPU applies it: block_swap, then sequential), or lower width, "
        f"height or frames. ({error})"
    )


def text_encoder_message(strategy: MemoryStrategy, error: BaseException) -> str:
    """Out of memory while the prompt encoder ran: not the ladder's (its rungs stream the denoiser's
    blocks; a leaner denoiser would not make the encoder fit), so the message says what would."""
    fixes = []
    if strategy.text_encoder is not TextEncoderPlacement.CPU:
        fixes.append("set text_encoder=cpu on the Memory Strategy (the prompt is encoded on the CPU; only its "
                     "embeddings move to the GPU)")
    if strategy.offload is OffloadTier.NONE:
        fixes.append("choose a leaner offload tier (model, block_swap or sequential: the encoder then has the GPU "
                     "to itself while it runs)")
    elif strategy.offload is not OffloadTier.SEQUENTIAL:
        fixes.append("choose offload=sequential (the encoder streams in layer by layer)")
    fixes.append("close other programs using the GPU")
    return (f"out of device memory while encoding the prompt under {strategy.describe()}; the out-of-memory ladder "
            f"covers placing the weights and denoising, not the text encoder. To fix: {'; or '.join(fixes)}. ({error})")


def planner_fits(loaded, shape, steps: int, budget: int | None, attention: Attention = Attention.FUSED,
                 cache_state: Mapping | None = None) -> Callable[[MemoryStrategy], bool] | None:
    """Whether the planner predicts the denoise stage of `shape` (a VideoShape: its size, frames,
    guidance and context windows) under a strategy to fit `budget` device bytes (the host's free figure
    after the cleanup, the CUDA context already made: `device_room_for_plan` adds it back, as the plan
    counts it), beside a step cache's state (`cache_state`: the next attempt restarts cached);
    None without a budget."""
    if budget is None:
        return None
    from ..memory.plan.stages import denoise_stage
    from ..memory.plan.types import PlanOptions
    from ..memory.telemetry import device_room_for_plan
    from .planning import plan_options, sampling_model

    room = device_room_for_plan(budget)

    models = []  # built on first use (with the run's LoRA tensors, which stream with their blocks), once per call

    def fits(strategy: MemoryStrategy) -> bool:
        models[:] = models or [sampling_model(loaded)]
        options = plan_options(loaded, PlanOptions(attention=attention, steps=steps, cache_state=cache_state or {}))
        return denoise_stage(models[0], shape, strategy, options).fits(room)

    return fits
