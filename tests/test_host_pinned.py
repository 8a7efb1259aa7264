"""The pinned-RAM ceiling shared with ComfyUI's own pinned budget: nodes/host.py reads it from
comfy.model_management (faked here) and every run hands it to the engine's host pool, so the two
pools never size themselves from the same free RAM."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import psutil
import pytest
import torch

from cuda_fake import FakeCuda
from test_tiers import request_for
from vidmem.memory import MemoryStrategy
from vidmem.memory.device import CpuBackend, CudaBackend
from vidmem.memory.hostpool import HostPool
from vidmem.memory.units import GiB
from vidmem.nodes import host
from vidmem.pipelines.decode import decode
from vidmem.pipelines.hooks import RunHooks
from vidmem.pipelines.loader import load_pipeline
from vidmem.pipelines.sample import sample


def comfy_pool(monkeypatch, max_pinned: float, total_pinned: int = 0) -> None:
    """comfy.model_management as ComfyUI 0.8.0 has it: MAX_PINNED_MEMORY (-1: pinning off) and TOTAL_PINNED_MEMORY."""
    monkeypatch.setattr(host, "model_management", SimpleNamespace(MAX_PINNED_MEMORY=max_pinned,
                                                                  TOTAL_PINNED_MEMORY=total_pinned))


@pytest.fixture
def ram(monkeypatch):
    """A machine with 64 GiB of RAM free (of 96)."""
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=64 * GiB, total=96 * GiB))


def test_the_host_promises_what_comfyuis_pool_may_still_pin(monkeypatch, ram):
    comfy_pool(monkeypatch, max_pinned=0.95 * 16 * GiB, total_pinned=3 * GiB)
    assert host.pinned_promised_bytes() == int(0.95 * 16 * GiB) - 3 * GiB  # what it pinned is not free RAM any more
    comfy_pool(monkeypatch, max_pinned=-1)  # --disable-pinned-memory, or a GPU ComfyUI does not pin for
    assert host.pinned_promised_bytes() == 0
    comfy_pool(monkeypatch, max_pinned=4 * GiB, total_pinned=5 * GiB)  # over its budget (unpinned later)
    assert host.pinned_promised_bytes() == 0


def test_without_comfyui_or_its_pool_nothing_is_promised(monkeypatch, ram):
    monkeypatch.setattr(host, "model_management", None)
    assert host.pinned_promised_bytes() == 0
    monkeypatch.setattr(host, "model_management", SimpleNamespace())  # a ComfyUI without a pinned pool
    assert host.pinned_promised_bytes() == 0


def test_a_promise_larger_than_free_ram_is_logged_with_the_way_out(monkeypatch, ram, caplog):
    comfy_pool(monkeypatch, max_pinned=0.95 * 96 * GiB)
    with caplog.at_level("INFO", logger="vidmem"):
        host.pinned_promised_bytes()
    assert "max_pinned_ram_gb" in caplog.text and "--disable-pinned-memory" in caplog.text


def small_pool_pipeline(tiny_folder, variant: str):
    """A pipeline of this test's own (its tensors get pinned homes), with 1 MiB arenas."""
    loaded = load_pipeline(tiny_folder(variant), "fp32")
    return dataclasses.replace(loaded, host_pool=HostPool(1 << 20))


@pytest.mark.parametrize("comfy_max, pins", [(0.95 * 96 * GiB, False), (-1, True), (8 * GiB, True)],
                         ids=["comfyui-default-budget", "comfyui-pinning-off", "comfyui-8GiB-budget"])
def test_block_swap_pins_only_ram_comfyuis_pool_has_not_promised(tiny_folder, monkeypatch, ram, comfy_max, pins):
    """64 GiB free: ComfyUI's 91 GiB budget leaves vidmem's automatic ceiling nothing; with its
    pinning off, or an 8 GiB budget (28 GiB ceiling left), streamed blocks get pinned homes."""
    loaded = small_pool_pipeline(tiny_folder, "wan2.1-t2v")
    comfy_pool(monkeypatch, comfy_max)
    strategy = MemoryStrategy(offload="block_swap", blocks_to_swap=2, prefetch_blocks=1)
    with monkeypatch.context() as patch:
        FakeCuda().install(patch)
        sample(loaded, strategy, request_for("wan2.1-t2v"), hooks=RunHooks(pinned_elsewhere=host.pinned_promised_bytes),
               backend=CudaBackend(torch.device("cpu")))
    pool = loaded.host_pool
    assert pool.promised_elsewhere_bytes == host.pinned_promised_bytes()
    assert (pool.pinned_bytes > 0) is pins and (pool.fallbacks > 0) is not pins


def test_a_users_pinned_ceiling_is_kept_whatever_comfyui_promises(tiny_folder, monkeypatch, ram):
    loaded = small_pool_pipeline(tiny_folder, "wan2.1-t2v")
    comfy_pool(monkeypatch, 0.95 * 96 * GiB)
    strategy = MemoryStrategy(offload="block_swap", blocks_to_swap=2, prefetch_blocks=1, max_pinned_ram_gb=1.0)
    with monkeypatch.context() as patch:
        FakeCuda().install(patch)
        sample(loaded, strategy, request_for("wan2.1-t2v"), hooks=RunHooks(pinned_elsewhere=host.pinned_promised_bytes),
               backend=CudaBackend(torch.device("cpu")))
    assert loaded.host_pool.pinned_bytes > 0 and loaded.host_pool.fallbacks == 0


def test_decoding_hands_the_hosts_promise_to_the_pool_too(tiny_loaded):
    loaded = tiny_loaded("wan2.1-t2v")
    latent = sample(loaded, MemoryStrategy(), request_for("wan2.1-t2v"), backend=CpuBackend()).latent
    try:
        decode(loaded, latent, MemoryStrategy(offload="model"), backend=CpuBackend(),
               hooks=RunHooks(pinned_elsewhere=lambda: 5 * GiB))
        assert loaded.host_pool.promised_elsewhere_bytes == 5 * GiB
    finally:
        loaded.host_pool.promised_elsewhere_bytes = 0  # the session's shared pipeline, left as found
