"""Streamed blocks reach the device from pinned memory, never as pageable asynchronous copies.

Under block swap and sequential, a streamed tensor with a pinned home (memory/hostpool.py HostPool)
is copied straight from it; one without (the pinned ceiling is 0, or spent) passes chunk by chunk
through the backend's streamed staging ring on the side stream. Runs the real tiny pipelines through
CudaBackend under the recording CUDA fake (tests/cuda_fake.py), which keeps every host-to-device
copy with its source's pinned-ness and non_blocking flag, with chunks patched small so a block takes
several slots: no copy is pageable and asynchronous, latents and frames equal the CPU backend's bit
for bit, the ring stays within its slots, the receipts say how many bytes took each route, and
the prefetch still overlaps (compute waits on the copy's event; the host never waits for it).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cuda_fake import FakeCuda
from test_cuda_path import Audit, log_forwards
from test_tiers import block_count, request_for
from vidmem.memory import MemoryStrategy
from vidmem.memory import hostpool
from vidmem.memory.device import CopyToken, CpuBackend, CudaBackend
from vidmem.memory.hostpool import MAX_STAGING_SLOTS, HostPool
from vidmem.memory.units import GiB
from vidmem.nodes.receipts import format_receipt
from vidmem.pipelines.decode import decode
from vidmem.pipelines.loader import load_pipeline
from vidmem.pipelines.sample import sample

VARIANT = "wan2.1-t2v"
CHUNK = 8 << 10  # bytes: a tiny Wan block (~26 KiB) takes four chunks
ARENA = 32 << 10  # bytes: one block fits an arena, two do not
CEILINGS = {"no pinning": 0.0, "one arena": ARENA / GiB}


@pytest.fixture
def loaded(tiny_folder):
    """A pipeline of this test's own, with a pinned pool of small arenas that starts empty."""
    return dataclasses.replace(load_pipeline(tiny_folder(VARIANT), "fp32"), host_pool=HostPool(ARENA))


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(hostpool, "RESIDENT_CHUNK_BYTES", CHUNK)


def strategy_for(tier: str, loaded, ceiling: float, **extra) -> MemoryStrategy:
    if tier == "block_swap":
        return MemoryStrategy(offload="block_swap", blocks_to_swap=block_count(loaded), prefetch_blocks=1,
                              max_pinned_ram_gb=ceiling, **extra)
    return MemoryStrategy(offload="sequential", prefetch_blocks=1, max_pinned_ram_gb=ceiling, **extra)


def reference(loaded, strategy: MemoryStrategy) -> tuple[torch.Tensor, torch.Tensor]:
    latents = sample(loaded, strategy, request_for(VARIANT), backend=CpuBackend()).latent
    return latents["samples"], decode(loaded, latents, strategy, backend=CpuBackend()).frames


def side_bytes(fake: FakeCuda) -> int:
    return sum(t.nbytes for t in fake.transfers if t.stream == "side")


def prefetch_overlaps(log: list[tuple]) -> list[str]:
    """Problems with the prefetch: each prefetched group's copy ends in an event recorded on the side
    stream, and compute waits for it there (`wait_event`) without the host having synchronized on
    it first (timing reads after the loop, on a prefetch no step used, are not waits)."""
    problems, last_side, pending, synced, waited = [], None, {}, set(), 0
    for entry in log:
        if entry[0] == "record" and entry[2] == "side":
            last_side = entry[1]
        elif entry[0] == "prefetch":
            pending[last_side] = entry[1]
        elif entry[0] == "event_sync":
            synced.add(entry[1])
        elif entry[0] == "wait_event" and entry[1] == "compute" and entry[2] in pending:
            waited += 1
            if entry[2] in synced:
                problems.append(f"the host waited for {pending[entry[2]]}'s prefetch before compute did")
            del pending[entry[2]]
    return problems + ([] if waited else ["compute never waited on a prefetched copy"])


@pytest.mark.parametrize("ceiling", CEILINGS)
@pytest.mark.parametrize("tier", ["block_swap", "sequential"])
def test_streamed_blocks_are_staged_or_pinned_never_pageable_and_asynchronous(loaded, tier, ceiling, monkeypatch):
    strategy = strategy_for(tier, loaded, CEILINGS[ceiling])
    latents, frames = reference(loaded, strategy)
    fake = FakeCuda().install(monkeypatch)
    log_forwards(monkeypatch, fake)
    backend = CudaBackend(torch.device("cpu"))
    result = sample(loaded, strategy, request_for(VARIANT), backend=backend, observer=fake.observe)
    sampled = list(fake.log)  # the decode reports to no observer: the audit reads the sampling
    decoded = decode(loaded, result.latent, strategy, backend=backend)

    assert torch.equal(result.latent["samples"], latents) and torch.equal(decoded.frames, frames)
    assert fake.transfers and not fake.pageable_async(), fake.pageable_async()[:3]
    assert all(t.source_pinned and t.non_blocking for t in fake.transfers if t.stream == "side")
    warm = result.receipt["warm"]
    routes = (warm["stream_pinned_bytes"], warm["stream_staged_bytes"], warm["stream_pageable_bytes"])
    assert warm["stream_staged_bytes"] > 0 and warm["stream_pageable_bytes"] == 0, warm
    assert sum(routes) == warm["streamed_bytes"] and "staged" in warm["summary"]
    assert (warm["stream_pinned_bytes"] > 0) == (ceiling == "one arena"), warm  # homes where the ceiling allows
    assert loaded.host_pool.pinned_bytes <= CEILINGS[ceiling] * GiB
    if tier == "block_swap":  # the swap receipt says the same, from the copy tokens
        swap = result.receipt["swap"]
        assert (swap["pinned_bytes"], swap["staged_bytes"], swap["pageable_bytes"]) == routes, swap
        swap_line = next(line for line in format_receipt("Sampler", result.receipt).splitlines() if "swap cost" in line)
        assert "staged" in swap_line and "pageable" not in swap_line, swap_line
    assert backend.staging.staged_bytes == side_bytes(fake) - warm["stream_pinned_bytes"]
    assert backend.staging.staged_bytes > MAX_STAGING_SLOTS * CHUNK  # slots were filled, waited for, reused
    assert 0 < backend.staging.slots <= MAX_STAGING_SLOTS and backend.staging.pinned_bytes <= MAX_STAGING_SLOTS * CHUNK
    assert not prefetch_overlaps(fake.log), prefetch_overlaps(fake.log)[:3]
    audit = Audit(sampled).run(strategy.prefetch_blocks)  # every streamed block ran after compute waited for it
    assert any(entry[0] == "forward" for entry in sampled) and not audit.problems, audit.problems[:3]


def test_a_second_call_pins_nothing_new(loaded, monkeypatch):
    strategy = strategy_for("block_swap", loaded, 0.0)
    fake = FakeCuda().install(monkeypatch)
    backend = CudaBackend(torch.device("cpu"))
    first = sample(loaded, strategy, request_for(VARIANT), backend=backend)
    pinned = fake.pinned_bytes()
    again = sample(loaded, strategy, request_for(VARIANT), backend=backend)
    assert fake.pinned_bytes() == pinned and again.receipt["warm"]["stream_staged_bytes"] > 0
    assert torch.equal(first.latent["samples"], again.latent["samples"])


def test_synchronous_copies_when_asked_are_counted_pageable(loaded, monkeypatch):
    strategy = strategy_for("block_swap", loaded, 0.0, non_blocking=False)
    fake = FakeCuda().install(monkeypatch)
    backend = CudaBackend(torch.device("cpu"))
    result = sample(loaded, strategy, request_for(VARIANT), backend=backend)
    swap = result.receipt["swap"]
    assert swap["pageable_bytes"] > 0 and swap["pinned_bytes"] == swap["staged_bytes"] == 0, swap
    assert not any(t.non_blocking for t in fake.transfers) and backend.staging.slots == 0
    assert "pageable" in result.receipt["warm"]["summary"]


def test_the_check_catches_a_pageable_asynchronous_prefetch(loaded, monkeypatch):
    """The copy path this replaced: a streamed block without a pinned home copied straight."""

    class Pageable(CudaBackend):
        def copy_group(self, hosts, non_blocking, side_stream, timed):
            if not side_stream:
                return super().copy_group(hosts, non_blocking, side_stream, timed)
            with torch.cuda.stream(self._side):
                tensors = [host.to(self.device, non_blocking=True) for host in hosts]
                return tensors, CopyToken(self.compute_done(), None, True)

    fake = FakeCuda().install(monkeypatch)
    sample(loaded, strategy_for("block_swap", loaded, 0.0), request_for(VARIANT), backend=Pageable(torch.device("cpu")))
    assert fake.pageable_async() and all(t.stream == "side" for t in fake.pageable_async())


def test_when_the_driver_refuses_to_pin_copies_are_synchronous_and_counted_pageable(loaded, monkeypatch):
    """WSL2's pinned limit, or no RAM left to lock: no slot can be pinned, so nothing is staged; the
    run still works, every copy synchronous, and the receipts say so."""
    strategy = strategy_for("block_swap", loaded, 1.0)
    latents, _ = reference(loaded, strategy)
    fake = FakeCuda().install(monkeypatch)
    backend = CudaBackend(torch.device("cpu"))

    def refuse(nbytes):
        raise RuntimeError("CUDA error: out of memory (cudaHostAlloc, fake)")

    monkeypatch.setattr(backend, "pin_arena", refuse)
    backend.staging._pin = backend.uploads._pin = refuse
    result = sample(loaded, strategy, request_for(VARIANT), backend=backend)
    swap, warm = result.receipt["swap"], result.receipt["warm"]
    assert torch.equal(result.latent["samples"], latents)
    assert fake.transfers and not any(t.non_blocking for t in fake.transfers)
    assert swap["pageable_bytes"] > 0 and swap["staged_bytes"] == swap["pinned_bytes"] == 0, swap
    assert warm["upload_pageable_bytes"] == warm["uploaded_bytes"] > 0 and "pageable" in warm["summary"]
    assert backend.staging.refusals > 0 and backend.staging.slots == 0 and loaded.host_pool.pinned_bytes == 0


def test_a_pin_refused_once_the_rings_have_a_slot_is_no_device_out_of_memory(loaded, monkeypatch):
    """The driver pins each ring's first slot and refuses every pin after it (WSL2's pinned limit reached
    mid-run). Its error reads "CUDA error: out of memory": were it let out, the sampler's ladder would take
    it for the device's own and climb. The rings carry on with one slot each instead, every copy still
    staged and asynchronous, and the latents are unchanged."""
    strategy = strategy_for("block_swap", loaded, 0.0)
    latents, _ = reference(loaded, strategy)
    fake = FakeCuda().install(monkeypatch)
    backend = CudaBackend(torch.device("cpu"))

    def first_pin_only(ring):
        def pin(nbytes):
            if ring.slots:
                raise RuntimeError("CUDA error: out of memory (cudaHostAlloc, fake)")
            return backend.pin_arena(nbytes)
        return pin

    for ring in (backend.staging, backend.uploads):
        ring._pin = first_pin_only(ring)
    result = sample(loaded, strategy, request_for(VARIANT), backend=backend, observer=fake.observe)
    assert not result.receipt.get("oom_ladder"), result.receipt.get("oom_ladder")
    assert torch.equal(result.latent["samples"], latents)
    assert backend.staging.refusals > 0 and backend.staging.slots == backend.uploads.slots == 1
    assert not fake.pageable_async() and result.receipt["swap"]["pageable_bytes"] == 0
