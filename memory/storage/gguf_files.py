"""GGUF files (city96's ComfyUI-GGUF releases and llama.cpp's format), memory-mapped.

`gguf.GGUFReader` maps the file (copy-on-write here, as for safetensors); every tensor stays a
zero-copy view of that mapping. Quantized tensors become StoredTensors over their raw blocks;
F32/F16/BF16 and integer tensors become plain tensors. GGUF lists dimensions fastest-first
(ggml's ne0 is the row length); the reader already gives numpy (torch) order, and a tensor's
logical shape is the reverse of its GGUF `shape`. city96's converter flattens tensors of more
than four dimensions and records the original under `comfy.gguf.orig_shape.<name>`: honoured.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

import numpy as np
import torch

from .errors import StorageError
from .files import GGUF_MAGIC, _refuse_pickles, _size
from .formats import FORMATS, StorageFormat
from .mapping import register_range
from .stored import StoredTensor

ORIG_SHAPE_KEY = "comfy.gguf.orig_shape."
GGUF_FORMATS: dict[str, StorageFormat] = {f.gguf_type: f for f in FORMATS.values() if f.gguf_type}
PLAIN_TYPES = {"F32", "F16", "F64", "I8", "I16", "I32", "I64"}  # the reader gives these typed


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
        reader = gguf.GGUFReader(path, "c")
    except Exception as error:  # the reader raises assorted errors on short or damaged files
        raise StorageError(f"{path} is a damaged or truncated GGUF file ({type(error).__name__}: {error}); download it again.") from None
    register_range(reader.data.ctypes.data, reader.data.nbytes, reader.data)
    metadata = {name: _contents(field) for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    tensors = {t.name: _tensor(path, t, metadata.get(ORIG_SHAPE_KEY + t.name)) for t in reader.tensors}
    return GgufFile(path, MappingProxyType(tensors), MappingProxyType(metadata))


def _tensor(path: Path, item, orig_shape) -> torch.Tensor | StoredTensor:
    kind = item.tensor_type.name
    shape = tuple(int(d) for d in reversed(item.shape.tolist()))
    if orig_shape is not None:
        shape = tuple(int(d) for d in orig_shape)
    data = _torch_view(item.data)
    if kind in PLAIN_TYPES:
        return data.reshape(shape)
    if kind == "BF16":
        return data.view(torch.bfloat16).reshape(shape)
    if kind not in GGUF_FORMATS:
        raise StorageError(
            f"{path}: tensor '{item.name}' is GGUF type {kind}, which vidmem does not read; "
            f"supported: {', '.join(supported_gguf_types())}. Use a file quantized to one of them (Q8_0 .. Q4_K)."
        )
    if orig_shape is not None:  # flattened by the converter: rows are no longer the logical rows
        data = data.reshape(-1)
    else:
        data = data.reshape(*shape[:-1], data.shape[-1])
    return StoredTensor(data, GGUF_FORMATS[kind], shape)


def _torch_view(array: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():  # copy-on-write maps are writable; keep quiet if one is not
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)


def _contents(field) -> Any:
    try:
        return field.contents()
    except Exception:  # a field type the reader cannot decode: keep the raw parts out of the way
        return None
