"""Speed (VidMem): the attention kernel, compiled blocks and fp8 matmul for the Video Sampler.

The node only describes the choices; the Sampler resolves them against its device and model before
any weight moves, applies them for its call only, and says in its receipt what ran
(pipelines/speed.py). Every offload tier runs every choice.
"""

from __future__ import annotations

import torch

from ..memory.storage.fp8_matmul import Fp8Matmul
from ..memory.strategy import StrategyError
from ..pipelines.attention import AttentionError, AttentionKernel, resolve_attention
from ..pipelines.compile import DYNAMIC_CHOICES, MODES, TOOLTIPS, CompileSettings
from ..pipelines.speed import NO_SPEED_NODE, Speed
from . import host
from .checks import connected

SPEED_TYPE = "VIDMEM_SPEED"
# A kernel is refused when queued only where no compute dtype could run it here (a dtype-dependent
# refusal comes from the Sampler, which knows the model's dtype, before anything moves).
QUEUE_CHECK_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FP8_MATMUL_TOOLTIP = (
    "Multiply the transformer's fp8 / fp8_scaled layers in fp8 (torch._scaled_mm) instead of upcasting each weight "
    "first. auto: upcast, for now: on an H100 and an H200 fp8 matmul made a step slower (x1.14 at 832x480x81, x1.25 "
    "at 480x320x17), since rounding each layer's input to fp8 costs more than the fp8 multiply saves. on: use it "
    "where the GPU has fp8 tensor cores (CUDA capability 8.9+: RTX 40xx, L4/L40S, H100/H200 and newer), refused "
    "where it cannot run. off: always upcast, exact to the stored weights. Its quality cost: each layer's input is "
    "rounded to fp8 (3 mantissa bits); a random Wan 1.3B-shaped model's latent came out 46-48 dB PSNR from 'off' "
    "(CPU, H100 and H200). Layers whose widths are not multiples of 16, with per-row scales or stored as e5m2 upcast "
    "as before, counted in the receipt.")


class VidMemSpeed:
    DESCRIPTION = (
        "How the Video Sampler computes: the attention kernel, compiled transformer blocks and fp8 matmul. "
        "Connect it to the Sampler's speed input; without it the Sampler runs plain SDPA, eager blocks and "
        "upcast fp8 weights. Every choice works under every offload tier, with LoRAs and the step cache."
    )
    CATEGORY = "vidmem"
    FUNCTION = "build"
    RETURN_TYPES = (SPEED_TYPE,)
    RETURN_NAMES = ("speed",)
    OUTPUT_TOOLTIPS = ("For the Video Sampler's speed input; it applies to that call only.",)

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "attention": ([k.value for k in AttentionKernel], {"default": AttentionKernel.AUTO.value, "tooltip":
                    "auto: torch's SDPA choosing its own fused kernel, measured the fastest exact choice on an "
                    "H100 (forcing FlashAttention-2 was 1.6x slower at 480p), named in the receipt; never a lossy "
                    "one. sdpa: the same, as without vidmem. flash, efficient, cudnn, math: that SDPA backend only. "
                    "flex: torch's flex_attention (unfused unless compiled). sage: SageAttention (pip "
                    "sageattention; INT8 Q.K, lossy but usually close; CUDA only)."}),
                "compile": ("BOOLEAN", {"default": False, "tooltip": TOOLTIPS["compile"]}),
                "compile_mode": (list(MODES), {"default": MODES[0], "tooltip": TOOLTIPS["compile_mode"]}),
                "compile_dynamic": (list(DYNAMIC_CHOICES), {"default": "auto",
                                    "tooltip": TOOLTIPS["compile_dynamic"]}),
                "fp8_matmul": ([m.value for m in Fp8Matmul], {"default": Fp8Matmul.AUTO.value,
                               "tooltip": FP8_MATMUL_TOOLTIP}),
            },
        }

    @classmethod
    def VALIDATE_INPUTS(cls, attention=None):
        """A kernel no dtype could run on this machine's device (sage not installed, no GPU for a
        CUDA-only kernel) is refused when queued, before any node runs. attention defaults to None
        (as linked): a prompt missing it gets ComfyUI's own "required input missing", not a TypeError."""
        return queue_problem(attention) or True

    def build(self, attention, compile, compile_mode, compile_dynamic, fp8_matmul):
        speed = Speed(attention, CompileSettings(compile, compile_mode, compile_dynamic), fp8_matmul)
        return {"ui": {"text": [f"Speed: {speed.describe()}"]}, "result": (speed,)}


def queue_problem(attention) -> str | None:
    """Why `attention` cannot run on the host's device in any compute dtype, or None; None for a
    linked input (no value when queued): Speed and then the Sampler check the value when it arrives."""
    if attention is None:
        return None
    try:
        kernel = AttentionKernel(attention)
    except ValueError:  # named in VALIDATE_INPUTS, so ComfyUI's own combo check is off for it
        return f"attention={attention!r} is not one of {', '.join(repr(k.value) for k in AttentionKernel)}."
    device = host.compute_device()
    problems = []
    for dtype in QUEUE_CHECK_DTYPES:
        try:
            resolve_attention(kernel, device, dtype)
            return None
        except AttentionError as error:
            problems.append(str(error))
    return problems[0]


def speed_input(value, node: str) -> Speed:
    """The Sampler's optional speed input as a Speed; refused naming what was connected."""
    if value is None:
        return NO_SPEED_NODE
    if isinstance(value, Speed):
        return value
    raise StrategyError(f"speed ({node}) got {connected(value)}, not a speed setting; connect the speed output of a "
                        "Speed (VidMem) node, or leave it empty.")
