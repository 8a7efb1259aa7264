"""Checks at the nodes' doors: numbers before a prompt is queued, the pack's own objects when a node runs.

ComfyUI 0.8.0 calls a V1 node's `VALIDATE_INPUTS` at queue time with the values of the inputs it
names, widget values only: a linked input arrives as None (its value does not exist yet). For
every input named, ComfyUI skips its own min/max/combo check and attaches a refusal to each named
input; so a node names only what ComfyUI cannot check itself, and `literal_problem` repeats the
range from INPUT_TYPES. NaN is the case in point: it passes every min/max test (each comparison
with NaN is false), and once queued it sits in the history as a JSON `NaN` the frontend cannot parse.

Linked inputs are checked where the node runs, first thing: `pipeline_input` names what was
connected instead of failing on an attribute deep inside.
"""

from __future__ import annotations

import math
from numbers import Real

from ..pipelines.family import ModelError
from ..pipelines.loader import LoadedPipeline


def literal_problem(node_cls, name: str, value) -> str | None:
    """Why widget `name` of `node_cls` cannot take `value` (a number: finite, within the widget's
    min and max), or None; None for a linked input (no value at queue time)."""
    if value is None:
        return None
    kind, options = _declared(node_cls, name)
    if isinstance(value, bool) or not isinstance(value, Real):
        return f"{name}={value!r} must be a number."
    if not math.isfinite(value):
        return f"{name}={value} is not a finite number; give a number from {options.get('min')} to {options.get('max')}."
    if kind == "INT" and value != int(value):
        return f"{name}={value!r} must be a whole number."
    low, high = options.get("min"), options.get("max")
    if (low is not None and value < low) or (high is not None and value > high):
        return f"{name}={value} must be from {low} to {high}."
    return None


def literal_problems(node_cls, **values) -> str | None:
    """The first literal_problem of `values`, or None: what a VALIDATE_INPUTS returns (or True)."""
    return next((problem for name, value in values.items() if (problem := literal_problem(node_cls, name, value))), None)


def _declared(node_cls, name: str) -> tuple[str, dict]:
    spec = node_cls.INPUT_TYPES()
    entry = {**spec.get("required", {}), **spec.get("optional", {})}[name]
    return entry[0], (entry[1] if len(entry) > 1 else {})


def connected(value) -> str:
    """What was connected, in a user's words: "nothing (None)", "a LATENT (a dict with 'samples')", ..."""
    if value is None:
        return "nothing (None)"
    if isinstance(value, dict):
        keys = ", ".join(repr(k) for k in list(value)[:4])
        kind = "a LATENT" if "samples" in value else "a dict"
        return f"{kind} (a dict with {keys or 'no keys'})"
    shape = getattr(value, "shape", None)
    if shape is not None:
        return f"a {type(value).__name__} of shape {tuple(shape)} (an IMAGE or latent tensor?)"
    text = repr(value)
    return f"a {type(value).__name__} ({text[:60] + '...' if len(text) > 60 else text})"


def pipeline_input(value, node: str, name: str = "pipeline") -> LoadedPipeline:
    """`value` if it is a vidmem pipeline; else ModelError naming the input and what was connected."""
    if isinstance(value, LoadedPipeline):
        return value
    raise ModelError(f"{name} ({node}) got {connected(value)}, not a vidmem pipeline; connect the pipeline output "
                     "of Load Video Pipeline, Load Video Model Files or Load LoRA (VidMem).")
