"""Where model files are, for the loader nodes: ComfyUI's model folders, or a models root outside it.

Inside ComfyUI its `folder_paths` names the folders of each key (models/<key> plus any
extra_model_paths.yaml entries); nodes/host.py passes the module in, since only host.py imports
ComfyUI. Without ComfyUI (`vidmem queue` tools, benches, scripts), $VIDMEM_MODELS_DIR is a folder
laid out like ComfyUI's models/: diffusers/, diffusion_models/ (or unet/), text_encoders/ (or
clip/), vae/, clip_vision/, loras/, vidmem_configs/. The files in them are listed by the pack's
own cached, symlink-loop-safe walk (nodes/model_lists.py), not folder_paths.get_filename_list,
whose walk never ends on a symlink loop.
"""

from __future__ import annotations

import ntpath
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .model_lists import ListingCache

MODELS_DIR_ENV = "VIDMEM_MODELS_DIR"
ALLOW_ANY_PATH_ENV = "VIDMEM_ALLOW_ANY_PATH"  # the server's operator accepts any folder in Load Video Pipeline's path
NOT_MODEL_FOLDERS = ("custom_nodes",)  # folder_paths keys that are not model folders
DIFFUSERS_KEY = "diffusers"
LORAS_KEY = "loras"
MODEL_CONFIGS_FOLDER = "vidmem_configs"

# Loader input -> ComfyUI folder keys, as core loaders list them ("unet" and "clip" are the legacy names).
MODEL_FILE_FOLDERS = {
    "model": ("diffusion_models", "unet"),
    "text_encoder": ("text_encoders", "clip"),
    "vae": ("vae",),
    "clip_vision": ("clip_vision",),
}
MODEL_FILE_SUFFIXES = (".safetensors", ".sft", ".gguf")  # what vidmem reads; pickles are never offered
LORA_SUFFIXES = (".safetensors", ".sft")

# The process's listings, one per root (folder_paths keeps its own the same way): walked again only
# when a directory in the root changes, so INPUT_TYPES stays cheap however often it is called.
LISTINGS = ListingCache()


def models_root() -> Path | None:
    """$VIDMEM_MODELS_DIR, or None when unset."""
    value = os.environ.get(MODELS_DIR_ENV, "").strip()
    return Path(value).expanduser() if value else None


@dataclass(frozen=True)
class ModelFolders:
    """The model folders of one host: ComfyUI's `folder_paths` module, else a models root (or none)."""

    folder_paths: Any = None
    root: Path | None = None
    listings: ListingCache = field(default_factory=lambda: LISTINGS, compare=False)  # the process's, read when made

    def folders(self, key: str) -> list[str]:
        """The existing folders of folder key `key`."""
        if self.folder_paths is None:
            return [str(self.root / key)] if self.root is not None and (self.root / key).is_dir() else []
        try:
            return [p for p in self.folder_paths.get_folder_paths(key) if os.path.isdir(p)]
        except KeyError:  # a folder key this ComfyUI version does not know
            return []

    def files(self, keys: tuple[str, ...], suffixes: tuple[str, ...]) -> list[str]:
        """Files under the folders of `keys` ending in one of `suffixes` (any case), relative names."""
        return sorted({name for key in keys for folder in self.folders(key) for name in self.listings.files(folder)
                       if name.lower().endswith(suffixes)})

    def diffusers_names(self, roots: list[str] | None = None) -> list[str]:
        """Folders under models/diffusers (or `roots`) that hold a model_index.json, by relative name."""
        roots = self.folders(DIFFUSERS_KEY) if roots is None else roots
        return sorted({os.path.dirname(name) or "." for folder in roots
                       for name in self.listings.files(folder) if os.path.basename(name) == "model_index.json"})

    def resolve_diffusers(self, name: str, roots: list[str] | None = None) -> Path:
        """The diffusers folder `name` under models/diffusers (or `roots`); FileNotFoundError naming them."""
        roots = self.folders(DIFFUSERS_KEY) if roots is None else roots
        self._check_listed(name, "model", "models/diffusers",
                           "or give a folder inside ComfyUI's model folders in the 'path' input")
        for folder in roots:
            candidate = Path(folder) / name
            if (candidate / "model_index.json").is_file():
                return candidate
        where = ", ".join(roots) or self.missing(DIFFUSERS_KEY)
        raise FileNotFoundError(
            f"model '{name}' was not found under {where}; put the diffusers-format folder there "
            "or give its full path in the 'path' input."
        )

    def resolve(self, keys: tuple[str, ...], name: str, label: str) -> Path:
        """The full path of file `name` in the folders of `keys`; FileNotFoundError naming them."""
        self._check_listed(name, label, "/".join(f"models/{key}" for key in keys), "")
        for key in keys:
            for folder in self.folders(key):
                candidate = Path(folder) / name
                if candidate.is_file():
                    return candidate
        where = ", ".join(f"models/{key}" if self.folders(key) else self.missing(key) for key in keys)
        raise FileNotFoundError(f"{label} '{name}' was not found in {where}; put the file there (or pick one from the list).")

    def _check_listed(self, name: str, label: str, where: str, elsewhere: str) -> None:
        """FileNotFoundError when `name`, a value of a list of the folders' contents, would lead out of
        them: absolute, or with '..'. ComfyUI checks a list widget's value only when it is typed in, not
        when a link brings it (any `*` output, Free VRAM's passthrough among them), so inside ComfyUI the
        name is checked here, as `outside_models` checks a typed path (and as folder_paths.get_full_path
        keeps names inside their folder), unless the operator allowed any path."""
        if self.folder_paths is None or any_path_allowed():
            return
        if _leaves_folder(name):
            raise FileNotFoundError(
                f"{label} '{name}' is not a name from its list: listed names lie inside {where}, never absolute or "
                f"with '..' (a value linked in from another node is not checked against the list). Pick one from the "
                f"list{', ' + elsewhere if elsewhere else ''}; to accept any path, whoever runs the server starts "
                f"ComfyUI with {ALLOW_ANY_PATH_ENV}=1.")

    def config_dirs(self) -> list[Path]:
        """models/vidmem_configs when it exists."""
        root = Path(self.folder_paths.models_dir) if self.folder_paths is not None else self.root
        folder = root / MODEL_CONFIGS_FOLDER if root is not None else None
        return [folder] if folder is not None and folder.is_dir() else []

    def model_roots(self) -> list[str]:
        """Every model folder ComfyUI knows: models/ and each key's folders (extra_model_paths.yaml's
        included); empty without ComfyUI."""
        if self.folder_paths is None:
            return []
        keyed = getattr(self.folder_paths, "folder_names_and_paths", {})
        roots = [getattr(self.folder_paths, "models_dir", None)] + [
            folder for key, (folders, *_rest) in keyed.items() if key not in NOT_MODEL_FOLDERS for folder in folders]
        return [root for root in dict.fromkeys(roots) if root]

    def outside_models(self, path: str) -> str | None:
        """Why a typed folder `path` may not be read, or None: inside ComfyUI only ComfyUI's model
        folders may be (the server is often reachable by others), unless its operator set
        $VIDMEM_ALLOW_ANY_PATH=1. Without ComfyUI the user is the operator: anything goes. A
        symlink placed inside a model folder is followed; '..' is refused outright."""
        if self.folder_paths is None or any_path_allowed() or inside_any(path, self.model_roots()):
            return None
        return (f"path '{path.strip()}' is outside ComfyUI's model folders (models/ and those of "
                "extra_model_paths.yaml); path may name only a folder inside them, without '..'. Put the diffusers "
                "folder under models/diffusers and pick it in 'model' (or give its path there). To accept any folder, "
                f"whoever runs the server starts ComfyUI with the environment variable {ALLOW_ANY_PATH_ENV}=1 (only "
                "where everyone who can reach the server may read its files).")

    def missing(self, key: str) -> str:
        """Where folder key `key` was looked for, for an error message."""
        if self.folder_paths is not None:
            return f"ComfyUI's models/{key} (no such folder)"
        if self.root is None:
            return (f"models/{key}: ComfyUI is not running and {MODELS_DIR_ENV} is not set "
                    "(set it to a folder laid out like ComfyUI's models/)")
        return f"{self.root / key} (from {MODELS_DIR_ENV}; no such folder)"


def _leaves_folder(name: str) -> bool:
    """Whether `folder / name` could lie outside the folder, on any OS: absolute here or on Windows, a drive
    ('C:x' is relative to drive C's current folder there, not to the folder), a leading slash or backslash
    (rooted on the folder's drive; Python 3.13's ntpath.isabs no longer calls '\\x' absolute), or '..'."""
    forward = name.replace("\\", "/")
    return (os.path.isabs(name) or ntpath.isabs(name) or bool(ntpath.splitdrive(name)[0]) or forward.startswith("/")
            or ".." in forward.split("/"))


def any_path_allowed() -> bool:
    """Whether the server's operator set $VIDMEM_ALLOW_ANY_PATH: typed folders anywhere may be read."""
    return os.environ.get(ALLOW_ANY_PATH_ENV, "").strip().lower() in ("1", "true", "yes")


def inside_any(path: str, roots) -> bool:
    """Whether the typed folder `path` lies inside one of `roots`: '..' refused outright, a link placed
    inside a root followed (its real path may be elsewhere)."""
    given = Path(os.path.expanduser(path.strip()))
    return ".." not in given.parts and any(_within(os.path.abspath(given), os.path.abspath(root)) or
                                           _within(os.path.realpath(given), os.path.realpath(root)) for root in roots)


def _within(path: str, root: str) -> bool:
    path, root = os.path.normcase(path), os.path.normcase(root)
    try:
        return os.path.commonpath([path, root]) == root
    except ValueError:  # different drives (Windows)
        return False
