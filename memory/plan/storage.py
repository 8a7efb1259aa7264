"""Weight bytes as stored: which tensors a storage format shrinks, and what that costs at run time.

Which tensors a format stores is the format's own declaration (`StorageFormat.lowers`, the one the
loaders' `weight_dtype` lowering reads too): every `nn.Linear` weight, and token embeddings
(`nn.Embedding`) only for formats whose files hold them narrow (GGUF; Comfy-Org's fp8 files keep
umt5's `shared.weight` in bf16). Biases, norms, convolutions and modulation tables stay in the
compute dtype. A stored tensor costs `StorageFormat.stored_bytes(numel)` (whole GGUF blocks), plus
one float32 scale for "fp8 scaled".

While a stored layer computes, the engine upcasts its weight to the compute dtype, through float32
temporaries for scaled fp8 and GGUF, in row chunks for large matrices; `upcast_workspace_bytes`
(memory.storage, measured against the engine's allocations) says how many bytes that takes. They
are freed before the next layer runs, so a component's transient is its largest stored linear
weight's workspace (`StoredSizes.transient_bytes`); each layer's own (`workspace_by_tensor`) is
kept for the sequential tier, whose phase holds it only while that layer computes. A stored
embedding dequantizes only the rows it looks up (`StoredTensor.select_rows`), a few tokens'
worth, so it adds no transient of note.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

import torch
from torch import nn

from ..storage.apply import lowered_weights
from ..storage.formats import StorageFormat, storage_format
from ..storage.stored import upcast_workspace_bytes

# Comfy-Org's "fp8 scaled" files carry one float32 `scale_weight` per quantized tensor.
FP8_SCALE_BYTES = 4


@dataclass(frozen=True)
class StoredSizes:
    """A component's quantized tensors under one format: stored bytes per tensor and the transient."""

    storage: str | None = None  # the format's name; None: every tensor in its compute dtype
    by_tensor: Mapping[int, int] = field(default_factory=lambda: MappingProxyType({}), repr=False, compare=False)
    transient_bytes: int = 0  # the largest stored weight's upcast workspace (upcast_workspace_bytes)
    stored_weights: int = 0  # weights upcast per forward pass (linear layers held below their compute dtype)
    # the upcast workspace of each stored weight (keyed as `by_tensor`), held while its layer computes
    workspace_by_tensor: Mapping[int, int] = field(default_factory=lambda: MappingProxyType({}), repr=False, compare=False)

    @property
    def widens(self) -> bool:
        """Whether an upcast only widens the stored values (plain fp8: one read, one write) rather
        than computing them through float32 temporaries (scaled fp8, GGUF)."""
        if self.storage is None:
            return False
        fmt = storage_format(self.storage)
        return fmt.gguf_type is None and not fmt.scaled

    def nbytes(self, key: int, tensor: torch.Tensor) -> int:
        """Bytes of `tensor` (`key`: id of its Parameter or buffer object) as the component holds it."""
        return self.by_tensor.get(key, tensor.numel() * tensor.element_size())


def quantizable(module: nn.Module, fmt: StorageFormat) -> list[tuple[nn.Module, nn.Parameter]]:
    """The layers whose weight `fmt` stores (`lowered_weights`, the rule the loaders lower by), each
    weight once (tied weights are one tensor)."""
    lowered = lowered_weights(module, fmt)
    found: dict[int, tuple[nn.Module, nn.Parameter]] = {}
    for name, sub in module.named_modules():
        if (f"{name}.weight" if name else "weight") in lowered:
            weight = sub._parameters["weight"]
            found.setdefault(id(weight), (sub, weight))
    return list(found.values())


def stored_tensor_bytes(numel: int, fmt: StorageFormat) -> int:
    return fmt.stored_bytes(numel) + (FP8_SCALE_BYTES if fmt.scaled else 0)


def stored_sizes(module: nn.Module, fmt: StorageFormat | None) -> StoredSizes:
    """`module`'s weights under `fmt`. A format equal to a tensor's own dtype changes nothing for
    it (bf16 storage of a bf16 model)."""
    if fmt is None:
        return StoredSizes()
    sizes, workspaces, upcast = {}, {}, 0
    for layer, weight in quantizable(module, fmt):
        if fmt.torch_dtype == weight.dtype and not fmt.scaled:
            continue
        sizes[id(weight)] = stored_tensor_bytes(weight.numel(), fmt)
        if isinstance(layer, nn.Embedding):  # dequantized row by row: no whole-weight transient
            continue
        workspaces[id(weight)] = upcast_workspace_bytes(fmt, weight.shape, weight.dtype)
        upcast += weight.numel()
    return StoredSizes(fmt.name, MappingProxyType(sizes), max(workspaces.values(), default=0), upcast,
                       MappingProxyType(workspaces))
