"""Plans for a loaded pipeline: its folder's configs on the meta device, under the host's budgets."""

from __future__ import annotations

from dataclasses import replace

from ..memory import MemoryStrategy
from ..memory.planner import Plan, choose_strategy, plan_run
from ..memory.planner_stages import VideoShape
from .configs import load_model
from .loader import LoadedPipeline


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
