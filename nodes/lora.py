"""Load LoRA (VidMem): a LoRA from models/loras on a pipeline, as a new pipeline value (chainable).

The input pipeline is never changed: the LoRA rides on the returned value and is attached to the
denoiser only for the length of each sampling call, beside the layers, under any memory tier.
"""

from __future__ import annotations

from ..pipelines.lora import EXPERTS, load_lora, with_lora
from ..pipelines.lora.spec import STRENGTH_RANGE
from . import host
from .checks import literal_problem, pipeline_input
from .loader import PIPELINE_TYPE, found

NO_LORAS = "(no LoRAs found in models/loras)"


class VidMemLoadLoRA:
    DESCRIPTION = (
        "Adds a LoRA (style, motion, or a distill LoRA such as lightx2v) to a pipeline. Chain several. "
        "Reads diffusers/PEFT, ComfyUI/kohya, original Wan (lightx2v, musubi), LTX-2 (Lightricks, "
        "ltx-trainer), HunyuanVideo 1.5 (Tencent's train.py) and CogVideoX-Factory files, .safetensors "
        "only. The base weights are never copied or changed."
    )
    CATEGORY = "vidmem"
    FUNCTION = "load"
    RETURN_TYPES = (PIPELINE_TYPE,)
    RETURN_NAMES = ("pipeline",)
    OUTPUT_TOOLTIPS = ("The same pipeline with this LoRA added after any earlier ones; the input pipeline is unchanged.",)

    @classmethod
    def INPUT_TYPES(cls):
        low, high = STRENGTH_RANGE
        return {
            "required": {
                "pipeline": (PIPELINE_TYPE, {"tooltip": "From Load Video Pipeline or another Load LoRA."}),
                "lora_name": (host.lora_names() or [NO_LORAS], {"tooltip": "A .safetensors LoRA under "
                              "models/loras made for this model family and size (a Wan 1.3B LoRA does not fit 14B)."}),
                "strength": ("FLOAT", {"default": 1.0, "min": low, "max": high, "step": 0.05, "tooltip":
                             "Multiplies the LoRA's effect; 0 gives the base model exactly, negative values invert it."}),
                "expert": (list(EXPERTS), {"default": "both", "tooltip": "Wan 2.2 A14B only: apply to the "
                           "high-noise expert, the low-noise expert, or both (distill LoRAs ship one file per "
                           "expert). Single-transformer models need 'both'."}),
            },
        }

    @classmethod
    def VALIDATE_INPUTS(cls, strength=None):
        """strength is named so NaN is refused when queued (it passes ComfyUI's min/max); its range is checked here."""
        return literal_problem(cls, "strength", strength) or True

    @classmethod
    def IS_CHANGED(cls, lora_name=None, **_other_inputs):
        """The file's modification time and size: a LoRA rewritten under the same name (Train LoRA
        writes models/loras/<name>.safetensors) is read again; an unchanged one stays cached."""
        if not isinstance(lora_name, str):  # linked: ComfyUI keys the cache on the value that arrives
            return ""
        try:
            stat = host.resolve_lora(lora_name).stat()
        except OSError:  # not there: the node says so when it runs
            return ""
        return stat.st_mtime_ns, stat.st_size

    def load(self, pipeline, lora_name: str, strength: float, expert: str = "both"):
        pipeline = pipeline_input(pipeline, "Load LoRA")
        path = found(host.resolve_lora, lora_name)
        spec = load_lora(path, pipeline.pipe, strength, expert, name=lora_name)
        return {"ui": {"text": [summary(spec)]}, "result": (with_lora(pipeline, spec),)}


def summary(spec) -> str:
    """What the node shows after a run: what was applied, and what was not (also warned in the log)."""
    layers = sum(len(found) for found in spec.layers.values())
    text = f"{spec.describe()}: {layers} layers ({spec.naming} key names)"
    if spec.skipped:
        text += f"; {len(spec.skipped)} key(s) not applied, e.g. {spec.skipped[0]}"
    return text
