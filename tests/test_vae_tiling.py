"""Tiled/sliced VAE decode, its schedules, auto tiling and the fallback ladder (CPU, tiny models)."""

from __future__ import annotations

import re

import pytest
import torch

from vidmem.memory.strategy import VaeTiling
from vidmem.memory.vae_tiles import peak_call_pixels
from vidmem.memory.vae import (
    DecodeReport,
    VaeGeometry,
    auto_tiling,
    decode_video,
    decode_with_fallback,
    fallback_rungs,
    plan_tiles,
)

COG = VaeGeometry(spatial_factor=8, temporal_factor=4, latent_channels=16)
WAN22 = VaeGeometry(spatial_factor=16, temporal_factor=4, latent_channels=48)

SCHEDULES = [
    ((1, 16, 13, 60, 90), COG, VaeTiling()),
    ((1, 16, 21, 20, 36), COG, VaeTiling(tile_size=128, overlap=32, temporal_size=16, temporal_overlap=4)),
    ((2, 16, 9, 17, 23), COG, VaeTiling(tile_size=64, overlap=16, temporal_size=8, temporal_overlap=4)),
    ((1, 48, 11, 14, 20), WAN22, VaeTiling(tile_size=128, overlap=24, temporal_size=20, temporal_overlap=8)),
    ((1, 16, 2, 7, 9), COG, VaeTiling(tile_size=64, overlap=0, temporal_size=8, temporal_overlap=0)),
    ((1, 16, 1, 8, 8), COG, VaeTiling(tile_size=64, overlap=16)),
]


def nearest_decode(geometry: VaeGeometry):
    """A per-pixel 'VAE': nearest upsampling with the causal rule (frame 0 -> 1, later -> tf frames)."""

    def decode(z: torch.Tensor) -> torch.Tensor:
        s, tf = geometry.spatial_factor, geometry.temporal_factor
        x = z[:, :3] * 0.5 + z[:, 3:6] * 0.25
        x = x.repeat_interleave(s, -1).repeat_interleave(s, -2)
        return torch.cat([x[:, :, :1], x[:, :, 1:].repeat_interleave(tf, 2)], dim=2)

    return decode


@pytest.mark.parametrize("shape, geometry, tiling", SCHEDULES)
def test_schedule_weights_sum_to_one_everywhere(shape, geometry, tiling):
    plan = plan_tiles(shape, geometry, tiling)
    frames, height, width = plan.out_shape
    assert (frames, height, width) == (geometry.frames(shape[2]), shape[3] * geometry.spatial_factor,
                                       shape[4] * geometry.spatial_factor)
    total = torch.zeros(plan.out_shape, dtype=torch.float64)
    for f in plan.frames:
        for r in plan.rows:
            for c in plan.cols:
                w = f.weight.double()[:, None, None] * r.weight.double()[:, None] * c.weight.double()
                total[f.out_start : f.out_stop, r.out_start : r.out_stop, c.out_start : c.out_stop] += w
    assert torch.allclose(total, torch.ones_like(total), atol=1e-6)


@pytest.mark.parametrize("shape, geometry, tiling", SCHEDULES)
def test_schedule_respects_tile_limits_and_causal_rule(shape, geometry, tiling):
    plan = plan_tiles(shape, geometry, tiling)
    s, tf = geometry.spatial_factor, geometry.temporal_factor
    for axis, length in ((plan.rows, shape[3]), (plan.cols, shape[4])):
        assert axis[0].start == 0 and axis[-1].stop == length
        for span in axis:
            assert (span.stop - span.start) * s <= max(tiling.tile_size, s)
            assert span.out_stop - span.out_start == (span.stop - span.start) * s
        for prev, nxt in zip(axis, axis[1:]):  # neighbours share at least the requested overlap
            assert prev.stop - nxt.start >= min(-(-tiling.overlap // s), nxt.stop - nxt.start - 1)
    first, *rest = plan.frames
    assert first.start == 0 and first.context == 0 and plan.frames[-1].stop == shape[2]
    for chunk in rest:  # one latent frame of context; an odd-length call keeps CogVideoX causal
        assert chunk.context == 1 and (chunk.stop - chunk.start + 1) % 2 == 1
        assert chunk.out_start == tf * (chunk.start - 1) + 1 and chunk.out_stop == tf * (chunk.stop - 1) + 1
    if rest:
        assert (first.stop - first.start) % 2 == 1


def test_tiles_larger_than_the_input_are_not_split():
    plan = plan_tiles((1, 16, 13, 30, 45), COG, VaeTiling(tile_size=512, overlap=64, temporal_size=64))
    assert plan.tiles == 1 and plan.chunks == 1


@pytest.mark.parametrize("shape, geometry, tiling", SCHEDULES)
@pytest.mark.parametrize("slicing", [False, True])
def test_per_pixel_decoder_tiled_equals_untiled(shape, geometry, tiling, slicing):
    torch.manual_seed(0)
    latents = torch.randn(shape)
    decode = nearest_decode(geometry)
    report = DecodeReport()
    tiled = decode_video(decode, latents, geometry, tiling, slicing, report=report)
    whole = decode_video(decode, latents, geometry, None)
    assert tiled.shape == whole.shape == (shape[0], 3, *plan_tiles(shape, geometry, None).out_shape)
    assert tiled.dtype == torch.float32
    assert torch.allclose(tiled, whole, atol=1e-6, rtol=0)
    assert report.decode_calls == report.tiles * report.chunks * (shape[0] if slicing else 1)


def test_whole_decode_keeps_dtype_out_device_and_reports():
    latents = torch.randn(2, 16, 3, 4, 5, dtype=torch.bfloat16)
    report = DecodeReport()
    out = decode_video(nearest_decode(COG), latents, COG, None, slicing=True, report=report, out_device="cpu")
    assert out.dtype == torch.float32 and out.shape == (2, 3, 9, 32, 40)
    assert (report.mode, report.sliced, report.decode_calls, report.tiles, report.chunks) == ("whole", True, 2, 1, 1)
    assert "whole decode on cpu" in report.describe()
    # a batch of one is not sliced, whatever slicing asked (the receipt said 'vae_slicing' after a ladder rung)
    decode_video(nearest_decode(COG), latents[:1], COG, None, slicing=True, report=report, out_device="cpu")
    assert not report.sliced and ", sliced" not in report.describe()


def test_tiled_decode_blends_half_precision_pixels():
    latents = torch.randn(1, 16, 5, 12, 12, dtype=torch.bfloat16)
    tiling = VaeTiling(tile_size=64, overlap=16, temporal_size=8, temporal_overlap=4)
    tiled = decode_video(nearest_decode(COG), latents, COG, tiling)
    assert tiled.dtype == torch.float32
    assert torch.allclose(tiled, decode_video(nearest_decode(COG), latents, COG, None), atol=1e-6)


def test_extra_leading_frames_from_the_vae_are_dropped():
    def even_rule_decode(z):  # CogVideoX on an even frame count: tf frames for every latent frame
        x = nearest_decode(COG)(z)
        return torch.cat([x[:, :, :1].expand(-1, -1, 3, -1, -1), x], dim=2) if z.shape[2] % 2 == 0 else x

    latents = torch.randn(1, 16, 4, 8, 8)
    out = decode_video(even_rule_decode, latents, COG, None)
    assert out.shape == (1, 3, 13, 64, 64)
    assert torch.equal(out, decode_video(nearest_decode(COG), latents, COG, None))


def test_progress_callback_counts_every_piece():
    steps = []
    tiling = VaeTiling(tile_size=64, overlap=16, temporal_size=8, temporal_overlap=4)
    latents = torch.randn(1, 16, 5, 12, 12)
    decode_video(nearest_decode(COG), latents, COG, tiling, on_step=lambda done, total: steps.append((done, total)))
    assert steps == [(i, len(steps)) for i in range(1, len(steps) + 1)] and len(steps) > 1


@pytest.mark.parametrize("slicing", [False, True])
def test_overlapped_copies_blend_one_piece_behind_with_the_same_frames(monkeypatch, slicing):
    """overlap_copies (on by default for CUDA decodes into host memory) blends piece i after piece i+1's
    decode was queued; the decoder here reuses one output buffer, as a caching allocator may, so the held
    piece must be a copy taken when it was handed over."""
    from vidmem.memory import vae as vae_module

    tiling = VaeTiling(tile_size=64, overlap=16, temporal_size=8, temporal_overlap=4)
    latents = torch.randn(2, 16, 5, 12, 12)
    events, plain = [], nearest_decode(COG)
    reused: dict[tuple, torch.Tensor] = {}

    def decode(z):
        pixels = plain(z)
        buffer = reused.setdefault(tuple(pixels.shape), torch.empty_like(pixels))
        events.append("decode")
        return buffer.copy_(pixels)

    blend = vae_module._blend
    monkeypatch.setattr(vae_module, "_blend", lambda *a: (events.append("blend"), blend(*a))[1])
    overlapped = decode_video(decode, latents, COG, tiling, slicing, overlap_copies=True)
    pieces = events.count("decode")
    assert pieces > 2 and events[:3] == ["decode", "decode", "blend"] and events[-3:] == ["decode", "blend", "blend"]
    assert events.count("blend") == pieces
    events.clear()
    assert torch.equal(overlapped, decode_video(decode, latents, COG, tiling, slicing, overlap_copies=False))
    assert events[:2] == ["decode", "blend"]
    assert torch.equal(overlapped, decode_video(plain, latents, COG, tiling, slicing))  # default: off on the CPU


def test_a_decoded_piece_does_not_outlive_its_landing():
    """The device output of piece i is gone before piece i+1 decodes (it was kept alive one piece too long,
    adding a piece to the decode's device peak), with the landing overlapped or not."""
    import weakref

    tiling = VaeTiling(tile_size=64, overlap=16, temporal_size=8, temporal_overlap=4)
    latents, plain = torch.randn(1, 16, 5, 12, 12), nearest_decode(COG)
    for overlap in (True, False):
        earlier: list[weakref.ref] = []

        def decode(z):
            assert all(ref() is None for ref in earlier), "an earlier piece's output is still alive"
            pixels = plain(z)
            earlier.append(weakref.ref(pixels))
            return pixels

        decode_video(decode, latents, COG, tiling, overlap_copies=overlap)
        assert len(earlier) > 2


def test_pinned_landing_pins_one_pair_within_its_budget_and_falls_back_otherwise(caplog):
    """One pin call per decode for two of the largest pieces; a budget too small for them, or a pin that fails,
    lands the blocking way with the same frames."""
    from vidmem.memory.vae import PinnedLanding

    tiling = VaeTiling(tile_size=64, overlap=16, temporal_size=8, temporal_overlap=4)
    latents = torch.randn(1, 16, 5, 12, 12)
    expected = decode_video(nearest_decode(COG), latents, COG, tiling)
    asked = []

    def pin(nbytes):
        asked.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    landed = decode_video(nearest_decode(COG), latents, COG, tiling, pinned=PinnedLanding(pin), overlap_copies=True)
    largest = max(f.out_stop - f.out_start for f in plan_tiles(latents.shape, COG, tiling).frames) * 3 * 64 * 64 * 4
    assert torch.equal(landed, expected) and len(asked) == 1 and asked[0] <= 2 * largest
    asked.clear()
    small = decode_video(nearest_decode(COG), latents, COG, tiling, pinned=PinnedLanding(pin, budget_bytes=1024),
                         overlap_copies=True)
    assert torch.equal(small, expected) and asked == []

    def refused(nbytes):
        raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)")

    with caplog.at_level("WARNING", logger="vidmem.memory.vae"):
        failed = decode_video(nearest_decode(COG), latents, COG, tiling, pinned=PinnedLanding(refused),
                              overlap_copies=True)
    assert torch.equal(failed, expected) and "could not pin" in caplog.text


# --- bad inputs -------------------------------------------------------------------------------


def test_latent_not_5d_names_the_input():
    with pytest.raises(ValueError, match="latents must be 5-D"):
        decode_video(nearest_decode(COG), torch.randn(1, 16, 8, 8), COG, None)


def test_latent_of_another_family_names_the_channels():
    with pytest.raises(ValueError, match="48 channels but this VAE takes 16"):
        decode_video(nearest_decode(COG), torch.randn(1, 48, 3, 8, 8), COG, VaeTiling())


def test_bad_geometry_is_refused():
    with pytest.raises(ValueError, match="spatial_factor"):
        VaeGeometry(spatial_factor=0, temporal_factor=4)


def test_decode_returning_a_wrong_size_is_refused():
    def short_decode(z):  # like diffusers' CogVideoX tiling at tile 96: a few pixels off
        return nearest_decode(COG)(z)[..., :-5]

    with pytest.raises(ValueError, match="disable_tiling"):
        decode_video(short_decode, torch.randn(1, 16, 3, 16, 16), COG, None)


# --- real tiny diffusers VAEs (diffusers' own test configs) ---------------------------------------


def tiny_cogvideox():
    from diffusers import AutoencoderKLCogVideoX

    torch.manual_seed(0)
    return AutoencoderKLCogVideoX(
        in_channels=3, out_channels=3, down_block_types=("CogVideoXDownBlock3D",) * 4,
        up_block_types=("CogVideoXUpBlock3D",) * 4, block_out_channels=(8, 8, 8, 8), latent_channels=4,
        layers_per_block=1, norm_num_groups=2, temporal_compression_ratio=4,
    ).eval()


def tiny_wan():
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    return AutoencoderKLWan(
        base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
    ).eval()


def smooth_latent(channels: int, frames: int = 5, height: int = 16, width: int = 20) -> torch.Tensor:
    torch.manual_seed(1)
    return torch.nn.functional.avg_pool3d(torch.randn(1, channels, frames, height, width), 3, 1, 1)


@pytest.mark.parametrize(
    "family, build, channels, diffusers_tiling",
    [
        ("cogvideox", tiny_cogvideox, 4, dict(tile_sample_min_height=64, tile_sample_min_width=64,
                                              tile_overlap_factor_height=0.25, tile_overlap_factor_width=0.25)),
        ("wan", tiny_wan, 16, dict(tile_sample_min_height=64, tile_sample_min_width=64,
                                   tile_sample_stride_height=48, tile_sample_stride_width=48)),
    ],
)
def test_tiny_vae_tiled_close_to_untiled_and_no_worse_than_diffusers(family, build, channels, diffusers_tiling):
    """Tolerance: random tiny VAEs mix globally (GroupNorm / mid-block attention), so tiles can never
    match exactly. Ours must give the exact shape, a mean error under 0.05 (outputs are in [-1, 1]),
    and be no worse than diffusers' own tiling at the same 64 px tiles (+10%)."""
    vae = build()
    geometry = VaeGeometry(8, 4, channels)
    latents = smooth_latent(channels)
    decode = lambda z: vae.decode(z).sample  # noqa: E731
    whole = decode_video(decode, latents, geometry, None)
    with torch.no_grad():
        assert torch.equal(whole, vae.decode(latents).sample)  # whole mode is the plain decode
        vae.enable_tiling(**diffusers_tiling)
        theirs = vae.decode(latents).sample
        vae.disable_tiling()
    ours = decode_video(decode, latents, geometry, VaeTiling(tile_size=64, overlap=16))
    assert ours.shape == whole.shape == (1, 3, 17, 128, 160)
    ours_err, their_err = (ours - whole).abs().mean().item(), (theirs - whole).abs().mean().item()
    assert ours_err < 0.05 and ours_err <= 1.1 * their_err, (ours_err, their_err)


@pytest.mark.parametrize("family, build, channels", [("cogvideox", tiny_cogvideox, 4), ("wan", tiny_wan, 16)])
def test_tiny_vae_temporal_chunks_have_exact_shape(family, build, channels):
    vae = build()
    geometry = VaeGeometry(8, 4, channels)
    latents = smooth_latent(channels, frames=7, height=8, width=8)
    decode = lambda z: vae.decode(z).sample  # noqa: E731
    report = DecodeReport()
    tiling = VaeTiling(tile_size=64, overlap=16, temporal_size=8, temporal_overlap=4)
    chunked = decode_video(decode, latents, geometry, tiling, report=report)
    whole = decode_video(decode, latents, geometry, None)
    assert report.chunks > 1 and chunked.shape == whole.shape == (1, 3, 25, 64, 64)
    # the first chunk is decoded exactly as the whole video's first frames (causal VAE)
    assert torch.allclose(chunked[:, :, :5], whole[:, :, :5], atol=1e-5)
    assert (chunked - whole).abs().mean() < 0.1


def test_cogvideox_diffusers_tiling_size_bug_is_caught():
    vae = tiny_cogvideox()
    vae.enable_tiling(tile_sample_min_height=96, tile_sample_min_width=96)
    with pytest.raises(ValueError, match="disable_tiling"):
        decode_video(lambda z: vae.decode(z).sample, smooth_latent(4, 3, 16, 16), VaeGeometry(8, 4, 4), None)


# --- automatic tile size ------------------------------------------------------------------------


def test_auto_tiling_none_when_the_whole_decode_fits():
    assert auto_tiling(10**12, (1, 16, 13, 60, 90), COG, 1000.0) is None


def test_auto_tiling_fits_the_budget_and_shrinks_with_it():
    shape, bpp, budgets = (1, 16, 13, 60, 90), 1000.0, (2 * 2**30, 2**30, 2**28)
    peaks = []
    for budget in budgets:
        plan = plan_tiles(shape, COG, auto_tiling(budget, shape, COG, bpp))
        frames = max(COG.frames(f.stop - f.start + f.context) for f in plan.frames)
        peaks.append(frames * max(r.out_stop - r.out_start for r in plan.rows)
                     * max(c.out_stop - c.out_start for c in plan.cols))
        assert bpp * peaks[-1] <= 0.75 * budget
    assert peaks == sorted(peaks, reverse=True)


def test_auto_tiling_too_small_a_budget_gives_the_smallest_tiles():
    assert auto_tiling(1, (1, 16, 13, 60, 90), COG, 1000.0) == VaeTiling(64, 16, 8, 4)



def test_a_streamed_decoder_keeps_large_tiles_where_chunks_cost_nothing():
    """A decoder that carries its caches across a tile's chunks and steps through them a latent frame at a time
    (Wan, CogVideoX, HunyuanVideo 1.5) repeats no frames between chunks, and one step sets its peak: tiles are
    sized to the budget, chunk length is free. Counted as context-framed calls, a 16x VAE at 720p x 121 was given
    64 px tiles (4 latent pixels: seams) to keep every frame in one chunk."""
    shape, bpp = (1, 32, 31, 45, 80), 2000.0  # 1280 x 720, 121 frames
    budget = 6 * 2**30
    framed = auto_tiling(budget, shape, WAN22, bpp)
    streamed = auto_tiling(budget, shape, WAN22, bpp, stream_batch=1)
    assert framed.tile_size < streamed.tile_size
    assert bpp * peak_call_pixels(shape, WAN22, streamed, stream_batch=1) <= 0.75 * budget
    # chunks repeat nothing when streamed: the same tile decodes the same pixels however it is chunked
    whole, chunked = (VaeTiling(streamed.tile_size, streamed.overlap, t, 0) for t in (124, 16))
    assert peak_call_pixels(shape, WAN22, whole, 1) == peak_call_pixels(shape, WAN22, chunked, 1)
    assert peak_call_pixels(shape, WAN22, whole) > peak_call_pixels(shape, WAN22, chunked)  # not streamed: it is


LTX2_GEOMETRY = VaeGeometry(spatial_factor=32, temporal_factor=8, latent_channels=128)


def test_auto_tiling_never_goes_below_the_familys_smallest_tile():
    """LTX-2's 32x VAE decodes with seams below 512 px: tight budgets shorten the chunks instead."""
    shape = (1, 128, 9, 24, 40)  # 768 x 1280, 65 frames
    free = auto_tiling(10**12, shape, LTX2_GEOMETRY, 1000.0, min_tile=512)
    assert free is None
    for budget in (2**36, 2**34, 2**32, 1):
        tiling = auto_tiling(budget, shape, LTX2_GEOMETRY, 1000.0, min_tile=512)
        assert tiling.tile_size >= 512, budget
    assert auto_tiling(1, shape, LTX2_GEOMETRY, 1000.0, min_tile=512) == VaeTiling(512, 64, 8, 4)
    assert auto_tiling(1, shape, LTX2_GEOMETRY, 1000.0).tile_size == 64  # the test can see the floor
    small = (1, 128, 9, 8, 8)  # 256 x 256: smaller than the floor, still tiled in time
    assert auto_tiling(1, small, LTX2_GEOMETRY, 1000.0, min_tile=512) == VaeTiling(512, 64, 8, 4)


# --- fallback ladder --------------------------------------------------------------------------------


class OomAbove:
    """nearest_decode that raises torch.OutOfMemoryError when a call is larger than `limit` latent cells."""

    def __init__(self, limit: int | None):
        self.limit, self.calls = limit, 0

    def __call__(self, z):
        self.calls += 1
        if self.limit is None or z[0].numel() // z.shape[1] > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return nearest_decode(COG)(z)


def test_ladder_rungs_go_smaller_then_shorter_then_cpu():
    rungs = fallback_rungs((2, 16, 13, 60, 90), COG, None)
    labels = [r.label for r in rungs]
    assert labels[:2] == ["as requested", "one batch item at a time"] and labels[-1] == "decode on the CPU"
    tiles = [r.tiling.tile_size for r in rungs[2:-1]]
    temporal = [r.tiling.temporal_size for r in rungs[2:-1]]
    assert tiles == sorted(tiles, reverse=True) and tiles[-1] == 64
    assert temporal == sorted(temporal, reverse=True)
    shortest = plan_tiles((2, 16, 13, 60, 90), COG, rungs[-2].tiling)  # 2 new latent frames per chunk
    assert [f.stop - f.start for f in shortest.frames[1:]] == [2] * (shortest.chunks - 1)
    assert rungs[-1].on_cpu and not any(r.on_cpu for r in rungs[:-1])
    without_cpu = fallback_rungs((1, 16, 3, 8, 8), COG, None, cpu_available=False)
    assert "decode on the CPU" not in [r.label for r in without_cpu]



def test_ladder_tiles_stop_at_the_familys_smallest_tile_and_the_cpu_rung_uses_it():
    shape = (1, 128, 9, 48, 64)  # LTX-2, 1536 x 2048
    rungs = fallback_rungs(shape, LTX2_GEOMETRY, None, min_tile=512)
    tiles = [r.tiling.tile_size for r in rungs[2:] if not r.on_cpu]
    assert tiles and min(tiles) == 512 and tiles == sorted(tiles, reverse=True)
    temporal = [r.tiling.temporal_size for r in rungs[2:-1]]
    assert temporal[-1] < temporal[0] and rungs[-2].tiling.tile_size == 512  # shorter chunks after the smallest tile
    assert rungs[-1].on_cpu and rungs[-1].tiling == VaeTiling(512, 64)  # the default tile, raised as the decode raises it
    unfloored = fallback_rungs(shape, LTX2_GEOMETRY, None)
    assert min(r.tiling.tile_size for r in unfloored[2:]) == 64 and unfloored[-1].tiling == VaeTiling()
    chosen = fallback_rungs(shape, LTX2_GEOMETRY, VaeTiling(224, 32), min_tile=512)  # the user's tile stays
    assert {r.tiling.tile_size for r in chosen} == {224}


@pytest.mark.parametrize("min_tile", [0, 65, 100, 512])
def test_the_planner_and_the_ladder_share_one_tile_floor(min_tile):
    """A family floor off the 32 px grid rounds up the same way in auto_tiling and in the ladder."""
    from vidmem.memory.vae_tiles import tile_floor

    shape = (1, 128, 9, 48, 64)
    floor = tile_floor(min_tile)
    assert floor % 32 == 0 and floor >= max(64, min_tile) and floor - 32 < max(64, min_tile)
    assert auto_tiling(1, shape, LTX2_GEOMETRY, 1000.0, min_tile=min_tile).tile_size == floor
    rungs = fallback_rungs(shape, LTX2_GEOMETRY, None, min_tile=min_tile)
    assert min(r.tiling.tile_size for r in rungs[2:] if not r.on_cpu) == floor


def largest_call(shape, tiling) -> int:
    """Latent cells (frames x rows x cols) of the largest decode call of a plan."""
    plan = plan_tiles(shape, COG, tiling)
    return (max(f.stop - f.start + f.context for f in plan.frames) * max(r.stop - r.start for r in plan.rows)
            * max(c.stop - c.start for c in plan.cols))


@pytest.mark.parametrize("limit", [10**9, 3 * 20 * 20, 3 * 8 * 8])
def test_ladder_stops_at_the_first_rung_that_fits(limit):
    shape = (1, 16, 3, 60, 90)
    latents = torch.randn(shape)
    rungs = fallback_rungs(shape, COG, None)
    first_fit = next(i for i, rung in enumerate(rungs) if largest_call(shape, rung.tiling) <= limit)
    freed, report = [], DecodeReport()
    out = decode_with_fallback(OomAbove(limit), latents, COG, None, free_memory=lambda: freed.append(1), report=report)
    assert torch.allclose(out, decode_video(nearest_decode(COG), latents, COG, None), atol=1e-6)
    assert len(report.fallbacks) == len(freed) == first_fit
    assert all("ran out of memory (CUDA out of memory" in line for line in report.fallbacks)
    assert report.mode == ("whole" if first_fit == 0 else "tiled")



def test_the_ladder_given_a_familys_smallest_tile_shortens_chunks_instead_of_going_below_it():
    shape = (1, 16, 9, 60, 90)
    latents = torch.randn(shape)
    report = DecodeReport()
    out = decode_with_fallback(OomAbove(3 * 8 * 8), latents, COG, None, free_memory=lambda: None, report=report,
                               to_cpu=lambda: nearest_decode(COG), min_tile=128)
    assert torch.allclose(out, decode_video(nearest_decode(COG), latents, COG, None), atol=1e-6)
    tiles = re.findall(r"tile_size (\d+)", " ".join(report.fallbacks))
    assert tiles and min(map(int, tiles)) == 128 and "retrying with decode on the CPU" in report.fallbacks[-1]
    unfloored = DecodeReport()
    decode_with_fallback(OomAbove(3 * 8 * 8), latents, COG, None, free_memory=lambda: None, report=unfloored)
    assert "tile_size 64" in " ".join(unfloored.fallbacks)  # the test can see the floor


def test_ladder_skips_rungs_predicted_to_overrun_without_running_them():
    shape, limit = (1, 16, 3, 60, 90), 3 * 20 * 20
    latents = torch.randn(shape)
    rungs = fallback_rungs(shape, COG, None)
    first_fit = next(i for i, rung in enumerate(rungs) if largest_call(shape, rung.tiling) <= limit)
    decode, report = OomAbove(limit), DecodeReport()

    def predict(rung):
        need = largest_call(shape, rung.tiling)
        return f"needs {need} cells" if need > limit else None

    out = decode_with_fallback(decode, latents, COG, None, free_memory=lambda: None, predict=predict, report=report)
    assert torch.allclose(out, decode_video(nearest_decode(COG), latents, COG, None), atol=1e-6)
    assert len(report.fallbacks) == first_fit and all("skipped: predicted" in line for line in report.fallbacks)
    assert decode.calls == report.decode_calls  # every call ran at the rung that fits: none was wasted


def test_ladder_still_tries_the_last_device_rung_when_all_are_predicted_to_overrun():
    latents, report = torch.randn(1, 16, 3, 16, 16), DecodeReport()
    device_rungs = [r for r in fallback_rungs(latents.shape, COG, None, cpu_available=False)]
    out = decode_with_fallback(nearest_decode(COG), latents, COG, None, free_memory=lambda: None,
                               to_cpu=lambda: pytest.fail("a rung predicted to overrun is no reason to leave the device"),
                               predict=lambda rung: "pessimistic", report=report)
    assert out.shape == (1, 3, 9, 128, 128)
    assert len(report.fallbacks) == len(device_rungs) - 1 and report.tiling == device_rungs[-1].tiling


def test_ladder_shortens_chunks_after_the_smallest_tile():
    latents = torch.randn(1, 16, 13, 8, 8)  # 64x64 px: already one smallest tile
    report = DecodeReport()
    out = decode_with_fallback(OomAbove(5 * 64), latents, COG, None, free_memory=lambda: None, report=report)
    assert report.chunks > 1 and out.shape == (1, 3, 49, 64, 64)
    assert any("temporal_size" in line for line in report.fallbacks)


def test_ladder_ends_on_the_cpu():
    latents, moved = torch.randn(1, 16, 3, 8, 8), []

    def to_cpu():
        moved.append(True)
        return nearest_decode(COG)

    report = DecodeReport()
    out = decode_with_fallback(OomAbove(None), latents, COG, None, free_memory=lambda: None, to_cpu=to_cpu,
                               report=report)
    assert moved == [True] and out.shape == (1, 3, 9, 64, 64)
    assert report.fallbacks[-1].endswith("retrying with decode on the CPU")


def test_ladder_exhausted_raises_oom_listing_every_rung():
    decode = OomAbove(None)
    with pytest.raises(torch.OutOfMemoryError, match="every rung.*as requested.*latents are intact"):
        decode_with_fallback(decode, torch.randn(1, 16, 3, 16, 16), COG, None, free_memory=lambda: None)
    assert decode.calls == len(fallback_rungs((1, 16, 3, 16, 16), COG, None, cpu_available=False))


def test_ladder_does_not_swallow_other_errors():
    def broken(z):
        raise RuntimeError("cuDNN error")

    with pytest.raises(RuntimeError, match="cuDNN"):
        decode_with_fallback(broken, torch.randn(1, 16, 3, 8, 8), COG, None, free_memory=lambda: None)
