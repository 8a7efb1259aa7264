"""How much device memory to ask the host for before a stage's first onload.

The weights the tier puts on the device are counted by the engine (`device_weight_bytes`, the
same partition `apply_strategy` uses, LoRA buffers included). On top come the activations: the
planner's prediction for the stage at the run's shape, i.e. each phase's allocator footprint
less the weights resident in it (so activations, the cuBLAS workspace and the allocator's
rounding), the largest over the stage's phases. The CUDA context is left out: the host's process
has one already. A host asked for the weights alone (as before) unloads too little, and the
first large activation then fails where the host could have made room.

If the planner cannot model the run (a config it does not know, a shape it refuses), the request
is the weights plus FALLBACK_MARGIN_BYTES, and the log says so: a prediction must never stop a run.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..memory import MemoryStrategy
from ..memory.plan.costs import CUDA_CONTEXT_BYTES
from ..memory.accounting import Attention
from ..memory.plan.types import CacheState, PlanOptions, StagePlan, VideoShape
from ..memory.units import GiB

log = logging.getLogger("vidmem")

# Asked on top of the weights when the planner has no prediction: a stated guess. The planner
# predicts 2.5 GiB (Wan 2.1 1.3B) and 5.6 GiB (Wan 2.1 14B) beyond the weights at 832x480x81 in
# bf16 under `model`; asking too much only unloads more of ComfyUI's models, too little ends in
# the out-of-memory ladder, so the margin covers the small models and is a floor for the large.
FALLBACK_MARGIN_BYTES = 3 * GiB

# Left free when streamed blocks stay on the device beyond the schedule's window ("residency follows
# free memory"), on top of the predicted activations and a tenth of them: room for the prediction's
# error and for the allocator's rounding, so a kept block never causes the out-of-memory error it saves a copy for.
KEEP_MARGIN_BYTES = 1 * GiB


@dataclass(frozen=True)
class RoomRequest:
    """Device bytes a stage needs: the engine's weight count plus the planner's activations."""

    weight_bytes: int
    activation_bytes: int
    predicted: bool  # False: activation_bytes is FALLBACK_MARGIN_BYTES (or 0 where nothing was asked)

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.activation_bytes

    def as_dict(self) -> dict:
        return {"weight_bytes": self.weight_bytes, "activation_bytes": self.activation_bytes,
                "predicted": self.predicted}


def wants_prediction(device: torch.device) -> bool:
    """A host frees device memory for an accelerator only: on the CPU the prediction (a meta trace
    the first time) would buy nothing, so the request there is the weights alone."""
    return device.type != "cpu"


def activation_bytes(stages: list[StagePlan], weights_outside: int = 0) -> int:
    """The largest non-weight footprint of any phase: allocator footprint less resident weights.

    `weights_outside`: bytes a phase counts as resident that the engine does not count as weights
    (the decode's latent), added back since the device needs them too.
    """
    extra = [p.device_bytes - CUDA_CONTEXT_BYTES - p.weights_bytes for s in stages for p in s.phases]
    return max(0, max(extra, default=0) + weights_outside)


def sample_room(loaded, strategy: MemoryStrategy, shape: VideoShape, steps: int, encode_text: bool,
                weight_bytes: int, device: torch.device, attention: Attention = Attention.FUSED,
                cache_state: Mapping[str, CacheState] | None = None) -> RoomRequest:
    """Room for the sampling stage (prompt encoding, when it runs, and denoising) under `strategy`, with
    the call's attention counted as `attention` (math and flex hold the whole score matrix) and what the
    step cache keeps on the device beside the activations (`cache_state`, per denoiser)."""
    if not wants_prediction(device):
        return RoomRequest(weight_bytes, 0, predicted=False)

    def predict() -> int:
        from ..memory.plan.stages import denoise_stage, text_encode_stage
        from .planning import plan_options, planner_model

        model = planner_model(loaded)
        options = plan_options(loaded, PlanOptions(attention=attention, steps=steps, cache_state=cache_state or {}))
        model.check_shape(shape)
        stages = [denoise_stage(model, shape, strategy, options)]
        if encode_text:
            stages.append(text_encode_stage(model, shape, strategy, options))
        return activation_bytes(stages)

    return _with_fallback(predict, weight_bytes, f"sampling {loaded.describe()}")


def decode_room(loaded, latent_shape: tuple[int, ...], strategy: MemoryStrategy, weight_bytes: int,
                device: torch.device) -> RoomRequest:
    """Room for decoding a LATENT of `latent_shape` ([B, C, T, h, w]) under `strategy`'s first rung."""
    if not wants_prediction(device):
        return RoomRequest(weight_bytes, 0, predicted=False)

    def predict() -> int:
        from ..memory.plan.stages import decode_stage
        from .planning import plan_options, planner_model

        batch, _, latent_frames, height, width = (int(n) for n in latent_shape)
        model = planner_model(loaded)
        s = model.geometry.spatial_factor
        shape = VideoShape(width * s, height * s, model.geometry.frames(latent_frames), batch=batch)
        vae = model.layout.vae
        latent = model.dtype_bytes(vae)
        for n in model.latent_shape(shape):
            latent *= n
        return activation_bytes([decode_stage(model, shape, strategy, plan_options(loaded))], latent)

    return _with_fallback(predict, weight_bytes, f"decoding with {loaded.describe()}")


def _with_fallback(predict, weight_bytes: int, what: str) -> RoomRequest:
    try:
        return RoomRequest(weight_bytes, predict(), predicted=True)
    except Exception as error:  # noqa: BLE001 - a failed prediction must not stop the run
        log.info("vidmem: no activation prediction for %s (%s); asking the host for the weights "
                 "(%.2f GiB) + a %.2f GiB margin", what, error, weight_bytes / GiB, FALLBACK_MARGIN_BYTES / GiB)
        return RoomRequest(weight_bytes, FALLBACK_MARGIN_BYTES, predicted=False)


def keep_bytes(free_bytes: int | None, room: RoomRequest, held_bytes: int) -> int:
    """Device bytes a sampling call's streamed blocks may keep beyond the schedule's window.

    `free_bytes` is what the device has free now (after the host made room), within the user's VRAM
    budget when one is set (RunHooks.device_budget: kept blocks must not take memory the user left to
    other applications; None where unknown: nothing is kept), `held_bytes` what the stage's warm
    store already holds of the tensors this call runs (part of the room's weights, already missing
    from the free figure; copies the call will not take back are not room it can count on). What the
    call itself needs (weights, activations) and the margin stay free.
    """
    if free_bytes is None:
        return 0
    margin = KEEP_MARGIN_BYTES + room.activation_bytes // 10
    return max(0, free_bytes + held_bytes - room.total_bytes - margin)
