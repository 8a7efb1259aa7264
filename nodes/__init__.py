"""Thin V1 node classes over the engine; importable without ComfyUI."""

from .cache import VidMemStepCache
from .decode import VidMemVAEDecode
from .decode_audio import VidMemDecodeAudio
from .free import VidMemFreeVRAM
from .load_files import VidMemLoadModelFiles
from .loader import VidMemLoadPipeline
from .lora import VidMemLoadLoRA
from .sampler import VidMemVideoSampler
from .speed import VidMemSpeed
from .strategy import VidMemMemoryStrategy
from .train import VidMemPrepareTrainingData, VidMemTrainLoRA

NODE_CLASS_MAPPINGS = {
    "VidMemLoadPipeline": VidMemLoadPipeline,
    "VidMemLoadModelFiles": VidMemLoadModelFiles,
    "VidMemMemoryStrategy": VidMemMemoryStrategy,
    "VidMemVideoSampler": VidMemVideoSampler,
    "VidMemStepCache": VidMemStepCache,
    "VidMemSpeed": VidMemSpeed,
    "VidMemVAEDecode": VidMemVAEDecode,
    "VidMemDecodeAudio": VidMemDecodeAudio,
    "VidMemFreeVRAM": VidMemFreeVRAM,
    "VidMemLoadLoRA": VidMemLoadLoRA,
    "VidMemPrepareTrainingData": VidMemPrepareTrainingData,
    "VidMemTrainLoRA": VidMemTrainLoRA,
}

NODE_DISPLAY_NAME_MAPPINGS = {
    "VidMemLoadPipeline": "Load Video Pipeline (VidMem)",
    "VidMemLoadModelFiles": "Load Video Model Files (VidMem)",
    "VidMemMemoryStrategy": "Memory Strategy (VidMem)",
    "VidMemVideoSampler": "Video Sampler (VidMem)",
    "VidMemStepCache": "Step Cache (VidMem)",
    "VidMemSpeed": "Speed (VidMem)",
    "VidMemVAEDecode": "Video VAE Decode (VidMem)",
    "VidMemDecodeAudio": "Decode Audio (VidMem)",
    "VidMemFreeVRAM": "Free VRAM (VidMem)",
    "VidMemLoadLoRA": "Load LoRA (VidMem)",
    "VidMemPrepareTrainingData": "Prepare Training Data (VidMem)",
    "VidMemTrainLoRA": "Train LoRA (VidMem)",
}
