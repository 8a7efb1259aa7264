"""The host pool's counts name distinct host tensors: a call after call meets the same tensors again
(every call builds its groups anew), and receipt["swap"]["host_pool"] must not grow with them."""
import torch

from cuda_fake import FakeCuda
from test_tiers import request_for
from vidmem.memory import MemoryStrategy
from vidmem.memory.device import CudaBackend
from vidmem.pipelines.loader import load_pipeline
from vidmem.pipelines.sample import sample


def test_pageable_count_is_flat_across_calls(tiny_folder, monkeypatch):
    loaded = load_pipeline(tiny_folder("wan2.1-t2v"), "fp32")
    FakeCuda().install(monkeypatch)
    backend = CudaBackend(torch.device("cpu"))
    strategy = MemoryStrategy(offload="block_swap", blocks_to_swap=2, prefetch_blocks=1, max_pinned_ram_gb=0)
    counts = []
    for _ in range(3):
        sample(loaded, strategy, request_for("wan2.1-t2v"), backend=backend)
        counts.append(loaded.host_pool.stats()["fallbacks"])
    assert counts[0] > 0 and counts == [counts[0]] * 3
