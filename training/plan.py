"""offload=auto for training: the training planner chooses the strategy, as `vidmem plan --train` does.

The planner (memory/plan/train_plan.py) predicts one training step's peak VRAM and RAM per tier
from the denoiser's config on the meta device, its stored format, the LoRA settings and the
largest bucket of the prepared data at the run's batch size; the first tier that fits both
budgets, fastest first, is the one trained with. The receipt names the plan and its predicted
peaks, and after the run the measured peaks beside them.

LoRAs already on the pipeline (a distill LoRA) ride beside the trained layers for the whole run
(training/loop.py applies them as the sampler does); the planner in memory/plan knows nothing of
them, so their bytes on the trained component are taken off the VRAM budget it plans against and
added to every plan's peak here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..memory import MemoryStrategy
from ..memory.activation_offload import UNPINNED, OffloadMode
from ..memory.hostpool import HostPool, pinned_cap_bytes
from ..memory.offload import streamed_units
from ..memory.plan.train import trace_activations
from ..memory.plan.train_plan import (TrainPlan, TrainRequest, advice, ceiling_note, recommended, strategy_plan,
                                      training_plans)
from ..memory.plan.types import VideoShape
from ..memory.residency import Slot, partition_slots
from ..memory.storage import FORMATS
from ..memory.units import GiB
from .adapters import check_rank, find_targets
from .errors import TrainingError
from .inference import training_mode
from .settings import TrainSettings





@dataclass(frozen=True)
class TrainingChoice:
    """What auto chose: the strategy to train with, the plan behind it and the shape it was planned at."""

    strategy: MemoryStrategy
    plan: TrainPlan
    shape: VideoShape
    budgets: tuple[int, int]  # (VRAM, RAM) bytes planned against

    fixed: bool = False  # the tier was chosen by hand; the plan decided activation_offload auto only
    pipeline_lora_bytes: int = 0  # the pipeline's own LoRAs on the trained component (in the plan's peak VRAM)

    def describe(self) -> str:
        shape = self.shape
        strategy = self.strategy.describe()
        chose = f"{strategy} (chosen by hand)" if self.fixed else f"auto chose {strategy}"
        return (f"{chose} for the training step at {shape.width}x{shape.height}x"
                f"{shape.frames}, batch {shape.batch}: predicted peak VRAM {self.plan.peak_vram_bytes / GiB:.2f} GiB, "
                f"RAM {self.plan.peak_ram_bytes / GiB:.2f} GiB (budgets {self.budgets[0] / GiB:.2f} / "
                f"{self.budgets[1] / GiB:.2f} GiB)" + self._offload_text())

    def _offload_text(self) -> str:
        plan = self.plan
        if not plan.activation_offload and not plan.activation_offload_reason:
            return ""
        text = f"; activation offload {'on' if plan.activation_offload else 'off'}"
        if plan.activation_offload_reason:
            text += f" ({plan.activation_offload_reason})"
        note = ceiling_note([plan])
        return text + (f"; {note}" if note else "")

    def settings(self, settings: TrainSettings) -> TrainSettings:
        """`settings` with activation_offload as the plan has it (auto resolved to on or off)."""
        return replace(settings, activation_offload=OffloadMode.ON if self.plan.activation_offload else OffloadMode.OFF)

    def receipt(self, measured: dict) -> dict:
        """The plan's predictions, and beside them the run's measured peaks (`StageMeter.as_dict()`)."""
        record = {"tier": self.plan.tier, "blocks_to_swap": self.plan.blocks_to_swap,
                  "shape": [self.shape.width, self.shape.height, self.shape.frames, self.shape.batch],
                  "predicted_peak_vram_bytes": self.plan.peak_vram_bytes,
                  "predicted_peak_ram_bytes": self.plan.peak_ram_bytes,
                  "vram_budget_bytes": self.budgets[0], "ram_budget_bytes": self.budgets[1],
                  "activation_offload": self.plan.activation_offload,
                  "pipeline_lora_bytes": self.pipeline_lora_bytes}
        if self.plan.activation_offload_reason:
            record["activation_offload_reason"] = self.plan.activation_offload_reason
        if self.plan.activation_offload:
            record.update(predicted_offloaded_bytes_per_step=self.plan.activation_moved_bytes,
                          predicted_activation_host_bytes=self.plan.activation_host_bytes,
                          predicted_inputs_kept_on_device=self.plan.activation_kept_inputs)
        if measured.get("peak_allocated_bytes") is not None:
            record["measured_peak_vram_bytes"] = measured["peak_allocated_bytes"]
        if measured.get("peak_rss_bytes"):
            record["measured_peak_rss_bytes"] = measured["peak_rss_bytes"]
        return record


def planned_shape(data, settings: TrainSettings) -> VideoShape:
    """The largest bucket of the data by latent volume (what the denoiser holds) at the run's batch
    size, no guidance pass. Not by pixel volume: the VAE compresses time (Wan and CogVideoX 4x, the
    first frame alone), so 832x480x5 pixels (2 latent frames, 12,480 latent pixels) is less than
    a 1024x1024 still (16,384)."""
    buckets = {sample.bucket for sample in data.samples}
    if not buckets:
        raise TrainingError("the prepared data holds no samples; prepare a folder with captioned clips.")
    largest = max(buckets, key=lambda b: (latent_volume(b, *data.vae_scale), b.label()))
    return VideoShape(largest.width, largest.height, largest.frames, batch=settings.batch_size, cfg=False)


def latent_volume(bucket, spatial: int, temporal: int) -> int:
    """Latent frames x height x width of a bucket's latent (the VAE keeps the first frame alone)."""
    return ((bucket.frames - 1) // temporal + 1) * (bucket.height // spatial) * (bucket.width // spatial)


def training_request(settings: TrainSettings, base: MemoryStrategy, storage: str | None,
                     pinned_ceiling: int | None = None) -> TrainRequest:
    """The request for an empty host pool; `pool_homes` adds what a pipeline's pool already holds."""
    return TrainRequest(rank=settings.rank, optimizer=settings.optimizer.value, checkpointing=settings.gradient_checkpointing,
                        targets=tuple(settings.target_modules), storage=storage, prefetch_blocks=base.prefetch_blocks,
                        activation_offload=settings.activation_offload, pinned_ceiling_bytes=pinned_ceiling)


def pool_homes(request: TrainRequest, pool: HostPool, model, blocks) -> TrainRequest:
    """`request` with the pinned homes `pool` already holds: all its pinned bytes, the room in its
    newest arena, and which of `model`'s streamed tensors have a home (per block, and for the
    sequential tier's leaves), split by the engine's own rule, so each tier's plan pins new arenas
    only for the streamed tensors the run will find without one."""
    if not pool.pinned_bytes:
        return replace(request, pinned_arena_bytes=pool.arena_bytes)
    every_block = MemoryStrategy(offload="block_swap", blocks_to_swap=len(blocks))
    per_block = tuple(pool.homed_bytes(slot.host for slot in unit)
                      for unit in _streamed_slots(model, blocks, every_block))
    leaves = _streamed_slots(model, blocks, MemoryStrategy(offload="sequential"))
    return replace(request, pinned_already_bytes=pool.pinned_bytes, pinned_homed_block_bytes=per_block,
                   pinned_homed_leaf_bytes=pool.homed_bytes(slot.host for unit in leaves for slot in unit),
                   pinned_spare_bytes=pool.spare_bytes, pinned_arena_bytes=pool.arena_bytes)


def _streamed_slots(model, blocks, strategy: MemoryStrategy) -> list[list[Slot]]:
    """Each unit's tensors as the engine streams them under `strategy` (apply_strategy's own split)."""
    return partition_slots(model, [members for _, members in streamed_units(model, blocks, strategy)])[1]


def plan_training_step(model, denoiser: str, shape: VideoShape, vram: int, ram: int,
                       request: TrainRequest) -> tuple[list[TrainPlan], int | None]:
    """Every tier's plan for one training step of `model`'s `denoiser` (a MetaModel from
    vidmem.pipelines.configs) and the index of the recommended one (None: nothing fits)."""
    plans = training_plans(model, denoiser, shape, vram, ram, request, _tracer(model, denoiser, shape, request))
    return plans, recommended(plans)


def _tracer(model, denoiser: str, shape: VideoShape, request: TrainRequest):
    from ..pipelines.configs import workloads

    # The full-size meta module, not the two-block traced one: the trace cuts it to one, two and three
    # blocks (the third block's increment is what every further block adds; memory/plan/train.py).
    module = model.module(denoiser)
    blocks = getattr(module, model.spec.blocks_attr)
    run = workloads.denoise_step(model, denoiser, shape, module, per_sample_timesteps=True)  # as objective.py calls it

    def activations(checkpointing: bool):
        return trace_activations(module, blocks, run, request.rank, request.targets, checkpointing, request.attention)
    return activations


def choose_training_strategy(loaded, data, settings: TrainSettings, base: MemoryStrategy,
                             vram: int, ram: int, can_pin: bool = True) -> TrainingChoice:
    """The fastest tier whose predicted training step fits both budgets; TrainingError if none does.
    With activation_offload auto, each tier's plan has it on only where the step fits with it and
    not without; `choice.settings(settings)` is the run's settings with it resolved. `can_pin`:
    whether the run's backend pins (False: no pinned ceiling, as on the CPU)."""
    component, shape, request, model = _planning_inputs(loaded, data, settings, base, can_pin)
    loras = applied_lora_bytes(loaded, component)
    try:
        with training_mode():  # the trace runs a backward: not under the host's inference mode
            plans, best = plan_training_step(model, component, shape, vram - loras, ram, request)
    except ValueError as error:
        raise TrainingError(f"offload=auto could not plan this training step: {error}; choose an offload tier "
                            "on the Memory Strategy node.") from None
    plans = [_with_loras(plan, loras) for plan in plans]
    if best is None:
        raise TrainingError(_nothing_fits(plans, shape, vram, ram, loras))
    plan = plans[best]
    strategy = replace(base, offload=plan.tier, blocks_to_swap=plan.blocks_to_swap)
    return TrainingChoice(strategy, plan, shape, (vram, ram), pipeline_lora_bytes=loras)


def resolve_activation_offload(loaded, data, settings: TrainSettings, strategy: MemoryStrategy,
                               vram: int, ram: int, can_pin: bool = True) -> TrainingChoice:
    """activation_offload auto on a tier chosen by hand: the plan of that strategy decides (on only
    when the step does not fit without it and fits with it). The strategy is kept either way;
    `choice.settings(settings)` is the run's settings with on or off."""
    component, shape, request, model = _planning_inputs(loaded, data, settings, strategy, can_pin)
    loras = applied_lora_bytes(loaded, component)
    try:
        with training_mode():
            plan = strategy_plan(model, component, shape, vram - loras, ram, request,
                                 _tracer(model, component, shape, request), strategy)
    except ValueError as error:
        raise TrainingError(f"activation_offload=auto could not plan this training step: {error}; set "
                            "activation_offload to on or off.") from None
    return TrainingChoice(strategy, _with_loras(plan, loras), shape, (vram, ram), fixed=True, pipeline_lora_bytes=loras)


def applied_lora_bytes(loaded, component: str) -> int:
    """Bytes of the pipeline's LoRAs on `component`, each tensor once (strength 0 applies nothing).
    Counted whole on the device for every tier: under block swap only the resident and in-flight
    blocks' share is there at once, so this over-counts those tiers by the streamed share."""
    sizes = {}
    for spec in getattr(loaded, "loras", ()):
        if spec.strength != 0:
            for layer in spec.layers.get(component, ()):
                sizes.update({id(t): t.numel() * t.element_size() for t in layer.tensors.values()})
    return sum(sizes.values())


def _with_loras(plan: TrainPlan, lora_bytes: int) -> TrainPlan:
    """`plan` (made against the budget less `lora_bytes`, so its `fits` already holds them) with the
    pipeline's LoRAs in its peak VRAM."""
    return replace(plan, peak_vram_bytes=plan.peak_vram_bytes + lora_bytes) if lora_bytes else plan


def _planning_inputs(loaded, data, settings: TrainSettings, base: MemoryStrategy, can_pin: bool = True):
    """(component, shape, request, planner model); the run's own checks first, so bad input is named
    as without a plan, not as a planning failure."""
    from ..pipelines.planning import planner_model

    from .loop import check_request

    component = check_request(loaded, data, base, settings)
    model = getattr(loaded.pipe, component)
    check_rank(model, find_targets(model, component, settings.target_modules, loaded.spec.blocks_attr), settings.rank)
    shape = planned_shape(data, settings)
    stored = loaded.storage.get(component) if hasattr(loaded, "storage") else None
    pool = getattr(loaded, "host_pool", None)
    # the run's ceiling (training/loop.py `_activation_cap`); the planner takes the weights' homes from it
    ceiling = pinned_cap_bytes(base.max_pinned_ram_gb, getattr(pool, "host_room_bytes", None)) if can_pin else UNPINNED
    request = training_request(settings, base, stored if stored in FORMATS else None, ceiling)
    if can_pin and pool is not None:  # homes an earlier call left in the pool
        request = pool_homes(request, pool, model, getattr(model, loaded.spec.blocks_attr))
    return component, shape, request, planner_model(loaded)


def _nothing_fits(plans: list[TrainPlan], shape: VideoShape, vram: int, ram: int, lora_bytes: int = 0) -> str:
    runnable = [p for p in plans if not p.refused] or plans
    least = min(runnable, key=lambda p: p.peak_vram_bytes)
    return (f"offload=auto: no strategy fits a training step at {shape.width}x{shape.height}x{shape.frames}, batch "
            f"{shape.batch} in {vram / GiB:.2f} GiB VRAM and {ram / GiB:.2f} GiB RAM; the least is {least.tier}"
            f"{f' {least.blocks_to_swap}' if least.blocks_to_swap else ''} at {least.peak_vram_bytes / GiB:.2f} GiB VRAM, "
            f"{least.peak_ram_bytes / GiB:.2f} GiB RAM"
            + (f" (the pipeline's LoRAs take {lora_bytes / GiB:.2f} GiB of it)" if lora_bytes else "")
            + ". Lower the rank, batch size or bucket size, turn "
            "gradient_checkpointing on, use optimizer adamw_8bit, or raise the budgets."
            + (f" Or: {advice(plans)}" if advice(plans) else ""))
