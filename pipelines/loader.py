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
from typing import Mapping

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
    """
    from .comfy_files import text_encoder_file as text_file
    from .folder_check import check_model_folder  # imports configs, which import this module
    from .folder_storage import build_stored, check_stored, folder_vae, lowered_components, on_disk

    check_weight_dtype(weight_dtype)
    if vae_dtype and vae_dtype not in DTYPES:
        raise ModelError(f"vae_dtype={vae_dtype!r} is not supported; use 'same as dtype' or one of {', '.join(DTYPES)}.")
    folder = Path(folder).expanduser()
    index = read_model_index(folder)
    class_name = index["_class_name"]
    spec = family_for(class_name)
    cls = pinned_pipeline_class(class_name)
    replaced = _replaced_by_file(spec, index, folder, transformer_file) if transformer_file else ()
    carries_vae = "vae" in replaced  # an LTX-2 checkpoint carries its video VAE
    if vae_file:
        replaced += _replaced_by_vae_file(spec, index, replaced)
    text_files = text_file.replaced_components(index, folder, {"text_encoder_file": text_encoder_file,
                                                               "text_encoder_2_file": text_encoder_2_file})
    replaced += tuple(text_files)
    stored_names = lowered_components(index, replaced) if weight_dtype != DEFAULT_WEIGHTS else ()
    used = {name: entry for name, entry in index.items() if name not in spec.unloaded}
    configs = check_model_folder(folder, used, torch_dtype(dtype), replaced + stored_names)  # before anything is allocated
    text_read = {name: text_file.read_text_encoder_file(path, name, index[name][1], configs.get(name), folder)
                 for name, path in text_files.items()}
    # check_stored checks the RAM the other components take at `dtype`; an encoder from a file lies in the
    # file's mapping (fp8 files: half the bytes), so it is left out of that sum rather than counted in full,
    # but what weight_dtype lowers of it into RAM is counted (in the same check, before anything is built).
    ram_configs = {name: config for name, config in configs.items() if name not in text_files}
    lowered_files = [need for name, file in text_read.items() if (need := text_file.lowered_ram_need(
        file, name, index[name][1], configs[name], weight_dtype))]
    checked = (check_stored(folder, index, ram_configs, stored_names, torch_dtype(dtype), weight_dtype, lowered_files)
               if stored_names or lowered_files else None)
    overrides, storage, reports = {}, {}, {}
    overrides.update({name: None for name in spec.unloaded if name in index})  # never read (the family's call copes)
    if transformer_file:
        overrides["transformer"], storage["transformer"], reports["transformer"] = _single_file_transformer(
            spec, index, folder, configs.get("transformer"), Path(transformer_file), dtype, weight_dtype)
    if carries_vae:
        from .comfy_files import files as ltx2_files

        overrides["vae"], storage["vae"], reports["vae"] = ltx2_files.load_ltx2_vae(
            transformer_file, configs.get("vae"), folder, torch_dtype(vae_dtype or dtype))
    if vae_file:
        from .comfy_files.vae_file import load_vae_file

        overrides["vae"], storage["vae"], reports["vae"] = load_vae_file(
            vae_file, index["vae"][1], configs.get("vae") or {}, folder, torch_dtype(vae_dtype or dtype))
    elif vae_dtype and vae_dtype != dtype and not carries_vae and "vae" in index:
        overrides["vae"] = folder_vae(folder, vae_dtype)  # read once, at its own precision
    removed = ()
    for name, file in text_read.items():
        overrides[name], storage[name], reports[name], parts = text_file.load_text_encoder_file(
            file, name, index[name][1], configs[name], folder, torch_dtype(dtype), weight_dtype)
        removed += tuple(f"{name}.{part}" for part in parts)
    stored = build_stored(checked) if checked else {}
    for name, component in stored.items():
        overrides[name], storage[name], reports[name] = component.module, component.storage, component.report
    try:
        pipe = cls.from_pretrained(
            folder, torch_dtype=torch_dtype(dtype), use_safetensors=True, local_files_only=True, **overrides
        )
    except ModelError:
        raise
    except (OSError, ValueError, RuntimeError) as error:  # files checked above: what is left is their contents
        raise ModelError(
            f"could not load the model in '{folder}' ({error}); its files do not fit together: re-download the "
            "diffusers-format model."
        ) from error
    pipe.set_progress_bar_config(disable=True)  # progress is reported through the host instead
    source = " + ".join([str(folder)] + [Path(f).name for f in (transformer_file, vae_file, *text_files.values()) if f])
    if weight_dtype != DEFAULT_WEIGHTS:
        source += f" (weight_dtype {weight_dtype})"
    return LoadedPipeline(pipe, spec, class_name, source, dtype, str(folder), storage=MappingProxyType(storage),
                          on_disk=on_disk(stored) and not transformer_file and not text_files,
                          storage_reports=MappingProxyType(reports),
                          transformer_file=str(transformer_file or ""), vae_file=str(vae_file or ""),
                          text_encoder_files=MappingProxyType({name: str(path) for name, path in text_files.items()}),
                          removed=removed,
                          vae_dtype_name=vae_dtype if vae_dtype != dtype and "vae" in index else "")


def _replaced_by_vae_file(spec: FamilySpec, index: dict, replaced: tuple[str, ...]) -> tuple[str, ...]:
    """("vae",) once the folder is known to take a VAE file (before any file is read)."""
    from .comfy_files.vae_file import check_family

    check_family(spec, (index.get("vae") or [None, None])[1])  # refuses LTX-2, whose checkpoint carries its VAE
    return ("vae",)


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


def _single_file_transformer(spec: FamilySpec, index: dict, folder: Path, config: dict | None, path: Path, dtype: str,
                             weight_dtype: str = DEFAULT_WEIGHTS):
    """The folder's transformer config filled from a single file (any layout or storage format
    pipelines.comfy_files reads: fp8 scaled files are dequantized per layer, not misread),
    lowered to `weight_dtype` where it is narrower than the file (the family is checked to take
    one in `_replaced_by_file`)."""
    if config is None:
        raise ModelError(f"transformer_file needs the folder's transformer config, but '{folder / 'model_index.json'}' "
                         "lists no transformer; use a diffusers folder of the file's model.")
    from .comfy_files import detect, hy15
    from .comfy_files.build import build_empty
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
    module = build_empty(component)
    report, held = hold(module, file.tensors, torch_dtype(dtype), weight_dtype, copy_to_ram=False, source=path.name)
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
