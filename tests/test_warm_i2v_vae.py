"""Image-to-video uses the VAE in two stages: the sampler encodes the image with it, the decode
decodes. Their warm stores share it: the device holds one copy between calls, never two, and a
tier that does not keep the VAE through the sampler's call leaves the decode's copy alone."""

from __future__ import annotations

from dataclasses import replace

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


def vae_hosts(loaded) -> list[torch.Tensor]:
    """The VAE's host tensors as they are now, between calls (mid-call its parameters point at device
    copies, so keys taken then would name those instead)."""
    return [t.data for t in list(loaded.pipe.vae.parameters()) + list(loaded.pipe.vae.buffers())]


class Cancelled(Exception):
    pass


def decode_store_vae_at_step(loaded, backend, hosts, seen):
    """A step callback noting the VAE bytes the decode's store keeps while the sampler runs."""
    def on_step(step, total):
        if step == 1:
            seen.append(loaded.warm_store("decode", backend).held_bytes_of(hosts))
    return on_step


def cancel_at_step(step, total):
    if step == 1:
        raise Cancelled()


def test_after_a_cancelled_sampler_call_the_next_one_still_takes_the_decodes_vae(tiny_folder, tmp_path, monkeypatch):
    """The takeover is decided by the call about to run (tier none keeps the VAE to its end), not by
    what the last call kept: a cancelled (or out-of-memory) call kept nothing, which used to make the
    next call upload a second VAE copy beside the decode's."""
    loaded = load_pipeline(tiny_folder(VARIANT), "fp32")
    FakeCuda().install(monkeypatch)
    backend = CudaBackend(torch.device("cpu"))
    hooks = RunHooks(prompt_cache=PromptCache(tmp_path / "prompts"))
    none = MemoryStrategy(offload="none")
    hosts = vae_hosts(loaded)
    vae_bytes = sum(t.numel() * t.element_size() for t in hosts)
    first = sample(loaded, none, request_for(VARIANT), hooks=hooks, backend=backend)
    decode(loaded, first.latent, backend=backend)
    with pytest.raises(Cancelled):
        sample(loaded, none, request_for(VARIANT), hooks=replace(hooks, on_step=cancel_at_step), backend=backend)
    decode(loaded, first.latent, backend=backend)
    assert vae_copies(loaded, backend) == vae_bytes
    mid_call = []
    third = sample(loaded, none, request_for(VARIANT), backend=backend,
                   hooks=replace(hooks, on_step=decode_store_vae_at_step(loaded, backend, hosts, mid_call)))
    assert mid_call == [0] and vae_copies(loaded, backend) == vae_bytes
    assert third.receipt["warm"]["reused_bytes"] >= vae_bytes
    assert torch.equal(first.latent["samples"], third.latent["samples"])


def test_a_sampler_switched_from_tier_model_to_none_takes_the_decodes_vae(tiny_folder, tmp_path, monkeypatch):
    """Tier model evicts the VAE mid-call and leaves the decode's copy alone; the next call under tier
    none keeps it to its end and takes it over, whatever the last call's tier was."""
    loaded = load_pipeline(tiny_folder(VARIANT), "fp32")
    FakeCuda().install(monkeypatch)
    backend = CudaBackend(torch.device("cpu"))
    hooks = RunHooks(prompt_cache=PromptCache(tmp_path / "prompts"))
    hosts = vae_hosts(loaded)
    vae_bytes = sum(t.numel() * t.element_size() for t in hosts)
    first = sample(loaded, MemoryStrategy(offload="model"), request_for(VARIANT), hooks=hooks, backend=backend)
    decode(loaded, first.latent, backend=backend)
    assert loaded.warm_store("decode", backend).held_bytes_of(hosts) == vae_bytes
    mid_call = []
    second = sample(loaded, MemoryStrategy(offload="none"), request_for(VARIANT), backend=backend,
                    hooks=replace(hooks, on_step=decode_store_vae_at_step(loaded, backend, hosts, mid_call)))
    assert mid_call == [0] and vae_copies(loaded, backend) == vae_bytes
    assert second.receipt["warm"]["reused_bytes"] >= vae_bytes
    assert torch.equal(first.latent["samples"], second.latent["samples"])


def test_a_sequential_sampler_that_pins_the_vae_leaves_the_decodes_copy_keyed_to_the_new_homes(tiny_folder, tmp_path,
                                                                                               monkeypatch):
    """Under `sequential` the sampler streams the VAE's leaves and gives them pinned homes: the decode's kept
    copies must follow them (every store, not only the sampler's), or they orphan the old host tensors and the
    next decode uploads the whole VAE again."""
    loaded = load_pipeline(tiny_folder(VARIANT), "fp32")
    FakeCuda().install(monkeypatch)
    backend = CudaBackend(torch.device("cpu"))
    hooks = RunHooks(prompt_cache=PromptCache(tmp_path / "prompts"))
    first = sample(loaded, MemoryStrategy(offload="model"), request_for(VARIANT), hooks=hooks, backend=backend)
    decode(loaded, first.latent, backend=backend)  # the decode (tier none) keeps the VAE
    vae_bytes = sum(t.numel() * t.element_size() for t in vae_hosts(loaded))
    streamed = sample(loaded, MemoryStrategy(offload="sequential", prefetch_blocks=1), request_for(VARIANT), hooks=hooks,
                      backend=backend)
    assert loaded.warm_store("decode", backend).held_bytes_of(vae_hosts(loaded)) == vae_bytes  # keyed to the pinned homes
    again = decode(loaded, streamed.latent, backend=backend)
    assert again.receipt["warm"]["uploaded_bytes"] == 0 and again.receipt["warm"]["reused_bytes"] >= vae_bytes
