"""Video Sampler (VidMem): text (or image) to a video LATENT, under a MemoryStrategy."""

from __future__ import annotations

from ..pipelines.sample import RunHooks, SampleRequest, sample
from . import host
from .loader import PIPELINE_TYPE
from .receipts import format_receipt
from .strategy import STRATEGY_TYPE

MAX_SEED = 0xFFFFFFFFFFFFFFFF


class VidMemVideoSampler:
    DESCRIPTION = (
        "Samples a video latent with the pipeline's own diffusers loop. The strategy is applied "
        "for this run only and removed afterwards, even on error or cancel."
    )
    CATEGORY = "vidmem"
    FUNCTION = "sample"
    RETURN_TYPES = ("LATENT",)
    RETURN_NAMES = ("latent",)
    OUTPUT_TOOLTIPS = ("Video latent [batch, channels, frames, h, w]; save it with core Save Latent to keep a run.",)

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "pipeline": (PIPELINE_TYPE, {"tooltip": "From Load Video Pipeline."}),
                "strategy": (STRATEGY_TYPE, {"tooltip": "From Memory Strategy: where weights live during sampling."}),
                "prompt": ("STRING", {"multiline": True, "default": "", "tooltip": "What the video shows."}),
                "negative_prompt": ("STRING", {"multiline": True, "default": "", "tooltip":
                    "What to avoid; used only when cfg > 1."}),
                "width": ("INT", {"default": 832, "min": 16, "max": 4096, "step": 16, "tooltip":
                    "Pixels; a multiple of 16 (32 for Wan 2.2 TI2V-5B). Wan 480p: 832x480, CogVideoX: 720x480."}),
                "height": ("INT", {"default": 480, "min": 16, "max": 4096, "step": 16, "tooltip":
                    "Pixels; a multiple of 16 (32 for Wan 2.2 TI2V-5B)."}),
                "frames": ("INT", {"default": 49, "min": 1, "max": 1025, "step": 4, "tooltip":
                    "Wan: 4k+1 (e.g. 81); CogVideoX: 8k+1 (49, or 81 for 1.5)."}),
                "steps": ("INT", {"default": 30, "min": 1, "max": 1000, "tooltip": "Denoising steps."}),
                "cfg": ("FLOAT", {"default": 6.0, "min": 0.0, "max": 30.0, "step": 0.1, "tooltip":
                    "Classifier-free guidance; above 1 runs the negative prompt too (twice the compute)."}),
                "seed": ("INT", {"default": 0, "min": 0, "max": MAX_SEED, "tooltip":
                    "Noise seed; noise is made on the CPU, so a seed gives the same video on any GPU."}),
            },
            "optional": {
                "image": ("IMAGE", {"tooltip": "First frame, for image-to-video models and Wan 2.2 TI2V-5B (which runs "
                          "text-to-video without it); leave empty for text-to-video models."}),
            },
        }

    def sample(self, pipeline, strategy, prompt, negative_prompt, width, height, frames, steps, cfg, seed, image=None):
        request = SampleRequest(prompt, negative_prompt, width, height, frames, steps, cfg, seed, image)
        progress = host.Progress(steps, "sampling")
        try:
            hooks = RunHooks(progress.step, host.check_interrupt, host.make_room)
            result = sample(pipeline, strategy, request, hooks, device=host.compute_device())
        finally:
            progress.close()
        text = format_receipt(f"Video Sampler: {pipeline.describe()}", result.receipt)
        return {"ui": {"text": [text], "vidmem_receipt": [result.receipt]}, "result": (result.latent,)}
