"""quantize: store a full-precision tensor in a storage format (the loader's `weight_dtype`
choice, and tests and benches writing fp8 / GGUF files).

fp8_scaled follows Comfy-Org's files: one float32 scale per tensor, scale = absmax / 448 (the
largest float8_e4m3fn value), weight = round(w / scale) to fp8; dequantized as fp8 * scale.
Plain fp8 saturates at the format's largest value instead of overflowing to NaN.
GGUF formats use the `gguf` package's reference quantizers (numpy, on the CPU); it has none for
the k-quants (Q4_K, Q5_K, Q6_K), which use kquants.py's plain-rounding quantizer.

Large tensors go in row chunks (the leading dimensions flattened into rows): each chunk is widened
to float32, quantized and written straight into the preallocated result, so the transient is one
chunk's (QUANTIZE_CHUNK) whatever the tensor's size. A StoredTensor source (an fp8 or GGUF file
lowered further) is dequantized a chunk at a time too, never whole. Every stored value depends only
on its own element or its own GGUF block (blocks run along a row) and on fp8_scaled's per-tensor
scale, whose absmax is a maximum taken chunk by chunk (exact): the result is bit-identical to
quantizing the whole tensor in one pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import StorageError
from .formats import StorageFormat, storage_format
from .kquants import quantize_k
from .stored import StoredTensor

K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")  # gguf-py has no quantizer for these: kquants.py

FP8_E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448

# Weights widened to float32 per chunk: 1 Mi, 4 MiB of float32 (256 rows of umt5-xxl's 4096-wide token
# table). The quantizers' temporaries are a few times that (kquants.py's per-sub-block tensors: about 20
# bytes per weight for Q4_K), so a lowering's transient is tens of MB whatever the table's size, where the
# whole-tensor pass took 4.2 GB of float32 for umt5's table before its temporaries. Chunks this small are
# also the fastest on a CPU (one thread, a 16,384 x 4,096 bf16 table): Q4_K 0.7 s, Q8_0 0.9 s, fp8_scaled
# 1.0 s in chunks of 1 Mi weights; 3.3 s, 1.3 s, 1.9 s in chunks of 16 Mi (likely: temporaries that large
# are fresh pages from the OS at every chunk); below 256 Ki weights per chunk the per-chunk overhead shows.
QUANTIZE_CHUNK = 1 << 20


def quantize(tensor: torch.Tensor | StoredTensor, fmt: str | StorageFormat) -> StoredTensor:
    """`tensor` stored in `fmt` (a FORMATS name or a StorageFormat); a new tensor, on the CPU for GGUF.
    A StoredTensor is dequantized (a row chunk at a time) and stored again in `fmt`."""
    fmt = storage_format(fmt) if isinstance(fmt, str) else fmt
    shape = tensor.shape
    if fmt.gguf_type is not None and not fmt.holds(tuple(shape)):
        raise StorageError(f"{fmt.name} needs a last dimension that is a multiple of {fmt.block_size}; got shape {list(shape)}. Keep this tensor in bf16/fp16.")
    if isinstance(tensor, torch.Tensor) and _plain(fmt):
        return StoredTensor(tensor.to(fmt.torch_dtype), fmt, shape)  # a cast: no float32 temporary
    rows = _RowSource.of(tensor)
    scale = _per_tensor_scale(rows) if fmt.scaled else None
    out = _empty_result(fmt, shape, rows.device)
    row_out = out.view(rows.count, -1) if out.numel() else out  # a view of the result: chunks land in place
    for start, stop in rows.chunks():
        row_out[start:stop] = _encode(rows.wide(start, stop), fmt, scale)
    return StoredTensor(out, fmt, shape, scale)


@dataclass(frozen=True)
class _RowSource:
    """A tensor to quantize seen as a matrix [count, width] (its leading dimensions flattened into rows),
    read a chunk of rows at a time: a plain tensor's rows in its own dtype (views: no copy), a
    StoredTensor's dequantized to float32. `apart` is False for a StoredTensor whose rows cannot be
    dequantized apart (`_stored_matrix`): it is read in one chunk."""

    matrix: torch.Tensor | StoredTensor
    count: int
    width: int
    device: torch.device
    apart: bool = True

    @classmethod
    def of(cls, tensor: torch.Tensor | StoredTensor) -> "_RowSource":
        shape = tensor.shape
        count, width = (shape[:-1].numel(), shape[-1]) if len(shape) else (1, 1)
        if isinstance(tensor, StoredTensor):
            matrix = _stored_matrix(tensor, count, width)
            if matrix is None:
                return cls(tensor, count, width, tensor.data.device, apart=False)
            return cls(matrix, count, width, tensor.data.device)
        # reshape is a view of a contiguous tensor (files' tensors are); a strided one is copied once, in its dtype
        return cls(tensor.detach().reshape(count, width), count, width, tensor.device)

    def chunks(self):
        """(start, stop) row ranges of at most QUANTIZE_CHUNK weights (one row at least); one range when
        a StoredTensor's rows cannot be taken apart."""
        if self.count == 0 or self.width == 0:
            return
        step = max(1, QUANTIZE_CHUNK // self.width) if self.apart else self.count
        for start in range(0, self.count, step):
            yield start, min(start + step, self.count)

    def wide(self, start: int, stop: int) -> torch.Tensor:
        """Rows start:stop: a plain tensor's as they are, a StoredTensor's dequantized to float32."""
        if not isinstance(self.matrix, StoredTensor):
            return self.matrix[start:stop]
        if not self.apart:
            return self.matrix.dequantize(torch.float32).reshape(self.count, self.width)
        return self.matrix.row_range(start, stop).dequantize(torch.float32)


def _stored_matrix(stored: StoredTensor, count: int, width: int) -> StoredTensor | None:
    """`stored` as a [count, width] StoredTensor of the same data, so its rows can be dequantized apart;
    None when they cannot: a GGUF tensor flattened before quantizing, or a scale (per row or column) of a
    tensor of more than 2 dimensions, which would not follow the flattened rows."""
    data, scale = stored.data, stored.scale
    if data.shape[:-1] != stored.shape[:-1] or not stored.shape:
        return None
    if scale is not None and scale.numel() == 1:
        scale = scale.reshape(())  # per tensor: broadcasts to any shape
    elif scale is not None and len(stored.shape) > 2:
        return None
    return StoredTensor(data.reshape(count, data.shape[-1]), stored.format, (count, width), scale)


def _per_tensor_scale(rows: _RowSource) -> torch.Tensor:
    """fp8_scaled's float32 scale, absmax / 448 (1 for an all-zero or empty tensor). The absmax is taken
    chunk by chunk: a maximum of maxima is exact, so it equals the whole tensor's. A StoredTensor source
    is dequantized twice (here, then to quantize): twice the time, one chunk's memory. A running maximum,
    not a list of the chunks' maxima: small tensors kept alive between chunks' temporaries fragment the
    heap (a list cost 260 MB of RSS for a 16,384 x 4,096 Q8_0 table; the running maximum 10 MB)."""
    amax = None
    for start, stop in rows.chunks():
        chunk_max = rows.wide(start, stop).abs().amax()
        amax = chunk_max if amax is None else torch.maximum(amax, chunk_max)
    amax = torch.zeros((), device=rows.device) if amax is None else amax.to(torch.float32)
    return torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))


def _empty_result(fmt: StorageFormat, shape: torch.Size, device: torch.device) -> torch.Tensor:
    """The stored data, to be filled: GGUF blocks as uint8 [*shape[:-1], row_bytes] on the CPU, else
    `shape` in the format's dtype on the source's device."""
    if fmt.gguf_type is not None:
        return torch.empty((*shape[:-1], shape[-1] // fmt.block_size * fmt.block_bytes), dtype=torch.uint8)
    return torch.empty(shape, dtype=fmt.torch_dtype, device=device)


def _encode(rows: torch.Tensor, fmt: StorageFormat, scale: torch.Tensor | None) -> torch.Tensor:
    """Rows of weights in `fmt`'s stored layout, computed in float32 as a whole-tensor pass would."""
    if fmt.gguf_type is not None:
        return _gguf_rows(rows.to(device="cpu", dtype=torch.float32).contiguous(), fmt)
    values = rows.to(torch.float32)
    if fmt.scaled:
        return (values / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(fmt.torch_dtype)
    if fmt.torch_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        limit = torch.finfo(fmt.torch_dtype).max
        return values.clamp(-limit, limit).to(fmt.torch_dtype)
    return values.to(fmt.torch_dtype)  # a StoredTensor source widened to a plain format


def _gguf_rows(values: torch.Tensor, fmt: StorageFormat) -> torch.Tensor:
    """float32 rows [n, width] as raw GGUF blocks [n, row_bytes]."""
    import gguf  # imported here: the planner CLI never needs it

    if fmt.gguf_type in K_QUANTS:
        blocks = quantize_k(values, fmt.gguf_type)
    else:
        blocks = torch.from_numpy(gguf.quants.quantize(values.numpy(), gguf.GGMLQuantizationType[fmt.gguf_type]))
    return blocks.reshape(values.shape[0], -1)


def _plain(fmt: StorageFormat) -> bool:
    """A 16/32-bit float format: storing a plain tensor in it is one cast."""
    return fmt.gguf_type is None and not fmt.scaled and fmt.torch_dtype not in (torch.float8_e4m3fn, torch.float8_e5m2)
