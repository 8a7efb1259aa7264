"""What activation chunks cost in the plan's time: the measured share of compute a sliced block spends
beyond its FLOPs (memory/plan/costs.py `CHUNK_COMPUTE_SHARE`), charged on a GPU and not on the CPU, and
held to the H200 measurement it quotes."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from vidmem.memory import MemoryStrategy
from vidmem.memory.strategy import MAX_ACTIVATION_CHUNKS
from vidmem.memory.plan.candidates import plan_run
from vidmem.memory.plan.costs import CHUNK_COMPUTE_SHARE, chunk_compute_share
from vidmem.memory.plan.planner import Allocator, PlanOptions, VideoShape
from vidmem.pipelines.configs import load_model

ROOT = Path(__file__).resolve().parents[1]
MEASURED = ROOT / "bench" / "results" / "activations-gpu-h200-2026-11-28.json"
SHAPE = VideoShape(832, 480, 81)
GPU = PlanOptions(allocator=Allocator.NATIVE, steps=4)


@pytest.fixture(scope="module")
def wan():
    return load_model("wan2.1-t2v-1.3b")


def _denoise(plan):
    return next(w for w in plan.stage("denoise").work if w.passes > 1)


@pytest.mark.parametrize("chunks", [2, 4, 16])
def test_a_chunked_denoise_costs_its_measured_share_on_a_gpu(wan, chunks):
    plain = plan_run(wan, SHAPE, MemoryStrategy(offload="none"), GPU, None, None)
    sliced = plan_run(wan, SHAPE, MemoryStrategy(offload="none", activation_chunks=chunks), GPU, None, None)
    work, plain_work = _denoise(sliced), _denoise(plain)
    assert work.compute_share == CHUNK_COMPUTE_SHARE[chunks] > 0 and plain_work.compute_share == 0
    # the same FLOPs, so the denoise's time grows by the share exactly (tier none: nothing streams)
    assert work.flops == pytest.approx(plain_work.flops, rel=1e-3)
    assert work.seconds() == pytest.approx(plain_work.seconds() * (1 + work.compute_share), rel=1e-3)
    assert sliced.est_slowdown > plain.est_slowdown


def test_the_cpu_is_not_charged(wan):
    cpu = replace(GPU, device="cpu")
    sliced = plan_run(wan, SHAPE, MemoryStrategy(offload="none", activation_chunks=4), cpu, None, None)
    assert _denoise(sliced).compute_share == 0


def test_a_count_between_the_listed_ones_costs_the_next_listed_ones_share():
    assert chunk_compute_share(1) == 0 and chunk_compute_share(3) == CHUNK_COMPUTE_SHARE[4]
    assert chunk_compute_share(17) == CHUNK_COMPUTE_SHARE[32] < chunk_compute_share(64) == chunk_compute_share(99)
    assert max(CHUNK_COMPUTE_SHARE) == MAX_ACTIVATION_CHUNKS  # every count the strategy takes has a share


def test_the_shares_are_the_h200_measurement_to_the_nearest_percent():
    rows = json.loads(MEASURED.read_text())["block_cuda"]["tokens"]["32760"]["rows"]
    measured = {int(count): row["time_ratio"] - 1 for count, row in rows.items() if int(count) > 1}
    assert set(measured) == {count for count in CHUNK_COMPUTE_SHARE if 1 < count < 32}  # the rest extrapolated
    for count, share in measured.items():
        assert CHUNK_COMPUTE_SHARE[count] == round(share, 2), count
    shares = [CHUNK_COMPUTE_SHARE[count] for count in sorted(CHUNK_COMPUTE_SHARE)]
    assert shares == sorted(shares) and len(set(shares)) == len(shares)  # more slices, more cost


def test_stored_weights_are_upcast_once_per_slice(wan):
    """A stored layer upcasts its weight at every call, and a chunked block calls its per-token layers once per
    slice: the plan counts those upcasts (the cross-attention's keys and values, made once per block call, once)."""
    fp8 = replace(GPU, storage=wan.layout.stored_as("fp8_scaled"))
    upcasts = {chunks: _denoise(plan_run(wan, SHAPE, MemoryStrategy(offload="none", activation_chunks=chunks), fp8,
                                         None, None)).dequant_weights for chunks in (1, 2, 4)}
    assert upcasts[1] == wan.weights("transformer", "fp8_scaled").stored.stored_weights > 0
    assert 1.5 * upcasts[1] < upcasts[2] < 2 * upcasts[1] and 3 * upcasts[1] < upcasts[4] < 4 * upcasts[1], upcasts
    bf16 = plan_run(wan, SHAPE, MemoryStrategy(offload="none", activation_chunks=4), GPU, None, None)
    assert _denoise(bf16).dequant_weights == 0  # nothing stored below the compute dtype, nothing upcast
