"""The planner's LTX-2 image-to-video step is the call LTX2ImageToVideoPipeline makes: one fp32 timestep
per video token (the clean first frame), the audio's per video, so the transformer's modulation is per
token and the denoise peak is about twice text-to-video's."""

from __future__ import annotations

import json
import shutil

import diffusers
import torch
from PIL import Image

from vidmem.memory.accounting import trace
from vidmem.memory.plan.types import Call, VideoShape
from vidmem.pipelines import ltx2
from vidmem.pipelines.configs import load_model
from vidmem.pipelines.configs.workloads import denoise_step
from vidmem.pipelines.tiny import tiny_call_kwargs, tiny_spec

VARIANT = "ltx2-t2v"
GiB = 2**30
# What diffusers passes and the planner leaves to the transformer's defaults (positions it computes itself,
# guidance passes vidmem keeps off: pipelines/ltx2.py VIDEO_ONLY_GUIDANCE).
LEFT_TO_DEFAULTS = {"video_coords", "audio_coords", "isolate_modalities", "spatio_temporal_guidance_blocks",
                    "perturbation_mask", "attention_kwargs"}


def first_call_kwargs(transformer, run) -> dict:
    """The keyword arguments of `transformer`'s first forward while `run()` runs."""
    seen = []
    handle = transformer.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs) or None,
                                                   with_kwargs=True)
    try:
        run()
    finally:
        handle.remove()
    return seen[0]


def described(value):
    return (tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else value


def test_the_image_to_video_step_calls_the_transformer_as_diffusers_does(tiny_folder, tmp_path):
    """Every argument the planner's step gives the transformer has the shape, dtype and value of the
    one LTX2ImageToVideoPipeline gives it (tiny model, on the CPU): a scalar video timestep fails here."""
    folder = shutil.copytree(tiny_folder(VARIANT), tmp_path / "ltx2-i2v")
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps(dict(index, _class_name="LTX2ImageToVideoPipeline")))
    plain = diffusers.LTX2ImageToVideoPipeline.from_pretrained(folder)
    plain.set_progress_bar_config(disable=True)
    spec = tiny_spec(VARIANT)
    grey = Image.new("RGB", (spec.width, spec.height), (128, 128, 128))
    theirs = first_call_kwargs(plain.transformer, lambda: plain(**tiny_call_kwargs(VARIANT), image=grey))

    model = load_model(str(folder), "fp32")
    assert model.pipeline_class == "LTX2ImageToVideoPipeline"
    step = denoise_step(model, "transformer", VideoShape(spec.width, spec.height, spec.frames), plain.transformer, "cpu")
    ours = first_call_kwargs(plain.transformer, step)

    assert set(theirs) - set(ours) == LEFT_TO_DEFAULTS and set(ours) <= set(theirs)
    assert theirs["timestep"].ndim == 2  # one per token, cfg's two rows
    assert {name: described(ours[name]) for name in ours} == {name: described(theirs[name]) for name in ours}


def test_image_to_video_plans_the_per_token_modulation_at_full_size():
    """LTX-2 19B at 768x512x121 on meta: the planner's step peaks where a bare transformer call shaped as
    diffusers' image-to-video call peaks (4.2 GiB), about 2 GiB above text-to-video's (review s-r20)."""
    shape = VideoShape(768, 512, 121)
    t2v = load_model("ltx2-t2v-19b").trace(Call("denoise", "transformer", shape), "fused").peak_bytes
    model = load_model("ltx2-i2v-19b")
    i2v = model.trace(Call("denoise", "transformer", shape), "fused").peak_bytes
    forward = trace(diffusers_shaped_forward(model, shape), "fused").peak_bytes
    assert i2v > t2v + 1.5 * GiB
    assert abs(i2v - forward) < 0.01 * forward


def diffusers_shaped_forward(model, shape: VideoShape):
    """The transformer alone, called with LTX2ImageToVideoPipeline's argument shapes (cfg as a batch of two)."""
    transformer, connectors = model.traced_module("transformer"), model.components["connectors"].config
    _, channels, frames, height, width = model.latent_shape(shape)
    tokens, config = frames * height * width, transformer.config
    audio_frames = ltx2.audio_latent_frames(shape.frames, config.audio_sampling_rate, config.audio_hop_length,
                                            config.audio_scale_factor)
    meta = dict(device="meta")

    def width_of(kind: str) -> int:
        return connectors[f"{kind}_connector_num_attention_heads"] * connectors[f"{kind}_connector_attention_head_dim"]

    def run():
        conditioning = torch.zeros((2, tokens), dtype=torch.float32, **meta)  # prepare_latents' mask, cat for cfg
        timestep = torch.zeros((2,), dtype=torch.float32, **meta)
        mask = torch.ones((2, ltx2.PROMPT_TOKENS), dtype=torch.long, **meta)
        return transformer(
            hidden_states=torch.empty((2, tokens, channels), dtype=model.dtype, **meta),
            audio_hidden_states=torch.empty((2, audio_frames, config.audio_in_channels), dtype=model.dtype, **meta),
            encoder_hidden_states=torch.empty((2, ltx2.PROMPT_TOKENS, width_of("video")), dtype=model.dtype, **meta),
            audio_encoder_hidden_states=torch.empty((2, ltx2.PROMPT_TOKENS, width_of("audio")), dtype=model.dtype, **meta),
            timestep=timestep.unsqueeze(-1) * (1 - conditioning), audio_timestep=timestep, sigma=timestep,
            encoder_attention_mask=mask, audio_encoder_attention_mask=mask, num_frames=frames, height=height,
            width=width, fps=24.0, audio_num_frames=audio_frames, return_dict=False)
    return run


def test_an_image_run_of_the_text_to_video_folder_is_planned_as_image_to_video(tiny_loaded):
    """LTX-2's one folder (model_index.json: LTX2Pipeline) runs image-to-video when an image comes: the
    sampler's plans (its room, the OOM ladder's budget, the Sampler's plan line) read the planner model
    of the class that runs, LTX2ImageToVideoPipeline's per-token step, not the folder's text-to-video one."""
    from vidmem.memory.plan.stages import denoise_stage
    from vidmem.memory import MemoryStrategy
    from vidmem.pipelines.planning import plan_options, planner_model

    loaded = tiny_loaded(VARIANT)
    text, image = planner_model(loaded), planner_model(loaded.image_mode())
    assert (text.pipeline_class, image.pipeline_class) == ("LTX2Pipeline", "LTX2ImageToVideoPipeline")
    assert planner_model(loaded.image_mode()) is image, "memoised: its traces are reused run after run"
    assert load_model(text.source, text.dtype_name) is text, "the folder's own model is unchanged"
    spec = tiny_spec(VARIANT)
    shape = VideoShape(spec.width, spec.height, spec.frames, cfg=True)
    options = plan_options(loaded, device="cuda")
    strategy = MemoryStrategy(offload="none")
    assert denoise_stage(image, shape, strategy, options).device_bytes > denoise_stage(text, shape, strategy, options).device_bytes


def test_the_sampler_plans_an_image_run_with_the_class_that_runs_it(tiny_loaded, monkeypatch):
    import pytest

    from vidmem.nodes import NODE_CLASS_MAPPINGS
    from vidmem.nodes import sampler as sampler_node

    class Planned(Exception):
        pass

    seen = []

    def strategy_for_run(pipeline, choice, shape, device, options):
        seen.append(pipeline.class_name)
        raise Planned

    monkeypatch.setattr(sampler_node, "_strategy_for_run", strategy_for_run)
    spec, loaded = tiny_spec(VARIANT), tiny_loaded(VARIANT)
    (choice,) = NODE_CLASS_MAPPINGS["VidMemMemoryStrategy"]().build(
        offload="none", blocks_to_swap=0, prefetch_blocks=1, max_pinned_ram_gb=-1.0, non_blocking=True,
        text_encoder="offload_after_encoding", vae_slicing=False, vae_tiling=False, tile_size=256, overlap=64,
        temporal_size=64, temporal_overlap=8)["result"]
    image = torch.full((1, spec.height, spec.width, 3), 0.5)
    for given in (None, image):
        with pytest.raises(Planned):
            sampler_node.VidMemVideoSampler().sample(loaded, choice, "a cat", "", spec.width, spec.height, spec.frames,
                                                     2, 1.0, 0, image=given)
    assert seen == ["LTX2Pipeline", "LTX2ImageToVideoPipeline"]
