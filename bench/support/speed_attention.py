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
