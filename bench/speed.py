"""Speed benchmark (issues 23 and 24): the step cache, attention kernels, compiled blocks and fp8 matmul, per tier.

Parts (`--parts`, all by default): `cache` (below), `attention` (bench/support/speed_attention.py: every kernel this
device runs against eager SDPA, time_ratio and max_abs_diff per tier), `attention_call` (the same module: one
attention call per kernel at the video size, no sampler around it), `compile` (bench/support/speed_compile.py:
step_time_ratio, recompiles_second_run and compile_seconds per tier against eager), `fp8_matmul`
(bench/support/speed_fp8.py: time_ratio and psnr_db against the upcast path, fp8_scaled weights) and `goal`
(bench/support/speed_goal.py: issue 24's goal, compiled blocks with the best kernel and fp8 matmul off and on
against eager SDPA with fp8 weights upcast, per tier, with the verdicts). Each part's JSON key is its name.
`--model wan2.1-t2v-14b` gives the parts other than cache 14B-wide blocks on CUDA (40 heads of 128, feed-forward
13,824: attention a smaller share of a step than at the 1.3B's width).

The cache part: blocks computed, weight copies made, time and PSNR per cache method and tier.

A 50-step Wan 2.1 1.3B-shaped sampler (30 blocks, random weights, the tiny text encoder and VAE from
vidmem.pipelines.tiny; narrow widths on the CPU, the 1.3B's own in bf16 on CUDA), through
`sample()` on the device's real backend, with each cache method:

- `off`: the uncached run every ratio is taken against;
- `mag_cache`: MagCache with the published Wan 2.1 T2V 1.3B ratios (pipelines/configs/mag_ratios.json)
  at their published threshold 0.12, K 4 and retention 0.2, passed directly (the random model's
  layout key is not the 1.3B's, so 'auto' would not find them);
- `first_block_cache` at diffusers' default threshold 0.05, and `first_block_cache_bold` (`--fbc-bold`);
- `taylor_seer`: TaylorSeer (diffusers' lite mode) at diffusers' defaults, interval 5, warm-up 3, order 1;

under each tier: none, block_swap of half the blocks and of all of them, sequential (prefetch 1).
One audited call per method and tier gives the counts: blocks computed (receipt), streamed copies
(the engine's observer; checked against the receipt) and which copies were wasted (evicted before
any leaf of their group computed). Then every method runs again under the timed tiers (`none` on the
CPU), rounds interleaved with the order rotated, after an untimed warm-up round.

Per method, against the uncached run (`--json PATH`, key `cache`): blocks_ratio, copies_ratio (per
streamed tier in copies_ratio_by_tier; the worst as copies_ratio), time_ratio (median wall time at
the first timed tier), psnr_db (the cached latent against the uncached one, over the uncached
latent's range; the random VAE would add nothing by decoding) and tiers_bitwise_equal (every tier's
latent equals tier none's with the same cache). The goals' verdicts go in `goals`.

Caveats, also in the JSON: on the CPU no weight is copied (the schedule still counts what it would
copy), so a CPU time ratio reflects compute saved, not copies. Random weights do not represent real
skip rates or quality for output-driven methods (First Block Cache decides from how much its first
block's output changed); MagCache's skips depend only on its ratios and the step count, so its
blocks_ratio is the real one for 50 steps, but its PSNR is not. bench/cache_quality.py measures both
on a tiny Wan trained in the bench (docs/step-cache.md, Quality).

    python bench/speed.py --parts cache --runs 3 --json bench/results/speed-cpu-2026-11-26.json  # 2-6 min on 2 cores, by load
    python bench/speed.py --steps 8 --blocks 4 --runs 1                     # seconds
    python bench/speed.py --device cuda --json bench/results/speed-gpu.json
    python bench/speed.py --parts attention,compile --steps 8 --runs 3     # one or more parts only
    python bench/speed.py --device cuda --parts compile --size 832x480x81 --blocks 4 --steps 2 --runs 3 \
        --compile-tiers none,block_swap_4                                   # compiled blocks at 480p (gpu_check.sh)
    python bench/speed.py --parts compile --steps 4 --blocks 4 --runs 2 --compile-tiers none,none+lora  # with a LoRA
    python bench/speed.py --device cuda --parts goal --size 832x480x81 --blocks 4 --steps 2 --runs 2  # the 1.5x goal
    python bench/speed.py --device cuda --parts goal --model wan2.1-t2v-14b --size 832x480x81 --blocks 4 --steps 2 \
        --runs 2                                                            # the same on 14B-wide blocks
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # bench.support: the parts
os.environ.setdefault("HF_HUB_OFFLINE", "1")
from bench.support.checkout import use_this_checkout  # noqa: E402

use_this_checkout()  # `import vidmem` is this clone, installed or not

import torch  # noqa: E402

from bench.support.speed_report import evidence, goals, print_goals, print_tables  # noqa: E402
from bench.support.speed_attention import attention_rows, call_rows  # noqa: E402
from bench.support.speed_compile import LORA, LORA_RANK, chosen_tiers, compile_rows  # noqa: E402
from vidmem.pipelines.compile import CompileSettings  # noqa: E402
from vidmem.pipelines.speed import cpu_name  # noqa: E402
from bench.support.speed_fp8 import fp8_rows  # noqa: E402
from bench.support.speed_goal import goal_rows, row_names_of  # noqa: E402
from bench.support.speed_runs import MODEL, WIDTH_MODELS, SpeedConfig, build, count_pass, tiers, time_pass  # noqa: E402

PARTS = ("cache", "attention", "attention_call", "compile", "fp8_matmul", "goal")
CAVEATS = [
    "Random weights: First Block Cache decides from its first block's output, so its skip rate and every "
    "method's PSNR here say nothing about a real model; MagCache's skips depend only on the published ratios and "
    "the step count, so its blocks_ratio is the real one at that step count. bench/cache_quality.py measures skip "
    "rates and PSNR on a trained tiny model instead.",
    "On the CPU nothing is copied (the schedule counts what it would copy): a CPU time_ratio reflects compute "
    "saved, not copies saved.",
    "Each call starts cold (warm-run device copies released), so every call of a tier copies the same way.",
]


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, SpeedConfig]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the evidence JSON here")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--blocks", type=int, default=30, help="transformer blocks (Wan 2.1 1.3B has 30)")
    parser.add_argument("--model", choices=WIDTH_MODELS, default=MODEL, help="the transformer whose config the blocks "
                        "have, and on CUDA whose widths (the 1.3B's 12 x 128 heads, feed-forward 8,960; the 14B's "
                        "40 x 128, 13,824); the cache part runs the 1.3B only (its published MagCache ratios)")
    parser.add_argument("--heads", type=int, default=2, help="attention heads (CPU; CUDA uses the model's)")
    parser.add_argument("--head-dim", type=int, default=32, help="width of a head (CPU; CUDA uses the model's)")
    parser.add_argument("--ffn", type=int, default=256, help="feed-forward width (CPU; CUDA uses the model's)")
    parser.add_argument("--size", default=None, help="video WxHxF (default 64x64x5 on the CPU, 480x320x17 on CUDA)")
    parser.add_argument("--runs", type=int, default=None, help="timed rounds after a warm-up (default 5 CPU, 3 CUDA)")
    parser.add_argument("--time-tiers", default=None, help="tiers timed, comma-separated (default none on the CPU, "
                        "none and block_swap of all blocks on CUDA); '' times nothing")
    parser.add_argument("--fbc-bold", type=float, default=0.1, help="First Block Cache's bolder threshold")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on the CPU (fixed, for stable timings)")
    parser.add_argument("--machine", default="", help="a note on the machine, for the JSON")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend of the compile part "
                        "(aot_eager: dynamo's tracing and guards without code generation, for a quick check)")
    parser.add_argument("--compile-tiers", default="", help="tiers of the compile part, comma-separated (default every "
                        "one: none, block_swap of half and of all blocks, sequential; the compile part also takes each "
                        "as <tier>+lora, with a random LoRA of --lora-rank on every block's linear layers), and of the "
                        "goal part (default none and block_swap of all blocks)")
    parser.add_argument("--lora-rank", type=int, default=LORA_RANK, help="rank of the compile part's LoRA on "
                        "+lora tiers")
    parser.add_argument("--goal-rows", default="", help="rows of the goal part, comma-separated, measured in the "
                        "order given (default all: sage+fp8_off, auto+fp8_off, sage+fp8_on, auto+fp8_on)")
    args = parser.parse_args(argv)
    if args.device != "cpu" and not torch.cuda.is_available():  # refused before minutes of building and compiling
        parser.error(f"--device {args.device}: torch sees no CUDA device here; use --device cpu (the default) for the "
                     "CPU run of the same parts")
    unknown = set(args.parts.split(",")) - set(PARTS)
    if unknown:
        parser.error(f"--parts {args.parts!r}: {', '.join(sorted(unknown))} not among {', '.join(PARTS)}")
    if "cache" in args.parts.split(",") and args.model != MODEL:
        parser.error(f"--model {args.model}: the cache part runs {MODEL} only (MagCache's published ratios are its); "
                     f"choose --parts without cache, or --model {MODEL}")
    args.compile_tiers = tuple(t for t in args.compile_tiers.split(",") if t)
    args.goal_rows = tuple(r for r in args.goal_rows.split(",") if r)
    try:
        row_names_of(args.goal_rows)
    except ValueError as error:
        parser.error(f"--goal-rows {','.join(args.goal_rows)!r}: {error}")
    try:
        chosen_tiers(args.blocks, args.compile_tiers, lora="goal" not in args.parts.split(","))
    except ValueError as error:
        parser.error(str(error) + ("; +lora tiers are the compile part's only" if LORA in ",".join(args.compile_tiers)
                                   else ""))
    if args.lora_rank < 1:
        parser.error(f"--lora-rank {args.lora_rank}: a LoRA's rank is 1 or more")
    cuda = args.device != "cpu"
    width, height, frames = (int(v) for v in (args.size or ("480x320x17" if cuda else "64x64x5")).split("x"))
    timed = args.time_tiers if args.time_tiers is not None else (f"none,block_swap_{args.blocks}" if cuda else "none")
    config = SpeedConfig(steps=args.steps, blocks=args.blocks, heads=args.heads, head_dim=args.head_dim, ffn=args.ffn,
                         width=width, height=height, frames=frames, device=args.device,
                         runs=args.runs if args.runs is not None else (3 if cuda else 5),
                         time_tiers=tuple(t for t in timed.split(",") if t), fbc_bold=args.fbc_bold, real_widths=cuda,
                         model=args.model)
    return args, config


def main(argv: list[str] | None = None) -> dict:
    args, config = parse(argv)
    if config.device == "cpu":
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    print(f"speed bench: {config.describe()}, load average {os.getloadavg()[0]:.1f}", flush=True)
    loaded = build(config)
    parts = args.parts.split(",")
    result = {"bench": "speed", "config": config.describe(), "machine": machine(args), "caveats": CAVEATS, "parts": parts}
    if "cache" in parts:
        result.update(cache_part(loaded, config))
    if "attention" in parts:
        print("\nattention kernels against eager SDPA", flush=True)
        result["attention"] = attention_rows(loaded, config, tiers(config.blocks))
        print(json.dumps(result["attention"], indent=1))
    if "attention_call" in parts:
        print("\none attention call per kernel at the model's real width", flush=True)
        result["attention_call"] = call_rows(config)
        print(json.dumps(result["attention_call"], indent=1))
    if "compile" in parts:
        print("\ncompiled blocks against eager", flush=True)
        result["compile"] = compile_rows(loaded, config, CompileSettings(True, backend=args.compile_backend),
                                         tier_names=args.compile_tiers, lora_rank=args.lora_rank,
                                         on_row=lambda found: write_json(args.json, {**result, "compile": found,
                                                                                     "partial": True}))
        print(json.dumps(result["compile"], indent=1))
    if "fp8_matmul" in parts:
        print("\nfp8 matmul against the upcast path (fp8_scaled weights)", flush=True)
        result["fp8_matmul"] = fp8_rows(loaded, config)
    if "goal" in parts:
        print("\nthe goal: compiled blocks, the best kernel, fp8 matmul against eager SDPA with fp8 weights upcast", flush=True)
        result["goal"] = goal_rows(loaded, config, CompileSettings(True, backend=args.compile_backend),
                                   tier_names=args.compile_tiers, row_names=args.goal_rows,
                                   on_row=lambda found: write_json(args.json, {**result, "goal": found, "partial": True}))
    result["wall_seconds"] = round(time.perf_counter() - started, 1)
    print(f"\ntotal {result['wall_seconds']:.0f} s, load average {os.getloadavg()[0]:.1f} at end")
    if args.json:
        write_json(args.json, result)
        print(f"wrote {args.json}")
    return result


def write_json(path: Path | None, result: dict) -> None:
    """The evidence so far, replaced whole (a part that writes as it goes leaves a complete file if cut short)."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(result, indent=1))
    partial.replace(path)


def cache_part(loaded, config: SpeedConfig) -> dict:
    """The step cache's rows (`cache`) and the verdicts on its goals (`goals`)."""
    calls = count_pass(loaded, config)
    times = None
    if config.time_tiers:
        print(f"timing {len(config.time_tiers)} tier(s): {config.runs} interleaved rounds after a warm-up", flush=True)
        times = time_pass(loaded, config)
    report = evidence(calls, times, config)
    verdicts = goals(report, config)
    print_tables(report, config)
    print_goals(verdicts)
    for caveat in CAVEATS:
        print(f"caveat: {caveat}")
    return {"cache": report, "goals": verdicts}


def machine(args: argparse.Namespace) -> dict:
    import diffusers

    found = {"note": args.machine, "platform": platform.platform(), "cpu": cpu_name(), "cores": os.cpu_count(),
             "threads": args.threads, "torch": torch.__version__, "diffusers": diffusers.__version__}
    if args.device != "cpu":
        found["gpu"] = torch.cuda.get_device_name()
    return found


if __name__ == "__main__":
    main()
