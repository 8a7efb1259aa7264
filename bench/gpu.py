"""GPU bench: vidmem's tiers beside resident and diffusers' group offloading, in one process.

One random-weight transformer at its real dimensions (Wan 2.1 14B by default: 40 blocks, built on
the GPU in bf16 with the class's own initialisation; no files, no hub), one denoise step as the
pipeline runs it (`pipelines.configs.workloads.denoise_step`, the very call the planner traces), at
the latent of 832x480x81 with guidance 1 (one transformer forward per step; with guidance both
branches run the same forward twice, so the ratios hold). Every row, in the same process:

- `resident`: the whole transformer on the GPU (vidmem tier none: no hooks at all);
- `block_swap_<N>` at several counts (prefetch 1), all blocks with prefetch 0 and 2, and `sequential`;
- `block_swap_<N>_unpinned`: all blocks at a pinned ceiling of 0 (`max_pinned_ram_gb=0`: no pinned
  homes, every streamed block staged chunk by chunk through the streamed ring), beside `block_swap_<N>`;
- `group_offload_block` / `group_offload_leaf`: diffusers' own `enable_group_offload`, block level
  with one block per group and leaf level, both with `use_stream=True`;
- `fp8_*`: the same tiers with the linear weights stored as fp8 (e4m3fn, upcast per layer);
- `disk_fp8_block_swap_<N>`: the fp8 weights memory-mapped from a safetensors file (the disk tier;
  the file was just written, so it reads from the page cache: the staging ring's cost, not a disk's);
- `cold_disk_fp8_block_swap_<N>` and `..._no_read_ahead`: the same with the file's pages dropped from the
  page cache before every step (a first run, or a model larger than RAM: every step reads the disk), with
  the schedule's read-ahead advice and without it (`memory.blockswap.READ_AHEAD_GROUPS` 0);
- `cap8_block_swap_<N>`: "a user's card, simulated": the caching allocator capped at 8 GiB by a
  per-process memory fraction, the whole transformer streamed;
- `warm_none`, `warm_model`, `warm_block_swap_<N/2>` and `warm_block_swap_<N/2>_keep` (warm runs,
  issue 22): the tier applied twice on one `WarmStore`, backend and pinned pool, cold then warm, as a
  loaded pipeline's Sampler is called again (bench/support/gpu_warm.py). Per call: resident bytes
  uploaded, bytes streamed and reused, seconds from applying the strategy to the transformer being on
  the device for its first step, the first step and the steps after it; `_keep` lets streamed blocks
  stay on the device while free memory allows (`keep_bytes`). The goal's verdict (`goal`): the warm
  call of Wan 2.1 1.3B at 832x480 uploads no resident byte and is ready in under 0.1 s.

Each row: median step seconds over `--steps` after `--warmup` steps, its ratio to resident, peak
allocated and reserved VRAM and allocator retries (`torch.cuda.memory_stats`), pinned host bytes,
the copy/compute overlap of one profiled step (share of host-to-device copy time that ran while a
kernel ran; pageable copies and host synchronisations counted), and the planner's predicted peak
and step time for the same call. A warm row's `step_seconds` is its warm call's (no profiled step);
`calls` holds both calls' figures.

    python bench/gpu.py --json bench/results/gpu-h100-2026-11-26.json
    python bench/gpu.py --device cpu        # the same rows on tiny dimensions: checks the bench end to end
    python bench/gpu.py --model wan2.1-t2v-1.3b --rows warm_none,warm_model,warm_block_swap_15,warm_block_swap_15_keep
    python bench/gpu.py --replan bench/results/gpu-h200-2026-11-26.json  # the planner's figures again, on any machine

On the CPU (`--device cpu`) the warm rows' backend copies every onload (a stand-in device), so their
byte counts are real; their seconds, like every CPU figure here, mean nothing.

`bench/gpu_check.sh` runs this and `tests/gpu` on a GPU machine within one short lease.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench.support
from bench.support.checkout import use_this_checkout  # noqa: E402

use_this_checkout()  # `import vidmem` is this clone, installed or not

import torch  # noqa: E402

from vidmem.memory import MemoryStrategy  # noqa: E402
from vidmem.memory.device import backend_for, resolve_compute_device  # noqa: E402
from vidmem.memory.hostpool import HostPool  # noqa: E402
from vidmem.memory.offload import StageComponents, apply_strategy  # noqa: E402
from vidmem.memory.plan.planner import Allocator, PlanOptions, VideoShape, plan_run  # noqa: E402
from vidmem.memory.units import GiB  # noqa: E402
from vidmem.memory.warm import WarmStore  # noqa: E402

from bench.support.gpu_warm import (  # noqa: E402
    goal_verdict, keep_budget, measure_call, pinned_weight_bytes, warm_backend, warm_lines)

DEFAULT_MODEL = "wan2.1-t2v-14b"
DEFAULT_SHAPE = VideoShape(832, 480, 81, cfg=False)
# The CPU dry run: the same classes and rows at negligible width (4 blocks, 2 heads of 16).
TINY_CHANGES = dict(num_layers=6, num_attention_heads=2, attention_head_dim=16, ffn_dim=64)
TINY_SHAPE = VideoShape(64, 64, 5, cfg=False)
FP8 = "fp8_e4m3fn"
USER_CARD_GIB = 8.0
PLANNED_STEPS = 1000


# --- what runs ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One way of placing the transformer for the same denoise step."""

    name: str
    strategy: MemoryStrategy | None = None  # vidmem's tier; None for diffusers' group offloading
    group_offload: str | None = None  # diffusers offload_type: "block_level" | "leaf_level"
    weights: str = "bf16"  # "bf16", or FP8 (linear weights stored as fp8, upcast per layer)
    disk: bool = False  # weights memory-mapped from a safetensors file
    vram_cap_gib: float | None = None  # per-process memory fraction, as on a smaller card
    cold: bool = False  # with disk: the file's pages dropped from the page cache before every step
    read_ahead: bool = True  # with disk: the schedule's read-ahead advice (False: READ_AHEAD_GROUPS 0)
    warm: bool = False  # two calls on one WarmStore, cold then warm (bench/support/gpu_warm.py)
    keep: bool = False  # with warm: streamed blocks kept on the device while free memory allows

    def __post_init__(self) -> None:
        if self.keep and not self.warm:
            raise ValueError(f"row {self.name}: keep=True measures the keep budget across warm calls; set warm=True too")
        if (self.cold or not self.read_ahead) and not self.disk:
            raise ValueError(f"row {self.name}: cold and read_ahead are about a memory-mapped file; set disk=True too")


def default_rows(blocks: int, pinned_gib: float | None) -> list[Row]:
    """The rows the issue asks for, in the order they run (models built once, freed when done)."""
    pin = dict(max_pinned_ram_gb=pinned_gib)
    swap = lambda n, **kw: MemoryStrategy(offload="block_swap", blocks_to_swap=n, **pin, **kw)  # noqa: E731
    counts = sorted({max(1, blocks // 4), blocks // 2, blocks})
    rows = [Row("resident", MemoryStrategy(offload="none", **pin))]
    rows += [Row(f"block_swap_{n}", swap(n)) for n in counts]
    rows += [Row(f"block_swap_{blocks}_prefetch_{k}", swap(blocks, prefetch_blocks=k)) for k in (0, 2)]
    # a pinned ceiling of 0: every streamed block staged chunk by chunk through the streamed ring (docs/warm-runs.md)
    rows += [Row(f"block_swap_{blocks}_unpinned", MemoryStrategy(offload="block_swap", blocks_to_swap=blocks,
                                                                 max_pinned_ram_gb=0))]
    rows += [Row("sequential", MemoryStrategy(offload="sequential", **pin))]
    rows += [Row(f"cap8_block_swap_{blocks}", swap(blocks), vram_cap_gib=USER_CARD_GIB)]
    rows += [Row("fp8_resident", MemoryStrategy(offload="none", **pin), weights=FP8),
             Row(f"fp8_block_swap_{blocks}", swap(blocks), weights=FP8),
             Row("fp8_sequential", MemoryStrategy(offload="sequential", **pin), weights=FP8),
             Row(f"disk_fp8_block_swap_{blocks}", swap(blocks), weights=FP8, disk=True),
             Row(f"cold_disk_fp8_block_swap_{blocks}", swap(blocks), weights=FP8, disk=True, cold=True),
             Row(f"cold_disk_fp8_block_swap_{blocks}_no_read_ahead", swap(blocks), weights=FP8, disk=True, cold=True,
                 read_ahead=False)]
    rows += [Row("group_offload_block", group_offload="block_level"), Row("group_offload_leaf", group_offload="leaf_level")]
    half = max(1, blocks // 2)  # half the blocks resident: the warm call reuses them, streams the rest
    rows += [Row("warm_none", MemoryStrategy(offload="none", **pin), warm=True),
             Row("warm_model", MemoryStrategy(offload="model", **pin), warm=True),
             Row(f"warm_block_swap_{half}", swap(half), warm=True),
             Row(f"warm_block_swap_{half}_keep", swap(half), warm=True, keep=True)]
    return rows


@dataclass(frozen=True)
class BenchConfig:
    model: str = DEFAULT_MODEL
    shape: VideoShape = DEFAULT_SHAPE
    changes: tuple[tuple[str, object], ...] = ()  # transformer config overrides (the CPU dry run's tiny widths)
    warmup: int = 1
    steps: int = 2
    device: str = "cuda"
    pinned_gib: float | None = 64.0  # an explicit ceiling: the automatic one follows free RAM, which varies
    seed: int = 0


# --- models -----------------------------------------------------------------------------------


def meta_model(name: str, changes: dict):
    """The shipped model's planner description, its transformer config changed by `changes`."""
    from vidmem.pipelines.configs import load_model
    from vidmem.pipelines.configs.meta import MetaModel

    model = load_model(name)
    if not changes:
        return model
    component = model.components["transformer"]
    changed = dataclasses.replace(component, config={**component.config, **changes})
    fields = {f.name: getattr(model, f.name) for f in dataclasses.fields(MetaModel) if not f.name.startswith("_")}
    return MetaModel(**{**fields, "components": {**model.components, "transformer": changed}})


def build_transformer(model, device: torch.device, seed: int) -> torch.nn.Module:
    """The model's transformer with random weights, built on `device` at the dtypes a load gives."""
    from vidmem.pipelines.configs.meta import build_meta

    torch.manual_seed(seed)
    module = build_meta(model.components["transformer"], model.dtype, device=device)
    return module.requires_grad_(False)


def stored_fp8(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`module`'s state as a plain fp8 file holds it (Comfy-Org's `*_fp8_e4m3fn` layout): every
    weight the format lowers (`StorageFormat.lowers`) quantized on the module's device, each tensor
    then on the CPU."""
    from vidmem.memory.storage import quantize, storage_format

    fmt, lowered = storage_format(FP8), {}
    for layer_name, layer in module.named_modules():
        if fmt.lowers(layer):
            lowered[f"{layer_name}.weight"] = layer
    state = {}
    for name, tensor in module.state_dict().items():
        state[name] = (quantize(tensor, fmt).data if name in lowered else tensor).to("cpu", copy=True).contiguous()
    return state


def held_transformer(model, tensors, source: str) -> torch.nn.Module:
    """A transformer filled from `tensors` as the loaders fill one (stored fp8 stays fp8)."""
    from vidmem.pipelines.comfy_files.build import build_empty
    from vidmem.pipelines.weight_storage import DEFAULT_WEIGHTS, hold

    module = build_empty(model.components["transformer"])
    hold(module, tensors, model.dtype, DEFAULT_WEIGHTS, copy_to_ram=False, source=source)
    return module


def write_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path))


# --- placing a transformer --------------------------------------------------------------------


@contextlib.contextmanager
def placed(row: Row, module: torch.nn.Module, device: torch.device, pool: HostPool, backend=None) -> Iterator[object]:
    """`module` placed as `row` says for the duration; restored (hooks off, weights home) after."""
    if row.group_offload:
        with group_offloaded(module, device, row.group_offload):
            yield None
        return
    stage = StageComponents({"transformer": module}, {"transformer": module.blocks})
    with apply_strategy(stage, row.strategy, backend or backend_for(device), host_pool=pool) as handle:
        yield handle


@contextlib.contextmanager
def group_offloaded(module: torch.nn.Module, device: torch.device, offload_type: str) -> Iterator[None]:
    """diffusers' `enable_group_offload` as its docs recommend for speed (streams; one block per
    group at block level); removed after, the weights back on the CPU."""
    from diffusers.hooks import HookRegistry
    from diffusers.hooks.group_offloading import _GROUP_OFFLOADING, _LAYER_EXECUTION_TRACKER, _LAZY_PREFETCH_GROUP_OFFLOADING

    streams = device.type == "cuda"  # use_stream needs an accelerator
    extra = dict(num_blocks_per_group=1) if offload_type == "block_level" else {}
    module.enable_group_offload(onload_device=device, offload_device=torch.device("cpu"), offload_type=offload_type,
                                use_stream=streams, non_blocking=streams, **extra)
    try:
        yield
    finally:
        registry = HookRegistry.check_if_exists_or_initialize(module)
        for name in (_GROUP_OFFLOADING, _LAYER_EXECUTION_TRACKER, _LAZY_PREFETCH_GROUP_OFFLOADING):
            registry.remove_hook(name, recurse=True)
        module.to("cpu")


# --- measuring ----------------------------------------------------------------------------------


def seeded_step(model, module: torch.nn.Module, shape: VideoShape, device: torch.device, seed: int = 0) -> torch.Tensor:
    """One denoise step on inputs drawn from `seed` (the same inputs whatever the placement)."""
    from vidmem.pipelines.configs.workloads import denoise_step

    torch.manual_seed(seed)
    with torch.no_grad():
        return denoise_step(model, "transformer", shape, module, device)()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_steps(step: Callable[[], object], count: int, device: torch.device,
                before_each: Callable[[], None] = lambda: None) -> list[float]:
    """Wall seconds of each of `count` steps, the device drained before and after each (and
    `before_each` run, untimed, before each)."""
    seconds = []
    for _ in range(count):
        before_each()
        synchronize(device)
        start = time.perf_counter()
        step()
        synchronize(device)
        seconds.append(time.perf_counter() - start)
    return seconds


def _intervals_union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _covered(start: float, end: float, union: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in union if b > start and a < end)


SYNC_CALLS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize")


def trace_overlap(events: list[dict]) -> dict:
    """Copy/compute overlap from a chrome trace's events (torch.profiler's export format).

    `overlap`: the share of host-to-device copy time during which some kernel was running (any
    stream): 1.0 means every copy hid behind compute. `gpu_busy`: the share of the step's GPU
    span in which a kernel ran. Pageable copies (a `non_blocking` copy from pageable memory is
    synchronous) and host synchronisation calls are counted.
    """
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    kernels = [(e["ts"], e["ts"] + e["dur"]) for e in complete if e.get("cat") == "kernel"]
    copies = [e for e in complete if e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", "")]
    device_side = kernels + [(e["ts"], e["ts"] + e["dur"]) for e in copies]
    union = _intervals_union(kernels)
    copy_us = sum(e["dur"] for e in copies)
    hidden_us = sum(_covered(e["ts"], e["ts"] + e["dur"], union) for e in copies)
    span = (max(b for _, b in device_side) - min(a for a, _ in device_side)) if device_side else 0.0
    syncs = {name: sum(1 for e in complete if e.get("name") == name) for name in SYNC_CALLS}
    return {
        "copies": len(copies),
        "copy_seconds": copy_us / 1e6,
        "hidden_copy_seconds": hidden_us / 1e6,
        "overlap": hidden_us / copy_us if copy_us else None,
        "pageable_copies": sum(1 for e in copies if "Pageable" in e.get("name", "")),
        "gpu_busy": sum(b - a for a, b in union) / span if span else None,
        "host_syncs": syncs,
    }


def profiled_step(step: Callable[[], object], device: torch.device) -> dict | None:
    """One step under torch.profiler, summarised by `trace_overlap` (None on a CPU run)."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        synchronize(device)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    return trace_overlap(events)


def drop_cached_pages(module: torch.nn.Module) -> int:
    """Drop the page-cache pages of every file `module`'s weights are mapped from, so the next step reads
    them from the disk (a first run, or a model larger than RAM): each mapping's pages are unmapped from
    this process (madvise DONTNEED: clean pages, never written) and its file's pages dropped
    (posix_fadvise DONTNEED). Returns the files' bytes. Linux only; elsewhere it drops nothing."""
    import mmap

    from vidmem.memory.storage import mapping

    if not (hasattr(os, "posix_fadvise") and hasattr(mmap, "MADV_DONTNEED")):
        return 0
    seen: dict[int, object] = {}
    for tensor in (*module.parameters(), *module.buffers()):
        found = mapping.mapping_of(tensor)
        if found is not None:
            seen.setdefault(id(found[0]), found[0])
    dropped = 0
    for mapped in seen.values():
        mapped.madvise(mmap.MADV_DONTNEED)
        path = getattr(module, "bench_file", None)
        if path is not None:
            with open(path, "rb") as handle:
                os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            dropped += len(mapped)
    return dropped


@contextlib.contextmanager
def read_ahead_groups(count: int | None) -> Iterator[None]:
    """The streaming schedule's read-ahead for the duration (None: as shipped)."""
    from vidmem.memory import blockswap

    shipped = blockswap.READ_AHEAD_GROUPS
    if count is not None:
        blockswap.READ_AHEAD_GROUPS = count
    try:
        yield
    finally:
        blockswap.READ_AHEAD_GROUPS = shipped


def memory_figures(device: torch.device) -> dict:
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {"peak_allocated_bytes": stats.get("allocated_bytes.all.peak", 0),
            "peak_reserved_bytes": stats.get("reserved_bytes.all.peak", 0),
            "alloc_retries": stats.get("num_alloc_retries", 0), "ooms": stats.get("num_ooms", 0)}


def host_pinned(device: torch.device) -> dict | None:
    """torch's pinned host allocator (vidmem's arenas and diffusers' pinned copies both come from it)."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if device.type != "cuda" or stats is None:
        return None
    return {k: v for k, v in stats().items() if "bytes" in k and (k.endswith(".current") or k.endswith(".peak"))}


@contextlib.contextmanager
def vram_cap(device: torch.device, cap_gib: float | None) -> Iterator[None]:
    if cap_gib is None or device.type != "cuda":
        yield
        return
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * GiB / total), device)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)


def predicted(model, shape: VideoShape, row: Row) -> dict | None:
    """The planner's figures for the same denoise step under the row's tier (None for diffusers'
    group offloading, which it does not model): peak allocated and reserved bytes of the
    transformer's phase (no CUDA context: torch's counters do not see it), and seconds per step
    with the ratio to the same step resident (the copy model's promise)."""
    if row.strategy is None:
        return None
    storage = {"transformer": row.weights} if row.weights != "bf16" else {}
    # Many steps, so the stage's one-time onload (which the bench's timed steps exclude) is spread thin.
    options = PlanOptions(allocator=Allocator.NATIVE, steps=PLANNED_STEPS, storage=storage, on_disk=row.disk)
    denoise = plan_run(model, shape, row.strategy, options).stage("denoise")
    resident = plan_run(model, shape, MemoryStrategy(offload="none"), options).stage("denoise")
    phase, work = denoise.peak_phase, denoise.work[-1]  # the transformer's: the denoiser is the last work item
    return {"peak_allocated_bytes": phase.peak.allocated, "peak_reserved_bytes": phase.peak.reserved,
            "step_seconds": denoise.seconds() / PLANNED_STEPS, "ratio_vs_resident": denoise.seconds() / resident.seconds(),
            "rates": "the planner's default GPU rates (memory.plan.costs.GPU_RATES), not this GPU's",
            "per_step": {"flops": work.flops / work.passes, "copy_bytes": work.traffic.per_pass_bytes,
                         "groups": work.traffic.per_pass_groups, "exposed_share": work.traffic.exposed_share,
                         "dequant_weights": work.upcast_weights}}


def ratio_at_measured_rates(row: dict, resident: dict, copy_bytes_per_s: float) -> float | None:
    """The planner's time model for `row` with this GPU's rates: compute at the resident row's
    measured FLOP rate, copies at the measured host-to-device rate (so the model's structure is
    what is compared, not the default rates of a consumer card)."""
    from vidmem.memory.plan.costs import DeviceRates, Traffic, stage_seconds

    mine, base = (row.get("predicted") or {}).get("per_step"), (resident.get("predicted") or {}).get("per_step")
    if not mine or not base or not resident.get("step_seconds"):
        return None
    rates = DeviceRates(base["flops"] / resident["step_seconds"], copy_bytes_per_s)
    def seconds(step: dict, traffic: Traffic) -> float:
        return stage_seconds(step["flops"], 1, traffic, rates=rates, dequant_weights=step["dequant_weights"])

    return seconds(mine, Traffic(mine["copy_bytes"], mine["groups"], exposed_share=mine["exposed_share"])) / seconds(base, Traffic())


def free_cached(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def reset_counters(device: torch.device) -> None:
    """Cached device memory freed and torch's peak and retry counters zeroed: a row starts clean."""
    free_cached(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        torch.cuda.reset_accumulated_memory_stats(device)


def measure_row(row: Row, module: torch.nn.Module, model, config: BenchConfig, pool: HostPool) -> dict:
    if row.warm:
        return measure_warm_row(row, module, model, config, pool)
    from vidmem.pipelines.configs.workloads import denoise_step

    device = resolve_compute_device(config.device)
    reset_counters(device)
    step = denoise_step(model, "transformer", config.shape, module, device)
    cold = (lambda: drop_cached_pages(module)) if row.cold else (lambda: None)
    started = time.perf_counter()
    # no_grad, as diffusers' pipelines run (placing weights under inference mode would make
    # inference tensors of the host copies)
    with torch.no_grad(), vram_cap(device, row.vram_cap_gib), placed(row, module, device, pool), \
            read_ahead_groups(None if row.read_ahead else 0):
        timed_steps(step, config.warmup, device, cold)
        seconds = timed_steps(step, config.steps, device, cold)
        memory = memory_figures(device)  # before the profiled step: the profiler allocates too
        cold()
        profile = profiled_step(step, device)
    result = {"step_seconds": statistics.median(seconds), "steps_seconds": seconds,
              "row_seconds": time.perf_counter() - started, **memory,
              "pinned_host_bytes": pool.pinned_bytes if row.strategy else None, "host_allocator": host_pinned(device),
              "pool": pool.stats() if row.strategy else None, "profile": profile, "weights": row.weights, "disk": row.disk,
              "vram_cap_gib": row.vram_cap_gib,
              "strategy": row.strategy.describe() if row.strategy else f"diffusers group offload {row.group_offload}"}
    result["predicted"] = predicted(model, config.shape, row)
    return result


def measure_warm_row(row: Row, module: torch.nn.Module, model, config: BenchConfig, pool: HostPool) -> dict:
    """The row's tier called twice on one WarmStore, backend and pool, cold then warm
    (bench/support/gpu_warm.py), after `--warmup` steps placed without a store. Its `step_seconds`
    is the warm call's; `calls` holds both calls' bytes and seconds, `goal` issue 22's verdict."""
    from vidmem.pipelines.configs.workloads import denoise_step

    device = resolve_compute_device(config.device)
    reset_counters(device)
    backend = warm_backend(device)  # one for the row, as a loaded pipeline keeps one per device
    stage = StageComponents({"transformer": module}, {"transformer": module.blocks})
    step = denoise_step(model, "transformer", config.shape, module, device)
    run_steps = lambda count: timed_steps(step, count, device)  # noqa: E731
    store, calls = WarmStore(f"the bench's {row.name}"), {}
    started = time.perf_counter()
    try:
        with torch.no_grad():
            if config.warmup:  # kernels chosen, streamed blocks pinned: the cold call times the upload alone
                with placed(row, module, device, pool, backend):
                    run_steps(config.warmup)
            pinned = pinned_weight_bytes(module, device)
            for label in ("cold", "warm"):
                free_cached(device)  # the store's copies stay; the cold call allocates as a first call does
                keep = keep_budget(model, config.shape, row.strategy, stage, device, store.held_bytes) if row.keep else 0
                calls[label] = measure_call(stage, row.strategy, backend, store, pool, keep, run_steps, config.steps,
                                            lambda: synchronize(device))
            memory = memory_figures(device)
    finally:
        store.release_all()  # the next row starts with none of this row's copies on the device
    return {"step_seconds": calls["warm"]["step_seconds"], "calls": calls,
            "goal": goal_verdict(config.model, config.shape, device, calls["warm"]),
            "row_seconds": time.perf_counter() - started, **memory, "host_pinned_weight_bytes": pinned,
            "pinned_host_bytes": pool.pinned_bytes, "host_allocator": host_pinned(device), "pool": pool.stats(),
            "weights": row.weights, "disk": row.disk, "vram_cap_gib": row.vram_cap_gib,
            "strategy": row.strategy.describe() + (", streamed blocks kept while free memory allows" if row.keep else ""),
            "predicted": predicted(model, config.shape, row)}


# --- the run ----------------------------------------------------------------------------------


def gpu_info(device: torch.device) -> dict:
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(name=props.name, total_memory_bytes=props.total_memory, multiprocessors=props.multi_processor_count)
    else:
        info.update(name="cpu (dry run)")
    return info


def run(config: BenchConfig, rows: list[Row], log: Callable[[str], None] = print,
        save: Callable[[dict], None] = lambda result: None, deadline: float | None = None) -> dict:
    """Every row on one transformer (and its fp8 and on-disk twins), in order; returns the JSON.

    `save` gets the JSON so far after every row (a lease that ends mid-run keeps what ran); rows
    that would start after `deadline` (time.time()) are listed as skipped instead."""
    device = resolve_compute_device(config.device)
    model = meta_model(config.model, dict(config.changes))
    blocks = model.components["transformer"].config["num_layers"]
    pools: dict[tuple[str, bool], HostPool] = {}  # one per twin, as each loaded pipeline has its own
    results: dict[str, dict] = {}
    build_start = time.perf_counter()
    bf16 = build_transformer(model, device, config.seed)
    fp8_state = stored_fp8(bf16) if any(r.weights == FP8 for r in rows) else None
    bf16.to("cpu")
    synchronize(device)
    log(f"built {config.model} ({blocks} blocks) in {time.perf_counter() - build_start:.1f} s")
    twins: dict[tuple[str, bool], torch.nn.Module] = {("bf16", False): bf16}
    with tempfile.TemporaryDirectory(dir=os.environ.get("VIDMEM_BENCH_TMP")) as folder:
        for row in rows:
            if deadline is not None and time.time() > deadline:
                results[row.name] = {"skipped": "the lease's time budget ran out before this row"}
                continue
            key = (row.weights, row.disk)
            if key not in twins:
                twins[key] = twin(model, fp8_state, row.disk, Path(folder), log)
                if row.disk:
                    fp8_state = None  # the file holds it now
            try:
                results[row.name] = measure_row(row, twins[key], model, config, pools.setdefault(key, HostPool()))
            except torch.OutOfMemoryError as error:  # a finding, not the end of the bench
                results[row.name] = {"error": f"out of memory: {str(error).splitlines()[0]}"}
            log(summary_line(row.name, results[row.name], results.get("resident")))
            save(document(config, device, results))
            if row.group_offload is None and not any(r.weights == row.weights and r.disk == row.disk
                                                     for r in rows[rows.index(row) + 1:]):
                twins.pop(key, None)  # the last row on this twin: free its host memory and pinned pool
                pools.pop(key, None)
                gc.collect()
    return document(config, device, results)


def document(config: BenchConfig, device: torch.device, results: dict) -> dict:
    add_ratios(results)
    return {"gpu": gpu_info(device), "model": config.model, "shape": dataclasses.asdict(config.shape),
            "transformer_changes": dict(config.changes), "warmup_steps": config.warmup, "timed_steps": config.steps,
            "step": "one denoise step as WanPipeline runs it at guidance 1 (one transformer forward), "
                    "random inputs, inference mode",
            "rows": results}


def twin(model, fp8_state: dict, disk: bool, folder: Path, log: Callable[[str], None]) -> torch.nn.Module:
    """The fp8 transformer, in RAM or memory-mapped from a file written now."""
    from vidmem.memory.storage import open_safetensors

    start = time.perf_counter()
    if not disk:
        module = held_transformer(model, fp8_state, "the bench's fp8 weights")
    else:
        path = folder / "transformer_fp8_e4m3fn.safetensors"
        write_safetensors(fp8_state, path)
        module = held_transformer(model, open_safetensors(path).tensors, str(path))
        module.bench_file = path  # for the cold rows (drop_cached_pages)
    log(f"fp8 transformer {'mapped from a file' if disk else 'in RAM'} in {time.perf_counter() - start:.1f} s")
    return module


def add_ratios(results: dict) -> None:
    resident = results.get("resident", {}).get("step_seconds")
    copy_rate = measured_copy_rate(results)
    for row in results.values():
        if resident and row.get("step_seconds"):
            row["ratio_vs_resident"] = row["step_seconds"] / resident
            if copy_rate:
                row["model_ratio_at_measured_rates"] = ratio_at_measured_rates(row, results["resident"], copy_rate)
        guess = row.get("predicted") or {}
        if guess.get("peak_reserved_bytes") and row.get("peak_reserved_bytes"):
            row["predicted_reserved_over_measured"] = guess["peak_reserved_bytes"] / row["peak_reserved_bytes"]
            row["predicted_allocated_over_measured"] = guess["peak_allocated_bytes"] / row["peak_allocated_bytes"]


def measured_copy_rate(results: dict) -> float | None:
    """Host-to-device bytes per second of vidmem's streamed copies (median over the rows that streamed)."""
    rates = [row["predicted"]["per_step"]["copy_bytes"] / row["profile"]["copy_seconds"] for row in results.values()
             if (row.get("profile") or {}).get("copy_seconds") and (row.get("predicted") or {}).get("per_step", {}).get("copy_bytes")]
    return statistics.median(rates) if rates else None


def summary_line(name: str, row: dict, resident: dict | None) -> str:
    if "error" in row or "skipped" in row:
        return f"{name:32s} {row.get('error') or row['skipped']}"
    if "calls" in row:
        return warm_lines(name, row)
    ratio = row["step_seconds"] / resident["step_seconds"] if resident and "step_seconds" in resident else 1.0
    gib = lambda key: f"{row[key] / GiB:6.2f}" if key in row else "     -"  # noqa: E731
    profile = row.get("profile") or {}
    overlap = profile.get("overlap")
    planned = (row.get("predicted") or {}).get("peak_reserved_bytes")
    pinned = row.get("pinned_host_bytes")
    return (f"{name:32s} {row['step_seconds']:8.3f} s  x{ratio:5.3f}  alloc {gib('peak_allocated_bytes')}  "
            f"reserved {gib('peak_reserved_bytes')}  planned {planned / GiB if planned else float('nan'):6.2f}  "
            f"overlap {overlap if overlap is not None else float('nan'):5.3f}  "
            f"pinned {pinned / GiB if pinned is not None else float('nan'):5.1f} GiB")


def sanitize_step(device: torch.device) -> None:
    """One block_swap step with prefetch 2 on a tiny Wan, for compute-sanitizer (memcheck,
    racecheck): kernels run a hundredfold slower under it, so the model is kept small."""
    model = meta_model(DEFAULT_MODEL, TINY_CHANGES)
    module = build_transformer(model, device, seed=0).to("cpu")
    strategy = MemoryStrategy(offload="block_swap", blocks_to_swap=TINY_CHANGES["num_layers"], prefetch_blocks=2)
    for _ in range(2):  # the second step runs with the prefetch order known
        with placed(Row("sanitize", strategy), module, device, HostPool()):
            out = seeded_step(model, module, TINY_SHAPE, device)
    synchronize(device)
    print(f"sanitize step done: output {tuple(out.shape)}, finite {bool(torch.isfinite(out).all())}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (the bench) or cpu (a dry run on tiny widths)")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--size", default=None, help="WxHxF (default 832x480x81 on a GPU, 64x64x5 on the CPU)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rows", default="", help="comma-separated row names (default: every row)")
    parser.add_argument("--pinned-gib", type=float, default=64.0)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--budget-seconds", type=float, default=None,
                        help="start no row after this many seconds (the JSON lists the rest as skipped)")
    parser.add_argument("--decode", action="store_true", help="the VAE decode rows instead (bench/support/gpu_decode.py; "
                        "--steps is its timed rounds)")
    parser.add_argument("--sanitize-step", action="store_true", help="one tiny block_swap step (for compute-sanitizer)")
    parser.add_argument("--replan", type=Path, metavar="JSON",
                        help="recompute the planner's figures in a results file with this checkout (no GPU needed)")
    args = parser.parse_args()
    if args.steps < 1 or args.warmup < 0:
        parser.error(f"--steps={args.steps} must be 1 or more and --warmup={args.warmup} 0 or more")
    if args.sanitize_step:
        return sanitize_step(torch.device(args.device))
    if args.replan:
        write_json(args.replan, replan(json.loads(args.replan.read_text())))
        print(f"rewrote the planner's figures in {args.replan}")
        return None
    cpu = args.device == "cpu"
    shape = TINY_SHAPE if cpu else DEFAULT_SHAPE
    if args.size:
        parts = args.size.lower().split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            parser.error(f"--size={args.size!r} must be WIDTHxHEIGHTxFRAMES, e.g. 832x480x81")
        shape = VideoShape(*(int(p) for p in parts), cfg=False)
    if args.decode:
        return decode_bench(args, shape if args.size or not cpu else VideoShape(128, 96, 9, cfg=False))
    config = BenchConfig(args.model, shape, tuple(TINY_CHANGES.items()) if cpu else (), args.warmup, args.steps,
                         args.device, args.pinned_gib)
    blocks = meta_model(config.model, dict(config.changes)).components["transformer"].config["num_layers"]
    rows = default_rows(blocks, args.pinned_gib)
    if args.rows:
        wanted = set(args.rows.split(","))
        unknown = wanted - {r.name for r in rows}
        if unknown:
            parser.error(f"--rows names no row {', '.join(sorted(unknown))}; this model's rows: {', '.join(r.name for r in rows)}")
        rows = [r for r in rows if r.name in wanted]
    print(f"{config.model} at {shape.width}x{shape.height}x{shape.frames} on {gpu_info(torch.device(args.device))['name']}: "
          f"{len(rows)} rows, {config.warmup} warm-up + {config.steps} timed steps each", flush=True)
    save = (lambda result: write_json(args.json, result)) if args.json else (lambda result: None)
    deadline = time.time() + args.budget_seconds if args.budget_seconds else None
    save(run(config, rows, lambda line: print(line, flush=True), save, deadline))
    if args.json:
        print(f"wrote {args.json}")


def decode_bench(args: argparse.Namespace, shape: VideoShape) -> None:
    """`--decode`: the model's VAE decoding the clip tiled, host copies overlapped or not (bench/support/gpu_decode.py)."""
    from bench.support.gpu_decode import decode_rows

    device = torch.device(args.device)
    deadline = time.time() + args.budget_seconds if args.budget_seconds is not None else None
    result = {"bench": "gpu_decode", "model": args.model, "shape": dataclasses.asdict(shape), "gpu": gpu_info(device),
              "torch": torch.__version__, **decode_rows(meta_model(args.model, {}), shape, device, args.steps, deadline)}
    print(json.dumps(result, indent=1))
    if args.json:
        write_json(args.json, result)
        print(f"wrote {args.json}")


def replan(result: dict) -> dict:
    """`result` (this bench's JSON, or a file gathering several runs under `runs` with the same rows
    flat under `rows`) with every row's `predicted` figures and ratios computed again by this
    checkout's planner, as the bench computes them after each row; measured figures stay as they are."""
    shape = VideoShape(**result["shape"])
    runs = result["runs"].values() if "runs" in result else [result]
    for run_ in runs:
        model = meta_model(run_["model"], result.get("transformer_changes", {}))
        known = {row.name: row for row in default_rows(model.components["transformer"].config["num_layers"], None)}
        for name, row in run_["rows"].items():
            if "predicted" in row and name in known:
                row["predicted"] = predicted(model, shape, known[name])
        add_ratios(run_["rows"])
        if "runs" in result:
            run_["copy_bytes_per_s"] = measured_copy_rate(run_["rows"])
            result["rows"].update({f"{run_['model']}/{name}@{run_['run']}": row for name, row in run_["rows"].items()
                                   if f"{run_['model']}/{name}@{run_['run']}" in result["rows"]})
    return result


def write_json(path: Path, result: dict) -> None:
    from vidmem.pipelines.atomic import write_bytes_atomically

    path.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomically(path, json.dumps(result, indent=1).encode())


if __name__ == "__main__":
    sys.exit(main())
