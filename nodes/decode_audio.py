"""Decode Audio (VidMem): LTX-2's sound in a sampled LATENT to core ComfyUI's AUDIO."""

from __future__ import annotations

from ..pipelines.hooks import RunHooks
from ..pipelines.ltx2_audio import decode_audio
from . import host
from .checks import pipeline_input
from .loader import PIPELINE_TYPE
from .receipts import format_receipt

NODE = "Decode Audio"


class VidMemDecodeAudio:
    DESCRIPTION = (
        "Decodes the sound LTX-2 made with the video (kept in the Video Sampler's LATENT) to an AUDIO for core "
        "Create Video's audio input, Save Audio or Preview Audio. Only this node loads LTX-2's audio VAE and vocoder, "
        "for its own run, and frees them after (leaving what other pipelines keep warm): a graph without it never "
        "loads them. If the GPU runs out of memory here, the sound is decoded on the CPU."
    )
    CATEGORY = "vidmem"
    FUNCTION = "decode"
    RETURN_TYPES = ("AUDIO",)
    RETURN_NAMES = ("audio",)
    OUTPUT_TOOLTIPS = ("The sound as core AUDIO: waveform [batch, channels, samples] float on the CPU and its "
                       "sample_rate (the vocoder's output rate); its length matches the video at 24 fps.",)

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "pipeline": (PIPELINE_TYPE, {"tooltip": "The LTX-2 pipeline that sampled the latent: its diffusers "
                             "folder must hold audio_vae/ and vocoder/ with their weights (or the single checkpoint "
                             "it was loaded with carries the audio VAE)."}),
                "latent": ("LATENT", {"tooltip": "From an LTX-2 Video Sampler run: it carries the audio latents "
                           "beside the video. Latents saved and loaded with core nodes keep only the video."}),
            },
        }

    def decode(self, pipeline, latent):
        pipeline = pipeline_input(pipeline, NODE)
        hooks = RunHooks(check_interrupt=host.check_interrupt, make_room=host.make_room)
        result = decode_audio(pipeline, latent, device=host.compute_device(), hooks=hooks)
        text = format_receipt(f"Decode Audio: {result.receipt['audio']}; {pipeline.describe()}", result.receipt)
        return {"ui": {"text": [text], "vidmem_receipt": [result.receipt]}, "result": (result.as_comfy(),)}
