"""quantize: store a full-precision tensor in a storage format (the loader's `weight_dtype`
choice, and tests and benches writing fp8 / GGUF files).

fp8_scaled follows Comfy-Org's files: one float32 scale per tensor, scale = absmax / 448 (the
largest float8_e4m3fn value), weight = round(w / scale) to fp8; dequantized as fp8 * scale.
Plain fp8 saturates at the format's largest value instead of overflowing to NaN.
GGUF formats use the `gguf` package's reference quantizers (numpy, on the CPU); it has none for
the k-quants (Q4_K, Q5_K, Q6_K), which use kquants.py's plain-rounding quantizer.
"""

from __future__ import annotations

import torch

from .errors import StorageError
from .formats import StorageFormat, storage_format
from .kquants import quantize_k
from .stored import StoredTensor

K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")  # gguf-py has no quantizer for these: kquants.py

FP8_E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


def quantize(tensor: torch.Tensor, fmt: str | StorageFormat) -> StoredTensor:
    """`tensor` stored in `fmt` (a FORMATS name or a StorageFormat); a new tensor, on the CPU for GGUF."""
    fmt = storage_format(fmt) if isinstance(fmt, str) else fmt
    if fmt.gguf_type is not None:
        return _quantize_gguf(tensor, fmt)
    if fmt.scaled:
        amax = tensor.detach().abs().amax().to(torch.float32)
        scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
        data = (tensor.to(torch.float32) / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(fmt.torch_dtype)
        return StoredTensor(data, fmt, tensor.shape, scale)
    if fmt.torch_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        limit = torch.finfo(fmt.torch_dtype).max
        return StoredTensor(tensor.to(torch.float32).clamp(-limit, limit).to(fmt.torch_dtype), fmt, tensor.shape)
    return StoredTensor(tensor.to(fmt.torch_dtype), fmt, tensor.shape)


def _quantize_gguf(tensor: torch.Tensor, fmt: StorageFormat) -> StoredTensor:
    import gguf  # imported here: the planner CLI never needs it

    if not fmt.holds(tuple(tensor.shape)):
        raise StorageError(f"{fmt.name} needs a last dimension that is a multiple of {fmt.block_size}; got shape {list(tensor.shape)}. Keep this tensor in bf16/fp16.")
    values = tensor.detach().to(device="cpu", dtype=torch.float32).contiguous()
    row_bytes = tensor.shape[-1] // fmt.block_size * fmt.block_bytes
    if fmt.gguf_type in K_QUANTS:
        blocks = quantize_k(values, fmt.gguf_type)
    else:
        blocks = torch.from_numpy(gguf.quants.quantize(values.numpy(), gguf.GGMLQuantizationType[fmt.gguf_type]))
    return StoredTensor(blocks.reshape(*tensor.shape[:-1], row_bytes), fmt, tensor.shape)
