"""The disk tier's copy path, on a CPU with a backend whose copies land late.

`LazyCopyBackend` copies as CudaBackend does, through `StagingRing.upload`, and behaves like a GPU
for ordering: a staged chunk's device copy only reads its slot when the copy "completes" (compute
waits for it, or the host blocks on it). If the staging ring handed a slot to a new chunk before
the copy that reads it had completed, that copy would read the new chunk's bytes and the output
would differ. It also pins (unpinned) buffers so HostPool runs.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from test_storage import inputs, load, tiers, wan_state, write_model_file
from vidmem.memory import MemoryStrategy, StageComponents, apply_strategy
from vidmem.memory.device import CpuBackend
from vidmem.memory.hostpool import HostPool, StagingRing
from vidmem.memory.storage import is_file_backed, open_safetensors
from safetensors.torch import save_file


class LazyCopy:
    """The copies queued on one stream up to a marker; completing it completes the earlier ones first."""

    def __init__(self, pairs, previous: "LazyCopy | None" = None):
        self.pairs, self.previous = pairs, previous
        self.done = False

    def complete(self) -> None:
        if self.previous is not None:
            self.previous.complete()
        if not self.done:
            for destination, source in self.pairs:
                _COPY(destination, source)
            self.done = True


_COPY = torch.Tensor.copy_


@contextlib.contextmanager
def queued_copies(queue: list):
    """Non-blocking copies (a staged chunk's device copy) are queued, not made: they read their slot late."""

    def copy_(destination, source, non_blocking=False):
        if not non_blocking:
            return _COPY(destination, source)
        queue.append((destination, source))
        return destination

    torch.Tensor.copy_ = copy_
    try:
        yield
    finally:
        torch.Tensor.copy_ = _COPY


class LazyCopyBackend(CpuBackend):
    can_pin = True

    def __init__(self) -> None:
        super().__init__()
        self.pinned = 0
        self.staging = StagingRing(self.pin_arena, lambda token: token.done, lambda token: token.complete())
        self.uploads = StagingRing(self.pin_arena, lambda token: token.done, lambda token: token.complete())

    def pin_arena(self, nbytes: int) -> torch.Tensor:
        self.pinned += nbytes
        return torch.empty(nbytes, dtype=torch.uint8)

    def copy_group(self, hosts, non_blocking, side_stream, timed):
        queue, marks = [], []

        def mark() -> LazyCopy:
            marks.append(LazyCopy(list(queue), marks[-1] if marks else None))
            queue.clear()
            return marks[-1]

        with queued_copies(queue):
            copies, _ = (self.staging if side_stream else self.uploads).upload(hosts, torch.device("cpu"), non_blocking, mark)
        token = marks[-1] if marks else mark()  # the last slot's marker follows every copy of the group
        if not side_stream:
            token.complete()  # whole components copy on the compute stream: in order
        return copies, token

    def wait(self, token, tensors) -> None:
        if token is not None:
            token.complete()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("staging")
    state = wan_state()
    paths = {}
    for name in ("gguf_q8_0", "fp8_scaled"):  # all file-backed; file-backed + cast (pinned) mixed
        paths[name] = root / f"wan.{name}"
        write_model_file(paths[name], state, name)
    return paths


@pytest.mark.parametrize("name", ["gguf_q8_0", "fp8_scaled"])
def test_file_backed_groups_stream_through_a_bounded_staging_ring(files, name):
    model, _ = load(files[name], torch.float32)
    reference, _ = load(files[name], torch.float32, dequantize_first=True)
    with torch.no_grad():
        expected = reference(**inputs(torch.float32))[0]
    stage = StageComponents({"transformer": model}, {"transformer": model.blocks})
    group_bytes = max(sum(t.numel() * t.element_size() for t in [*b.parameters(), *b.buffers()]) for b in model.blocks)
    for label, strategy in tiers(len(model.blocks)).items():
        backend, pool = LazyCopyBackend(), HostPool(1 << 20)
        with torch.no_grad(), apply_strategy(stage, strategy, backend, host_pool=pool) as handle:
            handle.activate("transformer")
            got = model(**inputs(torch.float32))[0]
        assert torch.equal(got, expected), f"{name} {label}"
        if not strategy.streams_blocks:
            continue
        assert pool.file_backed > 0 and backend.staging.staged_bytes > 0, label  # streamed from the mapping
        assert backend.staging.slots <= strategy.prefetch_blocks + 2, label
        if strategy.offload.value == "block_swap":
            assert backend.staging.pinned_bytes <= (strategy.prefetch_blocks + 2) * 2 * group_bytes, label
        if name == "gguf_q8_0":  # every weight is file-backed: only the computed rotary tables get pinned homes
            assert pool.allocations == (2 if strategy.offload.value == "sequential" else 0), label


def test_file_backed_tensors_keep_their_mapping_after_the_run(files):
    model, _ = load(files["gguf_q8_0"], torch.float32)
    stage = StageComponents({"transformer": model}, {"transformer": model.blocks})
    strategy = MemoryStrategy(offload="block_swap", blocks_to_swap=len(model.blocks), prefetch_blocks=1)
    with torch.no_grad(), apply_strategy(stage, strategy, LazyCopyBackend(), host_pool=HostPool(1 << 20)) as handle:
        handle.activate("transformer")
        model(**inputs(torch.float32))
    assert all(is_file_backed(b) for b in model.blocks.buffers() if b is not None and b.numel())


def file_tensors(tmp_path, sizes: list[int]) -> list[torch.Tensor]:
    save_file({f"t{i}": torch.full((n,), float(i + 1)) for i, n in enumerate(sizes)}, tmp_path / "t.safetensors")
    opened = open_safetensors(tmp_path / "t.safetensors")
    return [opened.tensors[f"t{i}"] for i in range(len(sizes))]


def test_a_slot_is_reused_only_after_its_copy_finished(tmp_path):
    backend = LazyCopyBackend()
    ring = backend.staging
    a, b, c = file_tensors(tmp_path, [1000, 1000, 1000])
    first, token_a = backend.copy_group([a], True, True, False)
    second, token_b = backend.copy_group([b], True, True, False)
    assert ring.slots == 2  # the first slot is still being read
    backend.wait(token_a, first)
    third, token_c = backend.copy_group([c], True, True, False)
    assert ring.slots == 2  # the first slot, now free, is reused
    for token, copies, value in ((token_b, second, 2.0), (token_c, third, 3.0)):
        backend.wait(token, copies)
        assert torch.equal(copies[0], torch.full((1000,), value))
    assert torch.equal(first[0], torch.full((1000,), 1.0))


def test_a_full_ring_waits_for_its_oldest_copy(tmp_path):
    backend = LazyCopyBackend()
    backend.staging = StagingRing(backend.pin_arena, lambda t: t.done, lambda t: t.complete(), max_slots=2)
    tensors = file_tensors(tmp_path, [100, 100, 100])
    outputs = [backend.copy_group([t], True, True, False) for t in tensors]
    assert backend.staging.slots == 2 and outputs[0][1].done and not outputs[1][1].done
    for (copies, token), value in zip(outputs, (1.0, 2.0, 3.0)):
        backend.wait(token, copies)
        assert torch.equal(copies[0], torch.full((100,), value))


def test_a_bigger_group_replaces_a_small_free_slot_when_full(tmp_path):
    backend = LazyCopyBackend()
    backend.staging = StagingRing(backend.pin_arena, lambda t: t.done, lambda t: t.complete(), max_slots=1)
    small, big = file_tensors(tmp_path, [10, 100_000])
    copies, token = backend.copy_group([small], True, True, False)
    backend.wait(token, copies)
    copies, token = backend.copy_group([big], True, True, False)
    backend.wait(token, copies)
    assert backend.staging.slots == 1 and backend.staging.pinned_bytes >= 400_000
    assert torch.equal(copies[0], torch.full((100_000,), 2.0))


def test_groups_of_growing_sizes_replace_free_slots_instead_of_adding(tmp_path):
    backend = LazyCopyBackend()
    tensors = file_tensors(tmp_path, [10, 100, 1000, 10_000])
    for tensor in tensors:  # one at a time, each copy finished before the next: one slot suffices
        copies, token = backend.copy_group([tensor], True, True, False)
        backend.wait(token, copies)
        assert torch.equal(copies[0], tensor)
    assert backend.staging.stats() == {"slots": 1, "pinned_bytes": 65536, "staged_bytes": 4 * (10 + 100 + 1000 + 10_000)}


def at_skews(skews: list[int], numel: int = 96) -> list[torch.Tensor]:
    """Weights whose first byte lies `skew` bytes past a 64-byte line, as views into files do."""
    line = torch.empty(64 * len(skews) + numel * 4 * len(skews), dtype=torch.uint8)
    base = (-line.data_ptr()) % 64
    views = []
    for i, skew in enumerate(skews):
        start = base + i * (64 + numel * 4) + skew
        views.append(line[start : start + numel * 4].view(torch.float32).copy_(torch.randn(numel)))
    return views


def test_a_pinned_home_keeps_its_originals_place_in_a_cache_line():
    """A home replaces its original for good, so it sits at the same address modulo 64: a CPU
    computing on it afterwards rounds as on the original (MKL's default mode picks its
    matrix-vector kernel by alignment; docs/bit-identity.md)."""
    from backends import StrictBackend
    from vidmem.memory.residency import Slot

    skews = list(range(0, 64, 4))
    originals = at_skews(skews)
    holder = torch.nn.Module()
    for i, tensor in enumerate(originals):
        holder.register_buffer(f"w{i}", tensor)
    slots = [[Slot(holder, f"w{i}", False, t)] for i, t in enumerate(originals)]
    adopted = HostPool(1 << 20).adopt(slots, StrictBackend(pinning=True), cap_bytes=1 << 30)
    homes = [owners[0].host for owners in adopted]
    assert all(home.data_ptr() != t.data_ptr() for home, t in zip(homes, originals))  # really copied
    assert [home.data_ptr() % 64 for home in homes] == skews
    assert all(torch.equal(home, t) for home, t in zip(homes, originals))
