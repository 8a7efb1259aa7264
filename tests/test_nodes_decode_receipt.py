"""Video VAE Decode's receipt names the decode as it ran (pipelines/decode.py decode_as_run): the VAE's
tier as applied, the tiling and slicing of the rung that ran. It used to print the Strategy as asked,
with blocks_to_swap, the text encoder and activation chunks, none of which touch the VAE (review r21)."""

from __future__ import annotations

import pytest
import torch

from vidmem.memory import MemoryStrategy, VaeTiling
from vidmem.memory.vae import DecodeReport
from vidmem.nodes.decode import VidMemVAEDecode
from vidmem.nodes.strategy import StrategyChoice
from vidmem.pipelines.decode import decode_as_run, latent_channels

VARIANT = "wan2.1-t2v"


def latent_for(loaded, height: int, width: int) -> dict:
    """A random latent of the pipeline's own VAE, `height` x `width` latent pixels, 3 latent frames."""
    torch.manual_seed(0)
    return {"samples": torch.randn(1, latent_channels(loaded.pipe), 3, height, width)}


def strategy_line(loaded, latent: dict, strategy: MemoryStrategy) -> str:
    out = VidMemVAEDecode().decode(loaded, latent, StrategyChoice(strategy))
    (line,) = [line for line in out["ui"]["text"][0].splitlines() if line.startswith("strategy: ")]
    assert line == "strategy: " + out["ui"]["vidmem_receipt"][0]["strategy"]
    return line


def test_a_block_swap_strategy_decodes_the_vae_as_model_and_says_so(tiny_loaded):
    loaded = tiny_loaded(VARIANT)
    strategy = MemoryStrategy(offload="block_swap", blocks_to_swap=2, text_encoder="cpu", activation_chunks=4)
    line = strategy_line(loaded, latent_for(loaded, 4, 4), strategy)
    assert line.startswith("strategy: VAE offload=model (asked block_swap") and line.endswith("; untiled; unsliced")
    assert not any(word in line for word in ("blocks_to_swap", "text_encoder", "activation_chunks", "prefetch"))


def test_tiling_and_slicing_are_shown_as_they_ran(tiny_loaded):
    loaded = tiny_loaded(VARIANT)
    tiling = VaeTiling(tile_size=64, overlap=16, temporal_size=16, temporal_overlap=4)  # 9 frames: one chunk
    strategy = MemoryStrategy(offload="sequential", vae_tiling=tiling, vae_slicing=True)
    tiled = strategy_line(loaded, latent_for(loaded, 16, 16), strategy)  # 128 px: 4 tiles of 64
    assert tiled == ("strategy: VAE offload=sequential prefetch=1; vae_tiling=64/16px,16/4f; "
                     "unsliced (one video: nothing to slice)")
    whole = strategy_line(loaded, latent_for(loaded, 4, 4), strategy)  # 32 px: one tile covers it
    assert whole == ("strategy: VAE offload=sequential prefetch=1; untiled (one tile covers the latent); "
                     "unsliced (one video: nothing to slice)")


@pytest.mark.parametrize("offload", ["none", "model", "block_swap", "sequential"])
def test_the_ladders_cpu_rung_is_named(offload):
    """The last rung of the decode's fallback ladder takes the offload off and decodes on the CPU."""
    report = DecodeReport(mode="whole", device="cpu")
    strategy = MemoryStrategy(offload=offload, blocks_to_swap=int(offload == "block_swap"), max_pinned_ram_gb=4.0)
    line = decode_as_run(strategy, report, torch.device("cuda", 0))
    assert line == "VAE on the CPU (the fallback ladder's last rung; the offload was removed); untiled; unsliced"


def test_the_copy_settings_that_reach_the_vae_are_shown():
    strategy = MemoryStrategy(offload="none", max_pinned_ram_gb=4.0, non_blocking=False)
    line = decode_as_run(strategy, DecodeReport(mode="whole", device="cuda:0", sliced=True), torch.device("cuda", 0))
    assert line == "VAE offload=none max_pinned_ram_gb=4 non_blocking=False; untiled; vae_slicing"
