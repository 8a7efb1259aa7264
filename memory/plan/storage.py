"""Weight bytes as stored: which tensors a storage format shrinks, and what that costs at run time.

Only the large matrices are ever stored below the compute precision, as Comfy-Org's fp8 files and
GGUF files do and as the engine's per-layer upcasting modules hold them: every `nn.Linear` weight,
and the text encoder's token embedding (`nn.Embedding`). Biases, norms, convolutions, other
embeddings and modulation tables stay in the compute dtype. A stored tensor costs
`StorageFormat.stored_bytes(numel)` (whole GGUF blocks), plus one float32 scale for "fp8 scaled".

While a stored layer computes, the engine holds one dequantized copy of its weight in the compute
dtype; scaled fp8 and GGUF dequantize through a float32 temporary of the same shape first (H1's
storage notes: exact, device-independent rounding). Both are freed before the next layer runs, so
a component's transient cost is its largest stored linear weight at those precisions
(`StoredSizes.transient_bytes`). A stored embedding dequantizes only the rows it looks up
(`StoredTensor.select_rows`), a few tokens' worth, so it adds no transient of note.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

import torch
from torch import nn

from ..storage.formats import StorageFormat

# Comfy-Org's "fp8 scaled" files carry one float32 `scale_weight` per quantized tensor.
FP8_SCALE_BYTES = 4
FLOAT32_BYTES = 4  # the dequantization temporary of scaled fp8 and GGUF


@dataclass(frozen=True)
class StoredSizes:
    """A component's quantized tensors under one format: stored bytes per tensor and the transient."""

    storage: str | None = None  # the format's name; None: every tensor in its compute dtype
    by_tensor: Mapping[int, int] = field(default_factory=lambda: MappingProxyType({}), repr=False, compare=False)
    transient_bytes: int = 0  # the largest stored weight, dequantized to its compute dtype

    def nbytes(self, key: int, tensor: torch.Tensor) -> int:
        """Bytes of `tensor` (`key`: id of its Parameter or buffer object) as the component holds it."""
        return self.by_tensor.get(key, tensor.numel() * tensor.element_size())


def quantizable(module: nn.Module, embeddings: bool) -> list[nn.Parameter]:
    """The weights a storage format applies to, each once (tied weights are one tensor)."""
    found: dict[int, nn.Parameter] = {}
    for sub in module.modules():
        if isinstance(sub, nn.Linear) or (embeddings and isinstance(sub, nn.Embedding)):
            weight = sub._parameters.get("weight")
            if weight is not None:
                found[id(weight)] = weight
    return list(found.values())


def stored_tensor_bytes(numel: int, fmt: StorageFormat) -> int:
    return fmt.stored_bytes(numel) + (FP8_SCALE_BYTES if fmt.scaled else 0)


def stored_sizes(module: nn.Module, fmt: StorageFormat | None, embeddings: bool) -> StoredSizes:
    """`module`'s quantizable weights under `fmt` (`embeddings`: the module is a text encoder).

    A format equal to a tensor's own dtype changes nothing for it (bf16 storage of a bf16 model).
    """
    if fmt is None:
        return StoredSizes()
    sizes, transient = {}, 0
    embedding_weights = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
    for weight in quantizable(module, embeddings):
        if fmt.torch_dtype == weight.dtype and not fmt.scaled:
            continue
        sizes[id(weight)] = stored_tensor_bytes(weight.numel(), fmt)
        if id(weight) in embedding_weights:  # dequantized row by row: no whole-weight transient
            continue
        through_float32 = fmt.scaled or fmt.gguf_type is not None
        transient = max(transient, weight.numel() * (weight.element_size() + (FLOAT32_BYTES if through_float32 else 0)))
    return StoredSizes(fmt.name, MappingProxyType(sizes), transient)
