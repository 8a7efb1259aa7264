"""Planner benchmark: how long a full plan takes, what memoisation buys, and the published check.

Four parts, written as JSON:
- `cold_cli`: wall time of `vidmem plan --model wan2.1-t2v-14b --size 1280x720 --frames 81
  --vram 12 --ram 64`, each run a fresh process (interpreter, imports, planning, its advice, the
  table), in a new plan cache folder: the first run with the cache empty (everything measured on
  `meta`), then the median of `--cli-runs` more with the cache it wrote; with the load average.
- `timing`: a full plan (all four tiers, each with its fewest swapped blocks, text encoder
  placement and VAE tiling) for Wan 2.1 T2V 14B at 1280x720, 81 frames, 12 GiB VRAM, 64 GiB RAM,
  in a fresh model (nothing memoised, no disk cache), after the libraries are imported; then the same call
  again on the warm model. Library import time is reported separately.
- `memoisation`: one denoise step of the 14B traced with 2 blocks (what the planner does) vs all
  40 (same peak, to show blocks are interchangeable), and one untiled VAE decode trace with and
  without the op cache (same trace).
- `published`: the plan next to published peak figures, each with its source and the settings the
  source leaves unstated: CogVideoX-2b 720x480x49 (diffusers docs), HunyuanVideo 1.5 (its README's
  minimum with model offloading). LTX-2 has none yet: no first-hand published peak was found.

    python bench/planner.py --json bench/results/planner.json

About 60-90 s on 2 shared cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
from bench.support.checkout import use_this_checkout  # noqa: E402

use_this_checkout()  # `import vidmem` is this clone, installed or not

from vidmem.memory.units import GiB  # noqa: E402

if TYPE_CHECKING:  # imported where used: main() times the CLI before this process imports torch
    from vidmem.memory import MemoryStrategy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "planner.json")
    parser.add_argument("--cli-runs", type=int, default=5, help="fresh `vidmem plan` processes with the cache written")
    args = parser.parse_args()
    cli = cold_cli(args.cli_runs)  # first: the subprocesses must not share the CPU with this one's imports
    started = time.perf_counter()
    import diffusers  # noqa: F401  (the planner builds diffusers/transformers classes on meta)
    import torch
    import transformers  # noqa: F401

    torch.set_num_threads(1)
    imports = time.perf_counter() - started
    results = {"cold_cli": cli, "imports_seconds": round(imports, 2), "timing": timing(), "memoisation": memoisation(),
               "published": published()}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    report(results)
    print(f"\nwritten to {args.json}")


CLI_ARGS = ("plan", "--model", "wan2.1-t2v-14b", "--size", "1280x720", "--frames", "81", "--vram", "12", "--ram", "64")


def cold_cli(runs: int) -> dict:
    """Wall seconds of fresh `vidmem plan` processes: one with an empty plan cache, then `runs` with it written."""
    code = ("import sys; from bench.support.checkout import use_this_checkout; use_this_checkout(); "
            "from vidmem.cli import main; raise SystemExit(main(sys.argv[1:]))")
    with tempfile.TemporaryDirectory() as folder:
        env = {**os.environ, "VIDMEM_PLAN_CACHE": "1", "VIDMEM_CACHE_DIR": folder}
        seconds = []
        for _ in range(runs + 1):
            started = time.perf_counter()
            done = subprocess.run([sys.executable, "-c", code, *CLI_ARGS], cwd=ROOT, env=env, capture_output=True, text=True)
            seconds.append(time.perf_counter() - started)
            if done.returncode not in (0, 1):  # 1: nothing fits 12 GiB (the advice is part of the answer)
                raise RuntimeError(f"vidmem plan failed ({done.returncode}): {done.stderr[-2000:]}")
    warm = statistics.median(seconds[1:]) if runs else None
    return {"command": "vidmem " + " ".join(CLI_ARGS), "empty_cache_seconds": round(seconds[0], 2),
            "cached_seconds": [round(s, 2) for s in seconds[1:]],
            "cached_median_seconds": None if warm is None else round(warm, 2),
            "under_3_s": warm is not None and warm < 3, "cpus": os.cpu_count(),
            "load_average": [round(x, 2) for x in os.getloadavg()]}


def timing() -> dict:
    from vidmem.memory.plan.planner import VideoShape, candidate_plans, recommended
    from vidmem.pipelines.configs import _from_json, MODELS_DIR

    data = json.loads((MODELS_DIR / "wan2.1-t2v-14b.json").read_text())
    model = _from_json(data, None, disk_cache=False)  # a fresh model: nothing memoised, nothing read from disk
    shape = VideoShape(1280, 720, 81)
    started, cpu = time.perf_counter(), time.process_time()
    plans = candidate_plans(model, shape, 12 * GiB, 64 * GiB)
    cold, cold_cpu = time.perf_counter() - started, time.process_time() - cpu
    started = time.perf_counter()
    candidate_plans(model, shape, 12 * GiB, 64 * GiB)
    warm = time.perf_counter() - started
    best = recommended(plans)
    return {
        "model": "wan2.1-t2v-14b", "size": "1280x720", "frames": 81, "vram_gib": 12, "ram_gib": 64,
        "full_plan_seconds": round(cold, 2), "full_plan_cpu_seconds": round(cold_cpu, 2),
        "warm_plan_seconds": round(warm, 2), "under_5_s": cold < 5,
        "rows": [p.as_dict() for p in plans], "recommended": best,
    }


def memoisation() -> dict:
    from vidmem.memory.accounting import OpCache, trace
    from vidmem.memory.plan.planner import VideoShape
    from vidmem.pipelines.configs import load_model
    from vidmem.pipelines.configs.meta import build_meta
    from vidmem.pipelines.configs.workloads import decode, wan_step
    import torch

    model = load_model("wan2.1-t2v-14b")
    shape, latent = VideoShape(1280, 720, 81), model.latent_shape(VideoShape(1280, 720, 81))
    rows = {}
    for label, blocks in (("2_blocks", 2), ("40_blocks", None)):
        module = build_meta(model.components["transformer"], model.dtype, blocks)
        started = time.perf_counter()
        step = trace(wan_step(module, latent, shape, model.dtype, 0, None, False))
        rows[f"denoise_{label}"] = {"seconds": round(time.perf_counter() - started, 2), "peak_gib": round(step.peak_bytes / GiB, 3)}
    vae = model.traced_module("vae")
    piece = torch.empty(latent, dtype=model.dtype, device="meta")
    for label, cache in (("decode_without_op_cache", None), ("decode_with_op_cache", OpCache())):
        started = time.perf_counter()
        result = trace(decode(vae, piece, False), cache=cache)
        rows[label] = {"seconds": round(time.perf_counter() - started, 2), "peak_gib": round(result.peak_bytes / GiB, 3)}
    return rows


@dataclass(frozen=True)
class PublishedFigure:
    """A peak-memory figure a model's authors or a library's docs publish, and the plan we set beside
    it: the model, the shot and the strategy as close as the source states them; what it leaves
    unstated is named in `settings`, so a gap to the plan is read with that in mind."""

    model: str  # a built-in model (`vidmem plan --list-models`)
    shape: tuple[int, int, int]  # width, height, frames the plan is made at
    case: str
    strategy: MemoryStrategy
    figure: str  # as published
    source: str  # where, with its words
    settings: str  # what the source says of resolution, frames, offload; "unknown" where it says nothing


def published_figures() -> list[PublishedFigure]:
    from vidmem.memory import MemoryStrategy, VaeTiling

    docs = "diffusers' CogVideoX docs, \"Memory optimization\" (CogVideoX-2b, 50 steps, fp16)"
    cog, cog_settings = (720, 480, 49), "720x480, 49 frames, fp16"
    hunyuan = ("github.com/Tencent-Hunyuan/HunyuanVideo-1.5 README, System Requirements: \"Minimum GPU Memory: "
               "14 GB (with model offloading enabled)\"")
    hunyuan_settings = ("resolution, frames and the attention kernel unstated in the README; its own inference code "
                        "(generate.py, hyvideo/pipelines/hunyuan_video_pipeline.py), not diffusers: under 60 GiB of GPU "
                        "memory --offloading (default on) means group offloading, one transformer block per group on a "
                        "side stream (vidmem's block swap), not whole-model offload; under 28 GiB the VAE decodes 128 px "
                        "spatial tiles, overlap 0.25, in fp16 (get_vae_inference_config); PYTORCH_CUDA_ALLOC_CONF="
                        "expandable_segments:True; --sr (1080p super-resolution) on by default. Planned here with "
                        "model offload and diffusers' default tiling (256 px tiles): an upper bound, not Tencent's run; "
                        "docs/decode.md, 'HunyuanVideo 1.5 against its 14 GB'")
    return [
        PublishedFigure("cogvideox-2b", cog, "everything resident (pipe.to)",
                        MemoryStrategy(offload="none", text_encoder="device"), "33 GB", docs, cog_settings),
        PublishedFigure("cogvideox-2b", cog, "enable_model_cpu_offload", MemoryStrategy(offload="model"), "19 GB", docs,
                        cog_settings),
        PublishedFigure("cogvideox-2b", cog, "model offload + vae.enable_tiling",
                        MemoryStrategy(offload="model", vae_tiling=VaeTiling()), "11 GB", docs, cog_settings),
        PublishedFigure("cogvideox-2b", cog, "enable_sequential_cpu_offload + tiling",
                        MemoryStrategy(offload="sequential", prefetch_blocks=0, vae_tiling=VaeTiling()), "under 4 GB", docs,
                        cog_settings),
        PublishedFigure("hunyuanvideo1.5-t2v-480p", (848, 480, 121), "HunyuanVideo 1.5 480p, model offloading",
                        MemoryStrategy(offload="model", vae_tiling=VaeTiling()), "14 GB", hunyuan, hunyuan_settings),
        PublishedFigure("hunyuanvideo1.5-t2v-720p", (1280, 720, 121), "HunyuanVideo 1.5 720p, model offloading",
                        MemoryStrategy(offload="model", vae_tiling=VaeTiling()), "14 GB", hunyuan, hunyuan_settings),
    ]


def published() -> list[dict]:
    from vidmem.memory.plan.planner import PlanOptions, Runtime, VideoShape, plan_run
    from vidmem.pipelines.configs import load_model

    rows = []
    for entry in published_figures():
        model, shape = load_model(entry.model), VideoShape(*entry.shape)
        plan = plan_run(model, shape, entry.strategy, PlanOptions(runtime=Runtime.DIFFUSERS))
        peak = max(plan.stages, key=lambda s: s.reserved_bytes)
        allocated = max(plan.stages, key=lambda s: s.allocated_bytes)  # may be another stage than the reserved peak's
        rows.append({"model": entry.model, "shape": "x".join(map(str, entry.shape)), "case": entry.case,
                     "published": entry.figure, "source": entry.source, "settings": entry.settings,
                     "max_memory_allocated_gib": round(allocated.allocated_bytes / GiB, 2),
                     "allocated_stage": allocated.name,
                     "max_memory_reserved_gib": round(peak.reserved_bytes / GiB, 2),
                     "peak_stage": peak.name, "peak_at": peak.peak_phase.label,
                     "device_incl_context_gib": round(plan.peak_vram_bytes / GiB, 2)})
    return rows


def report(results: dict) -> None:
    c = results["cold_cli"]
    print(f"cold CLI ({c['command']}), fresh processes on {c['cpus']} CPUs, load {c['load_average']}:")
    print(f"  empty plan cache  {c['empty_cache_seconds']:6.2f} s")
    print(f"  cache written     {c['cached_median_seconds']:6.2f} s median of {c['cached_seconds']} "
          f"(under 3 s: {c['under_3_s']})")
    t = results["timing"]
    print(f"imports: {results['imports_seconds']} s")
    print(f"full plan, {t['model']} {t['size']}x{t['frames']}: {t['full_plan_seconds']} s cold "
          f"({t['full_plan_cpu_seconds']} s CPU), {t['warm_plan_seconds']} s warm (under 5 s: {t['under_5_s']})")
    for row in t["rows"]:
        print(f"  {row['tier']:<11} swap {row['blocks_to_swap']:>2}  tiling {str(row['vae_tiling']):<5} "
              f"VRAM {row['peak_vram_bytes'] / GiB:5.1f} GiB  RAM {row['peak_ram_bytes'] / GiB:5.1f} GiB  "
              f"x{row['est_slowdown']:.2f}  fits {row['fits']}")
    print("memoisation:")
    for label, row in results["memoisation"].items():
        print(f"  {label:<24} {row['seconds']:6.2f} s   peak {row['peak_gib']:.3f} GiB")
    print("published figures vs the plan (GiB; each row's source and unstated settings are in the JSON):")
    for row in results["published"]:
        print(f"  {row['model']:<25} {row['shape']:<13} {row['case']:<40} published {row['published']:<13} "
              f"allocated {row['max_memory_allocated_gib']:6.2f} ({row['allocated_stage']})  "
              f"reserved {row['max_memory_reserved_gib']:6.2f} ({row['peak_stage']}: {row['peak_at']})")


if __name__ == "__main__":
    main()
