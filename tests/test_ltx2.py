"""LTX-2 as a family, video only: loaded from a diffusers folder without its audio VAE and vocoder,
sampled on every tier bit for bit as plain diffusers (with its audio parts) samples it, decoded
tiled, its bad input worded, and planned on meta."""

from __future__ import annotations

import json
import shutil

import diffusers
import pytest
import torch

from test_tiers import hooks_of, storage_map
from vidmem.memory import MemoryStrategy, VaeTiling
from vidmem.memory.device import CpuBackend
from vidmem.pipelines.decode import decode
from vidmem.pipelines.family import ModelError
from vidmem.pipelines.ltx2 import AUDIO_PARTS, LTX2, audio_error, pack_prompt, unpack_prompt
from vidmem.pipelines.sample import SampleRequest, sample
from vidmem.pipelines.tiny import tiny_call_kwargs, tiny_spec

VARIANT = "ltx2-t2v"
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
    """diffusers' own pipeline class on the same folder, audio VAE and vocoder loaded."""
    pipe = diffusers.LTX2Pipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    assert pipe.audio_vae is not None and pipe.vocoder is not None
    return pipe(**dict(tiny_call_kwargs(VARIANT, steps=STEPS), prompt=prompt, guidance_scale=cfg)).frames


def test_the_folder_loads_as_ltx2_without_its_audio_parts(tiny_loaded):
    loaded = tiny_loaded(VARIANT)
    assert loaded.spec is LTX2 and isinstance(loaded.pipe, diffusers.LTX2Pipeline)
    assert loaded.pipe.audio_vae is None and loaded.pipe.vocoder is None
    assert not loaded.needs_image
    assert "audio_vae" not in loaded.pipe.components or loaded.pipe.components["audio_vae"] is None


def test_every_tier_matches_plain_diffusers_bit_for_bit(tiny_loaded, tiny_folder):
    loaded = tiny_loaded(VARIANT)
    reference = plain_latents(tiny_folder(VARIANT))
    sample(loaded, TIERS["none"], request(steps=2), backend=CpuBackend())  # transformers adds its own hooks on first use
    before, hooks_before = storage_map(loaded.pipe), hooks_of(loaded.pipe)
    for label, strategy in TIERS.items():
        latent = sample(loaded, strategy, request(), backend=CpuBackend()).latent
        assert torch.equal(latent["samples"], reference), f"{label} differs from diffusers"
        assert latent["vidmem"]["family"] == "ltx2"
    assert storage_map(loaded.pipe) == before and hooks_of(loaded.pipe) == hooks_before
    assert loaded.pipe.audio_vae is None and loaded.pipe.vocoder is None  # never loaded, not even for a call


def test_image_to_video_from_the_same_folder_matches_plain_diffusers_on_every_tier(tiny_loaded, tiny_folder):
    """LTX-2 has one checkpoint for both: the text-to-video folder runs LTX2ImageToVideoPipeline."""
    from PIL import Image

    loaded = tiny_loaded(VARIANT).image_mode()
    assert loaded.class_name == "LTX2ImageToVideoPipeline" and loaded.needs_image and loaded.pipe.audio_vae is None
    plain = diffusers.LTX2ImageToVideoPipeline.from_pretrained(tiny_folder(VARIANT))
    plain.set_progress_bar_config(disable=True)
    grey = Image.new("RGB", (64, 64), (128, 128, 128))
    reference = plain(**tiny_call_kwargs(VARIANT, steps=STEPS), image=grey).frames
    image = torch.full((1, 64, 64, 3), 128 / 255)  # the same grey as a ComfyUI IMAGE
    for label, strategy in TIERS.items():
        latent = sample(loaded, strategy, request(image=image), backend=CpuBackend()).latent
        assert torch.equal(latent["samples"], reference), f"{label} differs from diffusers"
    with pytest.raises(ModelError, match="image-to-video: connect an IMAGE"):
        sample(loaded, TIERS["none"], request(), backend=CpuBackend())


def test_an_unguided_run_matches_plain_diffusers(tiny_loaded, tiny_folder):
    loaded = tiny_loaded(VARIANT)
    reference = plain_latents(tiny_folder(VARIANT), cfg=1.0)
    result = sample(loaded, TIERS["block_swap:1"], request(cfg=1.0), backend=CpuBackend())
    assert torch.equal(result.latent["samples"], reference)
    assert "negative_prompt" not in result.receipt["text_encode"]


def test_the_audio_latent_shape_comes_from_the_folders_config(tiny_folder, tmp_path):
    """Another audio geometry in audio_vae/config.json changes the audio tokens, and so the video:
    the stand-in reads the folder, not the pipeline's built-in defaults."""
    from vidmem.pipelines.loader import load_pipeline

    folder = tmp_path / "ltx2"
    shutil.copytree(tiny_folder(VARIANT), folder)
    config = folder / "audio_vae" / "config.json"
    values = json.loads(config.read_text())
    default = sample(load_pipeline(folder, "fp32"), TIERS["none"], request(), backend=CpuBackend()).latent["samples"]
    config.write_text(json.dumps(dict(values, sample_rate=8000)))  # half the audio tokens
    changed = sample(load_pipeline(folder, "fp32"), TIERS["none"], request(), backend=CpuBackend()).latent["samples"]
    assert not torch.equal(default, changed)


def test_a_folder_without_audio_weights_runs_video_and_refuses_audio(tiny_folder, tmp_path):
    """Video needs only audio_vae/config.json; without it the error names the file to copy."""
    from vidmem.pipelines.loader import load_pipeline

    folder = tmp_path / "ltx2"
    shutil.copytree(tiny_folder(VARIANT), folder)
    shutil.rmtree(folder / "vocoder")
    for weights in (folder / "audio_vae").glob("*.safetensors"):
        weights.unlink()
    loaded = load_pipeline(folder, "fp32")
    latent = sample(loaded, TIERS["model"], request(), backend=CpuBackend()).latent["samples"]
    assert torch.equal(latent, plain_latents(tiny_folder(VARIANT)))
    assert "no audio_vae or vocoder" in audio_error(loaded.pipe) and all(p in audio_error(loaded.pipe) for p in AUDIO_PARTS)
    (folder / "audio_vae" / "config.json").unlink()
    with pytest.raises(ModelError, match="copy audio_vae/config.json from the model's diffusers repository"):
        sample(load_pipeline(folder, "fp32"), TIERS["model"], request(), backend=CpuBackend())


def test_cached_prompt_embeddings_give_the_same_latents(tiny_loaded, tmp_path):
    """Gemma's stacked hidden states and mask go through the prompt cache as one tensor."""
    from vidmem.pipelines.hooks import RunHooks
    from vidmem.pipelines.prompt_cache import PromptCache

    loaded, hooks = tiny_loaded(VARIANT), RunHooks(prompt_cache=PromptCache(tmp_path))
    first = sample(loaded, TIERS["model"], request("a dog"), hooks=hooks, backend=CpuBackend())
    again = sample(loaded, TIERS["model"], request("a dog"), hooks=hooks, backend=CpuBackend())
    assert first.receipt["text_encode"]["cache"].startswith("encoded") and again.receipt["text_encode"]["cache"] == "used"
    assert torch.equal(first.latent["samples"], again.latent["samples"])


def test_cached_prompts_run_left_padded_whatever_padding_the_tokenizer_was_saved_with(tiny_folder, tmp_path):
    """LTX2Pipeline's encode pads Gemma's tokens on the left and its call tells the connectors the tokenizer's
    padding side; a cached prompt skips that encode, so a tokenizer saved with right padding (loaded fresh, as
    after a restart) would have the connectors unpad from the wrong end (0.7 off, tiny model)."""
    from vidmem.pipelines.hooks import RunHooks
    from vidmem.pipelines.loader import load_pipeline
    from vidmem.pipelines.prompt_cache import PromptCache

    folder = shutil.copytree(tiny_folder(VARIANT), tmp_path / "ltx2")
    config = folder / "tokenizer" / "tokenizer_config.json"
    config.write_text(json.dumps(dict(json.loads(config.read_text()), padding_side="right")))
    hooks = RunHooks(prompt_cache=PromptCache(tmp_path / "prompts"))
    encoded = sample(load_pipeline(folder, "fp32"), TIERS["none"], request(), hooks=hooks, backend=CpuBackend())
    fresh = load_pipeline(folder, "fp32")
    assert fresh.pipe.tokenizer.padding_side == "right"
    cached = sample(fresh, TIERS["none"], request(), hooks=hooks, backend=CpuBackend())
    assert cached.receipt["text_encode"]["cache"] == "used"
    assert torch.equal(cached.latent["samples"], encoded.latent["samples"])
    assert torch.equal(encoded.latent["samples"], plain_latents(folder))
    assert fresh.pipe.tokenizer.padding_side == "right"  # set for the call only


def test_packed_prompt_embeddings_unpack_to_the_same_bits():
    torch.manual_seed(0)
    embeds, mask = torch.randn(2, 7, 48), torch.randint(0, 2, (2, 7))
    unpacked, unpacked_mask = unpack_prompt(pack_prompt(embeds, mask))
    assert torch.equal(unpacked, embeds) and torch.equal(unpacked_mask, mask) and unpacked_mask.dtype == torch.int64


def test_a_video_only_call_decodes_video_and_gives_no_audio(tiny_loaded):
    loaded = tiny_loaded(VARIANT)
    output = loaded.pipe(**tiny_call_kwargs(VARIANT, steps=2, output_type="pt"))
    assert output.frames.shape == (1, 9, 3, 64, 64) and output.audio is None
    assert loaded.pipe.audio_vae is None and loaded.pipe.vocoder is None


def test_decode_equals_the_diffusers_pipeline(tiny_loaded, tiny_folder):
    plain = diffusers.LTX2Pipeline.from_pretrained(tiny_folder(VARIANT))
    plain.set_progress_bar_config(disable=True)
    expected = plain(**tiny_call_kwargs(VARIANT, steps=STEPS, output_type="pt")).frames[0]  # [F, C, H, W]
    loaded = tiny_loaded(VARIANT)
    latent = sample(loaded, TIERS["model"], request(), backend=CpuBackend()).latent
    frames = decode(loaded, latent, backend=CpuBackend()).frames
    assert torch.equal(frames, expected.permute(0, 2, 3, 1))


def _latent(frames: int = 5, height: int = 4, width: int = 8) -> dict:
    """A random latent of the tiny model: 5 x 4 x 8 decodes to 33 frames of 256x128."""
    return {"samples": torch.randn(1, 4, frames, height, width, generator=torch.Generator().manual_seed(0))}


def test_decode_tiled_in_space_stays_close_to_untiled(tiny_loaded):
    """Not exact: tiles are blended across their overlaps (LTX-2's VAE declares no staged decode:
    each piece runs vae.decode). Measured with these random weights at 192/32 px tiles (6 latent
    pixels sharing 1): mean error 0.033 on 0..1 pixels (0.051 at 128/32 px)."""
    loaded, latent = tiny_loaded(VARIANT), _latent()
    whole = decode(loaded, latent, backend=CpuBackend())
    tiled = decode(loaded, latent, MemoryStrategy(vae_tiling=VaeTiling(192, 32, 512, 8)), backend=CpuBackend())
    assert tiled.receipt["decode"]["tiles"] > 1 and tiled.receipt["decode"]["chunks"] == 1
    assert tiled.frames.shape == whole.frames.shape == (33, 128, 256, 3)
    assert 0 < (tiled.frames - whole.frames).abs().mean() < 0.05


def test_decode_chunked_in_time_stays_near_untiled(tiny_loaded):
    """Not exact either, and further off than space: chunks of 2 new latent frames with 1 frame of
    context, each decoded by vae.decode, see one frame of what came before (the decoder is not causal:
    LTX-2.0 sets decoder_causal false, and so does the tiny one).
    Measured: mean error 0.077 on 0..1 pixels (max 0.82). No streamed decode can make chunks exact
    here (the decoder reads frames on both sides of a chunk); more temporal overlap brings them closer."""
    loaded, latent = tiny_loaded(VARIANT), _latent()
    whole = decode(loaded, latent, backend=CpuBackend())
    chunked = decode(loaded, latent, MemoryStrategy(vae_tiling=VaeTiling(1024, 0, 16, 8)), backend=CpuBackend())
    assert chunked.receipt["decode"]["tiles"] == 1 and chunked.receipt["decode"]["chunks"] == 3
    assert 0 < (chunked.frames - whole.frames).abs().mean() < 0.1


@pytest.mark.parametrize("size, words", [
    (dict(frames=10), "frames=10 is not valid for ltx2: use 8k+1 frames (e.g. 9 or 17)"),
    (dict(width=80), "width=80 must be a multiple of 32 for ltx2; use 64 or 96"),
    (dict(height=16), "height=16 must be a multiple of 32 for ltx2; use 32 or 64"),
])
def test_frame_rule_and_size_grid_errors_name_the_fix(size, words, tiny_loaded):
    loaded = tiny_loaded(VARIANT)
    before = storage_map(loaded.pipe)
    with pytest.raises(ModelError) as error:
        sample(loaded, TIERS["block_swap:1"], request(**size), backend=CpuBackend())
    assert words in str(error.value)
    assert storage_map(loaded.pipe) == before


def test_the_planner_builds_the_real_model_on_meta_without_weights():
    """The 19B audio-video transformer (Lightricks' LTX-2) and Gemma 3 12B; no audio VAE, no vocoder."""
    from vidmem.memory.plan.types import VideoShape
    from vidmem.pipelines.configs import load_model

    assert load_model("ltx2-i2v-19b").layout.conditioning == ("vae",)  # the image's latent
    model = load_model("ltx2-t2v-19b")
    transformer = model.module("transformer")
    assert all(p.device.type == "meta" for p in transformer.parameters())
    assert 18.5e9 < sum(p.numel() for p in transformer.parameters()) < 19.5e9
    assert 11.5e9 < sum(p.numel() for p in model.module("text_encoder").parameters()) < 12.5e9
    assert not set(AUDIO_PARTS) & set(model.components)
    assert model.layout.placed_encoders == ("text_encoder", "connectors") and model.layout.call_encoders == ("connectors",)
    assert model.latent_shape(VideoShape(768, 512, 121)) == (1, 128, 16, 16, 24)
    assert model.forward_passes(VideoShape(768, 512, 121, cfg=True)) == 1  # cfg as one batch of two
    with pytest.raises(ModelError, match="use 8k\\+1 frames"):
        model.check_shape(VideoShape(768, 512, 120))
    with pytest.raises(ModelError, match="must be a multiple of 32"):
        model.check_shape(VideoShape(760, 512, 121))


def test_vidmem_plan_gives_peaks_that_fall_with_the_tier(capsys):
    """On meta, from the shipped config: the streamed tiers need less than holding everything, and
    the denoise stage with everything held needs at least the transformer's bf16 weights."""
    from vidmem.cli import main
    from vidmem.pipelines.configs import load_model

    main(["plan", "--model", "ltx2-t2v-19b", "--size", "256x256", "--frames", "9", "--vram", "16", "--ram", "64",
          "--json"])
    rows = {row["tier"]: row for row in json.loads(capsys.readouterr().out)["strategies"]}
    peaks = {tier: row["peak_vram_bytes"] for tier, row in rows.items()}
    assert peaks["sequential"] < peaks["block_swap"] < peaks["none"]
    assert rows["block_swap"]["blocks_to_swap"] > 0
    transformer = load_model("ltx2-t2v-19b").module("transformer")
    assert rows["none"]["stages"]["denoise"] > sum(p.numel() * p.element_size() for p in transformer.parameters())


def test_out_of_memory_resumes_video_and_audio_from_the_last_step(tiny_loaded):
    """The audio latents resume with the video's (recorded each step): a fresh audio draw at the
    resume would change the video through the blocks' cross-attention (max 0.09 off, tiny model)."""
    from test_oom_ladder import InjectOOM, block_count, run
    from vidmem.pipelines.ltx2_audio import AUDIO_KEY
    from vidmem.pipelines.sample_ladder import fixed_ladder

    loaded, steps = tiny_loaded(VARIANT), 4
    reference = run(loaded, fixed_ladder(MemoryStrategy(), block_count(loaded))[0], request(steps=steps)).latent
    with InjectOOM(loaded.pipe.transformer.transformer_blocks[-1], [2]) as oom:  # step 3: cfg is one batch
        result = run(loaded, MemoryStrategy(offload="model"), request(steps=steps))
    assert oom.raised == 1 and result.receipt["oom_ladder"][0]["resumed_from_step"] == 1
    assert torch.equal(result.latent["samples"], reference["samples"])
    assert torch.equal(result.latent[AUDIO_KEY], reference[AUDIO_KEY])
    assert "dropped" not in result.latent["vidmem"]["audio"]


def test_the_disk_tier_and_fp8_storage_run_the_family(tiny_loaded, tiny_folder):
    """Gemma 3's files name its weights as transformers saves them (`language_model.model.*`), not as
    its module holds them (`model.language_model.*`): read in place (weight_dtype), they take
    transformers' own renames. Used in place, the latents are the loaded pipeline's; fp8 runs finite."""
    from vidmem.pipelines.folder_storage import module_names
    from vidmem.pipelines.loader import load_pipeline

    reference = sample(tiny_loaded(VARIANT), TIERS["block_swap:1"], request(), backend=CpuBackend()).latent["samples"]
    on_disk = load_pipeline(tiny_folder(VARIANT), "fp32", weight_dtype="fp32")
    assert on_disk.on_disk and set(on_disk.storage) == {"transformer", "text_encoder"}
    assert torch.equal(sample(on_disk, TIERS["block_swap:1"], request(), backend=CpuBackend()).latent["samples"], reference)
    fp8 = load_pipeline(tiny_folder(VARIANT), "fp32", weight_dtype="fp8_scaled")
    latent = sample(fp8, TIERS["sequential"], request(), backend=CpuBackend()).latent["samples"]
    assert fp8.storage["text_encoder"] == "fp8_scaled" and torch.isfinite(latent).all()
    gemma = tiny_loaded(VARIANT).pipe.text_encoder
    saved = {"language_model.model.norm.weight": None, "model.language_model.norm.weight": None}
    assert set(module_names(gemma, saved)) == {"model.language_model.norm.weight"}


# --- the family's decode tile (FamilySpec.min_decode_tile) -----------------------------------------

def _wide_latent() -> dict:
    """2 x 20 x 24 latent pixels: 9 frames of 640x768, several 512 px tiles and many 256 px ones."""
    return _latent(frames=2, height=20, width=24)


def test_a_default_tiling_is_raised_to_the_familys_tile_and_the_receipt_says_so(tiny_loaded):
    """LTX-2's 32x VAE sees 8 latent pixels in a 256 px tile: the strategy's default tile becomes
    the family's 512 px (overlap scaled to 64), the tile an explicit 512/64 decodes with, bit for bit."""
    loaded, latent = tiny_loaded(VARIANT), _wide_latent()
    assert LTX2.min_decode_tile == 512
    default = decode(loaded, latent, MemoryStrategy(vae_tiling=VaeTiling()), backend=CpuBackend())
    chosen = decode(loaded, latent, MemoryStrategy(vae_tiling=VaeTiling(512, 64)), backend=CpuBackend())
    assert torch.equal(default.frames, chosen.frames)
    assert default.receipt["decode"]["tiles"] == chosen.receipt["decode"]["tiles"] == 4
    assert "default tile 256/32 px raised to 512/64 px" in default.receipt["tiling_note"]
    assert "tiling_note" not in chosen.receipt
    untiled = decode(loaded, latent, backend=CpuBackend())  # no tiling stays no tiling
    assert untiled.receipt["decode"]["tiles"] == 1 and "tiling_note" not in untiled.receipt


def test_a_tile_chosen_below_the_familys_is_honoured_with_a_warning(tiny_loaded, caplog):
    loaded, latent = tiny_loaded(VARIANT), _wide_latent()
    small = decode(loaded, latent, MemoryStrategy(vae_tiling=VaeTiling(288, 32)), backend=CpuBackend())
    raised = decode(loaded, latent, MemoryStrategy(vae_tiling=VaeTiling()), backend=CpuBackend())
    assert small.receipt["decode"]["tiles"] > raised.receipt["decode"]["tiles"]
    assert small.receipt["tiling_note"].startswith("warning: tile_size 288 is below 512 px, ltx2's smallest tile")
    assert any("tile_size 288 is below 512 px" in r.getMessage() for r in caplog.records)



def test_the_decode_ladder_is_given_the_familys_smallest_tile(tiny_loaded, monkeypatch):
    """Its fallback rungs then never halve an LTX-2 tile below 512 px (tests/test_vae_tiling.py)."""
    from vidmem.pipelines import decode as decode_module

    given, original = [], decode_module.decode_with_fallback
    monkeypatch.setattr(decode_module, "decode_with_fallback",
                        lambda *args, **kwargs: (given.append(kwargs.get("min_tile")), original(*args, **kwargs))[1])
    decode(tiny_loaded(VARIANT), _wide_latent(), MemoryStrategy(vae_tiling=VaeTiling()), backend=CpuBackend())
    assert given == [512]


def test_the_planner_plans_the_tile_the_decode_runs():
    """The planner resolves the default tile with the same rule: LTX-2's default plans 512 px
    pieces (as an explicit 512/64), Wan's (no family minimum) stays at 256 px."""
    from vidmem.memory.plan.stages import piece_counts
    from vidmem.memory.plan.types import VideoShape
    from vidmem.pipelines.configs import load_model

    shape = VideoShape(768, 512, 9)
    pieces = lambda model, tiling: piece_counts(model, shape, MemoryStrategy(vae_tiling=tiling))  # noqa: E731
    ltx2 = load_model("ltx2-t2v-19b")
    assert ltx2.vae_min_tile == 512
    assert pieces(ltx2, VaeTiling()) == pieces(ltx2, VaeTiling(512, 64)) != pieces(ltx2, VaeTiling(288, 32))
    wan = load_model("wan2.1-t2v-1.3b")
    assert wan.vae_min_tile == 0 and pieces(wan, VaeTiling()) != pieces(wan, VaeTiling(512, 64))


def test_the_family_tiling_rule():
    from vidmem.memory.strategy import family_tiling

    assert family_tiling(None, 512).tiling is None
    assert family_tiling(VaeTiling(), 0).tiling == VaeTiling() and not family_tiling(VaeTiling(), 0).note
    assert family_tiling(VaeTiling(), 512).tiling == VaeTiling(512, 64)
    assert family_tiling(VaeTiling(), 384).tiling == VaeTiling(384, 48)
    only_temporal = family_tiling(VaeTiling(256, 32, 32, 8), 512)  # the user chose the frames, not the tile
    assert only_temporal.tiling == VaeTiling(512, 64, 32, 8) and not only_temporal.warns
    small = family_tiling(VaeTiling(224, 32), 512)  # a tile chosen below the minimum: honoured, with a warning
    assert small.tiling == VaeTiling(224, 32) and small.warns and "224" in small.note
    assert not family_tiling(VaeTiling(), 512).warns and "raised" in family_tiling(VaeTiling(), 512).note
    assert family_tiling(VaeTiling(768, 64), 512).tiling == VaeTiling(768, 64)
