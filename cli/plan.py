"""`vidmem plan`: what fits, before anything is downloaded or run.

    vidmem plan --model wan2.1-t2v-14b --size 1280x720 --frames 81 --vram 12 --ram 32
    vidmem plan --model ~/models/CogVideoX-2b --size 720x480 --frames 49 --vram 8 --json
    vidmem plan --model wan2.2-t2v-a14b --weights fp8_scaled --size 832x480 --frames 81 --vram 8 --ram 32
    vidmem plan --model wan2.1-t2v-14b --size 1280x720 --frames 81 --vram 24 --ram 256 --gpus 4

Prints one row per strategy tier (each with the fewest swapped blocks, the text encoder placement
and the VAE tiling that fit) with predicted peak VRAM per stage, peak RAM and estimated slowdown,
and marks the recommendation: the fastest row that fits. When the weights overrun the RAM budget,
the same tiers follow with the weights on disk (memory-mapped: page cache, which the kernel
reclaims, instead of anonymous RAM; slower when the page cache cannot keep them). With `--gpus N`
(plan_parallel.py) the rows are per GPU, with the time and speedup against one GPU. `--weights`
never changes on its own: when nothing fits, the message says which storage or tier would.
Exit status: 0 when something fits, 1 when nothing does (the message says what would), 2 for bad input.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys

from .plan_parallel import add_parallel_arguments, run_parallel_plan, wants_parallel
from .plan_train import (GIB_NUMBER, add_train_arguments, number_of, refuse_sampling_flags, refuse_training_flags,
                         run_train_plan)

# Not vidmem.memory.units.GiB: importing vidmem.memory loads torch, and `vidmem --help` and
# `vidmem queue` import this module without needing it.
GIB = 1 << 30


def add_plan_parser(subparsers) -> argparse.ArgumentParser:
    plan = subparsers.add_parser("plan", help="predict VRAM/RAM per stage and pick the strategy that fits",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    plan.add_argument("--model", help="a built-in model (see --list-models) or a diffusers folder")
    plan.add_argument("--list-models", action="store_true", help="print the built-in models and exit")
    plan.add_argument("--size", help="WIDTHxHEIGHT (default: the model's own)")
    plan.add_argument("--frames", type=int, help="frames to generate (default: the model's own)")
    plan.add_argument("--vram", type=GIB_NUMBER, help="GPU memory budget in GiB (default: this machine's GPU)")
    plan.add_argument("--ram", type=GIB_NUMBER, help="RAM budget in GiB (default: this machine's total RAM)")
    plan.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), help="compute dtype (default: the model's own)")
    plan.add_argument("--vae-dtype", choices=("bf16", "fp16", "fp32"),
                      help="the VAE's compute dtype when it differs (fp32 for quality, as diffusers' Wan docs do)")
    # No `choices=`: argparse formats choices when the argument is added, and the names live in the engine,
    # which imports torch (`vidmem queue` and `--help` must not); run_plan checks the name (_check_weights).
    plan.add_argument("--weights", help="storage of the transformer(s) and text encoder, upcast per layer to the "
                      "compute dtype: fp16, bf16, fp8_e4m3fn, fp8_scaled, gguf_q8_0, ... (default: the compute "
                      "dtype); the VAE keeps its dtype")
    plan.add_argument("--disk", action="store_true", help="weights stay memory-mapped in their files (disk tier): "
                      "page cache instead of RAM, read from the disk again when RAM cannot keep them")
    plan.add_argument("--disk-gbps", type=number_of("GB/s", "3"), help="sequential read rate of the disk in GB/s, for "
                      "the time estimate (default: a mid-range NVMe SSD, printed under the table; a SATA SSD reads ~0.5)")
    plan.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                      help="what computes: a GPU (default), or the CPU, where memory-mapped weights are used in place "
                           "and upcasts run at the CPU's rate")
    plan.add_argument("--window", type=int, default=0, help="context windows: denoise this many video frames at a "
                      "time (on the model's frame grid, e.g. 81 for Wan); 0: the whole clip at once")
    plan.add_argument("--window-overlap", type=int, default=0, help="video frames two neighbouring context windows "
                      "share and blend (a multiple of 4, smaller than --window)")
    plan.add_argument("--steps", type=int, default=50, help="denoising steps, 1-1000 as the Sampler takes (time "
                      "estimate only)")
    plan.add_argument("--batch", type=int, default=1, help="videos per prompt")
    plan.add_argument("--cache", choices=("off", "mag_cache", "taylor_seer"), default="off",
                      help="mag_cache: also say how many steps MagCache with the model's published ratios computes; "
                           "taylor_seer: how many TaylorSeer computes at its defaults (interval 5, warm-up 3, order 1); "
                           "either way the rows hold the cache's state on the device")
    plan.add_argument("--no-cfg", action="store_true", help="guidance scale 1: no negative-prompt pass")
    plan.add_argument("--text-encoder", default="offload_after_encoding",
                      choices=("device", "offload_after_encoding", "cpu"), help="starting text encoder placement")
    plan.add_argument("--prefetch", type=int, default=1, help="streamed blocks copied ahead")
    plan.add_argument("--activation-chunks", default="auto", help="token slices per transformer block: auto (the "
                      "fewest that fit), off, or 2, 4, 8, 16, 32, 64 as the Memory Strategy node offers (same video, "
                      "lower denoise peak)")
    plan.add_argument("--allocator", choices=("native", "cudaMallocAsync"),
                      help="CUDA allocator backend: native = PyTorch's caching allocator (plain scripts; the "
                           "default); cudaMallocAsync = ComfyUI's default on CUDA builds (modelled as live bytes), "
                           "what its Memory Strategy node plans with there")
    plan.add_argument("--attention", default="fused", choices=("fused", "math"),
                      help="fused = flash/memory-efficient kernels; math = score matrix materialised")
    plan.add_argument("--compile", action="store_true", help="the Speed node's compile on: the time estimate uses "
                      "compiled blocks' step time where bench/speed.py measured it on this machine's device")
    plan.add_argument("--fp8-matmul", default="off", choices=("off", "auto", "on"),
                      help="the Speed node's fp8_matmul (with fp8 --weights): 'on' multiplies fp8 layers in fp8, "
                           "timed as measured on this machine's device")
    plan.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_train_arguments(plan)
    add_parallel_arguments(plan)
    return plan


def run_plan(args: argparse.Namespace) -> int:
    from ..pipelines.configs import defaults, load_model, model_names

    if args.list_models:
        print("\n".join(model_names()))
        return 0
    if not args.model:
        raise ValueError("--model is required: a built-in model (vidmem plan --list-models) or a diffusers folder.")
    from ..memory.accounting import Attention
    from ..memory.plan.planner import Allocator, PlanOptions, VideoShape, candidate_plans, recommended
    from ..memory.plan.advice import nothing_fits_message
    from ..memory.plan.costs import NVME_BYTES_PER_S, MeasuredSpeed
    from ..pipelines.speed import measured_speed
    from ..memory.strategy import MemoryStrategy

    _check_numbers(args)
    _check_weights(args.weights)
    refuse_sampling_flags(args)
    refuse_training_flags(args)
    model = load_model(args.model, args.dtype, args.vae_dtype)
    own = defaults(args.model)
    width, height = parse_size(args.size) if args.size else (own.get("width"), own.get("height"))
    frames = own.get("frames") if args.frames is None else args.frames
    if width is None or frames is None:
        raise ValueError("--size and --frames are required for a model folder (e.g. --size 832x480 --frames 81).")
    shape = VideoShape(width, height, frames, batch=args.batch, cfg=not args.no_cfg,
                       **_windows(model, frames, args.window, args.window_overlap))
    vram, ram = _budgets(args)
    parallel = wants_parallel(args)
    if args.train:  # a training step: no guidance pass, no text encoder or VAE on the device
        return run_train_plan(args, model, VideoShape(width, height, frames, batch=args.batch, cfg=False), vram, ram)
    disk_gbps = NVME_BYTES_PER_S / 1e9 if args.disk_gbps is None else args.disk_gbps
    storage = model.layout.stored_as(args.weights) if args.weights else {}
    speed = _speed(args)
    options = PlanOptions(attention=Attention(args.attention), allocator=Allocator(args.allocator or "native"), steps=args.steps,
                          storage=storage, on_disk=args.disk, disk_bytes_per_s=disk_gbps * 1e9,
                          device=args.device, speed=measured_speed(speed, args.device, context_parallel=_splits(args))
                          if speed else MeasuredSpeed(),
                          cache_state=_cache_state(model, args.cache))
    base = MemoryStrategy(text_encoder=args.text_encoder, prefetch_blocks=args.prefetch,
                          activation_chunks=args.activation_chunks)
    if parallel:
        return run_parallel_plan(args, model, shape, vram, ram, base, options)
    plans = candidate_plans(model, shape, vram, ram, base, options)
    best = recommended(plans)
    message = None if best is not None else nothing_fits_message(model, shape, plans, base, options)
    if args.json:
        print(json.dumps({"model": model.name, "size": [width, height], "frames": frames, "window": shape.window,
                          "window_overlap": shape.window_overlap, "dtype": model.dtype_name,
                          "vae_dtype": model.vae_dtype_name or model.dtype_name,
                          "weights": args.weights or model.dtype_name, "disk_gbps": disk_gbps,
                          "device": options.device, "steps": args.steps, "ram_bytes": ram,
                          # on the CPU the compute's budget is the RAM's: no VRAM budget was used
                          "vram_bytes": None if options.on_cpu else vram, "allocator": options.allocator.value,
                          **({"speed": _speed_line(speed, model, options)} if speed else {}),
                          **_json_notes(args, model, shape, plans, best, options),
                          "strategies": [_json_row(p, shape) for p in plans],
                          "recommended": best, **({"message": message} if message else {})}, indent=2))
    else:
        print(_table(model, shape, vram, ram, plans, best, options))
        if shape.window:
            print("\n" + window_line(model, shape))
        if best is not None and options.device != "cpu":
            print("\n" + _warm_line(model, plans[best]))
        if args.allocator is None and options.device != "cpu":
            print(f"\n{ALLOCATOR_NOTE}")
        if args.cache != "off":
            print("\n" + _cache_line(model, args.steps, shape, plans[best] if best is not None else None, args.cache))
        if speed:
            print("\nspeed: " + _speed_line(speed, model, options))
        if message:
            print(f"\n{message}")
    return 0 if best is not None else 1


def _speed(args: argparse.Namespace):
    """The Speed node's choices --compile and --fp8-matmul stand for (attention as the model has it); None without them."""
    from ..pipelines.compile import CompileSettings
    from ..pipelines.speed import Speed

    if not args.compile and args.fp8_matmul == "off":
        return None
    return Speed(compile=CompileSettings(args.compile), fp8_matmul=args.fp8_matmul)


def _speed_line(speed, model, options) -> str:
    """The Memory Strategy chart's speed line: what the choices resolve to on the plan's device, and what was measured
    there; fp8 matmul as the weights are stored (--weights)."""
    from ..pipelines.speed import speed_plan_line

    masked_by = model.spec.name if model.spec.attention_masked else ""
    stored = {options.storage_of(name) for name in model.layout.denoisers} - {None}
    return speed_plan_line(speed, options.device, model.dtype, masked_by, storage=tuple(stored))


def _check_numbers(args: argparse.Namespace) -> None:
    """The numeric flags and --activation-chunks, before a model is built: ValueError naming the flag.
    Budgets and the disk rate must be finite and positive (inf would plan an unbounded machine, nan
    compares false with every limit); frames and steps take the Sampler's ranges."""
    from ..nodes.strategy import CHUNK_CHOICES  # the Memory Strategy node's own choices

    for flag, value, example in (("--vram", args.vram, "12"), ("--ram", args.ram, "32"), ("--disk-gbps", args.disk_gbps, "3")):
        if value is not None and not (math.isfinite(value) and value > 0):
            unit = "a read rate in GB/s" if flag == "--disk-gbps" else "a budget in GiB"
            raise ValueError(f"{flag} {value} must be a positive finite number, {unit}, e.g. {flag} {example}.")
    if args.frames is not None and args.frames < 1:
        raise ValueError(f"--frames {args.frames} must be at least 1 (or leave it out for the model's own).")
    if not 1 <= args.steps <= 1000:
        raise ValueError(f"--steps {args.steps} must be from 1 to 1000, as the Video Sampler takes.")
    if args.activation_chunks not in CHUNK_CHOICES:
        raise ValueError(f"--activation-chunks {args.activation_chunks} must be one of {', '.join(CHUNK_CHOICES)}, "
                         "as the Memory Strategy node offers.")


def _check_weights(name: str | None) -> None:
    """--weights is one of the engine's storage formats (ValueError listing them)."""
    from ..memory.storage import FORMATS

    if name is not None and name not in FORMATS:
        raise ValueError(f"--weights {name!r} is not a storage vidmem knows; use one of {', '.join(FORMATS)}.")


# Engine and node inputs as the commands spell them, for messages the CLI passes on (the engine says "name=value").
FLAGS = {"prefetch_blocks": "--prefetch", "activation_chunks": "--activation-chunks", "batch": "--batch",
         "frames": "--frames", "steps": "--steps", "text_encoder": "--text-encoder",
         "width": "--size width", "height": "--size height", "seed": "--seed", "context_parallel": "--cp",
         "gpus": "--gpus"}


def in_flag_spelling(message: str) -> str:
    """An engine message with every 'name=' of an input a flag sets written as that flag ('--prefetch -1', 'with
    --cp ring'). Not 'gpus=cpu:N': CPU processes are the node's choice, which no flag of vidmem plan takes. Only a
    name that starts a word of the message (after a space or '(', or at its start): a path the message quotes may hold
    a folder named 'seed=7', which must come back as it was."""
    return re.sub(r"(?<![^\s(])(\w+)=(?!cpu:)", lambda m: f"{FLAGS[m.group(1)]} " if m.group(1) in FLAGS else m.group(0),
                  message)


def _windows(model, frames: int, window: int, overlap: int) -> dict:
    """--window/--window-overlap checked as the Sampler checks them (ValueError naming the fix)."""
    from ..pipelines.context_windows import ContextWindows, window_problem

    config = model.components[model.layout.denoisers[0]].config
    problem = window_problem(model.spec.name, config, ContextWindows(window, overlap), frames, model.spec.frames_error,
                             model.geometry.temporal_factor)
    if problem:
        for name, flag in WINDOW_FLAGS:
            problem = problem.replace(name, flag)
        raise ValueError(problem)
    return {"window": window, "window_overlap": overlap}


# The Sampler's window inputs as the plan command spells them, in its messages' every form
# ("window_overlap=16", "set window (e.g. 81)", "window_overlap to 0"); the longer name first.
WINDOW_FLAGS = (("window_overlap=", "--window-overlap "), ("window_overlap to", "--window-overlap to"),
                ("window=", "--window "), ("set window ", "set --window "))


def window_line(model, shape) -> str:
    """What the windows change in the plan, in words."""
    from ..memory.windows import WindowSchedule

    if not shape.window:
        return ""
    if not shape.windowed:
        return f"--window {shape.window} covers all {shape.frames} frames: planned as one clip, no windows."
    latent = model.latent_shape(shape)[2]
    schedule = WindowSchedule(latent, model.latent_shape(shape.one_window())[2],
                              shape.window_overlap // model.geometry.temporal_factor)
    return (f"context windows: {schedule.count} windows of {shape.window} frames, {shape.window_overlap} shared "
            f"(latent frames {', '.join(schedule.describe())}); the denoise peak follows one {shape.window}-frame window, "
            f"each step runs {schedule.count} passes; latents and decode are the whole {shape.frames} frames.")


def _table(model, shape, vram: int, ram: int, plans, recommended: int | None, options) -> str:
    stored = dict(options.storage)
    weights = f"weights {next(iter(stored.values()))}" if stored else "weights at the compute dtype"
    vae = f", VAE {model.vae_dtype_name}" if model.vae_dtype_name else ""
    from ..memory.plan.candidates import _gib  # a tiny budget keeps its digits ("0.001 GiB", not "0.0")

    head = (f"{model.name} ({model.dtype_name}{vae}, {weights}) {shape.width}x{shape.height}, {shape.frames} frames; "
            + (f"budget {_gib(ram)} RAM (the CPU computes)" if options.on_cpu else
               f"budget {_gib(vram)} VRAM, {_gib(ram)} RAM; {options.allocator.value} allocator"))
    from ..memory.plan.candidates import tiles_text, times_differ
    from ..memory.plan.costs import TIME_RESOLUTION
    from ..memory.strategy import TextEncoderPlacement

    timed = times_differ(plans)  # else every row would read about x1.00: one line below says so instead
    columns = ("strategy", "text enc.", "VAE tiles", "encode", "denoise", "decode",
               "peak compute" if options.on_cpu else "peak VRAM", "peak RAM",
               "page cache", "slowdown", "fits")
    rows = [columns]
    for plan in plans:
        s = plan.strategy
        tier = s.offload.value + (f" {s.blocks_to_swap}" if s.blocks_to_swap else "") + (" +disk" if plan.on_disk else "")
        tier += f" chunks {s.activation_chunks}" if s.activation_chunks != 1 else ""
        tiles = tiles_text(s.vae_tiling, shape.frames)
        stages = [f"{plan.stage(n).device_bytes / GIB:.1f}" for n in ("text_encode", "denoise", "decode")]
        rows.append((tier, s.text_encoder.value.replace("offload_after_encoding", "offload"), tiles, *stages,
                     f"{plan.peak_vram_bytes / GIB:.1f} GiB", f"{plan.peak_ram_bytes / GIB:.1f} GiB",
                     f"{plan.peak_page_cache_bytes / GIB:.1f} GiB" if plan.on_disk else "-",
                     f"x{plan.est_slowdown:.2f}", "yes" if plan.fits else "no"))
    if not timed:
        rows = [row[:9] + row[10:] for row in rows]
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    lines = [head, ""]
    for index, row in enumerate(rows):
        mark = "  <- recommended" if recommended is not None and index - 1 == recommended else ""
        lines.append("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip() + mark)
    if options.device == "cpu":
        lines.append("\nThe CPU computes: the VRAM columns are the RAM the compute holds (no CUDA context; memory-mapped "
                     "weights are read in place), and the RAM column counts it too: that is what fits the RAM budget; "
                     "block swap rows show the fewest blocks that fit.")
    else:
        lines.append("\nVRAM per stage in GiB, including the CUDA context; block swap rows show the fewest blocks that fit.")
    if any(plan.strategy.vae_tiling for plan in plans):
        lines.append(TILES_NOTE)
    where = "nothing streamed" if options.device == "cpu" else "every weight on the GPU"
    if timed:
        lines.append(f"slowdown: estimated time against the same run with {where} and the decode in one piece.")
    else:
        times = [plan.est_slowdown for plan in plans]
        lines.append(f"No slowdown column: every row takes x{min(times):.2f}-x{max(times):.2f} the time of the same run with "
                     f"{where}, within {TIME_RESOLUTION:.0%} of each other: closer than the time model can tell apart.")
    encoded_on_cpu = [plan for plan in plans if plan.strategy.text_encoder is TextEncoderPlacement.CPU]
    if timed and options.device != "cpu" and encoded_on_cpu and encoded_on_cpu[0].baseline_seconds:
        lines.append(_cpu_encode_line(encoded_on_cpu[0]))
    if any(plan.on_disk for plan in plans):
        lines.append(f"+disk: weights memory-mapped from their files. Peak RAM is anonymous memory, what must fit; the "
                     f"page cache holds the files and is reclaimable, so what the budget cannot keep is read again "
                     f"from the disk at {options.disk_bytes_per_s / 1e9:g} GB/s (--disk-gbps), in the time estimate.")
    return "\n".join(lines)


TILES_NOTE = ("VAE tiles: the decode's tile side in pixels / frames per temporal tile (all: the whole clip in one); "
              "\"-\": the decode runs untiled.")


def _cpu_encode_line(plan) -> str:
    """Why rows with the text encoder on the CPU are slower: what encoding there adds to the run, as the time model has it
    (its seconds less what the same FLOPs take on the GPU, in the baseline). `plan`: the first such row; a +disk row
    may read the encoder's weights at another rate, a difference this one line leaves out."""
    from ..memory.plan.costs import DEVICE_FLOPS_PER_S, HOST_FLOPS_PER_S

    stage = plan.stage("text_encode")
    on_gpu_share = HOST_FLOPS_PER_S / DEVICE_FLOPS_PER_S
    added = stage.seconds(plan.disk_read(stage)) * (1 - on_gpu_share) / plan.baseline_seconds
    return (f"text enc. cpu: the prompt is encoded on the CPU, which alone adds about {added:.0%} to those rows' time "
            f"(the CPU assumed at {HOST_FLOPS_PER_S / 1e12:g} TFLOP/s, the GPU at {DEVICE_FLOPS_PER_S / 1e12:g}).")


def _warm_line(model, plan) -> str:
    """The cold case and the warm case of the recommended row: what its first run uploads before it
    can denoise, which later runs of the same graph keep on the GPU (docs/warm-runs.md)."""
    kept = uploaded_weight_bytes(model, plan)
    rate, source = first_upload_rate(plan)
    streams = " (the streamed blocks still stream every step)" if plan.strategy.streams_blocks else ""
    seconds = kept / rate
    took = f"about {seconds:.1f} s" if seconds >= 0.05 else "under 0.1 s"  # never "about 0.0 s"
    size = f"{kept / GIB:.1f} GiB" if kept >= GIB // 20 else f"{kept / 2**20:.0f} MiB"  # never "0.0 GiB"
    return (f"Cold and warm: the recommended row's first run uploads {size} of weights before it "
            f"denoises ({took} at {rate / 1e9:g} GB/s, {source}); later runs of the "
            f"same graph find them on the GPU{streams}, unless ComfyUI took the memory back or, under tier model, a "
            "text encoder on the GPU evicted them (docs/warm-runs.md).")


def uploaded_weight_bytes(model, plan) -> int:
    """Weight bytes the denoise stage puts on the GPU, less the upcast workspace of a stored layer
    (a temporary the layer computes with, made on the GPU: never uploaded, never kept)."""
    from ..memory.plan.stages import component_weights

    def uploaded(phase) -> int:
        component = phase.label.removesuffix(" (image)")
        workspace = component_weights(model, component, plan.options).transient_bytes if component in model.layout.all else 0
        return phase.weights_bytes - workspace

    return max((uploaded(p) for p in plan.stage("denoise").phases), default=0)


def first_upload_rate(plan) -> tuple[float, str]:
    """How fast the first run's weights reach the GPU, and from where: memory-mapped weights (the disk
    tier) come from a cold page cache, so the disk (--disk-gbps) sets the pace, not the PCIe copy."""
    from ..memory.plan.costs import PCIE_BYTES_PER_S

    if plan.on_disk and plan.options.disk_bytes_per_s < PCIE_BYTES_PER_S:
        return plan.options.disk_bytes_per_s, "read from the disk (--disk-gbps): the page cache starts cold"
    return PCIE_BYTES_PER_S, "over PCIe"


def _cache_line(model, steps: int, shape, plan=None, method: str = "mag_cache") -> str:
    """MagCache's skips as published for this model at `steps` (or TaylorSeer's at its defaults; in each context
    window, with --window), and the time they save on `plan` (the recommended row; None where nothing fits)."""
    from ..pipelines.context_windows import ContextWindows
    from ..pipelines.step_cache import StepCache, cache_plan, cached_time_line, layout_key

    denoisers = {name: (c.config["num_layers"], c.config) for name, c in model.components.items() if name.startswith("transformer")}
    windows = ContextWindows(shape.window, shape.window_overlap).count(shape.frames, model.geometry.temporal_factor)
    cache = StepCache(method) if method == "taylor_seer" else None  # None: MagCache as published
    planned = cache_plan(layout_key(model.pipeline_class, denoisers), steps, list(denoisers), cache, windows=windows)
    if plan is None or planned.share is None:
        return planned.text
    return f"{planned.text}\n{cached_time_line(plan, planned.share)}"


ALLOCATOR_NOTE = ("allocator: planned for PyTorch's caching allocator, as plain scripts run; ComfyUI on a CUDA build "
                  "runs cudaMallocAsync by default and its Memory Strategy node plans for that (lower peaks): "
                  "--allocator cudaMallocAsync gives its figures.")


def _json_row(plan, shape) -> dict:
    """A row of --json: the plan's figures, with the strategy and VAE tiles as the table writes them (a script can
    rebuild the Memory Strategy from them)."""
    from ..memory.plan.candidates import tiles_text

    return {**plan.as_dict(), "strategy": plan.strategy.describe(),
            "vae_tiles": tiles_text(plan.strategy.vae_tiling, shape.frames)}


def _json_notes(args: argparse.Namespace, model, shape, plans, best: int | None, options) -> dict:
    """The paragraphs the table prints under it, for --json: windows, the cold and warm case, the step cache."""
    notes = {}
    if shape.window:
        notes["windows"] = window_line(model, shape)
    if best is not None and not options.on_cpu:
        notes["warm"] = _warm_line(model, plans[best])
    if args.cache != "off":
        notes["cache"] = {"method": args.cache, "text": _cache_line(model, args.steps, shape,
                                                                   plans[best] if best is not None else None, args.cache)}
    return notes


def _splits(args: argparse.Namespace) -> bool:
    """Context parallelism across --gpus (compiled blocks are refused there, so none is credited)."""
    return (args.gpus or 1) > 1 and args.cp != "balanced"


def _cache_state(model, method: str) -> dict:
    """What `--cache` keeps on the device per denoiser beside the activations (MagCache's state whatever its
    ratios say it skips)."""
    from ..pipelines.step_cache import StepCache

    if method == "off":
        return {}
    cache = StepCache(method, calibrate=True) if method == "mag_cache" else StepCache(method)
    return cache.planned_state(model.layout.denoisers)


def _budgets(args: argparse.Namespace) -> tuple[int, int]:
    ram = args.ram  # a given budget was checked (_check_numbers)
    if ram is None:
        import psutil

        ram = psutil.virtual_memory().total / GIB
    vram = args.vram
    if vram is None and args.device == "cpu":
        vram = ram  # the CPU computes from RAM: no GPU to ask (PlanOptions.compute_budget reads the RAM budget)
    if vram is None:
        import torch

        if not torch.cuda.is_available():
            raise ValueError("no GPU here: give the budget to plan for, e.g. --vram 12 (GiB).")
        vram = torch.cuda.mem_get_info()[1] / GIB
    return int(vram * GIB), int(ram * GIB)


def parse_size(text: str) -> tuple[int, int]:
    """--size WIDTHxHEIGHT, for every vidmem subcommand that takes one."""
    try:
        width, height = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"--size {text!r} must look like WIDTHxHEIGHT, e.g. 1280x720.") from None
    return width, height


def main(argv: list[str] | None = None) -> int:
    """`vidmem plan` alone, for callers in Python: `main(["plan", "--list-models"])`."""
    parser = argparse.ArgumentParser(prog="vidmem")
    add_plan_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return run_plan(args)
    except ValueError as error:
        print(f"vidmem: {in_flag_spelling(str(error))}", file=sys.stderr)
        return 2
