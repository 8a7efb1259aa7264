"""Files written whole or not at all: a temporary file beside the target, renamed onto it.

A crash, a full disk or an interrupt mid-write leaves the target as it was (or absent) and no
partial file a later run could mistake for a good one. The temporary file is flushed to disk
(fsync) before the rename, and the folder after it where the OS can open one: without the first,
a power loss soon after the rename can leave the target name on an empty or partial file
(filesystems may write the rename before the data); without the second, the rename itself may be
lost. Standard library only, so the light command-line client can use it too.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

PARTIAL_SUFFIX = ".part"  # what a temporary file ends with (so folders can sweep stale ones)


def _read_umask() -> int:
    mask = os.umask(0)  # the only way to read it; set back at once. Read once, at import, not
    os.umask(mask)      # per write: another thread creating a file meanwhile would get mode 0666.
    return mask


_UMASK = _read_umask()


@contextmanager
def atomic_path(target: Path) -> Iterator[Path]:
    """A fresh temporary path in `target`'s folder: write it inside the block; on a clean exit it
    replaces `target` in one rename, on any exception it is deleted."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=PARTIAL_SUFFIX)
    os.close(handle)
    try:
        yield Path(temporary)
        # mkstemp makes the file private (0600); the finished file gets the mode any new file gets
        # here (0666 less the umask), so a LoRA or latent is readable as the user's other files are.
        os.chmod(temporary, 0o666 & ~_UMASK)
        _flush_file(temporary)
        _replace(temporary, target)
        _flush_folder(target.parent)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _flush_file(path: str) -> None:
    handle = os.open(path, os.O_RDWR)  # writable: Windows' fsync (_commit) needs it
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def _flush_folder(folder: Path) -> None:
    """The rename on disk. Best effort: Windows cannot open a folder (NTFS journals the rename), and
    some filesystems refuse fsync on one; the file itself is already whole either way."""
    if not hasattr(os, "O_DIRECTORY"):
        return
    try:
        handle = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(handle)
    except OSError:
        pass
    finally:
        os.close(handle)


class FileInUse(PermissionError):
    """The target could not be replaced because something holds it open (Windows refuses to replace a
    file that is open or memory-mapped, as a LoRA or weight file vidmem maps is)."""


def _replace(temporary: str, target: Path) -> None:
    try:
        os.replace(temporary, target)
    except PermissionError as error:
        if not target.exists():
            raise
        raise FileInUse(error.errno, f"{target} could not be replaced: it is open in another program, or loaded "
                                     f"from disk by a node (a LoRA or model file is memory-mapped while it is in "
                                     f"use; {error.strerror}). Free it (Free VRAM, or remove the node that loads "
                                     f"it) or choose another file name; nothing was written.", str(target)) from None


def write_bytes_atomically(target: Path, data: bytes) -> Path:
    with atomic_path(target) as temporary:
        temporary.write_bytes(data)
    return Path(target)
