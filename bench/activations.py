"""Activation chunks benchmark (issue 28): what fits at 720p with them, and one real block measured on the CPU.

Two parts, written as JSON:
- `plans`: for Wan 2.1 T2V 14B and 1.3B and Wan 2.2 T2V A14B at 1280x720x81, CogVideoX-5b at its
  own 720x480x49 and HunyuanVideo 1.5 720p at 1280x720x121, on 8, 12 and 16 GiB cards with 32 GiB of
  RAM, weights fp8 scaled (the 14B's shipped files) and bf16: the recommended plan with activation_chunks
  off and with auto (tier, swapped blocks, chunks, peak VRAM, estimated slowdown), and the predicted
  denoise peak (allocated, and as the native allocator reserves it) per chunk count under sequential.
- `block`: one real-size Wan 14B block (dim 5,120, 40 heads, feed-forward 13,824; random weights,
  float32: bf16 on this CPU is 4-5x slower) at `--tokens` tokens (default 4,725: 1/16 of 1280x720x81's
  75,600, which would need ~15 GB at float32 unchunked and ~10 minutes per forward on two shared
  cores), each chunk count in a fresh process after an untimed warm-up: output equal to the unchunked
  one (bit for bit, by digest), time, peak RSS above where the forward started (sampled every
  millisecond), next to the planner's prediction for the same call (the block traced on meta).
- `--device cuda` (or `cpu`): the block part only, every chunk count in this process at each `--tokens`
  count (default 32,760 and 75,600: 480p and 720p), bf16 on CUDA: peak allocated above the weights and
  inputs against the plan, CUDA-event time against unchunked, output equality, and issue 28's goals
  (bench/support/activation_block.py). `--device cpu --tiny` is its dry run (CI runs it). `--profile` adds,
  per count, where the time goes: one more call under torch.profiler after all the timed ones, its device
  time by kind (gemm, attention, copy, elementwise), busy against wall time, and each kind's difference
  against unchunked (bench/support/activation_profile.py).

    python bench/activations.py --json bench/results/activations-cpu-2026-11-26.json
    python bench/activations.py --skip-block --json bench/results/activations-plans-2026-11-28.json  # 1 minute
    python bench/activations.py --device cuda --chunks 1,2,4,8,16 --json activations-gpu.json   # about 30 s on an H100
    python bench/activations.py --device cpu --tiny --tokens 64,96 --runs 2 --json /tmp/dry.json   # seconds
    python bench/activations.py --device cuda --compile --tokens 32760 --chunks 1,2,4 --json act-compiled.json
    python bench/activations.py --device cuda --profile --tokens 32760 --chunks 1,2,4,8,16 --json act-profiled.json
    python bench/activations.py --device cpu --tiny --tokens 64,96 --runs 2 --profile --json /tmp/dry.json

About 10 minutes on 2 shared cores (--skip-block for the plans only).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VIDMEM_PLAN_CACHE", "0")  # measure, never read an older cache
from bench.support.checkout import use_this_checkout  # noqa: E402

use_this_checkout()  # `import vidmem` is this clone, installed or not

from bench.support.activation_block import (TINY, WAN14B, CpuMeter, CudaMeter, block_inputs, build_block,  # noqa: E402
                                            chunked, measure, predicted_peak)
from vidmem.memory.units import GiB  # noqa: E402
from vidmem.pipelines.compile import CompileSettings  # noqa: E402

CASES = (("wan2.1-t2v-14b", 1280, 720, 81), ("wan2.1-t2v-1.3b", 1280, 720, 81), ("wan2.2-t2v-a14b", 1280, 720, 81),
         ("cogvideox-5b", 720, 480, 49), ("hunyuanvideo1.5-t2v-720p", 1280, 720, 121))
CARDS_GIB = (8, 12, 16)
RAM_GIB = 32
STORAGES = ("fp8_scaled", "bf16")
BLOCK_CHUNKS = (1, 2, 4, 8)
DTYPES = ("float32", "bfloat16")
DEVICES = ("cuda", "cpu")
CPU_RESULTS = ROOT / "bench" / "results" / "activations-cpu-2026-11-26.json"


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help=f"where the results go (default {CPU_RESULTS.relative_to(ROOT)}; "
                        "with --device, bench/results/activations-DEVICE.json)")
    parser.add_argument("--tokens", type=_counts, default=None, help="tokens of the block run, comma-separated with "
                        "--device (default 32760,75600: 480p, then 720p), one count without (default 4725)")
    parser.add_argument("--dtype", choices=DTYPES, default=None, help="the block's compute dtype (default bfloat16 on "
                        "CUDA, float32 elsewhere; bfloat16 keeps diffusers' float32 modules: norms, modulation table)")
    parser.add_argument("--device", choices=DEVICES, help="the block only, every chunk count in this process on this "
                        "device (cuda: allocator peaks and CUDA-event times; cpu: the dry run, no peaks)")
    parser.add_argument("--chunks", type=_counts, default=BLOCK_CHUNKS, help="chunk counts, comma-separated "
                        f"(default {','.join(map(str, BLOCK_CHUNKS))}; 1, unchunked, always runs: the reference)")
    parser.add_argument("--runs", type=int, default=5, help="timed calls per chunk count with --device (the median)")
    parser.add_argument("--tiny", action="store_true", help="with --device: a narrow block (dim 64) for a dry run")
    parser.add_argument("--compile", action="store_true", help="with --device: every count compiled as a Sampler call "
                        "with the Speed node's compile compiles it, but with static shapes (a Sampler call's default "
                        "dynamic 'auto' runs symbolic code once a last slice is one token longer; the default counts "
                        "here slice 32,760 tokens evenly): each count compiles its own code in the untimed warm-up. "
                        "The plan counts the eager forward, so a compiled peak fails only above it; written under "
                        "block_<device>_compiled")
    parser.add_argument("--profile", action="store_true", help="with --device: once every count's timed calls are "
                        "done, one more per count under torch.profiler, its time by kind (gemm, attention, copy, "
                        "elementwise), kernels launched, busy against wall time and the top kernels in the row's "
                        "`profile`, and a table of each kind's difference against unchunked "
                        "(bench/support/activation_profile.py)")
    parser.add_argument("--skip-block", action="store_true", help="plans only")
    parser.add_argument("--skip-plans", action="store_true", help="the block only, added to an existing --json file")
    parser.add_argument("--block-run", help=argparse.SUPPRESS)  # internal: one chunk count in this process
    args = parser.parse_args(argv)
    if args.device is None and (args.tiny or args.compile or (args.tokens and len(args.tokens) > 1)):
        parser.error("--tiny, --compile and several --tokens counts need --device (the CPU RSS part runs one real "
                     "block size, eagerly)")
    if args.profile and args.device is None:
        parser.error("--profile needs --device: it profiles the block run in this process (the CPU RSS part runs "
                     "each chunk count in its own process, unprofiled); try --device cpu --tiny --profile")
    if args.device == "cuda" and not torch_cuda_available():
        parser.error("--device cuda: torch sees no CUDA device here; use --device cpu for the dry run")
    if args.runs < 1:
        parser.error(f"--runs {args.runs}: at least 1 timed call per chunk count")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    args.tokens = args.tokens or ((32760, 75600) if args.device else (75600 // 16,))
    if args.json is None:
        args.json = ROOT / "bench" / "results" / f"activations-{args.device}.json" if args.device else CPU_RESULTS
    return args


def _counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of whole numbers of 1 or more")
    return counts


def torch_cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    if args.device:
        return device_block(args)
    tokens = args.tokens[0]
    if args.block_run:
        print(json.dumps(block_run(int(args.block_run), tokens, args.dtype)))
        return {}
    if args.skip_plans and args.json.exists():
        results = json.loads(args.json.read_text())
    else:
        results = {"date": time.strftime("%Y-%m-%d"), "machine": machine()}
    if not args.skip_plans:
        results["plans"] = plans()
        write(args.json, results)
    if not args.skip_block:
        results["block" if args.dtype == "float32" else f"block_{args.dtype}"] = block(tokens, args.dtype)
        write(args.json, results)
    report(results)
    return results


def device_block(args: argparse.Namespace) -> dict:
    """The block part in this process on --device: written under `block_<device>`, with the machine and date."""
    import torch

    meter = CudaMeter() if args.device == "cuda" else CpuMeter()
    if args.device == "cpu":
        torch.set_num_threads(1)  # the dry run's times: one thread does not fight other work for shared cores
    results = {"date": time.strftime("%Y-%m-%d"), "machine": machine(args.device)}
    kind = "".join((args.dtype, ", tiny" if args.tiny else "", ", compiled" if args.compile else "",
                    ", profiled" if args.profile else ""))
    print(f"block on {args.device} ({kind}): tokens "
          f"{', '.join(map(str, args.tokens))}, chunks {', '.join(map(str, args.chunks))}, {args.runs} timed runs",
          flush=True)
    started = time.perf_counter()
    key = f"block_{args.device}" + ("_compiled" if args.compile else "")
    # Static shapes: a fair kernel for each slice size (dynamic 'auto' would time symbolic code after the second).
    compiled = CompileSettings(on=True, dynamic=False) if args.compile else CompileSettings()

    def save(found: dict) -> None:
        results[key] = found
        results["seconds"] = round(time.perf_counter() - started, 1)
        write(args.json, results)

    found = measure(TINY if args.tiny else WAN14B, args.tokens, args.chunks, torch.device(args.device), args.dtype,
                    meter, args.runs, save=save, compiled=compiled, profile=args.profile)
    print(f"goals: {json.dumps(found['goals'])}\nwrote {args.json} in {results['seconds']} s")
    return results


def write(path: Path, results: dict) -> None:
    """The results so far, replacing the file whole (written after every count: a lease cut short mid-write keeps
    the last complete file, never a truncated one)."""
    from vidmem.pipelines.atomic import write_bytes_atomically

    write_bytes_atomically(path, (json.dumps(results, indent=2) + "\n").encode())


def machine(device: str = "cpu") -> dict:
    import torch

    found = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "torch": torch.__version__,
             "load_average": os.getloadavg()[0]}
    if device == "cuda":
        found.update(gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda)
    return found


# --- plans -------------------------------------------------------------------------------------------

def plans() -> list[dict]:
    from vidmem.memory import MemoryStrategy
    from vidmem.memory.plan.planner import Allocator, PlanOptions, VideoShape, candidate_plans, recommended
    from vidmem.pipelines.configs import load_model

    rows = []
    for name, width, height, frames in CASES:
        model, shape = load_model(name), VideoShape(width, height, frames)
        for storage in STORAGES:
            options = PlanOptions(storage=model.layout.stored_as(storage), allocator=Allocator.NATIVE, device="cuda")
            started = time.perf_counter()
            row = {"model": name, "size": [width, height], "frames": frames, "weights": storage,
                   "denoise_peak_by_chunks": denoise_peaks(model, shape, options), "cards": {}}
            for card in CARDS_GIB:
                found = {}
                for chunks in ("off", "auto"):
                    candidates = candidate_plans(model, shape, card * GiB, RAM_GIB * GiB,
                                                 MemoryStrategy(activation_chunks=chunks), options)
                    best = recommended(candidates)
                    found[chunks] = summary(candidates[best]) if best is not None else {
                        "fits": False, "leanest": summary(min(candidates, key=lambda p: p.peak_vram_bytes))}
                row["cards"][f"{card}GiB"] = found
            row["seconds"] = round(time.perf_counter() - started, 1)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def denoise_peaks(model, shape, options) -> dict:
    """Predicted denoise peak per chunk count under sequential (the tier whose weights are smallest)."""
    from vidmem.memory import MemoryStrategy
    from vidmem.memory.plan.candidates import CHUNK_STEPS
    from vidmem.memory.plan.stages import denoise_stage

    found = {}
    for chunks in CHUNK_STEPS:
        stage = denoise_stage(model, shape, MemoryStrategy(offload="sequential", activation_chunks=chunks), options)
        found[str(chunks)] = {"allocated_gib": round(stage.allocated_bytes / GiB, 2),
                              "device_gib": round(stage.device_bytes / GiB, 2)}
    return found


def summary(plan) -> dict:
    s = plan.strategy
    return {"fits": bool(plan.fits), "tier": s.offload.value, "blocks_to_swap": s.blocks_to_swap,
            "activation_chunks": s.activation_chunks, "text_encoder": s.text_encoder.value,
            "vae_tiling": s.vae_tiling is not None, "disk": plan.on_disk,
            "peak_vram_gib": round(plan.peak_vram_bytes / GiB, 2),
            "denoise_gib": round(plan.stage("denoise").device_bytes / GiB, 2), "est_slowdown": plan.est_slowdown}


# --- one real block on the CPU -------------------------------------------------------------------------

def block(tokens: int, dtype: str = "float32") -> dict:
    """Each chunk count in a fresh process, so each peak RSS is its own."""
    runs = {}
    for chunks in BLOCK_CHUNKS:
        out = subprocess.run([sys.executable, __file__, "--block-run", str(chunks), "--tokens", str(tokens),
                              "--dtype", dtype], capture_output=True, text=True, check=True)
        runs[str(chunks)] = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"block chunks={chunks}: {runs[str(chunks)]}", flush=True)
    base = runs["1"]
    for run in runs.values():
        run["equal_to_unchunked"] = run["output_digest"] == base["output_digest"]
        run["time_ratio"] = round(run["seconds"] / base["seconds"], 3)
    return {"tokens": tokens, "text_tokens": WAN14B.text_tokens, "dtype": dtype, "config": WAN14B.block_kwargs(),
            "note": f"1/{75600 // tokens} of 1280x720x81's 75,600 tokens" if 75600 % tokens == 0 else "", "runs": runs}


def block_run(chunks: int, tokens: int, dtype: str = "float32") -> dict:
    import hashlib

    import torch

    module = build_block(WAN14B, "cpu", dtype)
    inputs = block_inputs(WAN14B, tokens, "cpu", dtype)
    predicted = predicted_peak(WAN14B, chunks, tokens, dtype)
    with torch.no_grad():
        module(*block_inputs(WAN14B, 256, "cpu", dtype))  # warm-up (first-call kernel setup), not timed
        with chunked(module, chunks), RssPeak() as rss:
            started = time.perf_counter()
            out = module(*inputs)
            seconds = time.perf_counter() - started
    digest = hashlib.sha256(out.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
    return {"chunks": chunks, "seconds": round(seconds, 2), "peak_rss_gib": round(rss.peak_above_start / GiB, 3),
            "predicted_peak_gib": round(predicted / GiB, 3), "output_digest": digest}


class RssPeak:
    """The process's resident set sampled every millisecond on a thread: its peak above where it started
    (ru_maxrss would also count peaks from before, such as building the weights)."""

    def __enter__(self) -> "RssPeak":
        import threading

        self.start = self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, rss_bytes())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())

    @property
    def peak_above_start(self) -> int:
        return self.peak - self.start


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def report(results: dict) -> None:
    for row in results.get("plans", []):
        cards = "; ".join(f"{card}: off {_fit(found['off'])}, auto {_fit(found['auto'])}"
                          for card, found in row["cards"].items())
        print(f"{row['model']} {row['size'][0]}x{row['size'][1]}x{row['frames']} {row['weights']}: {cards}")
    for key in [key for key in results if key.startswith("block")]:
        part = results[key]
        for chunks, run in part["runs"].items():
            print(f"{key} ({part['dtype']}, {part['tokens']} tokens) chunks={chunks}: {run['seconds']} s "
                  f"(x{run['time_ratio']}), RSS +{run['peak_rss_gib']} GiB (planned {run['predicted_peak_gib']} GiB), "
                  f"equal {run['equal_to_unchunked']}")


def _fit(found: dict) -> str:
    if not found["fits"]:
        return f"no (leanest {found['leanest']['peak_vram_gib']} GiB)"
    blocks = f" {found['blocks_to_swap']}" if found["blocks_to_swap"] else ""
    return f"{found['tier']}{blocks} chunks {found['activation_chunks']} {found['peak_vram_gib']} GiB"


if __name__ == "__main__":
    main()
