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
PLAIN_TYPES = {"F32": torch.float32, "F16": torch.float16, "F64": torch.float64,
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
    return ["F32", "F16", "BF16", *GGUF_FORMATS]


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
    shape = tuple(int(d) for d in reversed(item.shape.tolist()))
    if orig_shape is not None:
        shape = tuple(int(d) for d in orig_shape)
    if int(item.data_offset) + int(item.n_bytes) > len(mapping) or not item.n_bytes:
        raise StorageError(f"{path} is truncated or damaged: tensor '{item.name}' lies outside the file; download it again.")
    if kind in PLAIN_TYPES or kind == "BF16":
        dtype = PLAIN_TYPES.get(kind, torch.bfloat16)
        return tensor_at(mapping, dtype, int(item.data_offset), int(item.n_bytes) // dtype.itemsize).reshape(shape)
    if kind not in GGUF_FORMATS:
        raise StorageError(
            f"{path}: tensor '{item.name}' is GGUF type {kind}, which vidmem does not read; "
            f"supported: {', '.join(supported_gguf_types())}. Use a file quantized to one of them (Q8_0 .. Q4_K)."
        )
    fmt = GGUF_FORMATS[kind]
    data = tensor_at(mapping, torch.uint8, int(item.data_offset), int(item.n_bytes))
    if orig_shape is None:  # rows stay rows: [*shape[:-1], row_bytes]
        data = data.reshape(*shape[:-1], shape[-1] // fmt.block_size * fmt.block_bytes)
    return StoredTensor(data, fmt, shape)


def _contents(field) -> Any:
    try:
        return field.contents()
    except Exception:  # a field type the reader cannot decode: keep the raw parts out of the way
        return None
