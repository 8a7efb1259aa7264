"""StoredTensor: a weight kept in its storage format, dequantized to the compute dtype on demand.

Dequantization is deterministic and device-independent: fp8 widens exactly; scaled fp8 and GGUF
are computed in float32 (one IEEE multiply per value for scaled fp8; for GGUF ggml's block
formulas as diffusers and the gguf package compute them, ggml.py) and rounded once to the
compute dtype. The same stored tensor therefore always gives the same bits, on the CPU and on
a GPU. The cost, on the compute device
while a layer runs, is its upcast weight in the compute dtype plus float32 temporaries of at
most DEQUANT_CHUNK weights (large matrices are upcast in row chunks, bit-identically).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .errors import StorageError
from .formats import FORMATS, StorageFormat
from .ggml import DEQUANTIZE

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# Weights upcast in one pass (16 Mi: 64 MiB of float32 temporaries); larger layers go in row chunks
# so a 14B model's 70 M-weight matrices do not need several 280 MB temporaries on the device.
DEQUANT_CHUNK = 1 << 24
# Peak bytes per weight of the temporaries one upcast pass allocates (its result included), for the
# formats computed through float32: scaled fp8 holds the widened copy and the scaled product (two
# float32); GGUF the block formulas' integer and float32 intermediates (ggml.py). Measured with
# torch.profiler(profile_memory=True) on torch 2.13's CPU allocator, the same for bf16/fp16/fp32
# results; tests/test_storage_workspace.py measures them again against `upcast_workspace_bytes`.
UPCAST_TEMPORARY_BYTES_PER_WEIGHT = {
    "fp8_scaled": 8.0, "gguf_q8_0": 8.125, "gguf_q4_0": 9.125, "gguf_q4_1": 9.125, "gguf_q5_0": 9.125,
    "gguf_q5_1": 9.125, "gguf_q4_k": 9.25, "gguf_q5_k": 9.25, "gguf_q6_k": 11.25,
}


@dataclass(frozen=True, eq=False)
class StoredTensor:
    """A weight as stored: `data` in `format`, meaning a tensor of `shape` once dequantized.

    Layouts: plain and fp8 formats hold `data` with the logical shape in the stored dtype;
    GGUF formats hold raw blocks as uint8 `[*shape[:-1], row_bytes]` (ggml blocks run along the
    last dimension, so rows are independent). `scale` is the per-tensor float32 scale of scaled
    fp8 (broadcastable to `shape`), else None. `full_precision_matmul`: the file asks that this
    weight never multiply in fp8 (ComfyUI's `full_precision_matrix_mult`, scaled.py); fp8 matmul
    leaves its layer upcast. Views of its rows keep it.
    """

    data: torch.Tensor
    format: StorageFormat
    shape: torch.Size
    scale: torch.Tensor | None = None
    full_precision_matmul: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", torch.Size(self.shape))
        problem = self._layout_problem()
        if problem:
            raise StorageError(f"StoredTensor({self.format.name}, shape {list(self.shape)}): {problem}")

    def __repr__(self) -> str:
        scale = ", scaled" if self.scale is not None else ""
        full = ", full-precision matmul" if self.full_precision_matmul else ""
        return f"StoredTensor({self.format.name}, shape={list(self.shape)}{scale}{full}, {self.data.device})"

    @property
    def nbytes(self) -> int:
        scale = self.scale.numel() * self.scale.element_size() if self.scale is not None else 0
        return self.data.numel() * self.data.element_size() + scale

    @property
    def numel(self) -> int:
        return self.shape.numel()

    def dequantize(self, dtype: torch.dtype, device: torch.device | str | None = None) -> torch.Tensor:
        """The weight as a `dtype` tensor of `shape` on `device` (default: where `data` is)."""
        data = self.data if device is None else self.data.to(device)
        if self.format.gguf_type is None and self.scale is None:
            return data.to(dtype)  # exact widening, no temporary
        scale = None if self.scale is None else self.scale.to(device=data.device, dtype=torch.float32)
        step = self._rows_per_chunk()
        if step is None:
            return _upcast(data, scale, self.format, self.shape, dtype)
        return _upcast_rows(data, scale, self.format, torch.empty(self.shape, dtype=dtype, device=data.device), step)

    def _rows_per_chunk(self) -> int | None:
        """Rows to upcast at once so the float32 temporaries stay under DEQUANT_CHUNK weights;
        None when one pass is small enough or rows cannot be taken apart. Chunking changes no
        bit: every value is computed from its own block or element."""
        if self.numel <= DEQUANT_CHUNK or len(self.shape) < 2 or self.data.shape[0] != self.shape[0]:
            return None
        return max(1, DEQUANT_CHUNK // (self.numel // self.shape[0]))

    def row_selection_problem(self) -> str | None:
        """Why `select_rows` (an embedding lookup) cannot take rows of this tensor; None when it can.
        Checked when a model is loaded, so a table that cannot be looked up fails there, not at its
        first prompt."""
        if len(self.shape) != 2 or self.data.shape[0] != self.shape[0]:
            return (f"an embedding table must be 2-D and stored row by row, but this one is {list(self.shape)} "
                    f"held as {list(self.data.shape)} (a tensor flattened before quantizing)")
        return None

    def select_rows(self, index: torch.Tensor) -> "StoredTensor":
        """The rows `index` of dimension 0 (an embedding lookup), still stored: dequantize only those.
        A per-row scale (one value per row) is selected with its rows; any other scale broadcasts."""
        problem = self.row_selection_problem()
        if problem:
            raise StorageError(f"{self!r}: {problem}.")
        index = index.reshape(-1).to(self.data.device)
        rows = self.data.index_select(0, index)
        return replace(self, data=rows, shape=(rows.shape[0], self.shape[1]), scale=_scale_rows(self.scale, index))

    def row_range(self, start: int, stop: int) -> "StoredTensor":
        """Rows `start:stop` of dimension 0, still stored: a view of the same data (a fused matrix's
        q, k or v). A per-row scale is cut with its rows; a per-tensor or per-column one is shared."""
        if self.data.shape[0] != self.shape[0] or not 0 <= start < stop <= self.shape[0]:
            raise StorageError(f"{self!r}: rows {start}:{stop} cannot be taken (held as {list(self.data.shape)}; "
                               "a tensor flattened before quantizing keeps no rows).")
        rows = slice(start, stop)
        return replace(self, data=self.data[rows], shape=(stop - start, *self.shape[1:]), scale=_scale_rows(self.scale, rows))

    def _layout_problem(self) -> str | None:
        fmt, data = self.format, self.data
        if fmt.scaled != (self.scale is not None):
            return "a scaled format needs a scale, and only a scaled format takes one"
        if self.scale is not None:
            try:
                torch.broadcast_shapes(self.scale.shape, self.shape)
            except RuntimeError:
                return f"its scale of shape {list(self.scale.shape)} does not broadcast to the weight"
        if fmt.gguf_type is None:
            expected = FP8_DTYPES if fmt.scaled else (fmt.torch_dtype,)  # Comfy also scales e5m2
            if data.dtype not in expected or data.shape != self.shape:
                return f"data is {data.dtype} {list(data.shape)}, expected {fmt.torch_dtype} {list(self.shape)}"
            return None
        if data.dtype != torch.uint8:
            return f"GGUF data must be raw uint8 blocks, got {data.dtype}"
        # Row layout [*shape[:-1], row_bytes] needs whole blocks per row; a flat layout (a tensor
        # reshaped before quantizing, with its original shape in the file's metadata) per tensor.
        # An empty tensor holds no block (zero rows, or rows of zero weights); a scalar cannot hold one.
        blocked = self.numel if data.dim() == 1 and len(self.shape) != 1 else (self.shape[-1] if self.shape else 0)
        if not self.shape or blocked % fmt.block_size:
            return f"the last dimension must be a multiple of the {fmt.block_size}-weight block"
        if data.numel() != fmt.stored_bytes(self.numel):
            return f"{data.numel()} data bytes, expected {fmt.stored_bytes(self.numel)}"
        return None


def dequantize_into(stored: StoredTensor, out: torch.Tensor) -> torch.Tensor:
    """`stored` dequantized into `out`, a preallocated tensor of its shape in the compute dtype (the leading
    rows of a padded table, say), and returned: for loads, never per forward.

    Why: a large table dequantized whole goes through float32 temporaries of its full size (Gemma 3 12B's
    262208 x 3840 token table: about 4 GB for a 2 GB bf16 result), and padding its result afterwards copies
    it again. Here rows go a chunk of at most DEQUANT_CHUNK weights at a time, so the temporaries stay one
    chunk's and the result is written once, in place. Bit-identical to `StoredTensor.dequantize`: every value
    is computed from its own element or block, and GGUF blocks run along a row. A tensor flattened before
    quantizing keeps no rows and is dequantized in one pass."""
    if tuple(out.shape) != tuple(stored.shape):
        raise StorageError(f"{stored!r} cannot be dequantized into a tensor of shape {list(out.shape)}; "
                           f"pass one of its shape {list(stored.shape)}.")
    data = stored.data.to(out.device)
    if stored.format.gguf_type is None and stored.scale is None:
        return out.copy_(data)  # exact widening, no temporary
    scale = None if stored.scale is None else stored.scale.to(device=out.device, dtype=torch.float32)
    if len(stored.shape) < 2 or data.shape[0] != stored.shape[0]:
        return out.copy_(_upcast(data, scale, stored.format, stored.shape, out.dtype))
    step = max(1, DEQUANT_CHUNK // (stored.numel // stored.shape[0] or 1))
    return _upcast_rows(data, scale, stored.format, out, step)


def _upcast_rows(data: torch.Tensor, scale: torch.Tensor | None, fmt: StorageFormat, out: torch.Tensor,
                 step: int) -> torch.Tensor:
    """`out` filled `step` rows at a time from row-laid stored `data` (a per-row scale cut with its rows)."""
    for start in range(0, out.shape[0], step):
        rows = slice(start, start + step)
        out[rows] = _upcast(data[rows], _scale_rows(scale, rows), fmt, out[rows].shape, out.dtype)
    return out


def upcast_workspace_bytes(fmt: StorageFormat, shape, dtype: torch.dtype) -> int:
    """Peak bytes `StoredTensor.dequantize` allocates for a weight of `shape` stored in `fmt` and
    upcast to `dtype` (the result included; the stored data already on the device): the one figure
    the planner reads for a stored layer's transient. Plain and unscaled fp8 formats only widen
    (the result; nothing when already `dtype`); scaled fp8 and GGUF go through float32 temporaries,
    in row chunks of at most DEQUANT_CHUNK weights for large matrices (the result is then whole
    while one chunk's temporaries live)."""
    shape = torch.Size(shape)
    numel, itemsize = shape.numel(), torch.empty(0, dtype=dtype).element_size()
    if fmt.gguf_type is None and not fmt.scaled:
        return 0 if fmt.torch_dtype == dtype else numel * itemsize
    per_weight = UPCAST_TEMPORARY_BYTES_PER_WEIGHT[fmt.name]
    if numel <= DEQUANT_CHUNK or len(shape) < 2:
        return int(max(per_weight, itemsize) * numel)
    row = numel // shape[0]
    chunk = min(shape[0], max(1, DEQUANT_CHUNK // row)) * row
    return numel * itemsize + int(per_weight * chunk)


def _scale_rows(scale: torch.Tensor | None, rows: slice | torch.Tensor) -> torch.Tensor | None:
    """The part of `scale` that applies to `rows` of a 2-D weight: a per-row scale ([rows, 1] or
    [rows, columns]) is taken with them; a per-tensor or per-column scale applies to every row."""
    if scale is None or scale.dim() < 2 or scale.shape[0] == 1:
        return scale
    return scale[rows] if isinstance(rows, slice) else scale.index_select(0, rows.to(scale.device))


def _upcast(data: torch.Tensor, scale: torch.Tensor | None, fmt: StorageFormat, shape, dtype: torch.dtype) -> torch.Tensor:
    if fmt.gguf_type is not None:
        return _dequantize_gguf(data, fmt, shape).to(dtype)
    return (data.to(torch.float32) * scale).to(dtype)


def _dequantize_gguf(data: torch.Tensor, fmt: StorageFormat, shape: torch.Size) -> torch.Tensor:
    """ggml's block formulas (ggml.py), in float32, on `data`'s device."""
    if data.numel() == 0:  # no block: the formulas' reshapes cannot infer a size from nothing
        return torch.empty(shape, dtype=torch.float32, device=data.device)
    return DEQUANTIZE[fmt.gguf_type](data.reshape(-1, fmt.block_bytes)).reshape(shape)


def stored_format_of(dtype: torch.dtype, scaled: bool = False) -> StorageFormat:
    """The storage format of a plain or fp8 tensor of `dtype` (scaled: Comfy-Org's fp8 scaled)."""
    if scaled:
        if dtype not in FP8_DTYPES:
            raise StorageError(f"a scaled fp8 weight must be float8_e4m3fn or float8_e5m2, got {dtype}.")
        return FORMATS["fp8_scaled"]
    for fmt in FORMATS.values():
        if fmt.torch_dtype == dtype and not fmt.scaled:
            return fmt
    raise StorageError(f"dtype {dtype} is not a weight storage format; supported: {', '.join(FORMATS)}.")
