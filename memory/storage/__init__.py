"""Weight storage: formats below the compute precision, upcast per layer when a layer runs."""

from .formats import FORMATS, StorageFormat, storage_format

__all__ = ["FORMATS", "StorageFormat", "storage_format"]
