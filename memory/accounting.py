"""Count the bytes a forward pass would hold, without running it: tensors on the meta device.

How it works: the model is built on `meta` (shapes, no storage) and called under a
`TensorLedger`, a TorchDispatchMode that sees every aten op. Each op that returns a fresh tensor
(its schema says the output aliases no input) adds the output storage's bytes, rounded up to the
512-byte blocks of PyTorch's CUDA caching allocator; a `weakref.finalize` on the storage takes
them off when Python drops the last reference, exactly when the caching allocator would reuse
the block. The ledger keeps the running peak and, for the allocator model in
`plan/allocator.py`, the ordered stream of allocations and frees.

Caveats, and what is done about them:
- On meta, `scaled_dot_product_attention` takes the unfused math path and materialises the
  [L, S] score matrix; GPUs run fused kernels (flash / memory-efficient) that hold only the
  output and a float32 logsumexp. `Attention.FUSED` (the default) accounts exactly that;
  `Attention.MATH` keeps the math path, for GPUs or dtypes without a fused kernel.
- Kernel workspaces that never become tensors (cuDNN convolution workspace) are invisible here.
- Meta kernels run in Python and are slow (a Wan VAE decode is seconds); outputs of ops that
  create fresh tensors are a pure function of their inputs' metadata, so `OpCache` memoises them
  and repeated blocks and frames cost a dictionary lookup.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

# c10/cuda/CUDACachingAllocator.cpp `kMinBlockSize`: every block is a multiple of 512 bytes.
ALLOCATION_ROUNDING = 512


class Attention(str, Enum):
    FUSED = "fused"  # output + float32 logsumexp, as flash / memory-efficient kernels hold
    MATH = "math"  # the unfused path: the full score matrix is materialised


@dataclass(frozen=True)
class Trace:
    """What one call held: peak live bytes, its allocation stream, and its matmul/conv FLOPs.

    `events`: n > 0 allocates n bytes (allocations are numbered in order), -(k + 1) frees the
    k-th allocation. Tensors still alive when the call returns are never freed in the stream.
    `marks`: where in `events` each module holding tensors of its own started and ended its
    forward, as (number of events before it, starts, module name), when `trace` was given the
    module: a tier that moves weights module by module replays them between the call's events.
    """

    peak_bytes: int
    events: tuple[int, ...]
    flops: float
    live_bytes: int  # still held when the call returned (its outputs)
    marks: tuple[tuple[int, bool, str], ...] = ()


def rounded(nbytes: int) -> int:
    return -(-nbytes // ALLOCATION_ROUNDING) * ALLOCATION_ROUNDING


class OpCache:
    """Output metadata of fresh-tensor ops, keyed by the op and its inputs' metadata."""

    def __init__(self) -> None:
        self._outputs: dict[tuple, tuple] = {}
        self.hits = 0

    def lookup(self, key: tuple | None) -> tuple | None:
        found = self._outputs.get(key) if key is not None else None
        self.hits += found is not None
        return found

    def store(self, key: tuple | None, out: Any) -> None:
        if key is None:
            return
        tensors = out if isinstance(out, (tuple, list)) else (out,)
        if all(isinstance(t, torch.Tensor) for t in tensors):
            meta = tuple((tuple(t.shape), t.stride(), t.dtype) for t in tensors)
            self._outputs[key] = (isinstance(out, (tuple, list)), meta)


class TensorLedger(TorchDispatchMode):
    """Live and peak bytes of the tensors created while active, one count per storage."""

    def __init__(self, cache: OpCache | None = None) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.flops = 0.0
        self.events: list[int] = []
        self._cache = cache
        self._recording = True
        self._count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        fresh = not func._schema.is_mutable and all(r.alias_info is None for r in func._schema.returns)
        key = _op_key(func, args, kwargs) if fresh and self._cache is not None else None
        cached = self._cache.lookup(key) if key is not None else None
        if cached is not None:
            out = _rebuild(*cached)
        else:
            out = func(*args, **kwargs)
            if fresh and _returns_an_input(out, args, kwargs):
                # an op whose schema claims a fresh result but hands back an input's storage (aten._unsafe_view,
                # which matmul's reshape runs): nothing is allocated, and a cached rebuild would allocate
                fresh = False
            elif key is not None:
                self._cache.store(key, out)
        if fresh:
            for tensor in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(tensor, torch.Tensor):
                    self._allocate(tensor.untyped_storage())
        counter = flop_registry.get(func._overloadpacket)
        if counter is not None:
            self.flops += counter(*args, **kwargs, out_val=out)
        return out

    def add_flops(self, flops: float) -> None:
        self.flops += flops

    def stop(self) -> None:
        """Stop recording: storages that die later (module caches) no longer touch the stream."""
        self._recording = False

    def _allocate(self, storage: torch.UntypedStorage) -> None:
        nbytes = rounded(storage.nbytes())
        if not nbytes:
            return
        index = self._count
        self._count += 1
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        self.events.append(nbytes)
        weakref.finalize(storage, self._free, nbytes, index)

    def _free(self, nbytes: int, index: int) -> None:
        if self._recording:
            self.live -= nbytes
            self.events.append(-(index + 1))


class _FusedAttention(TorchFunctionMode):
    """Replace `scaled_dot_product_attention` by what a fused GPU kernel allocates."""

    def __init__(self, ledger: TensorLedger) -> None:
        super().__init__()
        self._ledger = ledger

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v = (list(args) + [kwargs.get(n) for n in ("query", "key", "value")[len(args):]])[:3]
        out_shape = (*q.shape[:-1], v.shape[-1])
        logsumexp = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        out = _laid_out_as(q, out_shape)
        del logsumexp
        batch_heads = q.shape[:-2].numel()
        self._ledger.add_flops(2.0 * batch_heads * q.shape[-2] * k.shape[-2] * (q.shape[-1] + v.shape[-1]))
        return out


def _laid_out_as(q: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A fused kernel's output, laid out in memory as its query is (flash, memory-efficient and cuDNN
    attention on CUDA, and flash attention on the CPU, all write it so): a pipeline's usual transpose
    back and flatten then makes no copy."""
    order = sorted(range(q.dim()), key=lambda d: (-q.stride(d), d))  # dimensions, outermost first
    out = torch.empty([shape[d] for d in order], dtype=q.dtype, device=q.device)
    return out.permute(*[order.index(d) for d in range(q.dim())])


def trace(fn: Callable[[], Any], attention: Attention = Attention.FUSED, cache: OpCache | None = None,
          module: torch.nn.Module | None = None) -> Trace:
    """Run `fn` (which builds its inputs on meta and calls meta modules) and account what it held.

    With `module` (the one `fn` calls), the trace also marks where in its events each submodule
    that holds tensors of its own started and ended (`Trace.marks`)."""
    ledger = TensorLedger(cache)
    fused = _FusedAttention(ledger) if Attention(attention) is Attention.FUSED else None
    marks: list[tuple[int, bool, str]] = []
    handles = _mark_modules(module, ledger, marks) if module is not None else []
    try:
        with torch.no_grad(), ledger, fused if fused is not None else contextlib.nullcontext():
            result = fn()
    finally:
        for handle in handles:
            handle.remove()
    live = ledger.live
    ledger.stop()  # what the call returns stays allocated: it is not freed in the stream
    del result
    return Trace(ledger.peak, tuple(ledger.events), ledger.flops, live, tuple(marks))


def _mark_modules(module: torch.nn.Module, ledger: TensorLedger, marks: list) -> list:
    """Hooks noting (events so far, starts, name) around every submodule holding tensors of its own."""
    handles = []
    for name, sub in module.named_modules():
        if any(True for _ in sub.parameters(recurse=False)) or any(True for _ in sub.buffers(recurse=False)):
            handles.append(sub.register_forward_pre_hook(lambda m, a, n=name: marks.append((len(ledger.events), True, n))))
            handles.append(sub.register_forward_hook(lambda m, a, o, n=name: marks.append((len(ledger.events), False, n))))
    return handles


def _op_key(func, args, kwargs) -> tuple | None:
    try:
        key = (func, _meta_of(args), _meta_of(tuple(sorted(kwargs.items()))))
        hash(key)
        return key
    except TypeError:
        return None


def _meta_of(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("T", tuple(value.shape), value.stride(), value.dtype, value.device.type)
    if isinstance(value, (tuple, list)):
        return tuple(_meta_of(v) for v in value)
    return value


def _returns_an_input(out: Any, args, kwargs) -> bool:
    """Whether a tensor `out` holds shares its storage with a tensor in the op's arguments."""
    inputs = {t.untyped_storage()._cdata for t in _tensors((args, kwargs))}
    return any(t.untyped_storage()._cdata in inputs for t in _tensors(out))


def _tensors(value: Any):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _rebuild(is_sequence: bool, meta: tuple) -> Any:
    tensors = [torch.empty_strided(shape, stride, dtype=dtype, device="meta") for shape, stride, dtype in meta]
    return tuple(tensors) if is_sequence else tensors[0]
