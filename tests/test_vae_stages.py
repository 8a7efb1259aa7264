"""VAE decode stages: Wan's frame-wide layers once on the whole latent, and both families' caches
streamed across a tile's frame chunks (CPU, tiny VAEs)."""

from __future__ import annotations

import pytest
import torch

from vidmem.memory.strategy import VaeTiling
from vidmem.memory.vae import DecodeReport, Streaming, VaeGeometry, decode_video, decode_with_fallback, plan_tiles
from vidmem.pipelines.tiny import build_tiny_pipeline
from vidmem.pipelines.cogvideox_vae import cogvideox_stream, frame_batches
from vidmem.pipelines.wan_vae import wan_stages

from test_vae_tiling import COG, OomAbove, nearest_decode, smooth_latent, tiny_cogvideox, tiny_wan


def tiny_ti2v_vae():
    """Wan 2.2 TI2V-5B's layout: residual up-blocks, 48 channels, patch size 2 (16 px per latent)."""
    return build_tiny_pipeline("wan2.2-ti2v").vae.eval()


VAES = [
    pytest.param(tiny_wan, VaeGeometry(8, 4, 16), id="wan2.1"),
    pytest.param(tiny_ti2v_vae, VaeGeometry(16, 4, 48), id="wan2.2-ti2v"),
]


@pytest.mark.parametrize("build, geometry", VAES)
def test_two_stages_equal_the_diffusers_decode_bit_for_bit(build, geometry):
    vae = build()
    stages = wan_stages(vae)
    latents = smooth_latent(geometry.latent_channels, frames=5, height=6, width=8)
    with torch.no_grad():
        expected = vae.decode(latents).sample
        got = stages.pixels(stages.context(latents))
    assert got.shape == (1, 3, 17, 6 * geometry.spatial_factor, 8 * geometry.spatial_factor)
    assert torch.equal(got, expected)


def test_a_parked_context_holds_one_frame_on_the_device_and_the_planner_traces_it_so():
    """A tiled decode parks the frame-wide output on the host a frame at a time (memory.vae): the device holds one
    frame of it, and the planner's trace of that phase (`staged_decode`, parked) is what runs. It traced the whole
    output on the device, and its concatenation: about twice the output too high."""
    import copy

    from diffusers import AutoencoderKLWan

    from vidmem.memory.accounting import trace
    from vidmem.pipelines.configs.workloads import staged_decode

    torch.manual_seed(0)  # features 4x as wide as the latent (Wan's are 24x): the output is most of the phase
    vae = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                           temperal_downsample=[False, True, True]).eval()
    stages = wan_stages(vae)
    latents = smooth_latent(4, frames=13, height=12, width=16)
    # The device is the CPU here and the host is meta: both are counted, so the parked output is taken off.
    run = trace(lambda: stages.context(latents, park="meta"))
    with torch.no_grad():
        output = stages.context(latents)
    on_device = run.peak_bytes - output.untyped_storage().nbytes()
    meta_stages = wan_stages(copy.deepcopy(vae).to("meta"))
    planned = trace(staged_decode(meta_stages, "decode_context", tuple(latents.shape), latents.dtype, parked=True))
    assert planned.peak_bytes == pytest.approx(on_device, rel=0.02)
    unparked = trace(staged_decode(meta_stages, "decode_context", tuple(latents.shape), latents.dtype))
    assert unparked.peak_bytes > planned.peak_bytes + 0.8 * output.untyped_storage().nbytes()
    assert planned.live_bytes == 0 and unparked.live_bytes >= output.untyped_storage().nbytes()


@pytest.mark.parametrize("build, geometry", VAES)
def test_whole_mode_with_stages_is_the_plain_decode(build, geometry):
    vae = build()
    stages = wan_stages(vae)
    latents = smooth_latent(geometry.latent_channels, frames=3, height=6, width=8)
    report = DecodeReport()
    out = decode_video(stages.pixels, latents, geometry, None, prepare=stages.context, report=report)
    with torch.no_grad():
        assert torch.equal(out, vae.decode(latents).sample)
    assert report.shared_context and report.mode == "whole"


@pytest.mark.parametrize("build, geometry", VAES)
def test_streamed_temporal_chunks_are_exact(build, geometry):
    """Each tile's feature caches carry over from chunk to chunk: time is cut with no error at all."""
    vae = build()
    stages = wan_stages(vae)
    latents = smooth_latent(geometry.latent_channels, frames=7, height=4, width=6)
    tiling = VaeTiling(tile_size=4096, overlap=0, temporal_size=8, temporal_overlap=0)
    report = DecodeReport()
    out = decode_video(Streaming(stages.stream), latents, geometry, tiling, prepare=stages.context, report=report)
    with torch.no_grad():
        assert torch.equal(out, vae.decode(latents).sample)
    assert report.chunks == 4 and report.tiles == 1 and report.streamed


def tiny_cogvideox15():
    """CogVideoX 1.5's VAE layout: the tiny pipeline's, saved and used like the real one."""
    return build_tiny_pipeline("cogvideox1.5-t2v").vae.eval()


@pytest.mark.parametrize("build", [tiny_cogvideox, tiny_cogvideox15], ids=["cogvideox", "cogvideox1.5"])
@pytest.mark.parametrize("latent_frames", [7, 8])
def test_cogvideox_streamed_chunks_are_exact(build, latent_frames):
    vae = build()
    stream, channels = cogvideox_stream(vae), vae.config.latent_channels
    latents = smooth_latent(channels, frames=latent_frames, height=4, width=6)
    geometry = VaeGeometry(8, 4, channels)
    tiling = VaeTiling(tile_size=4096, overlap=0, temporal_size=8, temporal_overlap=0)
    report = DecodeReport()
    out = decode_video(Streaming(stream.stream, stream.frame_batch), latents, geometry, tiling, report=report)
    with torch.no_grad():
        whole = vae.decode(latents).sample
    assert torch.equal(out, whole[:, :, whole.shape[2] - out.shape[2]:]) and report.chunks > 1


def test_cogvideox_chunks_decoded_alone_are_not_exact():
    """The test above can fail: without the carried caches the same chunks differ."""
    vae = tiny_cogvideox()
    latents = smooth_latent(4, frames=7, height=4, width=6)
    tiling = VaeTiling(tile_size=4096, overlap=0, temporal_size=8, temporal_overlap=4)
    out = decode_video(lambda z: vae.decode(z).sample, latents, VaeGeometry(8, 4, 4), tiling)
    with torch.no_grad():
        assert not torch.equal(out, vae.decode(latents).sample)


def test_frame_batches_group_like_diffusers():
    assert list(frame_batches(13, 2)) == [(0, 3), (3, 5), (5, 7), (7, 9), (9, 11), (11, 13)]
    assert list(frame_batches(8, 2)) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert list(frame_batches(1, 2)) == [(0, 3)]  # diffusers slices past the end: frame 0 only


def test_streamed_tiles_match_per_piece_tiles_when_time_is_not_cut():
    vae = tiny_wan()
    stages, geometry = wan_stages(vae), VaeGeometry(8, 4, 16)
    latents = smooth_latent(16, frames=3, height=12, width=16)
    tiling = VaeTiling(tile_size=64, overlap=16)
    streamed = decode_video(Streaming(stages.stream), latents, geometry, tiling, prepare=stages.context)
    pieces = decode_video(stages.pixels, latents, geometry, tiling, prepare=stages.context)
    assert torch.equal(streamed, pieces)


def test_continuous_plans_cut_time_back_to_back_without_context():
    geometry, tiling = VaeGeometry(8, 4, 16), VaeTiling(temporal_size=16, temporal_overlap=8)
    plan = plan_tiles((1, 16, 21, 8, 8), geometry, tiling, stream_batch=1)
    assert [(f.start, f.stop, f.context) for f in plan.frames] == [(0, 1, 0), (1, 5, 0), (5, 9, 0), (9, 13, 0),
                                                                   (13, 17, 0), (17, 21, 0)]
    assert [(f.out_start, f.out_stop) for f in plan.frames][:2] == [(0, 1), (1, 17)]
    assert plan.frames[-1].out_stop == 81 and all(torch.equal(f.weight, torch.ones_like(f.weight)) for f in plan.frames)
    assert max(f.out_stop - f.out_start for f in plan.frames) <= tiling.temporal_size
    batched = plan_tiles((1, 16, 13, 8, 8), geometry, VaeTiling(temporal_size=20, temporal_overlap=8), stream_batch=2)
    # CogVideoX steps by 2 latent frames, 3 in its first batch: chunks keep those batches whole
    assert [(f.start, f.stop) for f in batched.frames] == [(0, 5), (5, 9), (9, 13)]


def test_tiles_sharing_the_attention_are_closer_to_untiled_than_whole_decoder_tiles():
    """The mid-block attention mixes the whole frame: tiles that each run it on their own drift
    apart; with the frame-wide stage shared, what is left is convolution reach at tile borders.
    Random tiny weights barely use the attention, so its output projection is scaled up 10x."""
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    vae = AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True]).eval()
    with torch.no_grad():
        vae.decoder.mid_block.attentions[0].proj.weight.mul_(10)
    stages, geometry = wan_stages(vae), VaeGeometry(8, 4, 16)
    latents = smooth_latent(16, frames=3, height=16, width=24)
    tiling = VaeTiling(tile_size=64, overlap=16)
    whole = decode_video(stages.pixels, latents, geometry, None, prepare=stages.context)
    shared = decode_video(stages.pixels, latents, geometry, tiling, prepare=stages.context)
    alone = decode_video(lambda z: vae.decode(z).sample, latents, geometry, tiling)
    shared_err, alone_err = (shared - whole).abs().mean().item(), (alone - whole).abs().mean().item()
    assert shared.shape == whole.shape == (1, 3, 9, 128, 192)
    assert shared_err < alone_err / 3, (shared_err, alone_err)


def test_a_frame_wide_prepare_makes_per_pixel_tiles_exact():
    """Stand-in: a per-frame mean (frame-wide) then a per-pixel decoder. Sharing the frame-wide
    stage makes tiles exact; tiling the composition does not."""

    def frame_wide(z, park=None):
        return z - z.mean(dim=(-2, -1), keepdim=True)

    latents, tiling = smooth_latent(16, frames=3, height=16, width=24) * 3, VaeTiling(tile_size=64, overlap=16)
    whole = decode_video(nearest_decode(COG), frame_wide(latents), COG, None)
    shared = decode_video(nearest_decode(COG), latents, COG, tiling, prepare=frame_wide)
    composed = decode_video(lambda z: nearest_decode(COG)(frame_wide(z)), latents, COG, tiling)
    assert torch.allclose(shared, whole, atol=1e-6)
    assert (composed - whole).abs().max() > 1e-3


def test_layouts_not_known_get_no_stages():
    assert wan_stages(tiny_cogvideox()) is None and cogvideox_stream(tiny_wan()) is None
    assert wan_stages(torch.nn.Linear(2, 2)) is None and cogvideox_stream(torch.nn.Linear(2, 2)) is None


def test_prepare_runs_once_per_batch_group_and_pieces_come_from_its_output():
    calls = []

    def prepare(z, park):
        calls.append((tuple(z.shape), park))
        return z * 2

    latents = torch.randn(2, 16, 3, 16, 16)
    tiling = VaeTiling(tile_size=64, overlap=16)
    out = decode_video(nearest_decode(COG), latents, COG, tiling, slicing=True, prepare=prepare)
    assert calls == [((1, 16, 3, 16, 16), torch.device("cpu"))] * 2
    assert torch.allclose(out, decode_video(nearest_decode(COG), latents * 2, COG, None), atol=1e-6)


def test_prepare_that_changes_the_grid_is_refused():
    with pytest.raises(ValueError, match="prepare must keep the latent's"):
        decode_video(nearest_decode(COG), torch.randn(1, 16, 3, 8, 8), COG, VaeTiling(tile_size=64, overlap=16),
                     prepare=lambda z, park: z[:, :, :, ::2])


class StreamingNearest:
    """A stateful stand-in for a streaming VAE: per-pixel like `nearest_decode`, but only the tile's
    very first latent frame gives 1 output frame; every later one, in any chunk, gives 4. A plan
    with context frames or a restarted state would give the wrong frames and fail the check."""

    def __init__(self, limit: int | None = None):
        self.limit, self.starts = limit, 0

    def start(self):
        self.starts += 1
        seen = [0]

        def decode(z):
            if self.limit is not None and z[0, 0].numel() > self.limit:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            x = (z[:, :3] * 0.5 + z[:, 3:6] * 0.25).repeat_interleave(8, -1).repeat_interleave(8, -2)
            first = x[:, :, :1] if seen[0] == 0 else x[:, :, :1].repeat_interleave(4, 2)
            seen[0] += z.shape[2]
            return torch.cat([first, x[:, :, 1:].repeat_interleave(4, 2)], dim=2)

        return decode


def test_ladder_runs_a_streaming_decoder_down_to_shorter_chunks():
    latents, fake, report = torch.randn(1, 16, 9, 8, 8), StreamingNearest(limit=4 * 8 * 8), DecodeReport()
    out = decode_with_fallback(Streaming(fake.start), latents, COG, None, free_memory=lambda: None, report=report)
    assert torch.allclose(out, decode_video(nearest_decode(COG), latents, COG, None), atol=1e-6)
    assert report.streamed and report.chunks > 1 and any("temporal_size" in line for line in report.fallbacks)
    assert fake.starts == len(report.fallbacks) + 1  # one fresh state per attempt (a single tile)


def test_streamed_tiles_and_chunks_restart_the_state_per_tile():
    latents, fake = torch.randn(2, 16, 9, 16, 24), StreamingNearest()
    tiling = VaeTiling(tile_size=64, overlap=16, temporal_size=8, temporal_overlap=0)
    report = DecodeReport()
    out = decode_video(Streaming(fake.start), latents, COG, tiling, slicing=True, report=report)
    assert torch.allclose(out, decode_video(nearest_decode(COG), latents, COG, None), atol=1e-6)
    assert report.tiles > 1 and report.chunks > 1 and fake.starts == 2 * report.tiles


@pytest.mark.parametrize("family", ["wan", "cogvideox"])
def test_real_tiles_cut_in_time_equal_the_same_tiles_uncut(family):
    """The default path: several tiles, several streamed chunks per tile. Cutting time changes nothing."""
    vae = tiny_wan() if family == "wan" else tiny_cogvideox()
    stages = wan_stages(vae) if family == "wan" else cogvideox_stream(vae)
    channels = 16 if family == "wan" else 4
    geometry, latents = VaeGeometry(8, 4, channels), smooth_latent(channels, frames=9, height=12, width=16)
    cut, uncut = (VaeTiling(tile_size=64, overlap=16, temporal_size=t, temporal_overlap=0) for t in (8, 4096))
    decode = Streaming(stages.stream, stages.frame_batch)
    report = DecodeReport()
    chunked = decode_video(decode, latents, geometry, cut, prepare=stages.context, report=report)
    whole_time = decode_video(decode, latents, geometry, uncut, prepare=stages.context)
    assert report.tiles > 1 and report.chunks > 1
    assert torch.equal(chunked, whole_time)


def test_ladder_keeps_the_shared_stage_on_every_rung_including_the_cpu():
    calls, on_cpu, latents = [], [], torch.randn(1, 16, 3, 8, 8)

    def prepare(z, park):
        calls.append(bool(on_cpu))
        return z

    def to_cpu():
        on_cpu.append(True)
        return nearest_decode(COG)

    report = DecodeReport()
    out = decode_with_fallback(OomAbove(None), latents, COG, None, free_memory=lambda: None,
                               to_cpu=to_cpu, prepare=prepare, report=report)
    assert out.shape == (1, 3, 9, 64, 64) and report.shared_context
    assert calls == [False] * len(report.fallbacks) + [True]  # once per device rung, then once on the CPU


def test_a_predictor_that_raises_is_ignored():
    latents, report = torch.randn(1, 16, 3, 16, 16), DecodeReport()

    def broken(rung):
        raise RuntimeError("planner cannot model this")

    out = decode_with_fallback(nearest_decode(COG), latents, COG, None, free_memory=lambda: None,
                               predict=broken, report=report)
    assert out.shape == (1, 3, 9, 128, 128) and report.fallbacks == [] and report.mode == "whole"
