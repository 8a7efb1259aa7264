"""Plans for LoRA training: a training step's peak VRAM and RAM per offload tier, before any weight moves.

A step holds, on the device: the denoiser's weights as the tier keeps them resident, the LoRA
weights, their gradients and (unless CPU-offloaded) the optimizer states for the whole run, and
the activations autograd saves for the backward. The text encoder and the VAE are absent (latents
and prompt embeddings are precomputed); Wan 2.2 A14B trains one expert per run.

Activations are traced, not guessed: one forward + backward of the denoiser cut to one, two and
three blocks, on the meta device, under the accounting `TensorLedger` (on meta, tensors autograd
saves stay alive until the backward frees them, as on a GPU). The three-block peak less the
two-block peak is what each further block adds, and the real block count extrapolates from two.
The step from one block to two is no guide: it also holds a one-time cost (the first block's input
needs no gradient, since nothing upstream trains; from the second block on a block input's gradient
is computed), and counting it per block doubled Wan 2.1 14B's activations at 832x480x81 (49.7 GiB
at 40 blocks for a traced 25.9). With checkpointing each block is wrapped in
`torch.utils.checkpoint` (non-reentrant), so a block keeps only its input and the backward re-runs
one block at a time; streamed tiers require it (training/loop.py says so).

Pure: no pipelines/ imports. The caller hands in the traced module, its block list and the call
that runs one denoise step on it (vidmem.pipelines.configs builds them); this module changes them
only inside `_training_view` and restores them on the way out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.checkpoint import checkpoint

from ..accounting import Attention, TensorLedger
from ..activation_offload import UNPINNED, ActivationOffload, ActivationPool, InlineCopies, checkpointing_switched

FP32 = 4
BNB_BLOCK = 256  # bitsandbytes' block size for 8-bit states (one float32 absmax per block per state)
BNB_MIN_8BIT = 4096  # smaller tensors keep 32-bit states
BNB_QMAP_BYTES = 2 * 256 * FP32  # two 256-entry float32 code maps per tensor
OPTIMIZERS = ("adamw", "adamw_8bit", "adamw_cpu_offload")


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


def training_bytes(linear_shapes: list[tuple[int, int]], rank: int, optimizer: str) -> TrainingBytes:
    """Bytes for LoRA training of layers of `linear_shapes` [(out, in), ...] at `rank`."""
    optimizer = getattr(optimizer, "value", optimizer)
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer {optimizer!r} is not one of {', '.join(OPTIMIZERS)}.")
    tensors = [n for pair in lora_shapes(linear_shapes, rank) for n in pair]
    weights = sum(tensors) * FP32
    if optimizer == "adamw_8bit":
        states = sum(_bnb_state_bytes(n) for n in tensors)
    else:
        states = sum(2 * n * FP32 + FP32 for n in tensors)  # exp_avg, exp_avg_sq, step
    on_host = optimizer == "adamw_cpu_offload"
    return TrainingBytes(weights, weights, states, on_host, weights if on_host else 0)


def _bnb_state_bytes(count: int) -> int:
    if count < BNB_MIN_8BIT:
        return 2 * count * FP32
    blocks = -(-count // BNB_BLOCK)
    return 2 * count + 2 * blocks * FP32 + BNB_QMAP_BYTES


def matches_target(path: str, targets: tuple[str, ...]) -> bool:
    """PEFT's `target_modules` rule: the name, or a dotted suffix of it."""
    return any(path == t or path.endswith("." + t) for t in targets)


def block_target_shapes(blocks: nn.ModuleList, targets: tuple[str, ...]) -> list[tuple[int, int]]:
    """(out, in) of every targeted nn.Linear inside the blocks (meta modules: shapes only)."""
    return [(m.out_features, m.in_features) for block in blocks for name, m in block.named_modules()
            if isinstance(m, nn.Linear) and matches_target(name, targets)]


@dataclass(frozen=True)
class ActivationPeaks:
    """Traced training-step peaks (bytes) of the denoiser cut to one, two and three blocks.

    `kept_per_block`: what the trainer's selective checkpointing keeps of each checkpointed block
    beyond its input (its self-attention output and logsumexp, training/autograd.py), held from
    the block's forward to its backward; the traced blocks re-run everything, so it is added here.
    """

    one_block: int
    two_blocks: int
    three_blocks: int
    kept_per_block: int = 0
    # What activation offload moves (bytes per tensor, `trace_offloaded_step`): the first
    # checkpointed block's inputs, then each later block's. None: not traced, one `per_block` each.
    offloaded: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    # The step traced with activation offload at three blocks, prefetch 1 (None: not traced).
    offloaded_step: int | None = None

    @property
    def per_block(self) -> int:
        """What each block past the second adds: with checkpointing, its input (what activation offload moves)."""
        return max(0, self.three_blocks - self.two_blocks)

    @property
    def once(self) -> int:
        """What the second block adds beyond its input, once for the run: the backward of a block
        whose input needs a gradient (every block but the first)."""
        return max(0, self.two_blocks - self.one_block - self.per_block)

    def at(self, blocks: int) -> int:
        """Linear in the block count from the second block on: every further block adds its input."""
        if blocks <= 1:
            return self.one_block + max(0, blocks) * self.kept_per_block
        return self.two_blocks + (blocks - 2) * self.per_block + blocks * self.kept_per_block

    def offloaded_at(self, blocks: int, prefetch: int) -> int:
        """With activation offload (memory/activation_offload.py): the block inputs wait on the host,
        so the device holds one block's worth (the re-run, its input and the one-time input gradient)
        plus the `prefetch` blocks' inputs copied ahead, and whatever else stays per block (the
        trainer turns selective checkpointing off with offload). The copies ahead peak when they
        reach the first block, whose inputs come back whole (`offloaded[0]`): those it shares with
        the later blocks (Wan's text embedding and timestep projection) stay alive on the device
        as well, so they count twice (Wan 2.2 TI2V's per-token timestep projection, 0.94 GiB at
        1280x704x121).

        Where the offloaded step was traced (`offloaded_step`, three blocks at prefetch 1), it is the
        figure, and each further block prefetched adds a later block's inputs: a sum of the plain
        traces would be too high where a block's copied-back input dies once its re-run is done (a
        plain checkpoint holds the original to the block's end; Wan 2.1 1.3B: 5/6 of a hidden state
        at the peak) and too low where the third block adds bytes the second does not (CogVideoX's
        text state). Beyond three blocks nothing more stays on the device. With two blocks it can be
        a block's text state high, never low."""
        stays = blocks * self.kept_per_block
        if blocks <= 1:
            return self.one_block + stays
        ahead = min(max(1, prefetch), blocks - 1)
        later = sum(self.offloaded[1]) if self.offloaded else self.per_block
        if self.offloaded_step is not None:
            return self.offloaded_step + (ahead - 1) * later + stays
        first = sum(self.offloaded[0]) if self.offloaded else self.per_block
        return self.one_block + self.once + first + (ahead - 1) * self.per_block + stays

    def offloaded_inputs(self, moved_blocks: int) -> list[int]:
        """The inputs activation offload moves in one step over `moved_blocks` checkpointed blocks,
        in the forward's order (bytes each): what the run's pool is asked for, in that order."""
        if moved_blocks < 1:
            return []
        first, later = self.offloaded or ((self.per_block,), (self.per_block,))
        return [n for n in first if n] + [n for _ in range(moved_blocks - 1) for n in later if n]


def trace_activations(module: nn.Module, blocks: nn.ModuleList, run: Callable[[], torch.Tensor], rank: int,
                      targets: tuple[str, ...], checkpointing: bool,
                      attention: Attention = Attention.FUSED) -> ActivationPeaks:
    """Peak bytes of one forward + backward (loss on `run()`'s output) with 1, 2 and 3 blocks kept,
    and with checkpointing, of the same step with activation offload at three blocks.
    `blocks` needs three (or all the model has) for the per-block increment past the second."""
    peaks, kept = [], 0
    for keep in (1, 2, 3):
        with _training_view(module, blocks, keep, rank, targets, checkpointing, attention):
            counter = _SelfAttentionOutputs()
            peaks.append(_trace_step(run, attention, counter))
            if keep == 1 and checkpointing:
                kept = counter.forward_bytes
    traced = trace_offloaded_step(module, blocks, run, rank, targets, attention) if checkpointing else None
    step, moved = traced or (None, None)
    return ActivationPeaks(*peaks, kept_per_block=kept, offloaded=moved, offloaded_step=step)


class _FreshCopies(InlineCopies):
    """Copies back to the (meta) device made as new tensors, as a GPU makes them: the ledger counts them."""

    def to_device(self, host: torch.Tensor, filled: object) -> tuple[torch.Tensor, None]:
        return host.clone(), None


def _host_buffer(nbytes: int) -> torch.Tensor:
    """A pool buffer made outside the ledger: host memory is not the device's to count."""
    with _disable_current_modes():
        return torch.empty(nbytes, dtype=torch.uint8, device="meta")


def trace_offloaded_step(module: nn.Module, blocks: nn.ModuleList, run: Callable[[], torch.Tensor], rank: int,
                         targets: tuple[str, ...], attention: Attention = Attention.FUSED,
                         ) -> tuple[int, tuple[tuple[int, ...], tuple[int, ...]]] | None:
    """One training step with activation offload on three blocks (or all the module has), prefetch 1,
    traced on meta as the run makes it: the run's own `ActivationOffload.saving` around each block,
    called as the trainer calls it, through the model's gradient-checkpointing switch (which hands
    each block its inputs positionally: what checkpoint saves, and so what the offload sees), and
    `begin_backward` before the backward. Returns the step's peak and the bytes the offload moved
    for the first checkpointed block and for a later one: the first moves every tensor input, a
    later one only those the previous block was not handed. None without a checkpointing switch."""
    offload = ActivationOffload(_FreshCopies(torch.device("meta")), ActivationPool(_host_buffer, UNPINNED))
    contexts = _attention_contexts if Attention(attention) is Attention.FUSED else _no_contexts
    moved: list[list[int]] = []

    def checkpointed(block, *args, **kwargs):
        with offload.saving(args):
            return checkpoint(block.__call__, *args, use_reentrant=False, context_fn=contexts, **kwargs)

    def begin_backward():
        moved.extend(offload.block_inputs())
        offload.begin_backward()

    try:
        with _training_view(module, blocks, 3, rank, targets, False, attention), \
                checkpointing_switched(_switches(module), True, checkpointed):
            peak = _trace_step(run, attention, before_backward=begin_backward)
    finally:
        offload.close()
    if not moved:  # no checkpointing switch (a plain module): the planner counts one `per_block` input a block
        return None
    return peak, (tuple(moved[0]), tuple(moved[1]) if len(moved) > 1 else tuple(moved[0]))


def _switches(module: nn.Module) -> list[nn.Module]:
    """The modules holding diffusers' per-block checkpointing switch."""
    return [m for m in module.modules() if hasattr(m, "gradient_checkpointing")]


def _trace_step(run: Callable[[], torch.Tensor], attention: Attention, counter: "_SelfAttentionOutputs | None" = None,
                before_backward: Callable[[], None] = lambda: None) -> int:
    ledger = TensorLedger()
    _COUNTERS.append(counter or _SelfAttentionOutputs())
    try:
        with ExitStack() as stack, torch.enable_grad():
            stack.enter_context(ledger)
            # The fused stand-in notes attention calls itself (inside checkpointed blocks it is the
            # innermost mode); for plain attention a mode that only notes them does.
            stack.enter_context(_FusedTrainingAttention() if Attention(attention) is Attention.FUSED else _NoteAttention())
            loss = run().float().square().mean()
            before_backward()
            loss.backward()
            del loss
    finally:
        _COUNTERS.pop()
    ledger.stop()
    return ledger.peak


class _SelfAttentionOutputs:
    """Bytes of the outputs (and float32 logsumexp) of attention calls whose keys are as long as
    their queries, in the forward: what selective checkpointing keeps per checkpointed block."""

    def __init__(self) -> None:
        self.forward_bytes = 0

    def note(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if torch._C._current_graph_task_id() == -1 and q.shape[-2] == k.shape[-2]:
            rows = q.numel() // q.shape[-1]
            self.forward_bytes += rows * v.shape[-1] * q.element_size() + rows * FP32


_COUNTERS: list[_SelfAttentionOutputs] = []  # the trace running now (traces run one at a time)


def _attention_inputs(args, kwargs):
    return (list(args) + [kwargs.get(n) for n in ("query", "key", "value")[len(args):]])[:3]


class _NoteAttention(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and _COUNTERS:
            _COUNTERS[-1].note(*_attention_inputs(args, kwargs))
        return func(*args, **kwargs)


@contextmanager
def _training_view(module: nn.Module, blocks: nn.ModuleList, keep: int, rank: int, targets: tuple[str, ...],
                   checkpointing: bool, attention: Attention = Attention.FUSED) -> Iterator[None]:
    """The module with `keep` blocks, frozen base weights, LoRA on the targets and (optionally)
    checkpointed blocks; everything is put back on exit (the module is the planner's cached one)."""
    original = dict(blocks._modules)
    grads = {name: p.requires_grad for name, p in module.named_parameters()}
    kept = [original[key] for key in list(original)[:keep]]
    hooks = [_attach_lora(m, rank) for block in kept for name, m in block.named_modules()
             if isinstance(m, nn.Linear) and matches_target(name, targets)]
    module.requires_grad_(False)
    blocks._modules.clear()
    for index, block in enumerate(kept):
        blocks._modules[str(index)] = _Checkpointed(block, attention) if checkpointing else block
    try:
        yield
    finally:
        blocks._modules.clear()
        blocks._modules.update(original)
        for handle in hooks:
            handle.remove()
        for name, p in module.named_parameters():
            if p.requires_grad != grads[name]:  # an inference tensor refuses the call even when unchanged
                p.requires_grad_(grads[name])


def _attach_lora(linear: nn.Linear, rank: int):
    """out + up(down(x)): float32 LoRA weights that require grad, so autograd saves what a real
    LoRA run saves. They are made outside the ledger and their gradients are dropped as soon as
    they are made: both are `training_bytes`' to count, for the whole step (the trace held each
    block's gradients from its backward on, so the plan counted most of them twice)."""
    down = torch.zeros(rank, linear.in_features, device="meta", requires_grad=True)
    up = torch.zeros(linear.out_features, rank, device="meta", requires_grad=True)
    for weight in (down, up):
        weight.register_post_accumulate_grad_hook(_drop_gradient)

    def hook(mod, inputs, out):  # as training/adapters.py: float32 LoRA on an upcast input, scaled
        return out + (F.linear(F.linear(inputs[0].float(), down), up) * 1.0).to(out.dtype)
    return linear.register_forward_hook(hook)


def _drop_gradient(weight: torch.Tensor) -> None:
    weight.grad = None


class _Checkpointed(nn.Module):
    def __init__(self, block: nn.Module, attention: Attention) -> None:
        super().__init__()
        self.block = block
        self.fused = Attention(attention) is Attention.FUSED

    def forward(self, *args, **kwargs):
        # The backward re-runs the block on the autograd engine's side, where the caller's
        # TorchFunctionMode is not active: hand the fused-attention mode to the recompute too.
        return checkpoint(self.block, *args, use_reentrant=False, context_fn=_attention_contexts if self.fused else _no_contexts, **kwargs)


def _attention_contexts():
    return _FusedTrainingAttention(), _FusedTrainingAttention()


def _no_contexts():
    return nullcontext(), nullcontext()


class _FlashAttention(torch.autograd.Function):
    """What a fused (flash / memory-efficient) kernel holds: the output and a float32 logsumexp
    saved for the backward, which makes q, k, v-sized gradients; never the score matrix."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = q.new_empty((*q.shape[:-1], v.shape[-1]))
        logsumexp = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, logsumexp)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class _FusedTrainingAttention(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v = _attention_inputs(args, kwargs)
        if _COUNTERS:
            _COUNTERS[-1].note(q, k, v)
        return _FlashAttention.apply(q, k, v)
