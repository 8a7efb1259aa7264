"""The plan route's view of the LoRAs on the Sampler's pipeline: the Load LoRA nodes between the loader
and the Sampler, counted where the run holds them. No ComfyUI imports.

The browser sends each Load LoRA node's widgets as lora<i>_<widget> (i from 0, from the loader down,
the order the run applies them) and how many Train LoRA nodes are on the path. Only names the host's
LoRA list offers are accepted (never a path). Each file's header alone is read (shapes and dtypes, no
tensor byte) and resolved against the planner's model by the engine's own rules
(pipelines.lora.load_lora, header_only), so the chart counts the bytes the Sampler's plan counts.
A Train LoRA's LoRA does not exist before its run: it is not counted, and the plan says so.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..memory.lora import LoraError
from ..memory.units import human_bytes
from . import host
from .plan_files import FilesProblem, listed_stat

LORA_PREFIX = "lora"  # lora<i>_lora_name, lora<i>_strength, lora<i>_expert: Load LoRA's widgets
LORA_WIDGETS = ("lora_name", "strength", "expert")
TRAINED = "trained_loras"  # the Train LoRA nodes on the path


@dataclass(frozen=True)
class LoraRequest:
    """One Load LoRA node's widgets, with its file's size and mtime: a rewritten file is a new request."""

    name: str
    strength: float
    expert: str
    size: int
    mtime_ns: int


def lora_prefix(index: int) -> str:
    return f"{LORA_PREFIX}{index}_"


def lora_request(index: int, name: str, strength: float, expert: str) -> LoraRequest:
    """The index-th Load LoRA's request; FilesProblem naming its lora_name when the host does not list it."""
    widget = lora_prefix(index) + "lora_name"
    if name not in host.lora_names():
        raise FilesProblem(widget, f"Load LoRA ({_nth(index)} after the loader): lora_name={name!r} is not in "
                                   "models/loras; pick a LoRA the node lists, or remove the node.")
    stat = listed_stat(lambda: host.resolve_lora(name), widget, name)
    return LoraRequest(name, strength, expert, stat.st_size, stat.st_mtime_ns)


def planned_with_loras(model, loras: tuple[LoraRequest, ...], trained: int = 0) -> tuple[object, list[str]]:
    """(`model` carrying the LoRAs' tensors on their layers, the lines the chart shows about them).
    FilesProblem naming the node's lora_name when a file cannot be read or fits nothing in the model."""
    from ..pipelines.lora import load_lora
    from ..pipelines.planning import WithLoras, meta_denoisers, with_loras

    if not loras:
        return model, _lines((), 0, trained)
    pipe = meta_denoisers(model)
    specs = []
    for index, lora in enumerate(loras):
        try:
            path = host.resolve_lora(lora.name)
            specs.append(load_lora(path, pipe, lora.strength, lora.expert, name=lora.name, header_only=True))
        except (LoraError, OSError) as error:  # a file gone since it was listed, a damaged one, one for another model
            widget = getattr(error, "widget", "") or "lora_name"  # a LoraError about the expert or strength says so
            raise FilesProblem(lora_prefix(index) + widget,
                               f"Load LoRA ({_nth(index)} after the loader) lora_name={lora.name!r}: {error}") from None
    planned = with_loras(model, pipe, specs)
    return planned, _lines(specs, planned.lora_bytes() if isinstance(planned, WithLoras) else 0, trained)


def _lines(specs, counted: int, trained: int) -> list[str]:
    """"LoRAs: 2 counted, 612.00 MiB on their layers (...): a x1, b x0.5", and the Train LoRA nodes not counted.
    `counted`: the bytes the plan counts (WithLoras.lora_bytes), not the specs' own: a layer the planner's
    model lacks is not counted, so the line does not say it is."""
    lines = []
    if specs:
        applied = [spec for spec in specs if spec.strength != 0]
        size = human_bytes(counted)
        each = ", ".join(f"{spec.name} x{spec.strength:g}" + ("" if spec.strength else " (adds nothing)") for spec in specs)
        lines.append(f"LoRAs: {len(applied)} counted, {size} on their layers (resident with them, streamed with "
                     f"their blocks under block_swap and sequential): {each}")
    if trained:
        lines.append(f"Train LoRA: {trained} on the path, not counted: the LoRA it trains is written by the run; the "
                     "Sampler counts it once it exists")
    return lines


def _nth(index: int) -> str:
    return {0: "1st", 1: "2nd", 2: "3rd"}.get(index, f"{index + 1}th")
