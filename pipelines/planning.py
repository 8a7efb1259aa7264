"""Plans for a loaded pipeline: its folder's configs on the meta device, under the host's budgets."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

from ..memory import MemoryStrategy
from ..memory.planner import Plan, choose_strategy, decode_activation_bytes, plan_run
from ..memory.planner_stages import VideoShape
from ..memory.vae import Rung
from .configs import load_model
from .loader import LoadedPipeline

logger = logging.getLogger(__name__)


def planner_model(loaded: LoadedPipeline):
    """The pipeline's architecture built on meta from its folder's config files (cached)."""
    return load_model(loaded.folder, loaded.dtype_name)


def plan_strategy(loaded: LoadedPipeline, shape: VideoShape, strategy: MemoryStrategy,
                  vram_budget_bytes: int | None, ram_budget_bytes: int | None) -> Plan:
    """Predicted peaks per stage for running `strategy` at `shape`."""
    return plan_run(planner_model(loaded), shape, strategy, vram_budget_bytes=vram_budget_bytes,
                    ram_budget_bytes=ram_budget_bytes)


def choose_for(loaded: LoadedPipeline, shape: VideoShape, base: MemoryStrategy,
               vram_budget_bytes: int, ram_budget_bytes: int) -> Plan:
    """The fastest strategy that fits both budgets (PlanError says what would fit if none does).

    `base` keeps the user's prefetch, pinning and slicing; the tier, blocks, text encoder
    placement and VAE tiling are the planner's choice.
    """
    return choose_strategy(planner_model(loaded), shape, vram_budget_bytes, ram_budget_bytes,
                           base=replace(base, offload="model", blocks_to_swap=0))


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
            need = decode_activation_bytes(model, shape, trial, free_bytes)
        except Exception as error:  # noqa: BLE001 - a failed prediction must not stop the decode
            logger.info("vidmem: no decode memory prediction for %s: %s", loaded.describe(), error)
            return None
        if need <= free_bytes:
            return None
        return f"needs {need / 2**30:.2f} GiB for its largest piece, {free_bytes / 2**30:.2f} GiB free"
    return predict
