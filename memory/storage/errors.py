"""The storage engine's one error type: a bad file or a bad request, named with its fix."""

from __future__ import annotations


class StorageError(ValueError):
    """A weight file or a stored tensor vidmem cannot use; the message names the input and the fix."""
