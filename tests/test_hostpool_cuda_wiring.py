"""CudaBackend's staging wiring, run on the CPU with torch.cuda's stream and event API faked.

What a CPU cannot show (real overlap, pinned DMA) is left to a GPU; this checks the code path
itself: which tensors are staged, on which copies, and that a slot is reused only after its
copy's event reports done (query) or the host waited for it (synchronize).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from safetensors.torch import save_file

from vidmem.memory.device import CudaBackend
from vidmem.memory.storage import is_file_backed, open_safetensors


class FakeEvent:
    made: list["FakeEvent"] = []

    def __init__(self, enable_timing: bool = False) -> None:
        self.finished = False
        self.synchronized = False
        FakeEvent.made.append(self)

    def record(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return self.finished

    def synchronize(self) -> None:
        self.synchronized = self.finished = True


@pytest.fixture
def backend(monkeypatch):
    FakeEvent.made = []
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: object())
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: object())
    cuda = CudaBackend(torch.device("cpu"))  # `.to(cpu)` stands in for the device copy
    monkeypatch.setattr(cuda, "pin_arena", lambda nbytes: torch.empty(nbytes, dtype=torch.uint8))
    cuda.staging._pin = cuda.uploads._pin = cuda.pin_arena
    return cuda


def mapped(tmp_path, n: int = 3) -> list[torch.Tensor]:
    save_file({f"t{i}": torch.full((256,), float(i)) for i in range(n)}, tmp_path / "w.safetensors")
    opened = open_safetensors(tmp_path / "w.safetensors")
    return [opened.tensors[f"t{i}"] for i in range(n)]


def test_streamed_copies_of_file_backed_tensors_go_through_a_slot(backend, tmp_path):
    first, second, _ = mapped(tmp_path)
    in_ram = torch.ones(8)
    copies, token = backend.copy_group([first, in_ram], True, True, False)
    assert not is_file_backed(copies[0]) and torch.equal(copies[0], first)  # read from the slot
    assert copies[1] is not in_ram and torch.equal(copies[1], in_ram)  # pageable RAM: staged too, never copied async
    assert backend.staging.slots == 1 and token.done is FakeEvent.made[-1]
    backend.copy_group([second], True, True, False)
    assert backend.staging.slots == 2  # the first copy has not reported done: its slot is busy
    token.done.finished = True
    backend.copy_group([second], True, True, False)
    assert backend.staging.slots == 2  # reused once its event said done


def test_blocking_copies_are_never_staged_and_whole_components_use_a_ring_of_their_own(backend, tmp_path):
    (tensor,) = mapped(tmp_path, 1)
    copies, _ = backend.copy_group([tensor], False, True, False)
    assert copies[0] is tensor
    copies, token = backend.copy_group([tensor], True, False, False)  # tests/test_resident_upload.py has the rest
    assert torch.equal(copies[0], tensor) and not is_file_backed(copies[0]) and token.routes.staged == 256 * 4
    assert backend.staging.slots == 0 and backend.uploads.slots == 1


def test_a_full_ring_synchronizes_on_the_oldest_copy(backend, tmp_path):
    backend.staging._max_slots = 1
    first, second, _ = mapped(tmp_path)
    _, token = backend.copy_group([first], True, True, False)
    copies, _ = backend.copy_group([second], True, True, False)
    assert token.done.synchronized and backend.staging.slots == 1
    assert torch.equal(copies[0], second)
