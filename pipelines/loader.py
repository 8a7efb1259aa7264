"""Load a pipeline of any declared family from a diffusers-format folder (parts optionally from single files), safetensors only, offline.

Components are loaded to the CPU and stay there: a MemoryStrategy onloads them for one call.
The family comes from `model_index.json`, never from the folder's name. The folder is checked
before diffusers reads it (`folder_check`): weight files by content, configs as JSON, and the
weights each config implies against the files and the machine's RAM, so bad input is named with
its fix and an absurd size never reaches the allocator.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Mapping

import torch

from ..memory.device import backend_for
from ..memory.hostpool import HostPool
from ..memory.warm import WarmStore
from ..memory.units import DTYPES  # re-exported: nodes and comfy_files name dtypes through the loader
from .cogvideox import COGVIDEOX
from .family import FamilySpec, ModelError
from .hunyuan_video15 import HUNYUAN_VIDEO15
from .ltx2 import LTX2
from .json_files import read_json_object
from .wan import WAN
from .weight_storage import DEFAULT_WEIGHTS, check_weight_dtype, hold

if TYPE_CHECKING:  # imported lazily at run time: they import this module
    from .comfy_files.files import WeightFile
    from .configs.meta import ComponentConfig
    from .folder_storage import CheckedFolder

FAMILIES = (COGVIDEOX, WAN, HUNYUAN_VIDEO15, LTX2)


@dataclass(frozen=True)
class LoadedPipeline:
    """What flows between nodes as VIDMEM_PIPELINE: the pipeline, its family and where it came from."""

    pipe: object
    spec: FamilySpec
    class_name: str
    source: str
    dtype_name: str
    # What the planner reads (configs.load_model): the diffusers folder, or for single files the
    # shipped config name they were recognised as (also in `config_name`).
    folder: str = ""
    config_name: str = ""  # the shipped model config single files were matched to ("" for folders)
    transformer_file: str = ""  # the single file that replaced the folder's transformer ("" for none)
    vae_file: str = ""  # the single file that replaced the folder's VAE ("" for none)
    # component -> the single file that replaced it (text_encoder, text_encoder_2; empty for none)
    text_encoder_files: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    # "component.sub.module" paths the loader removed (a Gemma 3 file without its vision tower): not planned either
    removed: tuple[str, ...] = ()
    storage: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))  # component -> StorageFormat name
    on_disk: bool = False  # weights used in place from their files' mappings (the disk tier)
    vae_dtype_name: str = ""  # "" when the VAE runs in dtype_name
    storage_reports: Mapping[str, object] = field(default_factory=dict, compare=False, repr=False)  # component -> StorageReport
    loras: tuple = ()  # pipelines.lora LoraSpecs applied for each run (image_mode() keeps them: it copies every field)
    host_pool: HostPool = field(default_factory=HostPool, compare=False, repr=False)  # pinned homes, reused run over run
    _image_mode: dict = field(default_factory=dict, compare=False, repr=False)
    _backends: dict = field(default_factory=dict, compare=False, repr=False)
    _warm: dict = field(default_factory=dict, compare=False, repr=False)  # stage -> WarmStore, run over run

    def backend(self, device: torch.device):
        """One backend per device for the pipeline's life, so CUDA streams and their cached
        memory are reused run over run instead of a new side stream per call."""
        if device not in self._backends:
            self._backends[device] = backend_for(device)
        return self._backends[device]

    def warm_store(self, stage: str, backend) -> WarmStore | None:
        """Where `stage` ("sample", "decode") keeps its device copies between calls (memory/warm.py);
        None on a backend that does not copy (the CPU: weights already live where they run)."""
        if not backend.copies_to_device:
            return None
        if stage not in self._warm:
            self._warm[stage] = WarmStore(f"vidmem {stage} weights of {self.class_name}")
        return self._warm[stage]

    def release_warm(self) -> int:
        """Drop every stage's kept device copies (before training, or when asked); bytes dropped."""
        return sum(store.release_all() for store in self._warm.values())

    @property
    def warm_stores(self) -> dict:
        return dict(self._warm)

    @property
    def needs_image(self) -> bool:
        return self.class_name in self.spec.image_conditioned

    @property
    def accepts_image(self) -> bool:
        return self.needs_image or self.spec.image_variant(self.pipe) is not None

    def image_mode(self) -> "LoadedPipeline":
        """This pipeline as image-to-video: itself, or the family's I2V class over the same components."""
        if self.needs_image:
            return self
        if not self._image_mode:
            class_name = self.spec.image_variant(self.pipe)
            config = {k: self.pipe.config[k] for k in ("boundary_ratio", "expand_timesteps") if k in self.pipe.config}
            pipe = pinned_pipeline_class(class_name)(**self.pipe.components, **config)
            pipe.set_progress_bar_config(disable=True)
            self._image_mode["pipeline"] = replace(self, pipe=pipe, class_name=class_name, _image_mode={})
        return self._image_mode["pipeline"]

    def describe(self) -> str:
        dtypes = self.dtype_name + (f", VAE {self.vae_dtype_name}" if self.vae_dtype_name not in ("", self.dtype_name) else "")
        text = f"{self.class_name} ({dtypes}) from {self.source}"
        if self.storage:
            held = ", ".join(f"{name} {fmt}" for name, fmt in self.storage.items())
            where = "mapped from the files (disk tier)" if self.on_disk else "copied into RAM" if self.config_name else ""
            text += f"; weights stored as {held}" + (f", {where}" if where else "")
        return text


def family_for(class_name: str) -> FamilySpec:
    for spec in FAMILIES:
        if class_name in spec.pipeline_classes:
            return spec
    supported = ", ".join(c for spec in FAMILIES for c in spec.pipeline_classes)
    raise ModelError(f"model_index.json names '{class_name}', which vidmem does not run; supported: {supported}.")


def read_model_index(folder: Path) -> dict:
    """The folder's model_index.json, checked: a JSON object naming its pipeline class."""
    if folder.is_file():
        raise ModelError(
            f"model folder '{folder}' is a file, not a folder; give the diffusers-format folder that contains "
            f"model_index.json (e.g. '{folder.parent}' if this file is in it)."
        )
    if not folder.is_dir():
        raise ModelError(f"model folder '{folder}' does not exist; give a diffusers-format folder.")
    index = folder / "model_index.json"
    if not index.is_file():
        raise ModelError(
            f"model folder '{folder}' has no model_index.json; point it at the diffusers-format folder "
            "that contains model_index.json (e.g. models/diffusers/Wan2.1-T2V-1.3B-Diffusers)."
        )
    data = read_json_object(index, "model folder")
    if not isinstance(data.get("_class_name"), str):
        raise ModelError(
            f"'{index}' has no _class_name (the diffusers pipeline class, e.g. \"WanPipeline\"); the file is damaged "
            "or not a diffusers pipeline's: re-download the model."
        )
    return data


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ModelError(f"dtype='{name}' is not supported; use one of {', '.join(DTYPES)}.")
    return DTYPES[name]


@dataclass(frozen=True)
class CheckedTransformerFile:
    """A transformer_file read (mapped, nothing copied) and checked against the folder's transformer config."""

    path: Path
    file: WeightFile
    component: ComponentConfig  # the folder's transformer config, which the file fills


@dataclass(frozen=True)
class CheckedLoad:
    """What `load_pipeline` found before building anything: the folder's index and configs, every single file
    read from its header and checked, and the RAM the whole load makes checked against the machine, so
    `_build` only allocates."""

    folder: Path
    index: dict
    spec: FamilySpec
    dtype: str
    weight_dtype: str
    vae_dtype: str  # "" follows dtype
    configs: dict  # component -> its config.json
    transformer_input: str | Path | None  # the inputs as given (what LoadedPipeline records)
    transformer: CheckedTransformerFile | None
    carries_vae: bool  # an LTX-2 checkpoint given as transformer_file carries its video VAE
    vae_input: str | Path | None
    text_files: dict  # component -> the file replacing it
    text_read: dict[str, WeightFile]  # component -> its file, checked against the folder's config
    stored: CheckedFolder | None  # the folder's lowered components, checked (None: none to check)

    @property
    def vae_torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.vae_dtype or self.dtype)


def load_pipeline(folder: str | Path, dtype: str = "bf16", transformer_file: str | Path | None = None,
                  weight_dtype: str = DEFAULT_WEIGHTS, vae_file: str | Path | None = None,
                  vae_dtype: str = "", text_encoder_file: str | Path | None = None,
                  text_encoder_2_file: str | Path | None = None) -> LoadedPipeline:
    """Load offline with safetensors weights only; every component ends on the CPU.

    `transformer_file` replaces the folder's transformer with a single-file checkpoint (Wan's
    original, ComfyUI's or diffusers' layout; plain, fp8, fp8 scaled or GGUF), configured by the
    folder's transformer/config.json and used in place from the file (mapped).
    `weight_dtype` (a StorageFormat name) holds the transformer(s) and the text encoder in that
    format, lowered at load where it is narrower than the files (`folder_storage`); "default"
    loads them as diffusers does, at `dtype`.
    `vae_file` replaces the folder's VAE with a single VAE file (Wan's, or HunyuanVideo 1.5's as
    Comfy-Org ships it: `comfy_files.vae_file`), configured by the folder's vae/config.json.
    `vae_dtype` ("" follows `dtype`) is the VAE's precision wherever it comes from: the folder, the
    vae_file, or an LTX-2 checkpoint given as transformer_file.
    `text_encoder_file` / `text_encoder_2_file` replace the folder's text encoder(s) with a single file
    (Comfy-Org's umt5 / t5xxl / Qwen2.5-VL / Gemma 3 / ByT5 files: `comfy_files.text_encoder_file`),
    configured by the folder's config.json and checked against it before anything is built; the
    folder keeps supplying the tokenizers. `weight_dtype` lowers the first as it lowers the folder's.
    Everything is read and checked first (`_check_load`: files, configs, and the RAM the load makes,
    in one check), then built (`_build`).
    """
    return _build(_check_load(folder, dtype, transformer_file, weight_dtype, vae_file, vae_dtype,
                              {"text_encoder_file": text_encoder_file, "text_encoder_2_file": text_encoder_2_file}))


def _check_load(folder, dtype: str, transformer_file, weight_dtype: str, vae_file, vae_dtype: str,
                text_inputs: dict) -> CheckedLoad:
    """Every input read and checked, nothing allocated (files mapped, models only on meta)."""
    from .comfy_files import files as ltx2_files, text_encoder_file as text_file
    from .folder_check import check_model_folder  # imports configs, which import this module
    from .folder_storage import lowered_components

    check_weight_dtype(weight_dtype)
    if vae_dtype and vae_dtype not in DTYPES:
        raise ModelError(f"vae_dtype={vae_dtype!r} is not supported; use 'same as dtype' or one of {', '.join(DTYPES)}.")
    folder = Path(folder).expanduser()
    index = read_model_index(folder)
    spec = family_for(index["_class_name"])
    replaced = _replaced_by_file(spec, index, folder, transformer_file) if transformer_file else ()
    carries_vae = "vae" in replaced  # an LTX-2 checkpoint carries its video VAE
    if vae_file:
        replaced += _replaced_by_vae_file(spec, index, replaced)
    text_files = text_file.replaced_components(index, folder, text_inputs)
    replaced += tuple(text_files)
    stored_names = lowered_components(index, replaced) if weight_dtype != DEFAULT_WEIGHTS else ()
    used = {name: entry for name, entry in index.items() if name not in spec.unloaded}
    dtypes = {"vae": torch_dtype(vae_dtype)} if vae_dtype else {}  # the folder's VAE is read at vae_dtype
    configs = check_model_folder(folder, used, torch_dtype(dtype), replaced + stored_names, dtypes)
    if carries_vae:  # before anything is built, not when the VAE is
        ltx2_files.check_ltx2_vae_config(transformer_file, configs.get("vae"), folder)
    text_read = {name: text_file.read_text_encoder_file(path, name, index[name][1], configs.get(name), folder)
                 for name, path in text_files.items()}
    transformer = (_check_transformer_file(spec, index, folder, configs.get("transformer"), Path(transformer_file),
                                           dtype) if transformer_file else None)
    checked = CheckedLoad(folder, index, spec, dtype, weight_dtype, vae_dtype, configs, transformer_file, transformer,
                          carries_vae, vae_file, text_files, text_read, None)
    return replace(checked, stored=_check_ram(checked, stored_names, replaced, dtypes))


def _check_ram(checked: CheckedLoad, stored_names: tuple[str, ...], replaced: tuple[str, ...], dtypes: dict):
    """The one RAM check of the whole load (`folder_storage.check_stored`), always run, after every file is read:
    the folder's own components at their dtype, its lowered components, and what each single file makes in RAM
    (nothing for a file used in place from its mapping; a component a file replaces is counted by its file
    only), so one refusal lists all of it. Returns the checked lowered components (None when there are none)."""
    from .folder_storage import check_stored

    needs, fixes = _file_needs(checked)
    folder_own = {name: config for name, config in checked.configs.items() if name not in replaced}
    stored = check_stored(checked.folder, checked.index, folder_own, stored_names, torch_dtype(checked.dtype),
                          checked.weight_dtype, needs, fixes, dtypes)
    return stored if stored_names else None


# The fix that avoids each kind of single-file RAM (a file used in place costs none).
LOWERED_FILE_FIX = "a {what} already stored in weight_dtype's format (used in place, not lowered into RAM)"
CAST_FILE_FIX = "{dtype_input} equal to the precision the {what} is stored in (used in place, not cast into RAM)"
PADDED_TABLE_FIX = ("a text encoder file with the config's whole token table (llama.cpp's Gemma 3 GGUFs cut it to the "
                    "tokenizer's rows, which the load pads back)")


def _file_needs(checked: CheckedLoad) -> tuple[list[tuple[str, int]], list[str]]:
    """(what, bytes) of the RAM each single file takes beyond its mapping, and the fix of each kind counted."""
    needs = []  # (what, bytes, fix)
    if checked.transformer is not None:
        needs.append(_transformer_file_need(checked.transformer, checked.dtype, checked.weight_dtype))
    for name, file in checked.text_read.items():
        needs += _text_file_needs(checked, name, file)
    if checked.configs.get("vae") is not None and (checked.vae_input or checked.carries_vae):
        needs.append(_vae_file_need(checked))  # no config: refused in _check_load (LTX-2) or by the VAE's loader
    counted = [need for need in needs if need[1]]
    return [(what, nbytes) for what, nbytes, _fix in counted], list(dict.fromkeys(fix for *_need, fix in counted))


def _transformer_file_need(checked: CheckedTransformerFile, dtype: str, weight_dtype: str) -> tuple[str, int, str]:
    """What the transformer_file takes in RAM as `_build_transformer` holds it (0: used in place from its mapping):
    the matrices weight_dtype lowers, by the loader's own rule, and the tensors cast to their dtype."""
    from .weight_check import built_on_meta

    module = built_on_meta(checked.component, torch_dtype(dtype))
    return _held_file_need(module, checked.file.tensors, dtype, weight_dtype, f"transformer_file '{checked.path.name}'",
                           "transformer_file")


def _text_file_needs(checked: CheckedLoad, name: str, file: WeightFile) -> list[tuple[str, int, str]]:
    """What a text encoder file takes in RAM as `load_text_encoder_file` holds it, counted as the transformer_file
    is (what weight_dtype lowers, where it lowers this component, and the casts and dequantized copies), plus
    the padded token table it allocates for a cut Gemma 3 GGUF, at every weight_dtype."""
    from .comfy_files import text_encoder_file as text_file

    module, tensors, padded = text_file.held_on_meta(file, checked.index[name][1], checked.configs[name],
                                                     torch_dtype(checked.dtype))
    what = f"{text_file.ROLES[name]} '{file.name}'"
    needs = [_held_file_need(module, tensors, checked.dtype, text_file.held_weight_dtype(name, checked.weight_dtype),
                             what, "text encoder file")]
    if padded is not None:
        needs.append((f"{what}: its token table padded to {padded.shape[0]:,} rows at {checked.dtype}",
                      padded.numel() * padded.element_size(), PADDED_TABLE_FIX))
    return needs


def _held_file_need(module: torch.nn.Module, tensors, dtype: str, weight_dtype: str, what: str,
                    kind: str) -> tuple[str, int, str]:
    """(label, bytes, fix) of the RAM a single file's `tensors` take beyond their mapping when `module` (on meta) is
    filled from them at `weight_dtype` (`weight_check.ram_beyond_mappings`: the loaders' own rules)."""
    from .weight_check import ram_beyond_mappings
    from .weight_storage import lowered_names

    nbytes = ram_beyond_mappings(module, tensors, torch_dtype(dtype), weight_dtype)
    if weight_dtype != DEFAULT_WEIGHTS and lowered_names(module, tensors, weight_dtype, torch_dtype(dtype)):
        return f"{what} lowered to {weight_dtype}", nbytes, LOWERED_FILE_FIX.format(what=kind)
    return f"{what} cast to {dtype}", nbytes, CAST_FILE_FIX.format(dtype_input="dtype", what=kind)


def _vae_file_need(checked: CheckedLoad) -> tuple[str, int, str]:
    """What the VAE read from a file (vae_file, or the one an LTX-2 transformer_file carries) takes in RAM: its
    tensors not stored at vae_dtype are cast into it (a file at vae_dtype is used in place)."""
    from .comfy_files import files
    from .comfy_files.vae_file import read_vae_file
    from .configs.meta import ComponentConfig
    from .weight_check import built_on_meta, ram_beyond_mappings

    folder, config, dtype = checked.folder, checked.configs["vae"], checked.vae_dtype or checked.dtype
    component = ComponentConfig("vae", "diffusers", checked.index["vae"][1], config,
                                str(folder / "vae" / "config.json"))
    module = built_on_meta(component, torch_dtype(dtype))
    if checked.vae_input:
        file = read_vae_file(checked.vae_input, component.class_name, config, folder)
        tensors, what = files.model_tensors(file, module.state_dict().keys()), f"vae_file '{file.name}'"
    else:
        path = checked.transformer.path
        tensors, what = files.ltx2_part(path, "vae", "transformer_file"), f"the VAE of transformer_file '{path.name}'"
    nbytes = ram_beyond_mappings(module, tensors, torch_dtype(dtype), DEFAULT_WEIGHTS)
    return f"{what} cast to {dtype}", nbytes, CAST_FILE_FIX.format(dtype_input="vae_dtype", what=what)


def _build(checked: CheckedLoad) -> LoadedPipeline:
    """The pipeline `_check_load` found fit to load: each replaced or lowered component built and held, the rest
    read by diffusers."""
    built = _components(checked)
    folder, dtype = checked.folder, checked.dtype
    try:
        pipe = pinned_pipeline_class(checked.index["_class_name"]).from_pretrained(
            folder, torch_dtype=torch_dtype(dtype), use_safetensors=True, local_files_only=True, **built.overrides
        )
    except ModelError:
        raise
    except (OSError, ValueError, RuntimeError, KeyError) as error:  # files checked above: what is left is their contents
        raise ModelError(
            f"could not load the model in '{folder}' ({error}); its files do not fit together: re-download the "
            "diffusers-format model."
        ) from error
    pipe.set_progress_bar_config(disable=True)  # progress is reported through the host instead
    transformer_file, vae_file = checked.transformer_input, checked.vae_input
    files = (transformer_file, vae_file, *checked.text_files.values())
    source = " + ".join([str(folder)] + [Path(f).name for f in files if f])
    if checked.weight_dtype != DEFAULT_WEIGHTS:
        source += f" (weight_dtype {checked.weight_dtype})"
    vae_dtype = checked.vae_dtype
    return LoadedPipeline(pipe, checked.spec, checked.index["_class_name"], source, dtype, str(folder),
                          storage=MappingProxyType(built.storage),
                          on_disk=built.on_disk and not transformer_file and not checked.text_files,
                          storage_reports=MappingProxyType(built.reports),
                          transformer_file=str(transformer_file or ""), vae_file=str(vae_file or ""),
                          text_encoder_files=MappingProxyType({name: str(p) for name, p in checked.text_files.items()}),
                          removed=built.removed,
                          vae_dtype_name=vae_dtype if vae_dtype != dtype and "vae" in checked.index else "")


@dataclass(frozen=True)
class BuiltComponents:
    """The components `_build` gives diffusers' from_pretrained in place of reading them from the folder."""

    overrides: dict  # component -> module (None: never read)
    storage: dict  # component -> the format its weights are held in
    reports: dict  # component -> StorageReport
    removed: tuple[str, ...]  # "component.sub.module" paths removed (a Gemma 3 file without its vision tower)
    on_disk: bool  # the lowered folder components all still lie in their files' mappings


def _components(checked: CheckedLoad) -> BuiltComponents:
    """Each component that is not read by from_pretrained, built and held as `_check_load` checked it."""
    from .comfy_files import text_encoder_file as text_file
    from .folder_storage import build_stored, folder_vae, on_disk

    index, folder, dtype = checked.index, checked.folder, checked.dtype
    overrides, storage, reports = {}, {}, {}
    # never read (the family's call copes)
    overrides.update({name: None for name in checked.spec.unloaded if name in index})
    if checked.transformer is not None:
        overrides["transformer"], storage["transformer"], reports["transformer"] = _build_transformer(
            checked.transformer, dtype, checked.weight_dtype)
    if checked.carries_vae:
        from .comfy_files import files as ltx2_files

        overrides["vae"], storage["vae"], reports["vae"] = ltx2_files.load_ltx2_vae(
            checked.transformer_input, checked.configs.get("vae"), folder, checked.vae_torch_dtype)
    if checked.vae_input:
        from .comfy_files.vae_file import load_vae_file

        overrides["vae"], storage["vae"], reports["vae"] = load_vae_file(
            checked.vae_input, index["vae"][1], checked.configs.get("vae") or {}, folder, checked.vae_torch_dtype)
    elif checked.vae_dtype and checked.vae_dtype != dtype and not checked.carries_vae and "vae" in index:
        overrides["vae"] = folder_vae(folder, checked.vae_dtype)  # read once, at its own precision
    removed = ()
    for name, file in checked.text_read.items():
        overrides[name], storage[name], reports[name], parts = text_file.load_text_encoder_file(
            file, name, index[name][1], checked.configs[name], folder, torch_dtype(dtype), checked.weight_dtype)
        removed += tuple(f"{name}.{part}" for part in parts)
    stored = build_stored(checked.stored) if checked.stored else {}
    for name, component in stored.items():
        overrides[name], storage[name], reports[name] = component.module, component.storage, component.report
    return BuiltComponents(overrides, storage, reports, removed, on_disk(stored))


def _replaced_by_vae_file(spec: FamilySpec, index: dict, replaced: tuple[str, ...]) -> tuple[str, ...]:
    """("vae",) once the folder is known to take a VAE file (before any file is read)."""
    from .comfy_files.vae_file import check_family

    check_family(spec, (index.get("vae") or [None, None])[1])  # refuses LTX-2, whose checkpoint carries its VAE
    return ("vae",)


def check_transformer_file(folder: str | Path, transformer_file: str | Path, dtype: str) -> None:
    """The checks Load Video Pipeline makes of a `transformer_file` against its `folder` before reading any weight
    (headers only; ModelError naming transformer_file and the fix): the family takes one, a Wan 2.2 A14B folder's
    two experts refuse it, the file is the folder's transformer. The plan route runs them too, so the chart says
    what the load will."""
    folder = Path(folder)
    index = read_model_index(folder)
    spec = family_for(index["_class_name"])
    _replaced_by_file(spec, index, folder, transformer_file)
    entry = index.get("transformer")
    config_path = folder / "transformer" / "config.json"
    config = read_json_object(config_path, "'transformer'") if isinstance(entry, list) and entry[0] else None
    _check_transformer_file(spec, index, folder, config, Path(transformer_file), dtype)


def _replaced_by_file(spec: FamilySpec, index: dict, folder: Path, transformer_file: str | Path) -> tuple[str, ...]:
    """The folder components a single file replaces: the transformer, and LTX-2's VAE where the
    file has it (read from its header once the folder is known to take a transformer file)."""
    from .comfy_files import files as ltx2_files

    if spec.single_file_transformer is None:
        raise ModelError(
            f"transformer_file is not supported for {spec.name} (vidmem reads single-file transformers of Wan, LTX-2 and "
            "HunyuanVideo 1.5 only); "
            "leave transformer_file empty and use the diffusers folder's transformer."
        )
    if index.get("transformer_2", [None])[0] is not None:
        raise ModelError(
            "transformer_file cannot replace the two experts of a Wan 2.2 A14B folder; leave it empty."
        )
    return ltx2_files.ltx2_replaced_components(transformer_file, folder)


def _check_transformer_file(spec: FamilySpec, index: dict, folder: Path, config: dict | None, path: Path,
                            dtype: str) -> CheckedTransformerFile:
    """The transformer_file read from its header (any layout or storage format pipelines.comfy_files reads) and
    checked to be the folder's transformer (the family is checked to take one in `_replaced_by_file`)."""
    if config is None:
        raise ModelError(f"transformer_file needs the folder's transformer config, but '{folder / 'model_index.json'}' "
                         "lists no transformer; use a diffusers folder of the file's model.")
    from .comfy_files import detect, hy15
    from .comfy_files.files import read_weight_file
    from .configs.meta import ComponentConfig
    from .weight_check import check_against_files, implied_weights, stored_elements

    file = read_weight_file(path, "transformer_file", detect.TRANSFORMER)
    wanted = detect.transformer_config_fields(config)
    family, folder_family = detect.transformer_family(file.fields), detect.transformer_family(wanted)
    if family != folder_family:
        raise ModelError(f"transformer_file '{path.name}' is not the transformer of '{folder.name}': the file is "
                         f"{detect.a_family_transformer(file.fields)}, the folder a {folder_family} model. Pick a diffusers "
                         f"folder of the file's model (it supplies the text encoders, VAE and scheduler), or a {folder_family} "
                         "file for this folder.")
    problems = detect.differences(file.fields, wanted)
    if problems:
        raise ModelError(f"transformer_file '{path.name}' is not the transformer of '{folder.name}' ({'; '.join(problems)}); "
                         "pick the file of the same model, or leave transformer_file empty.")
    for claim in hy15.name_disagreements(path.name, config):  # the tensors cannot tell: the folder decides
        logging.getLogger("vidmem").warning("vidmem: transformer_file '%s': %s; the folder's config is used.", path.name, claim)
    component = ComponentConfig("transformer", "diffusers", spec.single_file_transformer, config,
                                str(folder / "transformer" / "config.json"))
    # Used in place from the file's mapping (the disk tier): the config against the file's real tensors.
    check_against_files(implied_weights(component, torch_dtype(dtype)), stored_elements(t.shape for t in file.tensors.values()),
                        f"transformer_file '{path.name}'")
    return CheckedTransformerFile(path, file, component)


def _build_transformer(checked: CheckedTransformerFile, dtype: str, weight_dtype: str):
    """The checked transformer_file's module: the folder's config filled from the file (fp8 scaled files are
    dequantized per layer, not misread), lowered to `weight_dtype` where it is narrower than the file."""
    from .comfy_files.build import build_empty

    module = build_empty(checked.component)
    report, held = hold(module, checked.file.tensors, torch_dtype(dtype), weight_dtype, copy_to_ram=False,
                        source=checked.path.name)
    return module, held, report


@lru_cache(maxsize=None)
def pinned_pipeline_class(class_name: str) -> type:
    """The diffusers pipeline class, with an execution device we set instead of infer, behind the
    family's `call_adapter` when it declares one.

    diffusers infers where to create latents from where weights sit; while weights stream in,
    none sit on the compute device, so the strategy states it (`vidmem_execution_device`).
    """
    import diffusers

    base = getattr(diffusers, class_name)
    adapter = family_for(class_name).call_adapter

    def _execution_device(self) -> torch.device:
        pinned = getattr(self, "vidmem_execution_device", None)
        return pinned if pinned is not None else base._execution_device.fget(self)

    bases = (adapter, base) if adapter is not None else (base,)
    return type(f"VidMem{class_name}", bases, {"_execution_device": property(_execution_device)})
