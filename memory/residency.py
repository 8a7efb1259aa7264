"""WeightGroup: tensors that move together, evicted by re-pointing to their original host storage.

Weights are read-only at inference, so an eviction never copies device memory back: the
parameter's `.data` is pointed again at the host tensor it had before the strategy was
applied. `restore()` therefore leaves every parameter and buffer on its original storage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .storage.mapping import any_mapped_files, is_file_backed, read_ahead
from .warm import WarmStore


@dataclass(frozen=True)
class Slot:
    """One tensor of a module: a parameter (moved through `.data`) or a buffer (replaced)."""

    module: nn.Module
    name: str
    is_parameter: bool
    host: torch.Tensor  # the original tensor; restored on eviction and removal

    def point_to(self, tensor: torch.Tensor) -> None:
        if not self.is_parameter:
            self.module._buffers[self.name] = tensor
            return
        param = self.module._parameters[self.name]
        if type(tensor) is torch.Tensor and type(param.data) is torch.Tensor:
            param.data = tensor  # the common case: a plain tensor, re-pointed in place
        else:
            # A tensor subclass (GGUF, torchao) cannot take `.data =` of another type; swap the
            # whole object's contents, as nn.Module._apply does, keeping the Parameter object
            # the module (and any optimizer or hook) holds.
            torch.utils.swap_tensors(param, nn.Parameter(tensor, requires_grad=param.requires_grad))

    def current(self) -> torch.Tensor:
        return self.module._parameters[self.name] if self.is_parameter else self.module._buffers[self.name]


def own_slots(module: nn.Module) -> list[Slot]:
    """The parameters and buffers a module holds directly (not its children's)."""
    slots = [Slot(module, n, True, p.data) for n, p in module._parameters.items() if p is not None]
    slots += [Slot(module, n, False, b) for n, b in module._buffers.items() if b is not None]
    return slots


def partition_slots(root: nn.Module, units: list[list[nn.Module]]) -> tuple[list[Slot], list[list[Slot]]]:
    """Split `root`'s tensors into streamed units and the rest (resident).

    Every slot is captured before any group re-points a tensor, so each records its true
    original. A tensor owned by modules in more than one unit, or also outside the units (tied
    weights such as T5's shared embedding), is resident: it must be present whenever any of its
    owners runs.
    """
    unit_of = {id(m): i for i, members in enumerate(units) for m in members}
    slots = [(unit_of.get(id(m)), slot) for m in root.modules() for slot in own_slots(m)]
    owners: dict[int, set] = {}
    for unit, slot in slots:
        owners.setdefault(id(slot.current()), set()).add(unit)
    resident: list[Slot] = []
    per_unit: list[list[Slot]] = [[] for _ in units]
    for unit, slot in slots:
        units_owning = owners[id(slot.current())]
        if unit is None or len(units_owning) > 1:
            resident.append(slot)
        else:
            per_unit[unit].append(slot)
    return resident, per_unit


def tie(slots: list[Slot]) -> list[list[Slot]]:
    """Slots grouped by tensor: a tied tensor (one Parameter in two modules) moves once."""
    tied: dict[int, list[Slot]] = {}
    for slot in slots:
        tied.setdefault(id(slot.current()), []).append(slot)
    return list(tied.values())


def tied_bytes(tensors: list[list[Slot]]) -> int:
    """Bytes of tied tensors, each counted once."""
    return sum(_nbytes(owners[0].host) for owners in tensors)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class WeightGroup:
    """A named set of tensors onloaded and evicted as one unit through a device backend.

    `streamed` groups copy on the backend's side stream (overlapping compute); whole
    components copy on the compute stream, through pinned memory where the backend pins
    (`StagingRing.upload` in memory/hostpool.py), never as pageable asynchronous copies.
    """

    def __init__(self, name: str, tensors: list[list[Slot]], backend: Any, streamed: bool, non_blocking: bool = True,
                 warm: WarmStore | None = None) -> None:
        self.name = name
        self._tensors = tensors
        self._backend = backend
        self._streamed = streamed
        self._non_blocking = non_blocking
        self._warm = warm  # device copies kept from an earlier call: taken instead of copied
        self._token: Any = None
        self._copies: list[torch.Tensor] | None = None  # while on the device: one per tied tensor
        self.on_device = False
        self.nbytes = tied_bytes(tensors)
        self._mapped: bool | None = None  # whether a host lies in a file mapping (read_ahead's test, made once)
        self._point_all(backend.evicted)

    def __repr__(self) -> str:
        state = "on device" if self.on_device else "evicted"
        return f"WeightGroup({self.name!r}, {len(self._tensors)} tensors, {self.nbytes} bytes, {state})"

    def onload(self, timed: bool = False) -> Any:
        """Start the host-to-device copy (asynchronous where the backend allows); idempotent.

        Returns the backend's copy token (for telemetry), or None if already on the device.
        """
        if self.on_device:
            return None
        hosts = self.hosts
        copies = self._warm.take(hosts) if self._warm is not None else [None] * len(hosts)
        missing = [i for i, copy in enumerate(copies) if copy is None]
        self._token = None
        if missing:
            fresh, self._token = self._backend.copy_group([hosts[i] for i in missing], self._non_blocking, self._streamed, timed)
            for i, copy in zip(missing, fresh):
                copies[i] = copy
        if self._warm is not None:
            uploaded = sum(_nbytes(hosts[i]) for i in missing)
            # a backend that routes whole components through pinned memory says how on its token
            routes = getattr(self._token, "routes", None)
            self._warm.count(uploaded, self.nbytes - uploaded, self._streamed, routes)
        self._point_copies(copies)
        return self._token

    def read_ahead(self) -> int:
        """Have the kernel start reading this group's file-backed weights (the disk tier) into the page
        cache, ahead of its copy (`storage.mapping.read_ahead`); bytes advised, 0 when on the device."""
        if self._mapped is None and any_mapped_files():  # once: hosts only ever move from a file into pinned RAM
            self._mapped = any(is_file_backed(host) for host in self.hosts)
        if self.on_device or not self._mapped:
            return 0
        return read_ahead(self.hosts)

    def adopt_kept(self) -> bool:
        """Take the warm store's copies if it keeps every tensor of this group: the group is then
        on the device without a copy (a call starting where the last one ended)."""
        if self.on_device or self._warm is None or not self._warm.holds_all(self.hosts):
            return False
        self._point_copies(self._warm.take(self.hosts))
        self._warm.count(0, self.nbytes, self._streamed)
        return True

    def kept_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(host, device copy) of every tensor while on the device, for a warm store to keep."""
        return list(zip(self.hosts, self._copies)) if self.on_device and self._copies is not None else []

    @property
    def hosts(self) -> list[torch.Tensor]:
        return [owners[0].host for owners in self._tensors]

    @property
    def streamed(self) -> bool:
        return self._streamed

    def _point_copies(self, copies: list[torch.Tensor]) -> None:
        for owners, copy in zip(self._tensors, copies):
            for slot in owners:
                slot.point_to(copy)
        self._copies = copies
        self.on_device = True

    def wait(self) -> None:
        """Make compute wait until this group's copy has landed."""
        if self._token is not None:
            self._backend.wait(self._token, [owners[0].current().data for owners in self._tensors])
            self._token = None

    def evict(self) -> None:
        """Point every tensor back at its host copy: no device-to-host copy."""
        self._point_all(self._backend.evicted)
        self._token = self._copies = None
        self.on_device = False

    def restore(self) -> None:
        """Leave every tensor exactly on the storage it had before the group existed."""
        self._point_all(lambda host: host)
        self._token = self._copies = None
        self.on_device = False

    def _point_all(self, form) -> None:
        for owners in self._tensors:
            shared = form(owners[0].host)
            for slot in owners:
                slot.point_to(shared)
