"""StorageReport: what a model holds after loading, per storage format and per kind of memory.

Three kinds of host memory, because the planner and the user budget them differently:
- mapped: bytes used in place from file mappings (page cache: reclaimable, shared, not RAM the
  process owns; a model larger than RAM still runs, read from disk as it goes);
- in memory: bytes used in place from tensors the caller already held in RAM;
- copied: new anonymous memory made at load (casts of small tensors, load-time dequantization).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..units import GiB, MiB
from .mapping import is_file_backed
from .stored import StoredTensor



@dataclass(frozen=True)
class FormatCount:
    format: str  # a StorageFormat name, or the dtype for integer tensors
    tensors: int
    bytes: int


@dataclass(frozen=True)
class StorageReport:
    formats: tuple[FormatCount, ...]  # how the model's tensors are held, largest share first
    mapped_bytes: int
    in_memory_bytes: int
    copied_bytes: int
    stored_layers: int  # Linear/Embedding layers that upcast per call
    cast: tuple[str, ...]  # tensors cast to their target dtype at load (anonymous copies)
    dequantized: tuple[str, ...]  # quantized tensors outside Linear/Embedding, upcast once at load
    kept_computed: tuple[str, ...]  # buffers absent from the files, kept as the model computed them

    @property
    def total_bytes(self) -> int:
        return self.mapped_bytes + self.in_memory_bytes + self.copied_bytes

    def describe(self) -> str:
        """One sentence for receipts."""
        held = ", ".join(f"{c.format} {_size(c.bytes)}" for c in self.formats)
        text = f"weights {held}; {_size(self.mapped_bytes)} read in place from files, {_size(self.copied_bytes)} copied to RAM at load"
        if self.stored_layers:
            text += f"; {self.stored_layers} layers upcast per call"
        if self.dequantized:
            text += f"; {len(self.dequantized)} quantized tensors upcast once at load"
        return text + "."


class Ledger:
    """Collects per-tensor facts while weights are assigned; `report()` freezes them."""

    def __init__(self) -> None:
        self._formats: dict[str, list[int]] = {}
        self._memory = {"mapped": 0, "in_memory": 0, "copied": 0}
        self._stored = 0
        self._lists: dict[str, list[str]] = {"cast": [], "dequantized": [], "kept_computed": []}

    def held(self, name: str, tensor: torch.Tensor) -> None:
        self._count(_format_name(tensor.dtype), _nbytes(tensor))
        self._memory["mapped" if is_file_backed(tensor) else "in_memory"] += _nbytes(tensor)

    def copied(self, name: str, tensor: torch.Tensor, why: str) -> None:
        self._count(_format_name(tensor.dtype), _nbytes(tensor))
        self._memory["copied"] += _nbytes(tensor)
        self._lists[why].append(name)

    def stored(self, name: str, stored: StoredTensor) -> None:
        self._count(stored.format.name, stored.nbytes)
        self._stored += 1
        for tensor in (stored.data, stored.scale):
            if tensor is not None:
                self._memory["mapped" if is_file_backed(tensor) else "in_memory"] += _nbytes(tensor)

    def kept_computed(self, name: str, tensor: torch.Tensor) -> None:
        self.held(name, tensor)
        self._lists["kept_computed"].append(name)

    def report(self) -> StorageReport:
        counts = sorted((FormatCount(f, n, b) for f, (n, b) in self._formats.items()), key=lambda c: -c.bytes)
        lists = {k: tuple(v) for k, v in self._lists.items()}
        return StorageReport(tuple(counts), self._memory["mapped"], self._memory["in_memory"], self._memory["copied"], self._stored, **lists)

    def _count(self, fmt: str, nbytes: int) -> None:
        tally = self._formats.setdefault(fmt, [0, 0])
        tally[0] += 1
        tally[1] += nbytes


def _size(nbytes: int) -> str:
    return f"{nbytes / GiB:.2f} GiB" if nbytes >= GiB // 10 else f"{nbytes / MiB:.1f} MiB"


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _format_name(dtype: torch.dtype) -> str:
    from .formats import FORMATS

    for fmt in FORMATS.values():
        if fmt.torch_dtype == dtype and not fmt.scaled:
            return fmt.name
    return str(dtype).removeprefix("torch.")
