"""Which tensors HostPool gives pinned homes, when, and how many (memory/hostpool.py), on a CPU with a
backend that pins plain buffers (tests/backends.py StrictBackend):

- a tensor subclass (diffusers' GGUFParameter, a torchao-like wrapper) keeps its type and stays where it is;
- a LoRA's tensors and its traced strength, registered on their layer anew for every call, take the homes
  they had: allocations and pinned bytes stay flat call after call (a source written in place since gets
  a new one);
- adoption releases each unit's pageable originals once its homes are made, so RAM is not doubled;
- a streaming apply fits the pool to the room the host's pinned budget leaves, as to a lowered ceiling.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from backends import StrictBackend
from test_cuda_host import Wrapped
from vidmem.memory import MemoryStrategy
from vidmem.memory import hostpool
from vidmem.memory.device import CpuBackend
from vidmem.memory.hostpool import HostPool
from vidmem.memory.lora import LoraPatch, apply_loras
from vidmem.memory.offload import StageComponents, apply_strategy
from vidmem.memory.units import GiB

ARENA = 1 << 20


class Blocks(nn.Module):
    def __init__(self, count: int = 3, width: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Linear(width, width)) for _ in range(count))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def stage_of(model: Blocks) -> StageComponents:
    return StageComponents({"t": model}, {"t": model.blocks})


def streaming(tier: str, blocks: int, max_pinned_ram_gb: float | None = 1.0) -> MemoryStrategy:
    """A ceiling of its own by default: homes are made whatever RAM this machine has free."""
    if tier == "block_swap":
        return MemoryStrategy(offload="block_swap", blocks_to_swap=blocks, max_pinned_ram_gb=max_pinned_ram_gb)
    return MemoryStrategy(offload="sequential", max_pinned_ram_gb=max_pinned_ram_gb)


# --- tensor subclasses ------------------------------------------------------------------------------


def gguf_weight() -> nn.Parameter:
    gguf = pytest.importorskip("diffusers.quantizers.gguf.utils")
    return gguf.GGUFParameter(torch.randn(4, 4), quant_type=8)


@pytest.mark.parametrize("kind", ["gguf", "wrapper"])
def test_a_tensor_subclass_parameter_keeps_its_type_and_gets_no_home(kind):
    """A home is a plain tensor: GGUF's `quant_type` would be lost, and a wrapper has no data pointer."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    net[1].weight = gguf_weight() if kind == "gguf" else nn.Parameter(Wrapped(torch.randn(4, 4)), requires_grad=False)
    weight, kept = net[1].weight, net[1].weight.data
    pool = HostPool(ARENA)
    with torch.no_grad(), apply_strategy(StageComponents({"t": net}), MemoryStrategy(offload="sequential"),
                                         StrictBackend(pinning=True), host_pool=pool):
        pass
    assert net[1].weight is weight and type(net[1].weight.data) is type(kept)
    assert getattr(net[1].weight, "quant_type", None) == (8 if kind == "gguf" else None)
    assert pool.allocations == 3  # the plain ones: the first layer's weight and bias, the second's bias
    assert pool.homed_bytes([net[1].weight.data]) == 0


# --- a LoRA's tensors, call after call ----------------------------------------------------------------


def lora_patches(model: Blocks, tier: str, down: torch.Tensor, up: torch.Tensor) -> list[LoraPatch]:
    """Patches whose layers lie in one streamed unit: block 2 under block swap, its first layer under
    sequential (where each layer is a unit); the strength, shared by the patched layers, streams with them."""
    layers = [model.blocks[2][0], model.blocks[2][1]] if tier == "block_swap" else [model.blocks[2][0]]
    return [LoraPatch(layer, 0.5, down, up, name=f"blocks.2.{i}") for i, layer in enumerate(layers)]


def lora_call(model: Blocks, tier: str, down, up, x, backend, pool=None) -> torch.Tensor:
    strategy = streaming(tier, len(model.blocks)) if pool is not None else MemoryStrategy(offload="none")
    with torch.no_grad(), apply_loras(lora_patches(model, tier, down, up), traced_in=list(model.blocks)), \
            apply_strategy(stage_of(model), strategy, backend, host_pool=pool):
        return model(x)


@pytest.mark.parametrize("tier", ["sequential", "block_swap"])
def test_a_lora_takes_the_homes_it_had_call_after_call(tier):
    torch.manual_seed(0)
    model, x = Blocks().eval(), torch.randn(2, 8)
    down, up = torch.randn(2, 8), torch.randn(8, 2)  # in RAM: pageable, so they get homes too
    pool, seen = HostPool(ARENA), []
    for _ in range(3):
        got = lora_call(model, tier, down, up, x, StrictBackend(pinning=True), pool)
        assert torch.equal(got, lora_call(model, tier, down, up, x, CpuBackend()))
        seen.append((pool.allocations, pool.pinned_bytes, pool.spare_bytes, len(pool._homes)))
    assert seen[0] == seen[1] == seen[2], seen
    down.mul_(2)  # written in place since: its old home's bytes are stale
    got = lora_call(model, tier, down, up, x, StrictBackend(pinning=True), pool)
    assert torch.equal(got, lora_call(model, tier, down, up, x, CpuBackend()))
    assert pool.allocations == seen[0][0] + 1


@pytest.mark.parametrize("tier", ["sequential", "block_swap"])
@pytest.mark.parametrize("change", ["written_in_inference_mode", "data_reassigned"])
def test_a_source_whose_bytes_changed_without_a_counted_write_gets_a_home_of_its_own(tier, change):
    """As ComfyUI runs nodes, under inference mode: its tensors count no writes, and `.data =` moves any
    tensor's bytes without counting one. Unchanged, the source still takes its home back; changed, the
    run must use the new bytes, never the old home's."""
    torch.manual_seed(0)
    model, x = Blocks().eval(), torch.randn(2, 8)
    with torch.inference_mode():
        down, up = torch.randn(2, 8), torch.randn(8, 2)
    pool = HostPool(ARENA)
    for _ in range(2):
        lora_call(model, tier, down, up, x, StrictBackend(pinning=True), pool)
    homes = pool.allocations
    assert lora_call(model, tier, down, up, x, StrictBackend(pinning=True), pool) is not None
    assert pool.allocations == homes, "an inference tensor met again, unchanged, takes its home back"
    with torch.inference_mode():
        if change == "written_in_inference_mode":
            down.mul_(2)
        else:
            down.data = torch.randn(2, 8)
    got = lora_call(model, tier, down, up, x, StrictBackend(pinning=True), pool)
    assert torch.equal(got, lora_call(model, tier, down, up, x, CpuBackend()))
    assert pool.allocations == homes + 1


# --- adoption does not double RAM ---------------------------------------------------------------------


def test_adoption_releases_each_units_originals_as_its_homes_are_made():
    """Every block's tensor is a buffer only the block holds; at each arena pinned (one block per arena),
    the blocks adopted before it must have let their pageable originals go."""
    count = 6
    model = nn.Module()
    model.blocks = nn.ModuleList(nn.Module() for _ in range(count))
    for block in model.blocks:
        block.register_buffer("w", torch.randn(ARENA // 4 * 3 // 4))  # three quarters of an arena: one block per arena
    originals = [weakref.ref(block.w) for block in model.blocks]
    alive_at_pins = []

    class Counting(StrictBackend):
        def pin_arena(self, nbytes):
            gc.collect()
            alive_at_pins.append(sum(ref() is not None for ref in originals))
            return super().pin_arena(nbytes)

    with torch.no_grad(), apply_strategy(stage_of(model), streaming("block_swap", count), Counting(pinning=True),
                                         host_pool=HostPool(ARENA)):
        pass
    assert alive_at_pins == list(range(count, 0, -1))  # block k's arena: the k - 1 before it released
    gc.collect()
    assert not any(ref() is not None for ref in originals)


# --- the host's pinned budget ---------------------------------------------------------------------------


def pinned_pool(model: Blocks, arenas: int) -> HostPool:
    """A pool that pinned one arena per block under a user's ceiling of `arenas` arenas."""
    pool = HostPool(arena_bytes=4096)
    with torch.no_grad(), apply_strategy(stage_of(model), streaming("block_swap", len(model.blocks),
                                                                    max_pinned_ram_gb=arenas * 4096 / GiB),
                                         StrictBackend(pinning=True), host_pool=pool):
        pass
    assert pool.pinned_bytes == arenas * 4096
    return pool


@pytest.mark.parametrize("tier", ["sequential", "block_swap"])
def test_a_streaming_apply_fits_the_pool_to_the_hosts_pinned_room(tier, monkeypatch):
    """ComfyUI pinned more of its own since the homes were made: the automatic ceiling's room shrank,
    and the pool follows it as it follows a lowered ceiling (the run is unchanged)."""
    monkeypatch.setattr(hostpool, "default_pinned_cap", lambda available=None: 1 << 40)  # RAM is plenty
    torch.manual_seed(0)
    model, x = Blocks(count=4, width=16).eval(), torch.randn(2, 16)  # a block: 2 x 1088 bytes, one per arena
    expected = model(x)
    pool = pinned_pool(model, arenas=4)
    pool.host_room_bytes = 4096
    with torch.no_grad(), apply_strategy(stage_of(model), streaming(tier, 4, None), StrictBackend(pinning=True),
                                         host_pool=pool):
        got = model(x)
    assert pool.pinned_bytes == 4096 and torch.equal(got, expected)


@pytest.mark.parametrize("room, ceiling", [(4096, 4 * 4096 / GiB), (None, None), (1 << 30, None)],
                         ids=["users ceiling", "no budget", "little free RAM"])
def test_what_the_budget_does_not_forbid_stays_pinned(room, ceiling, monkeypatch):
    """A user's ceiling is kept whatever the host's room (new homes are pinned under it too, so fitting it
    to the room would unpin them every run and pin them again); no budget and no ceiling: nothing to fit;
    the free-RAM part of the automatic ceiling unpins nothing (the pool's homes already left that RAM)."""
    monkeypatch.setattr(hostpool, "default_pinned_cap", lambda available=None: 0)  # no RAM free at all
    model = Blocks(count=4, width=16).eval()
    pool = pinned_pool(model, arenas=4)
    pool.host_room_bytes = room
    with torch.no_grad(), apply_strategy(stage_of(model), streaming("block_swap", 4, max_pinned_ram_gb=ceiling),
                                         StrictBackend(pinning=True), host_pool=pool):
        pass
    assert pool.pinned_bytes == 4 * 4096
