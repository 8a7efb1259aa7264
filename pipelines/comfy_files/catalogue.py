"""The models single files can be: shipped model configs (pipelines/configs) read as data.

An entry says which pipeline class runs the model, its components' classes and configs, and its
scheduler. The loader matches a file's architecture against the entries; it never names a model
in code. Tests pass their own catalogue (tiny models) in the same shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from pathlib import Path
from typing import Any, Iterable, Mapping

from ..configs import COMPONENTS_DIR, MODELS_DIR, model_names
from ..configs.meta import ComponentConfig
from ..family import ModelError
from ..json_files import read_json_object

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
    config_file: str = ""  # the model config file it was read from

    @property
    def planner_source(self) -> str:
        """What `configs.load_model` plans this model from: a shipped config's name, else its file
        (a config in ComfyUI's models/vidmem_configs is no shipped name)."""
        shipped = MODELS_DIR / f"{self.name}.json"
        return self.name if self.config_file and Path(self.config_file) == shipped else (self.config_file or self.name)

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
    configs = ((read_json_object(file, "model config"), str(file)) for file in files)
    return tuple(entry_from_json(data, source) for data, source in configs if data.get("pipeline") in SINGLE_FILE_PIPELINES)


def entry_from_json(data: dict, source: str = "a model config") -> ModelEntry:
    """A model config in the shipped schema as an entry (its "scheduler" is what sampling starts from)."""
    scheduler = data.get("scheduler")
    if not (isinstance(scheduler, dict) and {"class", "config"} <= scheduler.keys()):
        raise ModelError(f"{source} has no \"scheduler\" entry ({{\"class\": ..., \"config\": {{...}}}}), which a model "
                         "loaded from single files needs; add it as the shipped configs in pipelines/configs/models do.")
    return ModelEntry(
        name=data["name"], pipeline_class=data["pipeline"],
        components=MappingProxyType({key: read_component(key, value) for key, value in data["components"].items()}),
        scheduler_class=scheduler["class"], scheduler_config=MappingProxyType(dict(scheduler["config"])),
        pipeline_config=MappingProxyType(dict(data.get("pipeline_config", {}))),
        image_processor=MappingProxyType(dict(data.get("image_processor", {}))),
        config_file=source if source.endswith(".json") else "",
    )


def read_component(name: str, entry: dict) -> ComponentConfig:
    if "ref" in entry:
        shared = read_json_object(COMPONENTS_DIR / f"{entry['ref']}.json", f"component '{name}'")
        entry = dict(shared, config={**shared["config"], **entry.get("config", {})})
    return ComponentConfig(name, entry["library"], entry["class"], entry["config"], entry.get("source", ""))
