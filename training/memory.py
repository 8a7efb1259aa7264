"""What a training step holds, in bytes, for the planner: pure arithmetic on shapes, no weights.

`training_bytes` answers for one denoiser, LoRA settings and optimizer: the trainable LoRA
weights, their gradients and the optimizer's states, and where each lives. Activations and the
base weights' residency are the planner's own model (they depend on the tier and the shape);
`activation_blocks_held` says how many blocks' activations the backward holds at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .optim import OptimizerName

FP32 = 4
BNB_BLOCK = 256  # bitsandbytes' block size for 8-bit states (one float32 absmax per block per state)
BNB_MIN_8BIT = 4096  # smaller tensors keep 32-bit states
BNB_QMAP_BYTES = 2 * 256 * FP32  # two 256-entry float32 code maps per tensor


@dataclass(frozen=True)
class TrainingBytes:
    trainable: int  # LoRA weights, float32, on the compute device for the run
    gradients: int  # float32, on the device from backward to the optimizer step
    optimizer_states: int  # where `optimizer_on_host` says
    optimizer_on_host: bool  # adamw_cpu_offload: states + a float32 master copy in host RAM
    host_master_copy: int  # adamw_cpu_offload's host copy of the weights (and of the gradients)

    @property
    def device(self) -> int:
        return self.trainable + self.gradients + (0 if self.optimizer_on_host else self.optimizer_states)

    @property
    def host(self) -> int:
        return (self.optimizer_states + 2 * self.host_master_copy) if self.optimizer_on_host else 0


def lora_shapes(linear_shapes: list[tuple[int, int]], rank: int) -> list[tuple[int, int]]:
    """(down, up) weight counts per targeted linear layer of shape (out, in)."""
    return [(rank * in_f, out_f * rank) for out_f, in_f in linear_shapes]


def training_bytes(linear_shapes: list[tuple[int, int]], rank: int, optimizer: OptimizerName | str) -> TrainingBytes:
    """Bytes for LoRA training of layers of `linear_shapes` [(out, in), ...] at `rank`."""
    optimizer = OptimizerName(optimizer)
    tensors = [n for pair in lora_shapes(linear_shapes, rank) for n in pair]
    weights = sum(tensors) * FP32
    if optimizer is OptimizerName.ADAMW_8BIT:
        states = sum(_bnb_state_bytes(n) for n in tensors)
    else:
        states = sum(2 * n * FP32 + FP32 for n in tensors)  # exp_avg, exp_avg_sq, step
    on_host = optimizer is OptimizerName.ADAMW_CPU_OFFLOAD
    return TrainingBytes(weights, weights, states, on_host, weights if on_host else 0)


def _bnb_state_bytes(count: int) -> int:
    if count < BNB_MIN_8BIT:
        return 2 * count * FP32
    blocks = -(-count // BNB_BLOCK)
    return 2 * count + 2 * blocks * FP32 + BNB_QMAP_BYTES


def target_shapes(model: nn.Module, paths: tuple[str, ...]) -> list[tuple[int, int]]:
    """(out, in) of each targeted layer (works on a meta-device model: only shapes are read)."""
    return [(model.get_submodule(p).out_features, model.get_submodule(p).in_features) for p in paths]


def activation_blocks_held(gradient_checkpointing: bool, block_count: int) -> int:
    """Blocks whose inner activations the backward holds at its peak: all of them without
    checkpointing; with it, one block's (re-run during the backward) plus each block's input."""
    return 1 if gradient_checkpointing else block_count
