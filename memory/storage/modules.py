"""Layers whose weights stay stored (fp8, scaled fp8, GGUF, or a plain narrower dtype) and are
upcast to the compute dtype only while the layer runs.

Why buffers, not parameters: diffusers' `ModelMixin.dtype` is the dtype of the first floating
*parameter*, and pipelines cast latents to `transformer.dtype`; an fp8 parameter would make the
whole run fp8. The stored data and scale are buffers (`weight_stored`, `weight_scale`), the bias
stays a parameter in the compute dtype, so `module.dtype` stays the compute dtype. The offload
engine moves buffers like parameters, so every tier streams the stored (small) bytes and the
upcast happens on the compute device.

`weight` is a read-only property returning the dequantized weight (compute dtype, on the
stored data's device). Model code reads it for its dtype or device (transformers' T5 casts
activations to `wo.weight.dtype`); each read costs one upcast of that layer, so it is correct
but not free. Assigning `weight` (e.g. a LoRA merge) is refused rather than silently lost.
A model-wide `.to(dtype)` changes the compute dtype, never the stored format.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .stored import StoredTensor


class _StoredWeight(nn.Module):
    """The shared part: a stored weight held as buffers, rebuilt as a StoredTensor on use."""

    def _hold(self, weight: StoredTensor, compute_dtype: torch.dtype) -> None:
        self.format = weight.format
        self.weight_shape = weight.shape
        self.compute_dtype = compute_dtype
        self.register_buffer("weight_stored", weight.data)
        self.register_buffer("weight_scale", weight.scale)

    @property
    def stored(self) -> StoredTensor:
        return StoredTensor(self.weight_stored, self.format, self.weight_shape, self.weight_scale)

    @property
    def weight(self) -> torch.Tensor:
        return self.stored.dequantize(self.compute_dtype)

    @weight.setter
    def weight(self, value) -> None:
        raise AttributeError(f"{type(self).__name__}.weight is computed from its stored {self.format.name} data; it cannot be assigned.")

    def _apply(self, fn, recurse: bool = True):
        """`.to(device)` moves the stored data; `.to(dtype)` / `.half()` change only the compute
        dtype (and the bias): a storage format is the file's, never recast by a model-wide cast."""
        before = {name: self._buffers[name] for name in ("weight_stored", "weight_scale")}
        result = super()._apply(fn, recurse)
        for name, old in before.items():
            new = self._buffers[name]
            if old is not None and new is not None and new.dtype != old.dtype:
                self._buffers[name] = old.to(new.device)
        self.compute_dtype = fn(torch.empty(0, dtype=self.compute_dtype)).dtype
        return result

    def extra_repr(self) -> str:
        return f"{list(self.weight_shape)}, stored={self.format.name}, compute={self.compute_dtype}"


class StoredLinear(_StoredWeight):
    """`nn.Linear` with a stored weight: F.linear(x, dequantize(weight), bias)."""

    def __init__(self, weight: StoredTensor, bias: torch.Tensor | None, compute_dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self._hold(weight, compute_dtype)
        if bias is not None and not isinstance(bias, nn.Parameter):
            bias = nn.Parameter(bias, requires_grad=False)
        self.bias = bias  # the same Parameter object the model had: ties and hooks keep seeing it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.stored.dequantize(self.compute_dtype, x.device)
        return F.linear(x, weight, self.bias)


class StoredEmbedding(_StoredWeight):
    """`nn.Embedding` with a stored table: only the looked-up rows are dequantized."""

    def __init__(self, weight: StoredTensor, compute_dtype: torch.dtype, padding_idx: int | None = None, max_norm: float | None = None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.shape
        self.padding_idx = padding_idx  # only affects gradients: kept for code that reads it
        self.max_norm = max_norm
        self._hold(weight, compute_dtype)

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        if self.max_norm is not None:  # renormalises the whole table in place: not for stored rows
            return F.embedding(indices, self.weight, self.padding_idx, self.max_norm)
        rows = self.stored.select_rows(indices).dequantize(self.compute_dtype, indices.device)
        return rows.reshape(*indices.shape, self.embedding_dim)
