"""Disk re-reads under sequential offload with activation chunks.

A chunked block calls its per-token layers once per token slice, and sequential offload copies a
layer each time it is called: PCIe carries every copy. The page cache keeps a layer's pages after the
first slice, so the disk reads each distinct streamed byte at most once per pass.
"""

from __future__ import annotations

import pytest

from vidmem.memory import MemoryStrategy
from vidmem.memory.plan.candidates import plan_run
from vidmem.memory.plan.costs import DiskRead, Traffic
from vidmem.memory.plan.planner import Allocator, PlanOptions, VideoShape
from vidmem.memory.units import GiB
from vidmem.pipelines.configs import load_model

SHAPE = VideoShape(832, 480, 81)
ON_DISK = PlanOptions(allocator=Allocator.NATIVE, on_disk=True, steps=4)


@pytest.fixture(scope="module")
def wan():
    return load_model("wan2.1-t2v-1.3b")


def test_a_layer_copied_once_per_slice_is_read_from_the_disk_once_per_pass():
    layer = 100 * GiB // 1024
    traffic = Traffic(per_pass_bytes=4 * layer, distinct_per_pass_bytes=layer)
    assert DiskRead(cache_bytes=layer // 4).reread_bytes(traffic)[0] == layer - layer // 4
    assert DiskRead(cache_bytes=layer // 4).reread_bytes(Traffic(per_pass_bytes=layer))[0] == layer - layer // 4


@pytest.mark.parametrize("chunks", [4, 16])
def test_chunks_copy_more_over_pcie_but_read_no_more_from_the_disk(wan, chunks):
    budgets = (3 * GiB, 3 * GiB)  # the page cache cannot keep the 1.3B transformer's 2.6 GiB
    plain = plan_run(wan, SHAPE, MemoryStrategy(offload="sequential"), ON_DISK, *budgets)
    chunked = plan_run(wan, SHAPE, MemoryStrategy(offload="sequential", activation_chunks=chunks), ON_DISK, *budgets)
    work, plain_work = (max(p.stage("denoise").work, key=lambda w: w.traffic.per_pass_bytes) for p in (chunked, plain))
    assert work.traffic.per_pass_bytes > plain_work.traffic.per_pass_bytes  # PCIe: a copy per slice
    assert chunked.disk_reread_bytes_per_pass == plain.disk_reread_bytes_per_pass > 0
    assert work.traffic.once_bytes == plain_work.traffic.once_bytes >= 0  # what stays never went negative
    assert work.traffic.streamed_bytes == plain_work.traffic.streamed_bytes <= wan.weights("transformer").nbytes
