"""bench/gpu.py --decode (issue 20): Wan 2.1's VAE decoding a whole clip on the GPU, tiled as the Decode node
tiles it, with each piece's copy to the host and its blend there overlapped with the next piece's decode
(`memory.vae._Landing`, the default on CUDA) and without (the copy and the CPU blend between two decodes).

Random weights at the published config (diffusers' `AutoencoderKLWan()` defaults are Wan 2.1's vae/config.json),
in the model's compute dtype (bf16 for Wan 2.1 1.3B, as its loader runs the VAE), a smooth random latent at
832x480x81. Both variants run the family's declared stages (mid-block attention once on the whole latent, the
rest streamed per tile) at the default VaeTiling; timed rounds are interleaved after one untimed decode.

Per variant: median seconds, peak allocated VRAM above what the VAE and latent hold, and whether the frames
equal the other variant's (they must: the same blends in the same order). With the planner's predicted decode
peak for the same call beside them. On the CPU (`--device cpu`) a tiny VAE at 64x64x5 checks the code path;
its seconds mean nothing.
"""

from __future__ import annotations

import statistics
import time

import torch

from vidmem.memory import MemoryStrategy
from vidmem.memory.strategy import VaeTiling
from vidmem.memory.vae import DecodeReport, VaeGeometry, decode_video
from vidmem.pipelines.decode import vae_decoder
from vidmem.pipelines.wan import WAN

VARIANTS = {"overlapped": True, "blocking": False}


def decode_rows(model, shape, device: torch.device, runs: int = 2, deadline: float | None = None) -> dict:
    """{"variants": {name: figures}, "same_frames": bool, "predicted_peak_allocated_bytes", ...}."""
    vae = build_vae(device, model.dtype if device.type == "cuda" else torch.float32, tiny=device.type != "cuda")
    latent = smooth_latent(vae, shape, device)
    decode, prepare = vae_decoder(WAN, vae)
    tiling = VaeTiling() if device.type == "cuda" else VaeTiling(tile_size=64, overlap=16)  # pieces on the CPU too
    vae_geometry = VaeGeometry(8, 4, vae.config.z_dim)  # Wan 2.1's VAE: 8x in space, 4x in time
    _sync(device)
    held = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    report = DecodeReport()
    started = time.perf_counter()
    frames = {name: decode_video(decode, latent, vae_geometry, tiling, prepare=prepare, overlap_copies=on,
                                 report=report if on else None)
              for name, on in VARIANTS.items()}  # untimed: cuDNN's choices, the allocator's first blocks
    result = {"tiling": report.describe(), "first_decodes_seconds": round(time.perf_counter() - started, 1),
              "held_bytes": held,  # allocated before any decode: the VAE and the latent
              "same_frames": torch.equal(*frames.values()), "vae_dtype": str(latent.dtype).removeprefix("torch."),
              "latent_shape": list(latent.shape), "variants": {name: {"seconds": [], "peak_above_held_bytes": 0}
                                                                 for name in VARIANTS}}
    del frames
    for round_ in range(runs):
        if deadline is not None and time.time() > deadline:
            result["stopped"] = f"budget: {round_} of {runs} rounds"
            break
        order = list(VARIANTS.items())[round_ % 2 :] + list(VARIANTS.items())[: round_ % 2]
        for name, on in order:
            row = result["variants"][name]
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            _sync(device)
            started = time.perf_counter()
            decode_video(decode, latent, vae_geometry, tiling, prepare=prepare, overlap_copies=on)
            _sync(device)
            row["seconds"].append(round(time.perf_counter() - started, 3))
            if device.type == "cuda":
                row["peak_allocated_bytes"] = max(row.get("peak_allocated_bytes", 0), torch.cuda.max_memory_allocated(device))
                row["peak_above_held_bytes"] = row["peak_allocated_bytes"] - held
    for row in result["variants"].values():
        row["median_seconds"] = statistics.median(row["seconds"]) if row["seconds"] else None
    times = [result["variants"][name]["median_seconds"] for name in VARIANTS]
    if all(times):
        result["overlapped_over_blocking"] = round(times[0] / times[1], 3)
    result["predicted"] = predicted_peak(model, shape)
    return result


def build_vae(device: torch.device, dtype: torch.dtype, tiny: bool):
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    config = dict(base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1) if tiny else {}
    return AutoencoderKLWan(**config).to(device, dtype).eval().requires_grad_(False)


def smooth_latent(vae, shape, device: torch.device) -> torch.Tensor:
    """Low-frequency noise at the clip's latent grid (seams and caches behave as on real latents)."""
    frames, height, width = (shape.frames - 1) // 4 + 1, shape.height // 8, shape.width // 8
    generator = torch.Generator().manual_seed(1)
    coarse = torch.randn(1, vae.config.z_dim, frames, max(2, height // 8), max(2, width // 8), generator=generator)
    latent = torch.nn.functional.interpolate(coarse, size=(frames, height, width), mode="trilinear", align_corners=True)
    return latent.to(device, vae.dtype)


def predicted_peak(model, shape) -> dict:
    """The planner's decode phase for the same call: the VAE alone on the device, default tiling."""
    from vidmem.memory.plan.planner import Allocator, PlanOptions, plan_run

    decode = plan_run(model, shape, MemoryStrategy(offload="none", vae_tiling=VaeTiling()), PlanOptions(allocator=Allocator.NATIVE)).stage("decode")
    phase = decode.peak_phase
    # `resident` holds the cuBLAS workspace too, which the bench's `held_bytes` (before any decode) does not:
    # compare peak_allocated_bytes with the variants' peak_allocated_bytes, both totals without the CUDA context
    return {"peak_allocated_bytes": phase.peak.allocated, "resident_bytes": sum(phase.resident),
            "activation_bytes": phase.peak.allocated - sum(phase.resident), "label": phase.label}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
