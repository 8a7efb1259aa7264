"""TrainSettings: one frozen, validated description of a LoRA training run."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from numbers import Integral, Real

from ..memory.activation_offload import OffloadMode, offload_mode
from .errors import TrainingError
from .optim import OptimizerName

DEFAULT_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")  # attention projections, as CogVideoX-Factory and finetrainers
MAX_SEED = 0xFFFFFFFFFFFFFFFF


@dataclass(frozen=True)
class TrainSettings:
    rank: int = 16
    alpha: float = 16.0
    learning_rate: float = 1e-4
    steps: int = 500
    batch_size: int = 1
    seed: int = 0
    target_modules: tuple[str, ...] = DEFAULT_TARGETS
    gradient_checkpointing: bool = True
    optimizer: OptimizerName = OptimizerName.ADAMW
    checkpoint_every: int = 0  # steps between checkpoints; 0: only on interrupt and at the end
    expert: str = "both"  # Wan 2.2 A14B: "high_noise" or "low_noise"
    weight_decay: float = 1e-4
    max_grad_norm: float = 1.0  # 0 turns clipping off
    # Checkpointed block inputs wait in (pinned) host memory until the backward: same LoRA, less VRAM,
    # more RAM and a copy per block each way (memory/activation_offload.py). on needs gradient_checkpointing;
    # auto: on only when the training plan says the step fits with it and not without (training/plan.py
    # resolves it before the run). True/False (saved workflows) are on/off.
    activation_offload: OffloadMode = OffloadMode.OFF

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "optimizer", OptimizerName(self.optimizer))
        except ValueError:
            raise TrainingError(f"optimizer={self.optimizer!r} is not one of "
                                f"{', '.join(o.value for o in OptimizerName)}.") from None
        if isinstance(self.target_modules, str):
            object.__setattr__(self, "target_modules", parse_targets(self.target_modules))
        for name, low in (("rank", 1), ("steps", 1), ("batch_size", 1), ("checkpoint_every", 0), ("seed", 0)):
            _whole(name, getattr(self, name), low)
        if self.seed > MAX_SEED:
            raise TrainingError(f"seed={self.seed} must be at most {MAX_SEED}.")
        for name in ("alpha", "learning_rate", "weight_decay", "max_grad_norm"):
            _finite(name, getattr(self, name))
        if self.learning_rate <= 0:
            raise TrainingError(f"learning_rate={self.learning_rate} must be above 0; LoRA training usually uses 1e-4.")
        if self.alpha <= 0:
            raise TrainingError(f"alpha={self.alpha} must be above 0; alpha = rank gives scale 1.")
        if self.weight_decay < 0 or self.max_grad_norm < 0:
            raise TrainingError("weight_decay and max_grad_norm must be 0 or more.")
        if not isinstance(self.gradient_checkpointing, bool):
            raise TrainingError(f"gradient_checkpointing={self.gradient_checkpointing!r} must be true or false.")
        try:
            object.__setattr__(self, "activation_offload", offload_mode(self.activation_offload))
        except ValueError as error:
            raise TrainingError(str(error)) from None
        if self.activation_offload is OffloadMode.ON and not self.gradient_checkpointing:
            raise TrainingError("activation_offload needs gradient_checkpointing on: it moves the checkpointed blocks' "
                                "inputs to host memory, and without checkpointing there are none. Turn "
                                "gradient_checkpointing on, or activation_offload off.")

    def as_record(self) -> dict:
        """For checkpoints: what must match to resume (steps, checkpoint_every and activation_offload may change)."""
        record = asdict(self)
        record.update(optimizer=self.optimizer.value, target_modules=list(self.target_modules))
        for free in ("steps", "checkpoint_every", "activation_offload"):  # change nothing trained
            record.pop(free)
        return record


def parse_targets(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(t.strip() for t in text.replace(";", ",").split(",") if t.strip()))
    if not names:
        raise TrainingError("target_modules is empty; give layer names such as 'to_q,to_k,to_v,to_out.0'.")
    return names


def _whole(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, Integral) or value < low:
        raise TrainingError(f"{name}={value!r} must be a whole number of at least {low}.")


def _finite(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise TrainingError(f"{name}={value!r} must be a finite number.")
