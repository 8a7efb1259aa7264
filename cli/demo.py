"""`vidmem demo`: the node code path end to end on a small model it builds itself (no downloads,
no ComfyUI), written as a video and its receipt."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from dataclasses import replace
from pathlib import Path

from ..pipelines.atomic import atomic_path, write_bytes_atomically  # standard library only
from .plan import parse_size
from .queue import unwritable_folder

DEMO_VARIANT = "wan2.1-t2v"
OFFLOAD_TIERS = ("none", "model", "block_swap", "sequential", "auto")  # the Strategy node's offload choices, without torch


def add_demo_parser(subparsers) -> argparse.ArgumentParser:
    demo = subparsers.add_parser("demo", help="sample and decode a small built-in model, write video + receipt")
    demo.add_argument("--out", type=Path, default=Path("vidmem-demo"), help="folder for demo.mp4 and receipt.json")
    demo.add_argument("--variant", default=DEMO_VARIANT, help="built-in tiny model (see --list-variants)")
    demo.add_argument("--list-variants", action="store_true", help="print the built-in variants and exit")
    demo.add_argument("--offload", default="block_swap", choices=OFFLOAD_TIERS, help=" | ".join(OFFLOAD_TIERS))
    demo.add_argument("--blocks-to-swap", type=int, default=1, help="for --offload block_swap")
    demo.add_argument("--size", help="WIDTHxHEIGHT (default: the variant's own, e.g. 32x32; see --list-variants)")
    demo.add_argument("--frames", type=int, help="frames to generate (default: the variant's own, e.g. 9)")
    demo.add_argument("--steps", type=int, default=4)
    demo.add_argument("--seed", type=int, default=0)
    return demo


def run_demo(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the demo never downloads
    from ..pipelines.tiny import TINY_VARIANTS, save_tiny_pipeline, tiny_spec

    if args.list_variants:
        print("\n".join(TINY_VARIANTS))
        return 0
    spec = tiny_spec(args.variant)
    if spec.needs_image:
        raise ValueError(f"--variant {args.variant} is image-to-video; the demo runs text-to-video variants.")
    # The variant's own shape by default: a tiny model's positional tables are sized for it.
    width, height = parse_size(args.size) if args.size else (spec.width, spec.height)
    count = spec.frames if args.frames is None else args.frames
    _check_run(args, spec, width, height, count)
    with tempfile.TemporaryDirectory(prefix="vidmem-demo-") as scratch:
        folder = save_tiny_pipeline(args.variant, Path(scratch) / args.variant)
        frames, receipt = _run_nodes(folder, args, width, height, count)
    receipt["video"] = {"path": str(_write_video(frames, args.out / "demo.mp4")), "frames": int(frames.shape[0]),
                        "size": [width, height]}
    write_bytes_atomically(args.out / "receipt.json", json.dumps(receipt, indent=2).encode())
    print(json.dumps(receipt, indent=2))
    return 0


def _write_video(frames, path: Path) -> Path:
    """The mp4 written whole or not at all: a failed write (a full disk, Ctrl-C) leaves an earlier demo.mp4 as it
    was, never a truncated one beside the earlier receipt."""
    with atomic_path(path) as partial:
        write_mp4(frames, partial)
    return path


def _check_run(args: argparse.Namespace, spec, width: int, height: int, frames: int) -> None:
    """What the nodes would refuse after the model is built, refused first (ValueError naming the flag):
    nothing is written and nothing is built for a run that cannot happen."""
    from ..nodes.sampler import MAX_SEED, size_problem
    from ..pipelines.loader import family_for

    problem = family_for(spec.pipeline).frames_error(frames)
    if problem:
        raise ValueError(problem.replace(f"frames={frames}", f"--frames {frames}"))
    problem = _rotary_table_error(args.variant, spec, width, height)
    if problem:
        raise ValueError(problem)
    for name, value in (("width", width), ("height", height)):
        problem = size_problem(name, value)  # the Sampler's own check: the grid every model shares
        if problem:
            raise ValueError(problem.replace(f"{name}={value}", f"--size {name} {value}", 1))
    if args.steps < 1:
        raise ValueError(f"--steps {args.steps} must be at least 1.")
    if args.offload == "block_swap" and args.blocks_to_swap < 1:
        raise ValueError(f"--blocks-to-swap {args.blocks_to_swap} must be at least 1 for --offload block_swap.")
    blocks = spec.transformer_config["num_layers"]  # each tiny denoiser's block count (both experts alike)
    if args.offload == "block_swap" and args.blocks_to_swap > blocks:
        raise ValueError(f"--blocks-to-swap {args.blocks_to_swap} is more than --variant {args.variant}'s {blocks} "
                         f"transformer blocks; use 1..{blocks} (or --offload sequential to stream every layer).")
    if not 0 <= args.seed <= MAX_SEED:
        raise ValueError(f"--seed {args.seed} must be from 0 to {MAX_SEED}, as the Video Sampler takes.")
    if args.out.exists() and not args.out.is_dir():
        raise ValueError(f"--out {args.out} is a file, not a folder; give a folder for demo.mp4 and receipt.json.")
    problem = unwritable_folder(args.out)  # last: the checks above leave no folder behind
    if problem:
        raise ValueError(f"--out {args.out}: cannot write there ({problem}); give a writable folder.")


def _rotary_table_error(variant: str, spec, width: int, height: int) -> str | None:
    """A size beyond the denoiser's positional table (CogVideoX 1.5's rotary table, Wan's rope_max_seq_len), as
    the Sampler refuses it (pipelines/family.positions_error), but from the tiny spec's config: before building."""
    from ..pipelines.family import positions_error
    from ..pipelines.loader import family_for

    family = family_for(spec.pipeline)
    if family.max_positions(spec.transformer_config) is None:
        return None
    problem = positions_error(family, spec.transformer_config, _spatial_factor(spec.vae_config), 1,
                              f"--variant {variant}", width, height, 1)  # one frame: the variants' own counts
    return problem and (problem.replace(f"width={width}", f"--size width {width}", 1)
                        .replace(f"height={height}", f"--size height {height}", 1).removesuffix(".")
                        + f" (its own size is {spec.width}x{spec.height}).")


def _spatial_factor(vae: dict) -> int:
    """The pipeline's vae_scale_factor_spatial, read from the tiny VAE's config as each pipeline reads it."""
    if "scale_factor_spatial" in vae:  # Wan 2.2's
        return vae["scale_factor_spatial"]
    if "temperal_downsample" in vae:  # Wan 2.1's (diffusers' spelling)
        return 2 ** len(vae["temperal_downsample"])
    return 2 ** (len(vae["block_out_channels"]) - 1)  # CogVideoX's


def _run_nodes(folder: Path, args: argparse.Namespace, width: int, height: int, frames: int):
    """The same node classes ComfyUI runs, called in graph order."""
    from ..nodes import NODE_CLASS_MAPPINGS as N

    (pipeline,) = N["VidMemLoadPipeline"]().load(model="", dtype="fp32", path=str(folder))
    blocks = args.blocks_to_swap if args.offload == "block_swap" else 0
    strategy = N["VidMemMemoryStrategy"]().build(
        offload=args.offload, blocks_to_swap=blocks, prefetch_blocks=1, max_pinned_ram_gb=-1.0, non_blocking=True,
        text_encoder="offload_after_encoding",
        vae_slicing=False, vae_tiling=True, tile_size=64, overlap=16, temporal_size=8, temporal_overlap=4,
    )["result"][0]
    sampled = N["VidMemVideoSampler"]().sample(
        pipeline, strategy, "a lighthouse at dusk", "", width, height, frames, args.steps, 5.0, args.seed
    )
    decoded = N["VidMemVAEDecode"]().decode(pipeline, sampled["result"][0], strategy)
    receipt = {
        # the variant, not the temporary folder it was built in (deleted when the demo ends)
        "model": replace(pipeline, source=f"vidmem's built-in tiny --variant {args.variant}").describe(),
        "sampler": sampled["ui"]["vidmem_receipt"][0],
        "decode": decoded["ui"]["vidmem_receipt"][0],
        "free": N["VidMemFreeVRAM"]().free(decoded["result"][0])["ui"]["vidmem_receipt"][0],
    }
    return decoded["result"][0], receipt


def write_mp4(frames, path: Path, fps: int = 8) -> Path:
    """IMAGE frames [F, H, W, 3] in 0..1 -> an H.264 mp4 (even sizes, yuv420p, as core SaveVideo)."""
    import av

    pixels = (frames.clamp(0, 1) * 255).round().byte().cpu().numpy()
    with av.open(str(path), mode="w", format="mp4") as container:  # the name may not end in .mp4 (a partial file)
        stream = container.add_stream("h264", rate=fps)
        stream.width, stream.height = pixels.shape[2], pixels.shape[1]
        stream.pix_fmt = "yuv420p"
        for frame in pixels:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return path
