"""Video VAE Decode (VidMem): a video LATENT to core IMAGE frames [frames, H, W, C] in 0..1."""

from __future__ import annotations

from dataclasses import replace

from ..memory.plan.stages import VideoShape
from ..pipelines.decode import decode, validate_latent
from ..pipelines.hooks import RunHooks
from ..pipelines.latents import next_latent_path, write_latent
from ..pipelines.planning import choose_for, planner_model
from . import host
from .checks import pipeline_input
from .loader import PIPELINE_TYPE
from .receipts import format_receipt
from .strategy import STRATEGY_TYPE, as_choice

LATENT_STEM = "vidmem"
NODE = "Video VAE Decode"


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
        run = _strategy_for_decode(pipeline, choice, samples.shape)
        saved = write_latent(latent, next_latent_path(host.latents_folder(), LATENT_STEM)) if save_latents else None
        progress = host.Progress(1, "decoding")
        try:
            hooks = RunHooks(progress.step, host.check_interrupt, host.make_room,
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


def _strategy_for_decode(pipeline, choice, latent_shape):
    """The user's strategy, or for offload=auto the planner's choice at the latent's video size.

    The Sampler chose at its own shape; the decode sees only the latent, so it asks the planner
    again at the size the latent decodes to (the same size, hence the same choice). If the
    planner cannot model this pipeline, the base strategy decodes untiled and the decode's own
    fallback ladder tiles it when memory runs short.
    """
    if choice is None or not choice.auto:
        return None if choice is None else choice.strategy
    batch, _channels, latent_frames, height, width = (int(n) for n in latent_shape)
    try:
        model = planner_model(pipeline)
        s = model.geometry.spatial_factor
        shape = VideoShape(width * s, height * s, model.geometry.frames(latent_frames), batch=batch)
        device = host.compute_device()
        vram, ram = choice.budgets(device)
        return choose_for(pipeline, shape, choice.strategy, vram, ram, device=device).strategy
    except ValueError:
        return replace(choice.strategy, vae_tiling=None)
