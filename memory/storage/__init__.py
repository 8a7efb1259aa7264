"""Weight storage: formats below the compute precision, upcast per layer when a layer runs, and
weights left memory-mapped in their files (the disk tier)."""

from .accounting import FormatCount, StorageReport
from .apply import assign_weights, bytes_copied, lowered_weights, stays_stored
from .errors import StorageError
from .files import SafetensorsFile, open_safetensors, sniff
from .formats import FORMATS, StorageFormat, storage_format
from .gguf_files import GgufFile, open_gguf, supported_gguf_types
from .mapping import is_file_backed, mapped_bytes
from .modules import StoredEmbedding, StoredLinear
from .quantize import quantize
from .scaled import fold_scaled_fp8
from .stored import StoredTensor, dequantize_into, upcast_workspace_bytes
from .weightfile import open_weights

__all__ = [
    "FORMATS",
    "FormatCount",
    "GgufFile",
    "SafetensorsFile",
    "StorageError",
    "StorageFormat",
    "StorageReport",
    "StoredEmbedding",
    "StoredLinear",
    "StoredTensor",
    "assign_weights",
    "bytes_copied",
    "dequantize_into",
    "fold_scaled_fp8",
    "is_file_backed",
    "lowered_weights",
    "mapped_bytes",
    "open_gguf",
    "open_safetensors",
    "open_weights",
    "quantize",
    "sniff",
    "stays_stored",
    "storage_format",
    "supported_gguf_types",
    "upcast_workspace_bytes",
]
