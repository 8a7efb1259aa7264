"""The GPU bench's CPU half: its trace arithmetic on known events, and every row end to end on
tiny widths (`bench/gpu.py --device cpu`), so the script a GPU lease runs is checked in CI; the warm
rows' byte counts (a copying CPU backend stands in for the device), not their seconds."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from gpu import BenchConfig, TINY_CHANGES, TINY_SHAPE, default_rows, meta_model, replan, run, trace_overlap  # noqa: E402


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


@pytest.fixture(scope="module")
def dry_run():
    """Every row once on tiny widths (one timed step after one warm-up): the rows, the JSON, each save."""
    rows = default_rows(TINY_CHANGES["num_layers"], None)
    saved = []
    result = run(BenchConfig(shape=TINY_SHAPE, changes=tuple(TINY_CHANGES.items()), device="cpu", steps=1, pinned_gib=None),
                 rows, log=lambda line: None, save=saved.append)
    return rows, result, saved


def test_every_row_runs_end_to_end_on_the_cpu(dry_run):
    rows, result, saved = dry_run
    assert set(result["rows"]) == {r.name for r in rows}
    assert {"resident", "sequential", "group_offload_block", "group_offload_leaf"} <= set(result["rows"])
    for name, row in result["rows"].items():
        assert row["step_seconds"] > 0 and row["ratio_vs_resident"] > 0, name
        assert (row["predicted"] is None) == name.startswith("group_offload"), name
    assert len(saved) == len(rows)  # the JSON is rewritten after every row
    json.dumps(result)


def test_replanning_a_results_file_gives_the_figures_the_bench_wrote(dry_run):
    """`--replan`: a results file's planner figures computed again without a GPU (as after a planner
    fix); with the planner unchanged they are the ones the run wrote."""
    _, result, _ = dry_run
    again = replan(json.loads(json.dumps(result)))
    for name, row in result["rows"].items():
        assert again["rows"][name].get("predicted") == row.get("predicted"), name


def test_rows_past_the_deadline_are_listed_not_run():
    rows = default_rows(TINY_CHANGES["num_layers"], None)[:2]
    result = run(BenchConfig(shape=TINY_SHAPE, changes=tuple(TINY_CHANGES.items()), device="cpu", steps=1, pinned_gib=None),
                 rows, log=lambda line: None, deadline=0.0)
    assert all("skipped" in row for row in result["rows"].values())


HALF = TINY_CHANGES["num_layers"] // 2


def test_a_warm_row_per_tier_uploads_resident_weights_on_the_first_call_only(dry_run):
    _, result, _ = dry_run
    names = ["warm_none", "warm_model", f"warm_block_swap_{HALF}", f"warm_block_swap_{HALF}_keep"]
    for name in names:
        row = result["rows"][name]
        cold, warm = row["calls"]["cold"], row["calls"]["warm"]
        assert cold["uploaded_bytes"] > 0 and cold["reused_bytes"] == 0, name
        assert cold["onload"]["uploaded_bytes"] == cold["uploaded_bytes"], name  # resident weights move before the first step
        assert warm["uploaded_bytes"] == 0 and warm["summary"].startswith("warm: 0 B uploaded"), name
        assert warm["reused_bytes"] >= cold["uploaded_bytes"] > 0, name  # every resident byte found on the device
        assert warm["before_first_step_seconds"] > 0 and warm["step_seconds"] > 0, name
        assert row["step_seconds"] == warm["step_seconds"] and row["ratio_vs_resident"] > 0, name
        assert row["goal"]["applies"] is False and row["goal"]["met"] is None, name  # judged on a GPU only
    for name in names[:2]:  # nothing streams under tiers none and model
        calls = result["rows"][name]["calls"]
        assert calls["cold"]["streamed_bytes"] == calls["warm"]["streamed_bytes"] == 0, name
        assert calls["warm"]["reused_bytes"] == calls["cold"]["uploaded_bytes"], name


def test_the_keep_budget_copies_each_streamed_block_once(dry_run):
    _, result, _ = dry_run
    swap = result["rows"][f"warm_block_swap_{HALF}"]["calls"]
    keep = result["rows"][f"warm_block_swap_{HALF}_keep"]["calls"]
    every_block = keep["cold"]["keep"]["limit_bytes"]  # the dry run's budget: room for every streamed block
    assert every_block > 0 and swap["cold"]["keep"]["limit_bytes"] == 0
    assert keep["cold"]["streamed_bytes"] == keep["cold"]["keep"]["kept_bytes"] == every_block
    assert keep["cold"]["keep"]["kept_groups"] == HALF
    assert keep["warm"]["streamed_bytes"] == 0  # the last call kept them all
    assert swap["cold"]["streamed_bytes"] > every_block and swap["warm"]["streamed_bytes"] > 0  # streamed every step


def test_the_gpu_check_runs_every_warm_row_of_its_model():
    """bench/gpu_check.sh names the warm rows of Wan 1.3B (blocks // 2 in a name): they must be rows."""
    script = (Path(__file__).resolve().parents[1] / "bench" / "gpu_check.sh").read_text()
    model = re.search(r"^WARM_MODEL=(\S+)$", script, re.M).group(1)
    names = re.search(r"^WARM_ROWS=(\S+)$", script, re.M).group(1).split(",")
    blocks = meta_model(model, {}).components["transformer"].config["num_layers"]
    assert names == [r.name for r in default_rows(blocks, None) if r.warm]


def test_the_decode_rows_run_on_the_cpu_with_the_same_frames_either_way():
    """`bench/gpu.py --decode`'s CPU half: a tiny VAE in several tiles, overlapped and blocking landings give
    the same frames; each variant timed every round; the planner's prediction beside them."""
    import torch

    from gpu import VideoShape
    from support.gpu_decode import decode_rows

    found = decode_rows(meta_model("wan2.1-t2v-1.3b", {}), VideoShape(128, 96, 9, cfg=False), torch.device("cpu"), runs=2)
    assert found["same_frames"] and "6 tiles" in found["tiling"]
    assert all(len(row["seconds"]) == 2 for row in found["variants"].values())
    assert found["predicted"]["activation_bytes"] > 0 and "overlapped_over_blocking" in found


def test_the_gpu_checks_default_14b_rows_are_rows():
    """bench/gpu_check.sh's default BENCH_ROWS must name rows of Wan 14B (a typo would cost a lease its 14B part)."""
    script = (Path(__file__).resolve().parents[1] / "bench" / "gpu_check.sh").read_text()
    names = re.search(r"^BENCH_ROWS=\$\{BENCH_ROWS-(\S+)\}$", script, re.M).group(1).split(",")
    blocks = meta_model("wan2.1-t2v-14b", {}).components["transformer"].config["num_layers"]
    assert set(names) <= {r.name for r in default_rows(blocks, None)}, names


def test_the_gpu_checks_stream_rows_are_rows_of_its_model():
    """bench/gpu_check.sh's STREAM_ROWS: every block streamed on the warm model, pinned homes against none."""
    script = (Path(__file__).resolve().parents[1] / "bench" / "gpu_check.sh").read_text()
    model = re.search(r"^WARM_MODEL=(\S+)$", script, re.M).group(1)
    names = re.search(r"^STREAM_ROWS=(\S+)", script, re.M).group(1).split(",")
    blocks = meta_model(model, {}).components["transformer"].config["num_layers"]
    rows = {r.name: r for r in default_rows(blocks, None)}
    assert names == [f"block_swap_{blocks}", f"block_swap_{blocks}_unpinned"]
    assert rows[names[1]].strategy.max_pinned_ram_gb == 0 and rows[names[0]].strategy.blocks_to_swap == blocks
