"""Weight storage formats: how many bytes a stored weight costs, and what it is upcast to.

A format is data shared by the engine (which dequantizes per layer at compute time), the loader
(which recognises a file's format from its tensors) and the planner (which counts host bytes and
host-to-device traffic per format). Which tensors a format stores is declared once, here
(`StorageFormat.lowers`), and read by the loaders when they lower weights (`weight_dtype`) and by
the planner when it counts them: every linear layer's weight, and token embeddings only for the
formats whose files hold them narrow. Biases, norms, convolutions and modulation tables stay in
the compute dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class StorageFormat:
    name: str  # the value users type: --weights, the loader's weight_dtype, receipts
    block_bytes: int  # bytes of one stored block of `block_size` weights (block_size 1: plain dtypes)
    block_size: int = 1
    torch_dtype: torch.dtype | None = None  # the stored dtype of plain and fp8 formats; None for GGUF
    scaled: bool = False  # fp8 with a per-tensor scale (Comfy-Org's "fp8 scaled" files)
    gguf_type: str | None = None  # gguf.GGMLQuantizationType member name
    # Whether token embeddings (nn.Embedding tables) are stored in this format too. GGUF converters
    # quantize them (city96's umt5-xxl GGUF files hold token_embd quantized; ComfyUI-GGUF
    # dequantizes it at load); Comfy-Org's fp8 files keep them 16-bit (umt5_xxl_fp8_e4m3fn_scaled:
    # `shared.weight` is bf16): an embedding is read a few rows per prompt, so storing it narrow
    # saves RAM only, at the cost of the tokens' precision. Plain dtypes: all.
    embeddings: bool = True

    @property
    def bytes_per_weight(self) -> float:
        return self.block_bytes / self.block_size

    @property
    def quantized(self) -> bool:
        """Stored below 16 bits: upcast per layer at compute time."""
        return self.bytes_per_weight < 2

    def holds(self, shape: tuple[int, ...]) -> bool:
        """Whether a tensor of `shape` can be stored in this format (GGUF blocks run along the
        last dimension, so it must be a whole number of blocks; converters keep others wide)."""
        return self.block_size == 1 or (len(shape) > 0 and shape[-1] % self.block_size == 0)

    def lowers(self, layer: nn.Module) -> bool:
        """Whether `layer`'s weight is stored in this format when a model is lowered to it: the one
        declaration the loaders (`weight_dtype`) and the planner (`--weights`) both read. Linear
        weights always, embedding tables when `embeddings`, and only shapes the format holds."""
        kinds = (nn.Linear, nn.Embedding) if self.embeddings else (nn.Linear,)
        weight = layer._parameters.get("weight") if isinstance(layer, kinds) else None
        return weight is not None and self.holds(tuple(weight.shape))

    def stored_bytes(self, numel: int) -> int:
        blocks = -(-numel // self.block_size)
        return blocks * self.block_bytes


_FORMATS = (
    StorageFormat("fp32", 4, torch_dtype=torch.float32),
    StorageFormat("bf16", 2, torch_dtype=torch.bfloat16),
    StorageFormat("fp16", 2, torch_dtype=torch.float16),
    StorageFormat("fp8_e4m3fn", 1, torch_dtype=torch.float8_e4m3fn, embeddings=False),
    StorageFormat("fp8_e5m2", 1, torch_dtype=torch.float8_e5m2, embeddings=False),
    StorageFormat("fp8_scaled", 1, torch_dtype=torch.float8_e4m3fn, scaled=True, embeddings=False),
    # GGUF block layouts (ggml-common.h): bytes per block of 32 (legacy) or 256 (k-quants) weights.
    StorageFormat("gguf_q8_0", 34, 32, gguf_type="Q8_0"),
    StorageFormat("gguf_q6_k", 210, 256, gguf_type="Q6_K"),
    StorageFormat("gguf_q5_k", 176, 256, gguf_type="Q5_K"),
    StorageFormat("gguf_q5_1", 24, 32, gguf_type="Q5_1"),
    StorageFormat("gguf_q5_0", 22, 32, gguf_type="Q5_0"),
    StorageFormat("gguf_q4_k", 144, 256, gguf_type="Q4_K"),
    StorageFormat("gguf_q4_1", 20, 32, gguf_type="Q4_1"),
    StorageFormat("gguf_q4_0", 18, 32, gguf_type="Q4_0"),
)
FORMATS = {f.name: f for f in _FORMATS}


def storage_format(name: str) -> StorageFormat:
    """The format called `name`; ValueError naming the accepted names otherwise."""
    if name not in FORMATS:
        raise ValueError(f"weights='{name}' is not a storage format vidmem reads; use one of {', '.join(FORMATS)}.")
    return FORMATS[name]
