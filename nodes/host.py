"""The only module that talks to ComfyUI. Every call degrades to a plain default without it.

Reads host state and asks the host for things through its public functions; it never assigns
a host attribute, never edits `current_loaded_models`, and never touches native MODELs.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import weakref
from pathlib import Path

from .model_folders import (  # noqa: F401 (public here: the loader nodes read them through host)
    DIFFUSERS_KEY as MODELS_FOLDER_KEY,
    LORAS_KEY as LORAS_FOLDER_KEY,
    MODEL_FILE_FOLDERS,
    LORA_SUFFIXES,
    MODEL_FILE_SUFFIXES,
    MODELS_DIR_ENV,
    ModelFolders,
    models_root,
)

log = logging.getLogger("vidmem")

try:  # ComfyUI present: the pack runs inside the host
    import comfy.model_management as model_management
    import comfy.utils as comfy_utils
    import folder_paths
except ImportError:  # CI, the CLI, plain Python: no host
    model_management = comfy_utils = folder_paths = None


def model_folders() -> ModelFolders:
    """The model folders: ComfyUI's folder_paths inside ComfyUI; without it $VIDMEM_MODELS_DIR (a
    folder laid out like ComfyUI's models/), read at each call; listings cached (nodes/model_lists.py)."""
    return ModelFolders(folder_paths, None if folder_paths is not None else models_root())


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
            self._tqdm.total, self._tqdm.n = total, done
            self._tqdm.refresh()

    def close(self) -> None:
        if self._tqdm is not None:
            self._tqdm.close()


def check_interrupt() -> None:
    """Raise ComfyUI's interrupt exception if the user pressed Cancel; no-op without ComfyUI."""
    if model_management is not None:
        model_management.throw_exception_if_processing_interrupted()


def diffusers_model_names() -> list[str]:
    """Folders under models/diffusers that hold a model_index.json, by relative name (cached, symlink-loop safe)."""
    return model_folders().diffusers_names(_diffusers_roots())


def resolve_model_folder(name: str, path: str) -> Path:
    """An explicit `path` wins; otherwise `name` is looked up under models/diffusers."""
    if path.strip():
        return Path(path.strip()).expanduser()
    return model_folders().resolve_diffusers(name, _diffusers_roots())


def _diffusers_roots() -> list[str]:
    return model_folders().folders(MODELS_FOLDER_KEY)


def single_file_transformer_names() -> list[str]:
    """Transformer files a diffusers folder's transformer can be replaced with: the weight files of
    models/diffusion_models (and the legacy models/unet), GGUF included (empty without ComfyUI)."""
    return model_file_names("model")


def resolve_single_file(name: str) -> Path:
    """The full path of transformer_file `name`; FileNotFoundError naming the folders when absent."""
    return resolve_model_file("model", name, "transformer_file")


def make_room(bytes_needed: int, device, warm=None, weight_bytes: int = 0) -> None:
    """Ask ComfyUI to unload its own models until `bytes_needed` fit on `device`.

    `bytes_needed` is the stage's weights plus its predicted activations (pipelines/room.py).
    With a warm store (memory/warm.py: the weights a stage keeps on the device between calls),
    the store is registered in ComfyUI's memory manager as one of its loaded models, through
    `load_models_gpu`, the way ComfyUI's own loaders ask for room: it frees 1.1x the weights
    the store does not hold yet plus the activations and the VRAM it reserves for other
    applications, never evicts the store itself, and from then on counts what the store holds
    and asks for it back when another model needs the room (`VidmemPatcher`, below).
    Without a store it calls `free_memory(bytes_needed + extra_reserved_memory())`: ComfyUI's
    free figure (driver free + torch's cached-but-unused) then exceeds the request.
    """
    if model_management is None:
        return
    if warm is None or not hasattr(model_management, "load_models_gpu"):
        if device.type == "cuda":
            reserve = getattr(model_management, "extra_reserved_memory", lambda: 0)()
            model_management.free_memory(bytes_needed + reserve, device)
        return
    patcher = registered_patcher(warm, device)
    patcher.planned_bytes = weight_bytes
    model_management.load_models_gpu([patcher], memory_required=max(0, bytes_needed - weight_bytes))


def registered_patcher(warm, device):
    """The ComfyUI model entry standing for `warm` on `device`, made on first use and kept alive by
    the store (ComfyUI holds its entries' patchers weakly: when the pipeline goes, so does the entry)."""
    patcher = warm.host_entry
    if patcher is None or patcher.load_device != device:
        patcher = _patcher_class()(warm, device)
        warm.host_entry = patcher
    return patcher


@functools.lru_cache(maxsize=None)
def _patcher_class():
    """ComfyUI's ModelPatcher, subclassed on first use (importable only inside ComfyUI)."""
    from comfy.model_patcher import ModelPatcher
    import torch

    class VidmemWeights(torch.nn.Module):
        """The module ComfyUI's entry points at (its logs name this class); holds no tensors."""

    class VidmemPatcher(ModelPatcher):
        """vidmem's device memory as ComfyUI's memory manager sees it: a model whose size is the
        weights the stage wants on the device and whose loaded part is what its warm store keeps.

        ComfyUI asks it for memory back through `partially_unload` (some) and `detach` (all),
        from `free_memory`, `unload_all_models`, `POST /free` and its out-of-memory handler.
        Nothing is copied back: the store drops device copies of weights whose host copies never
        changed. `detach(unpatch_all=False)` comes on every re-registration and from `__del__`:
        it must give nothing back and never raise.
        """

        def __init__(self, warm, device) -> None:
            super().__init__(VidmemWeights(), load_device=device, offload_device=torch.device("cpu"))
            self._warm = weakref.ref(warm)  # the store holds the patcher; the patcher must not hold it
            self.planned_bytes = 0  # the stage's device weights under its strategy (memory.offload)
            self.granted_bytes = 0  # ComfyUI's weight grant at the last registration

        def _held(self) -> int:
            warm = self._warm()
            return warm.held_bytes if warm is not None else 0

        def model_size(self):
            return max(self.planned_bytes, self._held())

        def loaded_size(self):
            return self._held()

        def current_loaded_device(self):
            return self.load_device if self._held() else self.offload_device

        def partially_load(self, device_to, extra_memory=0, force_patch_weights=False):
            """ComfyUI's weight grant at registration. Nothing is uploaded now (the stage's call
            does that); a negative grant (its formula is room less what is loaded) asks the store
            to shrink by that much, which it does, streamed blocks first."""
            self.granted_bytes = extra_memory
            warm = self._warm()
            if extra_memory >= 0 or warm is None:
                return 0
            return -warm.release(int(-extra_memory))

        def partially_unload(self, device_to, memory_to_free=0, force_patch_weights=False):
            warm = self._warm()
            freed = _give_back(warm, lambda: warm.release(int(memory_to_free))) if warm is not None else 0
            log.info("vidmem: gave back %.2f GiB at ComfyUI's request", freed / (1 << 30))
            return freed

        def detach(self, unpatch_all=True):
            """`unpatch_all`: ComfyUI drops the entry, so the store must give back everything, even
            when it holds nothing now: mid-call its groups have taken the copies, and the store then
            drops all of them when the call ends (ComfyUI no longer counts them)."""
            warm = self._warm()
            if unpatch_all and warm is not None:
                freed = _give_back(warm, warm.release_all)
                if freed:
                    log.info("vidmem: gave back all %.2f GiB of %s at ComfyUI's request", freed / (1 << 30), warm.label)
            return self.model

    return VidmemPatcher


def _give_back(warm, release) -> int:
    """Bytes `release()` freed; 0 while the store's call runs on another thread. Never raises into
    ComfyUI: its `free_memory` pops the models it unloaded only after its loop, so an exception from
    one entry would strand those it had already unloaded in its list, and its next cleanup would
    fail on them. The store applies the request itself when its call ends."""
    from ..memory.warm import WarmStoreBusy

    try:
        return release()
    except WarmStoreBusy as refusal:
        log.warning("%s", refusal)
        return 0


def pinned_room_bytes() -> int | None:
    """What ComfyUI's pinned-memory budget still allows: `MAX_PINNED_MEMORY - TOTAL_PINNED_MEMORY`
    of comfy.model_management. None without ComfyUI, or without a budget (`--disable-pinned-memory`,
    or a GPU ComfyUI does not pin for: MAX_PINNED_MEMORY <= 0).

    vidmem's automatic pinned ceiling stays within it (memory.hostpool.pinned_cap_bytes): one
    ceiling on locked memory for both pools. ComfyUI's budget is a share of total RAM (95% on Linux,
    45% on Windows, where the driver limits locked memory to about half), so inside a default
    ComfyUI vidmem's own "half of the free RAM, keeping 8 GB" is usually the smaller of the two.
    """
    if model_management is None:
        return None
    ceiling = getattr(model_management, "MAX_PINNED_MEMORY", -1)  # ComfyUI 0.8.0's names; absent: no budget
    if ceiling <= 0:
        return None
    return max(0, int(ceiling - getattr(model_management, "TOTAL_PINNED_MEMORY", 0)))


def unload_host_models() -> bool:
    """Ask ComfyUI to unload all of its models (only when the user asks); False without ComfyUI."""
    if model_management is None:
        return False
    model_management.unload_all_models()
    model_management.soft_empty_cache()
    return True


def compute_device():
    """ComfyUI's chosen device (honours --cpu and its GPU choice); CUDA-or-CPU without ComfyUI."""
    if model_management is not None:
        return model_management.get_torch_device()
    from ..memory import resolve_compute_device

    return resolve_compute_device()


def latents_folder() -> Path:
    """ComfyUI's input folder: core Load Latent lists only the .latent files directly in it; ./input without ComfyUI."""
    return Path(folder_paths.get_input_directory()) if folder_paths is not None else Path.cwd() / "input"


PROMPT_CACHE_ENV = "VIDMEM_CACHE_DIR"  # outside ComfyUI: where vidmem caches (prompt embeddings, ...)


def prompt_cache_folder(explicit: str | os.PathLike | None = None) -> Path:
    """Where prompt embeddings are cached (vidmem.pipelines.prompt_cache.PromptCache's folder).

    `explicit` wins. Inside ComfyUI: a system-user folder under its user directory
    (`user/__vidmem/prompt_embeddings`): it survives restarts, unlike the temp folder ComfyUI
    empties at every start, and ComfyUI serves no `__` folder over HTTP. Without ComfyUI:
    $VIDMEM_CACHE_DIR, else the OS cache folder (~/.cache/vidmem, ~/Library/Caches/vidmem,
    %LOCALAPPDATA%\\vidmem).
    """
    if explicit:
        return Path(explicit).expanduser()
    if folder_paths is not None:
        system_folder = getattr(folder_paths, "get_system_user_directory", None)
        root = Path(system_folder("vidmem")) if system_folder else Path(folder_paths.get_user_directory()) / "__vidmem"
        return root / "prompt_embeddings"
    if os.environ.get(PROMPT_CACHE_ENV):
        return Path(os.environ[PROMPT_CACHE_ENV]).expanduser() / "prompt_embeddings"
    return _os_cache_root() / "vidmem" / "prompt_embeddings"


def mag_ratios_folder() -> Path:
    """Where MagCache calibration runs save their ratios, which the Step Cache node lists: beside the
    prompt cache (inside ComfyUI `user/__vidmem/mag_ratios`, else under $VIDMEM_CACHE_DIR or the OS cache)."""
    return prompt_cache_folder().parent / "mag_ratios"


def _os_cache_root() -> Path:
    if sys.platform == "win32":
        return Path(os.environ.get("LOCALAPPDATA") or Path.home() / "AppData" / "Local")
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")


def lora_names() -> list[str]:
    """Safetensors files under models/loras (empty without ComfyUI or $VIDMEM_MODELS_DIR)."""
    return model_folders().files((LORAS_FOLDER_KEY,), LORA_SUFFIXES)


def resolve_lora(name: str) -> Path:
    """The full path of `name` under models/loras; FileNotFoundError naming the folders if absent."""
    return model_folders().resolve((LORAS_FOLDER_KEY,), name, "lora_name")


# --- ComfyUI's own model files (Load Video Model Files) --------------------------------------------

def model_file_names(role: str) -> list[str]:
    """Weight files under the folders of loader input `role`, .gguf included (core ComfyUI lists
    .gguf only when ComfyUI-GGUF is installed); empty without ComfyUI or $VIDMEM_MODELS_DIR."""
    return model_folders().files(MODEL_FILE_FOLDERS[role], MODEL_FILE_SUFFIXES)


def resolve_model_file(role: str, name: str, label: str = "") -> Path:
    """The full path of `name` in the folders of loader input `role` (named `label` in the error,
    default `role`); FileNotFoundError naming them."""
    return model_folders().resolve(MODEL_FILE_FOLDERS[role], name, label or role)


def model_config_dirs() -> list[Path]:
    """models/vidmem_configs when it exists: extra model configs (shipped schema) the single-file
    loader matches files against, e.g. the tiny test models (empty without ComfyUI or $VIDMEM_MODELS_DIR)."""
    return model_folders().config_dirs()


# --- LoRA training (Prepare Training Data, Train LoRA) ----------------------------------------------

TRAINING_FOLDER = "vidmem_training"


def loras_folder() -> Path:
    """Where a trained LoRA is written: ComfyUI's first models/loras folder; without ComfyUI
    $VIDMEM_MODELS_DIR/loras, else ./models/loras."""
    if folder_paths is not None:
        folders = model_folders().folders(LORAS_FOLDER_KEY) or list(folder_paths.get_folder_paths(LORAS_FOLDER_KEY))
        if folders:
            return Path(folders[0])
    root = models_root()
    return (root if root is not None else Path.cwd() / "models") / LORAS_FOLDER_KEY


def training_folder() -> Path:
    """Prepared-data cache and training checkpoints: ComfyUI's output/vidmem_training (./output/... without ComfyUI)."""
    root = Path(folder_paths.get_output_directory()) if folder_paths is not None else Path.cwd() / "output"
    return root / TRAINING_FOLDER


def prompt_server():
    """ComfyUI's running PromptServer (routes, progress text), or None outside a running ComfyUI.

    Found in sys.modules, never imported: ComfyUI imports it before custom nodes load, and outside
    ComfyUI a module named "server" may be anything."""
    server = sys.modules.get("server")
    return getattr(getattr(server, "PromptServer", None), "instance", None)


def progress_text(text: str, node_id: str | None) -> None:
    """Show `text` on the running node (ComfyUI's progress text, e.g. a training loss); no-op without a server."""
    send = getattr(prompt_server(), "send_progress_text", None)
    if send is not None and node_id is not None:
        send(text, node_id)
