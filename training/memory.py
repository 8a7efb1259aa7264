"""What a training step holds, in bytes, for the planner: pure arithmetic on shapes, no weights.

`training_bytes` answers for one denoiser, LoRA settings and optimizer: the trainable LoRA
weights, their gradients and the optimizer's states, and where each lives. Activations and the
base weights' residency are the planner's own model (they depend on the tier and the shape);
`activation_blocks_held` says how many blocks' activations the backward holds at once.
"""

from __future__ import annotations

from torch import nn

from .optim import OptimizerName

# The byte formulas live with the planner (memory/ must not import training/); re-exported here.
from ..memory.plan.train import (BNB_BLOCK, BNB_MIN_8BIT, BNB_QMAP_BYTES, FP32, TrainingBytes,  # noqa: F401
                                    lora_shapes)
from ..memory.plan.train import training_bytes as _training_bytes


def training_bytes(linear_shapes: list[tuple[int, int]], rank: int, optimizer: OptimizerName | str) -> TrainingBytes:
    """Bytes for LoRA training of layers of `linear_shapes` [(out, in), ...] at `rank`."""
    return _training_bytes(linear_shapes, rank, OptimizerName(optimizer).value)


def target_shapes(model: nn.Module, paths: tuple[str, ...]) -> list[tuple[int, int]]:
    """(out, in) of each targeted layer (works on a meta-device model: only shapes are read)."""
    return [(model.get_submodule(p).out_features, model.get_submodule(p).in_features) for p in paths]


def activation_blocks_held(gradient_checkpointing: bool, block_count: int) -> int:
    """Blocks whose inner activations the backward holds at its peak: all of them without
    checkpointing; with it, one block's (re-run during the backward) plus each block's input."""
    return 1 if gradient_checkpointing else block_count
