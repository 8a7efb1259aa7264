"""Plans for a loaded pipeline: its configs on the meta device, its real storage, the host's budgets.

The architecture comes from the pipeline's diffusers folder or, for ComfyUI's single files, the
shipped config the loader recognised them as. How the weights are held comes from the loader too
(`plan_options`): each component's storage format and whether the weights stay memory-mapped in
their files (the disk tier), so predictions and `auto` count the bytes the run really holds, the
LoRA tensors a sampling run attaches to its layers included (`sampling_model`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from types import SimpleNamespace

import torch

from ..memory import MemoryStrategy
from ..memory.plan.planner import Plan, PlanOptions, choose_strategy, decode_activation_bytes, plan_run
from ..memory.plan.stages import VideoShape
from ..memory.storage import FORMATS
from ..memory.units import GiB
from ..memory.vae import Rung
from .configs import load_model
from .loader import LoadedPipeline

logger = logging.getLogger(__name__)


def planner_model(loaded: LoadedPipeline):
    """The pipeline's architecture built on meta from its folder's config files, or the shipped
    config its single files were recognised as (cached), less the parts the loader removed, as the
    pipeline's class runs it (`loaded.image_mode()`'s: an image-to-video run of a text-to-video folder)."""
    return load_model(loaded.folder or loaded.config_name, loaded.dtype_name, loaded.vae_dtype_name or None, loaded.removed,
                      pipeline_class=loaded.class_name)


def sampling_model(loaded: LoadedPipeline):
    """`planner_model` as a sampling run holds it: with the LoRA tensors the run attaches to its
    layers (`with_loras`). Training plans keep `planner_model`: they add the pipeline's LoRAs
    themselves (training.plan.applied_lora_bytes)."""
    model, loras = planner_model(loaded), getattr(loaded, "loras", ())
    return with_loras(model, loaded.pipe, loras) if loras else model  # the common case reads nothing of the pipeline


def with_loras(model, pipe, loras):
    """`model` (a planner model) carrying `loras` (LoraSpecs resolved against `pipe`) on its layers, as
    a run holds them; `model` itself when they attach nothing. `pipe` is a loaded pipeline's, or the
    planner's own denoisers on meta (`meta_denoisers`) for the live plan, where the specs come from the
    files' headers: both count the same layers and bytes."""
    held = lora_tensors(pipe, loras)
    return WithLoras(model, held) if held else model


def lora_tensors(pipe, loras) -> dict[str, dict[str, list[tuple[int, int]]]]:
    """component -> layer -> (key, bytes) of each LoRA tensor a run registers on that layer.

    The engine's own patches (`lora_patches`, as pipelines.sample applies them): memory.lora puts
    each patch's tensors on its layer as buffers, so they ride with the layer's block or leaf under
    every tier; a tensor shared by two layers is one key. Strength 0 attaches nothing."""
    from .lora import lora_patches

    held: dict[str, dict[str, list[tuple[int, int]]]] = {}
    for patch in lora_patches(pipe, loras):  # strength 0 makes no patch, so no buffer
        component, layer = patch.name.split(".", 1)
        held.setdefault(component, {}).setdefault(layer, []).extend(
            (id(t), t.numel() * t.element_size()) for t in patch.tensors.values())
    return held


def meta_denoisers(model) -> SimpleNamespace:
    """The planner model's denoisers on the meta device, as a pipe (`transformer`, `transformer_2`) that
    load_lora(header_only=True) resolves a LoRA file against before anything is loaded."""
    return SimpleNamespace(**{name: model.module(name) for name in model.layout.denoisers})


class WithLoras:
    """A planner model whose components carry the run's LoRA tensors on their layers; everything
    else is the wrapped model's. Only `weights` differs: the denoise stage then streams the LoRA
    bytes with their blocks, as the engine moves them, instead of not counting them at all."""

    def __init__(self, model, held: dict[str, dict[str, list[tuple[int, int]]]]) -> None:
        self._model, self._held, self._weights = model, held, {}

    def __getattr__(self, name: str):
        return getattr(self._model, name)

    def weights(self, component: str, storage: str | None = None):
        base = self._model.weights(component, storage)
        held = self._held.get(component)
        if not held:
            return base
        key = (component, storage)
        if key not in self._weights:
            known = set(base.table.modules)
            for layer in held.keys() - known:  # a layer the meta model names otherwise: not planned, never fatal
                logger.info("vidmem: LoRA layer %s.%s is not in the planner's model: not counted", component, layer)
            self._weights[key] = base.with_tensors({layer: t for layer, t in held.items() if layer in known})
        return self._weights[key]

    def lora_bytes(self) -> int:
        """Bytes of the LoRA tensors these weights count: those on layers the planner's model names (the
        others are logged by `weights`, not counted), a tensor on several layers or experts once."""
        counted: dict[int, int] = {}
        for component, held in self._held.items():
            known = set(self._model.weights(component).table.modules)
            counted.update(pair for layer, tensors in held.items() if layer in known for pair in tensors)
        return sum(counted.values())


def plan_options(loaded: LoadedPipeline, options: PlanOptions = PlanOptions(), device=None) -> PlanOptions:
    """`options` with the pipeline's real storage: each component's format and the disk tier, and
    the device type the run computes on (`device`; None keeps `options.device`). On a CPU device
    memory-mapped weights are used in place and upcasts run at the CPU's rate.

    A component whose recorded format is not a StorageFormat (integer tensors are recorded by
    dtype), or that the planner's model does not run (an image encoder loaded beside a
    text-to-video model), is left out: a prediction must not stop a run over a label.
    """
    planned = planner_model(loaded).layout.all
    storage = {name: fmt for name, fmt in loaded.storage.items() if fmt in FORMATS and name in planned}
    for name in loaded.storage.keys() - storage.keys():
        logger.info("vidmem: %s stored as %r: not planned as stored", name, loaded.storage[name])
    device_type = torch.device(device).type if device is not None else options.device
    return replace(options, storage=storage, on_disk=loaded.on_disk, device=device_type)


def run_device(device=None) -> str:
    """The device type a prediction is for: `device`'s, or the one the engine would pick now
    (memory.device.resolve_compute_device: cuda when present, else cpu; only the type, no index)."""
    if device is not None:
        return torch.device(device).type
    return "cuda" if torch.cuda.is_available() else "cpu"


def plan_strategy(loaded: LoadedPipeline, shape: VideoShape, strategy: MemoryStrategy,
                  vram_budget_bytes: int | None, ram_budget_bytes: int | None,
                  options: PlanOptions = PlanOptions(), device=None) -> Plan:
    """Predicted peaks per stage for running `strategy` at `shape` on `device`, with the weights (and LoRAs) as loaded."""
    return plan_run(sampling_model(loaded), shape, strategy, plan_options(loaded, options, run_device(device)),
                    vram_budget_bytes=vram_budget_bytes, ram_budget_bytes=ram_budget_bytes)


def choose_for(loaded: LoadedPipeline, shape: VideoShape, base: MemoryStrategy,
               vram_budget_bytes: int, ram_budget_bytes: int, options: PlanOptions = PlanOptions(), device=None) -> Plan:
    """The fastest strategy that fits both budgets (PlanError says what would fit if none does).

    `base` keeps the user's prefetch, pinning and slicing; the tier, blocks, text encoder
    placement and VAE tiling are the planner's choice. Storage and the disk tier are the loaded
    pipeline's and are not chosen here (they were fixed at load); when nothing fits, the error
    says which storage or disk tier would, to load with instead.
    """
    return choose_strategy(sampling_model(loaded), shape, vram_budget_bytes, ram_budget_bytes,
                           base=replace(base, offload="model", blocks_to_swap=0),
                           options=plan_options(loaded, options, run_device(device)), consider_disk=False)


def decode_overrun(loaded: LoadedPipeline, latent_shape: tuple[int, ...], strategy: MemoryStrategy,
                   free_bytes: int) -> Callable[[Rung], str | None]:
    """For the decode's fallback ladder: why a rung would not fit `free_bytes`, or None.

    The prediction is the planner's trace of the rung's largest piece, built from the pipeline's
    folder on first use. It only ever skips rungs: if the planner cannot model this pipeline (a
    moved folder, a missing config), every rung is tried as usual.
    """
    batch, _, latent_frames, height, width = (int(n) for n in latent_shape)

    def predict(rung: Rung) -> str | None:
        try:
            model = planner_model(loaded)
            s = model.geometry.spatial_factor
            shape = VideoShape(width * s, height * s, model.geometry.frames(latent_frames), batch=batch)
            trial = replace(strategy, vae_tiling=rung.tiling, vae_slicing=rung.slicing)
            need = decode_activation_bytes(model, shape, trial, free_bytes, plan_options(loaded))
        except Exception as error:  # noqa: BLE001 - a failed prediction must not stop the decode
            logger.info("vidmem: no decode memory prediction for %s: %s", loaded.describe(), error)
            return None
        if need <= free_bytes:
            return None
        return f"needs {need / GiB:.2f} GiB for its largest piece, {free_bytes / GiB:.2f} GiB free"
    return predict
