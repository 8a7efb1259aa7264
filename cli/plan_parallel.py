"""`vidmem plan --gpus N`: each GPU's peak and the time on N GPUs, against one GPU.

    vidmem plan --model wan2.1-t2v-14b --size 1280x720 --frames 81 --vram 24 --ram 256 --gpus 4
    vidmem plan --model wan2.1-t2v-14b --vram 80 --ram 512 --gpus 8 --interconnect nvlink --json
    vidmem plan --model cogvideox-5b --vram 16 --ram 64 --gpus 2 --cp balanced

One row per tier as on one GPU, the figures per GPU (every rank of a context-parallel run holds all
the weights and encodes the prompt; only the transformer's sequence is split; the decode runs once,
on GPU 0),
then the recommended row GPU by GPU. Like this module's parent, nothing here imports torch at
module import: `vidmem --help` stays light.
"""

from __future__ import annotations

import argparse
import json
import math

from .plan_train import given_flags, number_of

GIB = 1 << 30


def add_parallel_arguments(plan: argparse.ArgumentParser) -> None:
    plan.add_argument("--gpus", type=int, help="plan for N GPUs (per-GPU peaks, time and speedup against one GPU)")
    plan.add_argument("--cp", choices=("ulysses", "ring", "balanced"), default="ulysses",
                      help="with --gpus: ulysses or ring context parallelism (the transformer's sequence split "
                           "across the GPUs), or balanced (whole components on different GPUs, nothing split)")
    # No `choices=`: argparse formats choices when the argument is added, and the names live in the
    # planner, which imports torch; they are checked in run_parallel_plan instead.
    plan.add_argument("--interconnect", default="pcie4",
                      help="link between the GPUs for the all-to-all time: pcie4 (25 GB/s per GPU, the default), "
                           "pcie5 (50), nvlink (300)")
    plan.add_argument("--interconnect-gbps", type=number_of("GB/s", "25"), help="the link's bandwidth per GPU in GB/s, "
                      "if you know it (GeForce cards without peer-to-peer reach about half of pcie4)")


# Flags that shape a plan on several GPUs and that one GPU's plan has no use for: (flag, its value, its default).
PARALLEL_ONLY = (("--cp", "cp", "ulysses"), ("--interconnect", "interconnect", "pcie4"),
                 ("--interconnect-gbps", "interconnect_gbps", None))


def wants_parallel(args: argparse.Namespace) -> bool:
    """--gpus 2 or more; --gpus 1 is the single-GPU plan, unchanged."""
    if args.gpus is not None and args.gpus < 1:
        raise ValueError(f"--gpus {args.gpus} must be at least 1.")
    if args.gpus == 1 and args.cp == "balanced":
        raise ValueError("--cp balanced needs --gpus 2 or more (whole components on different GPUs).")
    if (args.gpus or 1) == 1:
        _refuse_parallel_flags(args)
        return False
    if args.gpus > 1 and args.train:
        raise ValueError("--gpus plans inference; --train plans one GPU's training step (drop --gpus).")
    if args.gpus > 1 and args.device == "cpu":
        raise ValueError(f"--device cpu plans the CPU computing; --gpus {args.gpus} plans GPUs (drop one of them).")
    if args.gpus > 1 and args.cache != "off":
        raise ValueError(f"--cache {args.cache} is planned on one GPU only; drop it with --gpus {args.gpus} (or plan "
                         "without --gpus to see the steps it skips).")
    return args.gpus > 1


def _refuse_parallel_flags(args: argparse.Namespace) -> None:
    """A several-GPU flag in one GPU's plan: ValueError naming them, rather than a plan that silently ignored them."""
    given = given_flags(args, PARALLEL_ONLY)
    if given:
        one = f"with --gpus {args.gpus}" if args.gpus else "without --gpus"
        raise ValueError(f"{', '.join(given)} {'plans' if len(given) == 1 else 'plan'} a run on several GPUs; {one} the "
                         f"plan is one GPU's, which has no use for {'it' if len(given) == 1 else 'them'} (give --gpus 2 "
                         f"or more, or drop {', '.join(given)}).")


def run_parallel_plan(args, model, shape, vram: int, ram: int, base, options) -> int:
    from ..memory.plan.parallel import (INTERCONNECTS, RANK_STORAGE, MultiGpu, context_parallel_refusal,
                                        parallel_candidates, parallel_recommended)

    if args.interconnect not in INTERCONNECTS:
        raise ValueError(f"--interconnect {args.interconnect!r} is not one vidmem knows; use {', '.join(INTERCONNECTS)}, "
                         "or give the bandwidth with --interconnect-gbps.")
    link = INTERCONNECTS[args.interconnect]
    if args.interconnect_gbps is not None:
        if not (math.isfinite(args.interconnect_gbps) and args.interconnect_gbps > 0):  # inf: collectives for free
            raise ValueError(f"--interconnect-gbps {args.interconnect_gbps} must be a positive finite number, e.g. 25 "
                             "for PCIe 4.0 x16.")
        link = type(link)(f"a {args.interconnect_gbps:g} GB/s link (--interconnect-gbps)", args.interconnect_gbps * 1e9,
                          link.latency_s)
    layout = MultiGpu(args.gpus, args.cp, link)
    if args.cp != "balanced":
        _refuse_windows(shape, args.gpus)
    refusal = None if args.cp == "balanced" else context_parallel_refusal(model, args.cp)
    if refusal:  # the runtime's words, and the planner's way to what they suggest
        raise ValueError(f"{refusal} To plan that: vidmem plan --gpus {args.gpus} --cp balanced.")
    plans, single = parallel_candidates(model, shape, vram, ram, layout, base, options)
    best = parallel_recommended(plans)
    message = None if best is not None else _nothing_fits(plans, layout, vram, ram, single, args.disk)
    if args.json:
        print(json.dumps({"model": model.name, "size": [shape.width, shape.height], "frames": shape.frames,
                          "dtype": model.dtype_name, "weights": args.weights or model.dtype_name, "gpus": layout.gpus,
                          "cp": layout.mode.value, "interconnect": {"name": link.name, "gbps": link.bytes_per_s / 1e9},
                          "vram_per_gpu_bytes": vram, "ram_bytes": ram,
                          **({} if layout.mode.value == "balanced" else {"rank_weights": RANK_STORAGE}),
                          "single_gpu": None if single is None else single.as_dict(),
                          "strategies": [p.as_dict() for p in plans], "recommended": best,
                          **({"message": message} if message else {})}, indent=2))
    else:
        print(_table(model, shape, layout, vram, ram, plans, best, single))
        if message:
            print(f"\n{message}")
    return 0 if best is not None else 1


def _refuse_windows(shape, gpus: int) -> None:
    """Context windows under context parallelism, refused by the Sampler's own rule (a window covering the clip
    runs as one clip; balanced placement splits nothing and takes windows): a plan of a run that cannot start."""
    from ..pipelines.sample_checks import refuse_windows_in_parallel

    try:
        refuse_windows_in_parallel(shape)
    except ValueError:
        raise ValueError(f"--window {shape.window}: context windows do not run with context parallelism yet (the Video "
                         f"Sampler refuses them); drop --window, plan --gpus {gpus} --cp balanced, or plan one GPU "
                         "(without --gpus).") from None


def _table(model, shape, layout, vram: int, ram: int, plans, best, single) -> str:
    from ..memory.plan.candidates import tiles_text

    link = layout.interconnect
    head = (f"{model.name} ({model.dtype_name}) {shape.width}x{shape.height}, {shape.frames} frames on {layout.gpus} GPUs, "
            f"{layout.mode.value}" + ("" if layout.mode.value == "balanced" else f" over {link.name} "
                                      f"({link.bytes_per_s / 1e9:g} GB/s per GPU)")
            + f"; budget {vram / GIB:.1f} GiB VRAM per GPU, {ram / GIB:.1f} GiB RAM")
    one = ("one GPU: nothing fits" if single is None else
           f"one GPU: {_tier(single.strategy, single.on_disk)}, {_gib(single.peak_vram_bytes)} VRAM, x{single.est_slowdown:.2f} slowdown "
           f"(the speedup's reference)")
    columns = ("strategy per GPU", "text enc.", "VAE tiles", "encode", "denoise", "decode", "peak VRAM/GPU",
               "RAM (all)", "time", "speedup", "fits")
    rows = [columns]
    for plan in plans:
        s = plan.strategy
        stages = [f"{max(g.stage(n).device_bytes for g in plan.gpus) / GIB:.1f}" for n in ("text_encode", "denoise", "decode")]
        encoder = "GPU 1" if layout.mode.value == "balanced" else s.text_encoder.value.replace("offload_after_encoding", "offload")
        rows.append((_tier(s, plan.on_disk), encoder,
                     tiles_text(s.vae_tiling, shape.frames), *stages,
                     _gib(plan.per_gpu_peak_bytes), _gib(plan.host_bytes), f"{plan.seconds:.0f} s",
                     f"x{plan.speedup:.2f}" if plan.speedup else "-", "yes" if plan.fits else "no"))
    lines = [head, one, "", *_aligned(rows, best)]
    chosen = plans[best if best is not None else 0]
    lines += ["", f"Per GPU ({'recommended' if best is not None else 'leanest'} row):"]
    gpu_rows = [("GPU", "holds", "denoise weights", "activations", "NCCL", "encode", "denoise", "decode", "peak")]
    for g in chosen.gpus:
        gpu_rows.append((str(g.index), ", ".join(g.components) or "(idle)", _gib(g.weights_bytes),
                         _gib(g.denoise_activation_bytes), _gib(g.comm_bytes),
                         *(f"{g.stage(n).device_bytes / GIB:.1f}" for n in ("text_encode", "denoise", "decode")),
                         _gib(g.peak_bytes)))
    lines += _aligned(gpu_rows, None)
    lines += ["", *_notes(chosen, layout)]
    if any(plan.on_disk for plan in plans) or (single is not None and single.on_disk):
        lines.append("+disk: weights memory-mapped from their files. RAM (all) is anonymous memory, what must fit; the "
                     "page cache holds the files and is reclaimable, so what the budget cannot keep is read again from "
                     "the disk (--disk-gbps), in the time estimate.")
    return "\n".join(lines)


def _notes(plan, layout) -> list[str]:
    link = layout.interconnect
    if layout.mode.value == "balanced":
        return ["Balanced: the transformers on GPU 0 under the row's tier, the prompt encoder whole on GPU 1, the decode "
                "on GPU 0 afterwards (ComfyUI's device); nothing is split, so the time is one GPU's. VRAM per stage in "
                "GiB, including the CUDA context."]
    return [f"All-to-all: {plan.comm.total / 1e9:.2f} GB sent per GPU per transformer pass "
            f"({'q, k, v and the output' if layout.mode.value == 'ulysses' else 'keys and values gathered'} in every "
            f"block), {plan.comm_seconds:.0f} s of the run at {link.bytes_per_s / 1e9:g} GB/s (--interconnect, "
            f"--interconnect-gbps); diffusers waits for each collective, so it adds to compute.",
            "Every rank holds all the weights (its own offload tier) and encodes the prompt; the decode runs once, in "
            "ComfyUI's process on GPU 0. Activations include the collective's buffers; NCCL's buffers are an estimate.",
            "RAM (all): one process per GPU and the coordinating one, each with its own copy of the weights in RAM: "
            "ranks reopen the diffusers folder at its own dtype (no --disk or --weights rows until the ranks can open "
            "other storage)."]


def _nothing_fits(plans, layout, vram: int, ram: int, single, disk: bool) -> str:
    leanest = min(plans, key=lambda p: p.per_gpu_peak_bytes)
    head = (f"Nothing fits {layout.gpus} GPUs of {vram / GIB:.1f} GiB with {ram / GIB:.1f} GiB RAM: the leanest row needs "
            f"{_gib(leanest.per_gpu_peak_bytes)} per GPU and {_gib(leanest.host_bytes)} RAM. ")
    if layout.mode.value != "balanced":
        return head + ("Weights are replicated on every GPU, and every rank holds them in RAM (the folder at its own "
                       "dtype: context parallelism cannot use --weights or --disk yet): more RAM or VRAM per GPU, or "
                       "--cp balanced.")
    return head + _balanced_advice(leanest, vram, ram, single, disk)


def _balanced_advice(leanest, vram: int, ram: int, single, disk: bool) -> str:
    """What would fit, by what is over budget: the encoder's GPU holds the prompt encoder whole (neither
    a tier nor the disk lowers its VRAM), the transformers' GPU and the RAM follow the row's tier."""
    over = [g for g in leanest.gpus if g.peak_bytes > vram]
    one_gpu = ("" if single is None else f" One GPU of {vram / GIB:.1f} GiB fits: {_tier(single.strategy, single.on_disk)}, "
               f"{_gib(single.peak_vram_bytes)} (plan without --gpus); it can offload the prompt encoder.")
    disk_hint = "" if disk else ", or plan with --disk"
    whole = [g for g in over if g.index != 0]  # GPU 0 runs the row's tier; the others hold their components whole
    if whole:
        gpu = max(whole, key=lambda g: g.peak_bytes)
        return (f"GPU {gpu.index} holds {', '.join(gpu.components)} whole ({_gib(gpu.peak_bytes)}), which balanced "
                f"placement neither streams nor maps from disk: lower the storage (--weights) or give GPUs of more than "
                f"{_gib(gpu.peak_bytes)}.{one_gpu}")
    if over:
        return f"The transformers' GPU is over budget in every tier: lower the storage (--weights){disk_hint}.{one_gpu}"
    return f"The RAM is over budget: more RAM, lower the storage (--weights){disk_hint}.{one_gpu}"


def _aligned(rows, mark_index) -> list[str]:
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for index, row in enumerate(rows):
        mark = "  <- recommended" if mark_index is not None and index - 1 == mark_index else ""
        lines.append("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip() + mark)
    return lines


def _tier(strategy, on_disk: bool = False) -> str:
    """The row's tier as on one GPU ('block_swap 15 +disk')."""
    return (strategy.offload.value + (f" {strategy.blocks_to_swap}" if strategy.blocks_to_swap else "")
            + (" +disk" if on_disk else ""))


def _gib(nbytes: int) -> str:
    return f"{nbytes / GIB:.1f} GiB"
