"""RunHooks: how a sampling or decoding run talks to its host (ComfyUI, the CLI, a test).

Cancel takes effect within one block: `interrupt_checks` puts the host's interrupt check in
front of every transformer block (and text-encoder block) for the length of one call, so a
Cancel pressed mid-step stops the run before the next block starts, not a whole step later.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch
from torch import nn

from .prompt_cache import PromptCache


@dataclass(frozen=True)
class RunHooks:
    """Per-step progress, an interrupt check that raises, a request to free device memory, the
    device memory the run may still use, where prompt embeddings are cached (None:
    encode every time), and the pinned RAM the host may still lock."""

    on_step: Callable[[int, int], None] = lambda step, total: None
    check_interrupt: Callable[[], None] = lambda: None
    # Before the first onload: room for `nbytes` (weights + activations) on `device`. With a warm
    # store, the host also registers what it keeps (`weight_bytes` of them wanted on the device),
    # so its memory manager counts the store and can ask for memory back (nodes/host.py).
    make_room: Callable[..., None] = lambda nbytes, device, warm=None, weight_bytes=0: None
    # Device bytes this run may still use now: free memory, within the user's VRAM budget when one is
    # set (memory/telemetry.budgeted_free_bytes). Read for activation_chunks=auto, for the streamed
    # blocks kept beyond the plan (room.keep_bytes) and after an out-of-memory error to pick the next
    # rung; None: unknown (one slice, nothing kept, the fixed ladder).
    device_budget: Callable[[torch.device], int | None] = lambda device: None
    prompt_cache: PromptCache | None = None
    # What the host's pinned-memory budget still allows (inside ComfyUI: its MAX_PINNED_MEMORY less
    # what it has pinned), read before each run; the automatic pinned ceiling stays within it
    # (memory.hostpool.pinned_cap_bytes). None: the host has no such budget.
    pinned_room: Callable[[], int | None] = lambda: None
    # False: an out-of-memory error while denoising is raised at once instead of climbing the
    # ladder. A rank of a context-parallel run must not change strategy on its own: its peers
    # would wait for it in the next collective until the process group's timeout.
    climb_on_oom: bool = True


def outer_blocks(module: nn.Module) -> list[nn.Module]:
    """The items of a module's outermost ModuleLists (T5's `encoder.block`, CLIP's `encoder.layers`).

    Inner lists (a T5 block's `layer`) are not descended into: one check per block is enough.
    """
    found: list[nn.Module] = []
    pending = list(module.children())
    while pending:
        child = pending.pop(0)
        if isinstance(child, nn.ModuleList):
            found.extend(child)
        else:
            pending.extend(child.children())
    return found


@contextmanager
def interrupt_checks(blocks: Iterable[nn.Module], check_interrupt: Callable[[], None]) -> Iterator[None]:
    """Call `check_interrupt()` before each block's forward, for the length of the `with`.

    The check is prepended, so it runs before any streaming hook would onload the block it
    stops; raising from it unwinds the caller's `with apply_strategy(...)`, which restores every
    weight. The hooks are removed in `finally`, on success, error or cancel alike.
    """
    handles = []
    try:
        for block in blocks:
            handles.append(block.register_forward_pre_hook(lambda module, args: check_interrupt(), prepend=True))
        yield
    finally:
        for handle in handles:
            handle.remove()
