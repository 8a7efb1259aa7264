"""What a training step holds, in bytes, for the planner: pure arithmetic on shapes, no weights.

`training_bytes` answers for one denoiser's targeted layers, LoRA rank and optimizer: the
trainable LoRA weights, their gradients and the optimizer's states, and where each lives.
Activations and the base weights' residency are the planner's own model (memory/plan/train.py
traces the activations; memory/plan/train_plan.py places the weights per tier).
"""

from __future__ import annotations

from .optim import OptimizerName

# The byte formulas live with the planner (memory/ must not import training/).
from ..memory.plan.train import TrainingBytes
from ..memory.plan.train import training_bytes as _training_bytes


def training_bytes(linear_shapes: list[tuple[int, int]], rank: int, optimizer: OptimizerName | str) -> TrainingBytes:
    """Bytes for LoRA training of layers of `linear_shapes` [(out, in), ...] at `rank`."""
    return _training_bytes(linear_shapes, rank, OptimizerName(optimizer).value)
