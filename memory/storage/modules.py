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
but not free. Where the caller is known to read only the dtype and device, `dtype_only_weight_reads`
makes `weight` an empty tensor of the compute dtype for the duration (no upcast, and no read of
bytes a streamed tier may still be copying). Assigning `weight` (e.g. a LoRA merge) is refused
rather than silently lost.
A model-wide `.to(dtype)` changes the compute dtype, never the stored format.

fp8 matmul (fp8_matmul.py enables it per call): a StoredLinear holding float8_e4m3fn weights with a
per-tensor scale (or none) can skip the upcast and multiply in fp8 with `torch._scaled_mm`: the
input is quantized to e4m3fn with a dynamic per-tensor scale (its absolute maximum maps to 448),
and the weight's stored bytes are used in place (a transposed view, no copy). A layer whose file
asks for full-precision matmul (`full_precision_matmul`, read by scaled.py) always upcasts.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from typing import Iterator

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
        self.full_precision_matmul = weight.full_precision_matmul  # the file's request (StoredTensor)
        self.register_buffer("weight_stored", weight.data)
        self.register_buffer("weight_scale", weight.scale)

    @property
    def stored(self) -> StoredTensor:
        return StoredTensor(self.weight_stored, self.format, self.weight_shape, self.weight_scale, self.full_precision_matmul)

    dtype_only_reads = False  # class default; True inside `dtype_only_weight_reads`

    @property
    def weight(self) -> torch.Tensor:
        if self.dtype_only_reads:  # the reader wants the dtype and device only (dtype_only_weight_reads)
            return torch.empty(0, dtype=self.compute_dtype, device=self.weight_stored.device)
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


FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
# cuBLASLt's fp8 GEMM needs both dimensions of the weight to be multiples of 16; the CPU kernel
# takes any shape, but the rule is applied on every device so that the CPU tests see the same
# layers fall back as a GPU would.
FP8_MATMUL_MULTIPLE = 16
FP8_MATMUL_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Why a layer the file marks (ComfyUI's `full_precision_matrix_mult`, scaled.py) upcasts: ComfyUI always does.
FULL_PRECISION_REASON = "the file asks for full-precision matmul on this layer (ComfyUI's full_precision_matrix_mult)"
# Bias goes into the kernel only in the 16-bit output dtypes; cuBLASLt refuses a bias with a float32
# output, so there it is added after the product (one elementwise add, still no weight upcast).
FP8_MATMUL_BIAS_DTYPES = (torch.bfloat16, torch.float16)


class Fp8MatmulTally:
    """One layer's use of the fp8 matmul during one call: products computed in fp8 (`fp8_calls`), and
    calls that fell back to the upcast path, by reason (`fallbacks`). Its presence on a layer enables
    the path.

    Counted in 0-dim int64 tensors the forward adds to in place, read as ints after the call. Why:
    inside a compiled block dynamo guards a Python int by its value, so an int bumped per call made
    every denoiser pass compile the blocks again; a tensor is guarded by dtype, shape and device only.
    The counters sit on the device the layer computes on, made by `ready` before a compiled block first
    runs (made inside a graph, their appearance would compile a second one; a reason's first fallback
    still does, once). They are plain attributes, not buffers: offloading never moves them."""

    def __init__(self) -> None:
        self._fp8: torch.Tensor | None = None
        self._fallbacks: dict[str, torch.Tensor] = {}

    @property
    def fp8_calls(self) -> int:
        return 0 if self._fp8 is None else int(self._fp8)

    @property
    def fallbacks(self) -> Counter:
        return Counter({reason: int(count) for reason, count in self._fallbacks.items()})

    def ready(self, device: torch.device | str) -> None:
        """Make the fp8 counter on `device` now, outside any graph."""
        if self._fp8 is None or self._fp8.device != torch.device(device):
            self._fp8 = _counter_on(device, self._fp8)

    def count_fp8(self, device: torch.device) -> None:
        self.ready(device)
        self._fp8.add_(1)

    def count_fallback(self, reason: str, device: torch.device) -> None:
        count = self._fallbacks.get(reason)
        if count is None or count.device != device:
            count = self._fallbacks[reason] = _counter_on(device, count)
        count.add_(1)


def _counter_on(device: torch.device | str, count: torch.Tensor | None) -> torch.Tensor:
    """A counter on `device`, carrying `count` over. Never an inference tensor: one made inside
    `inference_mode` could not be added to outside it."""
    with torch.inference_mode(False):
        return torch.zeros((), dtype=torch.int64, device=device) if count is None else count.to(device)


def ready_fp8_tallies(module: nn.Module, device: torch.device | str) -> None:
    """Put the fp8 counters of `module`'s StoredLinears with fp8 matmul on onto `device`, for a caller
    about to run `module` compiled (see Fp8MatmulTally)."""
    for layer in module.modules():
        if isinstance(layer, StoredLinear) and layer.fp8_matmul is not None:
            layer.fp8_matmul.ready(device)


@contextmanager
def dtype_only_weight_reads(layer: "_StoredWeight") -> Iterator[None]:
    """While open, `layer.weight` is an empty tensor of the layer's compute dtype on its stored data's
    device: for callers that read the weight only for its dtype or device. Its own forward is unaffected
    (it reads the stored data, not `weight`)."""
    layer.dtype_only_reads = True
    try:
        yield
    finally:
        del layer.dtype_only_reads  # back to the class default


class StoredLinear(_StoredWeight):
    """`nn.Linear` with a stored weight: F.linear(x, dequantize(weight), bias), or, while a call
    has enabled it (`fp8_matmul` set), torch._scaled_mm on the stored fp8 bytes."""

    fp8_matmul: Fp8MatmulTally | None = None  # class default: off unless a call turns it on

    def __init__(self, weight: StoredTensor, bias: torch.Tensor | None, compute_dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self._hold(weight, compute_dtype)
        if bias is not None and not isinstance(bias, nn.Parameter):
            bias = nn.Parameter(bias, requires_grad=False)
        self.bias = bias  # the same Parameter object the model had: ties and hooks keep seeing it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8_matmul is not None:
            problem = self._fp8_input_problem(x)
            if problem is None:
                self.fp8_matmul.count_fp8(x.device)
                return fp8_linear(x, self.weight_stored, self.weight_scale, self.bias)
            self.fp8_matmul.count_fallback(problem, x.device)
        weight = self.stored.dequantize(self.compute_dtype, x.device)
        return F.linear(x, weight, self.bias)

    def fp8_matmul_problem(self) -> str | None:
        """Why this layer's weight cannot go to torch._scaled_mm as stored (it then upcasts as
        always); None when it can. Per-row or per-column weight scales are not used: _scaled_mm's
        rowwise mode also wants a scale per input row and runs other kernels per card (CUTLASS
        before Hopper or cuBLAS 12.9), none measured here; Comfy-Org's files scale per tensor."""
        if self.full_precision_matmul:
            return FULL_PRECISION_REASON
        if self.weight_stored.dtype != torch.float8_e4m3fn:
            return f"weight stored as {self.format.name} ({self.weight_stored.dtype}), not float8_e4m3fn"
        if self.weight_scale is not None and self.weight_scale.numel() != 1:
            return "weight scaled per row or column (only per-tensor scales are used)"
        if self.in_features % FP8_MATMUL_MULTIPLE or self.out_features % FP8_MATMUL_MULTIPLE:
            return f"shape {self.in_features}->{self.out_features}: both must be multiples of {FP8_MATMUL_MULTIPLE}"
        return None

    def _fp8_input_problem(self, x: torch.Tensor) -> str | None:
        """Why this call cannot use the fp8 product (the layer itself can); None when it can."""
        if x.dtype not in FP8_MATMUL_INPUT_DTYPES:
            return f"input dtype {x.dtype}"
        if torch.is_grad_enabled() and (x.requires_grad or (self.bias is not None and self.bias.requires_grad)):
            return "gradients needed (torch._scaled_mm has no backward)"
        if not self.weight_stored.is_contiguous():
            return "weight not contiguous (the kernel reads its transpose in place)"
        return None


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


def fp8_linear(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ (data * scale).T + bias, computed by torch._scaled_mm on float8_e4m3fn `data` [out, in]
    as stored, with `x` quantized to e4m3fn by a dynamic per-tensor scale.

    Why a dynamic input scale: the files' static `input_scale` (calibrated offline, dropped by
    scaled.py) clips activations beyond its range, and ComfyUI's unscaled path (scale 1, clamp to
    +-448) flushes small activations into e4m3fn's subnormals; one absolute maximum per call puts
    every activation in range at the cost of one reduction over the input."""
    rows = x.reshape(-1, x.shape[-1])
    # The scale is rounded to the input's dtype before dividing, and that same rounded value is
    # handed to the kernel, so quantizing and dequantizing use one number.
    amax = rows.abs().amax().float()
    x_scale = (amax / FP8_MAX).clamp(min=torch.finfo(x.dtype).tiny).to(x.dtype)
    # cuBLASLt multiplies a row-major input by a column-major weight only: .t() of the stored
    # [out, in] rows is that, and the quantized input is made row-major.
    quantized = (rows / x_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).contiguous()
    data = data.to(x.device)
    w_scale = torch.ones((), device=x.device) if scale is None else scale.to(device=x.device, dtype=torch.float32).reshape(())
    fused_bias = bias if bias is not None and x.dtype in FP8_MATMUL_BIAS_DTYPES else None
    if fused_bias is not None:
        fused_bias = fused_bias.to(device=x.device, dtype=x.dtype)
    out = torch._scaled_mm(quantized, data.t(), scale_a=x_scale.float(), scale_b=w_scale, bias=fused_bias, out_dtype=x.dtype)
    if isinstance(out, tuple):  # torch < 2.5 returned (out, amax)
        out = out[0]
    if bias is not None and fused_bias is None:
        out = out + bias.to(device=x.device, dtype=x.dtype)
    return out.reshape(*x.shape[:-1], data.shape[0])
