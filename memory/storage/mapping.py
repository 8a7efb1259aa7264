"""Memory-mapped weight files, and which tensors live in one (the "disk tier").

A mapped tensor's bytes are the page cache's: the kernel reads them from the file on first touch
and may drop them again under memory pressure, so a model larger than RAM still runs. Nothing is
copied into anonymous memory until something writes to a tensor or casts it.

On Linux mappings are copy-on-write without a commit charge (MAP_PRIVATE | MAP_NORESERVE): a
stray in-place write on a weight makes a private copy of the pages it touches instead of
crashing the process or changing the file. (A plain copy-on-write mapping, Python's
ACCESS_COPY, is charged against the commit limit in full, so a file larger than RAM fails to map
with ENOMEM: exactly the files the disk tier exists for.) Elsewhere, and under strict
overcommit (vm.overcommit_memory=2), mappings are read-only: vidmem never writes weights in
place, but code that did would crash there.

`is_file_backed` answers from a registry of the address ranges of live mappings. Address ranges
are a property of the process, so this registry is the one piece of process-wide state in the
engine; entries leave it when their mapping is unmapped (weakref finalizers). Its answer is a hint
for how to copy a tensor to the device (stage it, or pin it): a wrong answer costs RAM or speed,
never correctness.
"""

from __future__ import annotations

import mmap
import os
import sys
import threading
import warnings
import weakref
from collections import deque
from pathlib import Path

import torch

# MAP_NORESERVE (Linux; Python names it only from 3.12): copy-on-write without a commit charge.
NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000) if sys.platform.startswith("linux") else 0
_lock = threading.Lock()
_ranges: dict[int, tuple[int, int]] = {}  # key -> (first address, end address) of a live mapping
_mappings: dict[int, weakref.ref] = {}  # key -> its mmap, for read-ahead advice (mappings made by map_file)
# key -> (path, (st_dev, st_ino, st_size, st_mtime_ns)) of the file a map_file mapping was made from
_files: dict[int, tuple[str, tuple[int, int, int, int]]] = {}
_unmapped: deque[int] = deque()  # keys whose mapping is gone, dropped from _ranges under the lock
_next_key = 0


def map_file(path: Path) -> tuple[mmap.mmap, torch.Tensor]:
    """A mapping of the whole file (see the module doc) and a uint8 tensor over it (zero-copy).

    The returned tensor and every view made from it (or with `torch.frombuffer` on the mapping)
    keep the mapping alive; the mapping is unmapped when the last of them is gone.
    """
    with open(path, "rb") as handle:
        mapping = _map(handle.fileno())
        stamp = _stamp(os.fstat(handle.fileno()))
    whole = tensor_at(mapping, torch.uint8, 0, len(mapping))
    key = register_range(whole.data_ptr(), whole.numel(), mapping)
    _mappings[key] = weakref.ref(mapping)
    _files[key] = (str(path), stamp)
    return mapping, whole


def _map(fileno: int) -> mmap.mmap:
    if NORESERVE:
        try:
            return mmap.mmap(fileno, 0, flags=mmap.MAP_PRIVATE | NORESERVE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:  # strict overcommit charges even this: fall back to read-only
            pass
    return mmap.mmap(fileno, 0, access=mmap.ACCESS_READ)


def tensor_at(mapping: mmap.mmap, dtype: torch.dtype, offset: int, count: int) -> torch.Tensor:
    """`count` elements of `dtype` at byte `offset` of `mapping`, zero-copy (keeps it alive)."""
    with warnings.catch_warnings():  # read-only mappings: torch warns that writes are undefined
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(mapping, dtype=dtype, count=count, offset=offset)


def register_range(start: int, nbytes: int, owner: object) -> int:
    """Record that [start, start + nbytes) is file-backed for as long as `owner` lives; returns its key."""
    global _next_key
    with _lock:
        key = _next_key
        _next_key += 1
        _ranges[key] = (start, start + nbytes)
    weakref.finalize(owner, _forget, key)
    return key


def _forget(key: int) -> None:
    """The finalizer of a mapping. The garbage collector runs finalizers inside any allocation, also
    one made while this thread holds `_lock` (the generator in is_file_backed): taking the lock here
    deadlocked a test run, and changing `_ranges` there would break the iteration. So it only queues
    the key (a deque append is atomic); the next reader drops it under the lock."""
    _unmapped.append(key)


def _live_ranges() -> list[tuple[int, int]]:
    """The ranges of live mappings (call with `_lock` held)."""
    while _unmapped:
        key = _unmapped.popleft()
        _ranges.pop(key, None)
        _mappings.pop(key, None)
        _files.pop(key, None)
    return list(_ranges.values())


def _stamp(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class MappedFileChanged(RuntimeError):
    """A weight file mapped at load was replaced or changed on disk since."""


def check_files_unchanged(tensors: list[torch.Tensor]) -> None:
    """Refuse to run on weights whose file changed since it was mapped (at load).

    A mapping reads the file's current bytes: a file rewritten in place would silently give new
    weights (a mix with copies kept on the device), and one truncated would kill the process
    with SIGBUS on the first read past its new end. Checked before a call places anything; a
    change during the call cannot be caught this way (docs/storage.md).
    """
    with _lock:
        _live_ranges()
        spans = [(key, *_ranges[key]) for key in _files if key in _ranges]
        files = dict(_files)
    pointers = [t.data_ptr() for t in tensors if t.device.type == "cpu" and t.numel() > 0]
    used = {key for key, start, end in spans if any(start <= p < end for p in pointers)}
    for key in sorted(used):
        path, stamp = files[key]
        try:
            now = _stamp(os.stat(path))
        except OSError as error:
            raise MappedFileChanged(f"weight file {path} is gone or unreadable since the model was loaded "
                                    f"({error.strerror}): reload the model.") from None
        if now != stamp:
            raise MappedFileChanged(f"weight file {path} changed on disk since the model was loaded (it is read "
                                    "from the file while running, so the run would mix old and new weights or "
                                    "crash): reload the model.")


def is_file_backed(tensor: torch.Tensor) -> bool:
    """True when every byte of `tensor` lies inside a live file mapping (on the host)."""
    if tensor.device.type != "cpu" or tensor.numel() == 0:
        return False
    storage = tensor.untyped_storage()
    start, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    with _lock:
        return any(first <= start and end <= last for first, last in _live_ranges())


def read_ahead(tensors: list[torch.Tensor]) -> int:
    """Ask the kernel to start reading the file pages under the file-backed `tensors` in the background
    (madvise MADV_WILLNEED on their mapping); returns the bytes advised. Others are left alone.

    Why: the disk tier's weights are read when they are copied (staged) or computed with, on the thread
    that launches the GPU's work, so a page-cache miss stalls the GPU for the whole read. The streaming
    schedule advises the groups just past its prefetch window, so their pages are on their way before
    their copy starts. Advice only: a hint the kernel may ignore, never a change to any byte."""
    advised = 0
    for tensor in tensors:
        found = mapping_of(tensor)
        if found is None:
            continue
        mapping, offset, nbytes = found
        start = offset - offset % mmap.ALLOCATIONGRANULARITY  # madvise wants a page-aligned start
        try:
            mapping.madvise(mmap.MADV_WILLNEED, start, nbytes + offset - start)
        except (OSError, ValueError):  # a mapping closed meanwhile, or a platform without the advice
            continue
        advised += nbytes
    return advised


def any_mapped_files() -> bool:
    """Whether a file mapping made by `map_file` may still be live (a cheap test before `read_ahead`)."""
    return bool(_mappings)


def mapping_of(tensor: torch.Tensor) -> tuple[mmap.mmap, int, int] | None:
    """(the mmap holding every byte of `tensor`, its byte offset there, its byte count), or None."""
    if not hasattr(mmap, "MADV_WILLNEED") or tensor.device.type != "cpu" or tensor.numel() == 0:
        return None
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    with _lock:
        _live_ranges()
        for key, (first, last) in _ranges.items():
            if first <= start and end <= last and key in _mappings:
                mapping = _mappings[key]()
                return None if mapping is None else (mapping, start - first, end - start)
    return None


def mapped_bytes() -> int:
    """Bytes of all live file mappings (address space, not RAM: pages load on first touch)."""
    with _lock:
        return sum(last - first for first, last in _live_ranges())
