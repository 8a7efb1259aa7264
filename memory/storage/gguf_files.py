"""GGUF files (city96's ComfyUI-GGUF releases and llama.cpp's format), memory-mapped.

`gguf.GGUFReader` parses the header (through its own read-only mapping); the tensors are then
zero-copy views of vidmem's own mapping of the file (mapping.py: no commit charge, so a file
larger than RAM maps). Quantized tensors become StoredTensors over their raw blocks; F32/F16/BF16
and integer tensors become plain tensors. GGUF lists dimensions fastest-first (ggml's ne0 is the
row length), so a tensor's logical (torch) shape is the reverse of its GGUF `shape`. city96's
converter flattens tensors of more than four dimensions and records the original shape under
`comfy.gguf.orig_shape.<name>`: honoured.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

import torch

from .errors import StorageError
from .files import GGUF_MAGIC, _refuse_pickles, _size
from .formats import FORMATS, StorageFormat
from .mapping import map_file, tensor_at
from .stored import StoredTensor

ORIG_SHAPE_KEY = "comfy.gguf.orig_shape."
GGUF_FORMATS: dict[str, StorageFormat] = {f.gguf_type: f for f in FORMATS.values() if f.gguf_type}
PLAIN_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
               "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64}


@dataclass(frozen=True)
class GgufFile:
    path: Path
    tensors: Mapping[str, torch.Tensor | StoredTensor]
    metadata: Mapping[str, Any]  # key-value fields (without the GGUF.* header fields)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes if isinstance(t, StoredTensor) else t.numel() * t.element_size() for t in self.tensors.values())


def supported_gguf_types() -> list[str]:
    return [*PLAIN_TYPES, *GGUF_FORMATS]


def open_gguf(path: str | os.PathLike) -> GgufFile:
    """Map a GGUF file; StorageError if it is not one, is damaged, or holds an unsupported type."""
    import gguf  # imported here: the planner CLI never needs it

    path = Path(path)
    _size(path)
    with open(path, "rb") as handle:
        head = handle.read(8)
    _refuse_pickles(path, head)
    if head[:4] != GGUF_MAGIC:
        raise StorageError(f"{path} is not a GGUF file (it does not start with b'GGUF'); pass a .gguf file or open it as safetensors.")
    try:
        reader = gguf.GGUFReader(path, "r")
    except Exception as error:  # the reader raises assorted errors on short or damaged files
        raise StorageError(f"{path} is a damaged or truncated GGUF file ({type(error).__name__}: {error}); download it again.") from None
    metadata = {name: _contents(field) for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    mapping, _whole = map_file(path)
    tensors = {t.name: _tensor(path, mapping, t, metadata.get(ORIG_SHAPE_KEY + t.name)) for t in reader.tensors}
    return GgufFile(path, MappingProxyType(tensors), MappingProxyType(metadata))


def _tensor(path: Path, mapping, item, orig_shape) -> torch.Tensor | StoredTensor:
    kind = item.tensor_type.name
    shape = _logical_shape(path, item, orig_shape)
    if int(item.data_offset) + int(item.n_bytes) > len(mapping):
        raise StorageError(f"{path} is truncated or damaged: tensor '{item.name}' lies outside the file; download it again.")
    if kind not in PLAIN_TYPES and kind not in GGUF_FORMATS:
        raise StorageError(
            f"{path}: tensor '{item.name}' is GGUF type {kind}, which vidmem does not read; "
            f"supported: {', '.join(supported_gguf_types())}. Use a file quantized to one of them (Q8_0 .. Q4_K)."
        )
    fmt = GGUF_FORMATS.get(kind)
    if not item.n_bytes:  # an empty tensor (a dimension of 0): nothing to map
        return torch.empty(shape, dtype=PLAIN_TYPES[kind]) if fmt is None else StoredTensor(
            torch.empty(*shape[:-1], 0, dtype=torch.uint8), fmt, shape)
    if fmt is None:
        dtype = PLAIN_TYPES[kind]
        return tensor_at(mapping, dtype, int(item.data_offset), int(item.n_bytes) // dtype.itemsize).reshape(shape)
    data = tensor_at(mapping, torch.uint8, int(item.data_offset), int(item.n_bytes))
    if orig_shape is None:  # rows stay rows: [*shape[:-1], row_bytes]
        data = data.reshape(*shape[:-1], shape[-1] // fmt.block_size * fmt.block_bytes)
    return StoredTensor(data, fmt, shape)


def _logical_shape(path: Path, item, orig_shape) -> tuple[int, ...]:
    """The tensor's torch shape: its GGUF dimensions reversed, or city96's recorded original shape, which
    must be non-negative integers holding the same elements (a damaged record would fail later, raw)."""
    shape = tuple(int(d) for d in reversed(item.shape.tolist()))
    if orig_shape is None:
        return shape
    dims = list(orig_shape) if isinstance(orig_shape, (list, tuple)) else None
    valid = dims is not None and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims)
    if not valid or math.prod(dims) != math.prod(shape):
        raise StorageError(
            f"{path}: tensor '{item.name}' records an original shape {orig_shape!r} ({ORIG_SHAPE_KEY}{item.name}) "
            f"that does not hold its {math.prod(shape)} elements (stored as {list(shape)}); the file is damaged or "
            "was converted wrongly: download or convert it again."
        )
    return tuple(dims)


def _contents(field) -> Any:
    try:
        return field.contents()
    except Exception:  # a field type the reader cannot decode: keep the raw parts out of the way
        return None
