"""Resident weights reach the device through pinned memory, never as pageable asynchronous copies.

Runs the real tiny pipelines through CudaBackend under the recording CUDA fake (tests/cuda_fake.py),
which keeps every host-to-device copy with its source's pinned-ness and its non_blocking flag: a
cold call under tiers none, model and block_swap must make no non_blocking copy from pageable
memory; the resident bytes pass through the staging ring (chunks of a size patched small here, so
slots fill, wait and are reused); latents and frames equal the CPU backend's bit for bit; pinned
memory stays within its bounds, run after run. The disk tier (weights memory-mapped from their
file) stages the same way. Unit tests of `StagingRing.upload` run its copies late, as a GPU would,
so a slot refilled before its copy finished would show in the result.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cuda_fake import FakeCuda
from test_tiers import block_count, request_for
from vidmem.memory import MemoryStrategy, StageComponents, apply_strategy
from vidmem.memory import hostpool
from vidmem.memory.device import CpuBackend, CudaBackend
from vidmem.memory.hostpool import PAGEABLE, PINNED, RESIDENT_SLOTS, STAGED, HostPool, StagingRing, upload_route
from vidmem.memory.storage import is_file_backed
from vidmem.memory.warm import WarmStore
from vidmem.pipelines.decode import decode
from vidmem.pipelines.loader import load_pipeline
from vidmem.pipelines.sample import sample

VARIANT = "wan2.1-t2v"
CHUNK = 8 << 10  # bytes: small, so one component takes many chunks and the ring reuses its slots


@pytest.fixture
def loaded(tiny_folder):
    """A pipeline of this test's own: its warm stores and pinned pool (1 MiB arenas) start empty."""
    return dataclasses.replace(load_pipeline(tiny_folder(VARIANT), "fp32"), host_pool=HostPool(1 << 20))


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(hostpool, "RESIDENT_CHUNK_BYTES", CHUNK)


def tiers(loaded) -> dict[str, MemoryStrategy]:
    return {"none": MemoryStrategy(offload="none"), "model": MemoryStrategy(offload="model"),
            # a ceiling of its own: streamed blocks get pinned homes whatever RAM this machine has free
            "block_swap": MemoryStrategy(offload="block_swap", blocks_to_swap=1, prefetch_blocks=1,
                                         max_pinned_ram_gb=1.0)}


def compute_bytes(fake: FakeCuda) -> int:
    """Bytes the fake saw copied to the device on the compute stream (whole components)."""
    return sum(t.nbytes for t in fake.transfers if t.stream == "compute")


@pytest.mark.parametrize("tier", ["none", "model", "block_swap"])
def test_a_cold_call_stages_every_resident_byte_and_copies_nothing_pageable_asynchronously(
        loaded, tier, small_chunks, monkeypatch):
    strategy, request = tiers(loaded)[tier], request_for(VARIANT)
    latents = sample(loaded, strategy, request, backend=CpuBackend()).latent
    frames = decode(loaded, latents, backend=CpuBackend()).frames
    fake = FakeCuda().install(monkeypatch)
    backend = CudaBackend(torch.device("cpu"))
    result = sample(loaded, strategy, request, backend=backend)
    decoded = decode(loaded, result.latent, backend=backend)

    assert fake.transfers and not fake.pageable_async(), fake.pageable_async()[:3]
    for receipt in (result.receipt["warm"], decoded.receipt["warm"]):
        assert receipt["uploaded_bytes"] > 0
        assert receipt["upload_staged_bytes"] == receipt["uploaded_bytes"], receipt
        assert receipt["upload_pinned_bytes"] == receipt["upload_pageable_bytes"] == 0, receipt
        assert "staged)" in receipt["summary"]
    staged = result.receipt["warm"]["upload_staged_bytes"] + decoded.receipt["warm"]["upload_staged_bytes"]
    assert compute_bytes(fake) == staged  # what the fake saw cross, not only what the engine counted
    transformer = sum(p.numel() * p.element_size() for p in loaded.pipe.transformer.parameters())
    if tier != "block_swap":
        assert result.receipt["warm"]["uploaded_bytes"] >= transformer
    assert backend.uploads.staged_bytes == staged and staged > RESIDENT_SLOTS * CHUNK  # slots were reused
    assert torch.equal(result.latent["samples"], latents["samples"])
    assert torch.equal(decoded.frames, frames)


def test_pinned_memory_stays_within_its_bounds_and_a_cold_call_after_release_pins_nothing_new(
        loaded, small_chunks, monkeypatch):
    fake = FakeCuda().install(monkeypatch)
    backend = CudaBackend(torch.device("cpu"))
    request, strategy = request_for(VARIANT), MemoryStrategy(offload="none")
    first = sample(loaded, strategy, request, backend=backend)
    assert backend.uploads.pinned_bytes <= RESIDENT_SLOTS * CHUNK and backend.uploads.slots <= RESIDENT_SLOTS
    assert loaded.host_pool.pinned_bytes == 0  # resident weights get no pinned homes: staged, not pinned
    pinned = fake.pinned_bytes()
    store = loaded.warm_store("sample", backend)
    assert store.release_all() > 0 and store.held_bytes == 0
    again = sample(loaded, strategy, request, backend=backend)
    assert again.receipt["warm"]["upload_staged_bytes"] == first.receipt["warm"]["upload_staged_bytes"] > 0
    assert fake.pinned_bytes() == pinned  # the ring's slots served the second cold call too
    assert torch.equal(first.latent["samples"], again.latent["samples"])


def test_a_resident_tensor_with_a_pinned_home_is_copied_straight_from_it(loaded, monkeypatch):
    """Blocks streamed under block swap got pinned homes; made resident again, they need no staging."""
    fake = FakeCuda().install(monkeypatch)
    backend = CudaBackend(torch.device("cpu"))
    request, blocks = request_for(VARIANT), block_count(loaded)
    swap_all = MemoryStrategy(offload="block_swap", blocks_to_swap=blocks, prefetch_blocks=0, max_pinned_ram_gb=1.0)
    sample(loaded, swap_all, request, backend=backend)
    loaded.warm_store("sample", backend).release_all()
    homed = loaded.host_pool.pinned_bytes
    warm = sample(loaded, MemoryStrategy(offload="none"), request, backend=backend).receipt["warm"]
    block_bytes = sum(t.numel() * t.element_size() for b in loaded.pipe.transformer.blocks
                      for t in [*b.parameters(), *b.buffers()])
    assert homed > 0 and warm["upload_pinned_bytes"] == block_bytes
    assert warm["upload_pinned_bytes"] + warm["upload_staged_bytes"] == warm["uploaded_bytes"]
    assert not fake.pageable_async()


def test_the_check_catches_pageable_asynchronous_copies(loaded, monkeypatch):
    """The copy path this replaced: whole components copied straight from pageable memory."""

    class Pageable(CudaBackend):
        def copy_group(self, hosts, non_blocking, side_stream, timed):
            if side_stream:
                return super().copy_group(hosts, non_blocking, side_stream, timed)
            with torch.cuda.stream(torch.cuda.current_stream(self.device)):
                return [host.to(self.device, non_blocking=non_blocking) for host in hosts], None

    fake = FakeCuda().install(monkeypatch)
    result = sample(loaded, MemoryStrategy(offload="none"), request_for(VARIANT), backend=Pageable(torch.device("cpu")))
    assert fake.pageable_async() and result.receipt["warm"]["upload_staged_bytes"] == 0
    assert result.receipt["warm"]["upload_pageable_bytes"] == result.receipt["warm"]["uploaded_bytes"] > 0


@pytest.mark.parametrize("name", ["gguf_q8_0", "fp8_scaled"])
def test_the_disk_tier_stages_resident_weights_from_their_file_mapping(name, tmp_path, small_chunks, monkeypatch):
    from test_storage import inputs, load, wan_state, write_model_file

    write_model_file(tmp_path / f"wan.{name}", wan_state(), name)
    reference, _ = load(tmp_path / f"wan.{name}", torch.float32, dequantize_first=True)
    with torch.no_grad():
        expected = reference(**inputs(torch.float32))[0]
    for tier in ("none", "model"):
        model, _ = load(tmp_path / f"wan.{name}", torch.float32)
        mapped = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()] if is_file_backed(t))
        stage, store = StageComponents({"transformer": model}, {"transformer": model.blocks}), WarmStore("disk")
        with monkeypatch.context() as patch:
            fake = FakeCuda().install(patch)
            backend = CudaBackend(torch.device("cpu"))
            with torch.no_grad(), apply_strategy(stage, MemoryStrategy(offload=tier), backend, warm=store) as handle:
                handle.activate("transformer")
                got = model(**inputs(torch.float32))[0]
        routes = store.tally.routes
        assert torch.equal(got, expected), f"{name} {tier}"
        assert mapped > 0 and routes.staged == store.tally.uploaded_bytes >= mapped, f"{name} {tier}: {routes}"
        assert routes.pageable == 0 and not fake.pageable_async(), f"{name} {tier}"
        assert backend.uploads.pinned_bytes <= RESIDENT_SLOTS * CHUNK
        assert all(is_file_backed(b) for b in model.blocks.buffers() if b is not None and b.numel())  # still mapped


class LateCopies:
    """Non-blocking copies land only when their token completes, as on a GPU: a slot refilled before
    then would hand the device the next chunk's bytes."""

    def __init__(self, monkeypatch) -> None:
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.waits = 0
        original = torch.Tensor.copy_

        def copy_(destination, source, non_blocking=False):
            if not non_blocking:
                return original(destination, source)
            self.pending.append((destination, source))
            return destination

        self.original = original
        monkeypatch.setattr(torch.Tensor, "copy_", copy_)

    def mark(self) -> list:
        token, self.pending = {"copies": self.pending, "done": False}, []
        return token

    def finished(self, token) -> bool:
        return token["done"]

    def wait(self, token) -> None:
        self.waits += 1
        for destination, source in token["copies"]:
            self.original(destination, source)
        token["done"] = True


def ring_upload(monkeypatch, finished=None) -> tuple[list[torch.Tensor], list[torch.Tensor], int, StagingRing]:
    """Upload a few tensors through a two-slot ring in 1 KiB chunks; returns the hosts, their copies
    once every copy has landed, the waits the ring itself made, and the ring."""
    monkeypatch.setattr(hostpool, "RESIDENT_CHUNK_BYTES", 1024)
    torch.manual_seed(0)
    hosts = [torch.randn(n) for n in (3000, 10, 0, 700, 5000)] + [torch.arange(6, dtype=torch.int64).reshape(2, 3)]
    late, tokens = LateCopies(monkeypatch), []

    def mark():
        tokens.append(late.mark())
        return tokens[-1]

    ring = StagingRing(lambda n: torch.empty(n, dtype=torch.uint8), finished or late.finished, late.wait, max_slots=2)
    copies, routes = ring.upload(hosts, torch.device("cpu"), True, mark)
    ring_waits = late.waits
    for token in tokens:
        if not token["done"]:
            late.wait(token)
    assert routes.staged == sum(h.numel() * h.element_size() for h in hosts) and routes.pinned == routes.pageable == 0
    return hosts, copies, ring_waits, ring


def test_the_ring_refills_a_slot_only_after_its_copy_has_landed(monkeypatch):
    hosts, copies, ring_waits, ring = ring_upload(monkeypatch)
    assert all(torch.equal(h, c) and c.shape == h.shape and c.dtype == h.dtype for h, c in zip(hosts, copies))
    assert ring.slots <= 2 and ring_waits > 0  # two 1 KiB slots for ~36 KiB: the ring waited to reuse them


def test_a_ring_that_refills_too_early_is_caught(monkeypatch):
    hosts, copies, _, _ = ring_upload(monkeypatch, finished=lambda token: True)  # claims every copy landed
    assert not all(torch.equal(h, c) for h, c in zip(hosts, copies))


def test_a_pin_refused_after_the_first_slot_leaves_the_ring_with_the_slots_it_has(monkeypatch):
    """The driver pins the ring's first slot, then refuses (WSL2's pinned limit reached). A group larger
    than that slot, with its chunks' copies landing late, goes through the one slot, reused once its copy
    has landed; the refusal ("CUDA error: out of memory", which the sampler's ladder would take for the
    device's own) never leaves the ring, and the driver is asked again once per pass, not per chunk."""
    monkeypatch.setattr(hostpool, "RESIDENT_CHUNK_BYTES", 1024)
    late, tokens, pinned = LateCopies(monkeypatch), [], []

    def pin(nbytes: int) -> torch.Tensor:
        if pinned:
            raise RuntimeError("CUDA error: out of memory (cudaHostAlloc, fake)")
        pinned.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    def mark():
        tokens.append(late.mark())
        return tokens[-1]

    ring = StagingRing(pin, late.finished, late.wait, max_slots=4)
    torch.manual_seed(0)
    hosts, copies = [torch.randn(10), torch.randn(3000)], []
    for host in hosts:  # the small one first: the first slot is as small as it needs (512 bytes)
        copied, routes = ring.upload([host], torch.device("cpu"), True, mark)
        assert routes.staged == host.numel() * host.element_size() and routes.pageable == 0
        copies += copied
    for token in tokens:
        if not token["done"]:
            late.wait(token)
    assert all(torch.equal(h, c) for h, c in zip(hosts, copies))
    assert pinned == [512] and ring.slots == 1 and ring.refusals == 1


class _Pair(torch.Tensor):
    """A wrapper subclass (as GGUF's and torchao's tensors are): its bytes are not one buffer."""

    @staticmethod
    def __new__(cls, a):
        return torch.Tensor._make_wrapper_subclass(cls, a.shape, dtype=a.dtype, device=a.device)

    def __init__(self, a):
        self.a = a

    def __tensor_flatten__(self):
        return ["a"], None

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"{func} is not needed here")


def test_routes_pinned_straight_plain_staged_subclasses_and_synchronous_requests_pageable(monkeypatch):
    fake = FakeCuda().install(monkeypatch)
    pinned = torch.empty(16, dtype=torch.uint8, pin_memory=True)
    plain = torch.zeros(4)
    assert fake.is_pinned(pinned) and upload_route(pinned, True) == PINNED
    assert upload_route(plain, True) == STAGED
    assert upload_route(torch.zeros(3, 4).t(), True) == PAGEABLE  # not contiguous: no byte view
    assert upload_route(plain, False) == PAGEABLE  # the user asked for synchronous copies
    assert upload_route(_Pair(plain), True) == PAGEABLE
