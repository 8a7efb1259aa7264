"""Listings of model folders for the loader nodes' dropdowns: cached, and safe on symlink cycles.

ComfyUI builds every node's INPUT_TYPES on each /object_info request and each prompt validation,
so a listing that walks every file of every model folder (a diffusers model is dozens of shards)
runs again and again. As ComfyUI's own folder_paths does, a root's listing is kept with the
modification time of every directory the walk entered, and walked again only when one of them
changed (adding, removing or renaming an entry changes its directory's mtime) or the root is gone.
Checking costs one stat per directory, not a scan of every file.

Symlinked directories are followed (people link model folders in from other disks), but a
directory whose identity (device, inode) is already on the path being walked is not entered again:
a link back to an ancestor (`models/diffusers/loop -> ..`) ends there, once, with a log line;
Python's os.walk(followlinks=True), which ComfyUI uses, descends such a loop until the kernel's
40-link limit, i.e. 2**40 directories for two such links. A folder linked in under two names is
listed under both (ComfyUI does the same). Names are relative paths with the OS separator, as
ComfyUI's own lists give them; `.git` folders are skipped, as ComfyUI skips them.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

log = logging.getLogger("vidmem")

SKIPPED_FOLDERS = frozenset({".git"})


@dataclass(frozen=True)
class Listing:
    """Every file under a root (relative names, sorted) and the mtime of every directory entered."""

    files: tuple[str, ...]
    folder_mtimes: tuple[tuple[str, int], ...]  # (path, st_mtime_ns)

    def is_current(self) -> bool:
        for path, mtime in self.folder_mtimes:
            try:
                if os.stat(path).st_mtime_ns != mtime:
                    return False
            except OSError:  # removed, or no longer readable
                return False
        return bool(self.folder_mtimes)  # a root that did not exist is looked at again


def walk(root: str) -> Listing:
    """All files under `root`, following symlinked directories but never into a loop."""
    files: list[str] = []
    mtimes: list[tuple[str, int]] = []
    pending: list[tuple[str, str, frozenset]] = [(root, "", frozenset())]
    while pending:
        folder, prefix, ancestors = pending.pop()
        try:
            status = os.stat(folder)
            with os.scandir(folder) as scan:
                entries = list(scan)
        except OSError:  # unreadable, removed meanwhile, or a dangling link: nothing to list
            continue
        identity = (status.st_dev, status.st_ino)
        if identity in ancestors:
            log.info("vidmem: %s links back to a folder it is inside of; not listed again (a symlink loop)", folder)
            continue
        mtimes.append((folder, status.st_mtime_ns))
        inside = ancestors | {identity}
        for entry in entries:
            name = prefix + entry.name
            try:
                if entry.is_dir():  # follows symlinks
                    if entry.name not in SKIPPED_FOLDERS:
                        pending.append((entry.path, name + os.sep, inside))
                elif entry.is_file():
                    files.append(name)
            except OSError:
                continue
    return Listing(tuple(sorted(files)), tuple(mtimes))


class ListingCache:
    """Listings by root, each walked again only once a directory in it has changed."""

    def __init__(self) -> None:
        self._listings: dict[str, Listing] = {}
        self.walks = 0  # roots walked (not served from the cache): for tests and logs

    def files(self, root: str) -> tuple[str, ...]:
        listing = self._listings.get(root)
        if listing is None or not listing.is_current():
            listing = walk(root)
            self._listings[root] = listing
            self.walks += 1
        return listing.files
