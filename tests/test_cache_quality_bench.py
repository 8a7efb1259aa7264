"""bench/cache_quality.py at a dry-run size (3 training steps, 4 sampling steps): the JSON's shape,
and that a cached run is the uncached run bit for bit until its first skipped pass. Never timings;
never the figures themselves, which need the full training run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import cache_quality  # noqa: E402
from bench.support import cache_signal  # noqa: E402

STEPS = 4
METHODS = {"off", "mag_cache_published", "mag_cache_published_bold", "mag_cache_calibrated",
           "mag_cache_calibrated_published_settings", "mag_cache_calibrated_bold", "first_block_cache",
           "first_block_cache_0.1", "first_block_cache_0.2", "taylor_seer", "taylor_seer_interval_3",
           "taylor_seer_interval_3_order_2"}
ROW_KEYS = {"blocks_ratio", "psnr_db", "bitwise_equal_to_uncached", "passes", "passes_skipped", "first_skipped_pass",
            "first_differing_pass", "same_until_first_skip", "mse_to_own_class", "mse_to_nearest_other_class",
            "nearest_class_is_prompted"}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    path = tmp_path_factory.mktemp("cache-quality") / "quality.json"
    cache_quality.main(["--train-steps", "3", "--steps", str(STEPS), "--threads", "1", "--json", str(path)])
    return json.loads(path.read_text())


def test_the_json_has_the_training_evidence_and_every_method(report):
    assert {"config", "caveats", "training", "calibrated_ratios", "denoises", "seed_psnr_db", "methods"} <= set(report)
    losses = {"loss_first_tenth", "loss_last_tenth", "held_out_loss_before", "held_out_loss_after"}
    assert losses <= set(report["training"])
    assert set(report["methods"]) == METHODS
    prompts = {prompt for prompt, _ in cache_signal.CLASSES}
    assert set(report["denoises"]) == set(report["seed_psnr_db"]) == prompts
    assert len(report["calibrated_ratios"]) == STEPS and report["calibrated_ratios"][0] == 1.0
    samples = {f"{prompt} | seed {seed}" for prompt in prompts for seed in cache_quality.SEEDS}
    for method, row in report["methods"].items():
        assert set(row["by_sample"]) == samples, method
        for entry in row["by_sample"].values():
            assert set(entry) == ROW_KEYS and entry["passes"] == 2 * STEPS  # guidance: cond and uncond passes
        assert 0 <= row["nearest_class_is_prompted"] <= len(samples)


def test_a_cached_run_differs_from_uncached_only_from_its_first_skipped_pass(report):
    rows = [entry for row in report["methods"].values() for entry in row["by_sample"].values()]
    for entry in rows:
        assert entry["same_until_first_skip"]
        if entry["passes_skipped"] == 0:
            assert entry["bitwise_equal_to_uncached"] and entry["first_differing_pass"] is None
            assert entry["blocks_ratio"] == 1.0
        else:
            assert entry["first_differing_pass"] >= entry["first_skipped_pass"] and entry["blocks_ratio"] < 1.0
    # The check can fail: some runs here do skip, and then differ from their first skipped pass on.
    skipping = [e for e in rows if e["passes_skipped"]]
    assert skipping and any(e["first_differing_pass"] == e["first_skipped_pass"] for e in skipping)
    assert all(e["psnr_db"] is not None for e in skipping)


def test_the_uncached_row_is_its_own_reference(report):
    off = report["methods"]["off"]
    assert off["blocks_ratio"] == 1.0 and off["psnr_db_mean"] is None and off["same_until_first_skip"]
    assert off["ratios"] is None and "published" in report["methods"]["mag_cache_published"]["ratios"]
    assert "calibrated on the trained model" in report["methods"]["mag_cache_calibrated"]["ratios"]


def test_the_classes_are_distinct_families_of_smooth_motion():
    shape = cache_signal.latent_shape(64, 64, 17)
    assert shape == (16, 5, 8, 8)
    loading = cache_signal.signatures()
    videos = cache_signal.clean_videos(torch.arange(4).repeat(8), shape, torch.Generator().manual_seed(0), loading)
    assert videos.abs().max() <= loading.abs().max() + 1e-6
    by_class = videos.view(8, 4, *shape)
    # Members of a class differ (random start, speed, phase), and consecutive frames change little.
    assert not torch.equal(by_class[0, 0], by_class[1, 0])
    step = (videos[:, :, 1:] - videos[:, :, :-1]).abs().mean()
    assert step < (videos - videos.roll(1, dims=0)).abs().mean()


def test_a_video_size_the_latent_cannot_hold_is_refused_by_name():
    with pytest.raises(ValueError, match="64x60x17"):
        cache_signal.latent_shape(64, 60, 17)
