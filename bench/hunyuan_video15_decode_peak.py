"""HunyuanVideo 1.5's VAE decode peak on the meta device: diffusers' untiled decode vs vidmem's.

The real-size VAE (pipelines/configs/components/hunyuanvideo1.5-vae.json) is built on meta and each
decode runs through the planner's ledger (vidmem.memory.accounting.trace): live activation bytes,
weights excluded, attention counted as a fused kernel holds it (output + logsumexp; diffusers' math
path would add the score matrix on top). No GPU and no weights: a prediction of what the decodes
allocate, not a measurement on a device.

- diffusers: `vae.decode(z)` on the whole latent, as HunyuanVideo15Pipeline runs it; its mid-block
  builds a dense (T*h*w)^2 causal mask.
- diffusers tiled: the same after `vae.enable_tiling()` (its defaults: 256 px tiles, a quarter
  overlap, every frame at once), as the pipeline's docstring example runs it;
- Tencent's tiles: the same with 128 px tiles and a quarter overlap, what Tencent's own pipeline
  (github.com/Tencent-Hunyuan/HunyuanVideo-1.5, hyvideo/pipelines/hunyuan_video_pipeline.py,
  `get_vae_inference_config`) picks on GPUs under 28 GiB, in fp16 (as bf16: same bytes); spatial
  tiles only, its VAE refuses temporal tiling. This is the decode behind the README's "14 GB";
- vidmem: the staged decode (pipelines/hunyuan_video15_vae.py) with its default tiling
  (256/32 px tiles, 64-frame chunks, each stepped a latent frame at a time), output buffer included.

    python bench/hunyuan_video15_decode_peak.py --json bench/results/vae-decode-hunyuan15-peak-cpu-2026-11-28.json

About five minutes on 2 cores for both sizes (most of it diffusers' untiled decodes).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.support.checkout import use_this_checkout  # noqa: E402

use_this_checkout()  # `import vidmem` is this clone, installed or not

import torch  # noqa: E402

from vidmem.memory.accounting import Attention, trace  # noqa: E402
from vidmem.memory.strategy import VaeTiling  # noqa: E402
from vidmem.memory.vae import Streaming, decode_video  # noqa: E402
from vidmem.pipelines.configs import load_model  # noqa: E402
from vidmem.pipelines.hunyuan_video15_vae import hunyuan_video15_stages  # noqa: E402

SIZES = ((848, 480, 121), (1280, 720, 121))
# vae.enable_tiling() arguments: diffusers' defaults, and Tencent's below 28 GiB of GPU memory
DIFFUSERS_TILES = dict(tile_sample_min_height=256, tile_sample_min_width=256, tile_latent_min_height=16,
                       tile_latent_min_width=16, tile_overlap_factor=0.25)
TENCENT_UNDER_28_GIB = dict(tile_sample_min_height=128, tile_sample_min_width=128, tile_latent_min_height=8,
                            tile_latent_min_width=8, tile_overlap_factor=0.25)
GIB = 2**30


def peaks(width: int, height: int, frames: int) -> dict:
    model = load_model("hunyuanvideo1.5-t2v-480p")  # the VAE is the same for every checkpoint
    vae, geometry = model.module("vae"), model.geometry
    stages = hunyuan_video15_stages(vae)
    latent = (1, geometry.latent_channels, (frames - 1) // geometry.temporal_factor + 1,
              height // geometry.spatial_factor, width // geometry.spatial_factor)
    z = lambda: torch.empty(latent, dtype=model.dtype_of("vae"), device="meta")  # noqa: E731
    ours = trace(lambda: decode_video(Streaming(stages.stream, stages.frame_batch), z(), geometry, VaeTiling(),
                                      prepare=stages.context, out_device="meta"), Attention.FUSED)
    context = trace(lambda: stages.context(z()), Attention.FUSED)
    theirs = trace(lambda: vae.decode(z()).sample, Attention.FUSED)
    vae.enable_tiling()
    try:
        theirs_tiled = trace(lambda: vae.decode(z()).sample, Attention.FUSED)
        vae.enable_tiling(**TENCENT_UNDER_28_GIB)
        tencent = trace(lambda: vae.decode(z()).sample, Attention.FUSED)
    finally:
        vae.enable_tiling(**DIFFUSERS_TILES)  # the shared meta VAE back to diffusers' defaults, untiled
        vae.disable_tiling()
    return {"size": [width, height, frames], "latent": list(latent), "dtype": model.vae_dtype_name or model.dtype_name,
            "diffusers_untiled_bytes": theirs.peak_bytes, "diffusers_tiled_bytes": theirs_tiled.peak_bytes,
            "tencent_128px_tiles_bytes": tencent.peak_bytes,
            "decoder_weight_bytes": sum(p.numel() * p.element_size() for p in vae.decoder.parameters()),
            "vidmem_tiled_bytes": ours.peak_bytes,
            "vidmem_context_stage_bytes": context.peak_bytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    rows = [peaks(*size) for size in SIZES]
    print("| size | diffusers untiled | diffusers enable_tiling() | Tencent's 128 px tiles | vidmem 256/32 px, 64 frames "
          "| of which the shared mid-block | decoder weights |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        w, h, f = row["size"]
        print(f"| {w}x{h}x{f} | {row['diffusers_untiled_bytes'] / GIB:.1f} GiB | {row['diffusers_tiled_bytes'] / GIB:.1f} GiB "
              f"| {row['tencent_128px_tiles_bytes'] / GIB:.1f} GiB | {row['vidmem_tiled_bytes'] / GIB:.1f} GiB "
              f"| {row['vidmem_context_stage_bytes'] / GIB:.1f} GiB | {row['decoder_weight_bytes'] / GIB:.2f} GiB |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
