"""Drive a node as ComfyUI 0.8.0 does: validate the prompt's literal inputs, then call the function.

`comfy_refusal` mirrors `execution.validate_inputs` for V1 nodes (ComfyUI's execution.py,
lines 750-975 in 0.8.0) for inputs given as values, not links:
- a required input that is missing is refused;
- INT/FLOAT/STRING/BOOLEAN values are converted with int()/float()/str()/bool(); a value that
  does not convert is refused (so NaN never reaches an INT input, but NaN passes every FLOAT
  min/max test, since every comparison with NaN is false);
- for inputs NOT named by VALIDATE_INPUTS (all of them when it takes **kwargs), values below
  "min" or above "max" and combo values not in the list are refused; "step" is never checked;
- VALIDATE_INPUTS is called with the inputs it names; any answer but True is a refusal.
Linked inputs (custom types such as VIDMEM_PIPELINE, LATENT, IMAGE) are type-checked by
ComfyUI against the link's declared output type only, so a test passes them straight through.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from vidmem.memory import StrategyError
from vidmem.memory.lora import LoraError
from vidmem.memory.plan.planner import PlanError
from vidmem.memory.storage.errors import StorageError
from vidmem.pipelines.family import ModelError
from vidmem.training.errors import TrainingError

PACK_ERRORS = (ModelError, StrategyError, StorageError, LoraError, PlanError, TrainingError)
LITERAL_TYPES = {"INT": int, "FLOAT": float, "STRING": str, "BOOLEAN": bool}


def declared_inputs(node_cls) -> dict[str, tuple[Any, dict, str]]:
    """name -> (type, options, 'required'|'optional')."""
    spec = node_cls.INPUT_TYPES()
    found = {}
    for category in ("required", "optional"):
        for name, entry in spec.get(category, {}).items():
            found[name] = (entry[0], entry[1] if len(entry) > 1 else {}, category)
    return found


def comfy_refusal(node_cls, inputs: dict) -> tuple[list[str], dict]:
    """(ComfyUI's reasons to refuse the prompt, the inputs as the node would receive them)."""
    declared = declared_inputs(node_cls)
    validate = getattr(node_cls, "VALIDATE_INPUTS", None)
    named, takes_kwargs = [], False
    if validate is not None:
        argspec = inspect.getfullargspec(validate)
        named, takes_kwargs = [a for a in argspec.args if a != "cls"], argspec.varkw is not None
    reasons, converted = [], {}
    for name, (kind, options, category) in declared.items():
        if name not in inputs:
            if category == "required":
                reasons.append(f"Required input is missing: {name}")
            continue
        value = inputs[name]
        if isinstance(kind, str) and kind in LITERAL_TYPES:
            try:
                value = LITERAL_TYPES[kind](value)
            except Exception as error:  # noqa: BLE001 - ComfyUI catches everything here
                reasons.append(f"Failed to convert an input value to a {kind} value: {name}, {value}, {error}")
                continue
        converted[name] = value
        if name in named or takes_kwargs:
            continue
        if "min" in options and value < options["min"]:
            reasons.append(f"Value {value} smaller than min of {options['min']}: {name}")
        elif "max" in options and value > options["max"]:
            reasons.append(f"Value {value} bigger than max of {options['max']}: {name}")
        elif isinstance(kind, list) and value not in kind:
            reasons.append(f"Value not in list: {name}: '{value}' not in {kind}")
    if validate is not None and not reasons:
        given = converted if takes_kwargs else {k: converted[k] for k in named if k in converted}
        answer = validate(**given)
        if answer is not True:
            reasons.append(f"Custom validation failed for node: {', '.join(given)} - {answer}")
    return reasons, converted


@dataclass(frozen=True)
class Case:
    """One bad input: which node, what inputs, and what the refusal must say (a regex)."""

    id: str
    node: str
    inputs: Callable[[Any], dict]  # (fixtures) -> inputs; fixtures give pipelines, latents, files
    message: str
    validation_only: bool = False  # expensive if accepted: must be refused by validation, never run
    setup: Callable[[Any], None] | None = None
    marks: tuple = field(default_factory=tuple)


def tree(root: Path) -> set[str]:
    """Every file and folder under `root`, relative (what a case must not add to)."""
    return {str(p.relative_to(root)) for p in root.rglob("*")} if root.exists() else set()


class Fixtures:
    """What cases build their inputs from: tiny pipelines, Strategy node outputs, sampled latents,
    bad files under `root` (the only folder a case may write to is none: `root` is watched)."""

    def __init__(self, tiny_loaded, root: Path, monkeypatch) -> None:
        self.tiny_loaded, self.root, self.monkeypatch = tiny_loaded, root, monkeypatch
        self.used: list[object] = []  # pipelines handed to a case, checked afterwards

    def pipeline(self, variant: str = "wan2.1-t2v"):
        loaded = self.tiny_loaded(variant)
        self.used.append(loaded)
        return loaded

    def strategy(self, **widgets):
        from vidmem.nodes.strategy import VidMemMemoryStrategy

        return VidMemMemoryStrategy().build(**strategy_widgets(**widgets))["result"][0]

    def latent(self, variant: str = "wan2.1-t2v") -> dict:
        from vidmem.memory import MemoryStrategy
        from vidmem.memory.device import CpuBackend
        from vidmem.pipelines.sample import SampleRequest, sample
        from vidmem.pipelines.tiny import tiny_spec

        spec = tiny_spec(variant)
        request = SampleRequest("a cat", "", spec.width, spec.height, spec.frames, 2, 5.0, 0)  # LTX-2 takes 2 or more
        return sample(self.tiny_loaded(variant), MemoryStrategy(), request, backend=CpuBackend()).latent


def strategy_widgets(**changes) -> dict:
    """The Strategy node's widgets at their defaults, with `changes`."""
    from vidmem.nodes.strategy import VidMemMemoryStrategy

    widgets = {name: options.get("default", kind[0] if isinstance(kind, list) else None)
               for name, (kind, options, category) in declared_inputs(VidMemMemoryStrategy).items()
               if category == "required"}
    return {**widgets, **changes}


def sampler_inputs(fx: Fixtures, variant: str = "wan2.1-t2v", **changes) -> dict:
    """Sampler inputs that run in a fraction of a second on a tiny model, with `changes`."""
    from vidmem.pipelines.tiny import tiny_spec

    spec = tiny_spec(variant)
    inputs = dict(pipeline=fx.pipeline(variant), strategy=fx.strategy(), prompt="a cat", negative_prompt="",
                  width=spec.width, height=spec.height, frames=spec.frames, steps=1, cfg=5.0, seed=0)
    return {**inputs, **changes}


def tiny_comfy_module():
    """Where the tiny Comfy-layout file writers live (pipelines.tiny_files, earlier pipelines.tiny)."""
    try:
        from vidmem.pipelines import tiny_files as module
    except ImportError:
        from vidmem.pipelines import tiny as module
    return module
