"""A LoRA chosen for a pipeline: read, resolved against the model, checked, then applied per call.

`load_lora` does all the checking when the node runs (bad file, wrong family or size, expert on a
single-expert model), so a bad LoRA fails at its own node, before any sampling. The result, a
`LoraSpec`, rides on the pipeline value; `lora_patches` turns a pipeline's specs into the
engine's `LoraPatch`es for one call (memory.lora.apply_loras).
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import torch

from ...memory.lora import LoraError, LoraPatch
from ...memory.units import human_bytes
from .read import LoraFile, read_lora_file
from .resolve import ResolvedLayer, resolve_layers

EXPERTS = ("both", "high_noise", "low_noise")
# Wan 2.2 A14B in diffusers: `transformer` runs the high-noise steps, `transformer_2` the low-noise ones.
EXPERT_COMPONENTS = {"high_noise": ("transformer",), "low_noise": ("transformer_2",), "both": ("transformer", "transformer_2")}
# the component a vidmem training record names -> the expert, where the component alone says it
TRAINED_COMPONENT_EXPERT = {"transformer_2": "low_noise"}
STRENGTH_RANGE = (-4.0, 4.0)
SHOWN_SKIPPED = 20  # a warning lists this many skipped keys, then counts the rest


@dataclass(frozen=True)
class LoraSpec:
    """One LoRA on a pipeline: which file, how strong, which expert, and its layers per component."""

    name: str  # as the user chose it (the file name under models/loras)
    path: str
    strength: float
    expert: str
    layers: Mapping[str, tuple[ResolvedLayer, ...]] = field(compare=False, repr=False)  # component -> layers
    naming: str = ""  # which key naming the file used (for the receipt)
    skipped: tuple[str, ...] = ()  # keys not applied, each with its reason (warned when loaded)

    @property
    def nbytes(self) -> int:
        """Bytes of LoRA tensors this spec attaches per call (each expert's share counted once)."""
        seen: dict[int, int] = {}
        for layers in self.layers.values():
            for layer in layers:
                for t in layer.tensors.values():
                    seen[id(t)] = t.numel() * t.element_size()
        return sum(seen.values())

    def describe(self) -> str:
        experts = "" if self.expert == "both" else f", {self.expert.replace('_', '-')} expert"
        return f"{self.name} x{self.strength:g}{experts} ({human_bytes(self.nbytes)})"


def expert_components(pipe, expert: str, path: str | os.PathLike = "") -> tuple[str, ...]:
    """The denoiser components `expert` means on this pipeline; LoraError if it has no such expert."""
    if expert not in EXPERTS:
        raise LoraError(f"expert='{expert}' is not valid; use one of {', '.join(EXPERTS)}.", widget="expert")
    present = tuple(n for n in EXPERT_COMPONENTS["both"] if getattr(pipe, n, None) is not None)
    if expert != "both" and len(present) < 2:
        raise LoraError(
            f"LoRA {Path(path).name}: expert='{expert}' needs a two-expert model (Wan 2.2 A14B); this "
            "pipeline has a single transformer. Set expert to 'both'.", widget="expert"
        )
    return tuple(n for n in EXPERT_COMPONENTS[expert] if n in present)


def load_lora(path: str | os.PathLike, pipe, strength: float = 1.0, expert: str = "both", name: str = "",
              header_only: bool = False) -> LoraSpec:
    """Read `path`, resolve it against `pipe`'s denoiser(s) for `expert`, check every shape.

    Keys that cannot be applied are listed: as a LoraError when nothing applies, else as a
    warning (e.g. an image-to-video LoRA's image-attention layers on a text-to-video model).
    `header_only`: for a plan; `pipe` may hold the denoisers on the meta device, the LoRA's tensors
    are on meta too (read_lora_file), the same layers and bytes, alphas and finiteness unread.
    """
    low, high = STRENGTH_RANGE
    if not (low <= strength <= high):
        raise LoraError(f"LoRA {Path(path).name}: strength {strength} is outside [{low}, {high}]; pick a value in range.",
                        widget="strength")
    components = expert_components(pipe, expert, path)
    lora = read_lora_file(path, header_only)
    _check_trained_expert(lora, pipe, expert)
    layers, naming, skipped = {}, "", ()
    for component in components:
        layers[component], naming, skipped = resolve_layers(lora, getattr(pipe, component))
    _check_finite(lora.path, layers)
    if skipped:
        shown = list(skipped[:SHOWN_SKIPPED]) + ([f"... and {len(skipped) - SHOWN_SKIPPED} more"] if len(skipped) > SHOWN_SKIPPED else [])
        warnings.warn(f"LoRA {lora.path.name}: {len(skipped)} key(s) not applied:\n  " + "\n  ".join(shown), stacklevel=2)
    return LoraSpec(name or lora.path.name, str(lora.path), float(strength), expert, layers, naming, skipped)


def _check_trained_expert(lora: LoraFile, pipe, expert: str) -> None:
    """A LoRA vidmem trained on one Wan 2.2 expert goes on that expert: its keys name no expert (as
    diffusers and ComfyUI expect), so only the training record says which one it learned."""
    record = lora.trained_by
    trained = record.get("expert")
    if trained not in ("high_noise", "low_noise"):
        trained = TRAINED_COMPONENT_EXPERT.get(record.get("component"))  # files from before "expert" was recorded
    if trained is None or trained == expert:
        return
    component = EXPERT_COMPONENTS[trained][0]
    two_experts = all(getattr(pipe, n, None) is not None for n in EXPERT_COMPONENTS["both"])
    said = f"LoRA {lora.path.name} was trained on Wan 2.2 A14B's {trained.replace('_', '-')} expert ({component})"
    if two_experts:
        raise LoraError(f"{said}, but expert='{expert}' would apply it to {' and '.join(EXPERT_COMPONENTS[expert])}. Set "
                        f"expert to '{trained}' (Train LoRA's output already carries it there).", widget="expert")
    warnings.warn(f"{said}; this pipeline has one transformer, which it is applied to.", stacklevel=3)


def _check_finite(path: Path, layers: dict) -> None:
    """NaN or inf in a LoRA would turn every frame NaN without a word; refuse the file instead."""
    for component, resolved in layers.items():
        for layer in resolved:
            for role, tensor in layer.tensors.items():
                if tensor.is_floating_point() and not tensor.is_meta and not bool(torch.isfinite(tensor).all()):
                    raise LoraError(f"LoRA {path.name}: {component}.{layer.module} {role} holds NaN or infinite values; "
                                    "the file is damaged or was saved from a diverged training run. Use another file.")


def lora_patches(pipe, loras: tuple[LoraSpec, ...] | list[LoraSpec]) -> list[LoraPatch]:
    """The engine patches for `loras` on `pipe` (its modules looked up by path now, at call time)."""
    patches = []
    for spec in loras:
        if spec.strength == 0:
            continue
        for component, layers in spec.layers.items():
            model = getattr(pipe, component)
            for layer in layers:
                patches += layer.patches(model.get_submodule(layer.module), spec.strength, f"{component}.{layer.module}")
    return patches


def describe_loras(loras) -> str:
    """One line for a receipt: each LoRA's name, strength, expert and bytes, and the total."""
    if not loras:
        return "no LoRA"
    total = sum(spec.nbytes for spec in loras)
    return "LoRA: " + "; ".join(spec.describe() for spec in loras) + f" (+{human_bytes(total)} beside the layers)"


def with_lora(loaded, spec: LoraSpec):
    """A new pipeline value carrying `spec` after its LoRAs; `loaded` itself is not changed.

    Needs the `loras: tuple[LoraSpec, ...] = ()` field on LoadedPipeline. The image-mode cache is
    not shared: a cached image-to-video twin made before the LoRA would not carry it.
    """
    return dataclasses.replace(loaded, loras=tuple(getattr(loaded, "loras", ())) + (spec,), _image_mode={})
