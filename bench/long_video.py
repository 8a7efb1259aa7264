"""Long videos with context windows (issue 26): the plan and a CPU run follow the window, not the clip.

Three parts, written as JSON:
- `plans`: for Wan 2.1 T2V 14B and 1.3B and Wan 2.2 I2V A14B at 832x480 (161 frames in windows of 81
  sharing 16, against 81 frames alone) and CogVideoX-5b at 720x480 (97 frames in windows of 49 sharing
  16, against 49 alone): the planner's denoise and overall peak VRAM under sequential (activations
  dominate: the window shows) with the decode tiled in time, and the recommended plan on an 8 GiB card
  with 32 GiB of RAM. The issue's bar: the windowed plan peaks within 10% of the window's plan.
- `run`: vidmem's sampler on the CPU (a tiny Wan pipeline whose transformer is widened to dim 256 and a
  feed-forward of 1,024 so that activations, not the process, set the peak), 256x256, 1 step, no
  guidance, each case in a fresh process whose glibc returns freed blocks at once: the peak RSS above
  where sample() started for 81 frames, 161 frames in windows of 81/16, and 161 frames at once.
- `equality`: the same widened transformer's forward over 9 latent frames in windows of 5 sharing 1:
  the latent frames only one window covers equal that window's forward alone, bit for bit.

    python bench/long_video.py --json bench/results/long-video-cpu-2026-11-26.json

About 3 minutes on 2 shared cores (--skip-run for the plans only: an existing file's `run` and
`equality` parts are kept, and the file says they come from an earlier full run).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VIDMEM_PLAN_CACHE", "0")  # measure, never read an older cache
from bench.support.checkout import use_this_checkout  # noqa: E402

use_this_checkout()  # `import vidmem` is this clone, installed or not

import torch  # noqa: E402

from vidmem.memory.units import GiB  # noqa: E402

PLAN_CASES = (("wan2.1-t2v-14b", 832, 480, 161, 81), ("wan2.1-t2v-1.3b", 832, 480, 161, 81),
              ("wan2.2-i2v-a14b", 832, 480, 161, 81), ("cogvideox-5b", 720, 480, 97, 49))
OVERLAP = 16
CARD_GIB, RAM_GIB = 8, 32
RUN_SIZE, RUN_CASES = 256, (("window", 81, 0, 0), ("windowed", 161, 81, OVERLAP), ("clip", 161, 0, 0))
WIDE_WAN = dict(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=64, in_channels=16, out_channels=16,
                text_dim=32, freq_dim=256, ffn_dim=1024, num_layers=2, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", rope_max_seq_len=1024)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "long-video-cpu-2026-11-26.json")
    parser.add_argument("--skip-run", action="store_true", help="plans only")
    parser.add_argument("--run-case", help=argparse.SUPPRESS)  # internal: one measured run in this process
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run_case:
        print(json.dumps(run_case(args.folder, args.run_case)))
        return
    results = {"machine": machine(), "plans": plans()}
    if args.skip_run:
        results.update(kept_measurements(args.json))
    else:
        with tempfile.TemporaryDirectory() as folder:
            wide_pipeline(Path(folder))
            results["run"] = {name: measured(Path(folder), name) for name, *_ in RUN_CASES}
            window, windowed = results["run"]["window"], results["run"]["windowed"]
            results["run_windowed_over_window"] = windowed["peak_growth_bytes"] / window["peak_growth_bytes"]
            results["equality"] = equality(Path(folder))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    report(results)


MEASURED = ("run", "run_windowed_over_window", "equality")  # what --skip-run does not measure again


def kept_measurements(path: Path) -> dict:
    """With --skip-run, the measured parts of the file being rewritten (a re-plan must not erase the
    CPU run it does not repeat), and a note saying they were not measured with these plans."""
    earlier = json.loads(path.read_text()) if path.exists() else {}
    kept = {key: earlier[key] for key in MEASURED if key in earlier}
    if kept:
        kept["measured_earlier"] = (f"plans re-planned on {datetime.date.today()} with --skip-run; "
                                    f"{', '.join(k for k in MEASURED if k in kept)} kept from the earlier full run")
    return kept


def machine() -> dict:
    return {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "torch": torch.__version__,
            "threads": torch.get_num_threads()}


def plans() -> list[dict]:
    from vidmem.memory import MemoryStrategy
    from vidmem.memory.plan.candidates import candidate_plans, plan_run, recommended
    from vidmem.memory.plan.types import PlanOptions, VideoShape
    from vidmem.memory.strategy import VaeTiling
    from vidmem.pipelines.configs import load_model

    rows = []
    sequential = MemoryStrategy(offload="sequential", activation_chunks=1, vae_tiling=VaeTiling())
    for name, width, height, frames, window in PLAN_CASES:
        model = load_model(name, None, None)
        shapes = {"one_window": VideoShape(width, height, window),
                  "windowed": VideoShape(width, height, frames, window=window, window_overlap=OVERLAP),
                  "clip": VideoShape(width, height, frames)}
        row = {"model": name, "size": [width, height], "frames": frames, "window": window, "overlap": OVERLAP}
        for label, shape in shapes.items():
            plan = plan_run(model, shape, sequential, PlanOptions(steps=30))
            found = candidate_plans(model, shape, CARD_GIB * GiB, RAM_GIB * GiB, MemoryStrategy(), PlanOptions(steps=30))
            best = recommended(found)
            row[label] = {"sequential_denoise_gib": plan.stage("denoise").device_bytes / GiB,
                          "sequential_peak_gib": plan.peak_vram_bytes / GiB,
                          "sequential_decode_gib": plan.stage("decode").device_bytes / GiB,
                          "recommended": found[best].strategy.describe() if best is not None else None,
                          "recommended_peak_gib": found[best].peak_vram_bytes / GiB if best is not None else None}
        row["windowed_over_window"] = row["windowed"]["sequential_peak_gib"] / row["one_window"]["sequential_peak_gib"]
        rows.append(row)
    return rows


def wide_pipeline(folder: Path) -> None:
    """The tiny Wan T2V pipeline saved with a wider transformer (seeded random weights)."""
    from diffusers import WanTransformer3DModel

    from vidmem.pipelines.tiny import save_tiny_pipeline

    save_tiny_pipeline("wan2.1-t2v", folder)
    torch.manual_seed(0)
    WanTransformer3DModel(**WIDE_WAN).save_pretrained(folder / "transformer")


def measured(folder: Path, name: str) -> dict:
    """One case in a fresh process whose allocator returns every freed block (see bench/support/memwatch.py)."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    command = [sys.executable, __file__, "--run-case", name, "--folder", str(folder)]
    done = subprocess.run(command, env=env, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_case(folder: Path, name: str) -> dict:
    from bench.support.memwatch import peak_growth
    from vidmem.memory import MemoryStrategy
    from vidmem.memory.device import CpuBackend
    from vidmem.pipelines.loader import load_pipeline
    from vidmem.pipelines.sample import SampleRequest, sample

    frames, window, overlap = next((f, w, o) for case, f, w, o in RUN_CASES if case == name)
    loaded = load_pipeline(folder, "fp32")
    request = SampleRequest("a cat", "", RUN_SIZE, RUN_SIZE, frames, 1, 1.0, 0, window=window, window_overlap=overlap)
    warm = SampleRequest("a cat", "", 32, 32, 9, 1, 1.0, 0)
    sample(loaded, MemoryStrategy(offload="none"), warm, backend=CpuBackend())  # first-call allocations, untimed
    out = {}

    def call():
        out["result"] = sample(loaded, MemoryStrategy(offload="none"), request, backend=CpuBackend())

    growth = peak_growth(call)
    receipt = out["result"].receipt
    return {"frames": frames, "window": window, "overlap": overlap, "peak_growth_bytes": growth,
            "denoise_seconds": receipt["stages"][-1]["seconds"], "windows": receipt.get("windows", {}).get("windows")}


def equality(folder: Path) -> dict:
    """Frames one window alone covers equal that window's own forward, bit for bit."""
    from diffusers import WanTransformer3DModel

    from vidmem.memory.windows import WindowSchedule
    from vidmem.pipelines.context_windows import context_windows, window_call

    transformer = WanTransformer3DModel.from_pretrained(folder / "transformer").eval()
    generator = torch.Generator().manual_seed(0)
    call = {"hidden_states": torch.randn(1, 16, 9, 16, 16, generator=generator), "timestep": torch.tensor([500]),
            "encoder_hidden_states": torch.randn(1, 8, 32, generator=generator), "return_dict": False}
    schedule = WindowSchedule(9, 5, 1)  # windows 0-5 and 4-9
    with torch.no_grad():
        with context_windows({"transformer": transformer}, "wan", schedule):
            blended = transformer(**call)[0]
        alone = [transformer(**window_call(call, 2, start, stop, 9))[0] for start, stop in schedule.spans]
    first = torch.equal(blended[:, :, :4], alone[0][:, :, :4])
    last = torch.equal(blended[:, :, 5:], alone[1][:, :, 1:])
    return {"windows": schedule.describe(), "first_window_only_frames_equal": first,
            "last_window_only_frames_equal": last,
            "shared_frame_max_difference_from_first": float((blended[:, :, 4] - alone[0][:, :, 4]).abs().max())}


def report(results: dict) -> None:
    print(f"{'model':18} {'frames':>6} {'window':>6}  {'seq. peak window':>16} {'seq. peak windowed':>18} "
          f"{'seq. peak clip':>14}  ratio")
    for row in results["plans"]:
        print(f"{row['model']:18} {row['frames']:>6} {row['window']:>6}  {row['one_window']['sequential_peak_gib']:>14.2f} G "
              f"{row['windowed']['sequential_peak_gib']:>16.2f} G {row['clip']['sequential_peak_gib']:>12.2f} G  "
              f"x{row['windowed_over_window']:.3f}")
    if "run" in results:
        for name, run in results["run"].items():
            print(f"CPU run {name:8} {run['frames']:>4} frames: peak +{run['peak_growth_bytes'] / 2**20:.1f} MiB, "
                  f"denoise {run['denoise_seconds']:.1f} s, windows {run['windows']}")
        print(f"windowed / window peak: x{results['run_windowed_over_window']:.3f}; equality: {results['equality']}")


if __name__ == "__main__":
    main()
