"""bench/support/speed_attention.py on a shrunken Wan (4 steps, 2 blocks), untimed and once with one
timed round: the rows' shape, the kernels refused on the CPU listed with their reason, and the
latent differences (never the timings: those are the bench's, not CI's)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.support.speed_attention import EAGER, attention_rows, call_rows  # noqa: E402
from bench.support.speed_runs import SpeedConfig, build, tiers  # noqa: E402

CONFIG = SpeedConfig(steps=4, blocks=2, runs=0, time_tiers=())


@pytest.fixture(scope="module")
def rows():
    return attention_rows(lambda: build(CONFIG), CONFIG, tiers(CONFIG.blocks))  # a builder or a pipeline


def test_every_kernel_has_a_row_and_the_cpus_refusals_say_why(rows):
    assert set(rows) >= {"auto", "sdpa", "flash", "efficient", "cudnn", "math", "flex", "sage"}
    for kernel in ("efficient", "cudnn", "sage"):
        assert "needs a CUDA GPU" in rows[kernel]["skipped"], kernel
    assert rows["auto"]["resolves_to"] == "sdpa"


def test_sdpas_own_kernels_match_eager_sdpa_on_every_tier_and_the_others_stay_close(rows):
    for kernel in ("sdpa", "flash"):
        assert rows[kernel]["max_abs_diff"] == 0.0, kernel
        assert set(rows[kernel]["by_tier"]) == set(tiers(CONFIG.blocks)), kernel
        assert all(row["bitwise_equal"] for row in rows[kernel]["by_tier"].values()), kernel
    for kernel in ("math", "flex"):
        assert 0.0 <= rows[kernel]["max_abs_diff"] < 1e-3, kernel
        assert "time_ratio" not in rows[kernel]  # untimed


def test_a_timed_round_gives_each_kernel_a_time_ratio_against_eager_sdpa():
    config = SpeedConfig(steps=2, blocks=2, runs=1, time_tiers=("none",))
    found = attention_rows(build(config), config, {"none": tiers(config.blocks)["none"]})
    assert found[EAGER]["seconds_by_tier"]["none"]
    for kernel in ("sdpa", "flash", "math", "flex"):
        assert found[kernel]["time_ratio"] > 0 and found[kernel]["by_tier"]["none"]["seconds"], kernel


def test_one_call_per_kernel_at_the_video_size():
    """The attention_call part: Wan's token count from the size, every kernel timed or refused with its reason,
    each exact kernel's output equal to sdpa's within float32 rounding."""
    config = SpeedConfig(width=64, height=48, frames=9, heads=2, head_dim=8)
    found = call_rows(config, runs=2, compile_flex=False)
    assert found["shape"]["tokens"] == 3 * 3 * 4  # latent frames (9-1)/4+1, then 48/16 x 64/16 patches
    kernels = found["kernels"]
    assert kernels["auto"]["resolves_to"] == "sdpa" and "flex_compiled" not in kernels
    assert "needs a CUDA GPU" in kernels["cudnn"]["skipped"]
    for name in ("sdpa", "flash", "math", "flex"):
        assert len(kernels[name]["ms_all"]) == 2 and kernels[name]["max_abs_diff"] < 1e-5, (name, kernels[name])
    assert kernels["sdpa"]["ratio"] == 1.0
