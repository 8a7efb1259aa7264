"""Image-to-video uses the VAE in two stages: the sampler encodes the image with it, the decode
decodes. Their warm stores share it: the device holds one copy between calls, never two, and a
tier that does not keep the VAE through the sampler's call leaves the decode's copy alone."""

from __future__ import annotations

import pytest
import torch

from cuda_fake import FakeCuda
from test_tiers import request_for
from vidmem.memory import MemoryStrategy
from vidmem.memory.device import CudaBackend
from vidmem.pipelines.decode import decode
from vidmem.pipelines.hooks import RunHooks
from vidmem.pipelines.loader import load_pipeline
from vidmem.pipelines.prompt_cache import PromptCache
from vidmem.pipelines.sample import sample

VARIANT = "wan2.1-i2v"


def vae_copies(loaded, backend) -> int:
    """Bytes of VAE copies the pipeline's stores keep, over all of them."""
    vae = list(loaded.pipe.vae.parameters()) + list(loaded.pipe.vae.buffers())
    return sum(loaded.warm_store(stage, backend).held_bytes_of(vae) for stage in ("sample", "decode"))


@pytest.mark.parametrize("tier", ["none", "model"])
def test_the_sampler_and_the_decode_keep_one_copy_of_the_vae(tiny_folder, tmp_path, tier, monkeypatch):
    loaded = load_pipeline(tiny_folder(VARIANT), "fp32")
    FakeCuda().install(monkeypatch)
    backend = CudaBackend(torch.device("cpu"))
    hooks = RunHooks(prompt_cache=PromptCache(tmp_path / "prompts"))
    strategy = MemoryStrategy(offload=tier)
    vae_bytes = sum(t.numel() * t.element_size() for t in list(loaded.pipe.vae.parameters()) + list(loaded.pipe.vae.buffers()))
    runs = []
    for _ in range(2):
        sampled = sample(loaded, strategy, request_for(VARIANT), hooks=hooks, backend=backend)
        assert vae_copies(loaded, backend) <= vae_bytes
        decoded = decode(loaded, sampled.latent, backend=backend)
        assert vae_copies(loaded, backend) == vae_bytes  # the decode keeps it: one copy
        runs.append((sampled, decoded))
    (first_sample, first_decode), (second_sample, second_decode) = runs
    if tier == "none":  # the sampler keeps the VAE too: each stage takes the other's copy instead of uploading
        assert first_decode.receipt["warm"]["uploaded_bytes"] == 0
        assert second_sample.receipt["warm"]["uploaded_bytes"] == 0
    assert second_decode.receipt["warm"]["uploaded_bytes"] == 0  # tier model: the sampler left the decode's copy alone
    assert torch.equal(first_sample.latent["samples"], second_sample.latent["samples"])
    assert torch.equal(first_decode.frames, second_decode.frames)
