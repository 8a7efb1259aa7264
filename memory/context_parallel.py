"""What diffusers' context parallelism can split, and with which mode: each refusal, stated once.

- A transformer is split only where its class declares a context-parallel plan (`_cp_plan`; Wan
  has one, CogVideoX none): splitting joint text+video attention naively gives wrong frames.
- and only in the pipelines vidmem has run split and can trace per rank (`SPLIT_PIPELINES`, the Wan
  family): diffusers 0.42.1 declares a plan for LTX-2 too, whose ranks crash mid-run in its rotary
  embedding (a 2-way split of its 4 rotary halves), after loading.
- ring needs an attention kernel that returns the log-sum-exp (cuDNN or flash attention on CUDA);
  ulysses runs with any kernel, so CPU ranks (gloo, for testing) run ulysses only.
- ulysses hands each rank an equal share of the attention heads: the heads divide by the degree.
- Both split the video's tokens in equal shares (diffusers' `EquipartitionSharder`): the token
  count divides by the degree; the refusal names nearby sizes, one input changed, that do.
- Activation chunks do not combine with it: a rank's block sees 1/N of the tokens through diffusers'
  hooks, which the chunked forward would bypass. `auto` runs the ranks unchunked; a count is refused.
- Each rank reopens a diffusers folder at its own dtype (`RANK_STORAGE`): the planner plans no other
  storage for it and the runtime refuses a pipeline loaded any other way.

The planner (memory.plan.parallel_checks, on the meta model) and the runtime
(pipelines.parallel.checks, on the loaded pipeline before any rank starts) ask these questions
with their own facts and raise their own error types with these words; the Memory Strategy node
reads `cpu_modes` and `device_refusal`. Each function returns the refusal, or None when the rule holds.
"""

from __future__ import annotations

from collections.abc import Callable

from .strategy import CHUNKS_OFF, ContextParallel, MemoryStrategy

NEARBY = 3  # sizes suggested for each input
RANK_STORAGE = ("context parallelism runs a diffusers folder at its own dtype only, for now: each rank reopens the "
                "folder with its weights in RAM (no weight_dtype, no single files, no memory-mapped disk tier)")

# The pipeline classes whose split vidmem has run (tests/test_parallel_wan.py) and whose rank the
# planner traces (memory.plan.parallel_trace follows Wan's rope, blocks and proj_out).
SPLIT_PIPELINES = ("WanPipeline", "WanImageToVideoPipeline")
TokensAt = Callable[[int, int, int], int]  # (width, height, frames) -> video tokens the blocks see


def plan_refusal(mode: str, pipeline: str, has_plan: bool) -> str | None:
    """`pipeline`: the diffusers pipeline class name; `has_plan`: its denoisers declare a `_cp_plan`."""
    if has_plan and pipeline in SPLIT_PIPELINES:
        return None
    why = ("has no context-parallel plan in diffusers (splitting its joint text+video attention naively gives wrong "
           "frames without any error)" if not has_plan else
           f"is not split by vidmem: only the Wan family ({', '.join(SPLIT_PIPELINES)}) has been run and planned "
           "across ranks (diffusers' plan for it is not checked)")
    return (f"context_parallel={mode}: {pipeline} {why}. Set context_parallel to off; with two or more GPUs listed, "
            "whole components are then placed on different GPUs instead.")


def chunks_refusal(mode: str, strategy: MemoryStrategy) -> str | None:
    if strategy.chunks_auto or strategy.activation_chunks == CHUNKS_OFF:
        return None
    return (f"activation_chunks={strategy.activation_chunks} with context_parallel={mode}: a rank's blocks already "
            "compute only their share of the tokens (diffusers' context-parallel hooks split them), and a chunked "
            "block would bypass those hooks. Set activation_chunks to off (auto runs the ranks unchunked), or "
            "context_parallel to off.")


def cpu_modes() -> tuple[str, ...]:
    """The modes CPU ranks can run (those `device_refusal` lets through on the CPU)."""
    return tuple(m.value for m in (ContextParallel.ULYSSES, ContextParallel.RING) if not device_refusal(m.value, "cpu"))


def device_refusal(mode: str, device_type: str) -> str | None:
    if mode != ContextParallel.RING or device_type == "cuda":
        return None
    return ("context_parallel=ring needs an attention kernel that returns the log-sum-exp (cuDNN or flash attention "
            "on CUDA GPUs); none exists on the CPU. Use context_parallel=ulysses.")


def heads_refusal(mode: str, heads: int, degree: int) -> str | None:
    if mode != ContextParallel.ULYSSES or heads % degree == 0:
        return None
    working = [str(d) for d in range(2, heads + 1) if heads % d == 0 and d <= 16]
    counts = f"{', '.join(working[:-1])} or {working[-1]}" if len(working) > 1 else "".join(working)
    # Said in the inputs users have (gpus, context_parallel), not the API's `degree`; ring runs on CUDA only.
    use = f"use {counts} GPUs (or CPU processes, gpus=cpu:N), or" if working else "use"
    return (f"context_parallel=ulysses with {degree} ranks: this transformer has {heads} attention heads, which "
            f"do not divide between {degree} ranks; {use} on CUDA GPUs context_parallel=ring, which needs no such "
            "division.")


def tokens_refusal(mode: str, degree: int, size: tuple[int, int, int], tokens_at: TokensAt, spatial_step: int,
                   frame_step: int) -> str | None:
    problem = uneven_tokens(size, degree, tokens_at, spatial_step, frame_step)
    return None if problem is None else f"context_parallel={mode}, degree {degree}: {problem}"


def uneven_tokens(size: tuple[int, int, int], degree: int, tokens_at: TokensAt, spatial_step: int,
                  frame_step: int) -> str | None:
    """Why `size` (width, height, frames) cannot be split `degree` ways, naming sizes that can."""
    width, height, frames = size
    tokens = tokens_at(width, height, frames)
    if tokens % degree == 0:
        return None
    nearby = sizes_that_divide(size, degree, tokens_at, spatial_step, frame_step)
    options = "; ".join(f"{name} {', '.join(map(str, values))}" for name, values in nearby.items() if values)
    return (f"{width}x{height}x{frames} makes {tokens} video tokens, which does not divide between "
            f"{degree} ranks (context parallelism splits the tokens evenly). Sizes that work, changing one input: "
            f"{options}.")


def sizes_that_divide(size: tuple[int, int, int], degree: int, tokens_at: TokensAt, spatial_step: int,
                      frame_step: int) -> dict[str, list[int]]:
    """The NEARBY closest widths, heights and frame counts (alternating below and above, the other
    inputs unchanged) whose token count divides by `degree`."""
    width, height, frames = size

    def near(value: int, step: int, low: int, tokens: Callable[[int], int]) -> list[int]:
        found = [v for k in range(1, 64) for v in (value - k * step, value + k * step)
                 if v >= low and tokens(v) % degree == 0]
        return sorted(found[:NEARBY])

    return {
        "width": near(width, spatial_step, spatial_step, lambda w: tokens_at(w, height, frames)),
        "height": near(height, spatial_step, spatial_step, lambda h: tokens_at(width, h, frames)),
        "frames": near(frames, frame_step, 1, lambda f: tokens_at(width, height, f)),
    }
