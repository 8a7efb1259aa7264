"""open_weights: one entry point for any weight file, by content."""

from __future__ import annotations

import os

from .files import SafetensorsFile, open_safetensors, sniff
from .gguf_files import GgufFile, open_gguf


def open_weights(path: str | os.PathLike) -> SafetensorsFile | GgufFile:
    """A safetensors or GGUF file, memory-mapped, chosen by content (a pickle raises StorageError)."""
    return open_gguf(path) if sniff(path) == "gguf" else open_safetensors(path)
