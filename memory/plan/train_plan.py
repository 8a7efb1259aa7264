"""Training plans per offload tier: peak VRAM and RAM of one LoRA training step, and the one to use.

Device, per tier: the CUDA context and cuBLAS workspace, the denoiser's weights the tier keeps
resident (as stored; a stored-quantized layer adds its upcast copy, and with checkpointing one
whole block is re-run, so one block's upcast weights), the LoRA weights + gradients + optimizer
states (`training_bytes`) and the traced activation peak at the real block count. Figures are
live bytes (what `torch.cuda.max_memory_allocated` reports); the caching allocator reserves more.
Host: the runtime, the denoiser's weights loaded once into RAM (the loader's copy, as the sampling
planner counts it) and, for adamw_cpu_offload, the optimizer's states and float32 master copies.

With activation offload (checkpointing on), the checkpointed block inputs wait in pinned host
memory: the device's activations drop to one block's worth plus the inputs prefetched ahead of the
backward, the first block's whole when the prefetch reaches it (`ActivationPeaks.offloaded_at`; the
trainer turns selective checkpointing off with it, so nothing else stays per block), RAM rises by
every block's input, each in a buffer rounded up to a power of two as the pinned pool makes them,
and each input crosses PCIe twice per step (`activation_copy_seconds`, hidden behind the re-runs when the prefetch keeps up). The inputs
are the ones the run moves, traced (`trace_offloaded_step`: the first block's shared inputs
included), and they are split at the pinned ceiling by the pool's own rule (`split_at_ceiling`):
the ceiling is the strategy's max_pinned_ram_gb (or the automatic one) less what the pipeline's host
pool holds once the streamed weights have their pinned homes (homes an earlier call made are kept,
whichever tensors they serve; only streamed weights without one take new arenas), and the inputs
past it stay on the device, which the device peak then counts. A plan
without it says whether the same tier would fit with it (`fits_with_offload`), and `advice` names
it when it is what makes training fit, and max_pinned_ram_gb when the ceiling keeps inputs on the GPU.
With activation_offload auto each tier's plan turns it on only when the step does not fit without
it and fits with it (`activation_offload_reason` says which and why).

Tiers `none` and `model` hold the same during training (the denoiser is the only component the
step uses), `block_swap` and `sequential` stream weights and need checkpointing (training/loop.py
refuses them without it). The recommendation is the first that fits, fastest first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

from ..accounting import Attention
from ..activation_offload import CeilingSplit, OffloadMode, offload_mode, split_at_ceiling
from ..hostpool import ARENA_BYTES, default_pinned_cap
from ..units import GiB
from .costs import CUBLAS_WORKSPACE_BYTES, CUDA_CONTEXT_BYTES, HOST_RUNTIME_BYTES, PCIE_BYTES_PER_S
from .schedule import table_resident_tensors, table_streamed_unit_bytes
from .train import ActivationPeaks, TrainingBytes, block_target_shapes, training_bytes
from .types import Call, PlannerModel, VideoShape
from ..strategy import MemoryStrategy, OffloadTier

TIERS = (OffloadTier.NONE, OffloadTier.MODEL, OffloadTier.BLOCK_SWAP, OffloadTier.SEQUENTIAL)


@dataclass(frozen=True)
class TrainRequest:
    rank: int = 16
    optimizer: str = "adamw"
    checkpointing: bool = True
    targets: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out.0")
    storage: str | None = None  # StorageFormat of the denoiser's weights (None: the compute dtype)
    prefetch_blocks: int = 1
    attention: Attention = Attention.FUSED
    # Checkpointed block inputs in pinned host memory: off, on, or auto (on where only it makes the
    # step fit). True/False are read as on/off.
    activation_offload: OffloadMode = OffloadMode.OFF
    # The pinned-memory ceiling in bytes (pinned_cap_bytes of the strategy's max_pinned_ram_gb and the
    # host's room); the streamed weights' homes take their share first. None: the automatic ceiling
    # for the RAM the budget leaves once the weights are loaded.
    pinned_ceiling_bytes: int | None = None
    # The pipeline's host pool as the run will find it (training/plan.py reads it; `vidmem plan --train`
    # has none: an empty pool). The run's block inputs get the ceiling less every pinned byte it holds
    # once the tier's streamed weights have their homes; only those without one yet take new arenas.
    pinned_already_bytes: int = 0  # pinned bytes it holds (whole arenas: homes earlier calls made, never freed)
    # of each block's streamed tensors, the bytes that have a home there (block swap streams the last N)
    pinned_homed_block_bytes: tuple[int, ...] = ()
    pinned_homed_leaf_bytes: int = 0  # of the sequential tier's streamed tensors, the bytes that have a home there
    pinned_spare_bytes: int = 0  # room left in its newest arena, which new homes fill before another is pinned
    pinned_arena_bytes: int = ARENA_BYTES  # the size of its arenas

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"--rank {self.rank} must be 1 or more (16 to 128 is usual).")
        object.__setattr__(self, "activation_offload", offload_mode(self.activation_offload, "--activation-offload"))
        if self.pinned_ceiling_bytes is not None and self.pinned_ceiling_bytes < 0:
            raise ValueError(f"--max-pinned-ram-gb must be 0 or more (got {self.pinned_ceiling_bytes / GiB:.2f} GiB).")
        object.__setattr__(self, "pinned_homed_block_bytes", tuple(self.pinned_homed_block_bytes))
        if self.pinned_arena_bytes < 1:
            raise ValueError(f"pinned_arena_bytes {self.pinned_arena_bytes} must be 1 or more "
                             "(the host pool's arena size, HostPool.arena_bytes).")
        if self.activation_offload is OffloadMode.ON and not self.checkpointing:
            raise ValueError("--activation-offload moves the checkpointed blocks' inputs: it needs checkpointing "
                             "(drop --no-checkpointing).")


@dataclass(frozen=True)
class TrainPlan:
    tier: str
    blocks_to_swap: int
    weights_bytes: int  # the denoiser's weights resident on the device
    lora: TrainingBytes
    activation_bytes: int
    peak_vram_bytes: int
    peak_ram_bytes: int
    fits: bool
    refused: str = ""  # why the trainer would refuse this tier ("" when it runs)
    activation_offload: bool = False
    activation_host_bytes: int = 0  # pinned host buffers for the offloaded block inputs (in peak_ram_bytes)
    activation_copy_seconds: float = 0.0  # per step: every input to the host and back, at PCIe speed
    fits_with_offload: bool = False  # without offload: the same tier would fit with it
    activation_moved_bytes: int = 0  # input bytes copied to the host per step (the run's offloaded_bytes / steps)
    activation_kept_bytes: int = 0  # inputs past the pinned ceiling: they stay on the device (in activation_bytes)
    activation_kept_inputs: int = 0
    activation_ceiling_bytes: int = 0  # what the pinned ceiling leaves the inputs once the weights' homes are pinned
    activation_offload_reason: str = ""  # auto: why it is on or off for this tier

    def as_dict(self) -> dict:
        record = asdict(self)
        record["lora"] = {**asdict(self.lora), "device": self.lora.device, "host": self.lora.host}
        return record


# Traces one forward + backward at the given checkpointing setting; the caller builds it from
# the model's traced module (vidmem.pipelines.configs), which memory/ must not import.
ActivationTracer = Callable[[bool], ActivationPeaks]


def training_plans(model: PlannerModel, denoiser: str, shape: VideoShape, vram: int, ram: int,
                   request: TrainRequest, activations: ActivationTracer) -> list[TrainPlan]:
    """One plan per tier (block swap with the fewest blocks that fit, or all of them)."""
    model.check_shape(shape)
    blocks = model.blocks(denoiser)
    if blocks is None:
        raise ValueError(f"{denoiser} of {model.name} has no transformer blocks to train LoRA on.")
    shapes = block_target_shapes(blocks, request.targets)
    if not shapes:
        raise ValueError(f"--targets {','.join(request.targets)} match no linear layer in {model.name}'s blocks; "
                         "use names such as to_q,to_k,to_v,to_out.0 (CogVideoX) or attn1.to_q,ffn.net.0.proj (Wan).")
    call = Call("denoise", denoiser, shape)
    lora, peaks = _step_bytes(model, call, request, activations, shapes)
    plans = []
    for tier in TIERS:
        if tier is OffloadTier.BLOCK_SWAP:
            plans.append(_fewest_swapped(model, call, len(blocks), vram, ram, request, lora, peaks))
        else:
            plans.append(_plan(model, call, MemoryStrategy(offload=tier, prefetch_blocks=request.prefetch_blocks),
                               vram, ram, request, lora, peaks))
    return plans


def strategy_plan(model: PlannerModel, denoiser: str, shape: VideoShape, vram: int, ram: int, request: TrainRequest,
                  activations: ActivationTracer, strategy: MemoryStrategy) -> TrainPlan:
    """The plan of one strategy chosen by hand (its tier and blocks as given), e.g. to decide
    activation_offload auto for it."""
    model.check_shape(shape)
    blocks = model.blocks(denoiser)
    if blocks is None:
        raise ValueError(f"{denoiser} of {model.name} has no transformer blocks to train LoRA on.")
    shapes = block_target_shapes(blocks, request.targets)
    call = Call("denoise", denoiser, shape)
    lora, peaks = _step_bytes(model, call, request, activations, shapes)
    return _plan(model, call, strategy, vram, ram, request, lora, peaks)


def _step_bytes(model, call: Call, request, activations, shapes) -> tuple[TrainingBytes, ActivationPeaks]:
    lora = training_bytes(shapes, request.rank, request.optimizer)
    model.trace(call, request.attention)  # records the stream order residency reads
    return lora, activations(request.checkpointing)


def recommended(plans: list[TrainPlan]) -> int | None:
    return next((i for i, plan in enumerate(plans) if plan.fits), None)


def advice(plans: list[TrainPlan]) -> str:
    """Names activation offload when it makes a tier fit that does not without it: when nothing
    fits, or when it lets a faster tier than the recommended one fit; and max_pinned_ram_gb when
    the pinned ceiling keeps block inputs on the GPU. "" otherwise."""
    return " ".join(text for text in (_offload_advice(plans), ceiling_note(plans)) if text)


def _offload_advice(plans: list[TrainPlan]) -> str:
    best = recommended(plans)
    faster = plans if best is None else plans[:best]
    enabled = next((p for p in faster if p.fits_with_offload), None)
    if enabled is None:
        return ""
    faster_than = "" if best is None else f" (faster than {plans[best].tier})"
    return (f"activation offload makes {_tier(enabled)} fit{faster_than}: "
            "the checkpointed block inputs wait in pinned RAM and come back ahead of the backward (vidmem plan "
            "--train --activation-offload; Train LoRA's activation_offload input).")


def ceiling_note(plans: list[TrainPlan]) -> str:
    """The recommended plan's (or, when nothing fits, the first offloaded one's) inputs that the
    pinned ceiling keeps on the GPU, and the fix; "" when every input it moves fits the ceiling."""
    best = recommended(plans)
    candidates = [plans[best]] if best is not None else plans
    plan = next((p for p in candidates if p.activation_offload and p.activation_kept_inputs), None)
    if plan is None:
        return ""
    return (f"with activation offload on {_tier(plan)}, {plan.activation_kept_inputs} block inputs "
            f"({plan.activation_kept_bytes / GiB:.2f} GiB) stay on the GPU, past the pinned ceiling "
            f"({plan.activation_ceiling_bytes / GiB:.2f} GiB left for them after the weights' pinned homes; counted in "
            "its peak VRAM): raise max_pinned_ram_gb on the Memory Strategy node (vidmem plan --max-pinned-ram-gb) "
            "to move them to RAM.")


def _tier(plan: TrainPlan) -> str:
    return plan.tier + (f" {plan.blocks_to_swap}" if plan.blocks_to_swap else "")


def _fewest_swapped(model, call: Call, count, vram, ram, request, lora, peaks) -> TrainPlan:
    plan = None
    for swapped in range(1, count + 1):
        strategy = MemoryStrategy(offload=OffloadTier.BLOCK_SWAP, blocks_to_swap=swapped,
                                  prefetch_blocks=request.prefetch_blocks)
        plan = _plan(model, call, strategy, vram, ram, request, lora, peaks)
        if plan.fits or plan.refused:
            return plan
    return plan


def _plan(model: PlannerModel, call: Call, strategy: MemoryStrategy, vram: int, ram: int,
          request: TrainRequest, lora: TrainingBytes, peaks: ActivationPeaks) -> TrainPlan:
    """The plan under `strategy` for training the denoiser of `call` (the step's forward, traced)."""
    denoiser = call.component
    weights = model.weights(denoiser, request.storage)
    blocks = model.blocks(denoiser)
    streams = strategy.offload in (OffloadTier.BLOCK_SWAP, OffloadTier.SEQUENTIAL)
    resident = sum(table_resident_tensors(weights.table, strategy, model.stream_order(call)))
    upcast = weights.transient_bytes
    if upcast and request.checkpointing:  # the backward re-runs a whole block, its layers upcast
        upcast = sum(p.numel() for p in blocks[0].parameters()) * model.dtype_bytes(denoiser)
    if streams:  # streamed blocks re-run in full: nothing kept beyond each block's input
        peaks = replace(peaks, kept_per_block=0)
    fixed_vram = CUDA_CONTEXT_BYTES + CUBLAS_WORKSPACE_BYTES + resident + upcast + lora.device
    fixed_ram = HOST_RUNTIME_BYTES + weights.nbytes + lora.host
    refused = "needs checkpointing" if streams and not request.checkpointing else ""
    plain = (peaks.at(len(blocks)), 0, 0.0)
    streamed = sum(table_streamed_unit_bytes(weights.table, strategy))
    unhomed = max(0, streamed - _homed_streamed(request, strategy, len(blocks)))  # what the run pins anew
    ceiling = _activation_ceiling(request, ram - fixed_ram, unhomed)
    # with offload every block re-runs in full (selective checkpointing's kept outputs would stay on the device)
    rerun = replace(peaks, kept_per_block=0)
    split = _offloaded_inputs(rerun, len(blocks), streams, ceiling)
    # inputs past the ceiling stay on the device beside what offload leaves there
    offload = (rerun.offloaded_at(len(blocks), request.prefetch_blocks) + split.kept_bytes, split.host_bytes,
               2 * split.moved_bytes / PCIE_BYTES_PER_S)

    def fits(activation, host):
        return not refused and fixed_vram + activation <= vram and fixed_ram + host <= ram

    can_offload = request.checkpointing and not refused
    on, reason = _offload_choice(request.activation_offload, fits(*plain[:2]), can_offload and fits(*offload[:2]),
                                 request.checkpointing)
    activation, host, seconds = offload if on else plain
    kept = split if on else CeilingSplit(0, 0, 0, 0)
    return TrainPlan(strategy.offload.value, strategy.blocks_to_swap, resident + upcast, lora, activation,
                     fixed_vram + activation, fixed_ram + host, fits(activation, host), refused, on, host, seconds,
                     fits_with_offload=not on and can_offload and fits(*offload[:2]),
                     activation_moved_bytes=kept.moved_bytes, activation_kept_bytes=kept.kept_bytes,
                     activation_kept_inputs=kept.kept_inputs, activation_ceiling_bytes=ceiling if on else 0,
                     activation_offload_reason=reason)


def _offload_choice(mode: OffloadMode, fits_without: bool, fits_with: bool, checkpointing: bool) -> tuple[bool, str]:
    """(offload on?, why) for one tier: on and off as asked; auto turns it on only when the step
    does not fit without it and fits with it (its copies cost time, its buffers RAM)."""
    if mode is not OffloadMode.AUTO:
        return mode is OffloadMode.ON, ""
    if not checkpointing:
        return False, "auto: off (activation offload needs checkpointing)"
    if fits_without:
        return False, "auto: off (the step fits without it)"
    if fits_with:
        return True, "auto: on (the step fits only with it)"
    return False, "auto: off (the step does not fit with it either)"


def _homed_streamed(request: TrainRequest, strategy: MemoryStrategy, block_count: int) -> int:
    """Bytes of the tier's streamed tensors that already have a pinned home (pinned nothing new)."""
    homed = request.pinned_homed_block_bytes
    if homed and len(homed) != block_count:
        raise ValueError(f"pinned_homed_block_bytes has {len(homed)} entries for a denoiser of {block_count} blocks; "
                         "read it from the pipeline planned (training/plan.py `pool_homes`).")
    if strategy.offload is OffloadTier.SEQUENTIAL:
        return request.pinned_homed_leaf_bytes
    if strategy.offload is OffloadTier.BLOCK_SWAP:
        return sum(homed[block_count - strategy.blocks_to_swap:])
    return 0


def _activation_ceiling(request: TrainRequest, free_ram: int, unhomed: int) -> int:
    """Pinned bytes the block inputs may take: what the run gives them, the ceiling less every byte
    the host pool holds once this tier's streamed weights have their homes (training/loop.py
    `_activation_cap`). The pool keeps what it already holds, whatever tensors those homes serve,
    and pins new homes only for the `unhomed` streamed bytes: into the room left in its newest
    arena, then whole arenas while one more fits the ceiling (memory.hostpool.HostPool; the
    packing's slack at each arena's end is not counted)."""
    cap = request.pinned_ceiling_bytes
    if cap is None:  # the automatic ceiling, for the RAM free once the weights are loaded
        cap = default_pinned_cap(max(0, free_ram))
    arena, already = request.pinned_arena_bytes, request.pinned_already_bytes
    needed = max(0, unhomed - request.pinned_spare_bytes)
    arenas = min(-(-needed // arena), max(0, cap - already) // arena)
    return max(0, cap - already - arenas * arena)


def _offloaded_inputs(peaks: ActivationPeaks, blocks: int, streams: bool, ceiling: int) -> CeilingSplit:
    """The inputs the run moves, split at the pinned ceiling. Resident tiers keep the last block
    unwrapped (training/autograd.py): its input is not moved."""
    moved = blocks if streams else blocks - 1
    return split_at_ceiling(peaks.offloaded_inputs(moved), ceiling)
