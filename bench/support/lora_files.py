"""A random LoRA on every linear layer of a Wan transformer's blocks, written as a real file: what the LoRA bench
(bench/lora.py) and the compile part of the speed bench (bench/support/speed_compile.py) load as a user's would be."""

from __future__ import annotations

from pathlib import Path

import safetensors.torch
import torch

# original Wan names of every linear layer in a block, with their diffusers twins
BLOCK_LINEARS = {
    "self_attn.q": "attn1.to_q", "self_attn.k": "attn1.to_k", "self_attn.v": "attn1.to_v", "self_attn.o": "attn1.to_out.0",
    "cross_attn.q": "attn2.to_q", "cross_attn.k": "attn2.to_k", "cross_attn.v": "attn2.to_v", "cross_attn.o": "attn2.to_out.0",
    "ffn.0": "ffn.net.0.proj", "ffn.2": "ffn.net.2",
}


def write_lora(model, blocks: int, path: Path, rank: int = 64) -> Path:
    """A lightx2v-style file (`diffusion_model.blocks.N.self_attn.q.lora_down.weight` + `.alpha`, alpha = rank) for
    every linear layer of `model`'s first `blocks` blocks: small random float32 values (a strength-1 LoRA that moves
    the output a little, as a trained one does)."""
    gen = torch.Generator().manual_seed(1)
    tensors = {}
    for i in range(blocks):
        for original, ours in BLOCK_LINEARS.items():
            layer = model.get_submodule(f"blocks.{i}.{ours}")
            key = f"diffusion_model.blocks.{i}.{original}"
            tensors[f"{key}.lora_down.weight"] = torch.randn(rank, layer.in_features, generator=gen) * 0.01
            tensors[f"{key}.lora_up.weight"] = torch.randn(layer.out_features, rank, generator=gen) * 0.01
            tensors[f"{key}.alpha"] = torch.tensor(float(rank))
    safetensors.torch.save_file(tensors, str(path))
    return path
