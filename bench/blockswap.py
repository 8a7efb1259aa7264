"""Block swap benchmark: CPU wall time per tier, our sampler vs diffusers, and the modelled GPU cost.

Three parts, written as one evidence JSON:
- `cpu` (measured): one process, a mid-size Wan (the 1.3B widths, 6 blocks, fp32, random weights,
  the tiny text encoder and VAE from vidmem.pipelines.tiny), one `sample()` call per tier, rounds
  interleaved with the order rotated each round, median of `--runs` after an untimed warm-up round,
  and that every tier gives the tier-`none` latent bit for bit. On the CPU a tier adds only its
  hooks' bookkeeping, a few milliseconds, while other users of a shared machine move wall times by
  10-40%: so tier none is timed twice (the control row shows the noise floor), and the same
  variants run on a narrow model with the same modules, whose fastest runs give the bookkeeping
  in milliseconds (printed, not in the JSON).
- `sampler_vs_diffusers` (measured): vidmem's `sample()` at tier none vs the plain diffusers
  pipeline on the same modules, same seed, prompt and steps.
- `modelled` (NOT measured, no GPU here): per-block bytes and FLOPs of the published Wan 2.1 and
  CogVideoX transformers, built on the meta device, fed to `vidmem.memory.swap_model`.

    python bench/blockswap.py --json bench/results/blockswap.json

About 4 minutes on 2 shared cores; `--skip-cpu` runs only the modelled part (~20 s):

    python bench/blockswap.py --skip-cpu --json bench/results/blockswap_modelled.json

The parts live in bench/support/: blockswap_modelled.py, blockswap_cpu.py, blockswap_report.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # bench.support: the parts
os.environ.setdefault("HF_HUB_OFFLINE", "1")
from bench.support.checkout import use_this_checkout  # noqa: E402

use_this_checkout()  # `import vidmem` is this clone, installed or not

import torch  # noqa: E402

from bench.support.blockswap_cpu import MID_CHANGES, NARROW_CHANGES, evidence, time_cpu  # noqa: E402
from bench.support.blockswap_modelled import FAMILIES, MODELS, STEPS, bandwidth_sweep, measure, model_overheads, transformer_config  # noqa: E402
from bench.support.blockswap_report import plot, print_cpu, print_goals, print_modelled  # noqa: E402
from vidmem.memory.swap_model import GpuSpec  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the evidence JSON here")
    parser.add_argument("--png", type=Path, default=ROOT / "bench" / "results" / "blockswap_modelled.png")
    parser.add_argument("--runs", type=int, default=5, help="timed rounds (after one warm-up round)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (fixed, for stable timings)")
    parser.add_argument("--skip-cpu", action="store_true", help="only the modelled part")
    parser.add_argument("--pcie-gbps", type=float, default=25.0, help="effective host-to-device GB/s")
    parser.add_argument("--tflops", type=float, default=165.0, help="peak dense bf16 TFLOPS")
    parser.add_argument("--efficiency", type=float, default=0.5, help="fraction of peak the kernels reach")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gpu = GpuSpec(args.pcie_gbps * 1e9, args.tflops * 1e12, args.efficiency)
    started = time.perf_counter()
    measured = [measure(name, shape) for name in MODELS for shape in FAMILIES[transformer_config(name)[0]].shapes]
    overheads, sweep = model_overheads(measured, gpu), bandwidth_sweep(measured, gpu)
    print_modelled(measured, overheads, sweep, gpu)
    plot(args.png, measured, overheads, sweep, gpu)
    cpu = sampler = mid = narrow = None
    if not args.skip_cpu:
        print(f"\nCPU part: threads={args.threads}, load average {os.getloadavg()[0]:.1f} at start", flush=True)
        mid = time_cpu(MID_CHANGES, args.runs)
        cpu, sampler = evidence(mid)
        narrow = time_cpu(NARROW_CHANGES, 4 * args.runs)
        print_cpu(mid, narrow)
        print(f"load average {os.getloadavg()[0]:.1f} at end")
    print_goals(cpu, sampler, overheads, mid, narrow)
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    if args.json:
        write_json(args.json, cpu, sampler, overheads, sweep, gpu)


def write_json(path: Path, cpu: dict | None, sampler: dict | None, overheads: dict, sweep: dict, gpu: GpuSpec) -> None:
    """Issue 3's evidence format, plus the modelled GPU's rates and the PCIe sweep the README quotes."""
    report = {"cpu": cpu or {}, "sampler_vs_diffusers": sampler or {},
              "modelled": {key: {"overhead": value} for key, value in overheads.items()},
              "modelled_gpu": {"pcie_bytes_per_s": gpu.pcie_bytes_per_s, "peak_flops": gpu.peak_flops,
                               "achieved_fraction": gpu.achieved_fraction, "steps": STEPS},
              "modelled_bandwidth_sweep": sweep}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
