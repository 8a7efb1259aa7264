"""Prompt embeddings cached on disk, so a repeated prompt never loads the text encoder again.

The text encoder is the largest thing most runs load only to encode two short strings
(umt5-xxl: 11 GB in bf16), and users re-run the same prompt with other seeds, steps or sizes
all the time. One embedding is a few MiB (Wan: 512 x 4096 x bf16 = 4 MiB).

How an entry is found: its file name is a SHA-256 over
- the encoder's identity: its class, its config, and for every parameter and buffer its name,
  shape, dtype and 16 values sampled evenly through it. A content sample, not file paths and
  mtimes: the engine sees the loaded module, whatever files (folder, single file, fp8, GGUF) it
  came from; the same weights under another path still hit; and a file rewritten in place with
  new weights misses even if its size and mtime look unchanged. Reading 16 values per tensor
  costs microseconds, where hashing all 11 GB would cost a minute. A fine-tune changes
  essentially every value, so 16 per tensor tell two encoders apart;
- the embedding dtype and `max_sequence_length`;
- the exact prompt text and its token ids (which also pins the tokenizer).

Entries are safetensors files written atomically (temp file + rename). A corrupt or foreign
entry is ignored, deleted and written again; a folder that cannot be written only costs the
cache (logged), never the run. The folder is bounded: after each write the least recently used
entries (by mtime, bumped on every hit) are deleted until it holds at most `max_bytes`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch
from torch import nn

from .atomic import PARTIAL_SUFFIX, atomic_path

log = logging.getLogger("vidmem")

DEFAULT_MAX_BYTES = 2 << 30  # 2 GiB: ~500 Wan prompts (4 MiB each), ~1800 CogVideoX prompts (1.1 MiB)
SUFFIX = ".safetensors"
TENSOR = "prompt_embeds"
STALE_TEMP_S = 3600.0  # temp files older than this were left by a crash; younger ones may be in flight
SAMPLES_PER_TENSOR = 16


class EncoderIdentityError(RuntimeError):
    """The encoder's weights cannot be read on the host (e.g. still on the meta device)."""


@dataclass(frozen=True)
class PromptCache:
    """A folder of cached prompt embeddings, at most `max_bytes` large."""

    folder: Path
    max_bytes: int = DEFAULT_MAX_BYTES

    def __post_init__(self) -> None:
        object.__setattr__(self, "folder", Path(self.folder).expanduser())
        if isinstance(self.max_bytes, bool) or not isinstance(self.max_bytes, int) or self.max_bytes < 0:
            raise ValueError(f"PromptCache max_bytes={self.max_bytes!r} must be a whole number of bytes, 0 or more.")

    def path(self, key: str) -> Path:
        return self.folder / f"{key}{SUFFIX}"

    def load(self, key: str) -> torch.Tensor | None:
        """The cached embedding for `key` (on the CPU), or None if absent or unreadable."""
        path = self.path(key)
        if not path.is_file():
            return None
        try:
            with safetensors.safe_open(str(path), framework="pt") as entry:
                if (entry.metadata() or {}).get("key") != key:
                    raise ValueError("the entry was written for another key")
                # Out of the file's mapping into fresh memory, where encoded embeddings lie too: the
                # same values at another alignment may round differently (docs/bit-identity.md).
                tensor = entry.get_tensor(TENSOR).clone()
            if not tensor.is_floating_point() or tensor.ndim != 3 or not torch.isfinite(tensor).all():
                raise ValueError(f"the entry holds {tensor.dtype} {tuple(tensor.shape)}, not finite embeddings")
        except Exception as error:  # noqa: BLE001 - any unreadable entry is a miss, never a crash
            log.warning("vidmem: prompt cache entry %s is unreadable (%s); encoding again and rewriting it", path, error)
            _unlink(path)
            return None
        _touch(path)  # least recently used goes first
        return tensor

    def store(self, key: str, embeds: torch.Tensor, description: dict | None = None) -> bool:
        """Write one entry atomically, then trim the folder to `max_bytes`. False if it could not be written."""
        tensors = {TENSOR: embeds.detach().to("cpu").contiguous()}
        metadata = {"key": key, **{k: str(v) for k, v in (description or {}).items()}}
        try:
            with atomic_path(self.path(key)) as temporary:
                safetensors.torch.save_file(tensors, str(temporary), metadata=metadata)
        except OSError as error:
            log.warning("vidmem: prompt cache folder %s cannot be written (%s); embeddings not cached", self.folder, error)
            return False
        self.prune()
        return True

    def entries(self) -> list[Path]:
        try:
            return sorted(p for p in self.folder.glob(f"*{SUFFIX}") if p.is_file())
        except OSError:
            return []

    def prune(self) -> None:
        """Delete least recently used entries until the folder holds at most `max_bytes`, and
        temp files a crashed write left behind."""
        now = time.time()
        for temp in self.folder.glob(f".*{PARTIAL_SUFFIX}"):
            if now - _mtime(temp) > STALE_TEMP_S:
                _unlink(temp)
        sized = [(_mtime(p), _size(p), p) for p in self.entries()]
        total = sum(size for _, size, _ in sized)
        for _, size, path in sorted(sized):
            if total <= self.max_bytes:
                break
            _unlink(path)
            total -= size


def encoder_identity(encoder: nn.Module) -> str:
    """A fingerprint of the encoder's class, config and weights (see the module docstring)."""
    digest = hashlib.sha256(type(encoder).__qualname__.encode())
    config = getattr(encoder, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        digest.update(json.dumps(config.to_dict(), sort_keys=True, default=str).encode())
    for name, tensor in list(encoder.named_parameters()) + list(encoder.named_buffers()):
        digest.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}".encode())
        digest.update(_sampled_bytes(name, tensor))
    return digest.hexdigest()


def prompt_key(identity: str, dtype: torch.dtype, max_sequence_length: int, text: str, token_ids: list[int]) -> str:
    """The entry name for one text under one encoder."""
    fields = {"encoder": identity, "dtype": str(dtype), "max_sequence_length": max_sequence_length,
              "text": text, "token_ids": token_ids}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def _sampled_bytes(name: str, tensor: torch.Tensor) -> bytes:
    if tensor.device.type == "meta":
        raise EncoderIdentityError(f"text encoder weight '{name}' is not loaded (meta device)")
    flat = tensor.detach().reshape(-1)
    if flat.is_floating_point() and flat.element_size() == 1:
        flat = flat.view(torch.uint8)  # fp8 hashes by its bits (and cannot be indexed on the CPU)
    if flat.numel() == 0:
        return b""
    count = min(SAMPLES_PER_TENSOR, flat.numel())
    # Integer steps: a float32 linspace cannot name every index past 2**24 and may run off the end.
    index = torch.arange(count, dtype=torch.int64) * (flat.numel() - 1) // max(count - 1, 1)
    values = flat[index.to(flat.device)].to("cpu")
    return values.contiguous().view(torch.uint8).numpy().tobytes()


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _touch(path: Path) -> None:
    try:
        os.utime(path)
    except OSError:
        pass


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass
