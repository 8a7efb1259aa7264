"""How training's backward pass lives with a MemoryStrategy that moves weights by re-pointing them.

Two facts of torch's autograd decide it:

1. An op that saves a parameter for its backward (a linear layer saves its weight to compute the
   input's gradient) saves the Parameter object itself, not its current storage. The strategy's
   eviction re-points `param.data` at the host copy (or, with the test backend, at poison), so a
   backward reading a streamed weight after its block was evicted would read the wrong storage.
   `frozen_saved_by_storage` therefore saves every tensor that needs no gradient (frozen weights,
   inputs) as `detach()`: an alias of the storage the forward actually used. That is also what the
   memory costs: the device copy stays alive until its backward has run.
2. Per-block gradient checkpointing (non-reentrant `torch.utils.checkpoint`) saves nothing inside a
   block during the forward and re-runs the block's forward during the backward, through the
   module's `__call__`, so the strategy's hooks stream the block in again, blocks in reverse order;
   but checkpoint's re-run keeps tensors that need no gradient by reference, so a layer the
   `sequential` tier evicts right after its re-run would lose its weight before its backward.
   The re-run therefore runs under `frozen_saved_by_storage` as well, layered over checkpoint's
   own hooks (it aliases, then hands the alias on to them).

Without checkpointing a streamed tier therefore keeps every streamed block's weights alive until
the backward: it computes correctly but saves no memory. The loop refuses that combination.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from functools import partial
from typing import Iterator

import torch
import torch.utils.checkpoint
from torch import nn

from ..memory.activation_offload import ActivationOffload, checkpointing_switched
from .errors import TrainingError


def _identity(tensor):
    return tensor


# torch has no public getter for the active saved-tensor hooks; this private one exists from torch
# 2.8 (taking `ignore_is_tracing` in recent versions). Without it the hooks cannot be layered over
# checkpoint's re-run, so the `sequential` tier is refused for training (check_layering).
_TOP_HOOKS = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def can_layer_hooks() -> bool:
    return _TOP_HOOKS is not None


def _active_hooks():
    if _TOP_HOOKS is None:
        return None
    try:
        return _TOP_HOOKS(False)
    except TypeError:  # older signature without the argument
        return _TOP_HOOKS()


@contextmanager
def frozen_saved_by_storage() -> Iterator[None]:
    """Save tensors without gradients by their current storage (see the module docstring).

    Only the innermost saved-tensor hooks apply, so these wrap whatever hooks are active when
    entered (checkpoint's re-run hooks): alias first, then pass the alias on.
    """
    outer = _active_hooks()
    outer_pack, outer_unpack = outer if outer is not None else (_identity, _identity)

    def pack(tensor: torch.Tensor):
        return outer_pack(tensor if tensor.requires_grad else tensor.detach())

    with torch.autograd.graph.saved_tensors_hooks(pack, outer_unpack):
        yield


def _rerun_contexts():
    return nullcontext(), (frozen_saved_by_storage() if can_layer_hooks() else nullcontext())


_ATTENTION_OPS = tuple(getattr(torch.ops.aten, name).default for name in (
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
    if hasattr(torch.ops.aten, name))


def _save_self_attention(ctx, op, *args, **kwargs):
    """Keep the output of attention over the video tokens themselves (keys as long as queries):
    the one op whose cost grows with the square of the token count, for one token-sized output."""
    from torch.utils.checkpoint import CheckpointPolicy

    if op in _ATTENTION_OPS and args[0].shape[-2] == args[1].shape[-2]:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    forward, rerun = create_selective_checkpoint_contexts(_save_self_attention)
    return forward, _Both(rerun, frozen_saved_by_storage() if can_layer_hooks() else nullcontext())


class _Both:
    """Two context managers entered in order (checkpoint's context_fn hands back one per side)."""

    def __init__(self, first, second) -> None:
        self.first, self.second = first, second

    def __enter__(self):
        self.first.__enter__()
        try:
            self.second.__enter__()
        except BaseException:
            self.first.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc):
        try:
            self.second.__exit__(*exc)
        finally:
            self.first.__exit__(*exc)
        return False


def check_layering(streams_leaves: bool) -> None:
    """The `sequential` tier evicts layers between a block's re-run and its backward: that needs the
    re-run's saved weights aliased, which needs the hook getter."""
    if streams_leaves and not can_layer_hooks():
        raise TrainingError(f"offload='sequential' during training needs torch 2.8 or newer (this is {torch.__version__}); "
                            "choose offload 'block_swap' (blocks_to_swap = all blocks streams the whole transformer) "
                            "or update torch.")


def _checkpointed(module: nn.Module, *args, kept: nn.Module | None = None, selective: bool = False,
                  offload: ActivationOffload | None = None, **kwargs):
    if module is kept:
        return module(*args, **kwargs)
    # Non-reentrant checkpoint saves the block's inputs under the hooks active when it is called
    # (before entering its own): `offload.saving` puts them in host memory (memory/activation_offload.py).
    with offload.saving(args) if offload is not None else nullcontext():
        # determinism_check="default" compares each re-run's tensor shapes/dtypes/devices with the forward's.
        return torch.utils.checkpoint.checkpoint(module.__call__, *args, use_reentrant=False,
                                                 context_fn=_selective_contexts if selective else _rerun_contexts,
                                                 **kwargs)


@contextmanager
def gradient_checkpointing(model: nn.Module, enabled: bool, keep_last: nn.Module | None = None,
                           selective: bool = False, offload: ActivationOffload | None = None) -> Iterator[None]:
    """Per-block checkpointing through the model's own switch (diffusers' `gradient_checkpointing`
    attribute on the modules that loop over blocks), restored exactly afterwards.

    `keep_last`: the last block, run without checkpointing. Its backward comes right after the
    forward, so its activations are what a re-run would rebuild at that moment: keeping them costs
    no more at the peak (the forward's end holds the other blocks' inputs and this block's
    activations; the backward's re-run of a block holds the same) and saves re-running one block
    in N (as torch's checkpoint_sequential leaves its last segment). Only for tiers that keep
    the blocks resident: a streamed block's weights would stay on the device until its backward.

    `selective`: each checkpointed block also keeps its self-attention output (and logsumexp),
    the one op whose cost grows with the square of the token count, for one tensor the size of
    the block's input; its re-run then skips the attention kernel (torch's selective activation
    checkpointing). Cross-attention over the text is re-run (its keys are the short side). Not
    with streamed tiers: their hooks copy weights inside the re-run, at other moments than in
    the forward, and selective checkpointing replays the forward's op sequence exactly.

    `offload`: the checkpointed blocks' inputs wait in host memory until the backward
    (memory/activation_offload.py); what selective checkpointing keeps stays on the device.
    """
    switches = [m for m in model.modules() if hasattr(m, "gradient_checkpointing")]
    if enabled and not switches:
        raise TrainingError(f"{type(model).__name__} has no gradient checkpointing switch; set gradient_checkpointing "
                            "to false.")
    func = partial(_checkpointed, kept=keep_last, selective=selective, offload=offload)
    with checkpointing_switched(switches, enabled, func):
        yield
