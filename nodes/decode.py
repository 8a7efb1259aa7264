"""Video VAE Decode (VidMem): a video LATENT to core IMAGE frames [frames, H, W, C] in 0..1."""

from __future__ import annotations

from dataclasses import asdict, replace

from ..memory.plan.candidates import PlanError, tiling_that_fits
from ..memory.plan.costs import MeasuredSpeed
from ..memory.plan.stages import VideoShape
from ..memory.plan.types import Attention, PlanOptions
from ..memory.telemetry import budgeted_free_bytes
from ..memory.units import GiB
from ..pipelines.decode import decode, validate_latent
from ..pipelines.hooks import RunHooks
from ..pipelines.latents import next_latent_path, write_latent
from ..pipelines.planning import choose_for, plan_options, planner_model, run_device
from . import host
from .checks import pipeline_input
from .loader import PIPELINE_TYPE
from .receipts import format_receipt
from .strategy import STRATEGY_TYPE, as_choice

LATENT_STEM = "vidmem"
NODE = "Video VAE Decode"
PLAN_KEY = "plan"  # in latent["vidmem"]: the shape and attention the Sampler planned at (record_plan)


class VidMemVAEDecode:
    DESCRIPTION = (
        "Decodes a video latent to frames for core Create Video / Save Video / Save Animated WEBP. "
        "Honours the strategy's VAE slicing and tiling."
    )
    CATEGORY = "vidmem"
    FUNCTION = "decode"
    RETURN_TYPES = ("IMAGE",)
    RETURN_NAMES = ("frames",)
    OUTPUT_TOOLTIPS = ("Video frames as an IMAGE batch [frames, height, width, 3], values 0..1.",)

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "pipeline": (PIPELINE_TYPE, {"tooltip": "The pipeline that sampled the latent (its VAE decodes it)."}),
                "latent": ("LATENT", {"tooltip": "From Video Sampler, or core Load Latent of a saved run."}),
            },
            "optional": {
                "strategy": (STRATEGY_TYPE, {"tooltip": "VAE offload, slicing and tiling; without one the "
                             "whole VAE goes to the GPU and decodes untiled."}),
                "save_latents": ("BOOLEAN", {"default": False, "tooltip": "Write the latent to ComfyUI's "
                                 "input folder (core .latent format, vidmem_00001_.latent, ...) before decoding, "
                                 "so a crash loses nothing: core Load Latent lists it there."}),
            },
        }

    def decode(self, pipeline, latent, strategy=None, save_latents=False):
        pipeline = pipeline_input(pipeline, NODE)
        choice = as_choice(strategy, NODE, optional=True)
        samples = validate_latent(pipeline, latent)  # family, channels, finite: before anything is written or moved
        run = _strategy_for_decode(pipeline, choice, samples.shape, latent)
        saved = write_latent(latent, next_latent_path(host.latents_folder(), LATENT_STEM)) if save_latents else None
        progress = host.Progress(1, "decoding")
        try:
            # the ladder's rungs within the user's vram_budget_gb, as the Sampler's (none without a Strategy)
            budget = budgeted_free_bytes(int(choice.vram_budget_gb * GiB) if choice is not None else 0)
            hooks = RunHooks(progress.step, host.check_interrupt, host.make_room, device_budget=budget,
                             pinned_room=host.pinned_room_bytes)
            result = decode(pipeline, latent, run, hooks=hooks, device=host.compute_device())
        finally:
            progress.close()
        if saved is not None:
            result.receipt["saved_latents"] = saved.name
        if choice is not None and choice.notes:
            result.receipt["note"] = "; ".join(choice.notes)
        text = format_receipt(f"Video VAE Decode: {pipeline.describe()}", result.receipt)
        return {"ui": {"text": [text], "vidmem_receipt": [result.receipt]}, "result": (result.frames,)}


def record_plan(latent: dict, shape: VideoShape, options: PlanOptions) -> dict:
    """A copy of the Sampler's latent that also says what the Sampler planned at: its shape (cfg and
    the context window, which the latent's size does not show), the attention it counted and the speed
    it timed with (MeasuredSpeed), so an offload=auto Decode chooses as the Sampler did. Plain ints,
    floats, bools and strings: it survives a copy."""
    record = {"shape": asdict(shape), "attention": options.attention.value, "speed": asdict(options.speed)}
    return dict(latent, vidmem=dict(latent.get("vidmem") or {}, **{PLAN_KEY: record}))


def _strategy_for_decode(pipeline, choice, latent_shape, latent: dict | None = None):
    """The user's strategy, or for offload=auto the planner's choice for this latent.

    The planner chooses at the shape and attention the Sampler recorded in the latent (record_plan),
    so the Decode runs what the Sampler's receipt showed; a latent without that record (saved by an
    older version, or reloaded through core Load Latent) is planned at the size it decodes to, with
    guidance on and no window. If nothing fits the whole run, the decode stage alone is fitted:
    the tiling whose traced peak fits the VRAM budget. If the planner cannot model this pipeline,
    the base strategy decodes untiled and the decode's own fallback ladder tiles it when memory
    runs short.
    """
    if choice is None or not choice.auto:
        return None if choice is None else choice.strategy
    untiled = replace(choice.strategy, vae_tiling=None)
    try:
        model = planner_model(pipeline)
    except ValueError:
        return untiled
    shape, options = _recorded_plan(pipeline, model, latent_shape, latent) or (_latent_video_shape(model, latent_shape),
                                                                                  PlanOptions())
    device = host.compute_device()
    vram, ram = choice.budgets(device)
    try:
        return choose_for(pipeline, shape, choice.strategy, vram, ram, options, device=device).strategy
    except PlanError:
        # The whole run does not fit (the Sampler then ran what its PlanError allowed, or ran
        # elsewhere); the decode needs only the VAE to fit, so tile it against the budget.
        base = replace(choice.strategy, offload="model", blocks_to_swap=0, vae_tiling=None)
        try:
            return tiling_that_fits(model, shape, base, plan_options(pipeline, options, run_device(device)), vram)
        except ValueError:
            return untiled
    except ValueError:
        return untiled


def _latent_video_shape(model, latent_shape) -> VideoShape:
    """The video a latent decodes to, as far as its size tells (guidance on, no window)."""
    batch, _channels, latent_frames, height, width = (int(n) for n in latent_shape)
    s = model.geometry.spatial_factor
    return VideoShape(width * s, height * s, model.geometry.frames(latent_frames), batch=batch)


def _recorded_plan(pipeline, model, latent_shape, latent) -> tuple[VideoShape, PlanOptions] | None:
    """The Sampler's recorded shape, attention and speed, when the latent carries them, came from this
    pipeline's model class, and still has the size that shape samples; else None (plan as before). A record
    from before the speed was recorded plans with none, as its Sampler did."""
    metadata = latent.get("vidmem") if isinstance(latent, dict) else None
    record = metadata.get(PLAN_KEY) if isinstance(metadata, dict) else None
    if not isinstance(record, dict) or metadata.get("class_name") != pipeline.class_name:
        return None
    try:
        shape = VideoShape(**record["shape"])
        options = PlanOptions(attention=Attention(record["attention"]), speed=MeasuredSpeed(**record.get("speed", {})))
        size = tuple(int(n) for n in model.latent_shape(shape))
    except (KeyError, TypeError, ValueError):
        return None
    latent_size = tuple(int(n) for n in latent_shape)
    if (size[0], *size[2:]) != (latent_size[0], *latent_size[2:]):  # cropped or edited since: its own size rules
        return None
    return shape, options
