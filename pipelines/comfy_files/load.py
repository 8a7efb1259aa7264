"""load_model_files: a Wan pipeline from ComfyUI's model files, with no diffusers folder.

Every file is opened and checked before any model is built (content sniffing refuses pickles
and truncated files; tensor shapes say which model each file is and whether they belong
together), so a bad input costs nothing. Then each component is built without weights and given
the file's tensors in place: with `weights_on_disk` the weights stay in the files' mappings (the
page cache: the disk tier), otherwise they are copied into RAM once.

    files = ModelFiles(model="…/wan2.1_t2v_1.3B_fp16.safetensors",
                       text_encoder="…/umt5_xxl_fp8_e4m3fn_scaled.safetensors", vae="…/wan_2.1_vae.safetensors")
    loaded = load_model_files(files, LoadOptions(dtype="bf16", vae_dtype="fp32"))
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Sequence


from ..family import ModelError
from ..loader import DTYPES, LoadedPipeline, pinned_pipeline_class
from ..wan import WAN
from ..weight_check import check_against_files, check_against_ram, implied_weights, stored_elements
from ..weight_storage import DEFAULT_WEIGHTS, LOWERED, check_weight_dtype, held_format, hold, lowered_ram_bytes, matrices_mapped
from . import build, detect, match
from .catalogue import ModelEntry, shipped_catalogue
from .files import WeightFile, model_tensors, read_weight_file


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

    def lowers(self, file: WeightFile) -> bool:
        """Whether weight_dtype re-stores this file's matrices narrower (in RAM, not mapped)."""
        return held_format(file.storage, self.weight_dtype) != file.storage


def load_model_files(files: ModelFiles, options: LoadOptions = LoadOptions(),
                     catalogue: Sequence[ModelEntry] | None = None) -> LoadedPipeline:
    """Load a Wan pipeline from single files; ModelError naming the input and its fix when they do not fit."""
    opened = _open_all(files)
    entry = _match(opened, catalogue if catalogue is not None else shipped_catalogue())
    _check_sizes(entry, opened, options)
    components, storage, reports = {}, {}, {}
    for role, file in opened.items():
        name = _COMPONENT[role]
        components[name], reports[name], storage[name] = _load_component(entry, name, file, options)
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
    match.check_vae(entry, opened["vae"])
    match.check_text_encoder(entry, opened["text_encoder"])
    match.check_tokenizer(opened["text_encoder"])
    match.check_clip_vision(entry, opened.get("clip_vision"))
    return entry


def _maps_files(options: LoadOptions, components: dict) -> bool:
    """The disk tier holds only while the big matrices stay mapped from their files: weights
    that weight_dtype re-stored at load live in RAM, whatever weights_on_disk says."""
    return options.weights_on_disk and all(matrices_mapped(components[name]) for name in LOWERED if name in components)


def _check_sizes(entry: ModelEntry, opened: dict[str, WeightFile], options: LoadOptions) -> None:
    """Before any allocation: each matched config's weights (built on meta) against the file's
    real tensors, and when they are copied into RAM, the files' sizes against RAM and swap."""
    in_ram = []
    for role, file in opened.items():
        name = _COMPONENT[role]
        dtype = DTYPES[options.vae if name == "vae" else options.dtype]
        implied = implied_weights(entry.components[name], dtype)
        elements = stored_elements(t.shape for t in file.tensors.values())
        check_against_files(implied, elements, f"{role} '{file.name}'")
        if name in LOWERED and options.lowers(file):  # re-stored in RAM at the lower format
            in_ram.append((f"{role} '{file.name}' as {options.weight_dtype}", lowered_ram_bytes(options.weight_dtype, elements)))
        elif not options.weights_on_disk:
            in_ram.append((f"{role} '{file.name}'", file.path.stat().st_size))
    if in_ram:
        check_against_ram(in_ram, "holding these weights in RAM (weights_on_disk off, or weight_dtype lowering them)",
                          "Turn weights_on_disk on and leave weight_dtype at default: the weights then stay "
                          "mapped from the files and are read as needed.")


def _load_component(entry: ModelEntry, name: str, file: WeightFile, options: LoadOptions):
    module = build.build_empty(entry.components[name])
    tensors = model_tensors(file, module.state_dict().keys())
    weight_dtype = options.weight_dtype if name in LOWERED else DEFAULT_WEIGHTS
    dtype = DTYPES[options.vae if name == "vae" else options.dtype]
    report, matrices = hold(module, tensors, dtype, weight_dtype, not options.weights_on_disk, file.name)
    # The matrices' format for the lowered components (what the planner budgets); the VAE's and
    # the image encoder's convolutions and layers are cast to their dtype at load.
    held = matrices if name in LOWERED else report.formats[0].format
    return module, report, held


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
