"""bench/activations.py, one block in this process (issue 28 on a GPU): per activation_chunks count, the
measured activation peak against the planner's, the time per forward against unchunked, and the output.

One real-size Wan 2.1 14B block (dim 5,120, 40 heads, feed-forward 13,824; random weights, bf16 with
diffusers' float32 modules kept, as from_pretrained loads it) at each token count (32,760: 832x480x81,
first, where both goals are judged; 75,600: 1280x720x81; out of memory at one is recorded, and the next
runs). Per count, after an untimed warm-up call (kernel selection, cuBLAS workspace):
- `measured_peak_bytes`: one call with the peak statistics reset just before it,
  `torch.cuda.max_memory_allocated()` minus `memory_allocated()` at its start, so the block's weights,
  its inputs and the unchunked reference output are not counted; the call's own output is, as in the
  plan. No subprocess is needed (the CPU part needs one per count: RSS only grows);
- `predicted_peak_bytes`: the planner's count for the same call (the block traced on meta under its
  tensor ledger, fused attention: output and logsumexp, as flash and memory-efficient kernels hold);
- `seconds`: the median of `runs` timed calls (CUDA events), rounds interleaved across the counts so
  clock drift lands on all alike; `time_ratio` against unchunked;
- the output against unchunked: `bitwise_equal`, `max_abs_diff`, and `close` under torch.testing's
  default tolerance for the dtype (cuBLAS may pick another GEMM for fewer rows: last-bit differences,
  as between batch sizes; the engine promises bit identity on the CPU only).

The issue's goals, judged on CUDA only: every measured peak within 10% of the plan; at 32,760 tokens
(480p) every chunk count at most 5% slower than unchunked. A block's cost ratio stands for a step's:
the blocks are nearly all of a denoise step's time. `--device cpu` runs the same path with wall-clock
timing and no allocator statistics (a dry run: CI checks the wiring at tiny widths).

With `profile`, each count's row also says where its time goes (bench/support/activation_profile.py): one more
call once every timed call is done, under the profiler, its time summed by kind of work.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from vidmem.memory.accounting import trace
from vidmem.pipelines.activation_chunks import activation_chunks
from vidmem.pipelines.compile import CompileSettings, compiled_blocks

from .activation_profile import cost_table, profile_call

FP32_MODULES = ("scale_shift_table", "norm1", "norm2", "norm3")  # WanTransformer3DModel._keep_in_fp32_modules
VIDEO_TOKENS = {75600: "1280x720x81", 32760: "832x480x81"}  # Wan's latent patches: (W/16) x (H/16) x ((F-1)/4+1)
COST_GOAL_TOKENS = 32760  # "chunking costs at most 5% per step at 480p"
PEAK_GOAL = 0.10  # measured activation peak within 10% of the plan
COST_GOAL = 0.05


@dataclass(frozen=True)
class BlockShape:
    """A WanTransformerBlock's widths and the text tokens it cross-attends to."""

    dim: int = 5120
    heads: int = 40
    ffn: int = 13824
    text_tokens: int = 512

    def block_kwargs(self) -> dict:
        return dict(dim=self.dim, ffn_dim=self.ffn, num_heads=self.heads, cross_attn_norm=True, eps=1e-6)


WAN14B = BlockShape()
TINY = BlockShape(dim=64, heads=2, ffn=128, text_tokens=16)  # the dry run's: the same code path in milliseconds


def build_block(shape: BlockShape, device, dtype: str) -> torch.nn.Module:
    """The block with seeded random weights, built on `device` (meta: shapes only, the seed left alone)."""
    from diffusers.models.transformers.transformer_wan import WanTransformerBlock

    if str(device) != "meta":
        torch.manual_seed(0)
    with torch.device(device):
        return cast(WanTransformerBlock(**shape.block_kwargs()).eval(), dtype)


def cast(module: torch.nn.Module, dtype: str) -> torch.nn.Module:
    """The block as from_pretrained(torch_dtype=...) leaves it: diffusers' float32 modules stay float32."""
    for name, tensor in module.named_parameters():
        if not any(part in FP32_MODULES for part in name.split(".")):
            tensor.data = tensor.data.to(getattr(torch, dtype))
    return module


def block_inputs(shape: BlockShape, tokens: int, device, dtype: str) -> tuple:
    """hidden and text states in the compute dtype; the timestep projection and rotary tables in float32,
    as WanTransformer3DModel hands them to its blocks."""
    compute, head = getattr(torch, dtype), shape.dim // shape.heads

    def make(*size, dtype=torch.float32):
        if str(device) == "meta":
            return torch.empty(*size, device="meta", dtype=dtype)
        return torch.randn(*size, device=device).to(dtype)

    rope = (make(1, tokens, 1, head), make(1, tokens, 1, head))
    return make(1, tokens, shape.dim, dtype=compute), make(1, shape.text_tokens, shape.dim, dtype=compute), \
        make(1, 6, shape.dim), rope


def chunked(module: torch.nn.Module, chunks: int):
    """The engine's own chunking of one block (what a run applies to every block)."""
    return activation_chunks({"block": module}, {"block": [module]}, chunks)


class CompileFellBack(RuntimeError):
    """torch.compile failed and the block ran eagerly: its times would pass for compiled ones."""


@contextlib.contextmanager
def prepared(module: torch.nn.Module, chunks: int, compiled: CompileSettings = CompileSettings()):
    """The block chunked (chunks > 1) and, with `compiled` on, compiled as a Sampler call compiles it: the
    block's forward unchunked, the slices' steps chunked (pipelines/compile.py). A compile that fell back to
    eager stops the bench with its reason (CompileFellBack): a Sampler call would run on eagerly, but here
    the eager times would be recorded as compiled, and every later call would try the compile again."""
    with chunked(module, chunks) as applied, compiled_blocks({"block": [module]}, compiled, applied) as report:
        yield
        if report.fallback:
            raise CompileFellBack(report.fallback)


def predicted_peak(shape: BlockShape, chunks: int, tokens: int, dtype: str) -> int:
    """The planner's count for the same call: the block on meta under its tensor ledger."""
    module = build_block(shape, "meta", dtype)
    inputs = block_inputs(shape, tokens, "meta", dtype)
    with chunked(module, chunks):
        return trace(lambda: module(*inputs)).peak_bytes


# --- measuring ----------------------------------------------------------------------------------------

class CudaMeter:
    """Peak allocated bytes above the call's start (the caching allocator's own counters), CUDA-event time."""

    name = "cuda"

    def peak(self, call: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, int]:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        out = call()
        torch.cuda.synchronize()
        return out, torch.cuda.max_memory_allocated() - start

    def seconds(self, call: Callable[[], torch.Tensor]) -> float:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        call()  # the output is dropped here, before the next call allocates its own
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1000


class CpuMeter:
    """The dry run's: wall-clock time, no allocator statistics (the RSS part measures the CPU's peak)."""

    name = "cpu"

    def peak(self, call: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, None]:
        return call(), None

    def seconds(self, call: Callable[[], torch.Tensor]) -> float:
        started = time.perf_counter()
        call()
        return time.perf_counter() - started


def measure(shape: BlockShape, tokens: Sequence[int], chunks: Sequence[int], device, dtype: str, meter,
            runs: int = 5, log=print, save=None, compiled: CompileSettings = CompileSettings(),
            profile: bool = False) -> dict:
    """Every chunk count at every token count (see the module docstring); 1 (unchunked) always runs first.
    `save` is handed the result so far after each token count (a lease's time limit keeps what was done).
    `compiled` on: every count compiled (the warm-up call compiles, outside the timed calls).
    `profile`: each row's `profile`, from one more call once every token count's timed calls are done
    (bench/support/activation_profile.py): until CUPTI is torn down, a profiler session can slow the launches after
    it, and a chunked block launches more of them, so no timed call comes after one."""
    counts = (1, *sorted(set(chunks) - {1}))
    module = build_block(shape, device, dtype)
    found = {"config": asdict(shape), "dtype": dtype, "device": str(device), "meter": meter.name, "runs": runs,
             "chunks": list(counts), "compile": compiled.describe(), "tokens": {}}
    with torch.no_grad():
        for count in tokens:
            def keep(so_far: dict, count: int = count) -> None:  # rows measured so far: a time limit keeps them
                found["tokens"][str(count)] = {**so_far, "partial": True}
                if save is not None:
                    save(found)

            try:
                found["tokens"][str(count)] = _at_tokens(module, shape, count, counts, device, dtype, meter, runs, log,
                                                         compiled, keep)
            except torch.OutOfMemoryError as error:  # a finding at this size: the other counts still run
                found["tokens"][str(count)] = {"video": VIDEO_TOKENS.get(count, ""), "error": _first_line(error)}
                log(f"  {count} tokens: {found['tokens'][str(count)]['error']}")
            found["goals"] = goals(found["tokens"], meter.name == "cuda")
            if save is not None:
                save(found)
        if profile:
            _profile_all(module, shape, found["tokens"], device, dtype, log, compiled)
            if save is not None:
                save(found)
    return found


def _at_tokens(module, shape: BlockShape, tokens: int, counts: tuple[int, ...], device, dtype: str, meter, runs: int,
               log, compiled: CompileSettings, keep=lambda so_far: None) -> dict:
    """One token count's rows: each count's peak (after a warm-up that also compiles), then interleaved timed
    rounds. `keep` is handed the rows after each peak and each round (a real block compiles for a while)."""
    inputs = block_inputs(shape, tokens, device, dtype)
    rows, reference = {}, None
    so_far = {"video": VIDEO_TOKENS.get(tokens, ""), "text_tokens": shape.text_tokens, "rows": rows}
    for chunks in counts:
        with prepared(module, chunks, compiled):
            module(*inputs)  # warm-up: kernel selection, workspaces and the compile, outside the peak
            out, peak = meter.peak(lambda: module(*inputs))
        reference = out if reference is None else reference
        predicted = predicted_peak(shape, chunks, tokens, dtype)
        rows[str(chunks)] = {"chunks": chunks, "measured_peak_bytes": peak, "predicted_peak_bytes": predicted,
                             **_compare(out, reference)}
        del out
        keep(so_far)
    for _ in range(runs):  # interleaved rounds
        for chunks in counts:
            with prepared(module, chunks, compiled):
                rows[str(chunks)].setdefault("times", []).append(meter.seconds(lambda: module(*inputs)))
        keep(so_far)
    base = statistics.median(rows["1"]["times"]) if runs else None
    for row in rows.values():
        _finish(row, base, judged=meter.name == "cuda", cost_applies=tokens == COST_GOAL_TOKENS, compiled=compiled.on)
        log(_line(tokens, row))
    return so_far


def _profile_all(module, shape: BlockShape, by_tokens: dict, device, dtype: str, log,
                 compiled: CompileSettings) -> None:
    """Each row's `profile`: one more call of the block prepared as its timed calls were (chunked, compiled), on
    inputs of the same shapes; then each token count's table. A count that ran out of memory has no rows."""
    for tokens, part in by_tokens.items():
        if "rows" not in part:
            continue
        _profile_rows(module, block_inputs(shape, int(tokens), device, dtype), part["rows"], device, compiled)
        for line in cost_table(int(tokens), part["rows"]):
            log(line)


def _profile_rows(module, inputs: tuple, rows: dict, device, compiled: CompileSettings) -> None:
    for row in rows.values():
        with prepared(module, row["chunks"], compiled):
            row["profile"] = profile_call(lambda: module(*inputs), torch.device(device))


def _compare(out: torch.Tensor, reference: torch.Tensor) -> dict:
    try:
        torch.testing.assert_close(out, reference)
        close = True
    except AssertionError:
        close = False
    return {"bitwise_equal": torch.equal(out, reference), "close": close,
            "max_abs_diff": (out.float() - reference.float()).abs().max().item()}


def _finish(row: dict, base: float | None, judged: bool, cost_applies: bool, compiled: bool = False) -> None:
    """Medians, ratios and each goal's verdict on the row (None where it is not judged). Compiled, the plan (which
    traces the eager forward) is an upper bound: inductor fuses the float32 temporaries it counts, so only a peak
    more than 10% above it fails."""
    times = row.get("times", [])
    row["seconds"] = statistics.median(times) if times else None
    row["time_ratio"] = round(row["seconds"] / base, 4) if times and base else None
    measured, predicted = row["measured_peak_bytes"], row["predicted_peak_bytes"]
    row["peak_error"] = round(measured / predicted - 1, 4) if measured is not None and predicted else None
    error = row["peak_error"]
    if judged and error is not None:
        row["peak_within_10pct"] = (error if compiled else abs(error)) <= PEAK_GOAL
    else:
        row["peak_within_10pct"] = None
    row["cost_within_5pct"] = (row["time_ratio"] <= 1 + COST_GOAL
                               if judged and cost_applies and row["chunks"] > 1 and row["time_ratio"] else None)


def goals(by_tokens: dict, judged: bool) -> dict:
    """The issue's two goals over every row they apply to (None: not judged, as on the CPU)."""
    rows = [row for found in by_tokens.values() for row in found.get("rows", {}).values()]

    def verdict(key: str) -> bool | None:
        found = [row[key] for row in rows if row[key] is not None]
        return all(found) if judged and found else None

    return {"peak_within_10pct_of_plan": verdict("peak_within_10pct"),
            "chunking_costs_at_most_5pct_at_480p": verdict("cost_within_5pct"),
            "judged": "on CUDA only" if not judged else "yes"}


def _first_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"


def _line(tokens: int, row: dict) -> str:
    seconds = "-" if row["seconds"] is None else f"{row['seconds'] * 1000:.1f} ms (x{row['time_ratio']})"
    return (f"  {tokens} tokens, chunks {row['chunks']:>2}: peak {_size(row['measured_peak_bytes'])} (planned "
            f"{_size(row['predicted_peak_bytes'])}), {seconds}, bitwise {row['bitwise_equal']}, "
            f"close {row['close']}, max diff {row['max_abs_diff']:.2e}")


def _size(nbytes: int | None) -> str:
    if nbytes is None:
        return "-"
    return f"{nbytes / (1 << 30):.3f} GiB" if nbytes >= 1 << 30 else f"{nbytes / (1 << 20):.2f} MiB"
