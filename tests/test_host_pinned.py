"""The pinned-RAM ceiling shared with ComfyUI's own pinned budget: nodes/host.py reads what the budget
still allows from comfy.model_management (faked here) and every run hands it to the engine's host
pool, whose automatic ceiling stays within it (one ceiling on locked memory for both pools)."""

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
    """A machine with 20 GiB of RAM free (of 32): vidmem's own automatic ceiling is 10 GiB."""
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=20 * GiB, total=32 * GiB))


def test_the_host_reports_what_comfyuis_budget_still_allows(monkeypatch, ram):
    comfy_pool(monkeypatch, max_pinned=0.95 * 16 * GiB, total_pinned=3 * GiB)
    assert host.pinned_room_bytes() == int(0.95 * 16 * GiB) - 3 * GiB
    comfy_pool(monkeypatch, max_pinned=-1)  # --disable-pinned-memory, or a GPU ComfyUI does not pin for
    assert host.pinned_room_bytes() is None
    comfy_pool(monkeypatch, max_pinned=4 * GiB, total_pinned=5 * GiB)  # over its budget (unpinned later)
    assert host.pinned_room_bytes() == 0


def test_without_comfyui_or_its_budget_there_is_no_host_ceiling(monkeypatch, ram):
    monkeypatch.setattr(host, "model_management", None)
    assert host.pinned_room_bytes() is None
    monkeypatch.setattr(host, "model_management", SimpleNamespace())  # a ComfyUI without a pinned pool
    assert host.pinned_room_bytes() is None


def small_pool_pipeline(tiny_folder, variant: str):
    """A pipeline of this test's own (its tensors get pinned homes), with 1 MiB arenas."""
    loaded = load_pipeline(tiny_folder(variant), "fp32")
    return dataclasses.replace(loaded, host_pool=HostPool(1 << 20))


def run_block_swap(loaded, monkeypatch, strategy):
    with monkeypatch.context() as patch:
        FakeCuda().install(patch)
        sample(loaded, strategy, request_for("wan2.1-t2v"), hooks=RunHooks(pinned_room=host.pinned_room_bytes),
               backend=CudaBackend(torch.device("cpu")))
    return loaded.host_pool


@pytest.mark.parametrize("comfy_max, comfy_pinned, pins", [(0.95 * 32 * GiB, 0, True), (-1, 0, True),
                                                          (8 * GiB, 8 * GiB, False)],
                         ids=["comfyui-default-budget", "comfyui-pinning-off", "comfyui-budget-used-up"])
def test_block_swap_pins_within_comfyuis_budget(tiny_folder, monkeypatch, ram, comfy_max, comfy_pinned, pins):
    """A default ComfyUI (95% of RAM) leaves vidmem its own ceiling, so streamed blocks get pinned
    homes; so does ComfyUI with pinning off; a budget ComfyUI has used up leaves vidmem none."""
    loaded = small_pool_pipeline(tiny_folder, "wan2.1-t2v")
    comfy_pool(monkeypatch, comfy_max, comfy_pinned)
    pool = run_block_swap(loaded, monkeypatch, MemoryStrategy(offload="block_swap", blocks_to_swap=2, prefetch_blocks=1))
    assert pool.host_room_bytes == host.pinned_room_bytes()
    assert (pool.pinned_bytes > 0) is pins and (pool.fallbacks > 0) is not pins


def test_a_users_pinned_ceiling_is_kept_whatever_comfyui_allows(tiny_folder, monkeypatch, ram):
    loaded = small_pool_pipeline(tiny_folder, "wan2.1-t2v")
    comfy_pool(monkeypatch, 8 * GiB, 8 * GiB)
    strategy = MemoryStrategy(offload="block_swap", blocks_to_swap=2, prefetch_blocks=1, max_pinned_ram_gb=1.0)
    pool = run_block_swap(loaded, monkeypatch, strategy)
    assert pool.pinned_bytes > 0 and pool.fallbacks == 0


def test_decoding_hands_the_hosts_budget_to_the_pool_too(tiny_loaded):
    loaded = tiny_loaded("wan2.1-t2v")
    latent = sample(loaded, MemoryStrategy(), request_for("wan2.1-t2v"), backend=CpuBackend()).latent
    try:
        decode(loaded, latent, MemoryStrategy(offload="model"), backend=CpuBackend(),
               hooks=RunHooks(pinned_room=lambda: 5 * GiB))
        assert loaded.host_pool.host_room_bytes == 5 * GiB
    finally:
        loaded.host_pool.host_room_bytes = None  # the session's shared pipeline, left as found
