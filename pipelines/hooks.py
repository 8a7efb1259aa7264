"""RunHooks: how a sampling or decoding run talks to its host (ComfyUI, the CLI, a test)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class RunHooks:
    """Per-step progress, an interrupt check that raises, and a request to free device memory."""

    on_step: Callable[[int, int], None] = lambda step, total: None
    check_interrupt: Callable[[], None] = lambda: None
    make_room: Callable[[int, torch.device], None] = lambda nbytes, device: None  # before the first onload
