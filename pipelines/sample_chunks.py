"""activation_chunks for one sampling call: the strategy's count, or auto's, asked of the planner.

The mechanism is pipelines/activation_chunks.py; this is its place in `sample()` (as sample_ladder.py
is the out-of-memory ladder's): which count the call runs with, and why auto left chunking off.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from dataclasses import replace

from ..memory.accounting import Attention
from ..memory.plan.types import CacheState, PlanOptions, VideoShape
from ..memory.telemetry import device_room_for_plan

from .activation_chunks import AppliedChunks, activation_chunks, refusal
from .family import denoiser_blocks, denoisers

log = logging.getLogger("vidmem")


# Why auto runs unchunked under SageAttention 1.x (speed.ResolvedSpeed.takes_chunks), in the receipt's note.
UNCHUNKED_KERNEL = ("auto left chunking off: sageattention 1.x cannot run in slices (they call diffusers' dispatcher, "
                    "which needs sageattention 2.1.1 or newer)")


@contextlib.contextmanager
def chunks_for_call(loaded, strategy, request, guided: bool, budget_bytes: int | None,
                    cache_state: Mapping[str, CacheState] | None = None,
                    takes_chunks: bool = True, attention: Attention = Attention.FUSED) -> Iterator[AppliedChunks]:
    """`strategy.activation_chunks` applied to `loaded`'s denoisers for one sampling call of `request`
    (a SampleRequest: its width, height, frames and context windows) with guidance on or off.

    auto asks the planner for the fewest slices whose denoise fits `budget_bytes` (the device bytes
    the run may use, as the host's free figure gives them: the CUDA context already made, which
    `device_room_for_plan` adds back for the planner; None, as on the CPU: unknown, so nothing is
    chunked) beside what the step cache keeps (`cache_state`, per denoiser), and leaves chunking
    off, saying why in the receipt's note, where the model cannot chunk, the attention kernel cannot
    run in slices (`takes_chunks` False) or the planner cannot model it. `attention`: how the planner
    counts the call's resolved kernel (ResolvedSpeed.planned_attention: one that holds the whole score
    matrix needs more slices).
    An explicit count on a model that cannot chunk raises ChunkError before any block changes."""
    blocks = denoiser_blocks(loaded.pipe, loaded.spec)
    modules = denoisers(loaded.pipe, loaded.spec)
    count, note = strategy.activation_chunks, ""
    if strategy.chunks_auto and not takes_chunks:
        count, note = 1, UNCHUNKED_KERNEL
    elif strategy.chunks_auto:
        shape = VideoShape(request.width, request.height, request.frames, cfg=guided,
                           window=getattr(request, "window", 0), window_overlap=getattr(request, "window_overlap", 0))
        count, note = _auto_count(loaded, strategy, shape, budget_bytes, blocks, attention,
                                  cache_state or {})
    with activation_chunks(modules, blocks, count) as applied:
        yield replace(applied, note=note)  # the same record: the hooks fill in the slices that ran


def chunk_budget(free_bytes: int | None, warm) -> int | None:
    """The device bytes auto chunks against at run time: what is free now plus what the warm store
    kept from the last call. Those copies are this call's own weights, which the planner counts
    beside the activations, and already missing from the free figure (as room.keep_bytes counts
    them): without them a warm second run chose more slices than the first."""
    if free_bytes is None:
        return None
    return free_bytes + (warm.held_bytes if warm is not None else 0)


def can_chunk(loaded) -> bool:
    """Whether every denoiser block of `loaded` can run in activation chunks."""
    return refusal(denoiser_blocks(loaded.pipe, loaded.spec)) is None


def _auto_count(loaded, strategy, shape: VideoShape, budget_bytes: int | None, blocks, attention,
                cache_state: Mapping[str, CacheState]) -> tuple[int, str]:
    """(slices, note) for activation_chunks=auto: the planner's fewest that fit, or 1 and why."""
    if budget_bytes is None:
        return 1, ""
    problem = refusal(blocks)
    if problem:
        log.info("vidmem: activation_chunks=auto leaves chunking off: %s", problem)
        return 1, f"auto left chunking off: {problem}"
    from ..memory.plan.candidates import fewest_chunks
    from .planning import plan_options, sampling_model

    try:  # with the run's LoRA tensors, which stream with their blocks
        model = sampling_model(loaded)
        options = plan_options(loaded, PlanOptions(attention=attention, cache_state=cache_state))
        model.check_shape(shape)
        room = device_room_for_plan(budget_bytes)  # the free figure lacks the context the plan counts
        return fewest_chunks(model, shape, strategy, options, room).activation_chunks, ""
    except Exception as error:  # noqa: BLE001 - a failed prediction must not stop the run (as pipelines/room.py)
        log.info("vidmem: activation_chunks=auto has no prediction (%s); chunking stays off", error)
        return 1, f"auto left chunking off: no prediction ({error})"
