"""Image-to-video from what users download, end to end on tiny models; and its plan.

Tiny models written in Comfy-Org's layouts and key names (pipelines/tiny_files.py): the two
Wan 2.2 I2V A14B experts (no CLIP vision encoder), Wan 2.1 I2V with clip_vision_h's layout
(`vision_model.` names and a projection head Wan does not use); CogVideoX-5b I2V from its
diffusers folder. Against the folder twin (bit-identical latents per storage and layout) see
test_comfy_files; here, every tier on files kept on disk gives tier none's latents, the expert
hand-off streams the low-noise expert in time, a wrong or missing image encoder is named, and
the planner counts the image conditioning (the VAE encode, Wan 2.1's CLIP) and fits Wan 2.2
I2V A14B fp8 at 832x480x81 on 8 GB / 32 GB.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import safetensors
import torch

from backends import Recorder, StrictBackend
from vidmem.memory import MemoryStrategy
from vidmem.memory.device import CpuBackend
from vidmem.pipelines.comfy_files import LoadOptions, load_model_files, read_weight_file
from vidmem.pipelines.family import ModelError
from vidmem.pipelines.sample import sample
from vidmem.pipelines.tiny_files import save_tiny_comfy_files, tiny_catalogue
from test_tiers import request_for

A14B = "wan2.2-i2v-a14b"
TIERS = {
    "none": MemoryStrategy(offload="none"),
    "model": MemoryStrategy(offload="model"),
    "block_swap:1": MemoryStrategy(offload="block_swap", blocks_to_swap=1),
    "block_swap:2:p2": MemoryStrategy(offload="block_swap", blocks_to_swap=2, prefetch_blocks=2),
    "sequential": MemoryStrategy(offload="sequential"),
}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    cache = {}

    def get(variant, storage, layout="original"):
        key = (variant, storage, layout)
        if key not in cache:
            folder = tmp_path_factory.mktemp(f"{variant}-{storage}-{layout}")
            cache[key] = save_tiny_comfy_files(variant, folder, storage, layout, reference=False).files
        return cache[key]

    return get


def load(files, on_disk=True):
    return load_model_files(files, LoadOptions(dtype="fp32", weights_on_disk=on_disk), tiny_catalogue())


@pytest.mark.parametrize("storage", ["fp8_scaled", "gguf_q8_0", "bf16"])
def test_wan22_i2v_a14b_files_give_one_video_on_every_tier(written, storage):
    loaded = load(written(A14B, storage))
    assert loaded.config_name == f"tiny-{A14B}" and loaded.on_disk
    assert loaded.storage["transformer"] == loaded.storage["transformer_2"] == storage
    assert loaded.pipe.image_encoder is None and loaded.needs_image
    results = {label: sample(loaded, strategy, request_for(A14B, steps=4), backend=CpuBackend()).latent["samples"]
               for label, strategy in TIERS.items()}
    assert results["none"].isfinite().all() and results["none"].abs().sum() > 0
    for label, latent in results.items():
        assert torch.equal(latent, results["none"]), f"{storage} {label} differs from tier none"


def test_both_experts_run_and_the_low_noise_one_is_streamed_in_before_it_takes_over(written):
    """As T2V A14B (test_blockswap): the swap pool goes to the low-noise expert after the last
    high-noise step, prefetched, and nothing of the high-noise expert is copied afterwards."""
    loaded = load(written(A14B, "fp8_scaled"))
    recorder = Recorder()
    sample(loaded, MemoryStrategy(offload="block_swap", blocks_to_swap=2, prefetch_blocks=1),
           request_for(A14B, steps=4), backend=StrictBackend(), observer=recorder)
    events = recorder.events
    first_low = next(i for i, (kind, name) in enumerate(events) if name.startswith("transformer_2."))
    assert events[first_low] == ("prefetch", "transformer_2.blocks.0")
    assert first_low < events.index(("onload", "transformer_2"))
    assert [e for e in events[first_low:] if e[1].startswith("transformer.") and e[0] != "evict"] == []
    assert ("onload", "transformer") in events[:first_low]


def test_the_experts_are_not_interchangeable(written):
    """Swapping the two files changes the video: model is the high-noise expert, model_2 the low."""
    files = written(A14B, "bf16")
    swapped = replace(files, model=files.model_2, model_2=files.model)
    strategy = MemoryStrategy(offload="none")
    right = sample(load(files), strategy, request_for(A14B, steps=4), backend=CpuBackend()).latent["samples"]
    wrong = sample(load(swapped), strategy, request_for(A14B, steps=4), backend=CpuBackend()).latent["samples"]
    assert not torch.equal(right, wrong)


def test_one_i2v_a14b_expert_asks_for_the_other_and_a_clip_vision_file_is_refused(written):
    files = written(A14B, "fp8_scaled")
    with pytest.raises(ModelError, match="model: .* is one expert of tiny-wan2.2-i2v-a14b.*set model_2"):
        load(replace(files, model_2=None))
    clip = written("wan2.1-i2v", "fp8_scaled").clip_vision
    with pytest.raises(ModelError, match="clip_vision: tiny-wan2.2-i2v-a14b has no image encoder; set clip_vision to \\(none\\)"):
        load(replace(files, clip_vision=clip))


def test_clip_vision_in_comfy_orgs_layout_is_read_and_its_projection_left_out(written):
    files = written("wan2.1-i2v", "fp8_scaled")
    with safetensors.safe_open(str(files.clip_vision), "pt") as file:
        names = set(file.keys())
    assert "visual_projection.weight" in names and all(n.startswith(("vision_model.", "visual_projection.")) for n in names)
    clip = read_weight_file(files.clip_vision, "clip_vision", "clip_vision")
    assert "visual_projection.weight" not in clip.tensors and clip.fields["num_hidden_layers"] == 2
    loaded = load(files)
    assert loaded.pipe.image_encoder is not None
    latent = sample(loaded, MemoryStrategy(offload="block_swap", blocks_to_swap=1), request_for("wan2.1-i2v"),
                    backend=CpuBackend()).latent["samples"]
    assert latent.isfinite().all()


def test_wan21_i2v_with_an_fp16_clip_vision_file_runs_on_every_tier(written):
    """clip_vision_h ships in fp16; the encoder follows the tier like the transformer."""
    files = written("wan2.1-i2v", "fp16")
    loaded = load(files)
    assert loaded.storage["image_encoder"] == "fp16"
    results = {label: sample(loaded, strategy, request_for("wan2.1-i2v"), backend=CpuBackend()).latent["samples"]
               for label, strategy in TIERS.items()}
    for label, latent in results.items():
        assert torch.equal(latent, results["none"]), label


def test_cogvideox_i2v_from_its_folder_with_fp8_weights_on_every_tier_decodes_the_fitted_image(tiny_folder):
    """The CogVideoX-5b I2V template's load (diffusers folder, weight_dtype fp8_scaled) on every tier,
    from a picture of another size and aspect ratio fitted to the video by pipelines/image_fit."""
    from vidmem.pipelines.decode import decode
    from vidmem.pipelines.image_fit import fit_image
    from vidmem.pipelines.loader import load_pipeline
    from vidmem.pipelines.tiny import tiny_call_kwargs, tiny_picture

    variant = "cogvideox-i2v"
    loaded = load_pipeline(tiny_folder(variant), "fp32", weight_dtype="fp8_scaled")
    assert loaded.storage["transformer"] == "fp8_scaled" and loaded.needs_image
    request = request_for(variant)
    picture = torch.rand(1, 45, 70, 3, generator=torch.Generator().manual_seed(1))
    request = replace(request, image=fit_image(picture, request.width, request.height, "crop").image)
    tiers = {label: strategy for label, strategy in TIERS.items() if strategy.blocks_to_swap <= 1}  # one tiny block
    results = {label: sample(loaded, strategy, request, backend=CpuBackend()).latent for label, strategy in tiers.items()}
    for label, latent in results.items():
        assert torch.equal(latent["samples"], results["none"]["samples"]), label
    frames = decode(loaded, results["none"], backend=CpuBackend()).frames
    # diffusers' own pipeline on the same weights, given the fitted picture: it encodes it, denoises, decodes.
    plain = dict(tiny_call_kwargs(variant, steps=request.steps, output_type="pt"), image=tiny_picture(request.image))
    assert torch.equal(frames, loaded.pipe(**plain).frames[0].permute(0, 2, 3, 1))
    stretched = replace(request, image=fit_image(picture, request.width, request.height, "stretch").image)
    other = sample(loaded, TIERS["none"], stretched, backend=CpuBackend()).latent["samples"]
    assert not torch.equal(other, results["none"]["samples"]), "the start image conditions the video"


@pytest.mark.parametrize("model,conditioning", [
    ("wan2.2-i2v-a14b", ["vae (image)"]),
    ("wan2.1-i2v-14b-480p", ["image_encoder (image)", "vae (image)"]),
    ("cogvideox-5b-i2v", ["vae (image)"]),
])
def test_the_plan_counts_the_image_conditioning_before_the_denoise(model, conditioning):
    from vidmem.memory.plan.planner import PlanOptions, VideoShape, plan_run
    from vidmem.pipelines.configs import load_model

    plan = plan_run(load_model(model, "bf16"), VideoShape(720, 480, 49), MemoryStrategy(offload="model"), PlanOptions())
    denoise = next(stage for stage in plan.stages if stage.name == "denoise")
    labels = [phase.label for phase in denoise.phases]
    assert labels[:len(conditioning)] == conditioning and all(p.device_bytes > 0 for p in denoise.phases), labels


def test_wan22_i2v_a14b_fp8_at_480p_fits_8_gb_and_32_gb_of_ram_with_the_weights_on_disk():
    """The issue's `vidmem plan --model wan2.2-i2v-a14b --weights fp8_scaled --size 832x480 --frames 81
    --vram 8 --ram 32`: 35 GB of fp8 weights do not fit 32 GB of RAM, memory-mapped they do."""
    from vidmem.memory.plan.planner import PlanOptions, VideoShape, choose_strategy
    from vidmem.pipelines.configs import load_model

    storage = {"transformer": "fp8_scaled", "transformer_2": "fp8_scaled", "text_encoder": "fp8_scaled"}
    plan = choose_strategy(load_model("wan2.2-i2v-a14b", "bf16"), VideoShape(832, 480, 81), 8 << 30, 32 << 30,
                           options=PlanOptions(storage=storage))
    assert plan.fits and plan.on_disk and plan.strategy.offload.value == "block_swap"
    assert plan.peak_vram_bytes <= 8 << 30 and plan.peak_ram_bytes <= 32 << 30
