"""The plan route's view of a Load Video Model Files node: which model its files are, stored how.

The browser sends the loader's file widgets; only names the host's own model-file lists offer
are accepted (never a path). The files are opened the way the loader opens them (memory-mapped:
their headers, plus the few small records the loader reads to classify them: fp8 scale scalars,
ComfyUI's per-layer quant records, the embedded tokenizer) and matched to a model config without
building anything. Storage per component follows the loader: the files' own format, or the
weight_dtype choice where it lowers the matrices; the VAE and image encoder at their dtype.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from ..memory.plan.planner import PlanOptions
from ..memory.storage import FORMATS
from ..pipelines.comfy_files import shipped_catalogue
from ..pipelines.comfy_files import detect, match
from ..pipelines.comfy_files.files import read_weight_file
from ..pipelines.comfy_files.load import _COMPONENT, _KIND, restores_weights
from ..pipelines.comfy_files.text_encoder_file import ROLES, check_replaceable, read_text_encoder_file, removed_parts
from ..pipelines.configs import folder_stamp, load_model
from ..pipelines.weight_storage import DEFAULT_WEIGHTS, LOWERED, WEIGHT_DTYPES, held_format
from . import host
from .loader import FOLDER_TEXT_ENCODER, FOLDER_TRANSFORMER, SAME, vae_dtype_name
from .model_folders import MODEL_FILE_FOLDERS

FILES_LOADER = "VidMemLoadModelFiles"
FILE_ROLES = ("model", "text_encoder", "vae", "model_2", "clip_vision")  # the first three are required
NONE = "(none)"
LISTED_AS = {"model_2": "model"}  # the low-noise expert is picked from the model list
PREFIX = "loader_"  # the query names the loader's widgets loader_<widget>: the Strategy has a text_encoder too


class FilesProblem(ValueError):
    """A file widget the plan cannot use; `name` is the widget."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name


@dataclass(frozen=True)
class FilesRequest:
    """The loader's widgets, with each file's (name, size, mtime): a changed file is a new request."""

    files: tuple[tuple[str, str, int, int], ...]  # (role, name, size, mtime_ns)
    vae_dtype: str  # "" follows dtype
    weight_dtype: str
    weights_on_disk: bool


@dataclass(frozen=True)
class RecognisedFiles:
    config_name: str
    options: PlanOptions
    planner_model: object


def files_request(query, vae_dtypes: list[str]) -> FilesRequest:
    """A FilesRequest from the query; FilesProblem naming the widget when a name is not listed."""
    files = []
    for role in FILE_ROLES:
        name = query.get(PREFIX + role, NONE if role in ("model_2", "clip_vision") else "")
        if name == NONE and role in ("model_2", "clip_vision"):
            continue
        if name not in host.model_file_names(LISTED_AS.get(role, role)):
            folders = " or ".join(f"models/{folder}" for folder in MODEL_FILE_FOLDERS[LISTED_AS.get(role, role)])
            raise FilesProblem(role, f"{role}={name!r} is not among ComfyUI's files in {folders}; pick a file the "
                                     "Load Video Model Files node offers (put the file there and refresh first).")
        stat = listed_stat(lambda: host.resolve_model_file(LISTED_AS.get(role, role), name, role), role, name)
        files.append((role, name, stat.st_size, stat.st_mtime_ns))
    vae_dtype = vae_dtype_request(query, PREFIX + "vae_dtype", vae_dtypes)
    weight_dtype = query.get(PREFIX + "weight_dtype", DEFAULT_WEIGHTS)
    if weight_dtype != DEFAULT_WEIGHTS and weight_dtype not in FORMATS:
        raise FilesProblem("weight_dtype",
                           f"weight_dtype={weight_dtype!r} must be default or one of {', '.join(FORMATS)}.")
    on_disk = query.get(PREFIX + "weights_on_disk", "true").lower()
    if on_disk not in ("true", "false"):
        raise FilesProblem("weights_on_disk", f"weights_on_disk={on_disk!r} must be true or false.")
    return FilesRequest(tuple(files), vae_dtype, weight_dtype, on_disk == "true")


def listed_stat(resolve, widget: str, name: str) -> os.stat_result:
    """The stat of a file the host listed a moment ago; FilesProblem naming the widget when it has gone
    since (deleted, moved, unreadable): a bad request, not a server error."""
    try:
        return resolve().stat()
    except OSError as error:
        raise FilesProblem(widget, f"{widget}={name!r} is listed but cannot be read now ({error.strerror or error}); "
                                   "refresh the node's file list and pick it again.") from None


def vae_dtype_request(query, key: str, vae_dtypes: list[str]) -> str:
    """Either loader's vae_dtype widget (query parameter `key`) as configs.load_model takes it
    ("" follows dtype); FilesProblem when it is not one of the widget's choices."""
    value = query.get(key, SAME)
    if value != SAME and value not in vae_dtypes:
        raise FilesProblem("vae_dtype", f"vae_dtype={value!r} must be '{SAME}' or one of {', '.join(vae_dtypes)}.")
    return vae_dtype_name(value)


@lru_cache(maxsize=16)
def recognise(request: FilesRequest, dtype: str) -> RecognisedFiles:
    """The config the files are and their storage (ModelError naming the input when they do not fit)."""
    opened = {role: read_weight_file(host.resolve_model_file(LISTED_AS.get(role, role), name, role), role, _KIND[role])
              for role, name, _size, _mtime in request.files}
    configs = host.model_config_dirs()
    catalogue = shipped_catalogue(configs)
    match.check_experts(opened["model"], opened.get("model_2"))
    entry = match.choose_model(opened["model"], 1 + ("model_2" in opened), catalogue)
    match.check_vae(entry, opened["vae"])
    match.check_text_encoder(entry, opened["text_encoder"])
    match.check_clip_vision(entry, opened.get("clip_vision"))
    vae = request.vae_dtype or dtype
    model = load_model(entry.planner_source, dtype, vae)
    storage, restored = {}, False
    for role, file in opened.items():
        component = _COMPONENT[role]
        if component in LOWERED:
            held = held_format(file.storage, request.weight_dtype)
        else:
            held = vae if component == "vae" else dtype
        restored |= restores_weights(entry, role, file, request.weight_dtype, dtype)  # per tensor, as the load decides
        if held in FORMATS and component in model.layout.all:
            storage[component] = held
    # Matrices weight_dtype re-stored at load live in RAM: the disk tier holds only while they stay mapped.
    on_disk = request.weights_on_disk and not restored
    return RecognisedFiles(entry.name, PlanOptions(storage=storage, on_disk=on_disk), model)


def transformer_file_request(query) -> tuple[str, int, int] | None:
    """Load Video Pipeline's transformer_file as (name, size, mtime_ns); None for the folder's own."""
    name = query.get("transformer_file", FOLDER_TRANSFORMER)
    if name == FOLDER_TRANSFORMER:
        return None
    if name not in host.single_file_transformer_names():
        raise FilesProblem("transformer_file", f"transformer_file={name!r} is not in the host's list; pick one the "
                                               "Load Video Pipeline node offers, or (from the folder).")
    stat = listed_stat(lambda: host.resolve_single_file(name), "transformer_file", name)
    return name, stat.st_size, stat.st_mtime_ns


def text_encoder_files_request(query) -> tuple[tuple[str, str, int, int], ...]:
    """Load Video Pipeline's text-encoder files as (component, name, size, mtime_ns), the folder's own left out;
    FilesProblem naming the widget when a name is not in the host's list."""
    chosen = []
    for component, widget in ROLES.items():
        name = query.get(widget, FOLDER_TEXT_ENCODER)
        if name == FOLDER_TEXT_ENCODER:
            continue
        if name not in host.model_file_names("text_encoder"):
            raise FilesProblem(widget, f"{widget}={name!r} is not in the host's text encoder list; pick one the "
                                       f"Load Video Pipeline node offers, or {FOLDER_TEXT_ENCODER}.")
        stat = listed_stat(lambda: host.resolve_model_file("text_encoder", name, widget), widget, name)
        chosen.append((component, name, stat.st_size, stat.st_mtime_ns))
    return tuple(chosen)


def weight_dtype_request(query) -> str:
    """Load Video Pipeline's weight_dtype (its last widget); FilesProblem when it is not a choice."""
    value = query.get("weight_dtype", DEFAULT_WEIGHTS)
    if value not in WEIGHT_DTYPES:
        raise FilesProblem("weight_dtype",
                           f"weight_dtype={value!r} must be {DEFAULT_WEIGHTS} or one of {', '.join(FORMATS)}.")
    return value


def folder_options(model: str, weight_dtype: str, transformer_file: tuple[str, int, int] | None,
                   text_encoder_files: tuple[tuple[str, str, int, int], ...] = (), dtype: str = "bf16") -> PlanOptions:
    """How Load Video Pipeline holds a folder's weights, as the loader will (`folder_storage`):
    at the compute dtype by default; with weight_dtype, each lowered component in the format its
    files' matrices are held in, memory-mapped (the disk tier) when nothing was re-stored. A
    single file replacing a component (transformer_file, the text encoder files) plans in the
    file's storage, as the loader holds it, once the loader's own checks of it pass (ModelError naming it)."""
    if transformer_file:
        _check_transformer_file(*_folder_and_stamp(model), transformer_file, dtype)
    storage = dict(transformer_file_options(transformer_file, weight_dtype).storage) if transformer_file else {}
    if not text_encoder_files and weight_dtype == DEFAULT_WEIGHTS:
        return PlanOptions(storage=storage)
    folder, stamp = _folder_and_stamp(model)
    for component, *file in text_encoder_files:
        stored, _ = text_encoder_file_plan(folder, stamp, component, tuple(file))
        held = held_format(stored, weight_dtype if component in LOWERED else DEFAULT_WEIGHTS)
        if held in FORMATS:
            storage[component] = held
    if weight_dtype == DEFAULT_WEIGHTS:
        return PlanOptions(storage=storage)
    replaced = ("transformer",) * bool(transformer_file) + tuple(component for component, *_ in text_encoder_files)
    held = _folder_storage(str(folder), stamp, weight_dtype, replaced)
    storage.update({name: fmt for name, (_, fmt) in held.items()})
    on_disk = not replaced and all(stored == fmt for stored, fmt in held.values())
    return PlanOptions(storage=storage, on_disk=on_disk)


@lru_cache(maxsize=16)
def _folder_storage(folder: str, stamp: int, weight_dtype: str,
                    replaced: tuple[str, ...]) -> dict[str, tuple[str, str]]:
    """component -> (its files' matrix format, the format the loader holds it in); `stamp`: a
    changed model_index.json is read again. Only headers are read (the files are mapped)."""
    from ..pipelines.folder_storage import folder_tensors, lowered_components
    from ..pipelines.loader import read_model_index

    index = read_model_index(Path(folder))
    held = {}
    for name in lowered_components(index, replaced):
        stored = detect.storage_name(folder_tensors(Path(folder) / name, name))
        held[name] = (stored, held_format(stored, weight_dtype))
    return held


def folder_removed(model: str, text_encoder_files: tuple[tuple[str, str, int, int], ...]) -> tuple[str, ...]:
    """The parts of the folder's text encoders Load Video Pipeline removes for these files ("component.path",
    as LoadedPipeline.removed: a Gemma 3 file without its vision tower), for configs.load_model(removed=...)."""
    if not text_encoder_files:
        return ()
    folder, stamp = _folder_and_stamp(model)
    return tuple(f"{component}.{part}" for component, *file in text_encoder_files
                 for part in text_encoder_file_plan(folder, stamp, component, tuple(file))[1])


def _folder_and_stamp(model: str) -> tuple[str, int]:
    """The folder of `model` and its stamp (`folder_stamp`): a changed folder is read again."""
    folder = host.resolve_model_folder(model, "")
    return str(folder), folder_stamp(folder)


def listed_folder_stamp(model: str) -> int:
    """The stamp of the folder `model` names in models/diffusers; 0 where it is not there (planning it names that)."""
    try:
        return _folder_and_stamp(model)[1]
    except OSError:  # FileNotFoundError naming the folders searched: the plan's own error says it again
        return 0




@lru_cache(maxsize=16)
def text_encoder_file_plan(folder: str, stamp: int, component: str,
                           file: tuple[str, int, int]) -> tuple[str, tuple[str, ...]]:
    """(the storage format of the matrices of a text-encoder file replacing `folder`'s `component`, the parts of
    the component the loader removes for it: text_encoder_file.removed_parts). The file is checked against the
    folder by the loader's own checks, with its messages (a file the loader refuses gets no plan); only headers
    are read (and the few small records classifying it needs). `stamp`: model_index.json's mtime."""
    from ..pipelines.json_files import read_json_object
    from ..pipelines.loader import read_model_index

    folder_path, widget = Path(folder), ROLES[component]
    class_name = check_replaceable(read_model_index(folder_path), component, folder_path)
    config_path = folder_path / component / "config.json"
    config = read_json_object(config_path, widget) if config_path.is_file() else None
    path = host.resolve_model_file("text_encoder", file[0], widget)
    opened = read_text_encoder_file(path, component, class_name, config, folder_path)
    return opened.storage, removed_parts(opened, class_name, config)


@lru_cache(maxsize=16)
def _check_transformer_file(folder: str, stamp: int, file: tuple[str, int, int], dtype: str) -> None:
    """The loader's checks of a transformer_file against its folder (headers only); a passing one is remembered
    for this folder and file as they are (`stamp`, the file's size and mtime)."""
    from ..pipelines.loader import check_transformer_file

    check_transformer_file(folder, host.resolve_single_file(file[0]), dtype)


@lru_cache(maxsize=16)
def transformer_file_options(file: tuple[str, int, int], weight_dtype: str = DEFAULT_WEIGHTS) -> PlanOptions:
    """A folder's transformer replaced by a single file: planned in the file's storage (lowered by
    weight_dtype where narrower), copied to RAM (the folder loader does not keep weights on disk)."""
    opened = read_weight_file(host.resolve_single_file(file[0]), "transformer_file", detect.TRANSFORMER)
    held = held_format(opened.storage, weight_dtype)
    return PlanOptions(storage={"transformer": held} if held in FORMATS else {})
