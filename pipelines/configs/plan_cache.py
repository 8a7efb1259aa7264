"""What the planner measured on `meta`, kept on disk so the next `vidmem plan` need not measure it again.

Building a 14B model on `meta` and tracing its stages takes seconds (and importing the diffusers
and transformers classes to build it takes more); the numbers it yields are a pure function of
the model's configuration, the shape, the attention kernel and the code that traces. So a
`MetaModel` keeps them in one folder per identity under the user cache folder:

- `weights.json`: per component and storage format, its tensors as the tiers split them
  (`schedule.SlotTable`) and its upcast figures; the VAE's decoder stages (streamed batch, frame-wide layers);
- `traces-<shape>.json`: per traced call at one shape and attention kernel, its allocation events,
  peak, FLOPs, and the module order it ran in (what the sequential tier replays).

The folder's name is a hash of everything the numbers depend on: the model's resolved
configuration (every component's class and config, the dtypes), the source of vidmem's engine and
pipelines (any edit misses), and the torch, diffusers and transformers versions. A stale entry
can therefore never be read: it is simply never looked up again. Files are JSON, written whole
(`pipelines.atomic`); one that cannot be read is logged and ignored, and rewritten on the next
measurement. `VIDMEM_PLAN_CACHE=0` turns the cache off; `VIDMEM_CACHE_DIR` moves it (default:
`$XDG_CACHE_HOME/vidmem`, `~/.cache/vidmem`, or `%LOCALAPPDATA%\\vidmem` on Windows); deleting
the `plan` folder there clears it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
from functools import lru_cache
from importlib import metadata
from pathlib import Path

from ..atomic import write_bytes_atomically

log = logging.getLogger("vidmem")

FORMAT = 1  # bump when the files' layout changes
_PACKAGE = Path(__file__).resolve().parents[2]  # the vidmem package (the repository root)
_SOURCES = ("memory", "pipelines")  # the code whose output is cached: tracing, families, the split of tensors


def cache_root() -> Path | None:
    """Where plan caches live, or None when `VIDMEM_PLAN_CACHE` turns them off."""
    if os.environ.get("VIDMEM_PLAN_CACHE", "1").strip().lower() in ("0", "off", "false", "no"):
        return None
    if os.environ.get("VIDMEM_CACHE_DIR"):
        base = Path(os.environ["VIDMEM_CACHE_DIR"]).expanduser()
    elif sys.platform == "win32" and os.environ.get("LOCALAPPDATA"):
        base = Path(os.environ["LOCALAPPDATA"]) / "vidmem"
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vidmem"
    return base / "plan"


@lru_cache(maxsize=1)
def code_identity() -> dict:
    """The versions and source the cached numbers depend on (read once per process)."""
    digest = hashlib.sha256()
    for folder in _SOURCES:
        for file in sorted((_PACKAGE / folder).rglob("*.py")):
            digest.update(file.relative_to(_PACKAGE).as_posix().encode() + b"\0" + file.read_bytes() + b"\0")
    return {"format": FORMAT, "source": digest.hexdigest(),
            **{name: _version(name) for name in ("torch", "diffusers", "transformers")}}


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return ""


def digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


class PlanCache:
    """One model identity's folder: named JSON files of entries, read once, written whole."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._files: dict[str, dict] = {}

    @classmethod
    def open(cls, identity: dict) -> PlanCache | None:
        """The cache for a model whose numbers depend on `identity` (besides the code), or None when off."""
        root = cache_root()
        return None if root is None else cls(root / digest({**identity, **code_identity()})[:32])

    def get(self, file: str, key: str):
        return self._read(file).get(key)

    def put(self, file: str, key: str, value) -> None:
        """Add an entry and rewrite the file atomically; a failure to write only costs the next run time."""
        entries = self._read(file)
        entries[key] = value
        try:
            write_bytes_atomically(self.folder / f"{file}.json", json.dumps(entries, separators=(",", ":")).encode())
        except OSError as error:
            log.warning("vidmem: could not write the plan cache %s: %s", self.folder / f"{file}.json", error)

    def _read(self, file: str) -> dict:
        if file not in self._files:
            self._files[file] = self._load(self.folder / f"{file}.json")
        return self._files[file]

    @staticmethod
    def _load(path: Path) -> dict:
        try:
            data = json.loads(path.read_bytes())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as error:
            log.warning("vidmem: ignoring the damaged plan cache file %s (%s); it is measured again", path, error)
            return {}
        if not isinstance(data, dict):
            log.warning("vidmem: ignoring the damaged plan cache file %s (not a JSON object); it is measured again", path)
            return {}
        return data
