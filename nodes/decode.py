"""Video VAE Decode (VidMem): a video LATENT to core IMAGE frames [frames, H, W, C] in 0..1."""

from __future__ import annotations

from ..pipelines.decode import decode
from ..pipelines.hooks import RunHooks
from ..pipelines.latents import next_latent_path, write_latent
from . import host
from .loader import PIPELINE_TYPE
from .receipts import format_receipt
from .strategy import STRATEGY_TYPE


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
                "save_latents": ("BOOLEAN", {"default": False, "tooltip": "Write the latents to "
                                 "output/latents (core .latent format) before decoding, so a crash loses "
                                 "nothing: core Load Latent reads them back."}),
            },
        }

    def decode(self, pipeline, latent, strategy=None, save_latents=False):
        saved = write_latent(latent, next_latent_path(host.latents_folder(), "vidmem")) if save_latents else None
        progress = host.Progress(1, "decoding")
        try:
            hooks = RunHooks(progress.step, host.check_interrupt, host.make_room)
            result = decode(pipeline, latent, strategy, hooks=hooks, device=host.compute_device())
        finally:
            progress.close()
        if saved is not None:
            result.receipt["saved_latents"] = str(saved)
        text = format_receipt(f"Video VAE Decode: {pipeline.describe()}", result.receipt)
        return {"ui": {"text": [text], "vidmem_receipt": [result.receipt]}, "result": (result.frames,)}
