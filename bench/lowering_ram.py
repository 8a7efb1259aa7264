"""Peak RAM of lowering one large table to a storage format (Load Video Pipeline's `weight_dtype`).

One random bf16 table (default a quarter of umt5-xxl's 256,384 x 4,096 token table) is lowered in a
fresh process per case, and the process's peak RSS (resource.getrusage ru_maxrss) is read before and
after. Two paths:
- "chunked": vidmem's `quantize` (row chunks of QUANTIZE_CHUNK weights written into the result);
- "whole": the whole-tensor pass quantize made before it chunked, kept here verbatim (one float32 copy
  of the table, then each quantizer on all of it).
With `--source gguf_q8_0` the table is first stored as Q8_0 (a GGUF file lowered further): the whole
path then dequantizes it to float32 first, as lower_storage did.

    python bench/lowering_ram.py --json bench/results/lowering_ram.json
    python bench/lowering_ram.py --rows 4096 --cols 4096 --formats gguf_q4_k   # seconds

"growth" is the peak RSS during the lowering less the RSS before it (the table already built, the peak
then reset to it through /proc/self/clear_refs; where that cannot be written, less the peak so far, which
building the table a row chunk at a time keeps low); "transient" is growth less the result's bytes: what
the lowering needs beyond what it keeps.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.support.checkout import use_this_checkout  # noqa: E402

use_this_checkout()  # `import vidmem` is this clone, installed or not

import torch  # noqa: E402

from vidmem.memory.storage import FORMATS, StorageError, StorageFormat, StoredTensor, quantize  # noqa: E402
from vidmem.memory.storage.kquants import quantize_k  # noqa: E402

UMT5_ROWS, UMT5_COLUMNS = 256_384, 4_096
FORMAT_NAMES = ("gguf_q4_k", "gguf_q8_0", "fp8_scaled")
PATHS = ("whole", "chunked")
MIB = 1 << 20


def whole_pass(tensor: torch.Tensor, fmt: StorageFormat) -> StoredTensor:
    """quantize as it was before row chunks (commit abf6c8f), for a plain tensor: the baseline."""
    import gguf

    if fmt.gguf_type is not None:
        if not fmt.holds(tuple(tensor.shape)):
            raise StorageError(f"{fmt.name} cannot hold shape {list(tensor.shape)}")
        values = tensor.detach().to(device="cpu", dtype=torch.float32).contiguous()
        row_bytes = tensor.shape[-1] // fmt.block_size * fmt.block_bytes
        if fmt.gguf_type in ("Q4_K", "Q5_K", "Q6_K"):
            blocks = quantize_k(values, fmt.gguf_type)
        else:
            blocks = torch.from_numpy(gguf.quants.quantize(values.numpy(), gguf.GGMLQuantizationType[fmt.gguf_type]))
        return StoredTensor(blocks.reshape(*tensor.shape[:-1], row_bytes), fmt, tensor.shape)
    if fmt.scaled:
        amax = tensor.detach().abs().amax().to(torch.float32)
        scale = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
        data = (tensor.to(torch.float32) / scale).clamp(-448, 448).to(fmt.torch_dtype)
        return StoredTensor(data, fmt, tensor.shape, scale)
    if fmt.torch_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        limit = torch.finfo(fmt.torch_dtype).max
        return StoredTensor(tensor.to(torch.float32).clamp(-limit, limit).to(fmt.torch_dtype), fmt, tensor.shape)
    return StoredTensor(tensor.to(fmt.torch_dtype), fmt, tensor.shape)


def random_table(rows: int, columns: int) -> torch.Tensor:
    """A bf16 table of normal values, made a few rows at a time (no whole float32 temporary)."""
    table = torch.empty(rows, columns, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    step = max(1, (1 << 22) // columns)
    for start in range(0, rows, step):
        table[start:start + step] = torch.randn(table[start:start + step].shape, generator=generator)
    return table


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def reset_peak_rss() -> bool:
    """Lower the peak RSS to the current RSS (Linux: "5" into /proc/self/clear_refs), so that building
    the source (a quantized one replaces its bf16 table) leaves no peak above the lowering's own."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def run_case(rows: int, columns: int, name: str, path: str, source: str) -> dict:
    """One lowering in this process (a worker): its peak RSS growth, result and seconds."""
    torch.set_num_threads(1)
    table = random_table(rows, columns)
    if source != "bf16":
        table = quantize(table, source)  # the file's format: chunked, before the baseline is read
    table_bytes = table.nbytes if isinstance(table, StoredTensor) else table.numel() * table.element_size()
    one_row = random_table(1, columns)
    lower(one_row if source == "bf16" else quantize(one_row, source), name, path)  # one-off imports and buffers
    reset = reset_peak_rss()
    before = peak_rss_bytes()
    started = time.perf_counter()
    stored = lower(table, name, path)
    seconds = time.perf_counter() - started
    growth = peak_rss_bytes() - before
    return {"format": name, "path": path, "source": source, "rows": rows, "columns": columns,
            "source_bytes": table_bytes, "result_bytes": stored.nbytes, "peak_before_bytes": before,
            "peak_reset": reset,
            "growth_bytes": growth, "transient_bytes": growth - stored.nbytes, "seconds": seconds}


def lower(table: torch.Tensor | StoredTensor, name: str, path: str) -> StoredTensor:
    if path == "chunked":
        return quantize(table, name)
    wide = table.dequantize(torch.float32) if isinstance(table, StoredTensor) else table  # as lower_storage did
    return whole_pass(wide, FORMATS[name])


def run_in_subprocess(rows: int, columns: int, name: str, path: str, source: str) -> dict:
    command = [sys.executable, __file__, "--worker", "--rows", str(rows), "--cols", str(columns),
               "--formats", name, "--paths", path, "--source", source]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{name} ({path}) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def print_table(cases: list[dict]) -> None:
    first = cases[0]
    print(f"\n{first['rows']:,} x {first['columns']:,} table from {first['source']} "
          f"({first['source_bytes'] / MIB:,.0f} MiB), peak RSS growth while lowering (ru_maxrss):")
    print(f"{'format':<11} {'path':<8} {'result MiB':>10} {'growth MiB':>10} {'transient MiB':>13} "
          f"{'x source':>8} {'seconds':>8}")
    for case in cases:
        print(f"{case['format']:<11} {case['path']:<8} {case['result_bytes'] / MIB:>10,.0f} "
              f"{case['growth_bytes'] / MIB:>10,.0f} {case['transient_bytes'] / MIB:>13,.0f} "
              f"{case['growth_bytes'] / case['source_bytes']:>8.2f} {case['seconds']:>8.1f}")
    print("transient = growth - result: what lowering needs beyond what it keeps.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=UMT5_ROWS // 4)
    parser.add_argument("--cols", type=int, default=UMT5_COLUMNS)
    parser.add_argument("--formats", default=",".join(FORMAT_NAMES), help="comma-separated storage formats")
    parser.add_argument("--paths", default=",".join(PATHS), help="whole, chunked or both")
    parser.add_argument("--source", default="bf16", choices=["bf16", *(n for n, f in FORMATS.items() if f.quantized)],
                        help="the table as the file holds it (a quantized source is lowered further)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    names, paths = args.formats.split(","), args.paths.split(",")
    unknown = [n for n in names if n not in FORMATS] + [p for p in paths if p not in PATHS]
    if unknown:
        parser.error(f"unknown format or path {', '.join(unknown)}; formats: {', '.join(FORMATS)}; "
                     f"paths: {', '.join(PATHS)}")
    if args.worker:
        print(json.dumps(run_case(args.rows, args.cols, names[0], paths[0], args.source)))
        return
    cases = []
    for name in names:
        for path in paths:
            print(f"lowering to {name} ({path}) in a fresh process ...", flush=True)
            cases.append(run_in_subprocess(args.rows, args.cols, name, path, args.source))
    print_table(cases)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"cases": cases}, indent=2))
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
