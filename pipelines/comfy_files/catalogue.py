"""The models single files can be: shipped model configs (pipelines/configs) read as data.

An entry says which pipeline class runs the model, its components' classes and configs, and its
scheduler. The loader matches a file's architecture against the entries; it never names a model
in code. Tests pass their own catalogue (tiny models) in the same shape.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

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


def shipped_catalogue() -> tuple[ModelEntry, ...]:
    """Every shipped model config a Wan single file can be, in name order."""
    entries = (_shipped(name) for name in model_names())
    return tuple(entry for entry in entries if entry.pipeline_class in SINGLE_FILE_PIPELINES)


def _shipped(name: str) -> ModelEntry:
    data = json.loads((MODELS_DIR / f"{name}.json").read_text())
    scheduler = data.get("scheduler") or runtime_data.SCHEDULERS.get(name, runtime_data.SCHEDULERS["default"])
    return ModelEntry(
        name=data["name"], pipeline_class=data["pipeline"],
        components=MappingProxyType({key: read_component(key, value) for key, value in data["components"].items()}),
        scheduler_class=scheduler["class"], scheduler_config=MappingProxyType(dict(scheduler["config"])),
        pipeline_config=MappingProxyType(dict(data.get("pipeline_config", {}))),
    )


def read_component(name: str, entry: dict) -> ComponentConfig:
    if "ref" in entry:
        shared = json.loads((COMPONENTS_DIR / f"{entry['ref']}.json").read_text())
        extras = {k: v for k, v in runtime_data.COMPONENT_EXTRAS.get(entry["ref"], {}).items() if k not in shared["config"]}
        entry = dict(shared, config={**shared["config"], **extras, **entry.get("config", {})})
    return ComponentConfig(name, entry["library"], entry["class"], entry["config"], entry.get("source", ""))
