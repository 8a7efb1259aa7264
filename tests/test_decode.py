"""Decode: frames equal plain diffusers'; wrong latents are refused before anything moves."""

from __future__ import annotations

import pytest
import torch

from backends import StrictBackend
from test_tiers import hooks_of, request_for, storage_map
from vidmem.memory import MemoryStrategy, VaeTiling
from vidmem.memory.device import CpuBackend
from vidmem.pipelines.decode import decode
from vidmem.pipelines.family import ModelError
from vidmem.pipelines.sample import SampleRequest, sample
from vidmem.pipelines.tiny import TINY_VARIANTS, tiny_call_kwargs

STEPS = 2


@pytest.mark.parametrize("variant", TINY_VARIANTS)
def test_sample_then_decode_equals_the_diffusers_pipeline(variant, tiny_loaded):
    loaded = tiny_loaded(variant)
    expected = loaded.pipe(**tiny_call_kwargs(variant, steps=STEPS, output_type="pt")).frames[0]  # [F, C, H, W]
    latent = sample(loaded, MemoryStrategy(offload="model"), request_for(variant), backend=CpuBackend()).latent
    frames = decode(loaded, latent, backend=CpuBackend()).frames
    assert frames.shape == expected.permute(0, 2, 3, 1).shape
    assert frames.dtype == torch.float32 and 0 <= frames.min() and frames.max() <= 1
    assert torch.equal(frames, expected.permute(0, 2, 3, 1))


@pytest.mark.parametrize("offload", ["none", "model", "sequential"])
def test_decode_tiers_place_the_vae_and_restore_it(offload, tiny_loaded):
    loaded = tiny_loaded("wan2.1-t2v")
    latent = sample(loaded, MemoryStrategy(), request_for("wan2.1-t2v"), backend=CpuBackend()).latent
    reference = decode(loaded, latent, backend=CpuBackend()).frames
    before, hooks_before = storage_map(loaded.pipe), hooks_of(loaded.pipe)
    frames = decode(loaded, latent, MemoryStrategy(offload=offload), backend=StrictBackend()).frames
    assert torch.allclose(frames, reference, atol=1e-5)  # clones are aligned differently: last-bit noise only
    assert storage_map(loaded.pipe) == before
    assert hooks_of(loaded.pipe) == hooks_before


def test_tiled_decode_keeps_the_shape_and_reports_its_tiles(tiny_loaded):
    loaded = tiny_loaded("wan2.1-t2v")
    request = SampleRequest("a cat", "", width=128, height=96, frames=17, steps=1, cfg=5.0)
    latent = sample(loaded, MemoryStrategy(), request, backend=CpuBackend()).latent
    plain = decode(loaded, latent, backend=CpuBackend())
    tiled = decode(loaded, latent, MemoryStrategy(vae_tiling=VaeTiling(64, 16, 8, 4)), backend=CpuBackend())
    assert tiled.frames.shape == plain.frames.shape
    assert tiled.receipt["decode"]["mode"] == "tiled"
    assert tiled.receipt["decode"]["tiles"] > 1 and tiled.receipt["decode"]["chunks"] > 1
    assert torch.isfinite(tiled.frames).all()


def test_tiled_wan_decode_shares_the_frame_wide_stage(tiny_loaded):
    loaded = tiny_loaded("wan2.1-t2v")
    latent = sample(loaded, MemoryStrategy(), request_for("wan2.1-t2v"), backend=CpuBackend()).latent
    tiled = decode(loaded, latent, MemoryStrategy(vae_tiling=VaeTiling(64, 16)), backend=CpuBackend())
    assert tiled.receipt["decode"]["shared_context"]
    cog = tiny_loaded("cogvideox-t2v")
    latent = sample(cog, MemoryStrategy(), request_for("cogvideox-t2v"), backend=CpuBackend()).latent
    assert not decode(cog, latent, backend=CpuBackend()).receipt["decode"]["shared_context"]


def test_rungs_the_planner_predicts_to_overrun_are_skipped_before_anything_runs(tiny_loaded):
    """A 64 KiB device cannot hold the untiled decode's activations: the ladder starts lower,
    says why in the receipt, and the frames are those of the rung that ran."""
    loaded = tiny_loaded("wan2.1-t2v")
    request = SampleRequest("a cat", "", width=128, height=96, frames=17, steps=1, cfg=5.0)
    latent = sample(loaded, MemoryStrategy(), request, backend=CpuBackend()).latent
    roomy = decode(loaded, latent, backend=CpuBackend(), free_bytes=2**40)
    tight = decode(loaded, latent, backend=CpuBackend(), free_bytes=64 * 1024)
    assert roomy.receipt["decode"]["fallbacks"] == [] and roomy.receipt["decode"]["mode"] == "whole"
    skipped = tight.receipt["decode"]["fallbacks"]
    assert skipped and all("skipped: predicted to run out of memory" in line for line in skipped)
    assert "GiB free" in skipped[0] and tight.receipt["decode"]["mode"] == "tiled"
    assert tight.frames.shape == roomy.frames.shape


@pytest.mark.parametrize("broken_part", ["decode_activation_bytes", "planner_model"])
def test_a_failed_prediction_never_stops_the_decode(broken_part, tiny_loaded, monkeypatch):
    import vidmem.pipelines.planning as planning

    def broken(*args, **kwargs):
        raise RuntimeError("planner cannot model this")

    monkeypatch.setattr(planning, broken_part, broken)
    loaded = tiny_loaded("wan2.1-t2v")
    latent = sample(loaded, MemoryStrategy(), request_for("wan2.1-t2v"), backend=CpuBackend()).latent
    result = decode(loaded, latent, backend=CpuBackend(), free_bytes=1)
    assert result.receipt["decode"]["fallbacks"] == [] and result.receipt["decode"]["mode"] == "whole"


def test_latent_from_another_family_is_refused(tiny_loaded):
    wan = tiny_loaded("wan2.1-t2v")
    latent = sample(wan, MemoryStrategy(), request_for("wan2.1-t2v"), backend=CpuBackend()).latent
    with pytest.raises(ModelError, match="wan model but the pipeline is cogvideox"):
        decode(tiny_loaded("cogvideox-t2v"), latent)


def test_latent_from_a_vae_with_another_scaling_factor_is_refused(tiny_loaded):
    """CogVideoX-2b (1.15258426) and 5B / 1.5 (0.7) share family and channels but not the latent scale."""
    loaded = tiny_loaded("cogvideox-t2v")
    latent = sample(loaded, MemoryStrategy(), request_for("cogvideox-t2v"), backend=CpuBackend()).latent
    assert latent["vidmem"]["vae_scaling_factor"] == loaded.pipe.vae.config.scaling_factor == 1.15258426
    from_5b = dict(latent, vidmem=dict(latent["vidmem"], vae_scaling_factor=0.7))
    with pytest.raises(ModelError, match=r"scaling_factor 0.7 but .* VAE has 1.15258426"):
        decode(loaded, from_5b, backend=CpuBackend())
    older = dict(latent, vidmem={k: v for k, v in latent["vidmem"].items() if k != "vae_scaling_factor"})
    assert torch.equal(decode(loaded, older, backend=CpuBackend()).frames, decode(loaded, latent, backend=CpuBackend()).frames)


def test_latent_with_wrong_channels_is_refused(tiny_loaded):
    loaded = tiny_loaded("wan2.1-t2v")
    with pytest.raises(ModelError, match="latent has 4 channels .* decodes 16"):
        decode(loaded, {"samples": torch.zeros(1, 4, 3, 4, 4)})


@pytest.mark.parametrize("latent, message", [
    ({"samples": torch.zeros(1, 16, 4, 4)}, r"latent\['samples'\] has shape \(1, 16, 4, 4\); a video latent is"),
    ({"noise": 1}, r"latent has no 'samples' \(keys: \['noise'\]\)"),
    ({"samples": [1, 2]}, "'samples' of type list, not a tensor"),
    ("not a latent", r"latent must be a LATENT \(a dict with 'samples'\), got str"),
    (None, "latent must be a LATENT .* got NoneType"),
    ({"samples": torch.zeros(1, 16, 0, 4, 4)}, "are empty, so they are not a video latent"),
    ({"samples": torch.zeros(1, 16, 2, 4, 4, dtype=torch.int64)}, "dtype torch.int64"),
])
def test_non_video_latent_is_refused(latent, message, tiny_loaded):
    with pytest.raises(ModelError, match=message):
        decode(tiny_loaded("wan2.1-t2v"), latent)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_latent_is_refused_before_anything_moves(bad, tiny_loaded):
    loaded = tiny_loaded("wan2.1-t2v")
    samples = torch.zeros(1, 16, 2, 4, 4)
    samples[0, 3, 1, 2, 2] = bad
    before, hooks_before = storage_map(loaded.pipe), hooks_of(loaded.pipe)
    with pytest.raises(ModelError, match="latent contains 1 NaN or infinite values"):
        decode(loaded, {"samples": samples}, MemoryStrategy(offload="model"), backend=StrictBackend())
    assert storage_map(loaded.pipe) == before and hooks_of(loaded.pipe) == hooks_before


def test_decode_node_saves_latents_first_in_core_format(tiny_loaded, tmp_path, monkeypatch):
    from vidmem.nodes import host
    from vidmem.nodes.decode import VidMemVAEDecode
    from vidmem.pipelines.latents import read_latent

    monkeypatch.setattr(host, "latents_folder", lambda: tmp_path / "latents")
    loaded = tiny_loaded("wan2.1-t2v")
    latent = sample(loaded, MemoryStrategy(), request_for("wan2.1-t2v"), backend=CpuBackend()).latent
    first = VidMemVAEDecode().decode(loaded, latent, None, save_latents=True)
    second = VidMemVAEDecode().decode(loaded, latent, None, save_latents=True)
    paths = sorted((tmp_path / "latents").iterdir())
    assert [p.name for p in paths] == ["vidmem_00001_.latent", "vidmem_00002_.latent"]
    assert torch.equal(read_latent(paths[0])["samples"], latent["samples"])
    assert "latents saved to" in first["ui"]["text"][0]
    reloaded = VidMemVAEDecode().decode(loaded, read_latent(paths[1]), None)  # as core Load Latent gives it
    assert torch.equal(reloaded["result"][0], second["result"][0])
