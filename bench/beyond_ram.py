"""Beyond RAM: Wan 2.1 T2V 14B from ComfyUI's own files, larger than RAM, on this CPU.

Builds real-size random-weight files in Comfy-Org's layout and names (bench/support/beyond_ram_files.py):
the 14B transformer in bf16 (28.6 GB, more than this machine's RAM) and in fp8 scaled (14.3 GB),
umt5-xxl in fp8 scaled with an embedded SentencePiece tokenizer, the Wan 2.1 VAE. Each variant
then runs in a fresh process (bench/support/beyond_ram_run.py), as ComfyUI would: Load Video Model Files
from a models/ tree (weights_on_disk: the weights stay memory-mapped from the files), Memory
Strategy offload=auto (the planner picks the tier and the text encoder placement for this
machine's RAM), Video Sampler (1 step at 64x64x5, cfg 1: one pass), Video VAE Decode.

Measured, in the run's own process: peak anonymous memory (RssAnon, what the run takes from RAM;
sampled every 20 ms by a thread), peak RSS (VmHWM, which also counts the mapped file pages the
kernel can reclaim), wall and CPU seconds of load + sample + decode (CPU time is steadier on a
shared machine). Goal: both runs finish, the bf16 files exceed RAM, peak anonymous memory <= 8 GiB.

Compute dtype bf16: this CPU has AMX/AVX-512 bf16, where a bf16 matmul runs ~4x faster than fp32
(measured 261 vs 48 GFLOPS at 512x5120x13824), and the bf16 file is then used in place with no
upcast; the fp8 file is dequantized per layer to bf16. The VAE runs in fp32 (as diffusers' Wan
docs do, for quality). Each file is written, fsynced and dropped from the page cache, so every
run starts with its weights on disk. Disk: 35.6 GB at once (the shared text encoder and VAE, plus
one transformer at a time; each is deleted after its run), 50 GB with --keep.

    python bench/beyond_ram.py --json bench/results/beyond_ram.json
    python bench/beyond_ram.py --keep /data/wan_files --only fp8       # keep the files
    python bench/beyond_ram.py --reuse /data/wan_files                 # skip writing the files there
    python bench/beyond_ram.py --model tiny-wan2.1-t2v --json /tmp/x.json   # the same path in seconds
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.support.checkout import use_this_checkout  # noqa: E402

use_this_checkout()  # `import vidmem` is this clone, installed or not

from bench.support import beyond_ram_files as files  # noqa: E402

GOAL_ANON_BYTES = 8 * 2**30
RUN_SCRIPT = Path(__file__).parent / "support" / "beyond_ram_run.py"
MEASURED_PHASES = ("load", "strategy", "sample", "decode")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the results here (e.g. bench/results/beyond_ram.json)")
    parser.add_argument("--only", choices=list(files.VARIANTS), action="append", help="run only this variant (repeatable)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--keep", type=Path, help="write the files under DIR (a models/ tree) and keep them")
    where.add_argument("--reuse", type=Path, help="use the files under DIR, writing only those missing; keep them")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()),
                        help="where temporary files go without --keep/--reuse (default: the temp folder)")
    parser.add_argument("--model", default="wan2.1-t2v-14b", help="shipped config to build (tiny-wan2.1-t2v: a smoke test)")
    parser.add_argument("--prompt", default="a red fox runs through fresh snow at dawn, cinematic")
    parser.add_argument("--size", default="64x64")
    parser.add_argument("--frames", type=int, default=5)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--cfg", type=float, default=1.0)
    parser.add_argument("--dtype", default="bf16", help="compute dtype of transformer and text encoder")
    parser.add_argument("--vae-dtype", default="fp32")
    parser.add_argument("--offload", default="auto", help="Memory Strategy tier; auto: the planner's choice "
                        "(a tiny model has no shipped config to plan from: pass model)")
    return parser.parse_args(argv)


def machine_ram_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemTotal in /proc/meminfo")


def main(argv=None) -> dict:
    args = parse_args(argv)
    variants = [files.VARIANTS[key] for key in (args.only or files.VARIANTS)]
    keep = args.keep or args.reuse
    root = (keep or Path(tempfile.mkdtemp(prefix="beyond_ram_", dir=args.work))).resolve()
    entry = files.model_entry(args.model, root)
    try:
        check_disk(entry, variants, root, keep is not None)
        runs = {}
        for variant in variants:
            runs[variant.key] = run_variant(entry, variant, root, args)
            if keep is None:
                variant.model.path(root).unlink()
    finally:
        if keep is None:
            shutil.rmtree(root, ignore_errors=True)
    result = {"runs": runs, "machine_ram_bytes": machine_ram_bytes(), "model": entry.name, "source": source(),
              "goal": {"peak_anon_bytes_at_most": GOAL_ANON_BYTES, "bf16_files_exceed_ram": True}}
    print_table(result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2, default=str))
        print(f"\nwrote {args.json}")
    return result


def source() -> dict:
    """Which vidmem ran: its folder and, in a git checkout, the commit and whether tracked files differ."""
    import vidmem

    folder = Path(vidmem.__file__).resolve().parent
    git = ["git", "-C", str(folder)]
    commit = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True)
    if commit.returncode != 0:
        return {"folder": str(folder), "commit": "(not a git checkout)"}
    dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
    return {"folder": str(folder), "commit": commit.stdout.strip(), "tracked_files_modified": bool(dirty.stdout.strip())}


def check_disk(entry, variants, root: Path, keep: bool) -> None:
    """Refuse before writing anything when the disk cannot hold what this invocation writes at once."""
    def missing(file):
        return 0 if file.path(root).is_file() and files.is_complete(file.path(root)) else files.expected_bytes(entry, file)

    shared = sum(missing(file) for file in files.SHARED)
    models = [missing(variant.model) for variant in variants]
    needed = shared + (sum(models) if keep else max(models))
    what = ", ".join(v.model.name for v in variants) + " with the text encoder and VAE"
    print(f"files to write: {needed / 1e9:.1f} GB at most at once under {root}")
    files.check_free_space(root, needed, what)


def ensure_file(entry, file, root: Path) -> float:
    """Write `file` unless a complete one is there; the seconds spent writing (0 when reused)."""
    path = file.path(root)
    if path.is_file() and files.is_complete(path):
        files.drop_from_page_cache(path)  # every run starts with its weights on disk
        return 0.0
    print(f"writing {path} ({files.expected_bytes(entry, file) / 1e9:.1f} GB) ...", flush=True)
    started = time.perf_counter()
    files.write(entry, file, root)
    return time.perf_counter() - started


def run_variant(entry, variant, root: Path, args) -> dict:
    written = {f.name: round(ensure_file(entry, f, root), 1) for f in (*files.SHARED, variant.model)}
    paths = [f.path(root) for f in (variant.model, *files.SHARED)]
    width, height = (int(n) for n in args.size.lower().split("x"))
    settings = {"models": str(root), "files": {f.role: f.name for f in (variant.model, *files.SHARED)},
                "weights_on_disk": variant.weights_on_disk, "dtype": args.dtype, "vae_dtype": args.vae_dtype,
                "offload": args.offload, "prompt": args.prompt, "width": width, "height": height,
                "frames": args.frames, "steps": args.steps, "cfg": args.cfg, "seed": 0}
    with tempfile.TemporaryDirectory(prefix="beyond_ram_run_") as scratch:
        run_file, out_file = Path(scratch) / "run.json", Path(scratch) / "out.json"
        run_file.write_text(json.dumps(settings))
        print(f"running {variant.key} in a fresh process ...", flush=True)
        done = subprocess.run([sys.executable, str(RUN_SCRIPT), str(run_file), str(out_file)], env=os.environ.copy())
        if done.returncode != 0:
            raise SystemExit(f"{variant.key}: the run failed with exit status {done.returncode} (its output is above)")
        details = json.loads(out_file.read_text())
    memory = details["memory"]
    return {
        "files_bytes": sum(p.stat().st_size for p in paths),
        "peak_rss_bytes": memory["vm_hwm_bytes"],
        "peak_anon_bytes": memory["peak_anon_bytes"],
        "seconds": round(sum(memory["phases"].get(p, {}).get("seconds", 0.0) for p in MEASURED_PHASES), 1),
        "cpu_seconds": round(sum(memory["phases"].get(p, {}).get("cpu_seconds", 0.0) for p in MEASURED_PHASES), 1),
        "write_seconds": written,
        "settings": {k: v for k, v in settings.items() if k != "models"},
        "malloc_arena_max": os.environ.get("MALLOC_ARENA_MAX", "(glibc default)"),
        "details": details,
    }


def print_table(result: dict) -> None:
    ram = result["machine_ram_bytes"]
    gib = 2**30
    print(f"\n{result['model']} on this machine: RAM {ram / gib:.1f} GiB; goal: peak anon <= {GOAL_ANON_BYTES / gib:.0f} GiB")
    print(f"{'run':<10} {'files GiB':>9} {'> RAM':>5} {'peak anon':<11} {'VmHWM':>7} {'seconds':>8} {'cpu s':>7}  "
          f"{'load':>6} {'sample':>7} {'decode':>6}  strategy")
    for key, run in result["runs"].items():
        phases = run["details"]["memory"]["phases"]
        secs = [phases.get(p, {}).get("seconds", 0.0) for p in ("load", "sample", "decode")]
        ok = "ok" if run["peak_anon_bytes"] <= GOAL_ANON_BYTES else "OVER"
        over_ram = "yes" if run["files_bytes"] > ram else "no"
        print(f"{key:<10} {run['files_bytes'] / gib:>9.1f} {over_ram:>5} {run['peak_anon_bytes'] / gib:>6.2f} {ok:<4} "
              f"{run['peak_rss_bytes'] / gib:>7.2f} {run['seconds']:>8.1f} {run.get('cpu_seconds', 0.0):>7.1f}  "
              f"{secs[0]:>6.1f} {secs[1]:>7.1f} {secs[2]:>6.1f}  {run['details']['sampler_receipt'].get('strategy', '?')}")
    print("peak anon = RssAnon (anonymous memory, sampled every 20 ms); VmHWM = peak RSS, mapped file pages included.")


if __name__ == "__main__":
    main()
