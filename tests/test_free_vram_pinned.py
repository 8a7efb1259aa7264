"""Free VRAM and the RAM vidmem keeps page-locked for streamed blocks (memory/hostpool.py): the receipt
says how much the loaded pipelines still pin, and with unload_comfy_models on the node unpins it
(review r21: it left the pinned homes locked and said nothing). On the CUDA stand-in (tests/cuda_fake.py),
whose backend pins, as on a GPU."""

from __future__ import annotations

import pytest
import torch

from comfy_fake import FakeComfy
from cuda_fake import FakeCuda
from test_tiers import request_for
from vidmem.memory import MemoryStrategy
from vidmem.memory.device import CudaBackend
from vidmem.nodes import host
from vidmem.nodes.free import VidMemFreeVRAM
from vidmem.pipelines.loader import load_pipeline
from vidmem.pipelines.sample import sample

VARIANT = "wan2.1-t2v"
SWAP = MemoryStrategy(offload="block_swap", blocks_to_swap=1)


@pytest.fixture
def swapped(tiny_folder, monkeypatch):
    """A pipeline of its own that has sampled under block swap on the CUDA stand-in: its pool pins the swapped block."""
    comfy = FakeComfy.install(monkeypatch)
    monkeypatch.setattr(host, "model_management", comfy.mm)
    loaded = load_pipeline(tiny_folder(VARIANT), "fp32")
    FakeCuda().install(monkeypatch)
    backend = CudaBackend(torch.device("cpu"))
    first = sample(loaded, SWAP, request_for(VARIANT), backend=backend).latent["samples"]
    assert loaded.host_pool.pinned_bytes > 0
    return loaded, backend, first


def test_unload_comfy_models_unpins_the_streamed_blocks_homes(swapped):
    loaded, backend, first = swapped
    pinned = loaded.host_pool.pinned_bytes
    out = VidMemFreeVRAM().free("x", unload_comfy_models=True)
    report = out["ui"]["vidmem_receipt"][0]["pinned_host"]
    assert loaded.host_pool.pinned_bytes == 0
    assert report["unpinned_bytes"] >= pinned and report["pinned_bytes"] == 0  # other tests' pools may count too
    assert "pinned RAM for streamed blocks: " in out["ui"]["text"][0] and "unpinned" in out["ui"]["text"][0]
    # The weights now live in pageable RAM: the next run streams (and pins) them again, with the same result.
    again = sample(loaded, SWAP, request_for(VARIANT), backend=backend).latent["samples"]
    assert torch.equal(again, first) and loaded.host_pool.pinned_bytes == pinned


def test_without_it_the_receipt_says_what_stays_pinned(swapped):
    loaded, _backend, _first = swapped
    pinned = loaded.host_pool.pinned_bytes
    out = VidMemFreeVRAM().free("x", unload_comfy_models=False)
    report = out["ui"]["vidmem_receipt"][0]["pinned_host"]
    assert loaded.host_pool.pinned_bytes == pinned
    assert report["pinned_bytes"] >= pinned and report["pools"] >= 1 and report["unpinned_bytes"] == 0
    text = out["ui"]["text"][0]
    assert "pinned RAM still locked by" in text and "(turn unload_comfy_models on to unpin it)" in text
