"""bench/speed.py, attention part (issue 24): every attention kernel this device runs, through
`sample()` under each tier, against eager SDPA (the model's attention as diffusers runs it, nothing
set by vidmem).

Per kernel: `time_ratio` (median wall time over eager SDPA's at the first timed tier; the rounds
interleaved, after an untimed warm-up) and `max_abs_diff` (the largest latent difference from eager
SDPA's at the same tier, over every tier), with both per tier in `by_tier`. A kernel this device,
dtype or installation cannot run is listed as {"skipped": the refusal's reason}; one that is accepted
but fails while sampling as {"failed": the error}. `auto` is listed with the kernel it resolves to.
The `sdpa` row runs the same kernels as the reference with vidmem's setting applied: its time_ratio
is the noise floor of the others'.
"""

from __future__ import annotations

import statistics
import time
from functools import partial
from typing import Callable, Mapping

import torch

from vidmem.memory import MemoryStrategy
from vidmem.pipelines.attention import (AttentionError, AttentionKernel, ResolvedAttention, attention_for_call,
                                        resolve_attention)
from vidmem.pipelines.family import denoisers
from vidmem.pipelines.sample import sample
from vidmem.pipelines.step_cache import StepCache

from .blockswap_cpu import time_interleaved
from .speed_runs import SpeedConfig

EAGER = "eager_sdpa"  # the reference: no kernel set


def attention_rows(loaded_or_builder, config: SpeedConfig, tiers: Mapping[str, MemoryStrategy]) -> dict:
    """{"<kernel>": {"time_ratio", "max_abs_diff", "by_tier", ...} or {"skipped": reason}} for every kernel."""
    loaded = loaded_or_builder() if callable(loaded_or_builder) else loaded_or_builder
    device = torch.device(config.device)
    dtype = loaded.dtype_name  # the compute dtype (the parameters may be stored in another)
    rows, runnable = {}, {}
    for kernel in AttentionKernel:
        try:
            resolved = resolve_attention(kernel, device, dtype)
        except AttentionError as error:
            rows[kernel.value] = {"skipped": str(error)}
            continue
        if kernel is AttentionKernel.AUTO:
            rows[kernel.value] = {"resolves_to": resolved.kernel.value, "why": resolved.why, "fallback": resolved.fallback}
        else:
            runnable[kernel.value] = resolved
    reference = {tier: _latent(loaded, config, strategy, None) for tier, strategy in tiers.items()}
    for name, resolved in runnable.items():
        try:
            rows[name] = _diffs(loaded, config, tiers, resolved, reference)
        except Exception as error:  # a kernel accepted but failing on this model or shape is a result too
            rows[name] = {"failed": f"{type(error).__name__}: {error}"}
    timed = [tier for tier in config.time_tiers if tier in tiers]
    ran = {name: runnable[name] for name in runnable if "failed" not in rows[name]}
    if timed and config.runs:
        _add_times(rows, loaded, config, tiers, timed, ran)
    return rows


def _diffs(loaded, config: SpeedConfig, tiers: Mapping[str, MemoryStrategy], resolved: ResolvedAttention,
           reference: Mapping[str, torch.Tensor]) -> dict:
    by_tier = {}
    for tier, strategy in tiers.items():
        latent = _latent(loaded, config, strategy, resolved)
        by_tier[tier] = {"max_abs_diff": (latent.double() - reference[tier].double()).abs().max().item(),
                         "bitwise_equal": torch.equal(latent, reference[tier])}
    return {"resolved": resolved.as_dict(), "lossy": resolved.lossy,
            "max_abs_diff": max(row["max_abs_diff"] for row in by_tier.values()), "by_tier": by_tier}


def _add_times(rows: dict, loaded, config: SpeedConfig, tiers: Mapping[str, MemoryStrategy], timed: list[str],
               ran: Mapping[str, ResolvedAttention]) -> None:
    """Interleaved rounds of every kernel and the reference under each timed tier."""
    variants: dict[str, Callable[[], torch.Tensor]] = {}
    for tier in timed:
        variants[f"{EAGER}@{tier}"] = partial(_latent, loaded, config, tiers[tier], None)
        for name, resolved in ran.items():
            variants[f"{name}@{tier}"] = partial(_latent, loaded, config, tiers[tier], resolved)
    times = time_interleaved(variants, config.runs)
    for name in ran:
        for tier in timed:
            ratio = statistics.median(times.seconds[f"{name}@{tier}"]) / statistics.median(times.seconds[f"{EAGER}@{tier}"])
            rows[name]["by_tier"][tier].update(time_ratio=ratio, seconds=times.seconds[f"{name}@{tier}"])
        rows[name]["time_ratio"] = rows[name]["by_tier"][timed[0]]["time_ratio"]
    rows[EAGER] = {"seconds_by_tier": {tier: times.seconds[f"{EAGER}@{tier}"] for tier in timed}}


def _latent(loaded, config: SpeedConfig, strategy: MemoryStrategy, resolved: ResolvedAttention | None) -> torch.Tensor:
    """One cold `sample()` call (warm-run copies released, as every speed bench call), under `resolved`."""
    loaded.release_warm()
    request = config.request(StepCache())
    if resolved is None:
        return sample(loaded, strategy, request, device=torch.device(config.device)).latent["samples"]
    modules = denoisers(loaded.pipe, loaded.spec)
    with attention_for_call(modules, resolved):
        return sample(loaded, strategy, request, device=torch.device(config.device)).latent["samples"]


# --- one attention call at the model's real size ----------------------------------------------------------------


def call_rows(config: SpeedConfig, runs: int = 10, compile_flex: bool = True) -> dict:
    """Every kernel on one self-attention call of the transformer at the bench's video size (the 1.3B's 12 heads
    of 128 on CUDA: 32,760 tokens at 832x480x81), through diffusers' dispatcher as Wan's processors call it.

    Per kernel: `ms` (median of `runs` calls timed with CUDA events after two untimed ones; kernels one after
    another, not interleaved), `ratio` to the `sdpa` row, `max_abs_diff` from it, and `extra_bytes` (peak
    allocation above the inputs and one output, which the untimed calls left allocated). Kernels that hold
    the whole score matrix (math, flex uncompiled) are skipped where it would take over a quarter of free memory;
    `flex_compiled` is flex under torch.compile (its one-off compile seconds given), as it runs in compiled blocks.
    This isolates what the sampler rows blur at small sizes: which exact kernel auto should pick at real sizes.
    """
    device = torch.device(config.device)
    heads, head_dim = (config.transformer()[k] for k in ("num_attention_heads", "attention_head_dim"))
    tokens = _tokens(config)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    generator = torch.Generator(device).manual_seed(0)
    q, k, v = (torch.randn(1, tokens, heads, head_dim, device=device, dtype=dtype, generator=generator)
               for _ in range(3))
    score_bytes = heads * tokens * tokens * q.element_size()
    shape = {"tokens": tokens, "heads": heads, "head_dim": head_dim, "dtype": str(dtype).removeprefix("torch."),
             "score_matrix_bytes": score_bytes}
    rows: dict = {}
    for kernel in [*AttentionKernel, *(["flex_compiled"] if compile_flex else [])]:
        name = str(getattr(kernel, "value", kernel))
        rows[name] = _call_row(kernel, q, k, v, score_bytes, runs)
        print(f"  {name}: " + ", ".join(f"{key} {value}" for key, value in rows[name].items()
                                        if key not in ("output", "ms_all")), flush=True)  # kept if the part is cut short
    reference = rows.get("sdpa", {}).get("output")
    for row in rows.values():
        output = row.pop("output", None)
        if output is not None and reference is not None:
            row["max_abs_diff"] = (output.float() - reference.float()).abs().max().item()
    base = rows.get("sdpa", {}).get("ms")
    for row in rows.values():
        if base and "ms" in row:
            row["ratio"] = round(row["ms"] / base, 3)
    return {"shape": shape, "kernels": rows}


def _tokens(config: SpeedConfig) -> int:
    """Wan's patchified sequence: latent frames x (H/16) x (W/16) (VAE 4x8x8, patch 1x2x2)."""
    return ((config.frames - 1) // 4 + 1) * (config.height // 16) * (config.width // 16)


def _call_row(kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, score_bytes: int, runs: int) -> dict:
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    compiled = kernel == "flex_compiled"
    choice = AttentionKernel.FLEX if compiled else kernel
    try:
        resolved = resolve_attention(choice, q.device, q.dtype)
    except AttentionError as error:
        return {"skipped": str(error)}
    if kernel is AttentionKernel.AUTO:
        return {"resolves_to": resolved.kernel.value, "why": resolved.why}
    if resolved.backend == "sage1" or resolved.kernel is AttentionKernel.SAGE:
        return {"skipped": "sage is timed in the sampler rows only"}
    free = torch.cuda.mem_get_info(q.device)[0] if q.device.type == "cuda" else None
    if resolved.materialises_scores and not compiled and free is not None and score_bytes * 4 > free:
        return {"skipped": f"holds the {score_bytes / 2**30:.1f} GiB score matrix (and its softmax): over a quarter "
                           f"of the {free / 2**30:.0f} GiB free"}
    from diffusers.models.attention_dispatch import AttentionBackendName

    backend = AttentionBackendName(resolved.backend)

    def attend(q, k, v):
        return dispatch_attention_fn(q, k, v, backend=backend)

    row: dict = {"backend": resolved.backend}
    try:
        if compiled:
            attend = torch.compile(attend, fullgraph=False, dynamic=False)
            started = time.perf_counter()
            attend(q, k, v)
            _sync(q.device)
            row["compile_seconds"] = round(time.perf_counter() - started, 1)
        row.update(_timed_calls(attend, q, k, v, runs))
    except Exception as error:  # an accepted kernel failing at this shape is a result too
        return {"failed": f"{type(error).__name__}: {str(error)[:300]}"}
    return row


def _timed_calls(attend: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, runs: int) -> dict:
    cuda = q.device.type == "cuda"
    for _ in range(2):
        output = attend(q, k, v)
    _sync(q.device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(q.device)
        before = torch.cuda.memory_allocated(q.device)
    times = []
    for _ in range(runs):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            output = attend(q, k, v)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            started = time.perf_counter()
            output = attend(q, k, v)
            times.append((time.perf_counter() - started) * 1000)
    row = {"ms": round(statistics.median(times), 3), "ms_all": [round(t, 3) for t in times], "output": output}
    if cuda:
        row["extra_bytes"] = torch.cuda.max_memory_allocated(q.device) - before
    return row


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
