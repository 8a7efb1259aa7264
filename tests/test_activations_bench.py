"""bench/activations.py's block part in one process (`--device`): the CPU dry run end to end on a narrow
block, and its CUDA path on the recording CUDA fake, so the script a GPU lease runs (bench/gpu_check.sh)
is checked in CI. What is checked: the JSON's rows, the planner's prediction per chunk count, the
outputs against unchunked, that the allocator's peak is reset before every measured call and read
above where the call started, that times come from CUDA events, and the goals' verdicts from the
figures (never the figures themselves: those are the lease's)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import activations  # noqa: E402  (puts the repository root on the path, for bench.support)
from bench.support import activation_block  # noqa: E402
from bench.support.activation_block import TINY, CudaMeter, measure  # noqa: E402
from cuda_fake import FakeCuda  # noqa: E402

TOKENS = (64, 96)
RUNS = 2


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("activations") / "dry.json"
    activations.main(["--device", "cpu", "--tiny", "--tokens", ",".join(map(str, TOKENS)), "--runs", str(RUNS),
                      "--json", str(path)])
    return json.loads(path.read_text())


def test_the_dry_run_writes_every_chunk_count_at_every_token_count(dry_run):
    found = dry_run["block_cpu"]
    assert found["chunks"] == list(activations.BLOCK_CHUNKS) and found["config"]["dim"] == TINY.dim
    assert set(found["tokens"]) == {str(t) for t in TOKENS}
    for tokens, part in found["tokens"].items():
        rows = part["rows"]
        assert set(rows) == {str(c) for c in activations.BLOCK_CHUNKS}, tokens
        for chunks, row in rows.items():
            assert len(row["times"]) == RUNS and row["seconds"] > 0 and row["time_ratio"] > 0, (tokens, chunks)
            assert row["measured_peak_bytes"] is None and row["peak_error"] is None  # no allocator statistics on the CPU
            assert row["bitwise_equal"] and row["close"] and row["max_abs_diff"] == 0, (tokens, chunks)  # bit identity on the CPU
        # the plan is the engine's chunking traced: more slices, a lower predicted peak
        assert rows["8"]["predicted_peak_bytes"] < rows["2"]["predicted_peak_bytes"] < rows["1"]["predicted_peak_bytes"]
    assert found["goals"]["peak_within_10pct_of_plan"] is None  # judged on CUDA only
    assert found["goals"]["chunking_costs_at_most_5pct_at_480p"] is None


def test_the_cuda_path_resets_the_peak_before_each_measured_call_and_times_with_events(monkeypatch):
    """The CUDA meter on the recording fake (the block computes on the CPU): the measured peak is
    max_memory_allocated minus memory_allocated at the call's start, read after a reset; times are
    CUDA-event intervals (the fake's are 1 ms each); the goals follow from the figures."""
    fake = FakeCuda().install(monkeypatch)
    above = 120_000  # what the fake allocator says each measured call peaked at, above its start
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: fake.device_bytes["allocated"] + above)
    monkeypatch.setattr(activation_block, "COST_GOAL_TOKENS", TOKENS[0])  # the 480p goal, judged at a tiny count
    saved = []
    found = measure(TINY, TOKENS, (4, 2), torch.device("cpu"), "float32", CudaMeter(), runs=RUNS, log=lambda line: None,
                    save=lambda so_far: saved.append(json.loads(json.dumps(so_far))))
    assert found["chunks"] == [1, 2, 4] and found["meter"] == "cuda"  # unchunked first: the reference
    assert [list(s["tokens"]) for s in saved] == [[str(TOKENS[0])], [str(t) for t in TOKENS]]  # saved per token count
    counts = len(found["chunks"]) * len(TOKENS)
    resets = [i for i, call in enumerate(fake.log) if call == ("reset_peak_memory_stats",)]
    assert len(resets) == counts
    assert all(fake.log[i + 1] == ("memory_allocated",) and fake.log[i - 1] == ("device_sync",) for i in resets)
    assert len(fake.calls("elapsed_time")) == counts * RUNS
    verdicts = []
    for tokens, part in found["tokens"].items():
        for row in part["rows"].values():
            assert row["measured_peak_bytes"] == above and row["seconds"] == pytest.approx(0.001)
            error = above / row["predicted_peak_bytes"] - 1
            assert row["peak_error"] == pytest.approx(error, abs=1e-4)
            assert row["peak_within_10pct"] == (abs(error) <= 0.10)
            verdicts.append(row["peak_within_10pct"])
            applies = tokens == str(TOKENS[0]) and row["chunks"] > 1
            assert row["cost_within_5pct"] == (True if applies else None), (tokens, row["chunks"])
    assert found["goals"]["peak_within_10pct_of_plan"] == all(verdicts)
    assert found["goals"]["chunking_costs_at_most_5pct_at_480p"] is True


def test_bad_options_are_refused_by_name():
    with pytest.raises(SystemExit):
        activations.parse(["--device", "cpu", "--chunks", "2,0"])
    with pytest.raises(SystemExit):
        activations.parse(["--tiny"])  # the dry run's narrow block needs --device
    with pytest.raises(SystemExit):
        activations.parse(["--compile"])  # the CPU RSS part runs eagerly
    args = activations.parse(["--device", "cpu"])
    assert args.tokens == (32760, 75600) and args.dtype == "float32" and args.json.name == "activations-cpu.json"


def test_out_of_memory_at_one_token_count_is_recorded_and_the_next_count_runs():
    class FirstCallRunsOutOfMemory(activation_block.CpuMeter):
        calls = 0

        def peak(self, call):
            self.calls += 1
            if self.calls == 1:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.41 GiB\nmore")
            return super().peak(call)

    found = measure(TINY, TOKENS, (2,), torch.device("cpu"), "float32", FirstCallRunsOutOfMemory(), runs=1,
                    log=lambda line: None)
    assert found["tokens"][str(TOKENS[0])]["error"] == "OutOfMemoryError: CUDA out of memory. Tried to allocate 1.41 GiB"
    assert set(found["tokens"][str(TOKENS[1])]["rows"]) == {"1", "2"}


def test_compiled_counts_compile_the_block_unchunked_and_its_slice_steps_chunked():
    """`--compile` (aot_eager here for speed; the bench uses inductor): the unchunked count compiles the block's
    forward, a chunked count the slices' steps, each once; outputs stay close to the unchunked reference."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from vidmem.pipelines.compile import CompileSettings

    torch._dynamo.reset()
    counters.clear()
    found = measure(TINY, (64,), (1, 2), torch.device("cpu"), "float32", activation_block.CpuMeter(), runs=1,
                    log=lambda line: None, compiled=CompileSettings(on=True, backend="aot_eager", dynamic=False))
    rows = found["tokens"]["64"]["rows"]
    assert found["compile"] == "default, dynamic false, backend aot_eager" and rows["2"]["close"], found
    assert counters["frames"]["total"] == 3  # WanTransformerBlock.forward, then the two slice steps
    torch._dynamo.reset()


def test_a_compiled_peak_below_the_plan_passes_and_one_far_above_fails():
    """The plan traces the eager forward; compiled code fuses its float32 temporaries, so a compiled peak well under
    the plan is not a planner error. Eager, the goal stays two-sided."""
    def judged(measured, compiled):
        row = {"chunks": 2, "measured_peak_bytes": measured, "predicted_peak_bytes": 100, "times": [1.0]}
        activation_block._finish(row, 1.0, judged=True, cost_applies=False, compiled=compiled)
        return row["peak_within_10pct"]

    assert judged(60, compiled=True) and not judged(60, compiled=False)
    assert judged(105, compiled=True) and not judged(120, compiled=True)
