"""Real model configurations as data, and the loader that turns one into a plannable model.

`models/<name>.json` describes one pipeline: its diffusers class, the dtype it is run in, its
default size, and every component's class and config; `components/<name>.json` holds the text
encoders and VAEs models share, referenced as {"ref": name, "config": {overrides}}. Every file
says where its figures come from. A diffusers folder works too: its model_index.json and the
components' config.json files are read; no weights are touched.

    model = load_model("wan2.1-t2v-14b")
    model = load_model("~/models/Wan2.1-T2V-14B-Diffusers", dtype="bf16")
    model = load_model("ComfyUI/models/vidmem_configs/tiny-wan2.1-t2v.json")  # a config file in the shipped schema
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from pathlib import Path

import torch

from ...memory.accounting import OpCache
from ...memory.units import DTYPES
from ..family import ModelError
from ..json_files import read_json_object
from ..loader import family_for, read_model_index
from .meta import ComponentConfig, MetaModel, component_class

CONFIG_DIR = Path(__file__).parent
MODELS_DIR = CONFIG_DIR / "models"
COMPONENTS_DIR = CONFIG_DIR / "components"


def model_names() -> list[str]:
    return sorted(path.stem for path in MODELS_DIR.glob("*.json"))


def load_model(name_or_path: str, dtype: str | None = None, vae_dtype: str | None = None,
               removed: tuple[str, ...] = (), pipeline_class: str | None = None) -> MetaModel:
    """A shipped model by name, a model config file in the shipped schema, or a diffusers-format
    folder (configs only).

    `dtype` is the compute dtype (default: the model's own); `vae_dtype` the VAE's when it runs
    in another (e.g. fp32 for quality); `removed` the submodules the loader left out ("component.path":
    MetaModel.removed); `pipeline_class` the class that runs it when another of the family's than the
    folder's (a run with an image: LTX-2's and Wan 2.2 TI2V's one folder serves both). Models are shared
    per (name or folder, dtypes, removed, class) so their memoised traces are reused.
    """
    model = _load_model(name_or_path, dtype, vae_dtype, removed)
    if pipeline_class is None or pipeline_class == model.pipeline_class:
        return model
    return _run_by(model, pipeline_class)


# (id of the model, class) -> (the model, it as run by that class): kept beside the model for its traces.
_RUN_BY: dict[tuple[int, str], tuple[MetaModel, MetaModel]] = {}


def _run_by(model: MetaModel, pipeline_class: str) -> MetaModel:
    """`model` as `pipeline_class` of its own family runs it (what it conditions on, how it calls the
    transformer: configs/workloads.py reads the class), memoised, with traces of its own."""
    if family_for(pipeline_class).name != model.spec.name:
        raise ModelError(f"{pipeline_class} does not run {model.name} ({model.pipeline_class}'s family).")
    held = _RUN_BY.get((id(model), pipeline_class))
    if held is None or held[0] is not model:  # an id may be reused once its model has gone
        while len(_RUN_BY) >= 8:
            _RUN_BY.pop(next(iter(_RUN_BY)))
        held = (model, replace(model, pipeline_class=pipeline_class, _built={}, _weights={}, _traces={}, _streams={},
                               _cache=OpCache()))
        _RUN_BY[(id(model), pipeline_class)] = held
    return held[1]


def _load_model(name_or_path: str, dtype: str | None, vae_dtype: str | None, removed: tuple[str, ...]) -> MetaModel:
    path = Path(name_or_path).expanduser()
    vae = _dtype(vae_dtype) if vae_dtype else ""
    if path.name == "model_index.json" and path.is_file():  # the folder's index names the folder
        path, name_or_path = path.parent, str(path.parent)
    if (MODELS_DIR / f"{name_or_path}.json").is_file():
        return _shipped(name_or_path, dtype, vae, removed)
    if path.suffix == ".json" and path.is_file():  # a model config in the shipped schema kept elsewhere
        return _config_file(str(path.resolve()), dtype, path.stat().st_mtime_ns, vae, removed)
    if path.is_dir() or "/" in name_or_path or name_or_path.startswith("."):
        return _folder(str(path.resolve()), dtype, folder_stamp(path), vae, removed)
    raise ModelError(
        f"unknown model '{name_or_path}'; use one of {', '.join(model_names())}, "
        "or the path of a diffusers-format folder (with model_index.json)."
    )


def defaults(name: str) -> dict:
    """The size a shipped model is made for: {"width", "height", "frames"} (empty for folders)."""
    file = MODELS_DIR / f"{name}.json"
    return read_json_object(file, f"the shipped config of {name}").get("defaults", {}) if file.is_file() else {}


@lru_cache(maxsize=16)
def _shipped(name: str, dtype: str | None, vae_dtype: str = "", removed: tuple[str, ...] = ()) -> MetaModel:
    data = read_json_object(MODELS_DIR / f"{name}.json", f"the shipped config of {name}")
    return _from_json(data, dtype, vae_dtype, removed=removed)


@lru_cache(maxsize=8)
def _config_file(file: str, dtype: str | None, stamp: int, vae_dtype: str = "", removed: tuple[str, ...] = ()) -> MetaModel:
    """A model config outside the shipped set (ComfyUI's models/vidmem_configs: the tiny models the
    single-file loader matches); `stamp`: a changed file is read again."""
    return _from_json(read_json_object(Path(file), "model config"), dtype, vae_dtype, removed=removed, where=file)


CONFIG_KEYS = ("name", "pipeline", "dtype", "components")  # what every shipped-schema config states


def _from_json(data: dict, dtype: str | None, vae_dtype: str = "", disk_cache: bool = True,
               removed: tuple[str, ...] = (), where: str = "the model config") -> MetaModel:
    missing = [key for key in CONFIG_KEYS if key not in data]
    if missing or not isinstance(data["components"], dict):  # e.g. a workflow or a component's config.json
        raise ModelError(f"'{where}' is not a vidmem model config (it has no {', '.join(missing) or 'components object'}); "
                         "for a diffusers folder give the folder, for a built-in model its name (vidmem plan --list-models).")
    components = {name: _component(name, entry) for name, entry in data["components"].items()}
    spec = family_for(data["pipeline"])
    _check_parts(components, spec, f"'{where}'")
    dtype_name = _dtype(dtype or data["dtype"])
    return MetaModel(
        name=data["name"], pipeline_class=data["pipeline"], spec=spec, components=components,
        dtype_name=dtype_name, pipeline_config=data.get("pipeline_config", {}), source=data.get("source", ""),
        vae_dtype_name="" if vae_dtype == dtype_name else vae_dtype, disk_cache=disk_cache, removed=removed,
    )


def _component(name: str, entry: dict) -> ComponentConfig:
    if "ref" in entry:
        shared = read_json_object(COMPONENTS_DIR / f"{entry['ref']}.json", f"the shipped component {entry['ref']}")
        entry = dict(shared, config={**shared["config"], **entry.get("config", {})})
    return ComponentConfig(name, entry["library"], entry["class"], entry["config"], entry.get("source", ""))


def folder_stamp(folder: Path) -> int:
    """A number that changes when anything a plan reads in a diffusers folder does: model_index.json, and in each
    component folder its config.json and weight files (a config edited, weights swapped for fp8 ones under the same
    names). Names, sizes and mtimes only (stat calls, no reads)."""
    entries = []
    for path in (folder / "model_index.json", *sorted(folder.glob("*/config.json")),
                 *sorted(folder.glob("*/*.safetensors")), *sorted(folder.glob("*/*.index.json"))):
        try:
            stat = path.stat()
        except OSError:
            continue
        entries.append((str(path.relative_to(folder)), stat.st_size, stat.st_mtime_ns))
    return hash(tuple(entries))


@lru_cache(maxsize=8)
def _folder(folder: str, dtype: str | None, stamp: int, vae_dtype: str = "", removed: tuple[str, ...] = ()) -> MetaModel:
    return _from_folder(Path(folder), dtype, vae_dtype, removed)  # `stamp`: a changed folder is read again


def _from_folder(folder: Path, dtype: str | None, vae_dtype: str = "", removed: tuple[str, ...] = ()) -> MetaModel:
    index = read_model_index(folder)
    class_name = index["_class_name"]
    spec = family_for(class_name)
    components = {}
    for name, value in index.items():
        if not (isinstance(value, list) and len(value) == 2 and isinstance(value[0], str) and value[1]):
            continue  # absent components
        if name in spec.unloaded:
            continue  # never loaded (LTX-2's audio parts for video): never planned
        if not _is_module(*value):
            continue  # tokenizers, schedulers, processors: no weights
        config_file = folder / name / "config.json"
        config = read_json_object(config_file, f"{name}'s config (the planner reads each component's config.json)")
        components[name] = ComponentConfig(name, value[0], value[1], config, str(config_file))
    _check_parts(components, spec, f"model folder '{folder}'")
    pipeline_config = {k: v for k, v in index.items() if k in ("boundary_ratio", "expand_timesteps")}
    dtype_name = _dtype(dtype or "bf16")
    return MetaModel(
        name=folder.name, pipeline_class=class_name, spec=spec, components=components,
        dtype_name=dtype_name, pipeline_config=pipeline_config, source=str(folder),
        vae_dtype_name="" if vae_dtype == dtype_name else vae_dtype, removed=removed,
    )


def _check_parts(components: dict, spec, where: str) -> None:
    """A denoiser and a VAE, which every plan builds: ModelError naming the one missing (else a KeyError
    or IndexError deep in the planner)."""
    if not any(name in components for name in spec.denoisers):
        raise ModelError(f"{where} lists no denoiser ({' or '.join(spec.denoisers)} with a config.json): "
                         "give a complete diffusers-format pipeline folder.")
    if "vae" not in components:
        raise ModelError(f"{where} lists no vae (with a config.json): give a complete diffusers-format pipeline folder.")


def _is_module(library: str, class_name: str) -> bool:
    cls = component_class(library, class_name)
    return isinstance(cls, type) and issubclass(cls, torch.nn.Module)


def _dtype(name: str) -> str:
    if name not in DTYPES:
        raise ModelError(f"dtype='{name}' is not supported; use one of {', '.join(DTYPES)}.")
    return name
