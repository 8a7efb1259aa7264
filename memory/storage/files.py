"""Weight files by content: safetensors and GGUF, memory-mapped, never unpickled.

`sniff` decides a file's kind from its first bytes and header, never from its name: a pickle
renamed `.safetensors` is refused before anything parses it. `open_safetensors` maps the file and
gives every tensor as a zero-copy view of the mapping (the disk tier: page cache, no anonymous
copy); `open_gguf` (gguf_files.py) does the same for GGUF files.

Example:
    weights = open_weights("wan2.1_t2v_1.3B_fp8_e4m3fn_scaled.safetensors")
    tensors = fold_scaled_fp8(weights.tensors)   # "<layer>.weight" -> StoredTensor with its scale
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Mapping

import torch

from .errors import StorageError
from .mapping import map_file, tensor_at

GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)
ZIP_MAGIC = b"PK\x03\x04"  # torch.save's default format is a zip of pickles
PICKLE_PROTOCOL = 0x80  # the first byte of a pickle of protocol 2 or later (legacy torch.save)
MAX_HEADER_BYTES = 100 * (1 << 20)  # the safetensors library's own limit

# The safetensors dtype names torch can hold (safetensors/torch.py's table).
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16,
}


@dataclass(frozen=True)
class SafetensorsFile:
    """An opened safetensors file: tensors are read-only-in-spirit views of its mapping."""

    path: Path
    tensors: Mapping[str, torch.Tensor]
    metadata: Mapping[str, str]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def sniff(path: str | os.PathLike) -> str:
    """"safetensors" or "gguf", decided by the file's content; StorageError for anything else."""
    path = Path(path)
    size = _size(path)
    with open(path, "rb") as handle:
        head = handle.read(9)
    if head[:4] == GGUF_MAGIC:
        _check_gguf_version(path, head)
        return "gguf"
    _refuse_pickles(path, head)
    _safetensors_header(path, size)  # raises unless the header is consistent with the file
    return "safetensors"


def _check_gguf_version(path: Path, head: bytes) -> None:
    """The header's version only; open_gguf parses the rest (tensor infos, truncation)."""
    version = struct.unpack("<I", head[4:8])[0] if len(head) >= 8 else None
    if version not in GGUF_VERSIONS:
        raise StorageError(f"{path} starts like a GGUF file but has version {version}; vidmem reads GGUF versions 2 and 3. Download the file again or re-convert it.")


def open_safetensors(path: str | os.PathLike, header_only: bool = False) -> SafetensorsFile:
    """Map `path` and view each tensor in place (zero-copy); StorageError if it is not a valid file.

    `header_only`: read the header and nothing else; each tensor is on the meta device (its name,
    shape and dtype, no data), for a plan that counts bytes before anything is loaded."""
    path = Path(path)
    size = _size(path)
    with open(path, "rb") as handle:
        _refuse_pickles(path, handle.read(9))
    header, data_start = _safetensors_header(path, size)
    metadata = header.pop("__metadata__", None) or {}  # checked: strings to strings
    if header_only:
        tensors = {name: torch.empty(entry["shape"], dtype=SAFETENSORS_DTYPES[entry["dtype"]], device="meta")
                   for name, entry in header.items()}
    else:
        mapping, _whole = map_file(path)
        tensors = {name: _view(mapping, entry, data_start) for name, entry in header.items()}
    return SafetensorsFile(path, MappingProxyType(tensors), MappingProxyType(dict(metadata)))


def _view(mapping, entry: dict, data_start: int) -> torch.Tensor:
    dtype = SAFETENSORS_DTYPES[entry["dtype"]]
    begin, end = entry["data_offsets"]
    shape = entry["shape"]
    if end == begin:  # torch.frombuffer refuses empty buffers
        return torch.empty(shape, dtype=dtype)
    return tensor_at(mapping, dtype, data_start + begin, (end - begin) // dtype.itemsize).reshape(shape)


def _size(path: Path) -> int:
    if not path.is_file():
        raise StorageError(f"{path}: no such file; check the path (and the model folder it was listed from).")
    return path.stat().st_size


def _refuse_pickles(path: Path, head: bytes) -> None:
    """`head` is the file's first 9 bytes. A safetensors header length can start with 0x80 too
    (one file in 256), but its JSON header then opens at byte 8; a pickle's opcodes never do."""
    legacy_pickle = head[:1] == bytes([PICKLE_PROTOCOL]) and head[8:9] != b"{"
    if head[:4] == ZIP_MAGIC or legacy_pickle:
        raise StorageError(
            f"{path} is a PyTorch pickle (torch.save output); vidmem never unpickles files because "
            "a pickle can run arbitrary code. Convert it to .safetensors (safetensors.torch.save_file) "
            "or use a .safetensors / .gguf release of the model."
        )


def _safetensors_header(path: Path, size: int) -> tuple[dict, int]:
    """The parsed header and the offset where tensor data starts, checked against the file size."""
    bad = f"{path} is not a safetensors or GGUF file"
    if size < 8:
        raise StorageError(f"{bad}: it is only {size} bytes long (an empty or interrupted download?); download it again.")
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        if length > MAX_HEADER_BYTES or 8 + length > size:
            raise StorageError(f"{bad} (or it is truncated): its first 8 bytes announce a {length}-byte header in a {size}-byte file; download it again or convert it to .safetensors.")
        raw = handle.read(length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise StorageError(f"{bad}: its header is not JSON ({error}); download it again or convert it to .safetensors.") from None
    if not isinstance(header, dict):
        raise StorageError(f"{bad}: its header is not a JSON object; download it again or convert it to .safetensors.")
    data_start = 8 + length
    _check_metadata(path, header.get("__metadata__"))
    entries = {name: entry for name, entry in header.items() if name != "__metadata__"}
    for name, entry in entries.items():
        _check_entry(path, name, entry, size - data_start)
    _check_layout(path, entries, size - data_start)
    return header, data_start


def _check_metadata(path: Path, metadata: object) -> None:
    """safetensors' `__metadata__` is an object of strings to strings (or absent)."""
    if metadata is None:
        return
    if not (isinstance(metadata, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise StorageError(f"{path}: its header's __metadata__ is {json.dumps(metadata)[:80]}, where safetensors has an "
                           "object of strings to strings; the file is damaged or was not written by safetensors; "
                           "download it again or re-save it with safetensors.")


def _check_layout(path: Path, entries: dict, data_bytes: int) -> None:
    """The tensors, by offset, follow one another with no overlap and no gap and fill the data, as the
    safetensors library requires (an overlap would alias two tensors' bytes: a damaged or crafted file)."""
    end = 0
    for begin, stop, name in sorted((*entry["data_offsets"], name) for name, entry in entries.items()):
        if begin != end:
            what = "overlaps the tensor before it" if begin < end else f"leaves data bytes {end}..{begin} unused"
            raise StorageError(f"{path}: tensor '{name}' starts at data byte {begin} and {what} (invalid offset); the "
                               "file is damaged; download it again.")
        end = stop
    if end != data_bytes:
        raise StorageError(f"{path}: its tensors end at data byte {end} but the file holds {data_bytes} bytes of data "
                           "after its header (a damaged file, or not safetensors); download it again.")


def _check_entry(path: Path, name: str, entry: object, data_bytes: int) -> None:
    if not (isinstance(entry, dict) and {"dtype", "shape", "data_offsets"} <= entry.keys()):
        raise StorageError(f"{path}: header entry '{name}' lacks dtype/shape/data_offsets; the file is damaged or not safetensors; download it again.")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in SAFETENSORS_DTYPES:
        raise StorageError(f"{path}: tensor '{name}' has dtype {dtype!r}, which vidmem cannot read; supported: {', '.join(SAFETENSORS_DTYPES)}. Re-save the file in one of them.")
    valid_shape = isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)
    valid_offsets = isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
    if not (valid_shape and valid_offsets) or not 0 <= offsets[0] <= offsets[1]:
        raise StorageError(f"{path}: tensor '{name}' has a malformed shape {shape!r} or data_offsets {offsets!r}; the file is damaged; download it again.")
    numel = 1
    for dim in shape:
        numel *= dim
    if offsets[1] - offsets[0] != numel * SAFETENSORS_DTYPES[dtype].itemsize:
        raise StorageError(f"{path}: tensor '{name}' ({dtype} {shape}) does not match its {offsets[1] - offsets[0]} data bytes; the file is damaged; download it again.")
    if offsets[1] > data_bytes:
        raise StorageError(f"{path} is truncated: tensor '{name}' ends at data byte {offsets[1]} but the file holds only {data_bytes} bytes of data (an interrupted download?); download it again.")
