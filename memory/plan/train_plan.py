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
backward (`ActivationPeaks.offloaded_at`; the trainer turns selective checkpointing off with it, so
nothing else stays per block), RAM rises by every block's input, each in a buffer
rounded up to a power of two as the pinned pool makes them, and each input crosses PCIe twice per
step (`activation_copy_seconds`, hidden behind the re-runs when the prefetch keeps up). A plan
without it says whether the same tier would fit with it (`fits_with_offload`), and `advice` names
it when it is what makes training fit.

Tiers `none` and `model` hold the same during training (the denoiser is the only component the
step uses), `block_swap` and `sequential` stream weights and need checkpointing (training/loop.py
refuses them without it). The recommendation is the first that fits, fastest first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

from ..accounting import Attention
from ..activation_offload import host_buffer_bytes
from .costs import CUBLAS_WORKSPACE_BYTES, CUDA_CONTEXT_BYTES, HOST_RUNTIME_BYTES, PCIE_BYTES_PER_S
from .schedule import table_resident_tensors
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
    activation_offload: bool = False  # checkpointed block inputs in pinned host memory

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"--rank {self.rank} must be 1 or more (16 to 128 is usual).")
        if self.activation_offload and not self.checkpointing:
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
    lora = training_bytes(shapes, request.rank, request.optimizer)
    model.trace(Call("denoise", denoiser, shape), request.attention)  # records the stream order residency reads
    peaks = activations(request.checkpointing)
    plans = []
    for tier in TIERS:
        if tier is OffloadTier.BLOCK_SWAP:
            plans.append(_fewest_swapped(model, denoiser, len(blocks), vram, ram, request, lora, peaks))
        else:
            plans.append(_plan(model, denoiser, MemoryStrategy(offload=tier, prefetch_blocks=request.prefetch_blocks),
                               vram, ram, request, lora, peaks))
    return plans


def recommended(plans: list[TrainPlan]) -> int | None:
    return next((i for i, plan in enumerate(plans) if plan.fits), None)


def advice(plans: list[TrainPlan]) -> str:
    """Names activation offload when it makes a tier fit that does not without it: when nothing
    fits, or when it lets a faster tier than the recommended one fit. "" otherwise."""
    best = recommended(plans)
    faster = plans if best is None else plans[:best]
    enabled = next((p for p in faster if p.fits_with_offload), None)
    if enabled is None:
        return ""
    tier = enabled.tier + (f" {enabled.blocks_to_swap}" if enabled.blocks_to_swap else "")
    return (f"activation offload makes {tier} fit{'' if best is None else ' (faster than ' + plans[best].tier + ')'}: "
            "the checkpointed block inputs wait in pinned RAM and come back ahead of the backward (vidmem plan "
            "--train --activation-offload; Train LoRA's activation_offload input).")


def _fewest_swapped(model, denoiser, count, vram, ram, request, lora, peaks) -> TrainPlan:
    plan = None
    for swapped in range(1, count + 1):
        strategy = MemoryStrategy(offload=OffloadTier.BLOCK_SWAP, blocks_to_swap=swapped,
                                  prefetch_blocks=request.prefetch_blocks)
        plan = _plan(model, denoiser, strategy, vram, ram, request, lora, peaks)
        if plan.fits or plan.refused:
            return plan
    return plan


def _plan(model: PlannerModel, denoiser: str, strategy: MemoryStrategy, vram: int, ram: int,
          request: TrainRequest, lora: TrainingBytes, peaks: ActivationPeaks) -> TrainPlan:
    weights = model.weights(denoiser, request.storage)
    blocks = model.blocks(denoiser)
    streams = strategy.offload in (OffloadTier.BLOCK_SWAP, OffloadTier.SEQUENTIAL)
    resident = sum(table_resident_tensors(weights.table, strategy, model.stream_order(denoiser)))
    upcast = weights.transient_bytes
    if upcast and request.checkpointing:  # the backward re-runs a whole block, its layers upcast
        upcast = sum(p.numel() for p in blocks[0].parameters()) * model.dtype_bytes(denoiser)
    if streams:  # streamed blocks re-run in full: nothing kept beyond each block's input
        peaks = replace(peaks, kept_per_block=0)
    fixed_vram = CUDA_CONTEXT_BYTES + CUBLAS_WORKSPACE_BYTES + resident + upcast + lora.device
    fixed_ram = HOST_RUNTIME_BYTES + weights.nbytes + lora.host
    refused = "needs checkpointing" if streams and not request.checkpointing else ""
    # with offload every block re-runs in full (selective checkpointing's kept outputs would stay on the device)
    offload = _offloaded(replace(peaks, kept_per_block=0), len(blocks), request.prefetch_blocks, streams)
    if request.activation_offload:
        activation, host, seconds = offload
    else:
        activation, host, seconds = peaks.at(len(blocks)), 0, 0.0
    vram_peak, ram_peak = fixed_vram + activation, fixed_ram + host
    fits = not refused and vram_peak <= vram and ram_peak <= ram
    would_fit = (not refused and not request.activation_offload and request.checkpointing
                 and fixed_vram + offload[0] <= vram and fixed_ram + offload[1] <= ram)
    return TrainPlan(strategy.offload.value, strategy.blocks_to_swap, resident + upcast, lora, activation,
                     vram_peak, ram_peak, fits, refused, request.activation_offload, host, seconds, would_fit)


def _offloaded(peaks: ActivationPeaks, blocks: int, prefetch: int, streams: bool) -> tuple[int, int, float]:
    """(device activations, host bytes, copy seconds per step) with the checkpointed inputs offloaded.
    Resident tiers keep the last block unwrapped (training/autograd.py): its input is not moved."""
    moved = blocks if streams else blocks - 1
    host = moved * host_buffer_bytes(peaks.per_block) if peaks.per_block else 0
    return peaks.offloaded_at(blocks, prefetch), host, 2 * moved * peaks.per_block / PCIE_BYTES_PER_S


