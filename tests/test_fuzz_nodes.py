"""Fuzz the nodes as ComfyUI runs them (its prompt validation, then the node's function) with bad
inputs: each is refused by ComfyUI's own validation (tests/fuzz_support.py mirrors it) or by the
node with an error of the pack's own type whose message names the input; and nothing is left
behind: no file, no hook, no weight off its original storage.

Cases that fail today because the fix belongs to a file another helper owns are marked
`xfail(strict=True)` naming the owner, so they turn into passes (and the mark must go) when fixed.
"""

from __future__ import annotations

import re

import pytest
import torch

from fuzz_support import PACK_ERRORS, Case, Fixtures, comfy_refusal, sampler_inputs, strategy_widgets, tree
from test_tiers import hooks_of, storage_map
from vidmem.nodes import NODE_CLASS_MAPPINGS

NAN, INF = float("nan"), float("inf")


def S(**changes):  # Strategy node inputs
    return lambda fx: strategy_widgets(**changes)


def K(variant="wan2.1-t2v", **changes):  # Sampler inputs
    return lambda fx: sampler_inputs(fx, variant, **changes)


def C(**changes):  # Step Cache inputs
    widgets = dict(method="mag_cache", threshold=0.0, retention=0.2, max_skip_steps=3, mag_ratios="auto")
    return lambda fx: {**widgets, **changes}


def SP(**changes):  # Speed inputs
    widgets = dict(attention="auto", compile=False, compile_mode="default", compile_dynamic="auto", fp8_matmul="auto")
    return lambda fx: {**widgets, **changes}


def speed(**changes):
    """The Speed node's output, as the Sampler's speed input receives it."""
    return NODE_CLASS_MAPPINGS["VidMemSpeed"]().build(**SP(**changes)(None))["result"][0]


def step_cache(method="mag_cache", mag_ratios="auto", **taylor):
    """The Step Cache node's output, as the Sampler's cache input receives it."""
    node = NODE_CLASS_MAPPINGS["VidMemStepCache"]()
    return node.build(method, 0.0, 0.2, 3, mag_ratios, **taylor)["result"][0]


def latent_with(samples=None, variant="wan2.1-t2v", **extra):
    def build(fx):
        latent = dict(fx.latent(variant)) if samples is None else {"samples": samples(fx)}
        latent.update(extra)
        return latent

    return build


def D(latent, variant="wan2.1-t2v", **changes):  # Decode inputs
    return lambda fx: {"pipeline": fx.pipeline(variant), "latent": latent(fx), **changes}


def nan_latent(fx):
    samples = fx.latent()["samples"].clone()
    samples.view(-1)[3] = NAN
    return samples


def inf_latent(fx):
    samples = fx.latent()["samples"].clone()
    samples.view(-1)[-1] = -INF
    return samples


def image(fill=0.5, shape=(1, 32, 32, 3)):
    return lambda fx: torch.full(shape, fill)


def clips(*files: tuple[str, bytes | None]):
    """A training folder under the fixtures' root holding `files` (name, bytes; None: a small image)."""
    def build(fx):
        folder = fx.root / "clips"
        folder.mkdir(exist_ok=True)
        for name, data in files:
            if data is None:
                from PIL import Image

                Image.new("RGB", (48, 48), (90, 120, 200)).save(folder / name)
            else:
                (folder / name).write_bytes(data)
        return folder

    return build


def P(files=(("a.png", None), ("a.txt", b"a blue square")), variant="wan2.1-t2v", **changes):  # Prepare inputs
    def build(fx):
        from vidmem.pipelines.tiny import tiny_spec

        spec = tiny_spec(variant)
        inputs = dict(pipeline=fx.pipeline(variant), strategy=fx.strategy(), folder=str(clips(*files)(fx)),
                      resolutions=f"{spec.width}x{spec.height}", frame_buckets="1")
        return {**inputs, **changes}

    return build


def prepared(fx, variant="wan2.1-t2v"):
    """Training data prepared by the node from one tiny image (before the case's snapshot)."""
    inputs = P(variant=variant)(fx)
    return NODE_CLASS_MAPPINGS["VidMemPrepareTrainingData"]().prepare(**inputs)["result"][0]


def T(variant="wan2.1-t2v", **changes):  # Train LoRA inputs
    def build(fx):
        inputs = dict(pipeline=fx.pipeline(variant), data=prepared(fx, variant), strategy=fx.strategy(),
                      lora_name="fuzz_lora", rank=4, alpha=4.0, learning_rate=1e-4, steps=1, batch_size=1, seed=0,
                      target_modules="to_q,to_k,to_v,to_out.0", gradient_checkpointing=True, optimizer="adamw",
                      checkpoint_every=0, resume=False, expert="both")
        return {**inputs, **changes}

    return build


CASES = [
    # --- Memory Strategy: ComfyUI's own checks (VALIDATE_INPUTS names tile_size and the floats only) -----
    Case("strategy-offload-unknown", "VidMemMemoryStrategy", S(offload="swap"), "Value not in list: offload"),
    Case("strategy-offload-case", "VidMemMemoryStrategy", S(offload="Block_Swap"), "Value not in list: offload"),
    Case("strategy-text-encoder-gpu", "VidMemMemoryStrategy", S(text_encoder="gpu"), "Value not in list: text_encoder"),
    Case("strategy-blocks-negative", "VidMemMemoryStrategy", S(blocks_to_swap=-1), "smaller than min of 0: blocks_to_swap"),
    Case("strategy-blocks-too-many", "VidMemMemoryStrategy", S(blocks_to_swap=101), "bigger than max of 100: blocks_to_swap"),
    Case("strategy-blocks-text", "VidMemMemoryStrategy", S(blocks_to_swap="many"), "convert an input value to a INT value: blocks_to_swap"),
    Case("strategy-blocks-nan", "VidMemMemoryStrategy", S(blocks_to_swap=NAN), "convert an input value to a INT value"),
    Case("strategy-prefetch-negative", "VidMemMemoryStrategy", S(prefetch_blocks=-1), "smaller than min of 0: prefetch_blocks"),
    Case("strategy-prefetch-too-many", "VidMemMemoryStrategy", S(prefetch_blocks=9), "bigger than max of 8: prefetch_blocks"),
    Case("strategy-pinned-inf", "VidMemMemoryStrategy", S(max_pinned_ram_gb=INF), "max_pinned_ram_gb=inf is not a finite number"),
    Case("strategy-pinned-minus-inf", "VidMemMemoryStrategy", S(max_pinned_ram_gb=-INF), "max_pinned_ram_gb=-inf is not a finite"),
    Case("strategy-pinned-too-much", "VidMemMemoryStrategy", S(max_pinned_ram_gb=2000.0), "max_pinned_ram_gb=2000.0 must be from -1.0 to 1024.0"),
    Case("strategy-pinned-text", "VidMemMemoryStrategy", S(max_pinned_ram_gb="lots"), "convert an input value to a FLOAT"),
    Case("strategy-overlap-negative", "VidMemMemoryStrategy", S(vae_tiling=True, overlap=-8), "smaller than min of 0: overlap"),
    Case("strategy-temporal-size-small", "VidMemMemoryStrategy", S(vae_tiling=True, temporal_size=4), "smaller than min of 8"),
    Case("strategy-vram-budget-negative", "VidMemMemoryStrategy", S(vram_budget_gb=-1.0), "vram_budget_gb=-1.0 must be from 0.0 to 1024.0"),
    Case("strategy-ram-budget-inf", "VidMemMemoryStrategy", S(ram_budget_gb=INF), "ram_budget_gb=inf is not a finite number"),
    Case("strategy-missing-offload", "VidMemMemoryStrategy",
         lambda fx: {k: v for k, v in strategy_widgets().items() if k != "offload"}, "Required input is missing: offload"),
    # --- Memory Strategy: VALIDATE_INPUTS and build() ---------------------------------------------------
    Case("strategy-tile-not-multiple", "VidMemMemoryStrategy", S(vae_tiling=True, tile_size=100), "tile_size=100 must be a multiple of 32"),
    Case("strategy-tile-too-small", "VidMemMemoryStrategy", S(tile_size=32), "tile_size=32 must be a whole number of pixels from 64"),
    Case("strategy-tile-too-big", "VidMemMemoryStrategy", S(tile_size=8192), "tile_size=8192 must be"),
    Case("strategy-pinned-nan", "VidMemMemoryStrategy", S(max_pinned_ram_gb=NAN), "max_pinned_ram_gb=nan is not a finite number"),
    Case("strategy-pinned-negative", "VidMemMemoryStrategy", S(max_pinned_ram_gb=-0.5), r"max_pinned_ram_gb=-0.5 must be -1 \(automatic\), 0"),
    Case("strategy-swap-without-blocks", "VidMemMemoryStrategy", S(offload="block_swap"), "needs blocks_to_swap >= 1"),
    # (blocks_to_swap under another tier, or with auto, is ignored with a note: tests/test_nodes.py)
    Case("strategy-overlap-not-multiple", "VidMemMemoryStrategy", S(vae_tiling=True, overlap=12), "overlap=12 must be a multiple of 8"),
    Case("strategy-overlap-too-wide", "VidMemMemoryStrategy", S(vae_tiling=True, overlap=128), "overlap=128 must be between 0 and tile_size/4"),
    Case("strategy-temporal-not-multiple", "VidMemMemoryStrategy", S(vae_tiling=True, temporal_size=10), "temporal_size=10 must be a multiple of 4"),
    Case("strategy-temporal-overlap-wide", "VidMemMemoryStrategy", S(vae_tiling=True, temporal_overlap=40), "temporal_overlap=40 must be between"),
    Case("strategy-temporal-overlap-odd", "VidMemMemoryStrategy", S(vae_tiling=True, temporal_overlap=6), "temporal_overlap=6 must be a multiple of 4"),
    Case("strategy-vram-budget-nan", "VidMemMemoryStrategy", S(vram_budget_gb=NAN), "vram_budget_gb"),
    Case("strategy-ram-budget-nan", "VidMemMemoryStrategy", S(ram_budget_gb=NAN), "ram_budget_gb"),
    # --- Video Sampler: ComfyUI's own checks and VALIDATE_INPUTS (frames, width, height, the floats) ------
    Case("sampler-width-below-min", "VidMemVideoSampler", K(width=8), "width=8 must be from 16 to 4096"),
    Case("sampler-width-above-max", "VidMemVideoSampler", K(width=5000), "width=5000 must be from 16 to 4096", validation_only=True),
    Case("sampler-height-text", "VidMemVideoSampler", K(height="tall"), "convert an input value to a INT value: height"),
    Case("sampler-steps-zero", "VidMemVideoSampler", K(steps=0), "smaller than min of 1: steps"),
    Case("sampler-steps-huge", "VidMemVideoSampler", K(steps=1001), "bigger than max of 1000: steps"),
    Case("sampler-steps-nan", "VidMemVideoSampler", K(steps=NAN), "convert an input value to a INT value: steps"),
    Case("sampler-cfg-inf", "VidMemVideoSampler", K(cfg=INF), "cfg=inf is not a finite number", validation_only=True),
    Case("sampler-cfg-negative", "VidMemVideoSampler", K(cfg=-1.0), "cfg=-1.0 must be from 0.0 to 30.0"),
    Case("sampler-cfg-text", "VidMemVideoSampler", K(cfg="high"), "convert an input value to a FLOAT value: cfg"),
    Case("sampler-seed-negative", "VidMemVideoSampler", K(seed=-1), "smaller than min of 0: seed"),
    Case("sampler-seed-65-bits", "VidMemVideoSampler", K(seed=2**64), "bigger than max of 18446744073709551615: seed"),
    Case("sampler-missing-pipeline", "VidMemVideoSampler",
         lambda fx: {k: v for k, v in sampler_inputs(fx).items() if k != "pipeline"}, "Required input is missing: pipeline"),
    Case("sampler-frames-not-4k1", "VidMemVideoSampler", K(frames=50), "frames=50 is not valid for any model vidmem runs"),
    Case("sampler-frames-zero", "VidMemVideoSampler", K(frames=0), "frames=0 must be a whole number of frames from 1 to 1025"),
    Case("sampler-frames-over-max", "VidMemVideoSampler", K(frames=2001), "frames=2001", validation_only=True),
    Case("sampler-cfg-nan", "VidMemVideoSampler", K(cfg=NAN), "cfg=nan is not a finite number", validation_only=True),
    Case("sampler-shift-inf", "VidMemVideoSampler", K(shift=INF), "shift=inf is not a finite number", validation_only=True),
    Case("sampler-cfg2-nan", "VidMemVideoSampler", K("wan2.2-a14b", cfg_2=NAN), "cfg_2=nan is not a finite number",
         validation_only=True),
    Case("sampler-width-not-multiple", "VidMemVideoSampler", K(width=40), "width=40 must be a multiple of 16 for every model",
         validation_only=True),
    Case("sampler-height-not-multiple", "VidMemVideoSampler", K(height=24), "height=24 must be a multiple of 16",
         validation_only=True),
    # --- Video Sampler: the engine (pipelines/sample.py validate_request), checked first when the node runs --
    Case("sampler-beyond-positional-table", "VidMemVideoSampler", K(width=832, height=480),
         "width=832 is more than .* can place: its positional embedding covers 32 patches of 16 px .*use width 512 or less"),
    Case("sampler-ti2v-width-32", "VidMemVideoSampler", K("wan2.2-ti2v", width=48), "width=48 must be a multiple of 32"),
    Case("sampler-cogvideox-frames-8k1", "VidMemVideoSampler", K("cogvideox-t2v", frames=13), "frames=13 is not valid for cogvideox"),
    Case("sampler-t2v-given-image", "VidMemVideoSampler", lambda fx: sampler_inputs(fx, image=image()(fx)),
         "text-to-video: disconnect the image input"),
    Case("sampler-i2v-without-image", "VidMemVideoSampler", K("wan2.1-i2v"), "image-to-video: connect an IMAGE"),
    Case("sampler-image-nan", "VidMemVideoSampler", lambda fx: sampler_inputs(fx, "wan2.1-i2v", image=image(NAN)(fx)),
         "image contains NaN or infinite pixels"),
    Case("sampler-image-inf", "VidMemVideoSampler", lambda fx: sampler_inputs(fx, "wan2.1-i2v", image=image(INF)(fx)),
         "image contains NaN or infinite pixels"),
    Case("sampler-image-3d", "VidMemVideoSampler",
         lambda fx: sampler_inputs(fx, "wan2.1-i2v", image=image(shape=(32, 32, 3))(fx)), r"image has shape \(32, 32, 3\)"),
    Case("sampler-image-channels", "VidMemVideoSampler",
         lambda fx: sampler_inputs(fx, "wan2.1-i2v", image=image(shape=(1, 32, 32, 2))(fx)), "expected a ComfyUI IMAGE"),
    Case("sampler-image-empty-batch", "VidMemVideoSampler",
         lambda fx: sampler_inputs(fx, "wan2.1-i2v", image=image(shape=(0, 32, 32, 3))(fx)), "expected a ComfyUI IMAGE"),
    Case("sampler-swap-more-blocks-than-model", "VidMemVideoSampler",
         lambda fx: sampler_inputs(fx, strategy=fx.strategy(offload="block_swap", blocks_to_swap=99)),
         "blocks_to_swap=99 but this model's transformer has 2 blocks"),
    Case("sampler-strategy-not-a-strategy", "VidMemVideoSampler", K(strategy="fast"),
         r"strategy \(Video Sampler\) got a str \('fast'\), not a Memory Strategy"),
    Case("sampler-strategy-none", "VidMemVideoSampler", K(strategy=None), r"strategy \(Video Sampler\) got nothing \(None\)"),
    Case("sampler-strategy-latent", "VidMemVideoSampler", lambda fx: sampler_inputs(fx, strategy=fx.latent()),
         r"strategy \(Video Sampler\) got a LATENT \(a dict with 'samples'"),
    Case("sampler-pipeline-none", "VidMemVideoSampler", K(pipeline=None), r"pipeline \(Video Sampler\) got nothing \(None\)"),
    Case("sampler-pipeline-latent", "VidMemVideoSampler", lambda fx: sampler_inputs(fx, pipeline=fx.latent()),
         r"pipeline \(Video Sampler\) got a LATENT \(a dict with 'samples', 'vidmem'\), not a vidmem pipeline"),
    Case("sampler-pipeline-strategy", "VidMemVideoSampler", lambda fx: sampler_inputs(fx, pipeline=fx.strategy()),
         r"pipeline \(Video Sampler\) got a StrategyChoice"),
    # --- Step Cache, and the Sampler's cache input ------------------------------------------------------------
    Case("cache-method-unknown", "VidMemStepCache", C(method="teacache"), "Value not in list: method"),
    Case("cache-threshold-nan", "VidMemStepCache", C(threshold=NAN), "threshold=nan is not a finite number"),
    Case("cache-threshold-too-high", "VidMemStepCache", C(threshold=2.0), "threshold=2.0 must be from 0.0 to 1.0"),
    Case("cache-retention-negative", "VidMemStepCache", C(retention=-0.1), "retention=-0.1 must be from 0.0 to 1.0"),
    Case("cache-max-skip-zero", "VidMemStepCache", C(max_skip_steps=0), "smaller than min of 1: max_skip_steps"),
    Case("cache-ratios-file-absent", "VidMemStepCache", C(mag_ratios="elsewhere.json"), "Value not in list: mag_ratios"),
    Case("speed-attention-unknown", "VidMemSpeed", SP(attention="fastest"), "attention='fastest' is not one of"),
    Case("speed-attention-sage-not-here", "VidMemSpeed", SP(attention="sage"), "attention='sage' cannot run here",
         marks=(pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA refuses sage"),)),
    Case("speed-compile-cuda-graphs", "VidMemSpeed", SP(compile_mode="reduce-overhead"), "Value not in list: compile_mode"),
    Case("speed-fp8-maybe", "VidMemSpeed", SP(fp8_matmul="maybe"), "Value not in list: fp8_matmul"),
    Case("sampler-speed-not-a-speed", "VidMemVideoSampler", K(speed="fast"), r"speed \(Video Sampler\) got"),
    Case("sampler-fp8-matmul-on-without-fp8-layers", "VidMemVideoSampler", lambda fx: sampler_inputs(fx, speed=speed(
         fp8_matmul="on")), "fp8_matmul='on' cannot run here"),
    Case("sampler-cache-not-a-cache", "VidMemVideoSampler", K(cache="fast"),
         r"cache \(Video Sampler\) got a str \('fast'\), not a step cache"),
    Case("sampler-cache-latent", "VidMemVideoSampler", lambda fx: sampler_inputs(fx, cache=fx.latent()),
         r"cache \(Video Sampler\) got a LATENT"),
    Case("sampler-cache-no-published-ratios", "VidMemVideoSampler", lambda fx: sampler_inputs(fx, cache=step_cache()),
         "mag_ratios 'auto': no published MagCache ratios for WanPipeline"),
    Case("sampler-cache-taylor-seer-nothing-to-predict", "VidMemVideoSampler",  # the fuzz Sampler runs 1 step
         lambda fx: sampler_inputs(fx, cache=step_cache("taylor_seer", warmup_steps=1)),
         "warmup_steps=1 and end_steps=0, which leave nothing to predict in 1 steps"),
    Case("sampler-cache-first-block-one-block", "VidMemVideoSampler",
         lambda fx: sampler_inputs(fx, "cogvideox-t2v", cache=step_cache("first_block_cache")),
         "first_block_cache decides after the first block"),
    # --- Video Sampler: the sampler controls --------------------------------------------------------------
    Case("sampler-flow-euler-on-cogvideox", "VidMemVideoSampler", K("cogvideox-t2v", scheduler="flow_match_euler"), "scheduler"),
    Case("sampler-scheduler-unknown", "VidMemVideoSampler", K(scheduler="euler_a"), "Value not in list: scheduler"),
    Case("sampler-shift-on-cogvideox", "VidMemVideoSampler", K("cogvideox-t2v", shift=3.0), "shift"),
    Case("sampler-shift-nan", "VidMemVideoSampler", K(shift=NAN), "shift"),
    Case("sampler-cfg2-on-one-expert", "VidMemVideoSampler", K(cfg_2=3.0), "cfg_2"),
    Case("sampler-boundary-nan", "VidMemVideoSampler", K("wan2.2-a14b", boundary_ratio=NAN), "boundary_ratio"),
    Case("sampler-boundary-on-one-expert", "VidMemVideoSampler", K(boundary_ratio=0.5), "boundary_ratio"),
    # --- Video VAE Decode ----------------------------------------------------------------------------------
    Case("decode-latent-no-samples", "VidMemVAEDecode", D(lambda fx: {"noise": 1}), "samples"),
    Case("decode-latent-not-a-dict", "VidMemVAEDecode", D(lambda fx: "a latent"), "str"),
    Case("decode-latent-none", "VidMemVAEDecode", D(lambda fx: None), "NoneType"),
    Case("decode-samples-list", "VidMemVAEDecode", D(lambda fx: {"samples": [[1.0]]}), "samples"),
    Case("decode-image-latent-4d", "VidMemVAEDecode", D(lambda fx: {"samples": torch.zeros(1, 16, 4, 4)}), r"\(1, 16, 4, 4\)"),
    Case("decode-wrong-channels", "VidMemVAEDecode", D(lambda fx: {"samples": torch.zeros(1, 4, 2, 4, 4)}), "latent has 4 channels"),
    Case("decode-other-family", "VidMemVAEDecode", D(latent_with(variant="wan2.1-t2v"), "cogvideox-t2v"),
         "latent came from a wan model but the pipeline is cogvideox"),
    Case("decode-latent-nan", "VidMemVAEDecode", D(latent_with(nan_latent)), "latent contains 1 NaN or infinite values"),
    Case("decode-latent-inf", "VidMemVAEDecode", D(latent_with(inf_latent)), "latent contains 1 NaN or infinite values"),
    Case("decode-latent-empty", "VidMemVAEDecode", D(lambda fx: {"samples": torch.zeros(1, 16, 0, 4, 4)}), "not a video latent"),
    Case("decode-latent-integers", "VidMemVAEDecode", D(lambda fx: {"samples": torch.zeros(1, 16, 2, 4, 4, dtype=torch.int32)}),
         "dtype torch.int32"),
    Case("decode-strategy-not-a-strategy", "VidMemVAEDecode", D(latent_with(), strategy=42),
         r"strategy \(Video VAE Decode\) got a int \(42\), not a Memory Strategy"),
    Case("decode-pipeline-none", "VidMemVAEDecode", lambda fx: {"pipeline": None, "latent": fx.latent()},
         r"pipeline \(Video VAE Decode\) got nothing \(None\)"),
    Case("decode-pipeline-latent", "VidMemVAEDecode", lambda fx: {"pipeline": fx.latent(), "latent": fx.latent()},
         r"pipeline \(Video VAE Decode\) got a LATENT"),
    Case("decode-no-samples-saving", "VidMemVAEDecode", D(lambda fx: {"noise": 1}, save_latents=True), "samples"),
    Case("decode-4d-saving", "VidMemVAEDecode", D(lambda fx: {"samples": torch.zeros(1, 16, 4, 4)}, save_latents=True),
         r"\(1, 16, 4, 4\)"),
    Case("decode-nan-saving", "VidMemVAEDecode", D(latent_with(nan_latent), save_latents=True), "NaN"),
    Case("decode-wrong-channels-saving", "VidMemVAEDecode",
         D(lambda fx: {"samples": torch.zeros(1, 4, 2, 4, 4)}, save_latents=True), "latent has 4 channels"),
    Case("decode-missing-latent", "VidMemVAEDecode", lambda fx: {"pipeline": fx.pipeline()}, "Required input is missing: latent"),
    # --- Decode Audio: LTX-2's sound only, from a latent that carries it ---------------------------
    Case("audio-wan-pipeline", "VidMemDecodeAudio", D(latent_with(variant="ltx2-t2v")), "Decode Audio decodes LTX-2's sound"),
    Case("audio-wan-latent", "VidMemDecodeAudio", D(latent_with(), "ltx2-t2v"), "makes no sound"),
    Case("audio-latent-not-a-dict", "VidMemDecodeAudio", D(lambda fx: "a latent", "ltx2-t2v"), "expected a LATENT"),
    Case("audio-video-only-latent", "VidMemDecodeAudio", D(lambda fx: {"samples": fx.latent("ltx2-t2v")["samples"]}, "ltx2-t2v"),
         "latent: it has no 'audio_samples'"),
    Case("audio-samples-3d", "VidMemDecodeAudio", D(latent_with(variant="ltx2-t2v", audio_samples=torch.zeros(1, 8, 4)), "ltx2-t2v"),
         "are not audio latents"),
    Case("audio-samples-nan", "VidMemDecodeAudio",
         D(latent_with(variant="ltx2-t2v", audio_samples=torch.full((1, 8, 4, 16), NAN)), "ltx2-t2v"), "NaN or infinite"),
    Case("audio-missing-latent", "VidMemDecodeAudio", lambda fx: {"pipeline": fx.pipeline("ltx2-t2v")},
         "Required input is missing: latent"),
    # --- Prepare Training Data ----------------------------------------------------------------------------
    Case("prepare-empty-folder", "VidMemPrepareTrainingData", P(files=()), "folder .* has no videos"),
    Case("prepare-folder-missing", "VidMemPrepareTrainingData", P(folder="/nonexistent/clips"), "folder '/nonexistent/clips' is not a folder"),
    Case("prepare-caption-missing", "VidMemPrepareTrainingData", P(files=(("a.png", None),)), "have no caption: a.png"),
    Case("prepare-video-undecodable", "VidMemPrepareTrainingData",
         P(files=(("v.mp4", b"not a video at all"), ("v.txt", b"noise"))), "v.mp4"),
    Case("prepare-frames-not-4k1", "VidMemPrepareTrainingData", P(frame_buckets="10"), "frame_buckets: frames=10 is not valid for wan"),
    Case("prepare-frames-text", "VidMemPrepareTrainingData", P(frame_buckets="many"), "frame_buckets"),
    Case("prepare-resolution-not-multiple", "VidMemPrepareTrainingData", P(resolutions="40x32"), "width 40 must be a multiple of 16"),
    Case("prepare-resolution-text", "VidMemPrepareTrainingData", P(resolutions="big"), "resolutions"),
    Case("prepare-pipeline-latent", "VidMemPrepareTrainingData", lambda fx: {**P()(fx), "pipeline": fx.latent()},
         r"pipeline \(Prepare Training Data\) got a LATENT"),
    Case("prepare-strategy-none", "VidMemPrepareTrainingData", lambda fx: {**P()(fx), "strategy": None},
         r"strategy \(Prepare Training Data\) got nothing"),
    Case("prepare-missing-folder-input", "VidMemPrepareTrainingData",
         lambda fx: {k: v for k, v in P()(fx).items() if k != "folder"}, "Required input is missing: folder"),
    # --- Train LoRA -------------------------------------------------------------------------------------
    Case("train-lora-name-escapes", "VidMemTrainLoRA", T(lora_name="../outside"), "lora_name"),
    Case("train-lora-name-empty", "VidMemTrainLoRA", T(lora_name=""), "lora_name"),
    Case("train-rank-zero", "VidMemTrainLoRA", T(rank=0), "smaller than min of 1: rank"),
    Case("train-rank-larger-than-layer", "VidMemTrainLoRA", T(rank=512), "rank=512 is larger than layer"),
    Case("train-steps-zero", "VidMemTrainLoRA", T(steps=0), "smaller than min of 1: steps"),
    Case("train-learning-rate-nan", "VidMemTrainLoRA", T(learning_rate=NAN), "learning_rate=nan is not a finite number"),
    Case("train-alpha-inf", "VidMemTrainLoRA", T(alpha=INF), "alpha=inf is not a finite number"),
    Case("train-pipeline-none", "VidMemTrainLoRA", lambda fx: {**T()(fx), "pipeline": None}, r"pipeline \(Train LoRA\) got nothing"),
    Case("train-strategy-none", "VidMemTrainLoRA", lambda fx: {**T()(fx), "strategy": None}, r"strategy \(Train LoRA\) got nothing"),
    Case("train-optimizer-unknown", "VidMemTrainLoRA", T(optimizer="sgd"), "Value not in list: optimizer"),
    Case("train-targets-match-nothing", "VidMemTrainLoRA", T(target_modules="no_such_layer"), "target_modules"),
    Case("train-expert-on-one-transformer", "VidMemTrainLoRA", T(expert="low_noise"), "expert"),
    Case("train-data-not-prepared", "VidMemTrainLoRA", lambda fx: {**T()(fx), "data": "clips/"}, "data is not prepared training data"),
    # --- Free VRAM -----------------------------------------------------------------------------------------
    Case("free-missing-anything", "VidMemFreeVRAM", lambda fx: {"unload_comfy_models": False}, "Required input is missing: anything"),
]


@pytest.fixture
def fx(tiny_loaded, tmp_path, monkeypatch):
    from vidmem.nodes import host

    monkeypatch.setattr(host, "latents_folder", lambda: tmp_path / "input")
    monkeypatch.setattr(host, "loras_folder", lambda: tmp_path / "models" / "loras")
    monkeypatch.setattr(host, "training_folder", lambda: tmp_path / "output" / "vidmem_training")
    return Fixtures(tiny_loaded, tmp_path, monkeypatch)


def run_case(case: Case, fx: Fixtures) -> None:
    """ComfyUI's validation, then the node; the refusal must match; nothing may be left behind."""
    node_cls = NODE_CLASS_MAPPINGS[case.node]
    inputs = case.inputs(fx)
    before_files = tree(fx.root)
    before = [(storage_map(p.pipe), hooks_of(p.pipe)) for p in fx.used]
    reasons, converted = comfy_refusal(node_cls, inputs)
    if reasons:
        assert re.search(case.message, "\n".join(reasons)), reasons
    else:
        assert not case.validation_only, f"ComfyUI's validation accepts {case.id}, and running it would be expensive"
        with pytest.raises(PACK_ERRORS) as error:
            getattr(node_cls(), node_cls.FUNCTION)(**converted)
        assert re.search(case.message, str(error.value)), str(error.value)
    assert tree(fx.root) == before_files, "a file or folder was left behind"
    assert [(storage_map(p.pipe), hooks_of(p.pipe)) for p in fx.used] == before, "a hook or moved weight was left"


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=c.marks) for c in CASES])
def test_bad_node_input_is_refused_and_leaves_nothing(case, fx):
    run_case(case, fx)


def test_every_node_is_fuzzed_with_many_cases():
    from test_fuzz_files import CASES as FILE_CASES, MODEL_FILE_CASES

    every = CASES + FILE_CASES + MODEL_FILE_CASES
    assert {c.node for c in every} == set(NODE_CLASS_MAPPINGS)
    assert len({c.id for c in every}) == len(every) >= 80


def test_good_inputs_pass_the_same_validation(fx):
    """The mirror of ComfyUI's validation refuses nothing a good prompt holds (else every case is moot)."""
    assert comfy_refusal(NODE_CLASS_MAPPINGS["VidMemMemoryStrategy"], strategy_widgets()) == ([], strategy_widgets())
    reasons, converted = comfy_refusal(NODE_CLASS_MAPPINGS["VidMemVideoSampler"], sampler_inputs(fx))
    assert reasons == []
    result = NODE_CLASS_MAPPINGS["VidMemVideoSampler"]().sample(**converted)
    frames = NODE_CLASS_MAPPINGS["VidMemVAEDecode"]().decode(fx.pipeline(), result["result"][0], save_latents=True)
    assert torch.isfinite(frames["result"][0]).all() and len(list((fx.root / "input").iterdir())) == 1


def test_a_prompt_longer_than_the_encoder_reads_is_reported_not_refused(fx):
    inputs = sampler_inputs(fx, prompt="a lighthouse at dusk, " * 300)
    result = NODE_CLASS_MAPPINGS["VidMemVideoSampler"]().sample(**inputs)
    cut = result["ui"]["vidmem_receipt"][0]["text_encode"]["prompt"]["cut"]
    assert cut > 0
