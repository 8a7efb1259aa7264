"""ComfyUI's own model files (Comfy-Org's repackaged single files, city96's GGUF) as vidmem pipelines.

What a file is comes from its tensors, never its name: the key layout (original Wan,
`model.diffusion_model.`-prefixed, diffusers), the storage format (bf16 / fp16 / fp32 / fp8 /
fp8 scaled / GGUF), which Wan model (the shipped configs, matched field by field on shapes),
which VAE (2.1: 16 latent channels, 2.2: 48), the text encoder and its embedded tokenizer.
LTX-2's and HunyuanVideo 1.5's transformers (ltx2.py, hy15.py) are read the same way, as Load Video
Pipeline's transformer_file over their diffusers folders.
"""

from .catalogue import ModelEntry, shipped_catalogue
from .files import WeightFile, read_weight_file
from .keys import KeyLayout
from .load import DEFAULT_WEIGHTS, LoadOptions, ModelFiles, load_model_files

__all__ = [
    "DEFAULT_WEIGHTS",
    "KeyLayout",
    "LoadOptions",
    "ModelEntry",
    "ModelFiles",
    "WeightFile",
    "load_model_files",
    "read_weight_file",
    "shipped_catalogue",
]
