"""First-last-frame: the video starts on `image` and ends on `last_image` (issue 26).

Wan 2.1 FLF2V 14B (a CLIP positional embedding over two images: it needs both) and Wan 2.2 I2V
A14B (VAE conditioning only: the last frame's latent in the mask's last place) take a last frame;
every other model refuses one by name, and FLF2V refuses to run without one. The tiny FLF2V runs
every tier bit for bit with plain diffusers in test_tiers (it is a TINY_VARIANTS entry); here the
last frame is shown to matter, the Comfy-Org file layout (`img_emb.emb_pos`, which diffusers'
single-file converter leaves unnamed) loads, and the planner plans it.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import safetensors
import torch

from vidmem.memory import MemoryStrategy
from vidmem.memory.device import CpuBackend
from vidmem.pipelines.comfy_files import LoadOptions, load_model_files, read_weight_file
from vidmem.pipelines.family import ModelError
from vidmem.pipelines.loader import load_pipeline
from vidmem.pipelines.sample import sample
from vidmem.pipelines.tiny import tiny_call_kwargs, tiny_image, tiny_picture, tiny_spec
from vidmem.pipelines.tiny_files import save_tiny_comfy_files, tiny_catalogue
from test_tiers import request_for

FLF2V, A14B = "wan2.1-flf2v", "wan2.2-i2v-a14b"
NONE = MemoryStrategy(offload="none")


def grey(variant: str, level: int) -> torch.Tensor:
    spec = tiny_spec(variant)
    return torch.full((1, spec.height, spec.width, 3), level / 255)


def latent(loaded, request, strategy=NONE):
    return sample(loaded, strategy, request, backend=CpuBackend()).latent["samples"]


def test_flf2v_ends_on_its_last_image(tiny_loaded):
    loaded = tiny_loaded(FLF2V)
    request = request_for(FLF2V)
    darker = latent(loaded, request.__class__(**{**request.__dict__, "last_image": grey(FLF2V, 30)}))
    assert not torch.equal(latent(loaded, request), darker)


def test_wan22_i2v_a14b_takes_a_last_frame_as_diffusers_does(tiny_loaded):
    """With pictures that have an orientation (a flat grey one would hide a turned image) and differ
    from each other: swapping them changes the video, so each lands in its own place."""
    loaded = tiny_loaded(A14B)
    first, last = tiny_image(A14B), tiny_image(A14B, last=True)
    request = replace(request_for(A14B, steps=4), image=first)
    with_last = replace(request, last_image=last)
    kwargs = dict(tiny_call_kwargs(A14B, steps=4, structured=True), last_image=tiny_picture(last))
    reference = loaded.pipe(**kwargs).frames
    for strategy in (NONE, MemoryStrategy(offload="block_swap", blocks_to_swap=2), MemoryStrategy(offload="sequential")):
        assert torch.equal(latent(loaded, with_last, strategy), reference), strategy.offload
    assert not torch.equal(latent(loaded, request), reference)
    assert not torch.equal(latent(loaded, replace(with_last, image=last, last_image=first)), reference)


@pytest.mark.parametrize("variant,message", [
    ("wan2.1-i2v", r"last_image: .* cannot run this way \(Wan 2.1 I2V 14B was trained on a first frame only: use Wan 2.1 "
                   r"FLF2V 14B .*\); disconnect last_image"),
    ("wan2.2-ti2v", r"Wan 2.2 TI2V-5B conditions on its first frame only: use Wan 2.2 I2V A14B"),
    ("cogvideox-i2v", r"last_image: .* cannot run this way \(it conditions on a first frame only\); disconnect last_image"),
    ("hunyuanvideo1.5-i2v", r"it conditions on a first frame only"),
])
def test_a_model_without_last_frame_conditioning_refuses_one_by_name(variant, message, tiny_loaded):
    loaded = tiny_loaded(variant)
    request = request_for(variant)
    image = request.image if request.image is not None else grey(variant, 128)
    with pytest.raises(ModelError, match=message):
        sample(loaded, NONE, request.__class__(**{**request.__dict__, "image": image, "last_image": grey(variant, 9)}),
               backend=CpuBackend())
    sample(loaded, NONE, request.__class__(**{**request.__dict__, "image": image}), backend=CpuBackend())  # only last_image was wrong


def test_flf2v_without_a_last_image_and_a_last_image_alone_are_named(tiny_loaded):
    loaded = tiny_loaded(FLF2V)
    request = request_for(FLF2V)
    with pytest.raises(ModelError, match=r"first-last-frame model: .* load Wan 2.1 I2V 14B\); connect last_image or load another model"):
        sample(loaded, NONE, request.__class__(**{**request.__dict__, "last_image": None}), backend=CpuBackend())
    with pytest.raises(ModelError, match="is image-to-video: connect an IMAGE to the sampler's image input"):
        sample(tiny_loaded(A14B), NONE, request.__class__(**{**request_for(A14B).__dict__, "image": None,
                                                             "last_image": grey(A14B, 9)}), backend=CpuBackend())
    # A model that takes no last frame says so first, not "connect image" and then "disconnect both".
    t2v = request_for("wan2.1-t2v")
    with pytest.raises(ModelError, match=r"last_image: .* is text-to-video: disconnect last_image"):
        sample(tiny_loaded("wan2.1-t2v"), NONE, t2v.__class__(**{**t2v.__dict__, "last_image": grey("wan2.1-t2v", 9)}),
               backend=CpuBackend())
    ti2v = request_for("wan2.2-ti2v")
    with pytest.raises(ModelError, match="TI2V-5B conditions on its first frame only"):
        sample(tiny_loaded("wan2.2-ti2v"), NONE, ti2v.__class__(**{**ti2v.__dict__, "last_image": grey("wan2.2-ti2v", 9)}),
               backend=CpuBackend())
    bad = torch.full((1, 32, 32, 3), float("nan"))
    with pytest.raises(ModelError, match="last_image contains NaN"):
        sample(loaded, NONE, request.__class__(**{**request.__dict__, "last_image": bad}), backend=CpuBackend())


def test_flf2v_from_comfy_org_files_names_its_image_positions_and_matches_its_folder(tmp_path):
    """The original layout stores the positions as `img_emb.emb_pos`; loaded, the pipeline has them
    (not random: the same latents as the diffusers twin holding the same values)."""
    written = save_tiny_comfy_files(FLF2V, tmp_path, "fp8_scaled", "original")
    with safetensors.safe_open(str(written.files.model), "pt") as file:
        assert "img_emb.emb_pos" in set(file.keys())
    assert read_weight_file(written.files.model, "model", "transformer").fields["pos_embed_seq_len"] == 2 * 1025
    loaded = load_model_files(written.files, LoadOptions(dtype="fp32", weights_on_disk=True), tiny_catalogue())
    assert loaded.config_name == f"tiny-{FLF2V}"
    twin = load_pipeline(str(written.reference), dtype="fp32")
    request = request_for(FLF2V)
    assert torch.equal(latent(loaded, request, MemoryStrategy(offload="block_swap", blocks_to_swap=1)), latent(twin, request))


def test_the_planner_plans_wan21_flf2v_14b_at_720p(capsys):
    from vidmem.cli import main

    main(["plan", "--model", "wan2.1-flf2v-14b-720p", "--weights", "fp8_scaled", "--disk", "--size", "1280x720",
          "--frames", "81", "--vram", "12", "--ram", "32", "--json"])
    plan = json.loads(capsys.readouterr().out)
    assert plan["model"] == "wan2.1-flf2v-14b-720p"
    assert plan["strategies"][plan["recommended"]]["fits"]


def test_the_sampler_node_fits_last_image_like_image_and_says_so(tiny_folder):
    from test_nodes import strategy_inputs
    from vidmem.nodes import NODE_CLASS_MAPPINGS as N

    sampler = N["VidMemVideoSampler"]
    assert "last_image" in sampler.INPUT_TYPES()["optional"]
    (pipeline,) = N["VidMemLoadPipeline"]().load(model="ignored", dtype="fp32", path=str(tiny_folder(FLF2V)))
    (strategy,) = N["VidMemMemoryStrategy"]().build(**strategy_inputs())["result"]
    first, last = grey(FLF2V, 128), torch.rand(1, 45, 70, 3, generator=torch.Generator().manual_seed(5))

    def run(last_image, resize="crop"):
        out = sampler().sample(pipeline, strategy, "a cat", "", 32, 32, 9, 2, 5.0, 0, image=first, resize=resize,
                               last_image=last_image)
        return out["result"][0]["samples"], out["ui"]["vidmem_receipt"][0].get("note", "")

    cropped, note = run(last)
    assert "last_image: 70x45 scaled and cropped to 32x32" in note
    from vidmem.pipelines.image_fit import fit_image

    assert torch.equal(run(fit_image(last, 32, 32, "crop", "last_image").image)[0], cropped)
    with pytest.raises(ModelError, match="connect last_image"):
        run(None)


def test_the_planner_counts_both_pictures_of_flf2v():
    """FLF2V's image embedder takes two pictures' CLIP tokens (2 x 257) and adds a position to each: the
    planner's traced step feeds it both (with one, the embedder's reshape fails and the plan with it),
    and its weights count the positions."""
    from vidmem.memory import MemoryStrategy as Strategy
    from vidmem.memory.plan.stages import denoise_stage
    from vidmem.memory.plan.types import PlanOptions, VideoShape
    from vidmem.pipelines.configs import load_model

    shape, strategy = VideoShape(832, 480, 81), Strategy(offload="none")
    peaks = {name: denoise_stage(load_model(name), shape, strategy, PlanOptions()).peak_phase
             for name in ("wan2.1-flf2v-14b-720p", "wan2.1-i2v-14b-720p")}
    flf2v, i2v = peaks["wan2.1-flf2v-14b-720p"], peaks["wan2.1-i2v-14b-720p"]
    assert flf2v.weights_bytes - i2v.weights_bytes == 514 * 1280 * 2  # its pos_embed, bf16
