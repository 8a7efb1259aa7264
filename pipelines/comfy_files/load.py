"""load_model_files: a Wan pipeline from ComfyUI's model files, with no diffusers folder.

Every file is opened and checked before any weight is read into memory (content sniffing refuses
pickles and truncated files; tensor shapes say which model each file is and whether they belong
together; every component, built on meta, is checked name by name and shape by shape against its
file; the RAM the load takes is counted), so a bad input costs nothing. Then each component is
given the file's tensors in place: with `weights_on_disk` the weights stay in the files' mappings
(the page cache: the disk tier), otherwise they are copied into RAM once.

    files = ModelFiles(model="…/wan2.1_t2v_1.3B_fp16.safetensors",
                       text_encoder="…/umt5_xxl_fp8_e4m3fn_scaled.safetensors", vae="…/wan_2.1_vae.safetensors")
    loaded = load_model_files(files, LoadOptions(dtype="bf16", vae_dtype="fp32"))
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Sequence

import torch

from ...memory.storage import StorageError, StoredTensor
from ...memory.storage.apply import check_weights
from ..family import ModelError
from ..loader import DTYPES, LoadedPipeline, pinned_pipeline_class
from ..wan import WAN
from ..weight_check import check_against_files, check_against_ram, implied_weights, stored_elements
from ..weight_storage import (DEFAULT_WEIGHTS, LOWERED, check_weight_dtype, hold, lowered_names, lowered_ram_bytes,
                              matrices_mapped)
from . import build, detect, match
from .catalogue import ModelEntry, shipped_catalogue
from .files import WeightFile, model_tensors, read_weight_file

log = logging.getLogger("vidmem")


@dataclass(frozen=True)
class ModelFiles:
    """The files of one Wan pipeline. model_2: Wan 2.2 A14B's low-noise expert; clip_vision: Wan 2.1 I2V."""

    model: Path
    text_encoder: Path
    vae: Path
    model_2: Path | None = None
    clip_vision: Path | None = None


@dataclass(frozen=True)
class LoadOptions:
    dtype: str = "bf16"  # compute dtype of the transformer(s) and encoders
    vae_dtype: str = ""  # "" follows `dtype`; fp32 gives the VAE full precision
    weight_dtype: str = DEFAULT_WEIGHTS  # "default": as stored in the files; else a format to lower to
    weights_on_disk: bool = True  # True: weights stay mapped from the files; False: copied into RAM

    def __post_init__(self):
        for name in ("dtype", "vae_dtype"):
            value = getattr(self, name)
            if value not in DTYPES and not (name == "vae_dtype" and value == ""):
                raise ModelError(f"{name}='{value}' is not supported; use one of {', '.join(DTYPES)}.")
        check_weight_dtype(self.weight_dtype)

    @property
    def vae(self) -> str:
        return self.vae_dtype or self.dtype


def load_model_files(files: ModelFiles, options: LoadOptions = LoadOptions(),
                     catalogue: Sequence[ModelEntry] | None = None) -> LoadedPipeline:
    """Load a Wan pipeline from single files; ModelError naming the input and its fix when they do not fit."""
    opened = _open_all(files)
    entry = _match(opened, catalogue if catalogue is not None else shipped_catalogue())
    modules = {role: build.build_empty(entry.components[_COMPONENT[role]]) for role in opened}  # on meta
    tensors = {role: model_tensors(file, modules[role].state_dict().keys()) for role, file in opened.items()}
    _check_files(entry, opened, modules, tensors, options)
    components, storage, reports = {}, {}, {}
    for role, file in opened.items():
        name = _COMPONENT[role]
        components[name] = modules[role]
        reports[name], storage[name] = _fill_component(name, modules[role], tensors[role], file, options)
    pipe = _assemble(entry, components, opened["text_encoder"].tokenizer_model)
    return LoadedPipeline(
        pipe, WAN, entry.pipeline_class, source=" + ".join(f.name for f in opened.values()),
        dtype_name=options.dtype, folder=entry.planner_source, config_name=entry.name,
        storage=MappingProxyType(storage), on_disk=_maps_files(options, components), vae_dtype_name=options.vae,
        storage_reports=MappingProxyType(reports),
    )


_COMPONENT = {"model": "transformer", "model_2": "transformer_2", "text_encoder": "text_encoder", "vae": "vae",
              "clip_vision": "image_encoder"}
_KIND = {"model": detect.TRANSFORMER, "model_2": detect.TRANSFORMER, "text_encoder": detect.TEXT_ENCODER,
         "vae": detect.VAE, "clip_vision": detect.CLIP_VISION}


def _open_all(files: ModelFiles) -> dict[str, WeightFile]:
    paths = {role: getattr(files, role) for role in _COMPONENT}
    return {role: read_weight_file(path, role, _KIND[role]) for role, path in paths.items() if path is not None}


def _match(opened: dict[str, WeightFile], catalogue: Sequence[ModelEntry]) -> ModelEntry:
    match.check_experts(opened["model"], opened.get("model_2"))
    entry = match.choose_model(opened["model"], 1 + ("model_2" in opened), catalogue)
    for claim in match.name_disagreements(entry, opened["model"], opened.get("model_2")):
        log.warning("vidmem: %s.", claim)
    match.check_vae(entry, opened["vae"])
    match.check_text_encoder(entry, opened["text_encoder"])
    match.check_tokenizer(opened["text_encoder"])
    match.check_clip_vision(entry, opened.get("clip_vision"))
    return entry


def _maps_files(options: LoadOptions, components: dict) -> bool:
    """The disk tier holds only while the big matrices stay mapped from their files: weights
    that weight_dtype re-stored at load live in RAM, whatever weights_on_disk says."""
    return options.weights_on_disk and all(matrices_mapped(components[name]) for name in LOWERED if name in components)


def _check_files(entry: ModelEntry, opened: dict[str, WeightFile], modules: dict, tensors: dict,
                 options: LoadOptions) -> None:
    """Before any weight is read: each matched config's weights against the file's real tensors, then
    every name and shape against the component built on meta (`modules`), then what the load puts in
    RAM against RAM and swap. ModelError naming the input and its file."""
    for role, file in opened.items():
        name = _COMPONENT[role]
        implied = implied_weights(entry.components[name], _dtype(name, options))
        check_against_files(implied, stored_elements(t.shape for t in file.tensors.values()), f"{role} '{file.name}'")
    for role, file in opened.items():
        try:
            check_weights(modules[role], tensors[role], f"'{file.name}'")
        except StorageError as error:
            raise ModelError(f"{role}: {error}") from None
    in_ram = [need for role, file in opened.items() if (need := _ram_need(role, file, modules[role], tensors[role], options))]
    if in_ram:
        check_against_ram(in_ram, "holding these weights in RAM (weights_on_disk off, or weight_dtype lowering them)",
                          "Turn weights_on_disk on and leave weight_dtype at default: the weights then stay "
                          "mapped from the files and are read as needed.")


def _ram_need(role: str, file: WeightFile, module, tensors: dict, options: LoadOptions) -> tuple[str, int] | None:
    """(label, bytes) of what `file` takes in RAM once loaded, None when it stays mapped. weight_dtype
    re-stores tensor by tensor (`lowered_names`: a Q6_K matrix in a Q4_K_M file, an F16 one in a Q8_0
    file), so the count is per tensor, never from the file's majority format."""
    lowered = _lowered(_COMPONENT[role], module, tensors, options.weight_dtype, DTYPES[options.dtype])
    if not lowered:
        return None if options.weights_on_disk else (f"{role} '{file.name}'", file.path.stat().st_size)
    nbytes = lowered_ram_bytes(options.weight_dtype, stored_elements(tensors[n].shape for n in lowered))
    if not options.weights_on_disk:  # the rest is copied as the file holds it
        kept = tensors.keys() - set(lowered)
        nbytes += sum(_file_bytes(tensors[n]) for n in kept)
    return f"{role} '{file.name}' with {len(lowered)} tensors lowered to {options.weight_dtype}", nbytes


def _lowered(name: str, module, tensors: dict, weight_dtype: str, dtype: torch.dtype) -> list[str]:
    """The tensors weight_dtype re-stores in component `name` computing in `dtype` (none outside LOWERED, none at
    default)."""
    if name not in LOWERED or weight_dtype == DEFAULT_WEIGHTS:
        return []
    return lowered_names(module, tensors, weight_dtype, dtype)


def restores_weights(entry: ModelEntry, role: str, file: WeightFile, weight_dtype: str, dtype: str) -> bool:
    """Whether weight_dtype re-stores any of `file`'s tensors (into RAM: the disk tier no longer holds), as
    the load decides it, tensor by tensor, computing in `dtype`; the component is built on meta to know its
    matrices."""
    name = _COMPONENT[role]
    if name not in LOWERED or weight_dtype == DEFAULT_WEIGHTS:
        return False
    module = build.build_empty(entry.components[name])
    return bool(_lowered(name, module, model_tensors(file, module.state_dict().keys()), weight_dtype, DTYPES[dtype]))


def _file_bytes(tensor) -> int:
    return tensor.nbytes if isinstance(tensor, StoredTensor) else tensor.numel() * tensor.element_size()


def _dtype(name: str, options: LoadOptions):
    return DTYPES[options.vae if name == "vae" else options.dtype]


def _fill_component(name: str, module, tensors: dict, file: WeightFile, options: LoadOptions):
    """`module` (built on meta, checked against `tensors`) given its weights; (report, held format)."""
    weight_dtype = options.weight_dtype if name in LOWERED else DEFAULT_WEIGHTS
    report, matrices = hold(module, tensors, _dtype(name, options), weight_dtype, not options.weights_on_disk, file.name)
    # The matrices' format for the lowered components (what the planner budgets); the VAE's and
    # the image encoder's convolutions and layers are cast to their dtype at load.
    return report, matrices if name in LOWERED else report.formats[0].format


def _assemble(entry: ModelEntry, components: dict, spiece: bytes):
    import diffusers

    parts = dict(components)
    parts["tokenizer"] = build.tokenizer_from_spiece(spiece)
    parts["scheduler"] = getattr(diffusers, entry.scheduler_class)(**entry.scheduler_config)
    if "image_encoder" in parts:
        import transformers

        processor_cls = getattr(transformers, "CLIPImageProcessorPil", None) or transformers.CLIPImageProcessor
        parts["image_processor"] = processor_cls(**entry.image_processor)
    pipe = pinned_pipeline_class(entry.pipeline_class)(**parts, **entry.pipeline_config)
    pipe.set_progress_bar_config(disable=True)
    return pipe
