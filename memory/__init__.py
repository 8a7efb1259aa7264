"""vidmem's memory engine: pure torch, no ComfyUI imports. Public verbs only."""

from .cleanup import FreeReceipt, free_memory
from .device import backend_for, resolve_compute_device
from .offload import OffloadHandle, StageComponents, apply_strategy
from .strategy import MemoryStrategy, OffloadTier, StrategyError, TextEncoderPlacement, VaeTiling

__all__ = [
    "FreeReceipt",
    "MemoryStrategy",
    "OffloadHandle",
    "OffloadTier",
    "StageComponents",
    "StrategyError",
    "TextEncoderPlacement",
    "VaeTiling",
    "apply_strategy",
    "backend_for",
    "free_memory",
    "resolve_compute_device",
]
