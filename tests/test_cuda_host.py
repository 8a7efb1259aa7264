"""The CUDA branches of telemetry and cleanup, the allocator probe, the pinned ceiling, the MPS/XPU
fallback, hooks torch.compile leaves alone, and parameters that are tensor subclasses."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_map

from backends import StrictBackend
from cuda_fake import FakeCuda
from vidmem.memory import hostpool
from vidmem.memory.blockswap import StreamSchedule, hook_group
from vidmem.memory.cleanup import free_memory
from vidmem.memory.device import ComputeQueueBackend, CpuBackend, backend_for
from vidmem.memory.plan.types import Allocator, PlanOptions
from vidmem.memory.residency import WeightGroup, own_slots, tie
from vidmem.memory.telemetry import StageMeter, allocator_backend, default_budgets, free_device_bytes, snapshot
from vidmem.memory.units import GiB

CUDA = torch.device("cuda", 0)


@pytest.fixture
def fake(monkeypatch):
    return FakeCuda().install(monkeypatch)


def names(fake: FakeCuda) -> list[str]:
    return [entry[0] for entry in fake.log]


def test_snapshot_and_free_bytes_read_the_allocator_on_cuda(fake):
    now = snapshot(CUDA)
    assert (now.allocated_bytes, now.reserved_bytes, now.device_free_bytes) == (3 << 20, 8 << 20, 100 << 20)
    assert free_device_bytes(CUDA) == (100 << 20) + (8 << 20) - (3 << 20)  # free + cached but unused
    assert default_budgets(CUDA)[0] == 1 << 30
    assert free_device_bytes(torch.device("cpu")) is None


def test_stage_meter_synchronizes_around_the_stage_and_resets_the_peak_first(fake):
    with StageMeter("denoise", CUDA) as receipt:
        fake.log.append(("work",))
    assert names(fake) == ["device_sync", "reset_peak_memory_stats", "work", "device_sync", "max_memory_allocated"]
    assert receipt.peak_allocated_bytes == 3 << 20


def test_free_memory_empties_caches_between_two_snapshots(fake):
    receipt = free_memory(CUDA)
    calls = names(fake)
    assert calls.index("empty_cache") < calls.index("ipc_collect") < calls.index("host_empty_cache")
    assert calls.count("mem_get_info") == 2 and calls.index("mem_get_info") < calls.index("empty_cache")
    assert receipt.after.allocated_bytes == 3 << 20


def test_free_memory_on_the_cpu_touches_no_cuda(fake):
    free_memory(torch.device("cpu"))
    assert fake.log == []


@pytest.mark.parametrize("backend,expected", [("native", Allocator.NATIVE), ("cudaMallocAsync", Allocator.ASYNC)])
def test_the_planner_follows_the_allocator_backend_the_process_runs(monkeypatch, backend, expected):
    fake = FakeCuda(allocator=backend).install(monkeypatch)
    assert allocator_backend() == backend and PlanOptions().allocator.resolved() is expected
    assert PlanOptions(allocator=Allocator.NATIVE).allocator.resolved() is Allocator.NATIVE  # told: kept
    assert ("get_allocator_backend",) in fake.log


def test_without_cuda_the_planner_models_the_native_allocator(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert Allocator.AUTO.resolved() is Allocator.NATIVE


def test_the_pinned_ceiling_stays_within_the_hosts_budget(monkeypatch):
    class Memory:
        available = 64 * GiB

    monkeypatch.setattr(hostpool.psutil, "virtual_memory", lambda: Memory)
    assert hostpool.pinned_cap_bytes(None) == 32 * GiB
    assert hostpool.pinned_cap_bytes(None, host_room_bytes=None) == 32 * GiB  # no host budget
    assert hostpool.pinned_cap_bytes(None, host_room_bytes=40 * GiB) == 32 * GiB  # the budget is not a reservation
    assert hostpool.pinned_cap_bytes(None, host_room_bytes=12 * GiB) == 12 * GiB  # what the budget still allows
    assert hostpool.pinned_cap_bytes(None, host_room_bytes=0) == 0
    assert hostpool.pinned_cap_bytes(2.0, host_room_bytes=0) == 2 * GiB  # the user's own ceiling


@pytest.mark.parametrize("kind", ["mps", "xpu"])
def test_mps_and_xpu_copy_on_the_compute_queue_and_say_so(kind, caplog):
    with caplog.at_level(logging.WARNING, logger="vidmem"):
        backend = backend_for(torch.device(kind))
    assert isinstance(backend, ComputeQueueBackend) and backend.device.type == kind and not backend.can_pin
    assert "no side stream" in caplog.text and kind in caplog.text


def test_the_compute_queue_backend_copies_in_line(monkeypatch):
    moved = []
    monkeypatch.setattr(torch.Tensor, "to", lambda t, device, **kw: moved.append(device) or t.clone())
    backend = ComputeQueueBackend(torch.device("mps"))
    host = torch.ones(3)
    (copy,), token = backend.copy_group([host], True, True, True)
    assert moved == [torch.device("mps")] and token is None and copy is not host
    backend.wait(token, [copy])  # nothing to wait for: one queue, in order


def test_an_unknown_device_is_refused_naming_what_works():
    with pytest.raises(ValueError, match="device=meta.*cuda, cpu, mps, xpu"):
        backend_for(torch.device("meta"))


def test_streaming_hooks_are_left_out_of_torch_compile():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    group = WeightGroup("0", tie(own_slots(model[0])), CpuBackend(), streamed=True)
    schedule = StreamSchedule([group], 0, True, CpuBackend(), lambda kind, g: None)
    hook_group(model[0], group, schedule)
    hooks = [*model[0]._forward_pre_hooks.values(), *model[0]._forward_hooks.values()]
    assert hooks and all(getattr(h, "_torchdynamo_disable", False) for h in hooks)
    compiled = torch.compile(model, backend="eager")
    x = torch.ones(1, 4)
    assert torch.equal(compiled(x), model(x))


class Wrapped(torch.Tensor):
    """A wrapper subclass, as torchao's quantized tensors are: the data lives in `inner`."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)

    def __init__(self, inner):
        self.inner = inner

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda t: t.inner if isinstance(t, Wrapped) else t  # noqa: E731
        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        return tree_map(lambda t: Wrapped(t) if isinstance(t, torch.Tensor) else t, out)


def test_a_tensor_subclass_parameter_moves_with_its_group():
    """`param.data =` would leave `inner` (what the subclass computes with) where it was."""
    layer, original = nn.Linear(4, 4), torch.randn(4, 4)
    param = nn.Parameter(Wrapped(original), requires_grad=False)
    layer.weight = param
    group = WeightGroup("layer", tie(own_slots(layer)), StrictBackend(), streamed=True)
    assert torch.isnan(layer.weight.inner).all()  # evicted: the poisoned stand-in, contents included
    group.onload()
    assert torch.equal(layer.weight.inner, original) and layer.weight.inner.data_ptr() != original.data_ptr()
    group.restore()
    assert layer.weight is param and type(layer.weight) is Wrapped
    assert layer.weight.inner.data_ptr() == original.data_ptr()


def test_a_gguf_parameter_keeps_its_quant_type_through_a_move():
    from diffusers.quantizers.gguf.utils import GGUFParameter

    layer = nn.Linear(4, 4)
    layer.weight = GGUFParameter(torch.randn(4, 4), quant_type=8)
    before = layer.weight.data_ptr()
    group = WeightGroup("layer", tie(own_slots(layer)), StrictBackend(), streamed=True)
    group.onload()
    assert type(layer.weight) is GGUFParameter and layer.weight.quant_type == 8 and layer.weight.data_ptr() != before
    group.restore()
    assert layer.weight.data_ptr() == before and layer.weight.quant_type == 8
