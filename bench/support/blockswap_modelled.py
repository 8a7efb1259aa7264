"""bench/blockswap.py, modelled part (NOT measured: no GPU here): per-block bytes and FLOPs of
the published Wan 2.1 and CogVideoX transformers, built on the meta device from the shipped
configs, replayed through vidmem.memory.swap_model (which drives the engine's own StreamSchedule)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import partial

import torch
from torch.utils.flop_counter import FlopCounterMode

from vidmem.memory.swap_model import BlockCost, GpuSpec, simulate
from vidmem.pipelines.configs import MODELS_DIR  # the shipped configs (taken from diffusers' conversion scripts)

MODELS = ("wan2.1-t2v-1.3b", "wan2.1-t2v-14b", "cogvideox-2b", "cogvideox-5b")


@dataclass(frozen=True)
class Family:
    """How a family's pipeline calls its transformer: what the model needs to know."""

    blocks_attr: str
    channels_first: bool  # latents [B, C, T, H, W] (Wan) or [B, T, C, H, W] (CogVideoX)
    text_tokens: int  # the pipeline's max_sequence_length
    cfg_batch: int  # classifier-free guidance as one forward at this batch...
    forwards_per_step: int  # ...or as this many forwards per step
    shapes: tuple[tuple[int, int, int], ...]  # (width, height, frames) at 480p and 720p


FAMILIES = {  # by transformer class
    "WanTransformer3DModel": Family("blocks", True, 512, 1, 2, ((832, 480, 81), (1280, 720, 81))),
    "CogVideoXTransformer3DModel": Family("transformer_blocks", False, 226, 2, 1, ((720, 480, 49), (1280, 720, 81))),
}


def transformer_config(name: str) -> tuple[str, dict]:
    """(diffusers class name, constructor config) of a shipped model's transformer."""
    spec = json.loads((MODELS_DIR / f"{name}.json").read_text())["components"]["transformer"]
    return spec["class"], spec["config"]


STEPS = 50  # both pipelines' default num_inference_steps
BANDWIDTHS = {"PCIe 3.0 x4": 3.2e9, "PCIe 3.0 x8": 6.5e9, "PCIe 3.0 x16": 12.5e9, "PCIe 4.0 x16": 25e9,
              "PCIe 5.0 x16": 50e9}


@dataclass(frozen=True)
class Measured:
    """One architecture at one shape, per transformer forward (FLOPs of matmuls and attention)."""

    key: str  # "<model>@<W>x<H>x<F>"
    block_bytes: tuple[int, ...]  # bf16 parameter bytes per block
    block_flops: tuple[float, ...]
    other_flops: float  # embeddings and head
    forwards: int  # per call, at STEPS steps

    def costs(self, gpu: GpuSpec) -> tuple[list[BlockCost], float]:
        blocks = [BlockCost(b, gpu.compute_s(f)) for b, f in zip(self.block_bytes, self.block_flops)]
        return blocks, gpu.compute_s(self.other_flops)


def meta_inputs(family: Family, config: dict, shape: tuple[int, int, int]) -> dict:
    """The transformer's inputs at `shape` (VAE 8x spatial, 4x temporal; 16 latent channels)."""
    width, height, frames = shape
    latent_frames, batch = (frames - 1) // 4 + 1, family.cfg_batch
    meta = partial(torch.empty, device="meta")
    layout = (batch, 16, latent_frames) if family.channels_first else (batch, latent_frames, 16)
    inputs = dict(hidden_states=meta(*layout, height // 8, width // 8),
                  encoder_hidden_states=meta(batch, family.text_tokens, 4096), timestep=meta(batch, dtype=torch.long))
    if config.get("use_rotary_positional_embeddings"):  # CogVideoX-5b: the pipeline passes RoPE in
        tokens, head_dim = latent_frames * (height // 16) * (width // 16), config.get("attention_head_dim", 64)
        inputs["image_rotary_emb"] = (meta(tokens, head_dim), meta(tokens, head_dim))
    return inputs


def measure(name: str, shape: tuple[int, int, int]) -> Measured:
    """Bytes and FLOPs of every block from one forward of the real-size model on the meta device."""
    import diffusers

    class_name, config = transformer_config(name)
    family = FAMILIES[class_name]
    with torch.device("meta"):
        model = getattr(diffusers, class_name)(**config).eval()
    blocks = getattr(model, family.blocks_attr)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(**meta_inputs(family, config, shape))
    counts = {module: sum(ops.values()) for module, ops in counter.get_flop_counts().items()}
    prefix = f"{class_name}.{family.blocks_attr}"
    block_flops = tuple(float(counts[f"{prefix}.{i}"]) for i in range(len(blocks)))
    block_bytes = tuple(2 * sum(p.numel() for p in block.parameters()) for block in blocks)
    key = f"{name}@{'x'.join(map(str, shape))}"
    return Measured(key, block_bytes, block_flops, counts["Global"] - sum(block_flops), STEPS * family.forwards_per_step)


def modelled_tiers(blocks: int) -> list[tuple[str, int, int]]:
    """(tier, N, prefetch): block_swap N in {1, half, all}; sequential as every block streamed."""
    tiers = [("block_swap", n, k) for n in sorted({1, blocks // 2, blocks}) for k in (0, 1, 2)]
    return tiers + [("sequential", blocks, k) for k in (0, 1, 2)]


def model_overheads(measured: list[Measured], gpu: GpuSpec) -> dict[str, float]:
    overheads = {}
    for m in measured:
        blocks, other_s = m.costs(gpu)
        for tier, n, k in modelled_tiers(len(blocks)):
            timeline = simulate(blocks, n, k, gpu.pcie_bytes_per_s, forwards=m.forwards, other_compute_s=other_s)
            overheads[f"{m.key}/{tier}:{n}:{k}"] = timeline.overhead
    return overheads


def bandwidth_sweep(measured: list[Measured], gpu: GpuSpec) -> dict[str, dict[str, float]]:
    """Overhead of streaming every block at prefetch 0 and 1, per PCIe link, at 480p Wan."""
    sweep = {}
    for m in (m for m in measured if m.key.startswith("wan") and "x480x" in m.key):
        blocks, other_s = m.costs(gpu)
        for k in (0, 1):
            sweep[f"{m.key} all:{k}"] = {
                link: simulate(blocks, len(blocks), k, bw, forwards=m.forwards, other_compute_s=other_s).overhead
                for link, bw in BANDWIDTHS.items()
            }
    return sweep
