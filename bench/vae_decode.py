"""VAE decode benchmark: untiled vs diffusers' enable_tiling() vs vidmem's tiled decode, on the CPU.

Real-size VAEs with random weights: CogVideoX-2b and Wan 2.1 (the diffusers constructor defaults
are the published vae/config.json of THUDM/CogVideoX-2b and Wan-AI/Wan2.1-T2V-1.3B-Diffusers),
LTX-2 and HunyuanVideo 1.5 (built from the shipped configs, pipelines/configs/components/
ltx2-vae.json and hunyuanvideo1.5-vae.json: for LTX-2 the constructor defaults are NOT the
published config, which has decoder_causal false and 32x/8x compression), fp32, decoding a smooth synthetic latent (seams show best on smooth content). "vidmem_tiled" is
the pack's own decode path: the family's declared VAE stages (Wan: the mid-block attention once on
the whole latent, the rest per tile; both: caches streamed across a tile's frame chunks) and
`decode_video` at the default VaeTiling (HunyuanVideo 1.5: its mid-block once on the whole latent,
the rest per tile; LTX-2 declares no stages, so each piece is `vae.decode`). Every decode
runs in its own process: peak RSS is sampled every 2 ms and reported above the RSS measured after
the VAE and the latent are loaded (the activation peak).

    python bench/vae_decode.py --json bench/results/vae_decode.json
    python bench/vae_decode.py --families ltx2 hunyuanvideo1.5 \
        --json bench/results/vae-decode-families-cpu-2026-11-27.json

Default size: 480x720 (the size class the issue names), scaled down in frames to fit RAM and
~15 minutes on 2 idle cores:
- CogVideoX decodes latent frames in batches of 2-3 (up to 9 output frames at once); untiled at
  480x720 that needs ~22 GiB, more than this machine can spare next to the tiled runs, so it
  decodes 1 latent frame (1 output frame).
- Wan streams one latent frame at a time through its causal cache. Its first latent frame gives 1
  output frame, every later one 4, so 2 latent frames (5 output frames) show the per-frame peak
  that every later frame of a long video repeats.
- LTX-2 (32x spatial, 8x temporal, 128 latent channels) decodes 512x768, LTX2Pipeline's default
  size (720 is no multiple of 32), 2 latent frames (9 output frames). Its decoder is not causal:
  all frames go through at once, so the peak grows with the frame count; diffusers' tiling (512 px
  tiles, stride 448) splits only the width at this size. At 480 px height diffusers' tiled decode
  fails: its last row of tiles is 1 latent pixel high and the decoder's reflect padding needs 2
  (480x704: "Padding size should be less than the corresponding input dimension"); a failed
  decode is recorded under "error" instead of ending the run.
- HunyuanVideo 1.5 (16x spatial, 4x temporal, 32 latent channels) decodes all frames at once
  too (no frame batches) and is the slowest here on the CPU (128 channels at full resolution
  around 3x3x3 convolutions: ~75 s for 5 frames of 128x320), so it decodes 1 latent frame (1
  output frame) at 480x720, as CogVideoX does. Its mid-block mask is then (30*45)^2 fp32 = 7 MB,
  not the GBs of a 121-frame 720p decode (bench/hunyuan_video15_decode_peak.py models those on
  the meta device), and vidmem's temporal streaming has nothing to stream.
`seconds` is wall time, `cpu_seconds` the process's CPU time (steadier on a shared machine).
`--extra-tiling 192/32` adds a decode with that tile_size/overlap.

Quality, on pixels clamped to [-1, 1] as the IMAGE output shows them (CogVideoX's decoder does
not clamp, and random weights drive some pixels far outside): max and mean |tiled - untiled|;
the mean inside the bands where tiles blend and outside them (and their ratio, `seam_ratio`); and
`share_over_2_levels`, the share of pixel values more than 2 levels of 8 bits away from untiled.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.support.checkout import use_this_checkout  # noqa: E402

use_this_checkout()  # `import vidmem` is this clone, installed or not

import torch  # noqa: E402

from vidmem.memory.strategy import VaeTiling  # noqa: E402
from vidmem.memory.vae import DecodeReport, VaeGeometry, decode_video, plan_tiles  # noqa: E402
from vidmem.pipelines.cogvideox import COGVIDEOX  # noqa: E402
from vidmem.pipelines.configs import COMPONENTS_DIR  # noqa: E402
from vidmem.pipelines.decode import vae_decoder  # noqa: E402
from vidmem.pipelines.hunyuan_video15 import HUNYUAN_VIDEO15  # noqa: E402
from vidmem.pipelines.ltx2 import LTX2  # noqa: E402
from vidmem.pipelines.wan import WAN  # noqa: E402

FAMILIES = ("cogvideox", "wan", "ltx2", "hunyuanvideo1.5")
SPECS = {"cogvideox": COGVIDEOX, "wan": WAN, "ltx2": LTX2, "hunyuanvideo1.5": HUNYUAN_VIDEO15}
SHIPPED_CONFIG = {"ltx2": "ltx2-vae", "hunyuanvideo1.5": "hunyuanvideo1.5-vae"}  # pipelines/configs/components
LATENT_FRAMES = {"cogvideox": 1, "wan": 2, "ltx2": 2, "hunyuanvideo1.5": 1}  # see the module docstring
SIZES = {"ltx2": (512, 768)}  # (height, width): LTX2Pipeline's default size (480x720 does not divide by 32)
TWO_LEVELS = 2 * 2 / 255  # two 8-bit levels on the [-1, 1] scale
MODES = ("untiled", "diffusers_tiled", "vidmem_tiled")
OURS = VaeTiling()  # vidmem's defaults: 256/32 px, 64/8 frames


def shipped(family: str) -> dict:
    """The family's VAE entry in pipelines/configs/components: {"class", "config", ...}."""
    return json.loads((COMPONENTS_DIR / f"{SHIPPED_CONFIG[family]}.json").read_text())


def geometry_of(family: str) -> VaeGeometry:
    if family not in SHIPPED_CONFIG:
        return VaeGeometry(spatial_factor=8, temporal_factor=4, latent_channels=16)  # CogVideoX-2b, Wan 2.1
    config = shipped(family)["config"]
    return VaeGeometry(config["spatial_compression_ratio"], config["temporal_compression_ratio"], config["latent_channels"])


def build_vae(family: str):
    import diffusers

    torch.manual_seed(0)  # same random weights in every process
    if family in SHIPPED_CONFIG:
        entry = shipped(family)
        vae = getattr(diffusers, entry["class"])(**entry["config"])
    else:
        vae = diffusers.AutoencoderKLCogVideoX() if family == "cogvideox" else diffusers.AutoencoderKLWan()
    return vae.eval().requires_grad_(False)


def smooth_latent(shape: tuple[int, ...]) -> torch.Tensor:
    """Low-frequency noise: random at 1/8 resolution, trilinearly upsampled, unit-ish scale."""
    generator = torch.Generator().manual_seed(1)
    b, c, t, h, w = shape
    coarse = torch.randn(b, c, t, max(2, h // 8), max(2, w // 8), generator=generator)
    return torch.nn.functional.interpolate(coarse, size=(t, h, w), mode="trilinear", align_corners=True) * 2


class PeakRss:
    """Samples this process's RSS on a thread; `peak` is the highest value seen."""

    def __init__(self, interval: float = 0.002):
        import psutil

        self._process, self._interval, self._stop = psutil.Process(), interval, threading.Event()
        self.peak = self._process.memory_info().rss
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._process.memory_info().rss)
            time.sleep(self._interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._process.memory_info().rss)


def tiling_for(mode: str) -> VaeTiling:
    """'vidmem_tiled' is the defaults; 'vidmem_tiled_384_32' is tile_size 384, overlap 32."""
    if mode == "vidmem_tiled":
        return OURS
    tile, overlap = mode.rsplit("_", 2)[1:]
    return VaeTiling(tile_size=int(tile), overlap=int(overlap))


def worker(family: str, mode: str, shape: tuple[int, ...], out_path: str) -> dict:
    """One decode in this process; writes the pixels to out_path and returns its measurements."""
    import gc

    torch.set_num_threads(os.cpu_count() or 1)
    vae, latents, geometry = build_vae(family), smooth_latent(shape), geometry_of(family)
    report = DecodeReport()
    if mode == "diffusers_tiled":
        vae.enable_tiling()
    decode = lambda z: vae.decode(z).sample  # noqa: E731
    with torch.no_grad():  # first-call library set-up is not the decode's cost
        decode(smooth_latent((1, shape[1], 1, 4, 4)))
    gc.collect()
    ours, prepare = vae_decoder(SPECS[family], vae)
    with torch.no_grad(), PeakRss() as meter:
        baseline, start, cpu_start = meter.peak, time.perf_counter(), time.process_time()
        if mode.startswith("vidmem_tiled"):
            pixels = decode_video(ours, latents, geometry, tiling_for(mode), prepare=prepare, report=report)
        else:
            pixels = decode(latents)
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    torch.save(pixels.float(), out_path)
    result = {"peak_rss_bytes": int(meter.peak - baseline), "seconds": round(seconds, 2),
              "cpu_seconds": round(cpu_seconds, 2), "output_shape": list(pixels.shape)}
    if mode == "untiled":
        result["mean_abs_output"] = round(pixels.abs().mean().item(), 5)  # the scale of the diffs below
    if mode.startswith("vidmem_tiled"):
        result.update(tiling=asdict(tiling_for(mode)), tiles=report.tiles, chunks=report.chunks,
                      shared_context=report.shared_context)
    return result


def run_isolated(family: str, mode: str, shape: tuple[int, ...], out_path: str) -> dict:
    command = [sys.executable, __file__, "--worker", family, mode, "--shape", *map(str, shape), "--out", out_path]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:  # kept in the results: a tiling that fails at a size is a finding
        return {"error": done.stderr.strip().splitlines()[-1][:500]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def blend_bands(shape: tuple[int, ...], geometry: VaeGeometry, tiling: VaeTiling) -> torch.Tensor:
    """[H, W] bool: the pixels where two or more tiles blend."""
    plan = plan_tiles(shape, geometry, tiling)
    bands = []
    for axis in (plan.rows, plan.cols):
        band = torch.zeros(axis[-1].out_stop, dtype=torch.bool)
        for span in axis:
            band[span.out_start : span.out_stop] |= span.weight < 1 - 1e-6
        bands.append(band)
    return bands[0][:, None] | bands[1][None, :]


def compare(result: dict, pixels: torch.Tensor, reference: torch.Tensor, shape, geometry: VaeGeometry) -> None:
    if pixels.shape != reference.shape:
        result["shape_mismatch"] = f"{list(pixels.shape)} vs untiled {list(reference.shape)}"
        return
    error = (pixels.clamp(-1, 1) - reference.clamp(-1, 1)).abs()  # as the IMAGE output shows them
    result["max_abs_diff"] = round(error.max().item(), 5)
    result["mean_abs_diff"] = round(error.mean().item(), 6)
    result["share_over_2_levels"] = round((error > TWO_LEVELS).float().mean().item(), 6)
    if "tiling" in result:
        band = blend_bands(shape, geometry, VaeTiling(**result["tiling"]))
        per_pixel = error.mean(dim=(0, 1, 2))
        if band.any() and not band.all():
            inside, outside = per_pixel[band].mean().item(), per_pixel[~band].mean().item()
            result.update(band_mean_abs_diff=round(inside, 6), interior_mean_abs_diff=round(outside, 6),
                          seam_ratio=round(inside / max(outside, 1e-12), 2))


def save_png(path: Path, family: str, ours: torch.Tensor, reference: torch.Tensor) -> None:
    """Middle frame: vidmem tiled | untiled | |difference| scaled so its 99.9th percentile is white."""
    from PIL import Image, ImageDraw

    frame = ours.shape[2] // 2
    a, b = ours[0, :, frame].clamp(-1, 1), reference[0, :, frame].clamp(-1, 1)
    diff = (a - b).abs().mean(0, keepdim=True).expand(3, -1, -1)
    scale = torch.quantile(diff[0].flatten(), 0.999).clamp(min=1e-8)
    panels = [(a + 1) / 2, (b + 1) / 2, diff / scale]
    strip = torch.cat([p.clamp(0, 1) for p in panels], dim=2)
    image = Image.fromarray((strip.permute(1, 2, 0) * 255).round().byte().numpy())
    canvas = Image.new("RGB", (image.width, image.height + 18), "white")
    canvas.paste(image, (0, 18))
    width = a.shape[-1]
    labels = ("vidmem tiled", "untiled", f"|difference| x{1 / scale.item():.2g}")
    draw = ImageDraw.Draw(canvas)
    for i, label in enumerate(labels):
        draw.text((i * width + 4, 3), f"{family}: {label}", fill="black")
    path.parent.mkdir(parents=True, exist_ok=True)
    canvas.save(path)


def print_table(results: dict) -> None:
    print(f"\n{'family':<16} {'mode':<20} {'peak RSS':>10} {'% untiled':>9} {'seconds':>8} {'x untiled':>9} "
          f"{'cpu x':>6} {'max diff':>9} {'mean diff':>9} {'band':>9} {'interior':>9} {'>2 lvls':>8}")
    for family, entry in results.items():
        base = entry["untiled"]
        for mode in [key for key in entry if isinstance(entry[key], dict)]:
            r = entry[mode]
            if "error" in r:
                print(f"{family:<16} {mode:<20} failed: {r['error']}")
                continue
            print(f"{family:<16} {mode:<20} {r['peak_rss_bytes'] / 2**30:>8.2f}Gi "
                  f"{100 * r['peak_rss_bytes'] / base['peak_rss_bytes']:>8.0f}% {r['seconds']:>8.1f} "
                  f"{r['seconds'] / base['seconds']:>9.2f} {r['cpu_seconds'] / base['cpu_seconds']:>6.2f} "
                  f"{r.get('max_abs_diff', '-')!s:>9} "
                  f"{r.get('mean_abs_diff', '-')!s:>9} {r.get('band_mean_abs_diff', '-')!s:>9} "
                  f"{r.get('interior_mean_abs_diff', '-')!s:>9} {r.get('share_over_2_levels', '-')!s:>8}"
                  + (f"  ({r['shape_mismatch']})" if "shape_mismatch" in r else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--png-dir", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    parser.add_argument("--latent-frames", type=int, help=f"for every family (default: {LATENT_FRAMES})")
    parser.add_argument("--height", type=int, help="output pixels, a multiple of the VAE's factor (default 480)")
    parser.add_argument("--width", type=int, help=f"output pixels (default 720; {SIZES})")
    parser.add_argument("--extra-tiling", metavar="TILE/OVERLAP", help="also decode with this vidmem tiling")
    parser.add_argument("--worker", nargs=2, metavar=("FAMILY", "MODE"), help=argparse.SUPPRESS)
    parser.add_argument("--shape", nargs=5, type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker, tuple(args.shape), args.out)))
        return
    modes = list(MODES)
    if args.extra_tiling:
        tile, overlap = (int(n) for n in args.extra_tiling.split("/"))
        VaeTiling(tile_size=tile, overlap=overlap)  # validate before spending minutes
        modes.append(f"vidmem_tiled_{tile}_{overlap}")
    print(f"VAE decode at 480x720 unless said, fp32 CPU, random weights, "
          f"{len(args.families) * len(modes)} decodes each in its own process (default: ~15 min on 2 idle "
          f"cores). vidmem tiling: {OURS}.", flush=True)
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        for family in args.families:
            frames, geometry = args.latent_frames or LATENT_FRAMES[family], geometry_of(family)
            height, width = SIZES.get(family, (480, 720))
            height, width, s = args.height or height, args.width or width, geometry.spatial_factor
            if height % s or width % s:
                parser.error(f"{family} needs --height and --width in multiples of {s}, got {height}x{width}.")
            shape = (1, geometry.latent_channels, frames, height // s, width // s)
            print(f"{family}: latent {list(shape)} -> {geometry.frames(frames)} frames of {height}x{width}", flush=True)
            entry, outputs = {"latent_shape": list(shape), "size": [height, width, geometry.frames(frames)]}, {}
            for mode in modes:
                outputs[mode] = os.path.join(scratch, f"{family}-{mode}.pt")
                entry[mode] = run_isolated(family, mode, shape, outputs[mode])
                print(f"  {family} {mode}: " + (f"FAILED: {entry[mode]['error']}" if "error" in entry[mode] else
                      f"{entry[mode]['seconds']} s, +{entry[mode]['peak_rss_bytes'] / 2**30:.2f} GiB"), flush=True)
            reference = torch.load(outputs["untiled"])
            for mode in [m for m in modes[1:] if "error" not in entry[m]]:
                compare(entry[mode], torch.load(outputs[mode]), reference, shape, geometry)
            save_png(args.png_dir / f"vae_decode_{family}.png", family, torch.load(outputs["vidmem_tiled"]), reference)
            results[family] = entry
            if args.json:  # after each family: a long run keeps what it finished
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(results, indent=2))
    print_table(results)
    if args.json:
        print(f"\nwrote {args.json} and {args.png_dir}/vae_decode_<family>.png")


if __name__ == "__main__":
    main()
