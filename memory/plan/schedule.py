"""Which weight tensors a tier keeps on the device while a component computes.

The split into resident tensors and streamed units is the engine's own (`offload.py` and
`residency.partition_slots`, run on the full-size meta module), so tied weights and tensors held
by parent modules stay resident exactly as they do in a run. What is in flight on top:
- `block_swap`: blocks stream in index order with `prefetch` ahead (cyclically into the next
  pass), so at most min(prefetch + 1, N) blocks are on the device with the resident part;
- `sequential`: the engine's `StreamSchedule` is replayed over the order one forward really runs
  the leaf modules in (recorded on the meta model), two passes so prefetch is in steady state,
  and the most bytes it ever holds are taken (prefetched units are allocated while the unit that
  issued them is still resident).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from ..blockswap import EVICTED_IN_FLIGHT, StreamSchedule
from ..offload import streamed_units  # the engine's unit rule; see the planner notes for making it public
from .storage import StoredSizes
from ..residency import own_slots, partition_slots
from ..strategy import MemoryStrategy, OffloadTier

Order = tuple[tuple[bool, str], ...]  # one forward: (True, name) = module starts, (False, name) = ends


@dataclass(frozen=True)
class ComponentWeights:
    """A component's weight totals as stored: bytes of its distinct tensors and its transformer blocks."""

    name: str
    nbytes: int
    block_count: int = 0  # blocks the engine can swap (denoisers only)
    tensors: tuple[int, ...] = field(default=(), repr=False)  # every distinct tensor's bytes
    stored: StoredSizes = StoredSizes()  # the storage format, its per-tensor bytes and transient

    @property
    def transient_bytes(self) -> int:
        """The dequantized copy of the layer computing now (0 when nothing is stored quantized)."""
        return self.stored.transient_bytes


def tensor_sizes(slots, stored: StoredSizes = StoredSizes()) -> list[int]:
    """Bytes of each distinct tensor among `slots` as stored (a tied tensor is copied once)."""
    unique = {id(slot.current()): slot.host for slot in slots}
    return [stored.nbytes(key, t) for key, t in unique.items()]


def streamed_unit_bytes(module: nn.Module, blocks: nn.ModuleList | None, strategy: MemoryStrategy,
                        stored: StoredSizes = StoredSizes()) -> list[int]:
    """Bytes of each unit the tier streams per forward pass (empty for none / model)."""
    units = streamed_units(module, blocks, strategy)
    if not units:
        return []
    _, per_unit = partition_slots(module, [members for _, members in units])
    return [sum(tensor_sizes(slots, stored)) for slots in per_unit]


def resident_tensors(module: nn.Module, blocks: nn.ModuleList | None, strategy: MemoryStrategy,
                     order: Order | None = None, stored: StoredSizes = StoredSizes()) -> list[int]:
    """Tensor sizes (as stored) on the device while `module` runs its heaviest part under `strategy`."""
    units = streamed_units(module, blocks, strategy)
    if not units:  # none / model, or block swap on a component without blocks: all of it
        return tensor_sizes((slot for m in module.modules() for slot in own_slots(m)), stored)
    resident, per_unit = partition_slots(module, [members for _, members in units])
    sizes = [tensor_sizes(slots, stored) for slots in per_unit]
    if strategy.offload is OffloadTier.BLOCK_SWAP:
        in_flight = min(strategy.prefetch_blocks + 1, len(sizes))
        window = max((sum(map(sum, sizes[i : i + in_flight])), i) for i in range(len(sizes) - in_flight + 1))[1]
        return tensor_sizes(resident, stored) + [t for unit in sizes[window : window + in_flight] for t in unit]
    heads = {id(head): i for i, (head, _) in enumerate(units)}
    names = {name: heads[id(m)] for name, m in module.named_modules() if id(m) in heads}
    return tensor_sizes(resident, stored) + _replay(sizes, names, order or (), strategy.prefetch_blocks)


def computing_residency(module: nn.Module, blocks: nn.ModuleList | None, strategy: MemoryStrategy,
                        order: Order | None = None, stored: StoredSizes = StoredSizes()) -> tuple[list[int], list[int]]:
    """(tensors live while a streamed block computes, tensors evicted but still read by the GPU).

    Block swap: a block's prefetches are queued when its forward has been queued, so while block i
    computes the live blocks are those queued before it, i .. i+prefetch-1 (i alone without a
    prefetch), and the block before it is evicted but kept by the allocator until the compute
    stream has passed it (`record_stream`; the engine's EVICTED_IN_FLIGHT): in reserved memory,
    not in allocated. Measured on an H200 (docs/gpu.md): counting prefetch + 1 blocks live put Wan
    14B's allocated peak one block high. Other tiers: `resident_tensors`, nothing held. (Sequential
    would need the same split leaf by leaf, and with it the weight peak outside the blocks, where an
    embedder's leaf can be larger than any block's while activations are small: not modelled yet;
    the whole-pass peak it takes instead errs high, 1.10x allocated on the H200.)
    """
    units = streamed_units(module, blocks, strategy)
    if strategy.offload is not OffloadTier.BLOCK_SWAP or not units:
        return resident_tensors(module, blocks, strategy, order, stored), []
    resident, per_unit = partition_slots(module, [members for _, members in units])
    sizes = [tensor_sizes(slots, stored) for slots in per_unit]
    live = min(max(strategy.prefetch_blocks, 1), len(sizes))
    # Without a prefetch the reserved peak is one block lower again (measured on the H200: 7.05 GiB
    # at prefetch 0, 7.71 at 1, 8.37 at 2): the held block is counted only with a prefetch.
    held = min(EVICTED_IN_FLIGHT, len(sizes) - live) if strategy.prefetch_blocks else 0
    span = live + held
    start = max((sum(map(sum, sizes[i : i + span])), i) for i in range(len(sizes) - span + 1))[1]
    window = sizes[start : start + span]
    return (tensor_sizes(resident, stored) + [t for unit in window[held:] for t in unit],
            [t for unit in window[:held] for t in unit])


def _replay(sizes: list[list[int]], names: dict[str, int], order: Order, prefetch: int) -> list[int]:
    """The streamed tensors resident when the schedule holds the most bytes."""
    if not order:  # no recorded pass: the prefetch + 1 largest units (the engine's own bound)
        largest = sorted(sizes, key=sum, reverse=True)[: prefetch + 1]
        return [t for unit in largest for t in unit]
    ledger = _Ledger()
    groups = [_SimGroup(i, unit, ledger) for i, unit in enumerate(sizes)]
    schedule = StreamSchedule(groups, prefetch, False, backend=_SimBackend(), observer=lambda kind, group: None)
    for _ in range(2):  # the first pass learns the order; the second prefetches
        for start, name in order:
            index = names.get(name)
            if index is None:
                continue
            if start:
                schedule.before_forward(groups[index])
            else:
                schedule.after_forward(groups[index])
        schedule.end_of_pass()
    return [t for group in ledger.peak_groups for t in group.sizes]


@dataclass
class _Ledger:
    resident: set = field(default_factory=set)
    bytes: int = 0
    peak: int = -1
    peak_groups: tuple = ()

    def change(self, group: "_SimGroup", onload: bool) -> None:
        (self.resident.add if onload else self.resident.discard)(group)
        self.bytes += group.nbytes if onload else -group.nbytes
        if self.bytes > self.peak:
            self.peak, self.peak_groups = self.bytes, tuple(self.resident)


class _SimGroup:
    """Stands in for a WeightGroup in the real StreamSchedule: the same verbs, bytes for tensors."""

    def __init__(self, index: int, sizes: list[int], ledger: _Ledger) -> None:
        self.name = f"unit{index}"
        self.sizes = sizes
        self.nbytes = sum(sizes)
        self.on_device = False
        self._ledger = ledger

    def onload(self, timed: bool = False) -> None:
        if not self.on_device:
            self.on_device = True
            self._ledger.change(self, True)

    def wait(self) -> None:
        return None

    def evict(self) -> None:
        if self.on_device:
            self.on_device = False
            self._ledger.change(self, False)


class _SimBackend:
    """The backend verbs the schedule calls for ordering and timing; nothing to order here."""

    def stamp(self) -> None:
        return None

    def compute_done(self) -> None:
        return None

    def host_wait(self, marker) -> None:
        return None
