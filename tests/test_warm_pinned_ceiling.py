"""A pinned ceiling lowered after a run that pinned applies to the homes already made: the newest
arenas are unpinned, their homes move back to pageable copies (the run stays bit-identical), and
the warm store's kept copies follow them (nothing is uploaded again)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from cuda_fake import FakeCuda
from test_tiers import block_count, request_for
from vidmem.memory import MemoryStrategy
from vidmem.memory.device import CudaBackend
from vidmem.memory.hostpool import HostPool
from vidmem.memory.units import GiB
from vidmem.pipelines.hooks import RunHooks
from vidmem.pipelines.loader import load_pipeline
from vidmem.pipelines.prompt_cache import PromptCache
from vidmem.pipelines.sample import sample

VARIANT = "wan2.1-t2v"
ARENA = 16 * 1024  # small arenas: the tiny model's streamed blocks fill several


@pytest.mark.parametrize("arenas_kept", [0, 1])
def test_lowering_the_pinned_ceiling_unpins_homes_beyond_it_and_the_run_is_unchanged(tiny_folder, tmp_path, arenas_kept,
                                                                                      monkeypatch):
    loaded = replace(load_pipeline(tiny_folder(VARIANT), "fp32"), host_pool=HostPool(arena_bytes=ARENA))
    FakeCuda().install(monkeypatch)
    backend = CudaBackend(torch.device("cpu"))
    hooks = RunHooks(prompt_cache=PromptCache(tmp_path / "prompts"))
    swap = MemoryStrategy(offload="block_swap", blocks_to_swap=block_count(loaded), prefetch_blocks=1)
    first = sample(loaded, swap, request_for(VARIANT), hooks=hooks, backend=backend)
    pool = loaded.host_pool
    assert pool.stats()["arenas"] > arenas_kept and first.receipt["warm"]["stream_pinned_bytes"] > 0
    ceiling = arenas_kept * ARENA
    lowered = replace(swap, max_pinned_ram_gb=ceiling / GiB)
    second = sample(loaded, lowered, request_for(VARIANT), hooks=hooks, backend=backend)
    assert pool.pinned_bytes <= ceiling and pool.stats()["arenas"] == arenas_kept
    warm = second.receipt["warm"]
    assert warm["stream_staged_bytes"] > 0 and (warm["stream_pinned_bytes"] > 0) == (arenas_kept > 0)
    # the kept copies (core and prefetched blocks) followed their bytes to the pageable copies: none is copied again
    assert warm["uploaded_bytes"] == 0 and warm["reused_bytes"] == first.receipt["warm"]["kept_bytes"]
    assert torch.equal(first.latent["samples"], second.latent["samples"])
    third = sample(loaded, lowered, request_for(VARIANT), hooks=hooks, backend=backend)  # settled: nothing moves
    assert pool.pinned_bytes <= ceiling and torch.equal(first.latent["samples"], third.latent["samples"])


def test_every_dropped_arena_is_freed_before_the_host_allocator_is_asked_to_unlock_it(tiny_folder, tmp_path,
                                                                                     monkeypatch):
    """fit_ceiling's release_cached_pinned() unlocks only arenas nobody refers to: a loop variable left
    pointing at the last home's owners kept one arena page-locked until the next release."""
    import vidmem.memory.hostpool as hostpool
    from vidmem.memory.warm import rehome_everywhere

    loaded = replace(load_pipeline(tiny_folder(VARIANT), "fp32"), host_pool=HostPool(arena_bytes=ARENA))
    fake = FakeCuda().install(monkeypatch)
    swap = MemoryStrategy(offload="block_swap", blocks_to_swap=block_count(loaded), prefetch_blocks=1)
    sample(loaded, swap, request_for(VARIANT), hooks=RunHooks(prompt_cache=PromptCache(tmp_path / "prompts")),
           backend=CudaBackend(torch.device("cpu")))
    pool = loaded.host_pool
    for arena in pool._arenas:
        fake.pinned.pop(arena.data_ptr(), None)  # the fake's registry of pinned buffers is not the pool's
    weak = [arena.untyped_storage()._weak_ref() for arena in pool._arenas]
    del arena
    assert len(weak) > 1
    alive_at_release = []
    monkeypatch.setattr(hostpool, "release_cached_pinned",
                        lambda: alive_at_release.append([not torch.UntypedStorage._expired(w) for w in weak]))
    assert pool.fit_ceiling(0, rehome_everywhere) == len(weak) * ARENA
    assert alive_at_release == [[False] * len(weak)]


def test_a_decode_with_a_lower_ceiling_leaves_the_samplers_homes_pinned(tiny_folder, tmp_path, monkeypatch):
    """The pool is the pipeline's, its homes the sampler's streamed blocks: only a streaming stage's
    ceiling unpins them. A Decode strategy with max_pinned_ram_gb=0 used to unpin them every run and
    the Sampler pinned them again at its next: every run copied every streamed weight twice."""
    from vidmem.pipelines.decode import decode

    loaded = replace(load_pipeline(tiny_folder(VARIANT), "fp32"), host_pool=HostPool(arena_bytes=ARENA))
    FakeCuda().install(monkeypatch)
    backend = CudaBackend(torch.device("cpu"))
    hooks = RunHooks(prompt_cache=PromptCache(tmp_path / "prompts"))
    sampler = MemoryStrategy(offload="block_swap", blocks_to_swap=block_count(loaded), prefetch_blocks=1)
    decoder = MemoryStrategy(offload="none", max_pinned_ram_gb=0.0)
    pool = loaded.host_pool
    seen = []
    for _ in range(3):
        result = sample(loaded, sampler, request_for(VARIANT), hooks=hooks, backend=backend)
        decode(loaded, result.latent, decoder, backend=backend)
        seen.append((pool.allocations, pool.pinned_bytes))
    assert seen[0][1] > 0 and seen[1:] == seen[:1] * 2


def test_a_dropped_pipelines_pinned_blocks_are_unlocked_after_the_next_placement(tiny_folder, tmp_path, monkeypatch):
    """torch keeps a collected pool's pinned arenas in its host cache, still locked, until told to let go, and
    ComfyUI never tells it: once a pipeline that pinned is gone, the next placement (after its own homes reused
    what they could) empties that cache, once; without a pipeline gone, nothing is emptied."""
    import gc

    from vidmem.memory import cleanup

    fake = FakeCuda().install(monkeypatch)
    gc.collect()  # earlier tests' pipelines go now, not in the middle of this one
    monkeypatch.setattr(cleanup._DroppedPinned, "pending", False)
    hooks = RunHooks(prompt_cache=PromptCache(tmp_path / "prompts"))
    emptied = lambda: sum(1 for entry in fake.log if entry == ("host_empty_cache",))  # noqa: E731

    def run(loaded):  # each pipeline with its own backend (staging), as LoadedPipeline.backend gives it
        swap = MemoryStrategy(offload="block_swap", blocks_to_swap=block_count(loaded), prefetch_blocks=1)
        if id(loaded) not in backends:
            backends[id(loaded)] = CudaBackend(torch.device("cpu"))
        backend = backends[id(loaded)]
        return sample(loaded, swap, request_for(VARIANT), hooks=hooks, backend=backend)

    backends = {}

    kept = replace(load_pipeline(tiny_folder(VARIANT), "fp32"), host_pool=HostPool(arena_bytes=ARENA))
    run(kept)
    run(kept)
    assert kept.host_pool.pinned_bytes > 0 and emptied() == 0  # nothing dropped: the cache is reused as it is
    dropped = replace(load_pipeline(tiny_folder(VARIANT), "fp32"), host_pool=HostPool(arena_bytes=ARENA))
    run(dropped)
    del backends[id(dropped)], dropped
    gc.collect()
    assert cleanup._DroppedPinned.pending and emptied() == 0
    run(kept)
    assert emptied() == 1 and not cleanup._DroppedPinned.pending
    run(kept)
    assert emptied() == 1
