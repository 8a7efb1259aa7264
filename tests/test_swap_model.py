"""The GPU timeline model against small cases worked out by hand (unit bandwidth: bytes = seconds)."""

from __future__ import annotations

import pytest

from vidmem.memory.swap_model import BlockCost, GpuSpec, simulate, uniform_blocks


def run(count, copy, compute, swapped, prefetch, **kwargs):
    return simulate(uniform_blocks(count, copy, compute), swapped, prefetch, bandwidth=1.0, **kwargs)


def test_nothing_swapped_costs_nothing():
    timeline = run(4, copy=5, compute=2, swapped=0, prefetch=2, forwards=3, other_compute_s=1)
    assert timeline.total_s == timeline.resident_s == 27
    assert timeline.overhead == 0 and timeline.copies == 0


@pytest.mark.parametrize("forwards", [1, 3])
def test_prefetch_0_still_overlaps_one_copy_because_the_host_runs_ahead(forwards):
    # The host queues b0 (copy0 0-1, compute0 1-3) and goes on at once: b1's hook issues copy1 at
    # 1-2 while b0 computes (one evicted block may still be computing: EVICTED_IN_FLIGHT). b2's hook
    # waits for b0's compute (3) first: copy2 3-4, compute2 5-7; copy3 5-6, compute3 7-9. Only the
    # cold copy of the call is exposed.
    timeline = run(4, copy=1, compute=2, swapped=4, prefetch=0, forwards=forwards)
    assert timeline.total_s == 8 * forwards + 1
    assert timeline.stall_s == 1
    assert timeline.peak_swapped_on_device == 1


def test_prefetch_hides_copies_when_copy_is_at_most_compute():
    # copy0 0-1, compute0 1-3 | copy1 1-2, compute1 3-5 | copy2 3-4, ... | compute3 7-9, copy0' 7-8;
    # the second forward never waits: only the first copy of the call is exposed.
    for forwards in (1, 2):
        timeline = run(4, copy=1, compute=2, swapped=4, prefetch=1, forwards=forwards)
        assert timeline.total_s == 8 * forwards + 1
    equal = run(4, copy=2, compute=2, swapped=4, prefetch=1, forwards=2)
    assert equal.total_s == 16 + 2


@pytest.mark.parametrize("prefetch", [1, 2])
def test_copy_bound_runs_at_copy_speed_whatever_the_prefetch(prefetch):
    # The copy queue never idles: 4 copies of 3, then the last block's compute of 1.
    timeline = run(4, copy=3, compute=1, swapped=4, prefetch=prefetch)
    assert timeline.total_s == 13
    assert timeline.stall_s == 3 + 3 * 2


def test_blocking_copies_hold_the_host_and_run_at_copy_speed():
    # Copy-bound (copy 3, compute 1): the copy queue sets the pace, 3 per block, plus the last
    # compute. With prefetch 2 the wrap-around copies of the first forward's last block hold the
    # host before it can queue the second forward: 3 more.
    for prefetch, copies, total in ((0, 8, 25), (1, 9, 25), (2, 10, 28)):
        timeline = run(4, copy=3, compute=1, swapped=4, prefetch=prefetch, overlap=False, forwards=2)
        assert (timeline.copies, timeline.total_s) == (copies, total)
    assert run(4, copy=3, compute=1, swapped=4, prefetch=2, forwards=2).total_s == 25  # non-blocking: no such delay


def test_resident_blocks_hide_the_swapped_copies():
    # 2 resident + 2 swapped, copy 1 = compute 1: the host reaches the first swapped block's hook
    # while the resident blocks compute, so even the cold copy (0-1) is hidden behind them (0-2).
    timeline = run(4, copy=1, compute=1, swapped=2, prefetch=1, forwards=2)
    assert timeline.total_s == timeline.resident_s == 8


def test_one_swapped_block_is_never_prefetched_but_is_copied_while_the_host_runs_ahead():
    # StreamSchedule never prefetches a block for itself (N = 1): each forward copies it at its
    # hook, which the host reaches while the resident blocks compute.
    for prefetch in (0, 2):
        timeline = run(3, copy=1, compute=2, swapped=1, prefetch=prefetch, forwards=2)
        assert timeline.total_s == 12 and timeline.copies == 2 and timeline.peak_swapped_on_device == 1


@pytest.mark.parametrize("swapped,prefetch,expected", [(4, 0, 1), (4, 1, 2), (4, 2, 3), (2, 2, 2), (1, 2, 1)])
def test_at_most_prefetch_plus_one_swapped_blocks_on_the_device(swapped, prefetch, expected):
    assert run(4, copy=1, compute=1, swapped=swapped, prefetch=prefetch, forwards=2).peak_swapped_on_device == expected


def test_head_and_embeddings_count_as_resident_compute():
    timeline = run(2, copy=1, compute=1, swapped=2, prefetch=1, forwards=2, other_compute_s=3)
    # copy0 0-1 and copy1 1-2 land while the embeddings compute (0-3): nothing waits.
    assert timeline.resident_s == 10 and timeline.total_s == 10
    # copy-bound: copy0 0-5 (embeddings 0-3), b0 5-6, copy1 5-10, b1 10-11
    assert run(2, copy=5, compute=1, swapped=2, prefetch=1, forwards=1, other_compute_s=3).total_s == 11


def test_the_model_runs_the_engines_schedule():
    """Not a restatement: a change to StreamSchedule (here, no prefetch at all) changes the model."""
    from unittest import mock

    with mock.patch("vidmem.memory.blockswap.StreamSchedule._upcoming", lambda self, group: []):
        without = run(4, copy=1, compute=1, swapped=4, prefetch=2, forwards=1)
    assert without.copies == 4 and without.peak_swapped_on_device == 1
    assert run(4, copy=1, compute=1, swapped=4, prefetch=2, forwards=1).peak_swapped_on_device == 3


def test_gpu_spec_converts_bytes_and_flops():
    gpu = GpuSpec(pcie_bytes_per_s=25e9, peak_flops=100e12, achieved_fraction=0.5)
    assert gpu.copy_s(50e9) == pytest.approx(2.0)
    assert gpu.compute_s(100e12) == pytest.approx(2.0)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(swapped=5, prefetch=1), "between 0 and the block count 4"),
        (dict(swapped=2, prefetch=-1), "prefetch=-1"),
        (dict(swapped=2, prefetch=1, forwards=0), "forwards=0"),
    ],
)
def test_bad_input_names_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        simulate(uniform_blocks(4, 1, 1), bandwidth=1.0, **kwargs)
    with pytest.raises(ValueError, match="achieved_fraction"):
        GpuSpec(achieved_fraction=0)
    assert BlockCost(1, 2).compute_s == 2
