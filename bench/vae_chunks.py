"""Temporal chunks: streamed (caches carried over) vs decoded alone (one context frame) vs untiled.

Real-size CogVideoX-2b and Wan 2.1 VAEs with random weights (as bench/vae_decode.py), fp32 CPU, a
smooth 21-latent-frame latent (81 frames) at a small 64x64 so that time, not area, is what is cut.
Both tiled decodes use one 64 px tile and temporal_size 64 (the default), so they differ from the
untiled decode only in how time is cut:
- "streamed": vidmem's decode path, each chunk continuing from the previous one's caches;
- "alone": every chunk decoded with a fresh VAE call, after one latent frame of context.

    python bench/vae_chunks.py --json bench/results/vae_chunks.json

Prints the largest per-frame mean |difference| and writes a PNG of it per output frame
(bench/results/vae_chunks.png). About 4 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from bench.support.checkout import use_this_checkout  # noqa: E402

use_this_checkout()  # `import vidmem` is this clone, installed or not

import torch  # noqa: E402

from vae_decode import GEOMETRY, SPECS, build_vae, smooth_latent  # noqa: E402
from vidmem.memory.strategy import VaeTiling  # noqa: E402
from vidmem.memory.vae import DecodeReport, decode_video  # noqa: E402
from vidmem.pipelines.decode import vae_decoder  # noqa: E402

TILING = VaeTiling(tile_size=64, overlap=16)  # temporal_size 64, temporal_overlap 8: the defaults


def per_frame_errors(family: str, latent_frames: int, size: int) -> dict:
    vae = build_vae(family)
    ours, prepare = vae_decoder(SPECS[family], vae)
    latents = smooth_latent((1, 16, latent_frames, size // 8, size // 8))
    with torch.no_grad():
        reference = vae.decode(latents).sample.clamp(-1, 1)
    streamed_report, alone_report = DecodeReport(), DecodeReport()
    streamed = decode_video(ours, latents, GEOMETRY, TILING, prepare=prepare, report=streamed_report)
    alone = decode_video(lambda z: vae.decode(z).sample, latents, GEOMETRY, TILING, report=alone_report)

    def errors(pixels: torch.Tensor) -> list[float]:
        return (pixels.clamp(-1, 1) - reference).abs().mean(dim=(0, 1, 3, 4)).tolist()

    return {"frames": reference.shape[2], "chunks": streamed_report.chunks, "alone_chunks": alone_report.chunks,
            "mean_abs_output": reference.abs().mean().item(),
            "streamed": errors(streamed), "alone": errors(alone)}


def save_png(path: Path, results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 3.2), squeeze=False)
    for axis, (family, entry) in zip(axes[0], results.items()):
        axis.plot(entry["alone"], label="chunks decoded alone (1 context frame)")
        axis.plot(entry["streamed"], label="vidmem: chunks streamed")
        axis.set(title=f"{family}: {entry['frames']} frames, temporal_size 64", xlabel="output frame",
                 ylabel="mean |tiled - untiled|")
        axis.legend(fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--png", type=Path, default=ROOT / "bench" / "results" / "vae_chunks.png")
    parser.add_argument("--latent-frames", type=int, default=21)
    parser.add_argument("--size", type=int, default=64, help="frame edge in pixels, a multiple of 8")
    args = parser.parse_args()
    results = {}
    print(f"{'family':<10} {'frames':>6} {'streamed max':>13} {'alone max':>10} {'output mean':>12}")
    for family in SPECS:
        entry = results[family] = per_frame_errors(family, args.latent_frames, args.size)
        print(f"{family:<10} {entry['frames']:>6} {max(entry['streamed']):>13.4f} {max(entry['alone']):>10.4f} "
              f"{entry['mean_abs_output']:>12.4f}", flush=True)
    save_png(args.png, results)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.png}" + (f" and {args.json}" if args.json else ""))


if __name__ == "__main__":
    main()
