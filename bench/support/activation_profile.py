"""bench/activations.py --profile: where one block call's time goes, by kind of work (issue 28 on a GPU).

Times alone cannot say why a chunked block is slower than the whole one. The extra can go to GEMMs on fewer
rows (tile quantization: a last tile row half empty costs a full one), attention on fewer queries, the copies
chunking adds (keys, values and queries written into preallocated tensors, each slice's output written back),
elementwise work, or host-side launch overhead (the GPU idle while the CPU launches more, smaller kernels).
So once every count's timed runs are done (at every token count: a profiler session can slow the launches
after it until CUPTI is torn down, pytorch/pytorch#144455), one more call of the block per count runs under
`torch.profiler.profile`, and its row gets a `profile`:
- `clock`: "cuda" (device kernels: CUDA activity) or "cpu" (the dry run: the aten ops' self CPU time, since
  there are no device kernels);
- `device_ms_by_kind`: that time in ms summed by kind, `gemm`, `attention`, `copy`, `elementwise`, each kernel
  (or op) named by the first row of KERNEL_KINDS (OP_KINDS) whose substring its name holds, else elementwise;
- `kernels`: device kernels launched, copies and memsets included (cpu: aten ops counted, nested ones too);
- `wall_ms` of the profiled call (synchronised) and `busy_ms`, the sum of device time: wall well above busy
  means the GPU waited for the host. The profiler adds host time per launch, so wall is an upper bound: the
  row's own timed `seconds` (unprofiled) against `busy_ms` says the same without it. Busy above wall cannot
  happen on one stream: the printed line then says the kernels' timestamps are suspect (CUPTI has handed back
  kernel records with timestamps from another clock at the start of a session, pytorch/pytorch#192021);
- `top`: the 8 kernels (or ops) with the most time: name (first 80 characters), calls, ms.

A dtype cast (`.float()`, `type_as`) runs the same CUDA kernel as a copy (`direct_copy_kernel_cuda`), so casts
are counted as copies on both clocks. The chunked block casts the same tokens as the whole one, so casts
largely cancel in the difference `cost_table` prints; what remains under copy is mostly what chunking writes.
Compiled, inductor folds casts and copies into its fused kernels (`triton_*`), counted as elementwise.
(Compiled by inductor on the CPU, the fused C++ kernels are no aten ops and go uncounted: the CPU clock is the
dry run's, it checks the wiring.)
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

KINDS = ("gemm", "attention", "copy", "elementwise")
TOP = 8
NAME_CHARS = 80

# CUDA kernel names (lowercased) -> kind; the first row with a matching substring wins. Inductor's own kernels
# come first: it names a fused kernel after the ops it serves, attention's among them
# ("triton_poi_fused__scaled_dot_product_flash_attention__to_copy_mul_0" is the rotary and casts feeding SDPA),
# so its matmul templates ("triton_tem_fused_mm_0") are GEMMs and every other "triton_" kernel elementwise
# (a fused "triton_poi_fused__to_copy_add_0" is arithmetic whose cast is free). Attention next: memory-efficient
# attention is built on CUTLASS ("fmha_cutlassF_..."), so "cutlass" alone would call it a GEMM.
KERNEL_KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("gemm", ("triton_tem",)),
    ("elementwise", ("triton_",)),
    ("attention", ("flash", "fmha", "sdpa", "attention")),  # flash-attn 2/3, PyTorch's, cuDNN's fused SDPA
    ("gemm", ("gemm", "gemv", "sm90_xmma", "sm80_xmma", "cutlass", "nvjet", "splitkreduce")),
    ("copy", ("copy", "memcpy", "memset", "catarray", "index", "scatter")),  # CatArrayBatchedCopy, index_put
)

# aten op names (lowercased) -> kind, as above, for the CPU clock. Self time only: aten::linear's work is in its
# aten::addmm child, aten::_to_copy's in aten::copy_, so no time is counted twice.
OP_KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("scaled_dot_product", "_flash_attention", "_efficient_attention", "_cudnn_attention")),
    ("gemm", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::linear", "aten::matmul")),
    ("copy", ("aten::copy_", "aten::_to_copy", "aten::clone", "aten::cat", "aten::index", "aten::slice_scatter",
              "aten::select_scatter", "aten::fill_", "aten::zero_")),
)


def kind_of(name: str, table: Sequence[tuple[str, tuple[str, ...]]] = KERNEL_KINDS) -> str:
    """The kind of work a kernel (or, with OP_KINDS, an aten op) named `name` does."""
    lowered = name.lower()
    for kind, parts in table:
        if any(part in lowered for part in parts):
            return kind
    return "elementwise"


def profile_call(call: Callable[[], object], device: torch.device) -> dict:
    """One call of `call` under the profiler, summed by kind on the device's clock (see the module docstring)."""
    on_cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_cuda else [])]
    with profile(activities=activities) as profiler:
        sync()  # the call's own launches only: nothing queued before it runs inside its wall time
        started = time.perf_counter()
        call()  # the output is dropped here, as in the timed calls
        sync()
        wall = time.perf_counter() - started
    timings = _device_kernels(profiler.events()) if on_cuda else _aten_ops(profiler.events())
    return summary(timings, KERNEL_KINDS if on_cuda else OP_KINDS, "cuda" if on_cuda else "cpu", wall * 1000)


def _device_kernels(events: Iterable) -> list[tuple[str, float]]:
    """(name, µs) of every device kernel, copy and memset; not the device-side ranges of annotations, which
    span kernels already counted."""
    return [(event.name, event.device_time_total) for event in events
            if event.device_type == DeviceType.CUDA and not event.is_user_annotation]


def _aten_ops(events: Iterable) -> list[tuple[str, float]]:
    """(name, self CPU µs) of every aten op (not Python functions or annotations around them)."""
    return [(event.name, event.self_cpu_time_total) for event in events
            if event.device_type == DeviceType.CPU and event.name.startswith("aten::") and not event.is_async]


def summary(timings: Sequence[tuple[str, float]], table, clock: str, wall_ms: float) -> dict:
    """A row's `profile` from (name, µs) pairs: ms by kind, count, busy and wall time, the top kernels."""
    by_kind, by_name, calls = dict.fromkeys(KINDS, 0.0), Counter(), Counter()
    for name, micros in timings:
        by_kind[kind_of(name, table)] += micros / 1000
        by_name[name] += micros / 1000
        calls[name] += 1
    top = [{"name": name[:NAME_CHARS], "calls": calls[name], "ms": round(ms, 3)}
           for name, ms in by_name.most_common(TOP)]
    return {"clock": clock, "device_ms_by_kind": {kind: round(ms, 3) for kind, ms in by_kind.items()},
            "kernels": len(timings), "wall_ms": round(wall_ms, 3), "busy_ms": round(sum(by_kind.values()), 3),
            "top": top}


def cost_table(tokens: int, rows: dict) -> list[str]:
    """The lines bench/activations.py prints per token count: each chunk count's ms by kind, and what each kind
    costs more (or less) than unchunked. Each line names its token and chunk counts, as the timed lines do, so
    one grep finds both."""
    profiled = [row for row in rows.values() if "profile" in row]
    if not profiled:
        return []
    base = rows["1"]["profile"]["device_ms_by_kind"] if "profile" in rows.get("1", {}) else None
    lines = [f"  profile at {tokens} tokens ({profiled[0]['profile']['clock']} clock, ms by kind; "
             "difference against unchunked):"]
    for row in profiled:
        line = _profile_line(tokens, row)
        if base is not None and row["chunks"] != 1:
            line += "; " + difference(row["profile"]["device_ms_by_kind"], base)
        lines.append(line)
    return lines


def _profile_line(tokens: int, row: dict) -> str:
    """One count's ms by kind, busy and profiled wall time beside its timed (unprofiled) median, and launches."""
    found = row["profile"]
    kinds = ", ".join(f"{kind} {found['device_ms_by_kind'][kind]:.2f}" for kind in KINDS)
    timed = "-" if row.get("seconds") is None else f"{row['seconds'] * 1000:.2f}"
    launched = "kernels" if found["clock"] == "cuda" else "aten ops"
    suspect = " (busy above wall: suspect kernel timestamps)" if found["busy_ms"] > found["wall_ms"] else ""
    return (f"    profiled {tokens} tokens, chunks {row['chunks']:>2}: {kinds}; busy {found['busy_ms']:.2f} ms, "
            f"wall {found['wall_ms']:.2f} ms profiled{suspect}, {timed} ms timed, {found['kernels']} {launched}")


def difference(by_kind: dict, base: dict) -> str:
    """'gemm +1.20 ms, attention +0.80 ms, ...': each kind's ms against `base`'s."""
    return ", ".join(f"{kind} {by_kind[kind] - base[kind]:+.2f} ms" for kind in KINDS)
