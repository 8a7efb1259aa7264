"""The only module that talks to ComfyUI. Every call degrades to a plain default without it.

Reads host state and asks the host for things through its public functions; it never assigns
a host attribute, never edits `current_loaded_models`, and never touches native MODELs.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger("vidmem")

try:  # ComfyUI present: the pack runs inside the host
    import comfy.model_management as model_management
    import comfy.utils as comfy_utils
    import folder_paths
except ImportError:  # CI, the CLI, plain Python: no host
    model_management = comfy_utils = folder_paths = None

MODELS_FOLDER_KEY = "diffusers"


def in_comfyui() -> bool:
    return folder_paths is not None


class Progress:
    """ComfyUI's progress bar (which also raises on interrupt) or tqdm on a terminal."""

    def __init__(self, total: int, label: str = "vidmem") -> None:
        if comfy_utils is not None:
            self._bar = comfy_utils.ProgressBar(total)
            self._tqdm = None
        else:
            from tqdm.auto import tqdm

            self._bar = None
            self._tqdm = tqdm(total=total, desc=label, leave=False)

    def step(self, done: int, total: int) -> None:
        if self._bar is not None:
            self._bar.update_absolute(done, total)
        else:
            self._tqdm.n = done
            self._tqdm.refresh()

    def close(self) -> None:
        if self._tqdm is not None:
            self._tqdm.close()


def check_interrupt() -> None:
    """Raise ComfyUI's interrupt exception if the user pressed Cancel; no-op without ComfyUI."""
    if model_management is not None:
        model_management.throw_exception_if_processing_interrupted()


def diffusers_model_names() -> list[str]:
    """Folders under ComfyUI's models/diffusers that hold a model_index.json, by relative name."""
    names: set[str] = set()
    for root in _diffusers_roots():
        for folder, _dirs, files in os.walk(root, followlinks=True):
            if "model_index.json" in files:
                names.add(os.path.relpath(folder, root))
    return sorted(names)


def resolve_model_folder(name: str, path: str) -> Path:
    """An explicit `path` wins; otherwise `name` is looked up under models/diffusers."""
    if path.strip():
        return Path(path.strip()).expanduser()
    for root in _diffusers_roots():
        candidate = Path(root) / name
        if (candidate / "model_index.json").is_file():
            return candidate
    where = ", ".join(_diffusers_roots()) or "ComfyUI's models/diffusers (ComfyUI not running)"
    raise FileNotFoundError(
        f"model '{name}' was not found under {where}; put the diffusers-format folder there "
        "or give its full path in the 'path' input."
    )


def _diffusers_roots() -> list[str]:
    if folder_paths is None:
        return []
    return [p for p in folder_paths.get_folder_paths(MODELS_FOLDER_KEY) if os.path.isdir(p)]


def make_room(bytes_needed: int, device) -> None:
    """Ask ComfyUI to unload its own models until `bytes_needed` fit on `device`."""
    if model_management is not None and device.type == "cuda":
        model_management.free_memory(bytes_needed, device)


def unload_host_models() -> bool:
    """Ask ComfyUI to unload all of its models (only when the user asks); False without ComfyUI."""
    if model_management is None:
        return False
    model_management.unload_all_models()
    model_management.soft_empty_cache()
    return True
