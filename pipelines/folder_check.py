"""Check a diffusers-format folder before diffusers reads it, so a bad file is named with its fix.

diffusers' `from_pretrained(use_safetensors=True)` picks weight files by NAME (`*.safetensors`)
and reports a damaged one, a missing folder or a broken config.json as a raw error about the
whole folder. Here every component model_index.json lists is looked at first:
- its folder exists, and a model's config.json is a JSON object;
- every weight file is decided by CONTENT (`memory.storage.sniff`): a pickle under any name, an
  empty or truncated file, a GGUF file named .safetensors are refused naming the file; files
  named like pickles (.bin, .pt, .pth, .ckpt, .pkl) are refused unread: vidmem never unpickles;
- a shard index (`*.safetensors.index.json`) may name only .safetensors files of its own folder:
  diffusers reads the shards it lists by their names, and hands any other name to `torch.load`;
- these file checks run on every component folder, whatever library model_index.json names
  (a library spelled "diffusers.models", or a pipeline module such as LTX-2's "ltx2", which
  diffusers resolves itself), and on folders read outside the index (`check_weight_folder`);
- the config is built on meta and its weights counted against the files (`weight_check`), so an
  absurd size never reaches the allocator.
The RAM the load makes is checked after this, in one check with the single files and the lowered
components (`folder_storage.check_stored`, from the loader): one refusal lists everything.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import torch

from ..memory.storage import StorageError, sniff
from .configs.meta import ComponentConfig, component_class
from .family import ModelError
from .json_files import read_json_object
from .weight_check import check_against_files, implied_weights, stored_elements

LIBRARIES = ("diffusers", "transformers")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
SAFETENSORS_SUFFIXES = (".safetensors", ".sft")  # .sft: sniffed too, but diffusers reads only .safetensors
# The shard indexes diffusers and transformers read with use_safetensors=True ({"metadata": ..., "weight_map": {...}}),
# "model.safetensors.index.json", "diffusion_pytorch_model.fp16.safetensors.index.json"; a "*.bin.index.json" left
# beside them is never read (a .bin shard present is refused by its name).
INDEX_SUFFIX = ".safetensors.index.json"


@dataclass(frozen=True)
class FolderComponent:
    """One component model_index.json lists: its folder, and its config.json when it is a model."""

    name: str
    library: str
    class_name: str
    path: Path
    config: dict | None = None  # None: tokenizers, schedulers, processors (no weights)

    def component_config(self) -> ComponentConfig:
        return ComponentConfig(self.name, self.library, self.class_name, self.config, str(self.path / "config.json"))


def check_model_folder(folder: Path, index: dict, dtype: torch.dtype, replaced: Collection[str] = (),
                       dtypes: Mapping[str, torch.dtype] = MappingProxyType({})) -> dict[str, dict]:
    """Every component of `folder` checked (see the module doc); its models' configs by name.

    `replaced` components are read from elsewhere (a single transformer file): only their
    config.json is checked here (that the class takes it). Each component is built at its dtype in
    `dtypes` (the VAE at vae_dtype), else at `dtype`. Nothing is checked against RAM here: the loader
    checks the whole load's RAM once, after every file is read (`folder_storage.check_stored`), so a
    refusal lists all that takes RAM instead of the folder's part first and the files' after.
    """
    components = [_component(folder, name, entry) for name, entry in index.items() if _is_component(entry)]
    for component in components:
        if component.config is None:
            if component.name not in replaced and component.path.is_dir():
                check_weight_folder(component.path, component.name)  # whatever reads it must find no pickle
            continue
        implied = implied_weights(component.component_config(), dtypes.get(component.name, dtype))
        if component.name in replaced:
            continue
        stored = _check_weight_files(component)
        check_against_files(implied, stored, f"the .safetensors files in '{component.path}'")
    return {c.name: c.config for c in components if c.config is not None}


def _is_component(entry) -> bool:
    """model_index.json lists components as [library, class]; [null, null] is an absent one."""
    return isinstance(entry, list) and len(entry) == 2 and entry[0] is not None and entry[1] is not None


def _component(folder: Path, name: str, entry: list) -> FolderComponent:
    library, class_name = entry
    index = folder / "model_index.json"
    if not isinstance(library, str) or library.partition(".")[0] not in LIBRARIES or not isinstance(class_name, str):
        return FolderComponent(name, str(library), str(class_name), folder / name)  # diffusers resolves other libraries itself
    path = folder / name
    if not path.is_dir():
        raise ModelError(f"{index} lists the component '{name}' ({class_name}) but the folder '{path}' is missing; "
                         f"re-download the model's '{name}' folder (or the whole diffusers-format model).")
    cls = component_class(library, class_name)  # "diffusers", or a module of it such as "diffusers.models"
    spelled, library = library, library.partition(".")[0]  # built as the library's class (fp32 rules, from_config)
    if cls is None:
        raise ModelError(f"{index} names '{name}' as {spelled}.{class_name}, which the installed {library} does not "
                         f"have; update {library}, or re-download the model.")
    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
        return FolderComponent(name, library, class_name, path)
    return FolderComponent(name, library, class_name, path, read_json_object(path / "config.json", f"'{name}'"))


def _check_weight_files(component: FolderComponent) -> int:
    """Every weight file of the component's folder by content; the elements its .safetensors files hold."""
    weights = check_weight_folder(component.path, component.name)
    named = [p for p in weights if p.suffix == ".safetensors"]
    if not named:
        found = ", ".join(p.name for p in sorted(component.path.iterdir())) or "nothing"
        raise ModelError(f"'{component.name}': '{component.path}' has no .safetensors weights (it holds {found}); "
                         "diffusers reads weights named *.safetensors: re-download the model's safetensors files.")
    return sum(stored_elements(_shapes(p)) for p in named)


def check_weight_folder(path: Path, name: str) -> list[Path]:
    """The weight files of a model's folder `path` (component `name`), every one safe for diffusers or
    transformers to read (ModelError naming the file and its fix otherwise): no file named like a pickle,
    shard indexes that list only .safetensors files of this folder, every .safetensors/.sft file one by
    content. Returns those files."""
    files = sorted(p for p in path.iterdir() if p.is_file())
    for file in files:
        if file.name.lower().endswith(PICKLE_SUFFIXES):
            raise ModelError(
                f"'{name}': '{file}' is named like a PyTorch pickle, and vidmem never unpickles (a pickle can run "
                "code). Convert it to .safetensors (safetensors.torch.save_file) or remove it from the folder, or "
                "download the model's safetensors release."
            )
    present = {file.name for file in files}
    for file in files:
        if file.name.endswith(INDEX_SUFFIX):
            _check_shard_index(file, name, present)
    weights = [p for p in files if p.name.lower().endswith(SAFETENSORS_SUFFIXES)]
    for file in weights:
        try:
            kind = sniff(file)
        except StorageError as error:
            raise ModelError(f"'{name}': {error}") from None
        if kind != "safetensors":
            raise ModelError(f"'{name}': '{file}' is a {kind.upper()} file, but a diffusers folder holds "
                             "safetensors; give a GGUF transformer as transformer_file, or load GGUF files with "
                             "Load Video Model Files.")
    return weights


def _check_shard_index(index: Path, name: str, present: set[str]) -> None:
    """A shard index names its shards by file name, and the libraries read every one they list: any name not
    ending in .safetensors goes to torch.load. Each must be a .safetensors file beside the index (then sniffed)."""
    weight_map = read_json_object(index, f"'{name}'").get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelError(f"'{name}': '{index}' is a shard index without a weight_map; the file is damaged: "
                         "re-download it with the model.")
    for shard in dict.fromkeys(weight_map.values()):
        if not isinstance(shard, str) or Path(shard).name != shard or not shard.endswith(".safetensors"):
            raise ModelError(f"'{name}': '{index}' lists the shard {shard!r}, which is not a .safetensors file of this "
                             "folder; diffusers would read it with torch.load, and vidmem never unpickles. Use the "
                             "model's safetensors release (its index lists only *.safetensors shards).")
        if shard not in present:
            raise ModelError(f"'{name}': '{index}' lists the shard '{shard}', which is missing from '{index.parent}'; "
                             "the download is incomplete: re-download the model's files.")


def _shapes(path: Path):
    """The shapes of a safetensors file's tensors, read from its header only (safetensors' own reader)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        return [handle.get_slice(name).get_shape() for name in handle.keys()]
