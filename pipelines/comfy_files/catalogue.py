"""The models single files can be: shipped model configs (pipelines/configs) read as data.

An entry says which pipeline class runs the model, its components' classes and configs, and its
scheduler. The loader matches a file's architecture against the entries; it never names a model
in code. Tests pass their own catalogue (tiny models) in the same shape.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from types import MappingProxyType
from pathlib import Path
from typing import Any, Iterable, Mapping

from ..configs import COMPONENTS_DIR, MODELS_DIR, model_names
from ..configs.meta import ComponentConfig
from . import runtime_data

SINGLE_FILE_PIPELINES = ("WanPipeline", "WanImageToVideoPipeline")


@dataclass(frozen=True)
class ModelEntry:
    name: str
    pipeline_class: str
    components: Mapping[str, ComponentConfig]
    scheduler_class: str
    scheduler_config: Mapping[str, Any]
    pipeline_config: Mapping[str, Any] = field(default_factory=dict)
    image_processor: Mapping[str, Any] = field(default_factory=dict)  # CLIPImageProcessor kwargs (I2V 2.1)

    @property
    def experts(self) -> int:
        return sum(name in self.components for name in ("transformer", "transformer_2"))

    def config(self, component: str) -> Mapping[str, Any]:
        return self.components[component].config


def shipped_catalogue(extra_dirs: Iterable[str | Path] = ()) -> tuple[ModelEntry, ...]:
    """Every shipped model config a Wan single file can be (name order), then those in `extra_dirs`.

    Extra configs are model files in the shipped schema (components inline or by "ref" to a
    shipped component), e.g. the tiny models tests and the live host write (`pipelines.tiny`).
    """
    files = [MODELS_DIR / f"{name}.json" for name in model_names()]
    for folder in extra_dirs:
        files += sorted(Path(folder).glob("*.json"))
    entries = (entry_from_json(json.loads(file.read_text())) for file in files)
    return tuple(entry for entry in entries if entry.pipeline_class in SINGLE_FILE_PIPELINES)


def entry_from_json(data: dict) -> ModelEntry:
    """A model config in the shipped schema as an entry; the scheduler falls back to runtime_data."""
    name = data["name"]
    scheduler = data.get("scheduler") or runtime_data.SCHEDULERS.get(name, runtime_data.SCHEDULERS["default"])
    return ModelEntry(
        name=name, pipeline_class=data["pipeline"],
        components=MappingProxyType({key: read_component(key, value) for key, value in data["components"].items()}),
        scheduler_class=scheduler["class"], scheduler_config=MappingProxyType(dict(scheduler["config"])),
        pipeline_config=MappingProxyType(dict(data.get("pipeline_config", {}))),
        image_processor=MappingProxyType(dict(data.get("image_processor", {}))),
    )


def read_component(name: str, entry: dict) -> ComponentConfig:
    if "ref" in entry:
        shared = json.loads((COMPONENTS_DIR / f"{entry['ref']}.json").read_text())
        extras = {k: v for k, v in runtime_data.COMPONENT_EXTRAS.get(entry["ref"], {}).items() if k not in shared["config"]}
        entry = dict(shared, config={**shared["config"], **extras, **entry.get("config", {})})
    return ComponentConfig(name, entry["library"], entry["class"], entry["config"], entry.get("source", ""))
