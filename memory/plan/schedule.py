"""Which weight tensors a tier keeps on the device while a component computes.

The split into resident tensors and streamed units is the engine's own (`offload.streamed_units`
and `residency.partition_slots`' rule, read once from the full-size meta module into a
`SlotTable`), so tied weights and tensors held by parent modules stay resident exactly as they
do in a run. What is in flight on top:
- `block_swap`: blocks stream in index order with `prefetch` ahead (cyclically into the next
  pass), so at most min(prefetch + 1, N) blocks are on the device with the resident part;
- `sequential`: the engine's `StreamSchedule` is replayed over the order one forward really runs
  the leaf modules in (recorded on the meta model), two passes so prefetch is in steady state,
  and the most bytes it ever holds are taken (prefetched units are allocated while the unit that
  issued them is still resident): the weights the tier puts on the device. Which of them are there
  at the activations' peak is another matter: `stream_timeline` replays the same schedule over a
  traced call's own allocations, so each leaf is allocated and freed where the engine moves it.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from torch import nn

from ..blockswap import EVICTED_IN_FLIGHT, StreamSchedule
from .allocator import EVICT, FREE, ONLOAD, RELEASE, WeightTimeline
from ..offload import streamed_units  # the engine's unit rule, recorded in each SlotTable
from .storage import StoredSizes
from ..residency import own_slots
from ..strategy import MemoryStrategy, OffloadTier

Order = tuple[tuple[bool, str], ...]  # one forward: (True, name) = module starts, (False, name) = ends


@dataclass(frozen=True)
class SlotTable:
    """A component's tensors as `residency.partition_slots` sees them, as plain numbers: enough to
    split them into resident tensors and streamed units for any tier without the module (so a
    plan can come from the planner's disk cache, and each split costs a walk over integers).

    `modules` are the names of the modules holding tensors directly, in `module.modules()` order;
    `slots[i]` the tensors module i holds (indexes into `sizes`, one per distinct tensor, as
    stored, in first-use order); `leaf[i]` whether the sequential tier streams it as a unit;
    `block[i]` the swappable block it belongs to (the last one if several), -1 outside them. Both
    are read from the engine's own rule, `offload.streamed_units`; block swap with N blocks
    streams the last N (tests/test_plan_cache.py checks the split against `partition_slots`).
    `workspace[i]`: the upcast workspace module i holds while it computes (its stored weight's,
    `StoredSizes.workspace_by_tensor`; 0 for the rest).
    """

    sizes: tuple[int, ...] = ()
    modules: tuple[str, ...] = ()
    slots: tuple[tuple[int, ...], ...] = ()
    leaf: tuple[bool, ...] = ()
    block: tuple[int, ...] = ()
    block_count: int = 0
    workspace: tuple[int, ...] = ()
    _memo: dict = field(default_factory=dict, compare=False, hash=False, repr=False)  # residency per tier

    def as_json(self) -> dict:
        return {"sizes": self.sizes, "modules": self.modules, "slots": self.slots, "leaf": self.leaf,
                "block": self.block, "block_count": self.block_count, "workspace": self.workspace}

    @classmethod
    def from_json(cls, data: dict) -> "SlotTable":
        return cls(tuple(data["sizes"]), tuple(data["modules"]), tuple(tuple(s) for s in data["slots"]),
                   tuple(bool(x) for x in data["leaf"]), tuple(data["block"]), int(data["block_count"]),
                   tuple(int(x) for x in data["workspace"]))

    def units(self, strategy: MemoryStrategy) -> tuple[list[int], list[list[int]], dict[str, int]]:
        """(resident tensor indexes, each streamed unit's, unit index by its head module's name),
        as `offload.streamed_units` and `residency.partition_slots` split the module."""
        key = ("units", strategy.offload, strategy.blocks_to_swap)
        if key not in self._memo:
            self._memo[key] = self._units(strategy)
        return self._memo[key]

    def _units(self, strategy: MemoryStrategy) -> tuple[list[int], list[list[int]], dict[str, int]]:
        if strategy.offload is OffloadTier.SEQUENTIAL:
            heads = [i for i, leaf in enumerate(self.leaf) if leaf]
            unit_of = {m: u for u, m in enumerate(heads)}
        elif strategy.offload is OffloadTier.BLOCK_SWAP and self.block_count:
            first = self.block_count - strategy.blocks_to_swap
            unit_of = {m: b - first for m, b in enumerate(self.block) if b >= first}
            heads = []
        else:
            return [], [], {}
        count = len(heads) if heads else strategy.blocks_to_swap
        owners: dict[int, set] = {}
        for m, tensors in enumerate(self.slots):
            for t in tensors:
                owners.setdefault(t, set()).add(unit_of.get(m))
        resident: list[int] = []
        per_unit: list[list[int]] = [[] for _ in range(count)]
        for m, tensors in enumerate(self.slots):
            unit = unit_of.get(m)
            for t in tensors:
                (resident if unit is None or len(owners[t]) > 1 else per_unit[unit]).append(t)
        return resident, per_unit, {self.modules[m]: u for u, m in enumerate(heads)}

    def nbytes(self, tensors: list[int]) -> list[int]:
        """Bytes of each distinct tensor among `tensors` (a tied tensor is copied once)."""
        return [self.sizes[t] for t in dict.fromkeys(tensors)]

    def with_tensors(self, held: Mapping[str, Sequence[tuple[Hashable, int]]]) -> "SlotTable":
        """This table with more tensors held directly by named modules: `held` maps a module's name
        to (key, bytes) per tensor, one key per distinct tensor (a key under several modules is one
        tensor, tied as `residency.partition_slots` ties it). A module's own buffers move with it
        under every tier, in its block or as part of its leaf, so these do too (the LoRA buffers
        memory.lora registers on their layers). ValueError names a module the table does not have."""
        unknown = [name for name in held if name not in self.modules]
        if unknown:
            raise ValueError(f"no module {', '.join(map(repr, unknown))} holds tensors in this component; "
                             "name modules that hold weights (its linear layers).")
        sizes, index = list(self.sizes), {}
        extra: dict[str, list[int]] = {}
        for name, tensors in held.items():
            for key, nbytes in tensors:
                if key not in index:
                    index[key] = len(sizes)
                    sizes.append(int(nbytes))
                extra.setdefault(name, []).append(index[key])
        slots = tuple(slot + tuple(extra.get(name, ())) for name, slot in zip(self.modules, self.slots))
        return replace(self, sizes=tuple(sizes), slots=slots, _memo={})


def slot_table(module: nn.Module, blocks: nn.ModuleList | None, stored: StoredSizes = StoredSizes()) -> SlotTable:
    """`module`'s SlotTable, its tensors counted as stored."""
    count = len(blocks) if blocks is not None else 0
    every_block = streamed_units(module, blocks, MemoryStrategy(offload="block_swap", blocks_to_swap=count)) if count else []
    block_of = {id(m): i for i, (_, members) in enumerate(every_block) for m in members}
    leaves = {id(head) for head, _ in streamed_units(module, blocks, MemoryStrategy(offload="sequential"))}
    index: dict[int, int] = {}
    sizes, names, slots, leaf, block, workspace = [], [], [], [], [], []
    for name, sub in module.named_modules():
        own = own_slots(sub)
        if not own:
            continue
        for slot in own:
            key = id(slot.current())
            if key not in index:
                index[key] = len(sizes)
                sizes.append(stored.nbytes(key, slot.host))
        names.append(name)
        slots.append(tuple(index[id(slot.current())] for slot in own))
        leaf.append(id(sub) in leaves)
        block.append(block_of.get(id(sub), -1))
        workspace.append(sum(stored.workspace_by_tensor.get(id(slot.current()), 0) for slot in own))
    return SlotTable(tuple(sizes), tuple(names), tuple(slots), tuple(leaf), tuple(block), count, tuple(workspace))


@dataclass(frozen=True)
class ComponentWeights:
    """A component's weight totals as stored: bytes of its distinct tensors and its transformer blocks."""

    name: str
    nbytes: int
    block_count: int = 0  # blocks the engine can swap (denoisers only)
    tensors: tuple[int, ...] = field(default=(), repr=False)  # every distinct tensor's bytes
    stored: StoredSizes = StoredSizes()  # the storage format, its per-tensor bytes and transient
    table: SlotTable = field(default=SlotTable(), repr=False)  # how the tiers split its tensors

    @property
    def transient_bytes(self) -> int:
        """The dequantized copy of the layer computing now (0 when nothing is stored quantized)."""
        return self.stored.transient_bytes

    def with_tensors(self, held: Mapping[str, Sequence[tuple[Hashable, int]]]) -> "ComponentWeights":
        """These weights and more tensors held by named modules (`SlotTable.with_tensors`), e.g. the
        LoRA buffers a run attaches to its layers: counted where the engine moves them, with their
        block or leaf, not as one lump beside the component."""
        table = self.table.with_tensors(held)
        added = table.sizes[len(self.table.sizes):]
        return replace(self, nbytes=self.nbytes + sum(added), tensors=self.tensors + added, table=table)


def tensor_sizes(slots, stored: StoredSizes = StoredSizes()) -> list[int]:
    """Bytes of each distinct tensor among `slots` as stored (a tied tensor is copied once)."""
    unique = {id(slot.current()): slot.host for slot in slots}
    return [stored.nbytes(key, t) for key, t in unique.items()]


def streamed_unit_bytes(module: nn.Module, blocks: nn.ModuleList | None, strategy: MemoryStrategy,
                        stored: StoredSizes = StoredSizes()) -> list[int]:
    """Bytes of each unit the tier streams per forward pass (empty for none / model)."""
    return table_streamed_unit_bytes(slot_table(module, blocks, stored), strategy)


def resident_tensors(module: nn.Module, blocks: nn.ModuleList | None, strategy: MemoryStrategy,
                     order: Order | None = None, stored: StoredSizes = StoredSizes()) -> list[int]:
    """Tensor sizes (as stored) on the device while `module` runs its heaviest part under `strategy`."""
    return table_resident_tensors(slot_table(module, blocks, stored), strategy, order)


def computing_residency(module: nn.Module, blocks: nn.ModuleList | None, strategy: MemoryStrategy,
                        order: Order | None = None, stored: StoredSizes = StoredSizes()) -> tuple[list[int], list[int]]:
    """`table_computing_residency` of the module's SlotTable."""
    return table_computing_residency(slot_table(module, blocks, stored), strategy, order)


def table_streamed_unit_bytes(table: SlotTable, strategy: MemoryStrategy) -> list[int]:
    _, per_unit, _ = table.units(strategy)
    return [sum(table.nbytes(unit)) for unit in per_unit]


def table_resident_tensors(table: SlotTable, strategy: MemoryStrategy, order: Order | None = None) -> list[int]:
    """`resident_tensors` from a SlotTable (memoised on it: the candidate search asks again and again)."""
    key = (strategy.offload, strategy.blocks_to_swap, strategy.prefetch_blocks, order)
    if key not in table._memo:
        table._memo[key] = _resident_tensors(table, strategy, order)
    return list(table._memo[key])


def _resident_tensors(table: SlotTable, strategy: MemoryStrategy, order: Order | None) -> list[int]:
    resident, per_unit, names = table.units(strategy)
    if not per_unit:  # none / model, or block swap on a component without blocks: all of it
        return list(table.sizes)
    sizes = [table.nbytes(unit) for unit in per_unit]
    if strategy.offload is OffloadTier.BLOCK_SWAP:
        in_flight = min(strategy.prefetch_blocks + 1, len(sizes))
        window = max((sum(map(sum, sizes[i : i + in_flight])), i) for i in range(len(sizes) - in_flight + 1))[1]
        return table.nbytes(resident) + [t for unit in sizes[window : window + in_flight] for t in unit]
    return table.nbytes(resident) + _replay(sizes, names, order or (), strategy.prefetch_blocks)


def table_computing_residency(table: SlotTable, strategy: MemoryStrategy,
                              order: Order | None = None) -> tuple[list[int], list[int]]:
    """(tensors live while a streamed block computes, tensors evicted but still read by the GPU).

    Block swap: a block's prefetches are queued when its forward has been queued, so while block i
    computes the live blocks are those queued before it, i .. i+prefetch-1 (i alone without a
    prefetch), and the block before it is evicted but kept by the allocator until the compute
    stream has passed it (`record_stream`; the engine's EVICTED_IN_FLIGHT): in reserved memory,
    not in allocated. Measured on an H200 (docs/gpu.md): counting prefetch + 1 blocks live put Wan
    14B's allocated peak one block high. Other tiers: `resident_tensors`, nothing held. (Sequential
    moves its leaves between the activations' own allocations: `stream_timeline`.)
    """
    resident, per_unit, _ = table.units(strategy)
    if strategy.offload is not OffloadTier.BLOCK_SWAP or not per_unit:
        return table_resident_tensors(table, strategy, order), []
    sizes = [table.nbytes(unit) for unit in per_unit]
    live = min(max(strategy.prefetch_blocks, 1), len(sizes))
    # Without a prefetch the reserved peak is one block lower again (measured on the H200: 7.05 GiB
    # at prefetch 0, 7.71 at 1, 8.37 at 2): the held block is counted only with a prefetch.
    held = min(EVICTED_IN_FLIGHT, len(sizes) - live) if strategy.prefetch_blocks else 0
    span = live + held
    start = max((sum(map(sum, sizes[i : i + span])), i) for i in range(len(sizes) - span + 1))[1]
    window = sizes[start : start + span]
    return (table.nbytes(resident) + [t for unit in window[held:] for t in unit],
            [t for unit in window[:held] for t in unit])


@dataclass(frozen=True)
class Streaming:
    """A component the sequential tier streams leaf by leaf while a call runs.

    `copy_stream`: how the runtime moves a leaf. vidmem copies it on a side stream, into that
    stream's own allocator pool, and an evicted leaf's memory stays taken until the GPU has passed
    it (`record_stream`); accelerate (diffusers' `enable_sequential_cpu_offload`) loads it on the
    compute stream and frees it at once. `peak`: the streamed tensors on the device when the tier
    holds the most, with a stored layer's upcast workspace (`resident_tensors` beyond what stays).
    """

    table: SlotTable
    strategy: MemoryStrategy
    copy_stream: bool = True
    peak: tuple[int, ...] = ()


def stream_timeline(streaming: Streaming, marks: tuple[tuple[int, bool, str], ...]) -> WeightTimeline | None:
    """Where one traced call's streamed leaves, and its stored layers' upcast workspaces, come and go
    among the call's own allocations (`Trace.marks`).

    The engine's StreamSchedule is replayed over the call's module marks three times (the first pass
    learns the order, the third starts as every later one does and is the one kept): a leaf is allocated
    where the schedule onloads or prefetches it and freed where it evicts it; an evicted leaf the
    GPU was computing with is held until the host next waits for that computation (the engine's
    EVICTED_IN_FLIGHT throttle), the most memory its copy can keep. A workspace lives from its
    layer's start to its end. So a phase holds, at its activations' peak, the leaves the engine
    holds then, not the most it holds anywhere in the pass (Wan 14B: one 50 MiB projection at the
    feed-forward's residual, not the 300 MiB time projection and its neighbour; measured on an H200).
    """
    table, strategy = streaming.table, streaming.strategy
    if not marks:  # a call traced without them: the tier's peak, throughout
        return WeightTimeline((streaming.peak,), (streaming.copy_stream,), ((0, False),)) if streaming.peak else None
    key = ("timeline", strategy.offload, strategy.prefetch_blocks, streaming.copy_stream, marks)
    if key not in table._memo:
        table._memo[key] = _timeline(table, strategy, streaming.copy_stream, marks)
    return table._memo[key]


def _timeline(table: SlotTable, strategy: MemoryStrategy, copy_stream: bool, marks) -> WeightTimeline:
    _, per_unit, names = table.units(strategy)
    groups = [tuple(table.nbytes(unit)) for unit in per_unit]
    workspace = {}
    for name, nbytes in zip(table.modules, table.workspace):
        if nbytes:
            workspace[name] = len(groups)
            groups.append((nbytes,))
    moves = _Moves(copy_stream)
    units = [_SimGroup(i, list(unit), moves) for i, unit in enumerate(groups[: len(per_unit)])]
    schedule = StreamSchedule(units, strategy.prefetch_blocks, False, backend=moves, observer=lambda kind, group: None)
    for recording in (False, False, True):  # learn the order, prefetch, then the steady state is kept
        moves.begin(recording)
        for position, start, name in marks:
            moves.position = position
            unit, upcast = names.get(name), workspace.get(name)
            if start:
                if unit is not None:
                    schedule.before_forward(units[unit])
                if upcast is not None:
                    moves.add(ONLOAD, upcast)
            else:
                if upcast is not None:
                    moves.add(FREE, upcast)
                if unit is not None:
                    schedule.after_forward(units[unit])
        schedule.end_of_pass()
    copied = (copy_stream,) * len(per_unit) + (False,) * len(workspace)
    return WeightTimeline(tuple(groups), copied, moves.start, tuple(moves.moves))


class _Moves:
    """Records a simulated StreamSchedule's onloads and evictions as WeightTimeline moves; it is the
    `_SimGroup`s' ledger and the schedule's backend (whose compute-done markers name the group)."""

    def __init__(self, copy_stream: bool) -> None:
        self.copy_stream = copy_stream
        self.recording = False
        self.position = 0
        self.moves: list[tuple[int, int, int]] = []
        self.start: tuple[tuple[int, bool], ...] = ()
        self._on: dict[int, None] = {}  # groups on the device, in onload order
        self._held: list[int] = []  # evicted while the GPU may read them, oldest first
        self._changes = 0
        self._evicted: tuple[int, int, int] | None = None  # (group, its move's index, change count)

    def begin(self, recording: bool) -> None:
        if recording:
            self.start = tuple((g, True) for g in self._held) + tuple((g, False) for g in self._on)
        self.recording = recording

    def add(self, op: int, group: int) -> None:
        if self.recording:
            self.moves.append((self.position, op, group))

    def change(self, group: "_SimGroup", onload: bool) -> None:
        self._changes += 1
        if onload:
            self._on[group.index] = None
            self.add(ONLOAD, group.index)
            return
        self._on.pop(group.index, None)
        self.add(FREE, group.index)
        self._evicted = (group.index, len(self.moves) - 1, self._changes)

    # the backend verbs StreamSchedule calls
    def stamp(self) -> None:
        return None

    def compute_done(self) -> int | None:
        """Called right after a group whose compute was queued is evicted: its memory is held."""
        if not self.copy_stream or self._evicted is None or self._evicted[2] != self._changes:
            return None
        group, index, _ = self._evicted
        if self.recording:
            self.moves[index] = (self.moves[index][0], EVICT, group)
        self._held.append(group)
        return group

    def host_wait(self, marker: int | None) -> None:
        if marker is not None and marker in self._held:
            self._held.remove(marker)
            self.add(RELEASE, marker)


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
    # In onload order, as the allocator sees them: a set's order would follow object addresses, so
    # the same plan could replay its weights in another order in another process.
    resident: dict = field(default_factory=dict)
    bytes: int = 0
    peak: int = -1
    peak_groups: tuple = ()

    def change(self, group: "_SimGroup", onload: bool) -> None:
        if onload:
            self.resident[group] = None
        else:
            self.resident.pop(group, None)
        self.bytes += group.nbytes if onload else -group.nbytes
        if self.bytes > self.peak:
            self.peak, self.peak_groups = self.bytes, tuple(self.resident)


class _SimGroup:
    """Stands in for a WeightGroup in the real StreamSchedule: the same verbs, bytes for tensors."""

    def __init__(self, index: int, sizes: list[int], ledger: "_Ledger | _Moves") -> None:
        self.index = index
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

    def read_ahead(self) -> int:
        return 0  # page-cache advice moves no device bytes


class _SimBackend:
    """The backend verbs the schedule calls for ordering and timing; nothing to order here."""

    def stamp(self) -> None:
        return None

    def compute_done(self) -> None:
        return None

    def host_wait(self, marker) -> None:
        return None
