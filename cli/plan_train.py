"""`vidmem plan --train`: what a LoRA training step needs, per offload tier, before anything runs.

    vidmem plan --train --model cogvideox-2b --size 720x480 --frames 49 --rank 64 --batch 1 --vram 24 --ram 64
    vidmem plan --train --model wan2.1-t2v-1.3b --rank 32 --optimizer adamw_8bit --vram 12 --ram 32 --json

The text encoder and VAE are absent (latents and prompt embeddings are precomputed); for Wan 2.2
A14B the plan is for one expert (each run trains one). Exit status as `vidmem plan`.
"""

from __future__ import annotations

import argparse
import json

# Not vidmem.memory.units.GiB: importing vidmem.memory loads torch, and `vidmem --help` and
# `vidmem queue` import this module without needing it.
GIB = 1 << 30


def number_of(unit: str, example: str):
    """An argparse `type=` for a plain number in `unit` ("GiB"): "8GB" is refused naming the unit the flag takes,
    rather than argparse's "invalid float value"."""
    def parse(text: str) -> float:
        try:
            return float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number: give a number of {unit}, e.g. {example} "
                                             "(no unit after it).") from None

    parse.__name__ = f"number of {unit}"
    return parse


GIB_NUMBER = number_of("GiB", "8")


def add_train_arguments(plan: argparse.ArgumentParser) -> None:
    group = plan.add_argument_group("training (--train)")
    group.add_argument("--train", action="store_true", help="plan a LoRA training step instead of sampling "
                       "(--batch is then the training batch size)")
    group.add_argument("--rank", type=int, default=16, help="LoRA rank (default 16)")
    group.add_argument("--optimizer", default="adamw", choices=("adamw", "adamw_8bit", "adamw_cpu_offload"),
                       help="adamw_8bit: bitsandbytes 8-bit states; adamw_cpu_offload: states in host RAM")
    group.add_argument("--no-checkpointing", action="store_true", help="keep every block's activations (faster, "
                       "much more VRAM; block_swap and sequential then refuse)")
    group.add_argument("--targets", help="comma-separated layer names LoRA trains (default: the trainer's)")
    group.add_argument("--activation-offload", nargs="?", const="on", default="off", choices=("off", "on", "auto"),
                       help="checkpointed block inputs in pinned RAM, copied back ahead of the backward: about one "
                       "block's activations on the device, every block's input in RAM (needs checkpointing). Alone "
                       "or 'on': every tier with it; 'auto': each tier with it only where the step fits with it and "
                       "not without (default off)")
    group.add_argument("--max-pinned-ram-gb", type=GIB_NUMBER, help="the pinned-memory ceiling (the Memory Strategy's "
                       "max_pinned_ram_gb): streamed weights' homes first, then the offloaded block inputs; inputs "
                       "past it stay on the GPU (default: the automatic ceiling, half the RAM the budget leaves "
                       "once the weights are loaded, keeping 8 GiB unpinned)")


# Flags that shape a sampling plan and that the training step's plan has no use for: (flag, its value, its default).
# The step is planned on a GPU with PyTorch's allocator, without text encoder, VAE, guidance or steps.
SAMPLING_ONLY = (("--window", "window", 0), ("--window-overlap", "window_overlap", 0), ("--disk", "disk", False),
                 ("--disk-gbps", "disk_gbps", None), ("--cache", "cache", "off"), ("--device", "device", "cuda"),
                 ("--allocator", "allocator", None), ("--text-encoder", "text_encoder", "offload_after_encoding"),
                 ("--no-cfg", "no_cfg", False), ("--activation-chunks", "activation_chunks", "auto"),
                 ("--vae-dtype", "vae_dtype", None), ("--steps", "steps", 50))


# Flags that shape the training step's plan and that a sampling plan has no use for, as SAMPLING_ONLY. The
# sampling planner credits no pinned ceiling either: --max-pinned-ram-gb places the step's offloaded block inputs.
TRAIN_ONLY = (("--rank", "rank", 16), ("--optimizer", "optimizer", "adamw"),
              ("--no-checkpointing", "no_checkpointing", False), ("--targets", "targets", None),
              ("--activation-offload", "activation_offload", "off"), ("--max-pinned-ram-gb", "max_pinned_ram_gb", None))


def given_flags(args: argparse.Namespace, table) -> list[str]:
    """The flags of `table` ((flag, its value, its default), ...) that the command line set."""
    return [flag for flag, name, default in table if getattr(args, name) != default]


def refuse_sampling_flags(args: argparse.Namespace) -> None:
    """--train with a sampling-only flag: ValueError naming them, rather than a plan that silently ignored them."""
    given = given_flags(args, SAMPLING_ONLY)
    if args.train and given:
        raise ValueError(f"{', '.join(given)} {'plans' if len(given) == 1 else 'plan'} sampling; --train plans one "
                         f"training step without {'it' if len(given) == 1 else 'them'} (drop {', '.join(given)}).")


def refuse_training_flags(args: argparse.Namespace) -> None:
    """A training-only flag without --train: ValueError naming them (the sampling plan would ignore them)."""
    given = given_flags(args, TRAIN_ONLY)
    if not args.train and given:
        raise ValueError(f"{', '.join(given)} {'plans' if len(given) == 1 else 'plan'} a LoRA training step; without "
                         f"--train the plan is for sampling, which has no use for {'it' if len(given) == 1 else 'them'} "
                         f"(add --train, or drop {', '.join(given)}).")


def run_train_plan(args: argparse.Namespace, model, shape, vram: int, ram: int) -> int:
    from ..memory.accounting import Attention
    from ..memory.plan.train_plan import TrainRequest, advice
    from ..training.plan import plan_training_step
    from ..training.settings import DEFAULT_TARGETS, parse_targets

    targets = parse_targets(args.targets) if args.targets else tuple(DEFAULT_TARGETS)
    denoiser = model.layout.denoisers[0]  # Wan 2.2 A14B: one expert per run; both are the same size
    request = TrainRequest(rank=args.rank, optimizer=args.optimizer, checkpointing=not args.no_checkpointing,
                           targets=targets, storage=args.weights, prefetch_blocks=args.prefetch,
                           attention=Attention(args.attention), activation_offload=args.activation_offload,
                           pinned_ceiling_bytes=_pinned_ceiling(args.max_pinned_ram_gb))
    plans, best = plan_training_step(model, denoiser, shape, vram, ram, request)  # as Train LoRA's offload=auto
    if args.json:
        print(json.dumps({"model": model.name, "component": denoiser, "size": [shape.width, shape.height],
                          "frames": shape.frames, "batch": shape.batch, "dtype": model.dtype_name,
                          "request": {**request.__dict__, "attention": request.attention.value,
                                      "activation_offload": request.activation_offload.value,
                                      "targets": list(targets)},
                          "strategies": [p.as_dict() for p in plans], "recommended": best,
                          "advice": advice(plans)}, indent=2))
    else:
        print(_table(model, denoiser, shape, vram, ram, request, plans, best, advice(plans)))
    return 0 if best is not None else 1


def _table(model, denoiser, shape, vram, ram, request, plans, best, hint: str = "") -> str:
    head = (f"{model.name} {denoiser} LoRA rank {request.rank}, {request.optimizer}, "
            f"{'checkpointing' if request.checkpointing else 'no checkpointing'}"
            f"{_offload_head(request.activation_offload.value)}; {shape.width}x{shape.height}, "
            f"{shape.frames} frames, batch {shape.batch}; budget {vram / GIB:.1f} GiB VRAM, {ram / GIB:.1f} GiB RAM")
    columns = ("strategy", "weights", "LoRA+grads+states", "activations", "peak VRAM", "peak RAM", "fits")
    rows = [columns]
    for plan in plans:
        tier = plan.tier + (f" {plan.blocks_to_swap}" if plan.blocks_to_swap else "")
        fits = "yes" if plan.fits else (f"no ({plan.refused})" if plan.refused else "no")
        activations = _gib(plan.activation_bytes) + (" (offloaded)" if plan.activation_offload else "")
        rows.append((tier, _gib(plan.weights_bytes), _gib(plan.lora.device), activations,
                     _gib(plan.peak_vram_bytes), _gib(plan.peak_ram_bytes), fits))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(columns))]
    lines = [head, ""]
    for index, row in enumerate(rows):
        mark = "  <- recommended" if best is not None and index - 1 == best else ""
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() + mark)
    lines.append("\nDevice bytes live (as max_memory_allocated reports), including the CUDA context; the text "
                 "encoder and VAE are absent (latents and embeddings precomputed).")
    offloaded = next((p for p in plans if p.activation_offload), None)
    if offloaded is not None:
        kept = (f"; {offloaded.activation_kept_inputs} inputs ({_gib(offloaded.activation_kept_bytes)}) past the "
                "pinned ceiling stay on the GPU (in peak VRAM)" if offloaded.activation_kept_inputs else "")
        lines.append(f"Activation offload ({offloaded.tier}): block inputs {_gib(offloaded.activation_host_bytes)} in "
                     f"pinned RAM (in peak RAM){kept}, ~{offloaded.activation_copy_seconds:.2f} s of copies per step "
                     "(PCIe 4.0 x16), hidden behind the backward's re-runs while the prefetch keeps up.")
    if request.activation_offload.value == "auto":
        lines += [f"{_tier(p)}: {p.activation_offload_reason}" for p in plans if p.activation_offload_reason]
    if hint:
        lines.append(hint[0].upper() + hint[1:])
    if best is None:
        lines.append("Nothing fits: lower --rank/--batch/--size, use checkpointing, --optimizer adamw_8bit, "
                     "or stored weights such as --weights fp8_e4m3fn.")
    return "\n".join(lines)


def _offload_head(mode: str) -> str:
    return {"off": "", "on": ", activation offload", "auto": ", activation offload auto"}[mode]


def _tier(plan) -> str:
    return plan.tier + (f" {plan.blocks_to_swap}" if plan.blocks_to_swap else "")


def _pinned_ceiling(gb: float | None) -> int | None:
    import math

    if gb is None:
        return None
    if not math.isfinite(gb) or gb < 0:
        raise ValueError(f"--max-pinned-ram-gb {gb} must be 0 (no pinning) or more.")
    return int(gb * GIB)


def _gib(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f} GiB"
