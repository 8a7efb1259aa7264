"""Context windows: the schedule and blend, exactness inside a window, every tier, bad values, the plan."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from vidmem.memory import MemoryStrategy
from vidmem.memory.device import CpuBackend
from vidmem.memory.windows import WindowSchedule
from vidmem.pipelines.context_windows import HOOK_NAME, context_windows, window_call
from vidmem.pipelines.family import ModelError, denoisers
from vidmem.pipelines.sample import SampleRequest, sample
from vidmem.pipelines.tiny import tiny_spec

STEPS = 2
FRAMES = 17  # 5 latent frames: windows of 9 frames (3 latent) sharing 4 (1 latent) -> spans 0-3, 2-5
WINDOWED = ("wan2.1-t2v", "wan2.1-i2v", "wan2.2-ti2v", "wan2.2-a14b", "cogvideox-t2v", "cogvideox-i2v", "hunyuanvideo1.5-t2v",
            "hunyuanvideo1.5-i2v")


def request_for(variant: str, frames: int = FRAMES, window: int = 9, overlap: int = 4, **changes) -> SampleRequest:
    spec = tiny_spec(variant)
    image = torch.full((1, spec.height, spec.width, 3), 128 / 255) if spec.needs_image else None
    request = SampleRequest("a cat", "", spec.width, spec.height, frames, STEPS, 5.0, 0, image,
                            window=window, window_overlap=overlap)
    return replace(request, **changes)


def run(loaded, request, strategy=MemoryStrategy(offload="none")):
    return sample(loaded, strategy, request, backend=CpuBackend())


# --- the schedule ----------------------------------------------------------------------------------

def test_static_schedule_steps_by_window_less_overlap_and_ends_on_the_last_frame():
    assert WindowSchedule(41, 21, 4).spans == ((0, 21), (17, 38), (20, 41))
    assert WindowSchedule(5, 3, 1).spans == ((0, 3), (2, 5))
    assert WindowSchedule(5, 5, 1).spans == ((0, 5),)
    assert WindowSchedule(5, 9, 0).spans == ((0, 5),)


def test_weights_cross_fade_over_each_overlap_and_are_exactly_one_elsewhere():
    schedule = WindowSchedule(55, 21, 4)  # strides fit: every overlap is the 4 asked for
    assert schedule.spans == ((0, 21), (17, 38), (34, 55))
    totals = [0.0] * schedule.frames
    for index, (start, stop) in enumerate(schedule.spans):
        for frame, weight in zip(range(start, stop), schedule.weights(index)):
            totals[frame] += weight
    assert totals == pytest.approx([1.0] * 55)  # neighbours' ramps sum to one: a linear cross-fade
    assert schedule.weights(0)[:17] == [1.0] * 17  # frames only the first window sees: weight exactly 1
    assert schedule.weights(1)[:4] == [0.2, 0.4, 0.6, 0.8]
    assert schedule.weights(1)[-4:] == [0.8, 0.6, 0.4, 0.2]
    moved = WindowSchedule(41, 21, 4)  # the last window moved back shares 18 frames with the one before
    assert moved.weights(2)[:18] == [(i + 1) / 19 for i in range(18)]


@pytest.mark.parametrize("frames, window, overlap", [(0, 3, 0), (5, 3, 3), (5, 3, -1), (5, True, 0)])
def test_a_bad_schedule_is_refused_by_name(frames, window, overlap):
    with pytest.raises(ValueError, match="context window"):
        WindowSchedule(frames, window, overlap)


# --- exactness ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["wan2.1-t2v", "cogvideox-t2v"])
def test_a_window_covering_the_clip_is_the_unwindowed_run(variant, tiny_loaded):
    loaded = tiny_loaded(variant)
    plain = run(loaded, request_for(variant, window=0, overlap=0))
    covered = run(loaded, request_for(variant, window=FRAMES, overlap=4))
    assert torch.equal(plain.latent["samples"], covered.latent["samples"])
    assert "covers all 17 frames" in covered.receipt["windows"]["note"]


@pytest.mark.parametrize("variant", WINDOWED)
def test_one_window_over_the_whole_clip_through_the_hook_is_the_plain_forward(variant, tiny_loaded):
    """The hook's slicing and blending path (weight 1 everywhere) changes no bit of a whole-clip run."""
    loaded = tiny_loaded(variant)
    request = request_for(variant, window=0, overlap=0)
    plain = run(loaded, request)
    spec, pipe = loaded.spec, loaded.pipe
    latent = (FRAMES - 1) // pipe.vae_scale_factor_temporal + 1
    with context_windows(denoisers(pipe, spec), spec.name, WindowSchedule(latent, latent, 0)) as receipt:
        hooked = run(loaded, request)
    assert receipt["passes"] > 0
    assert torch.equal(plain.latent["samples"], hooked.latent["samples"])


@pytest.mark.parametrize("variant", WINDOWED)
def test_frames_only_one_window_sees_are_that_window_run_alone(variant, tiny_loaded):
    """One denoiser forward over 5 latent frames in windows 0-3 and 2-5: frames 0-1 are the forward
    of frames 0-3 alone and frames 3-4 that of frames 2-5 alone, bit for bit."""
    loaded = tiny_loaded(variant)
    calls = []
    transformer = next(iter(denoisers(loaded.pipe, loaded.spec).values()))
    handle = transformer.register_forward_pre_hook(lambda m, a, k: calls.append(k), with_kwargs=True)
    try:
        run(loaded, request_for(variant, window=0, overlap=0, steps=1))
    finally:
        handle.remove()
    kwargs = dict(calls[0], return_dict=False)
    axis = 1 if loaded.spec.name == "cogvideox" else 2
    schedule = WindowSchedule(5, 3, 1)
    with torch.no_grad():
        with context_windows({"transformer": transformer}, loaded.spec.name, schedule):
            blended = transformer(**kwargs)[0]
        first = transformer(**window_call(kwargs, axis, 0, 3, 5))[0]
        last = transformer(**window_call(kwargs, axis, 2, 5, 5))[0]
    assert blended.shape == transformer(**kwargs)[0].shape
    assert torch.equal(blended.narrow(axis, 0, 2), first.narrow(axis, 0, 2))
    assert torch.equal(blended.narrow(axis, 3, 2), last.narrow(axis, 1, 2))
    # The shared frame (one latent frame of overlap: weight 1/2 from each side) is their mean, computed
    # as the hook computes it: in float32, weighted, divided by the weights' sum.
    shared = (first.narrow(axis, 2, 1).float() * 0.5 + last.narrow(axis, 0, 1).float() * 0.5) / 1.0
    assert torch.equal(blended.narrow(axis, 2, 1), shared.to(blended.dtype))
    assert not torch.equal(blended.narrow(axis, 2, 1), first.narrow(axis, 2, 1))


# --- tiers -------------------------------------------------------------------------------------------

TIERS = {
    "model": MemoryStrategy(offload="model"),
    "block_swap": MemoryStrategy(offload="block_swap", blocks_to_swap=1, prefetch_blocks=1),
    "sequential": MemoryStrategy(offload="sequential"),
}
# (variant, weight storage): the folder as saved (fp32), held fp8 (upcast per forward), or on disk
# (the folder already in the chosen dtype: weights memory-mapped from its files).
PIPELINES = [("wan2.1-t2v", None), ("wan2.1-i2v", None), ("cogvideox-t2v", None), ("wan2.1-t2v", "fp8_scaled"),
             ("cogvideox-t2v", "fp8_e4m3fn"), ("wan2.1-t2v", "disk"), ("hunyuanvideo1.5-t2v", None)]


@pytest.mark.parametrize("variant, storage", PIPELINES, ids=[f"{v}-{s or 'fp32'}" for v, s in PIPELINES])
def test_every_tier_windowed_is_tier_none_windowed_bit_for_bit(variant, storage, tiny_loaded, tiny_folder):
    from vidmem.memory.storage import is_file_backed
    from vidmem.pipelines.loader import load_pipeline

    if storage is None:
        loaded = tiny_loaded(variant)
    else:
        loaded = load_pipeline(tiny_folder(variant), "fp32", weight_dtype="fp32" if storage == "disk" else storage)
        assert loaded.on_disk == (storage == "disk")
        assert storage != "disk" or is_file_backed(loaded.pipe.transformer.blocks[0].attn1.to_q.weight)
    request = request_for(variant)
    reference = run(loaded, request)
    assert reference.receipt["windows"]["windows"] == ["0-3", "2-5"]
    assert reference.receipt["windows"]["passes"] == 2 * STEPS * (1 if loaded.spec.cfg_as_batch else 2)
    for label, strategy in TIERS.items():
        result = run(loaded, request, strategy)
        assert torch.equal(reference.latent["samples"], result.latent["samples"]), label
    for module in denoisers(loaded.pipe, loaded.spec).values():  # nothing left applied
        registry = getattr(module, "_diffusers_hook", None)
        assert registry is None or registry.get_hook(HOOK_NAME) is None
        assert registry is not None or "forward" not in module.__dict__


def test_windows_change_the_result_and_keep_the_shape(tiny_loaded):
    loaded = tiny_loaded("wan2.1-t2v")
    plain = run(loaded, request_for("wan2.1-t2v", window=0, overlap=0))
    windowed = run(loaded, request_for("wan2.1-t2v"))
    assert plain.latent["samples"].shape == windowed.latent["samples"].shape
    assert not torch.equal(plain.latent["samples"], windowed.latent["samples"])


def test_the_hook_is_removed_when_the_run_fails(tiny_loaded):
    loaded = tiny_loaded("wan2.1-t2v")

    def stop(step, total):
        raise RuntimeError("stop")

    from vidmem.pipelines.hooks import RunHooks
    with pytest.raises(RuntimeError, match="stop"):
        sample(loaded, MemoryStrategy(offload="none"), request_for("wan2.1-t2v"), RunHooks(on_step=stop),
               backend=CpuBackend())
    transformer = loaded.pipe.transformer
    assert not hasattr(transformer, "_diffusers_hook") or transformer._diffusers_hook.get_hook(HOOK_NAME) is None
    assert hasattr(transformer, "_diffusers_hook") or "forward" not in transformer.__dict__



@pytest.mark.parametrize("call, passes", [(5, 12), (7, 14)])
def test_after_an_out_of_memory_climb_the_receipt_counts_every_window_pass_that_ran(tiny_loaded, call, passes):
    """The ladder resumes after step 1 (Wan: 2 windows x cond and uncond = 4 passes a step; block 0's
    5th call is step 2's first). The receipt counts the passes that ran: at step 2's first pass as
    many as an uninterrupted run's; at its third (the cond forward's two windows done) two more,
    since the rung runs step 2 again; the summary says how many came after the resume."""
    from test_oom_ladder import InjectOOM

    loaded = tiny_loaded("wan2.1-t2v")
    request = request_for("wan2.1-t2v", steps=3)
    whole = run(loaded, request, MemoryStrategy(offload="block_swap", blocks_to_swap=1)).receipt["windows"]
    with InjectOOM(loaded.pipe.transformer.blocks[0], [call]) as oom:
        result = run(loaded, request, MemoryStrategy(offload="model"))
    windows = result.receipt["windows"]
    assert oom.raised == 1 and result.receipt["oom_ladder"][0]["resumed_from_step"] == 1
    assert whole["passes"] == 12 and windows["passes"] == passes
    assert windows["summary"].endswith(f"; {passes} denoiser passes ran (8 of them after resuming from step 1 under "
                                       "the out-of-memory ladder's rung, which runs again the step the error cut short)")
    assert whole["summary"].endswith("; 12 denoiser passes")

# --- bad values --------------------------------------------------------------------------------------

@pytest.mark.parametrize("window, overlap, words", [
    (10, 0, r"window=10 is not valid for wan: use 4k\+1 frames \(e.g. 9 or 13\)"),
    (9, 9, "window_overlap=9 must be smaller than window=9"),
    (9, 3, "window_overlap=3 must be a multiple of 4 video frames .* use 0 or 4"),
    (0, 4, "window_overlap=4 needs a window"),
    (-9, 0, "window=-9 must be a whole number"),
])
def test_bad_windows_are_refused_with_the_fix(window, overlap, words, tiny_loaded):
    with pytest.raises(ModelError, match=words):
        run(tiny_loaded("wan2.1-t2v"), request_for("wan2.1-t2v", window=window, overlap=overlap))


def test_cogvideox_windows_follow_its_own_frame_grid(tiny_loaded):
    with pytest.raises(ModelError, match=r"window=13 is not valid for cogvideox: use 8k\+1"):
        run(tiny_loaded("cogvideox-t2v"), request_for("cogvideox-t2v", window=13))


def test_cogvideox_with_temporal_patches_is_refused(tiny_loaded):
    with pytest.raises(ModelError, match="CogVideoX 1.5"):
        run(tiny_loaded("cogvideox1.5-t2v"), request_for("cogvideox1.5-t2v"))


def test_a_family_whose_transformer_windows_cannot_cut_is_refused_by_name(tiny_loaded):
    """LTX-2 takes the video as packed tokens with positions of its own: refused before any step, naming the fix."""
    with pytest.raises(ModelError, match=r"context windows are not supported for ltx2 yet .* set window to 0"):
        run(tiny_loaded("ltx2-t2v"), request_for("ltx2-t2v"))


# --- the planner -------------------------------------------------------------------------------------

@pytest.mark.parametrize("model, size, frames, window", [("wan2.1-t2v-14b", (832, 480), 161, 81),
                                                         ("cogvideox-5b", (720, 480), 97, 49),
                                                         ("hunyuanvideo1.5-t2v-480p", (848, 480), 241, 121)])
def test_a_windowed_plan_peaks_with_its_window_not_its_clip(model, size, frames, window):
    """Streamed weights (sequential) leave the activations to dominate, so the window shows; the
    decode is tiled in time, so the whole clip decodes within the same peak."""
    from vidmem.memory.plan.candidates import plan_run
    from vidmem.memory.plan.types import PlanOptions, VideoShape
    from vidmem.memory.strategy import VaeTiling
    from vidmem.pipelines.configs import load_model

    meta = load_model(model, None, None)
    strategy = MemoryStrategy(offload="sequential", activation_chunks=1, vae_tiling=VaeTiling())
    plans = {label: plan_run(meta, shape, strategy, PlanOptions(steps=4)) for label, shape in (
        ("window", VideoShape(*size, window)),
        ("windowed", VideoShape(*size, frames, window=window, window_overlap=16)),
        ("clip", VideoShape(*size, frames)))}
    denoise = {label: plan.stage("denoise").device_bytes for label, plan in plans.items()}
    if plans["window"].stage("decode").device_bytes <= plans["window"].stage("denoise").device_bytes:
        # HunyuanVideo 1.5's decode outgrows its denoise (the peak users complain of): there the clip's decode,
        # tiled in time, is the whole run's peak, and only the denoise can follow the window
        assert abs(plans["windowed"].peak_vram_bytes - plans["window"].peak_vram_bytes) <= 0.1 * plans["window"].peak_vram_bytes
    assert denoise["window"] <= denoise["windowed"] <= 1.1 * denoise["window"]  # the clip's latents are counted
    assert denoise["clip"] > 1.1 * denoise["window"]  # the clip in one pass needs more: the test can fail


# --- the Sampler node ----------------------------------------------------------------------------------

def test_the_sampler_appends_window_inputs_after_every_existing_one():
    from vidmem.nodes.sampler import VidMemVideoSampler

    optional = list(VidMemVideoSampler.INPUT_TYPES()["optional"])
    assert optional[optional.index("resize") + 1:optional.index("resize") + 3] == ["window", "window_overlap"]
    for name in ("window", "window_overlap"):
        kind, options = VidMemVideoSampler.INPUT_TYPES()["optional"][name]
        assert kind == "INT" and options["default"] == 0 and "frames" in options["tooltip"]


def test_the_sampler_node_runs_windows_and_its_receipt_names_them(tiny_loaded):
    from test_nodes import strategy_inputs
    from vidmem.nodes.strategy import VidMemMemoryStrategy
    from vidmem.nodes.sampler import VidMemVideoSampler

    loaded = tiny_loaded("wan2.1-t2v")
    (choice,) = VidMemMemoryStrategy().build(**strategy_inputs(offload="none"))["result"]
    out = VidMemVideoSampler().sample(loaded, choice, "a cat", "", 32, 32, FRAMES, 1, 1.0, 0, window=9, window_overlap=4)
    receipt = out["ui"]["vidmem_receipt"][0]
    assert receipt["windows"]["windows"] == ["0-3", "2-5"] and receipt["windows"]["passes"] == 2
    assert "context windows: 2 windows of 9 frames, 4 shared (latent frames 0-3, 2-5); 2 denoiser passes" \
        in out["ui"]["text"][0]
    assert out["result"][0]["samples"].shape[2] == 5


# --- the planner's command line -------------------------------------------------------------------------

def test_vidmem_plan_states_the_windows_and_refuses_bad_ones(capsys):
    from vidmem.cli.plan import main as plan_main

    base = ["plan", "--model", "wan2.1-t2v-1.3b", "--size", "832x480", "--frames", "161", "--vram", "12", "--ram", "64"]
    assert plan_main([*base, "--window", "81", "--window-overlap", "16"]) == 0
    out = capsys.readouterr().out
    assert "context windows: 3 windows of 81 frames, 16 shared (latent frames 0-21, 17-38, 20-41)" in out
    assert "the denoise peak follows one 81-frame window" in out
    assert plan_main([*base, "--window", "80", "--window-overlap", "16"]) == 2
    assert "--window 80 is not valid for wan: use 4k+1 frames (e.g. 77 or 81)" in capsys.readouterr().err
    assert plan_main([*base, "--window", "81", "--window-overlap", "81"]) == 2
    assert "--window-overlap 81 must be smaller than --window 81" in capsys.readouterr().err


def test_ti2v_with_an_image_splits_its_per_token_timesteps_with_the_frames(tiny_loaded):
    """Wan 2.2 TI2V-5B image-to-video: per-token timesteps (0 on the image's frame) cut per window."""
    loaded = tiny_loaded("wan2.2-ti2v")
    spec = tiny_spec("wan2.2-ti2v")
    image = torch.linspace(0, 1, spec.height * spec.width * 3).reshape(1, spec.height, spec.width, 3)
    seen = []
    handle = loaded.pipe.transformer.register_forward_pre_hook(
        lambda m, a, k: seen.append(k["timestep"].shape), with_kwargs=True)
    try:
        windowed = run(loaded, request_for("wan2.2-ti2v", image=image))
    finally:
        handle.remove()
    assert seen and all(len(shape) == 2 for shape in seen)  # the pipeline passed per-token timesteps
    assert windowed.receipt["windows"]["windows"] == ["0-3", "2-5"]
    swapped = run(loaded, request_for("wan2.2-ti2v", image=image), TIERS["block_swap"])
    assert torch.equal(windowed.latent["samples"], swapped.latent["samples"])


def test_context_parallelism_refuses_windows_in_the_engine_and_a_whole_clip_window_is_no_window():
    """The engine's parallel entry refuses windows itself (not only the node); a window covering the
    clip changes nothing, so it is not refused."""
    from vidmem.pipelines.sample import SampleRequest
    from vidmem.pipelines.sample_checks import refuse_windows_in_parallel

    with pytest.raises(ModelError, match="window=41: context windows do not run with context parallelism yet"):
        refuse_windows_in_parallel(SampleRequest("a cat", frames=81, window=41, window_overlap=8))
    refuse_windows_in_parallel(SampleRequest("a cat", frames=81, window=81))
    refuse_windows_in_parallel(SampleRequest("a cat", frames=81))


def test_the_samplers_window_widget_can_hold_off_and_every_grid_window():
    """ComfyUI's frontend rounds an INT widget to its step counted from its min (found in the browser: with
    min 0 and step 4 a typed 81 became 80, a window no model takes). Off (0) and the grid windows must stay."""
    from vidmem.nodes.sampler import VidMemVideoSampler

    inputs = VidMemVideoSampler.INPUT_TYPES()["optional"]
    for name, values in {"window": (0, 17, 49, 81, 121), "window_overlap": (0, 8, 16, 24)}.items():
        options = inputs[name][1]
        assert all((value - options["min"]) % options["step"] == 0 for value in values), (name, options)


def test_each_window_gets_its_own_frames_per_token_timesteps():
    """Wan 2.2 TI2V's per-token timesteps, frame-major: window k must see its own frames' (the image's frame has
    timestep 0, the others not), not the clip's first frames'. Checked against timesteps that name their frame."""
    frames, tokens = 5, 3
    timestep = torch.arange(frames).repeat_interleave(tokens).unsqueeze(0).float()  # frame index, per token
    call = {"hidden_states": torch.zeros(1, 2, frames, 2, 2), "timestep": timestep}
    for start, stop in ((0, 3), (2, 5), (1, 4)):
        cut = window_call(call, 2, start, stop, frames)["timestep"].unflatten(1, (stop - start, tokens))
        assert torch.equal(cut[0, :, 0], torch.arange(start, stop).float()), (start, stop)


def test_cogvideox_windows_get_the_rotary_positions_of_a_clip_of_their_length(tiny_loaded):
    """Each window runs as a clip of its own: its rotary table is the one diffusers makes for that many latent
    frames (the first rows of the clip's frame-major table), computed here by diffusers itself."""
    loaded = tiny_loaded("cogvideox-i2v")
    calls = []
    transformer = loaded.pipe.transformer
    handle = transformer.register_forward_pre_hook(lambda m, a, k: calls.append(k), with_kwargs=True)
    try:
        run(loaded, request_for("cogvideox-i2v", window=0, overlap=0, steps=1))
    finally:
        handle.remove()
    kwargs = calls[0]
    frames = kwargs["hidden_states"].shape[1]
    spec = tiny_spec("cogvideox-i2v")
    for start, stop in ((0, 2), (frames - 2, frames)):
        expected = loaded.pipe._prepare_rotary_positional_embeddings(spec.height, spec.width, stop - start,
                                                                     kwargs["hidden_states"].device)
        cut = window_call(kwargs, 1, start, stop, frames)["image_rotary_emb"]
        assert all(torch.equal(a, b) for a, b in zip(cut, expected)), (start, stop)


def test_a_model_with_learned_positions_takes_windows_of_its_own_length_only(tiny_loaded):
    """CogVideoX-5b I2V (learned positional embeddings, sample_frames 49; the tiny one 9): diffusers builds an untrained
    sin-cos table for any other clip length, so a window of another length is refused; its own length runs."""
    loaded = tiny_loaded("cogvideox-i2v")
    with pytest.raises(ModelError, match=r"window=17: this model learned its positions for 9-frame clips.*window=9"):
        run(loaded, request_for("cogvideox-i2v", frames=25, window=17, overlap=8))
    assert run(loaded, request_for("cogvideox-i2v", frames=25, window=9, overlap=4)).receipt["windows"]
