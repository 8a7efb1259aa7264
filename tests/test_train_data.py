"""Data preparation: buckets, latents in the sampler's LATENT form, a cache reused by content."""

from __future__ import annotations

import json

import pytest
import torch

from test_train_support import make_dataset, prepare_tiny
from vidmem.memory import MemoryStrategy, VaeTiling
from vidmem.memory.device import CpuBackend
from vidmem.training import BucketSettings, parse_frames, parse_resolutions, prepare_training_data
from vidmem.training.data import Clip, choose_bucket, fit_to_bucket
from vidmem.training.prepare import from_vae_latent


def test_buckets_pick_the_nearest_aspect_and_the_most_frames_a_clip_has():
    buckets = BucketSettings(parse_resolutions("832x480, 480x832, 512x512"), parse_frames("81, 33, 17"))
    wide, tall = Clip("a.mp4", "x", False), Clip("b.mp4", "x", False)
    assert choose_bucket(wide, 50, 1920, 1080, buckets).label() == "832x480x33"
    assert choose_bucket(tall, 81, 720, 1280, buckets).label() == "480x832x81"
    assert choose_bucket(Clip("c.png", "x", True), 1, 600, 600, buckets).label() == "512x512x1"


def test_fit_covers_then_crops_the_centre():
    frames = torch.zeros(3, 40, 80, 3, dtype=torch.uint8)
    frames[:, :, 30:50] = 255  # a white band in the middle of the width
    video = fit_to_bucket(frames, choose_bucket(Clip("a", "x", False), 3, 80, 40, BucketSettings(((32, 32),), (3,))))
    assert video.shape == (3, 3, 32, 32)
    assert video.min() >= -1 and video.max() <= 1
    assert video[:, :, :, 16].mean() > 0.9 and video[:, :, :, 0].mean() < -0.9


@pytest.mark.parametrize("variant", ["wan2.1-t2v", "cogvideox-t2v"])
def test_latents_are_in_the_samplers_latent_form(tiny_loaded, variant):
    loaded = tiny_loaded(variant)
    z = torch.randn(1, loaded.pipe.vae.config.latent_channels if variant.startswith("cog") else 16, 3, 4, 4)
    assert torch.allclose(loaded.spec.to_vae_latent(loaded.pipe, from_vae_latent(loaded, z)), z, atol=1e-6)


def test_second_run_reuses_the_cache_and_an_edited_caption_is_encoded_again(tiny_loaded, tmp_path):
    loaded = tiny_loaded("wan2.1-t2v")
    folder = make_dataset(tmp_path / "data", clips=2, image=True)
    first = prepare_tiny(loaded, folder, tmp_path / "cache", frames=(9,))
    assert first.receipt["encoded"] == 3 and first.receipt["buckets"] == {"32x32x1": 1, "32x32x9": 2}
    files = {p: p.stat().st_mtime_ns for p in (tmp_path / "cache").rglob("*.safetensors")}
    again = prepare_tiny(loaded, folder, tmp_path / "cache", frames=(9,))
    assert again.receipt["reused"] == 3 and again.receipt["encoded"] == 0 and again.samples == first.samples
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "cache").rglob("*.safetensors")} == files
    (folder / "clip1.txt").write_text("a dog")
    edited = prepare_tiny(loaded, folder, tmp_path / "cache", frames=(9,))
    assert edited.receipt["encoded"] == 1
    latent, embeds = edited.load(edited.samples[0])
    assert latent.shape == (16, 3, 4, 4) and embeds.shape == (512, 32)
    manifest = json.loads(next((tmp_path / "cache" / "wan").glob("*.manifest.json")).read_text())
    assert sorted(e["source"] for e in manifest["entries"]) == ["clip0.mp4", "clip1.mp4", "still.png"]
    assert "a dog" in [e["caption"] for e in manifest["entries"]]


def test_cached_latent_is_the_vae_encoding(tiny_loaded, tmp_path):
    loaded = tiny_loaded("cogvideox-t2v")
    folder = make_dataset(tmp_path / "data", clips=1)
    data = prepare_tiny(loaded, folder, tmp_path / "cache")
    from vidmem.training.data import read_frames

    pixels = fit_to_bucket(read_frames(Clip(folder / "clip0.mp4", "", False), 9), data.samples[0].bucket)[None]
    with torch.no_grad():
        expected = loaded.pipe.vae.encode(pixels).latent_dist.mode() * loaded.pipe.vae.config.scaling_factor
    assert torch.equal(data.load(data.samples[0])[0], expected[0])


def test_tiled_encoding_restores_the_vae_and_the_encoders_are_left_as_found(tiny_loaded, tmp_path):
    loaded = tiny_loaded("wan2.1-t2v")
    vae = loaded.pipe.vae
    before = {k: v for k, v in vars(vae).items() if k == "use_tiling" or k.startswith("tile_")}
    pointers = {n: p.data_ptr() for n, p in loaded.pipe.text_encoder.named_parameters()}
    strategy = MemoryStrategy(offload="sequential", vae_tiling=VaeTiling(tile_size=64, overlap=16))
    folder = make_dataset(tmp_path / "data", clips=1)
    data = prepare_training_data(loaded, folder, BucketSettings(((32, 32),), (9,)), strategy, tmp_path / "cache", CpuBackend())
    assert data.receipt["encoded"] == 1 and data.receipt["encoders_unloaded"]
    assert {k: v for k, v in vars(vae).items() if k == "use_tiling" or k.startswith("tile_")} == before
    assert {n: p.data_ptr() for n, p in loaded.pipe.text_encoder.named_parameters()} == pointers
    assert not any(m._forward_pre_hooks for m in vae.modules())


def test_the_planner_plans_the_bucket_with_the_largest_latent_not_the_most_pixels(tiny_loaded, tmp_path):
    """832x480x5 has more pixels than a 1024x1024 still (2.0M vs 1.05M), but the VAE keeps 2 of its
    5 frames: 2 x 60 x 104 = 12,480 latent pixels against the still's 128 x 128 = 16,384."""
    from types import SimpleNamespace

    from vidmem.training.data import Bucket
    from vidmem.training.plan import planned_shape
    from vidmem.training.settings import TrainSettings

    clips, stills = [Bucket(832, 480, 5)] * 3, [Bucket(1024, 1024, 1)]
    data = SimpleNamespace(samples=[SimpleNamespace(bucket=b) for b in clips + stills], vae_scale=(8, 4))
    shape = planned_shape(data, TrainSettings(batch_size=2))
    assert (shape.width, shape.height, shape.frames, shape.batch) == (1024, 1024, 1, 2)
    longer = SimpleNamespace(samples=data.samples + [SimpleNamespace(bucket=Bucket(832, 480, 9))], vae_scale=(8, 4))
    assert planned_shape(longer, TrainSettings()).frames == 9  # 3 x 60 x 104 = 18,720
    loaded = tiny_loaded("wan2.1-t2v")
    prepared = prepare_tiny(loaded, make_dataset(tmp_path / "data", clips=1), tmp_path / "cache")
    assert prepared.vae_scale == (loaded.pipe.vae_scale_factor_spatial, loaded.pipe.vae_scale_factor_temporal)
