"""A diffusers folder's transformer(s) and text encoder held in a chosen storage format.

Load Video Pipeline's `weight_dtype`: instead of diffusers' `from_pretrained` (every weight
copied into RAM at the compute dtype), each lowered component is built empty from its
config.json and given its .safetensors files' tensors as the single-file loader gives them
(`weight_storage.hold`): the matrices the format lowers are quantized at load (RAM), every other
tensor stays where the file's mapping holds it when it is already in its compute dtype. So a
folder holding its weights in the chosen format itself (bf16 weights at weight_dtype bf16 and
dtype bf16) is used in place: the disk tier. The VAE and the image encoder load as before.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Mapping, Sequence

import torch

from ..memory.units import DTYPES
from ..memory.storage import StorageError, StorageReport, fold_scaled_fp8, open_safetensors
from ..memory.storage.scaled import merged_header_records
from .configs.meta import ComponentConfig
from .family import ModelError
from .json_files import read_json_object
from .weight_check import (built_on_meta, check_against_files, check_against_ram, implied_weights, ram_beyond_mappings,
                           ram_need, stored_elements)
from .weight_storage import DEFAULT_WEIGHTS, LOWERED, hold, matrices_mapped

WEIGHT_FILES = ("diffusion_pytorch_model", "model")  # diffusers' and transformers' weight file names


@dataclass(frozen=True)
class StoredComponent:
    module: torch.nn.Module
    storage: str  # the StorageFormat name its matrices are held in
    report: StorageReport


def lowered_components(index: dict, replaced: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The components of a folder weight_dtype applies to (those model_index.json lists)."""
    return tuple(n for n in LOWERED if n not in replaced and isinstance(index.get(n), list) and index[n][0] is not None)


@dataclass(frozen=True)
class CheckedFolder:
    """The lowered components of a folder as `check_stored` found them fit to load: `build_stored` builds them."""

    folder: Path
    components: dict[str, ComponentConfig]
    tensors: dict[str, dict]  # component -> its files' tensors, memory-mapped
    dtype: torch.dtype
    weight_dtype: str


def check_stored(folder: Path, index: dict, configs: dict[str, dict], names: tuple[str, ...], dtype: torch.dtype,
                 weight_dtype: str, file_needs: Sequence[tuple[str, int]] = (), fixes: Sequence[str] = (),
                 dtypes: Mapping[str, torch.dtype] = MappingProxyType({})) -> CheckedFolder:
    """The components in `names` checked, before any allocation, to be loadable as `weight_dtype` says.

    Every file by content (a pickle or a truncated file is named), each config against the weights its
    files hold, and what the load makes in RAM against the machine's RAM and swap, in one check: one message
    lists all of it. Counted: what the lowered components take beyond their files' mappings
    (`ram_beyond_mappings`: a folder already in weight_dtype's format is used in place), every other
    component of `configs` in full at its dtype (`dtypes`, else `dtype`: diffusers copies it into RAM), and
    `file_needs`: (what, bytes) of the single files that replace components (what weight_dtype lowers or the
    load casts of them), each with the fix in `fixes` that avoids it. `configs` holds the folder's own
    components only: a component a file replaces is counted by its file, never by the folder's config.
    The loader checks first and builds (`build_stored`) after the other files are read.
    """
    tensors = {name: folder_tensors(folder / name, name) for name in names}
    components = {name: _component_config(folder, index, name, configs) for name in names}
    needs = []
    for name in names:
        implied = implied_weights(components[name], dtype)
        check_against_files(implied, stored_elements(t.shape for t in tensors[name].values()),
                            f"the .safetensors files in '{folder / name}'")
        module = built_on_meta(components[name], dtype)
        needs.append((f"{name} as {weight_dtype}",
                      ram_beyond_mappings(module, module_names(module, tensors[name]), dtype, weight_dtype)))
    for name in configs.keys() - set(names):
        config = _component_config(folder, index, name, configs)
        needs.append(ram_need(implied_weights(config, dtypes.get(name, dtype))))
    needs = [need for need in (*needs, *file_needs) if need[1]]  # nothing for what stays mapped
    lowers = weight_dtype != DEFAULT_WEIGHTS
    fix = "Pick a smaller weight_dtype (fp8_scaled, gguf_q4_k) or a smaller model" if lowers else \
        ("Load a smaller model or a lower dtype, or set weight_dtype (the transformer and text encoder are then held "
         "from their files' mappings, not copied into RAM, where already in its format)")
    what = f"model folder '{folder}'" + (f" with weight_dtype {weight_dtype}" if lowers else "")
    check_against_ram(needs, what, "".join((fix, *(f", or {clause}" for clause in fixes), ".")))
    return CheckedFolder(folder, components, tensors, dtype, weight_dtype)


def build_stored(checked: CheckedFolder) -> dict[str, StoredComponent]:
    """Each component `check_stored` checked, built from its config and its files, held as its weight_dtype says."""
    return {name: _stored(config, checked.tensors[name], checked.dtype, checked.weight_dtype, checked.folder / name)
            for name, config in checked.components.items()}


def folder_vae(folder: Path, vae_dtype: str) -> torch.nn.Module:
    """The folder's VAE read from its files at `vae_dtype` (Load Video Pipeline's vae_dtype: fp32 for
    quality, as Load Video Model Files offers), so an fp32 VAE holds the files' own values, not ones
    rounded to the compute dtype first. load_pipeline passes it to from_pretrained in place of the VAE
    it would read at the compute dtype: the files are read once."""
    library, class_name = read_json_object(folder / "model_index.json", "model folder")["vae"]  # checked at load
    vae_class = getattr(importlib.import_module(library), class_name)
    try:
        return vae_class.from_pretrained(folder / "vae", torch_dtype=DTYPES[vae_dtype], use_safetensors=True,
                                         local_files_only=True)
    except (OSError, ValueError, RuntimeError) as error:
        raise ModelError(f"could not read the VAE of '{folder}' at vae_dtype {vae_dtype} ({error}); re-download the "
                         "model, or set vae_dtype to 'same as dtype'.") from error


def on_disk(components: dict[str, StoredComponent]) -> bool:
    """The disk tier: every lowered component's matrices still lie in their files' mappings."""
    return bool(components) and all(matrices_mapped(c.module) for c in components.values())


def _stored(config: ComponentConfig, tensors: dict, dtype: torch.dtype, weight_dtype: str, path: Path) -> StoredComponent:
    from .comfy_files.build import build_empty

    module = build_empty(config)
    report, held = hold(module, module_names(module, tensors), dtype, weight_dtype, copy_to_ram=False, source=str(path))
    return StoredComponent(module, held, report)


def module_names(module: torch.nn.Module, tensors: dict) -> dict:
    """The file's tensors under `module`'s own names. transformers renames some checkpoints' keys as
    it loads them (Gemma 3, LTX-2's text encoder: the files' `language_model.model.*` is the module's
    `model.language_model.*`); read directly, the files need the same renames, which the model class
    declares. Files already named as the module are returned as they are."""
    expected = set(module.state_dict())
    if set(tensors) <= expected:
        return tensors
    rename = _transformers_renames(module, expected)
    return {rename(name): tensor for name, tensor in tensors.items()} if rename else tensors


def _transformers_renames(module: torch.nn.Module, expected: set[str]):
    """transformers' key renames for this model class (None where it declares none)."""
    try:  # transformers 5: the model's conversion mapping, applied as its loader applies it
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key
    except ImportError:  # transformers 4: a regex table on the class
        table = getattr(module, "_checkpoint_conversion_mapping", None) or {}
        return (lambda name: next((re.sub(p, r, name) for p, r in table.items() if re.search(p, name)), name)) if table else None
    try:
        renames = [t for t in get_model_conversion_mapping(module) if isinstance(t, WeightRenaming)]
    except Exception:  # noqa: BLE001 - not a transformers model: its names are the file's
        return None
    known = dict.fromkeys(expected)
    return lambda name: rename_source_key(name, renames, [], getattr(module, "base_model_prefix", None), known)[0]


def _component_config(folder: Path, index: dict, name: str, configs: dict[str, dict]) -> ComponentConfig:
    library, class_name = index[name]
    return ComponentConfig(name, library, class_name, configs[name], str(folder / name / "config.json"))


def folder_tensors(path: Path, name: str) -> dict:
    """The component's weights as its class loads them (the index's shards, or the single file),
    memory-mapped; fp8 scales folded as in Comfy-Org's files."""
    tensors, headers = {}, []
    try:
        for file in _weight_files(path, name):
            opened = open_safetensors(file)
            tensors.update(opened.tensors)
            headers.append(opened.metadata)
        # the shards' own quantization records too (a layer's request for full-precision matmul)
        return fold_scaled_fp8(tensors, merged_header_records(headers))
    except StorageError as error:
        raise ModelError(f"'{name}': {error}") from None


def _weight_files(path: Path, name: str) -> list[Path]:
    for stem in WEIGHT_FILES:
        index = path / f"{stem}.safetensors.index.json"
        if index.is_file():
            weight_map = read_json_object(index, f"'{name}'s shard index").get("weight_map")
            if not isinstance(weight_map, dict):
                raise ModelError(f"'{index}' has no weight_map; the file is damaged: re-download the model's '{name}' folder.")
            return [path / shard for shard in sorted(set(weight_map.values()))]
        single = path / f"{stem}.safetensors"
        if single.is_file():
            return [single]
    raise ModelError(f"'{name}': '{path}' has no {' or '.join(f'{s}.safetensors' for s in WEIGHT_FILES)} (nor a shard "
                     "index); weight_dtype reads the weights diffusers would: re-download the model's safetensors files.")
