"""Block-swap invariants checked through a test backend: pinned homes, no copy on evict, receipts."""

from __future__ import annotations

import dataclasses

import pytest
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


def private_copy(tiny_folder, variant: str, arena_bytes: int = 64 << 10):
    """A pipeline of our own (pinning re-homes weights) with small arenas."""
    return dataclasses.replace(load_pipeline(tiny_folder(variant), "fp32"), host_pool=HostPool(arena_bytes))


def swapped_tensors(loaded, n: int, expert: str = "transformer") -> list[torch.Tensor]:
    blocks = getattr(loaded.pipe, expert).blocks
    return [p for block in list(blocks)[len(blocks) - n :] for p in [*block.parameters(), *block.buffers()]]


def test_streamed_weights_get_one_pinned_home_reused_run_over_run(tiny_folder):
    loaded = private_copy(tiny_folder, "wan2.1-t2v")
    strategy = MemoryStrategy(offload="block_swap", blocks_to_swap=1, max_pinned_ram_gb=1.0)
    swapped = swapped_tensors(loaded, 1)
    values = [t.detach().clone() for t in swapped]
    backend = StrictBackend(pinning=True)
    first = sample(loaded, strategy, request_for("wan2.1-t2v"), backend=backend)
    pool = loaded.host_pool
    assert pool.allocations == len(swapped) and backend.arenas == len(pool._arenas) >= 1
    assert all(pool._holds(t) for t in swapped)  # re-homed into the arenas...
    assert all(torch.equal(t, v) for t, v in zip(swapped, values))  # ...with the same values
    homes = storage_map(loaded.pipe)
    for _ in range(2):
        again = sample(loaded, strategy, request_for("wan2.1-t2v"), backend=backend)
        assert torch.equal(again.latent["samples"], first.latent["samples"])
    assert pool.allocations == len(swapped) and backend.arenas == len(pool._arenas)  # nothing new after warm-up
    assert storage_map(loaded.pipe) == homes
    assert first.receipt["swap"]["host_pool"]["allocations"] == len(swapped)
    assert pool.pinned_bytes == len(pool._arenas) * pool.arena_bytes  # the ceiling counts what is locked


def test_past_the_ceiling_tensors_stay_pageable(tiny_folder):
    loaded = private_copy(tiny_folder, "wan2.1-t2v")
    before = storage_map(loaded.pipe)
    backend = StrictBackend(pinning=True)
    sample(loaded, MemoryStrategy(offload="block_swap", blocks_to_swap=1, max_pinned_ram_gb=0.0),
           request_for("wan2.1-t2v"), backend=backend)
    assert backend.arenas == 0 and loaded.host_pool.allocations == 0 and loaded.host_pool.fallbacks > 0
    assert storage_map(loaded.pipe) == before


def test_a_refused_pin_falls_back_to_pageable(tiny_folder):
    class Refusing(StrictBackend):
        def pin_arena(self, nbytes):
            raise RuntimeError("cudaHostAlloc failed")

    loaded = private_copy(tiny_folder, "wan2.1-t2v")
    before = storage_map(loaded.pipe)
    sample(loaded, MemoryStrategy(offload="block_swap", blocks_to_swap=1, max_pinned_ram_gb=1.0),
           request_for("wan2.1-t2v"), backend=Refusing(pinning=True))
    assert loaded.host_pool.allocations == 0 and loaded.host_pool.fallbacks > 0
    assert storage_map(loaded.pipe) == before


def test_pool_is_shared_by_both_experts_of_a14b(tiny_folder):
    loaded = private_copy(tiny_folder, "wan2.2-a14b")
    sample(loaded, MemoryStrategy(offload="block_swap", blocks_to_swap=2, max_pinned_ram_gb=1.0),
           request_for("wan2.2-a14b", steps=4), backend=StrictBackend(pinning=True))
    expected = len(swapped_tensors(loaded, 2)) + len(swapped_tensors(loaded, 2, "transformer_2"))
    assert loaded.host_pool.allocations == expected


def test_a_tied_tensor_is_pinned_once(tiny_folder):
    """T5 ties its shared embedding into the encoder: under sequential both owners share one home."""
    loaded = private_copy(tiny_folder, "wan2.1-t2v", arena_bytes=1 << 20)
    encoder = loaded.pipe.text_encoder
    sample(loaded, MemoryStrategy(offload="sequential", text_encoder="device", max_pinned_ram_gb=1.0),
           request_for("wan2.1-t2v"), backend=StrictBackend(pinning=True))
    unique = {id(s.current()) for m in encoder.modules() if next(m.children(), None) is None for s in own_slots(m)}
    shared = encoder.shared.weight
    assert shared is encoder.encoder.embed_tokens.weight
    assert loaded.host_pool.allocations <= slot_count(loaded.pipe.transformer) + len(unique)


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
    (device_copy,), token = backend.copy_group([host], non_blocking=True, side_stream=True, timed=True)
    assert device_copy is host and token is None and backend.evicted(host) is host
    assert not backend.can_pin and HostPool().adopt([], backend, cap_bytes=1 << 30) == []


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
    # The running block plus one evicted block the GPU may still be reading: with 2 blocks per
    # expert and no prefetch, streaming saves no peak on these tiny experts.
    assert sizes["none"] > sizes["model"] == sizes["swap1"] == sizes["swap2"] > sizes["sequential"] > 0
    tensor_bytes = lambda m: sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()])  # noqa: E731
    transformer = tensor_bytes(loaded.pipe.transformer)
    assert sizes["none"] == 2 * sizes["model"] == 2 * transformer  # both experts at once vs one at a time

    asked = []
    result = sample(loaded, MemoryStrategy(offload="model", text_encoder="cpu"), request_for("wan2.2-a14b"),
                    hooks=RunHooks(make_room=lambda nbytes, device, **_: asked.append((nbytes, device))), backend=CpuBackend())
    assert asked == [(sizes["model"], torch.device("cpu"))] == [(result.receipt["device_weight_bytes"], torch.device("cpu"))]


def test_a14b_hands_the_swap_pool_to_the_low_noise_expert_before_it_runs(tiny_loaded):
    loaded = tiny_loaded("wan2.2-a14b")
    recorder = Recorder()
    sample(loaded, MemoryStrategy(offload="block_swap", blocks_to_swap=2, prefetch_blocks=1),
           request_for("wan2.2-a14b", steps=4), backend=StrictBackend(), observer=recorder)
    events = recorder.events
    first_low = next(i for i, (kind, name) in enumerate(events) if name.startswith("transformer_2."))
    assert events[first_low] == ("prefetch", "transformer_2.blocks.0")  # copied ahead, not on demand
    assert first_low < events.index(("onload", "transformer_2"))  # before the expert even activates
    high_after = [e for e in events[first_low:] if e[1].startswith("transformer.") and e[0] != "evict"]
    assert high_after == []  # nothing of the high-noise expert is copied after the hand-off
    assert {("evict", "transformer.blocks.0"), ("evict", "transformer.blocks.1")} & set(events[:first_low])


@pytest.mark.parametrize("swapped, prefetch, at_once", [(4, 0, 2), (4, 1, 3), (5, 2, 4), (2, 3, 2)])
def test_peak_weight_bytes_count_the_running_prefetched_and_in_flight_blocks(swapped, prefetch, at_once):
    """Six blocks of distinct sizes: the peak holds the core plus the `at_once` largest swapped
    blocks (the running one, its prefetches, and one evicted block a queued kernel may still read),
    never more blocks than are swapped."""
    from vidmem.memory.offload import StageComponents, device_weight_bytes

    blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8 * (i + 1), bias=False) for i in range(6))
    model = torch.nn.Module()
    model.blocks, model.head = blocks, torch.nn.Linear(8, 3, bias=False)
    size = lambda m: sum(p.numel() * p.element_size() for p in m.parameters())  # noqa: E731
    streamed = sorted((size(b) for b in blocks[6 - swapped:]), reverse=True)
    expected = size(model) - sum(streamed) + sum(streamed[:at_once])
    strategy = MemoryStrategy(offload="block_swap", blocks_to_swap=swapped, prefetch_blocks=prefetch)
    assert device_weight_bytes(StageComponents({"transformer": model}, {"transformer": blocks}), strategy) == expected


class _Group:
    """A streamed group's verbs, recording read-ahead advice."""

    def __init__(self, name: str, advised: list) -> None:
        self.name, self.nbytes, self.on_device, self._advised = name, 1, False, advised

    def onload(self, timed: bool = False) -> None:
        self.on_device = True

    def wait(self) -> None:
        return None

    def evict(self) -> None:
        self.on_device = False

    def read_ahead(self) -> int:
        self._advised.append(self.name)
        return 1


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_the_schedule_reads_ahead_the_groups_past_its_prefetch_window(prefetch):
    from vidmem.memory.blockswap import READ_AHEAD_GROUPS, StreamSchedule
    from vidmem.memory.device import CpuBackend

    advised: list[str] = []
    groups = [_Group(f"b{i}", advised) for i in range(6)]
    schedule = StreamSchedule(groups, prefetch, True, CpuBackend(), lambda kind, g: None)
    schedule.before_forward(groups[0])
    schedule.after_forward(groups[0])
    assert advised == [f"b{i}" for i in range(1 + prefetch, 1 + prefetch + READ_AHEAD_GROUPS)]
    assert all(g.on_device == (1 <= i <= prefetch) for i, g in enumerate(groups))  # advice copies nothing


def test_read_ahead_advises_only_file_backed_tensors(tmp_path):
    """madvise(MADV_WILLNEED) on the mapping under each tensor, at any offset in the file; other tensors are
    left alone, and a tensor's bytes are never changed."""
    import mmap

    from vidmem.memory.storage import open_safetensors
    from vidmem.memory.storage.mapping import read_ahead

    if not hasattr(mmap, "MADV_WILLNEED"):
        pytest.skip("this platform's mmap has no MADV_WILLNEED: read-ahead is a no-op here")
    from safetensors.torch import save_file

    tensors = {"a": torch.randn(3), "b": torch.randn(1000, 7)}  # b starts at an unaligned offset
    save_file(tensors, tmp_path / "w.safetensors")
    opened = open_safetensors(tmp_path / "w.safetensors")
    mapped = [opened.tensors["a"], opened.tensors["b"]]
    assert read_ahead(mapped) == sum(t.numel() * t.element_size() for t in mapped)
    assert read_ahead([torch.randn(4), torch.empty(0)]) == 0
    assert torch.equal(opened.tensors["b"], tensors["b"])
