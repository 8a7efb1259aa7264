"""HunyuanVideo 1.5 as a family: loaded from a diffusers folder, sampled on every tier bit for bit
as plain diffusers samples it, decoded tiled, its bad input worded, and planned on meta."""

from __future__ import annotations

import dataclasses
import json

import diffusers
import pytest
import torch

from test_tiers import hooks_of, storage_map
from vidmem.memory import MemoryStrategy, VaeTiling
from vidmem.memory.device import CpuBackend
from vidmem.pipelines.decode import decode
from vidmem.pipelines.family import ModelError
from vidmem.pipelines.hunyuan_video15 import HUNYUAN_VIDEO15, pack_prompt, unpack_prompt
from vidmem.pipelines.sample import SampleRequest, sample
from vidmem.pipelines.tiny import tiny_call_kwargs, tiny_spec

VARIANT = "hunyuanvideo1.5-t2v"
I2V = "hunyuanvideo1.5-i2v"
STEPS = 2
TIERS = {
    "none": MemoryStrategy(offload="none"),
    "model": MemoryStrategy(offload="model"),
    "model/te-cpu": MemoryStrategy(offload="model", text_encoder="cpu"),
    "block_swap:1": MemoryStrategy(offload="block_swap", blocks_to_swap=1, prefetch_blocks=0),
    "block_swap:2": MemoryStrategy(offload="block_swap", blocks_to_swap=2, prefetch_blocks=1),
    "sequential": MemoryStrategy(offload="sequential"),
}


def request(prompt: str = "a cat", cfg: float = 5.0, **fields) -> SampleRequest:
    spec = tiny_spec(VARIANT)
    fields = dict(width=spec.width, height=spec.height, frames=spec.frames, steps=STEPS) | fields
    return SampleRequest(prompt, "", cfg=cfg, seed=0, **fields)


def plain_latents(folder, prompt: str = "a cat", cfg: float = 5.0) -> torch.Tensor:
    """diffusers' own pipeline class on the same folder, cfg in its guider as diffusers takes it."""
    pipe = diffusers.HunyuanVideo15Pipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    pipe.guider = type(pipe.guider)(guidance_scale=cfg)
    return pipe(**dict(tiny_call_kwargs(VARIANT, steps=STEPS), prompt=prompt)).frames


def test_the_folder_loads_as_the_hunyuan_video15_family(tiny_loaded):
    loaded = tiny_loaded(VARIANT)
    assert loaded.spec is HUNYUAN_VIDEO15
    assert isinstance(loaded.pipe, diffusers.HunyuanVideo15Pipeline)
    assert not loaded.needs_image and not loaded.accepts_image


def test_every_tier_matches_plain_diffusers_bit_for_bit(tiny_loaded, tiny_folder):
    loaded = tiny_loaded(VARIANT)
    reference = plain_latents(tiny_folder(VARIANT))
    sample(loaded, TIERS["none"], request(steps=1), backend=CpuBackend())  # transformers adds its own hooks on first use
    before, hooks_before, guider = storage_map(loaded.pipe), hooks_of(loaded.pipe), loaded.pipe.guider
    for label, strategy in TIERS.items():
        latent = sample(loaded, strategy, request(), backend=CpuBackend()).latent
        assert torch.equal(latent["samples"], reference), f"{label} differs from diffusers"
        assert latent["vidmem"]["family"] == "hunyuanvideo1.5"
    assert storage_map(loaded.pipe) == before and hooks_of(loaded.pipe) == hooks_before
    assert loaded.pipe.guider is guider and "step" not in vars(loaded.pipe.scheduler)  # nothing left applied


@pytest.mark.parametrize("prompt, cfg, diffusers_cfg", [('a sign that says "vidmem"', 5.0, 5.0), ("a cat", 3.0, 3.0),
                                                       ("a cat", 1.0, 1.0), ("a cat", 0.5, 1.0)])
def test_glyph_text_cfg_and_unguided_runs_match_plain_diffusers(prompt, cfg, diffusers_cfg, tiny_loaded, tiny_folder):
    """Quoted text runs the ByT5 encoder; a cfg other than the folder's guider's (5.0 in the tiny one)
    reaches the call's guider; cfg 1 or less runs no negative pass (nor encodes one), as for every
    family (diffusers' guider would still guide at 0.5)."""
    loaded = tiny_loaded(VARIANT)
    reference = plain_latents(tiny_folder(VARIANT), prompt, diffusers_cfg)
    result = sample(loaded, TIERS["block_swap:1"], request(prompt, cfg), backend=CpuBackend())
    assert torch.equal(result.latent["samples"], reference)
    assert ("negative_prompt" in result.receipt["text_encode"]) == (cfg > 1)


def test_cached_prompt_embeddings_give_the_same_latents(tiny_loaded, tmp_path):
    """The packed embeddings go through the prompt cache whole; a hit skips both text encoders."""
    from vidmem.pipelines.hooks import RunHooks
    from vidmem.pipelines.prompt_cache import PromptCache

    loaded, hooks = tiny_loaded(VARIANT), RunHooks(prompt_cache=PromptCache(tmp_path))
    first = sample(loaded, TIERS["model"], request('a sign that says "hi"'), hooks=hooks, backend=CpuBackend())
    again = sample(loaded, TIERS["model"], request('a sign that says "hi"'), hooks=hooks, backend=CpuBackend())
    assert first.receipt["text_encode"]["cache"].startswith("encoded") and again.receipt["text_encode"]["cache"] == "used"
    assert torch.equal(first.latent["samples"], again.latent["samples"])


def test_image_to_video_matches_plain_diffusers_on_every_tier(tiny_loaded, tiny_folder):
    """diffusers sizes the video from the image (64x64 here: the bucket nearest a square image)."""
    loaded = tiny_loaded(I2V)
    plain = diffusers.HunyuanVideo15ImageToVideoPipeline.from_pretrained(tiny_folder(I2V))
    plain.set_progress_bar_config(disable=True)
    call = {k: v for k, v in tiny_call_kwargs(I2V, steps=STEPS).items() if k not in ("height", "width")}
    reference = plain(**call).frames
    image = torch.full((1, 64, 64, 3), 128 / 255)  # the grey image tiny_call_kwargs gives diffusers
    for label, strategy in TIERS.items():
        latent = sample(loaded, strategy, request(image=image), backend=CpuBackend()).latent
        assert torch.equal(latent["samples"], reference), f"{label} differs from diffusers"


def test_image_to_video_makes_the_requested_size_not_the_images_bucket(tiny_loaded):
    loaded = tiny_loaded(I2V)
    image = torch.full((1, 64, 64, 3), 128 / 255)
    latent = sample(loaded, TIERS["none"], request(image=image, width=96, height=64), backend=CpuBackend()).latent
    assert latent["samples"].shape[-2:] == (64 // 16, 96 // 16)
    assert "calculate_default_height_width" not in vars(loaded.pipe.video_processor)
    with pytest.raises(ModelError, match="image-to-video: connect an IMAGE"):
        sample(loaded, TIERS["none"], request(), backend=CpuBackend())


def test_out_of_memory_resumes_from_the_last_step_through_the_adapter(tiny_loaded):
    """The adapter's step-end callback counts steps with the restored scheduler's index, so the
    resumed run equals an uninterrupted one under the strategy the ladder chose."""
    from test_oom_ladder import InjectOOM, block_count, run
    from vidmem.pipelines.sample_ladder import fixed_ladder

    loaded, steps = tiny_loaded(VARIANT), 4
    final = fixed_ladder(MemoryStrategy(), block_count(loaded))[0]
    reference = run(loaded, final, request(steps=steps)).latent["samples"]
    guider = loaded.pipe.guider
    with InjectOOM(loaded.pipe.transformer.transformer_blocks[-1], [2 * 2 + 1]) as oom:  # step 3's cond pass
        result = run(loaded, MemoryStrategy(offload="model"), request(steps=steps))
    assert oom.raised == 1 and oom.calls == 2 * steps + 1  # finished steps are not run again
    (rung,) = result.receipt["oom_ladder"]
    assert rung["at_step"] == 3 and rung["resumed_from_step"] == 2
    assert torch.equal(result.latent["samples"], reference)
    assert loaded.pipe.guider is guider and "step" not in vars(loaded.pipe.scheduler)


def test_a_resumed_image_to_video_run_encodes_its_image_once(tiny_loaded):
    """SigLIP and the VAE encode the image in the first attempt only: the attempt resumed after an
    out-of-memory error reuses both (pipelines/sample_call.py `vidmem_once`), and its latents are an
    uninterrupted run's."""
    from test_oom_ladder import InjectOOM, block_count, run
    from vidmem.pipelines.sample_ladder import fixed_ladder

    loaded, steps = tiny_loaded(I2V), 4
    image = torch.full((1, 64, 64, 3), 128 / 255)
    reference = run(loaded, fixed_ladder(MemoryStrategy(), block_count(loaded))[0], request(image=image, steps=steps))
    encodes = []
    hooks = [module.register_forward_pre_hook(lambda module, args, name=name: encodes.append(name))
             for name, module in (("siglip", loaded.pipe.image_encoder), ("vae", loaded.pipe.vae.encoder))]
    try:
        with InjectOOM(loaded.pipe.transformer.transformer_blocks[-1], [2 * 2 + 1]) as oom:  # step 3's cond pass
            result = run(loaded, MemoryStrategy(offload="model"), request(image=image, steps=steps))
    finally:
        for hook in hooks:
            hook.remove()
    assert oom.raised == 1 and result.receipt["oom_ladder"][0]["resumed_from_step"] == 2
    assert sorted(encodes) == ["siglip", "vae"]
    assert torch.equal(result.latent["samples"], reference.latent["samples"])


def test_keys_only_masking_gives_the_valid_tokens_the_same_attention(tiny_loaded, monkeypatch):
    """Above EXACT_MASK_BYTES the blocks mask keys only (no dense S x S mask); forced here at the
    tiny size, the latents match diffusers' masking (on the CPU's math kernel, bit for bit)."""
    from vidmem.pipelines import hunyuan_video15_attention as attention

    loaded = tiny_loaded(VARIANT)
    processors = [block.attn.processor for block in loaded.pipe.transformer.transformer_blocks]
    exact = sample(loaded, TIERS["block_swap:1"], request('a sign that says "hi"'), backend=CpuBackend()).latent["samples"]
    lean_calls = []
    keys_masked = attention.KeyMaskedAttention._keys_masked
    monkeypatch.setattr(attention, "EXACT_MASK_BYTES", 0)
    monkeypatch.setattr(attention.KeyMaskedAttention, "_keys_masked",
                        lambda self, *args: lean_calls.append(1) or keys_masked(self, *args))
    lean = sample(loaded, TIERS["block_swap:1"], request('a sign that says "hi"'), backend=CpuBackend()).latent["samples"]
    assert len(lean_calls) == STEPS * 2 * len(processors)  # every block, cond and uncond, every step
    assert torch.allclose(lean, exact, atol=1e-6, rtol=0)
    assert [block.attn.processor for block in loaded.pipe.transformer.transformer_blocks] == processors
    # activation chunks mask as the wrapper would: keys only here, so the chunked run gives its latents bit for bit
    for chunks in (2, 3):
        chunked = sample(loaded, dataclasses.replace(TIERS["block_swap:1"], activation_chunks=chunks),
                         request('a sign that says "hi"'), backend=CpuBackend())
        assert torch.equal(chunked.latent["samples"], lean) and chunked.receipt["activation_chunks"]["chunks"] == chunks
    assert len(lean_calls) == STEPS * 2 * len(processors)  # the slices attend themselves: the wrapper never ran


@pytest.mark.reproducible_blas
def test_the_disk_tier_and_fp8_storage_run_the_family(tiny_loaded, tiny_folder):
    """Weights used in place from the folder's files (weight_dtype = the files' dtype) give the
    loaded pipeline's latents; fp8 storage upcasts per forward and stays finite."""
    from vidmem.pipelines.loader import load_pipeline

    reference = sample(tiny_loaded(VARIANT), TIERS["block_swap:1"], request(), backend=CpuBackend()).latent["samples"]
    on_disk = load_pipeline(tiny_folder(VARIANT), "fp32", weight_dtype="fp32")
    assert on_disk.on_disk and set(on_disk.storage) == {"transformer", "text_encoder"}
    assert torch.equal(sample(on_disk, TIERS["block_swap:1"], request(), backend=CpuBackend()).latent["samples"], reference)
    fp8 = load_pipeline(tiny_folder(VARIANT), "fp32", weight_dtype="fp8_e4m3fn")
    latent = sample(fp8, TIERS["sequential"], request(), backend=CpuBackend()).latent["samples"]
    assert fp8.storage["transformer"] == "fp8_e4m3fn" and torch.isfinite(latent).all()


def test_packed_prompt_embeddings_unpack_to_the_same_bits():
    torch.manual_seed(0)
    embeds, glyphs = torch.randn(2, 7, 16), torch.randn(2, 5, 32)
    masks = (torch.randint(0, 2, (2, 7)).float(), torch.randint(0, 2, (2, 5)).float())
    unpacked = unpack_prompt(pack_prompt(embeds, masks[0], glyphs, masks[1]), 16, 32, 5)
    expected = {"prompt_embeds": embeds, "prompt_embeds_mask": masks[0], "prompt_embeds_2": glyphs,
                "prompt_embeds_mask_2": masks[1]}
    assert unpacked.keys() == expected.keys()
    assert all(torch.equal(unpacked[key], value) for key, value in expected.items())


def test_decode_equals_the_diffusers_pipeline(tiny_loaded):
    loaded = tiny_loaded(VARIANT)
    expected = loaded.pipe(**tiny_call_kwargs(VARIANT, steps=STEPS, output_type="pt")).frames[0]  # [F, C, H, W]
    latent = sample(loaded, TIERS["model"], request(), backend=CpuBackend()).latent
    frames = decode(loaded, latent, backend=CpuBackend()).frames
    assert torch.equal(frames, expected.permute(0, 2, 3, 1))


def _latent(frames: int = 5, height: int = 4, width: int = 8) -> dict:
    """A random latent of the tiny model: 5 x 4 x 8 decodes to 17 frames of 128x64."""
    return {"samples": torch.randn(1, 4, frames, height, width, generator=torch.Generator().manual_seed(0))}


def test_decode_chunked_in_time_equals_untiled_exactly(tiny_loaded):
    """The causal convolutions carry their last frames from chunk to chunk (hunyuan_video15_vae.py)."""
    loaded, latent = tiny_loaded(VARIANT), _latent()
    whole = decode(loaded, latent, backend=CpuBackend())
    chunked = decode(loaded, latent, MemoryStrategy(vae_tiling=VaeTiling(256, 32, 8, 4)), backend=CpuBackend())
    assert chunked.receipt["decode"]["chunks"] > 1 and chunked.receipt["decode"]["tiles"] == 1
    assert chunked.receipt["decode"]["shared_context"] and chunked.receipt["decode"]["streamed"]
    assert torch.equal(chunked.frames, whole.frames)


def test_decode_chunked_in_time_at_an_odd_size_equals_untiled_up_to_rounding(tiny_loaded):
    """At 5x7x9 a frame's elements do not fill whole vector lanes, so the CPU's SiLU rounds some of them
    differently in a chunk than in the whole decode (hunyuan_video15_vae.py): under 1e-6 in fp32, as stated."""
    loaded, latent = tiny_loaded(VARIANT), _latent(5, 7, 9)
    whole = decode(loaded, latent, backend=CpuBackend())
    chunked = decode(loaded, latent, MemoryStrategy(vae_tiling=VaeTiling(4096, 0, 8, 0)), backend=CpuBackend())
    assert chunked.receipt["decode"]["chunks"] == 3 and chunked.receipt["decode"]["tiles"] == 1
    assert "chunks streamed with the causal caches carried" in chunked.receipt["decode_summary"]
    assert torch.allclose(chunked.frames, whole.frames, atol=1e-6, rtol=0)


def test_decode_tiled_in_space_stays_close_to_untiled(tiny_loaded):
    """Not exact: tiles are blended across their overlaps. With these random weights and tiles of
    4 latent pixels (every pixel is within a convolution's reach of a border) the mean error on
    0..1 pixels stays below 0.05; bench/ measures the real VAE."""
    loaded, latent = tiny_loaded(VARIANT), _latent()
    whole = decode(loaded, latent, backend=CpuBackend())
    tiled = decode(loaded, latent, MemoryStrategy(vae_tiling=VaeTiling(64, 16, 8, 4)), backend=CpuBackend())
    assert tiled.receipt["decode"]["tiles"] > 1 and tiled.receipt["decode"]["chunks"] > 1
    assert tiled.frames.shape == whole.frames.shape == (17, 64, 128, 3)
    assert 0 < (tiled.frames - whole.frames).abs().mean() < 0.05


def test_a_batch_of_two_decodes_each_item_as_diffusers_decodes_it_alone(tiny_loaded):
    """diffusers' mid-block attention fails at a batch of two (its [B, N, N] mask meets [B, 1, N, N] scores): the
    context runs it an item at a time, so each video is its own `vae.decode` (up to the CPU's rounding: a batch of
    two convolves in another order than one)."""
    from vidmem.pipelines.hunyuan_video15_vae import hunyuan_video15_stages

    vae = tiny_loaded(VARIANT).pipe.vae
    z = torch.randn(2, 4, 5, 4, 8, generator=torch.Generator().manual_seed(3))
    stages = hunyuan_video15_stages(vae)
    with torch.no_grad():
        with pytest.raises(RuntimeError, match="broadcast"):  # when diffusers fixes it, this test can go
            vae.decode(z)
        both = stages.stream()(stages.context(z))
        for item in range(2):
            assert torch.allclose(both[item : item + 1], vae.decode(z[item : item + 1]).sample, atol=1e-5, rtol=0)


def test_frame_causal_attention_equals_the_masked_one_without_the_mask(tiny_loaded):
    """Above EXACT_MASK_BYTES the mid-block attends frame by frame: the same sums up to rounding."""
    from vidmem.pipelines.hunyuan_video15_vae import hunyuan_video15_stages

    vae = tiny_loaded(VARIANT).pipe.vae
    z = _latent()["samples"] / vae.config.scaling_factor
    exact = hunyuan_video15_stages(vae)
    lean = type(exact)(vae, exact_mask_bytes=0)
    with torch.no_grad():
        assert torch.equal(exact.stream()(exact.context(z)), vae.decode(z).sample)
        assert torch.allclose(lean.context(z), exact.context(z), atol=1e-5, rtol=0)


@pytest.mark.parametrize("size, words", [
    (dict(frames=10), "frames=10 is not valid for hunyuanvideo1.5: use 4k+1 frames (e.g. 9 or 13)"),
    (dict(width=72), "width=72 must be a multiple of 16 for hunyuanvideo1.5; use 64 or 80"),
    (dict(height=8), "height=8 must be a multiple of 16 for hunyuanvideo1.5; use 16 or 32"),
])
def test_frame_rule_and_size_grid_errors_name_the_fix(size, words, tiny_loaded):
    loaded = tiny_loaded(VARIANT)
    before = storage_map(loaded.pipe)
    with pytest.raises(ModelError) as error:
        sample(loaded, TIERS["block_swap:1"], request(**size), backend=CpuBackend())
    assert words in str(error.value)
    assert storage_map(loaded.pipe) == before


def test_the_planner_builds_the_real_models_on_meta_without_weights():
    """The 8.3B transformer (diffusers' HunyuanVideo-1.5 docs) and the shapes the pipeline makes."""
    from vidmem.memory.plan.types import VideoShape
    from vidmem.pipelines.configs import load_model

    for name in ("hunyuanvideo1.5-t2v-480p", "hunyuanvideo1.5-t2v-720p", "hunyuanvideo1.5-i2v-480p",
                 "hunyuanvideo1.5-i2v-720p"):
        model = load_model(name)
        transformer = model.module("transformer")
        assert all(p.device.type == "meta" for p in transformer.parameters())
        assert 8.0e9 < sum(p.numel() for p in transformer.parameters()) < 8.6e9
        image = "i2v" in name
        assert model.layout.placed_encoders == ("text_encoder", "text_encoder_2", "image_encoder")[: 3 if image else 2]
        assert model.layout.conditioning == (("image_encoder", "vae") if image else ())
        assert model.latent_shape(VideoShape(848, 480, 121)) == (1, 32, 31, 30, 53)
        assert model.forward_passes(VideoShape(848, 480, 121, cfg=True)) == 2
    with pytest.raises(ModelError, match="use 4k\\+1 frames"):
        load_model("hunyuanvideo1.5-t2v-480p").check_shape(VideoShape(848, 480, 120))


def test_the_planned_decode_is_the_staged_decode_vidmem_runs():
    """The planner traces the decode vidmem runs (pipelines/decode.py): the mid-block once on the whole latent,
    then each tile streamed a latent frame at a time. It traced `vae.decode` per piece, every frame of a tile at
    once with its own dense mask: 4x what runs here, and 64 px tiles chosen at 720p to escape it."""
    from vidmem.memory.accounting import Attention, trace
    from vidmem.memory.plan.planner import GiB, PlanOptions, VideoShape
    from vidmem.memory.plan.stages import _numel, decode_calls, decode_stage
    from vidmem.memory.plan.types import Call
    from vidmem.memory.vae import Streaming, decode_video
    from vidmem.pipelines.configs import MODELS_DIR, _from_json, load_model
    from vidmem.pipelines.json_files import read_json_object

    name, shape, tiling = "hunyuanvideo1.5-t2v-480p", VideoShape(320, 256, 33), VaeTiling()
    model = _from_json(read_json_object(MODELS_DIR / f"{name}.json", name), None, disk_cache=False)
    strategy = MemoryStrategy(vae_tiling=tiling)
    planned = decode_stage(model, shape, strategy, PlanOptions(device="cpu", attention=Attention.FUSED))
    pieces = [p for p in planned.phases if "frame-wide" not in p.label]
    assert len(pieces) < len(planned.phases)  # the mid-block's own phase, on the whole latent
    piece_peak = max(p.peak.allocated - sum(p.resident) for p in pieces)

    latent, vae = model.latent_shape(shape), model.module("vae")
    stages, geometry = model.spec.vae_stages(vae), model.geometry
    z = lambda: torch.empty(latent, dtype=model.dtype_of("vae"), device="meta")  # noqa: E731
    run = trace(lambda: decode_video(Streaming(stages.stream, stages.frame_batch), z(), geometry, tiling,
                                     prepare=stages.context, out_device="meta"), Attention.FUSED)
    host_side = 4 * 3 * geometry.frames(latent[2]) * shape.height * shape.width  # the float32 frames
    host_side += trace(lambda: stages.context(z()), Attention.FUSED).live_bytes  # the features, parked there
    assert abs(piece_peak - (run.peak_bytes - host_side)) < 0.1 * piece_peak

    largest = max((c for c, _ in decode_calls(model, shape, strategy) if c.kind == "decode_stream"),
                  key=lambda c: _numel(c.piece))
    whole_piece = model.trace(Call("decode", "vae", shape, largest.piece), Attention.FUSED).peak_bytes
    assert whole_piece > 3 * piece_peak and piece_peak < GiB
    assert load_model(name).vae_shared_context


def test_the_decode_never_tiles_below_tencents_128_px():
    """A 16x VAE's 64 px tile is 4 latent pixels; Tencent's pipeline decodes 128 px tiles at the least. The fallback
    ladder stops there (then shorter chunks, then the CPU), and a tile chosen below it is honoured with a warning."""
    from vidmem.memory.strategy import family_tiling
    from vidmem.memory.vae import VaeGeometry, fallback_rungs

    floor = HUNYUAN_VIDEO15.min_decode_tile
    rungs = fallback_rungs((1, 32, 31, 45, 80), VaeGeometry(16, 4, 32), None, stream_batch=1, min_tile=floor)
    tiles = [rung.tiling.tile_size for rung in rungs if rung.tiling is not None and not rung.on_cpu]
    assert floor == 128 and min(tiles) == 128
    assert family_tiling(VaeTiling(64, 16), floor, "hunyuanvideo1.5").warns


def test_vidmem_plan_gives_peaks_that_fall_with_the_tier(capsys):
    """On meta, from the shipped config: the streamed tiers need less than holding everything, and
    the denoise stage with everything held needs at least the transformer's bf16 weights."""
    from vidmem.cli import main
    from vidmem.pipelines.configs import load_model

    main(["plan", "--model", "hunyuanvideo1.5-t2v-480p", "--size", "256x256", "--frames", "9", "--vram", "16",
          "--ram", "64", "--json"])
    rows = {row["tier"]: row for row in json.loads(capsys.readouterr().out)["strategies"]}
    peaks = {tier: row["peak_vram_bytes"] for tier, row in rows.items()}
    assert peaks["sequential"] < peaks["block_swap"] < peaks["none"]
    assert rows["block_swap"]["blocks_to_swap"] > 0
    transformer = load_model("hunyuanvideo1.5-t2v-480p").module("transformer")
    assert rows["none"]["stages"]["denoise"] > sum(p.numel() * p.element_size() for p in transformer.parameters())


def test_cuda_backend_keeps_its_stream_order_for_hunyuan_video15(tiny_folder, monkeypatch):
    """The recording CUDA fake (tests/cuda_fake.py) on every tier: streamed copies on the side
    stream, waits per block, no device copy left behind, latents equal the CPU backend's."""
    from cuda_fake import FakeCuda
    from test_cuda_path import Audit, own_pipeline, points_at_a_device_copy, tiers
    from vidmem.memory.device import CudaBackend

    loaded = own_pipeline(tiny_folder, VARIANT)
    reference = sample(loaded, TIERS["none"], request('a sign that says "hi"'), backend=CpuBackend()).latent["samples"]
    for label, strategy in tiers(len(loaded.pipe.transformer.transformer_blocks)).items():
        with monkeypatch.context() as patch:
            fake = FakeCuda().install(patch)
            result = sample(loaded, strategy, request('a sign that says "hi"'), backend=CudaBackend(torch.device("cpu")),
                            observer=fake.observe)
        assert torch.equal(result.latent["samples"], reference), label
        assert not points_at_a_device_copy(loaded.pipe, fake), label
        audit = Audit(fake.log).run(strategy.prefetch_blocks)
        assert not audit.problems, f"{label}: " + "; ".join(audit.problems[:5])
