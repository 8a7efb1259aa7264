"""LoRA training on the pack's memory engine: data preparation, the training loop, saving.

Example:
    data = prepare_training_data(loaded, "clips/", BucketSettings(((480, 320),), (33,)), strategy, cache, backend)
    result = train_lora(loaded, data, strategy, TrainSettings(rank=16, steps=500), outputs, backend)
"""

from .data import Bucket, BucketSettings, parse_frames, parse_resolutions
from .errors import TrainingError
from .loop import TrainOutputs, TrainResult, train_lora
from .memory import TrainingBytes, training_bytes
from .optim import OptimizerName
from .prepare import PreparedData, prepare_training_data
from .settings import DEFAULT_TARGETS, TrainSettings

__all__ = [
    "Bucket", "BucketSettings", "DEFAULT_TARGETS", "OptimizerName", "PreparedData", "TrainOutputs", "TrainResult",
    "TrainSettings", "TrainingBytes", "TrainingError", "parse_frames", "parse_resolutions", "prepare_training_data",
    "train_lora", "training_bytes",
]
