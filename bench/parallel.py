"""Wan across GPUs: CPU parity of Ulysses degree 2, and the planner's per-GPU figures on 1-8 GPUs.

Two parts, written as JSON:
- `cpu.ulysses2`: Wan with Ulysses degree 2 over two spawned CPU ranks (gloo) against one process,
  under tiers none and block_swap (`bench/support/parallel_cpu.ulysses2_parity`): the largest absolute
  difference of the frames and the wall time. Skipped with `--modelled-only`.
- `modelled`: `vidmem.memory.plan.parallel.plan_parallel` for Wan 2.1 T2V 14B at 1280x720x81 and
  Wan 2.2 T2V A14B at 832x480x81 on 1, 2, 4 and 8 GPUs, Ulysses, bf16, the default strategy (model
  offload, text encoder off the GPU after encoding, untiled decode), 50 steps with guidance: each
  GPU's peak, the speedup against the same strategy on one GPU over PCIe 4.0 x16 (and over NVLink,
  `speedup_nvlink`), the all-to-all bytes and the tokens each rank holds. Planned, not measured:
  no GPU here.

    python bench/parallel.py --json bench/results/parallel.json
    python bench/parallel.py --modelled-only --json /tmp/parallel.json

The modelled part takes about 20 s on 2 shared cores (meta traces); the CPU part spawns processes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
from bench.support.checkout import use_this_checkout  # noqa: E402

use_this_checkout()  # `import vidmem` is this clone, installed or not

CASES = (("wan2.1-t2v-14b", (1280, 720, 81)), ("wan2.2-t2v-a14b", (832, 480, 81)))
GPU_COUNTS = (1, 2, 4, 8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "parallel.json")
    parser.add_argument("--modelled-only", action="store_true", help="skip the CPU parity runs (spawned ranks)")
    args = parser.parse_args()
    results = {"cpu": {"skipped": "--modelled-only"} if args.modelled_only else cpu(), "modelled": modelled()}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    report(results)
    print(f"\nwritten to {args.json}")


def cpu() -> dict:
    """Ulysses degree 2 on two CPU ranks against one process (the runtime's own parity check)."""
    from bench.support.parallel_cpu import ulysses2_parity  # the runtime's bench helper; spawns gloo ranks

    parity = ulysses2_parity(variants=("wan_t2v",), tiers=("none", "block_swap"))
    return {"ulysses2": {"max_abs_diff": parity["max_abs_diff"], "seconds": parity["seconds"], "runs": parity["runs"]}}


def modelled() -> dict:
    from vidmem.memory.plan.parallel import INTERCONNECTS, MultiGpu, plan_parallel, sequence_tokens
    from vidmem.memory.plan.planner import VideoShape
    from vidmem.memory.strategy import MemoryStrategy
    from vidmem.pipelines.configs import load_model

    results = {}
    for name, (width, height, frames) in CASES:
        model, shape = load_model(name), VideoShape(width, height, frames)
        tokens = sequence_tokens(model, shape)
        for gpus in GPU_COUNTS:
            plans = {link: plan_parallel(model, shape, MemoryStrategy(), MultiGpu(gpus, "ulysses", INTERCONNECTS[link]))
                     for link in ("pcie4", "nvlink")}
            plan, rank = plans["pcie4"], plans["pcie4"].gpus[0]
            results[f"{name}@{width}x{height}x{frames}:{gpus}gpu"] = {
                "per_gpu_peak_bytes": plan.per_gpu_peak_bytes, "speedup": plan.speedup,
                "speedup_nvlink": plans["nvlink"].speedup, "seconds": round(plan.seconds, 1),
                "single_gpu_seconds": round(plan.single_seconds, 1),
                "denoise_weights_bytes": rank.weights_bytes, "denoise_activation_bytes": rank.denoise_activation_bytes,
                "nccl_bytes": rank.comm_bytes, "peak_stage": max(rank.stages, key=lambda s: s.device_bytes).name,
                "all_to_all_bytes_per_pass": plan.comm.total, "comm_seconds": round(plan.comm_seconds, 1),
                "tokens": tokens, "tokens_per_rank": tokens // gpus, "ram_bytes_all_ranks": plan.host_bytes,
                "strategy": plan.strategy.describe(), "interconnect": plan.layout.interconnect.name,
            }
    return results


def report(results: dict) -> None:
    from vidmem.memory.units import GiB

    parity = results["cpu"].get("ulysses2")
    if parity:
        print(f"CPU, Ulysses degree 2 on gloo vs one process: max |diff| {parity['max_abs_diff']:.3g} over "
              f"{', '.join(parity['runs'])}; {parity['seconds']:.1f} s for the first run (starting the ranks included)\n")
    else:
        print("CPU parity skipped (--modelled-only)\n")
    header = ("case", "GPUs", "peak/GPU", "weights", "activations", "NCCL", "a2a/pass", "time", "x PCIe4", "x NVLink")
    rows = [header]
    for key, row in results["modelled"].items():
        case, gpus = key.rsplit(":", 1)
        rows.append((case, gpus.removesuffix("gpu"), f"{row['per_gpu_peak_bytes'] / GiB:.1f} GiB",
                     f"{row['denoise_weights_bytes'] / GiB:.1f} GiB", f"{row['denoise_activation_bytes'] / GiB:.2f} GiB",
                     f"{row['nccl_bytes'] / GiB:.2f} GiB", f"{row['all_to_all_bytes_per_pass'] / 1e9:.1f} GB",
                     f"{row['seconds']:.0f} s", f"x{row['speedup']:.2f}", f"x{row['speedup_nvlink']:.2f}"))
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(header))]
    for r in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())
    print("\nPlanned on meta (bf16, 50 steps, guidance; model offload, text encoder off the GPU after encoding). "
          "Weights are replicated on every GPU; activations are the traced per-rank denoise peak including the "
          "all-to-all buffers; time = per-rank compute at 80 TFLOP/s + all-to-all bytes at 25 GB/s (PCIe 4.0 x16) "
          "or 300 GB/s (NVLink); text encoding and decode are not split.")


if __name__ == "__main__":
    main()
