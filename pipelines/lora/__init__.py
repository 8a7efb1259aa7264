"""LoRA files for the pack's denoisers: read (safetensors only), resolved to diffusers module paths,
checked against the model, and handed to memory.lora to run beside the layers for one call.

Example:
    spec = load_lora("models/loras/wan_style.safetensors", loaded.pipe, strength=0.8)
    loaded = with_lora(loaded, spec)                       # a new pipeline value; the input is unchanged
    with apply_loras(lora_patches(loaded.pipe, loaded.loras)), apply_strategy(stage, strategy, backend):
        ...
"""

from ...memory.lora import LoraError
from .read import LoraFile, read_lora_file
from .resolve import ResolvedLayer, resolve_layers
from .spec import EXPERTS, LoraSpec, describe_loras, expert_components, load_lora, lora_patches, with_lora

__all__ = [
    "EXPERTS", "LoraError", "LoraFile", "LoraSpec", "ResolvedLayer", "describe_loras", "expert_components",
    "load_lora", "lora_patches", "read_lora_file", "resolve_layers", "with_lora",
]
