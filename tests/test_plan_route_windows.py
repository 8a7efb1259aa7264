"""GET /vidmem/plan with the Sampler's context window: planned per window, refused as the Sampler refuses.

The chart must say what the run will do: a window that fits is planned at the window's peak, and a
window the Sampler would refuse is shown as the Sampler's own words, on the input it names.
"""

from __future__ import annotations

import pytest

from vidmem.memory.units import GiB
from vidmem.nodes.plan_route import PlanRequestError, parse_request, plan_answer
from vidmem.pipelines.family import ModelError
from vidmem.pipelines.sample import SampleRequest
from vidmem.pipelines.sample_checks import validate_request
from vidmem.pipelines.step_cache import StepCache
from vidmem.pipelines.tiny import tiny_spec

BUDGETS = (8 * GiB, 64 * GiB)
FBC = dict(cache_method="first_block_cache", cache_threshold="0.1", cache_retention="0.2", cache_max_skip_steps="3",
           cache_mag_ratios="auto")  # a Step Cache node on the Sampler's cache input


def query(model: str, width: int, height: int, frames: int, **change) -> dict:
    base = dict(model=model, dtype="bf16", offload="model", blocks_to_swap="0", prefetch_blocks="1",
                max_pinned_ram_gb="-1", non_blocking="true", text_encoder="cpu", vae_slicing="false",
                vae_tiling="true", tile_size="256", overlap="32", temporal_size="64", temporal_overlap="8",
                vram_budget_gb="8", ram_budget_gb="64", width=str(width), height=str(height), frames=str(frames),
                cfg="5")
    return base | {name: str(value) for name, value in change.items()}


def shipped_plan(config: str, width=832, height=480, frames=161, **change) -> dict:
    """A shipped config on meta (nothing read, nothing traced until planning)."""
    from vidmem.pipelines.configs import load_model

    request = parse_request(query(config, width, height, frames, **change), [config], ["bf16"])
    return plan_answer(request, lambda name, dtype: load_model(config, dtype), BUDGETS, device="cuda")


def denoise_bytes(plan: dict) -> int:
    row = plan["rows"][plan["chosen"]]
    return next(stage["vram_bytes"] for stage in row["stages"] if stage["name"] == "denoise")


def test_a_window_plans_the_denoise_peak_of_one_window_and_says_so():
    """Wan 2.1 1.3B, 832x480x161 under the model tier: 81-frame windows sharing 16 hold less on the
    GPU while denoising than the whole clip; latents and decode stay the clip's (the decode row equal)."""
    whole = shipped_plan("wan2.1-t2v-1.3b")
    windowed = shipped_plan("wan2.1-t2v-1.3b", window=81, window_overlap=16)
    assert whole["status"] == windowed["status"] == "ok", (whole, windowed)
    assert denoise_bytes(windowed) < denoise_bytes(whole)
    decode = [[s["vram_bytes"] for s in p["rows"][p["chosen"]]["stages"] if s["name"] == "decode"] for p in (whole, windowed)]
    assert decode[0] == decode[1]
    assert windowed["shape"] == {"width": 832, "height": 480, "frames": 161, "window": 81, "window_overlap": 16}
    (line,) = windowed["windows"]
    assert line.startswith("81-frame windows, overlap 16, of 161 frames: 3 windows a step"), line
    assert whole["shape"]["window"] == 0 and whole["windows"] == []


def test_a_window_covering_the_clip_is_planned_as_the_clip_with_the_samplers_note():
    whole = shipped_plan("wan2.1-t2v-1.3b", frames=81, **FBC)  # the cache's state planned in both
    covering = shipped_plan("wan2.1-t2v-1.3b", frames=81, window=81, **FBC)  # no windows: the cache may run
    assert covering["status"] == "ok", covering
    assert covering["rows"] == whole["rows"]
    assert covering["windows"] == ["window=81 covers all 81 frames: sampled as one clip, no windows."]


def test_a_step_cache_beside_windows_is_planned_per_window_with_its_time():
    """The Sampler runs a step cache beside windows (one cache state per window): the plan does too.
    MagCache computes the same steps in every window, so the share of the passes is the unwindowed
    one, and the time line scales the windowed plan's denoise stage (every window's passes) by it."""
    mag = dict(FBC, cache_method="mag_cache", cache_threshold="0")
    whole = shipped_plan("wan2.1-t2v-1.3b", **mag)
    windowed = shipped_plan("wan2.1-t2v-1.3b", window=81, window_overlap=16, **mag)
    assert whole["status"] == windowed["status"] == "ok", (whole, windowed)
    (line,) = [line for line in windowed["speed"] if line.startswith("step cache:")]
    (unwindowed,) = [line for line in whole["speed"] if line.startswith("step cache:")]
    computed = unwindowed.split("steps computed transformer ")[1].split(" (")[0]  # "23 of 50"
    assert f"steps computed transformer {computed} in each of the 3 context windows (each with its own cache state) (" \
        in line, (line, unwindowed)
    assert "Time with the cache: about x" in line, line
    fbc = shipped_plan("wan2.1-t2v-1.3b", window=81, window_overlap=16, **FBC)
    assert fbc["status"] == "ok" and any("in each of the 3 context windows" in s for s in fbc["speed"]), fbc


@pytest.mark.parametrize("change, name", [
    (dict(window="-4"), "window"), (dict(window="81.5"), "window"), (dict(window="2000"), "window"),
    (dict(window="81", window_overlap="x"), "window_overlap"), (dict(window_overlap="-1"), "window_overlap"),
])
def test_a_window_outside_the_samplers_range_is_named(change, name):
    with pytest.raises(PlanRequestError) as caught:
        parse_request(query("wan", 832, 480, 161, **change), ["wan"], ["bf16"])
    assert caught.value.name == name and f"{name}=" in str(caught.value)


def _sampler_refusal(loaded, variant: str, frames: int, window: int, overlap: int, cache: StepCache) -> str:
    """What the Sampler says to the same request on the loaded tiny pipeline (validate_request runs before anything moves)."""
    spec = tiny_spec(variant)
    request = SampleRequest("a cat", "", spec.width, spec.height, frames, 2, 5.0, 0, window=window,
                            window_overlap=overlap, cache=cache)
    with pytest.raises(ModelError) as caught:
        validate_request(loaded, request)
    return str(caught.value)


@pytest.mark.parametrize("variant, frames, window, overlap, cached, name", [
    ("wan2.1-t2v", 17, 8, 0, False, "window"),  # off Wan's 4k+1 grid
    ("wan2.1-t2v", 17, 9, 12, False, "window_overlap"),  # overlap not smaller than the window
    ("wan2.1-t2v", 17, 9, 2, False, "window_overlap"),  # not a whole latent frame
    ("wan2.1-t2v", 17, 0, 4, False, "window_overlap"),  # an overlap with no window
    ("cogvideox1.5-t2v", 17, 9, 0, False, "window"),  # CogVideoX 1.5's temporal patches
    ("ltx2-t2v", 17, 9, 4, False, "window"),  # a family that takes no windows
])
def test_a_window_the_sampler_refuses_is_answered_with_the_samplers_own_words(tiny_folder, tiny_loaded, variant, frames,
                                                                               window, overlap, cached, name):
    from vidmem.pipelines.configs import load_model

    spec = tiny_spec(variant)
    folder = tiny_folder(variant)
    q = query(variant, spec.width, spec.height, frames, window=window, window_overlap=overlap, **(FBC if cached else {}))
    plan = plan_answer(parse_request(q, [variant], ["bf16"]), lambda n, d: load_model(str(folder), d), BUDGETS)
    assert plan["status"] == "error" and plan["input"] == name, plan
    cache = StepCache("first_block_cache", 0.1) if cached else StepCache()
    assert plan["error"] == _sampler_refusal(tiny_loaded(variant), variant, frames, window, overlap, cache)


@pytest.mark.parametrize("config, expected", [
    ("ltx2-t2v-19b", "not supported for"), ("cogvideox1.5-5b", "CogVideoX 1.5 pads"),
])
def test_real_size_families_that_take_no_windows_show_the_refusal(config, expected):
    from vidmem.pipelines.configs import defaults

    size = defaults(config)
    plan = shipped_plan(config, size["width"], size["height"], 161, window=81, window_overlap=16)
    assert plan["status"] == "error" and plan["input"] == "window" and expected in plan["error"], plan
    assert "set window to 0" in plan["error"]


def test_hunyuanvideo15_takes_windows_on_the_chart():
    from vidmem.pipelines.configs import defaults

    size = defaults("hunyuanvideo1.5-t2v-480p")
    plan = shipped_plan("hunyuanvideo1.5-t2v-480p", size["width"], size["height"], 241, window=121, window_overlap=24)
    assert plan["status"] == "ok", plan
