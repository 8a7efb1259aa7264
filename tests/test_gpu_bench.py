"""The GPU bench's CPU half: its trace arithmetic on known events, and every row end to end on
tiny widths (`bench/gpu.py --device cpu`), so the script a GPU lease runs is checked in CI."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from gpu import BenchConfig, TINY_CHANGES, TINY_SHAPE, default_rows, run, trace_overlap  # noqa: E402


def kernel(ts, dur, name="gemm"):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}


def copy(ts, dur, pinned=True):
    return {"ph": "X", "cat": "gpu_memcpy", "ts": ts, "dur": dur,
            "name": f"Memcpy HtoD ({'Pinned' if pinned else 'Pageable'} -> Device)"}


def test_overlap_counts_copy_time_under_any_kernel():
    events = [kernel(0, 100), kernel(150, 50), copy(50, 100), copy(210, 10, pinned=False),
              {"ph": "X", "cat": "cuda_runtime", "name": "cudaEventSynchronize", "ts": 5, "dur": 1},
              {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": 0, "dur": 500}]
    result = trace_overlap(events)
    # the first copy runs 50..150: kernels cover 50..100 (the gap 100..150 is exposed); the second, 210..220, none
    assert result["copies"] == 2 and result["pageable_copies"] == 1
    assert result["overlap"] == pytest.approx(50 / 110)
    assert result["gpu_busy"] == pytest.approx(150 / 220)  # kernels' union over the span of device work
    assert result["host_syncs"]["cudaEventSynchronize"] == 1


def test_no_copies_no_overlap_figure():
    assert trace_overlap([kernel(0, 10)])["overlap"] is None


def test_every_row_runs_end_to_end_on_the_cpu(tmp_path):
    rows = default_rows(TINY_CHANGES["num_layers"], None)
    saved = []
    result = run(BenchConfig(shape=TINY_SHAPE, changes=tuple(TINY_CHANGES.items()), device="cpu", steps=1, pinned_gib=None),
                 rows, log=lambda line: None, save=saved.append)
    assert set(result["rows"]) == {r.name for r in rows}
    assert {"resident", "sequential", "group_offload_block", "group_offload_leaf"} <= set(result["rows"])
    for name, row in result["rows"].items():
        assert row["step_seconds"] > 0 and row["ratio_vs_resident"] > 0, name
        assert (row["predicted"] is None) == name.startswith("group_offload"), name
    assert len(saved) == len(rows)  # the JSON is rewritten after every row
    json.dumps(result)


def test_rows_past_the_deadline_are_listed_not_run():
    rows = default_rows(TINY_CHANGES["num_layers"], None)[:2]
    result = run(BenchConfig(shape=TINY_SHAPE, changes=tuple(TINY_CHANGES.items()), device="cpu", steps=1, pinned_gib=None),
                 rows, log=lambda line: None, deadline=0.0)
    assert all("skipped" in row for row in result["rows"].values())
