"""Step cache quality on a trained signal (issue 23): blocks computed and PSNR against the uncached run.

bench/speed.py's cache part measures the caches on a random-weight Wan, whose outputs have no
structure: it cannot say how often First Block Cache skips on a real model, nor what any cache costs
in quality. There are no real weights here, so this bench makes the nearest justified thing: a tiny
Wan-shaped transformer (8 blocks, width 64, Wan 2.1's 16 latent channels and patching, the tiny text
encoder and VAE of vidmem.pipelines.tiny) trained first, deterministically and for a few minutes,
with Wan's flow-matching objective on four classes of smooth synthetic motion in latent space, each
tied to its own prompt (bench/support/cache_signal.py). The JSON records that it learned: the
training and held-out losses fall, and each uncached sample lies nearer its prompted class's videos
than noise does and than to any other class.

Then, per class prompt at seeds 0 and 1, `sample()` at tier none with the pipeline's own scheduler
(UniPC, flow shift 3, guidance 5: two passes per step), `--steps` steps, with each cache:

- `off`: the reference;
- `mag_cache_published` (and `_bold`: threshold 0.24, K 6): the published Wan 2.1 T2V 1.3B ratios at
  their threshold 0.12, K 4, retention 0.2, as bench/speed.py runs them. They were measured on the
  1.3B, not on this model: they set how often it skips, never what this model's outputs do;
- `mag_cache_calibrated` (vidmem's defaults: threshold 0.06, K 3), `_published_settings` (0.12, K 4)
  and `_bold` (0.24, K 6): ratios measured on the trained model by vidmem's own calibration run
  (the first class's prompt, seed 100: another video than the ones judged);
- `first_block_cache` at diffusers' default 0.05, and at 0.1 and 0.2;
- `taylor_seer` (diffusers' lite mode) at diffusers' defaults (interval 5, warm-up 3, order 1), and
  `_interval_3` and `_interval_3_order_2`.

Per method, prompt and seed (JSON key `methods`: mean and worst over the eight, then `by_sample`):
blocks_ratio (blocks computed / uncached), psnr_db (final latent against the uncached one, over the
uncached latent's range; the random VAE would add nothing by decoding), passes skipped, and where the
run first skipped and first differed from the uncached run's pass outputs (`same_until_first_skip`:
before its first skip a cached run is the uncached run bit for bit). `seed_psnr_db`: the uncached
run at seed 0 against seed 1, same prompt, for scale (two different videos of one class);
mse_to_own_class and nearest_class_is_prompted: whether the cached video still lies among its
prompt's videos (as `denoises` judges the uncached ones).

    python bench/cache_quality.py --json bench/results/cache-quality-cpu-2026-11-27.json  # 3-5 min on 2 cores
    python bench/cache_quality.py --train-steps 3 --steps 4                             # seconds: a dry run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # bench.support
os.environ.setdefault("HF_HUB_OFFLINE", "1")
from bench.support.checkout import use_this_checkout  # noqa: E402

use_this_checkout()  # `import vidmem` is this clone, installed or not

import torch  # noqa: E402

from bench.support.cache_quality_runs import calibrated_ratios, compared, quality_methods, run  # noqa: E402
from bench.support.cache_signal import CLASSES, TrainConfig, denoises, judged, latent_shape, train  # noqa: E402
from bench.support.speed_runs import UNCACHED, SpeedConfig, build, psnr_db  # noqa: E402
from vidmem.pipelines.step_cache import StepCache  # noqa: E402

SEEDS = (0, 1)  # each class prompt is sampled at both: eight videos judged per method
CALIBRATION_SEED = 100  # MagCache's ratios are measured on another video than the ones judged
CAVEATS = [
    "A tiny model (8 blocks, width 64) trained for minutes on synthetic latent motion, not a video model: its "
    "velocity field is real (it was learned; it denoises) but far simpler than Wan's, so the figures show how the "
    "caches behave on a smooth learned trajectory, not the skip rates or quality on Wan 2.1 itself.",
    "The published MagCache ratios belong to Wan 2.1 T2V 1.3B, not to this model: with them MagCache skips the steps "
    "the 1.3B's ratios allow, whatever this model does; the calibrated rows use this model's own ratios.",
    "PSNR is over latents (the tiny VAE is random); it measures drift from the uncached run, not visual quality.",
]


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, SpeedConfig, TrainConfig]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the evidence JSON here")
    parser.add_argument("--steps", type=int, default=50, help="sampling steps")
    parser.add_argument("--train-steps", type=int, default=TrainConfig.steps)
    parser.add_argument("--batch", type=int, default=TrainConfig.batch)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--ffn", type=int, default=256)
    parser.add_argument("--size", default="64x64x17", help="video WxHxF (latent 16 x 5 x 8 x 8)")
    parser.add_argument("--cfg", type=float, default=5.0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (fixed: results depend on it; "
                        "one, because two threads on two shared cores ran 5x slower here)")
    args = parser.parse_args(argv)
    width, height, frames = (int(v) for v in args.size.split("x"))
    try:
        latent_shape(width, height, frames)
        training = TrainConfig(steps=args.train_steps, batch=args.batch)
    except ValueError as error:
        parser.error(str(error))
    config = SpeedConfig(steps=args.steps, blocks=args.blocks, heads=args.heads, head_dim=args.head_dim, ffn=args.ffn,
                         width=width, height=height, frames=frames, cfg=args.cfg, runs=0, time_tiers=())
    return args, config, training


def main(argv: list[str] | None = None) -> dict:
    args, config, training = parse(argv)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    print(f"cache quality bench: {config.describe()}, training {training}", flush=True)
    loaded = build(config)
    video = (config.width, config.height, config.frames)
    trained = train(loaded.pipe, training, video, loaded.spec.max_sequence_length)
    calibration = replace(config, prompt=CLASSES[0][0], seed=CALIBRATION_SEED)
    ratios = calibrated_ratios(loaded, calibration)
    settings = quality_methods(config, ratios, f"'{calibration.prompt}', seed {calibration.seed}")
    shape = latent_shape(config.width, config.height, config.frames)
    rows, uncached = judge(loaded, config, settings, shape, started)
    result = {"bench": "cache_quality", "config": config.describe(), "threads": args.threads, "caveats": CAVEATS,
              "training": trained, "calibrated_ratios": list(ratios),
              "denoises": denoises({i: uncached[(i, SEEDS[0])][0] for i in range(len(CLASSES))}, shape, seed=7),
              "seed_psnr_db": {p: psnr_db(uncached[(i, SEEDS[0])], uncached[(i, SEEDS[1])])
                               for i, (p, _) in enumerate(CLASSES)},
              "methods": {m: summary(settings[m], by_sample) for m, by_sample in rows.items()}}
    result["wall_seconds"] = round(time.perf_counter() - started, 1)
    print_report(result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json}")
    return result


def judge(loaded, config: SpeedConfig, settings: dict[str, StepCache], shape, started: float) -> tuple[dict, dict]:
    """Every method on every class prompt and seed against the uncached run: method -> "prompt |
    seed" -> its row, and (class, seed) -> the uncached latent."""
    rows, uncached = {m: {} for m in settings}, {}
    for index, (prompt, _) in enumerate(CLASSES):
        for seed in SEEDS:
            one = replace(config, prompt=prompt, seed=seed)
            reference = run(loaded, one, settings[UNCACHED])
            uncached[(index, seed)] = reference.latent
            for method, cache in settings.items():
                done = reference if method == UNCACHED else run(loaded, one, cache)
                rows[method][f"{prompt} | seed {seed}"] = {**compared(done, reference, config),
                                                           **judged(done.latent[0], index, shape)}
        print(f"  {prompt}: done ({time.perf_counter() - started:.0f} s)", flush=True)
    return rows, uncached


def summary(cache: StepCache, by_sample: dict) -> dict:
    """One method over every prompt and seed: mean blocks ratio, mean and worst PSNR (None: equal)."""
    rows = list(by_sample.values())
    psnrs = [row["psnr_db"] for row in rows if row["psnr_db"] is not None]
    mean = lambda key: sum(row[key] for row in rows) / len(rows)  # noqa: E731
    return {"settings": cache.describe(), "ratios": cache.ratio_source or None, "blocks_ratio": mean("blocks_ratio"),
            "psnr_db_mean": sum(psnrs) / len(psnrs) if psnrs else None, "psnr_db_worst": min(psnrs) if psnrs else None,
            "same_until_first_skip": all(row["same_until_first_skip"] for row in rows),
            "mse_to_own_class_mean": mean("mse_to_own_class"),
            "nearest_class_is_prompted": sum(row["nearest_class_is_prompted"] for row in rows), "by_sample": by_sample}


def print_report(result: dict) -> None:
    t = result["training"]
    print(f"\ntraining: {t['steps']} steps in {t['seconds']:.0f} s; loss {t['loss_first_tenth']:.3f} -> "
          f"{t['loss_last_tenth']:.3f} (first and last tenth), held out {t['held_out_loss_before']:.3f} -> "
          f"{t['held_out_loss_after']:.3f}")
    print(f"{'class prompt':<38} {'MSE own class':>13} {'other class':>11} {'noise':>8} {'nearest ok':>10} "
          f"{'seed PSNR':>9}")
    for prompt, row in result["denoises"].items():
        print(f"{prompt:<38} {row['mse_to_own_class']:>13.3f} {row['mse_to_nearest_other_class']:>11.3f} "
              f"{row['noise_mse_to_own_class']:>8.3f} {str(row['nearest_class_is_prompted']):>10} "
              f"{result['seed_psnr_db'][prompt]:>9.1f}")
    print(f"\n{'method':<40} {'settings':<56} {'blocks':>7} {'PSNR mean':>9} {'worst':>6} {'same until skip':>15} "
          f"{'MSE own class':>13} {'in class':>8}")
    for method, row in result["methods"].items():
        mean = "equal" if row["psnr_db_mean"] is None else f"{row['psnr_db_mean']:.1f}"
        worst = "-" if row["psnr_db_worst"] is None else f"{row['psnr_db_worst']:.1f}"
        print(f"{method:<40} {row['settings']:<56} {row['blocks_ratio']:>7.3f} {mean:>9} {worst:>6} "
              f"{str(row['same_until_first_skip']):>15} {row['mse_to_own_class_mean']:>13.3f} "
              f"{row['nearest_class_is_prompted']:>4}/{len(row['by_sample'])}")
    print("(blocks: computed / uncached, mean over the class prompts at seeds 0 and 1; PSNR of the final latent "
          "against the uncached run, dB, mean and worst; MSE own class: to the nearest of 256 videos of the prompted "
          "class, mean; in class: samples no other class lies nearer to; seed PSNR: the uncached run at seed 0 against "
          "seed 1, for scale)")
    for caveat in result["caveats"]:
        print(f"caveat: {caveat}")


if __name__ == "__main__":
    main()
