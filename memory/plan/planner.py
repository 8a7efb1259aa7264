"""Predict what a video run needs on the device and in RAM, per stage, and pick what fits.

How it works: the real architecture is built on the `meta` device (shapes, no memory) and one
call of each stage runs under a tensor ledger (`accounting.py`): the text encoder on the prompt,
one denoise step (both classifier-free-guidance branches, as the pipeline runs them), and the VAE
decode as vidmem runs it: a family's frame-wide decoder layers once on the whole latent, then every
distinct piece the tiling cuts the latent into (`stages.decode_calls`). Transformer blocks are identical,
so calls are traced with two blocks (the activation peak of two is the peak of all; FLOPs scale);
weights come from the full-size meta model. Weight residency is the engine's own partition and
schedule (`schedule.py`), and each phase's weights plus its allocation stream are
replayed through a model of PyTorch's caching allocator (`allocator.py`), because the
allocator reserves more than the tensors hold.

Weights are counted as stored (`PlanOptions.storage`, `storage.py`): fp8 or GGUF matrices
at their stored bytes on the host, on the device and in every host-to-device copy, plus one
dequantized layer on the device while it computes. RAM is split in two: anonymous memory (the
runtime, weights copied at load, pinned buffers, CPU activations), which must fit the RAM budget,
and page cache (weights memory-mapped from their files, `PlanOptions.on_disk`), which the kernel
reclaims: a plan on disk fits when its anonymous bytes fit, and runs slower by what the page
cache cannot keep and the disk must read again (`costs.DiskRead`).

Priorities when choosing (`choose_strategy`; the candidates are `candidates.py`'s): one candidate
per tier (none, model offload, block swap with the fewest blocks that fit, sequential); within a
tier the text encoder moves to the CPU only if it does not fit on the device, and the VAE is tiled
only if the whole decode does not fit, with the least redundant tiling that does. When the weights
overrun the RAM budget, the same tiers follow with the weights on disk. The fitting candidate with
the least estimated time wins, the earlier candidate on a tie. Storage precision is never lowered by
the planner; when nothing fits, `advice.py` says which storage or disk tier would (planned, not
guessed).

What a stage figure includes: CUDA context, cuBLAS workspace, resident weights, activations,
and allocator segments (`Allocator.NATIVE`, reserved bytes) or live bytes only
(`Allocator.ASYNC`, ComfyUI's default cudaMallocAsync backend); by default (`Allocator.AUTO`) the
backend this process runs, probed with `torch.cuda.get_allocator_backend()`. Not included: cuDNN convolution
workspaces (they never become tensors; cuDNN picks smaller ones when memory is short).

    model = load_model("wan2.1-t2v-14b")            # vidmem.pipelines.configs
    plan = choose_strategy(model, VideoShape(1280, 720, 81), 12 * GiB, 32 * GiB, MemoryStrategy())
    print(plan.describe())
"""

from __future__ import annotations

from .advice import nothing_fits_message
from .candidates import Plan, PlanError, candidate_plans, plan_run, recommended
from .costs import CUDA_CONTEXT_BYTES, GiB
from .stages import decode_stage
from .types import Allocator, Call, ModelLayout, Phase, PlannerModel, PlanOptions, Runtime, StagePlan, VideoShape
from ..strategy import MemoryStrategy

__all__ = ["Allocator", "Call", "GiB", "ModelLayout", "Phase", "Plan", "PlanError", "PlanOptions", "PlannerModel",
           "Runtime", "StagePlan", "VideoShape", "candidate_plans", "choose_strategy", "decode_activation_bytes",
           "plan_run", "recommended"]


def choose_strategy(
    model: PlannerModel,
    shape: VideoShape,
    vram_budget_bytes: int,
    ram_budget_bytes: int,
    base: MemoryStrategy = MemoryStrategy(),
    options: PlanOptions = PlanOptions(),
    consider_disk: bool = True,
) -> Plan:
    """The fastest plan that fits both budgets; PlanError saying what would fit if none does.

    `base` supplies what the planner does not choose: prefetch, slicing, non_blocking, and the
    text encoder placement it starts from. The plan may put the weights on disk (`plan.on_disk`)
    when `consider_disk`; it never lowers their precision.
    """
    plans = candidate_plans(model, shape, vram_budget_bytes, ram_budget_bytes, base, options, consider_disk)
    best = recommended(plans)
    if best is None:
        raise PlanError(nothing_fits_message(model, shape, plans, base, options, consider_disk))
    return plans[best]


def decode_activation_bytes(model: PlannerModel, shape: VideoShape, strategy: MemoryStrategy, free_bytes: int,
                            options: PlanOptions = PlanOptions()) -> int:
    """Device bytes the decode needs beyond what is already there (weights, latent, workspace):
    the allocator footprint of its largest piece, on a device with `free_bytes` left for it (near
    the limit the allocator releases its cache and retries, as `Phase.within` models)."""
    phase = decode_stage(model, shape, strategy, options).peak_phase
    there = CUDA_CONTEXT_BYTES + sum(phase.resident)
    return phase.within(there + free_bytes).device_bytes - there
