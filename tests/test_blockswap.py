"""Block-swap invariants checked through a test backend: pinned homes, no copy on evict, receipts."""

from __future__ import annotations

import torch

from backends import Recorder, StrictBackend
from test_tiers import request_for, storage_map
from vidmem.memory import MemoryStrategy
from vidmem.memory.hostpool import HostPool
from vidmem.memory.residency import own_slots
from vidmem.memory.device import CpuBackend
from vidmem.pipelines.loader import load_pipeline
from vidmem.pipelines.sample import sample


def slot_count(module) -> int:
    """Tensors as the engine copies them: a tied weight (T5's shared embedding) once."""
    return len({id(slot.current()) for m in module.modules() for slot in own_slots(m)})


class CountingPin:
    """Stands in for cudaHostAlloc + copy: a fresh host tensor per call, counted."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, host: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return host.clone()


def swapped_parameters(loaded, n: int) -> list[torch.nn.Parameter]:
    blocks = loaded.pipe.transformer.blocks
    return [p for block in list(blocks)[len(blocks) - n :] for p in block.parameters()]


def test_streamed_weights_get_one_pinned_home_reused_run_over_run(tiny_folder):
    loaded = load_pipeline(tiny_folder("wan2.1-t2v"), "fp32")  # private copy: pinning re-homes weights
    pin = CountingPin()
    strategy = MemoryStrategy(offload="block_swap", blocks_to_swap=1, max_pinned_ram_gb=1.0)
    swapped = swapped_parameters(loaded, 1)
    values = [p.detach().clone() for p in swapped]
    first = sample(loaded, strategy, request_for("wan2.1-t2v"), backend=StrictBackend(pin))
    assert pin.calls == len(swapped) == loaded.host_pool.allocations
    homes = storage_map(loaded.pipe)
    assert all(torch.equal(p, v) for p, v in zip(swapped, values))  # same values, new (pinned) home
    for _ in range(2):
        again = sample(loaded, strategy, request_for("wan2.1-t2v"), backend=StrictBackend(pin))
        assert torch.equal(again.latent["samples"], first.latent["samples"])
    assert pin.calls == len(swapped)  # no host copy allocated after warm-up
    assert storage_map(loaded.pipe) == homes
    assert first.receipt["swap"]["host_pool"]["allocations"] == len(swapped)


def test_past_the_ceiling_tensors_stay_pageable(tiny_folder):
    loaded = load_pipeline(tiny_folder("wan2.1-t2v"), "fp32")
    pin = CountingPin()
    before = storage_map(loaded.pipe)
    sample(loaded, MemoryStrategy(offload="block_swap", blocks_to_swap=1, max_pinned_ram_gb=0.0),
           request_for("wan2.1-t2v"), backend=StrictBackend(pin))
    assert pin.calls == 0 and loaded.host_pool.allocations == 0 and loaded.host_pool.over_cap_tensors > 0
    assert storage_map(loaded.pipe) == before


def test_pool_is_shared_by_both_experts_of_a14b(tiny_folder):
    loaded = load_pipeline(tiny_folder("wan2.2-a14b"), "fp32")
    pin = CountingPin()
    sample(loaded, MemoryStrategy(offload="block_swap", blocks_to_swap=2, max_pinned_ram_gb=1.0),
           request_for("wan2.2-a14b", steps=4), backend=StrictBackend(pin))
    experts = [loaded.pipe.transformer, loaded.pipe.transformer_2]
    expected = sum(len(list(e.blocks.parameters())) for e in experts)
    assert loaded.host_pool.allocations == pin.calls == expected


def test_eviction_copies_nothing_and_the_receipt_counts_every_copy(tiny_loaded):
    loaded = tiny_loaded("wan2.1-t2v")
    recorder, backend = Recorder(), StrictBackend()
    result = sample(loaded, MemoryStrategy(offload="block_swap", blocks_to_swap=2, prefetch_blocks=1),
                    request_for("wan2.1-t2v"), backend=backend, observer=recorder)
    block_tensors = slot_count(loaded.pipe.transformer.blocks[0])
    resident_tensors = slot_count(loaded.pipe.transformer) - 2 * block_tensors
    text_tensors = slot_count(loaded.pipe.text_encoder)
    streamed_onloads = sum(1 for kind, name in recorder.events if kind in ("onload", "prefetch") and "." in name)
    # every copy is an onload: streamed blocks, plus each whole component once; evictions add none
    assert backend.copies == streamed_onloads * block_tensors + resident_tensors + text_tensors
    swap = result.receipt["swap"]
    block_bytes = sum(p.numel() * p.element_size() for p in loaded.pipe.transformer.blocks[0].parameters())
    assert swap["copies"] == streamed_onloads and swap["bytes_moved"] == streamed_onloads * block_bytes
    assert swap["groups"] == 2 and 0.0 <= swap["swap_cost"] < 1.0


def test_cpu_backend_moves_nothing():
    backend = CpuBackend()
    host = torch.ones(3)
    (device_copy,), token = backend.copy_group([host], non_blocking=True)
    assert device_copy is host and token is None and backend.evicted(host) is host
    assert HostPool().adopt  # pinning is opt-in through backend.pin, which the CPU backend lacks
    assert backend.pin is None


def test_weight_bytes_follow_the_tier_and_the_host_is_asked_first(tiny_loaded):
    from vidmem.memory.offload import device_weight_bytes
    from vidmem.pipelines.sample import RunHooks, sample_stage

    loaded = tiny_loaded("wan2.2-a14b")
    sizes = {}
    for label, strategy in {  # text encoder on the CPU: the tiny T5 outweighs the tiny transformer
        "none": MemoryStrategy(offload="none", text_encoder="cpu"),
        "model": MemoryStrategy(offload="model", text_encoder="cpu"),
        "swap1": MemoryStrategy(offload="block_swap", blocks_to_swap=1, prefetch_blocks=0, text_encoder="cpu"),
        "swap2": MemoryStrategy(offload="block_swap", blocks_to_swap=2, prefetch_blocks=0, text_encoder="cpu"),
        "sequential": MemoryStrategy(offload="sequential", prefetch_blocks=0, text_encoder="cpu"),
    }.items():
        sizes[label] = device_weight_bytes(sample_stage(loaded, strategy), strategy)
    # one streamed block is on the device while it runs, so swapping 1 of 2 blocks saves no peak
    assert sizes["none"] > sizes["model"] == sizes["swap1"] > sizes["swap2"] > sizes["sequential"] > 0
    tensor_bytes = lambda m: sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()])  # noqa: E731
    transformer, block = tensor_bytes(loaded.pipe.transformer), tensor_bytes(loaded.pipe.transformer.blocks[0])
    assert sizes["none"] == 2 * sizes["model"] == 2 * transformer  # both experts at once vs one at a time
    assert sizes["swap2"] == transformer - block  # two of two blocks streamed, one on the device at a time

    asked = []
    result = sample(loaded, MemoryStrategy(offload="model", text_encoder="cpu"), request_for("wan2.2-a14b"),
                    hooks=RunHooks(make_room=lambda nbytes, device: asked.append((nbytes, device))), backend=CpuBackend())
    assert asked == [(sizes["model"], torch.device("cpu"))] == [(result.receipt["device_weight_bytes"], torch.device("cpu"))]
