"""A step cache beside context windows (pipelines/step_cache.py `WindowPasses`): one cache state per
window, so each window's step is compared with the same window's step before. Every tier gives tier
none's frames (the strict backend poisons evicted weights: a block computed with weights the cache
said it would skip ruins the latent), a window covering the clip is the cached clip, a cache that
never skips changes nothing, and no window's decisions depend on another window's passes."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from backends import StrictBackend
from test_context_windows import request_for
from test_tiers import block_count
from vidmem.memory import MemoryStrategy
from vidmem.pipelines.context_windows import HOOK_NAME, WINDOW_PASSES_HOOK
from vidmem.pipelines.family import denoisers
from vidmem.pipelines.sample import sample
from vidmem.pipelines.step_cache import StepCache, current_cache_context, mag_schedule

STEPS = 10
VARIANT = "wan2.1-t2v"  # 17 frames in windows of 9 sharing 4: latent frames 0-3 and 2-5, two windows
WINDOWS = 2
FIRST_BLOCK = StepCache("first_block_cache", threshold=0.9, retention=0.0)  # bold: skips on random weights
MAG = StepCache("mag_cache", mag_ratios=(1.0,) * STEPS, threshold=0.5, retention=0.2, max_skip_steps=3)
TAYLOR = StepCache("taylor_seer", interval=3, warmup_steps=2, end_steps=1, order=2)
CACHES = {"first_block_cache": FIRST_BLOCK, "mag_cache": MAG, "taylor_seer": TAYLOR}
# Caches that never skip: First Block Cache's first block never changes this little between steps,
# MagCache keeps every step (retention 1), TaylorSeer computes one step in one.
NEVER_SKIP = {"first_block_cache": replace(FIRST_BLOCK, threshold=1e-12), "mag_cache": replace(MAG, retention=1.0),
              "taylor_seer": replace(TAYLOR, interval=1)}  # TaylorSeer: one step in 1 computed


def run(loaded, cache, strategy=MemoryStrategy(offload="none"), **changes):
    request = replace(request_for(VARIANT, steps=STEPS, cache=cache), **changes)
    return sample(loaded, strategy, request, backend=StrictBackend())


def swap_tiers(loaded) -> dict[str, MemoryStrategy]:
    return {f"block_swap:{n}:{p}": MemoryStrategy(offload="block_swap", blocks_to_swap=n, prefetch_blocks=p)
            for n in sorted({1, block_count(loaded)}) for p in (0, 1)}


def assert_nothing_left(loaded) -> None:
    for module in denoisers(loaded.pipe, loaded.spec).values():
        assert not module.is_cache_enabled
        registry = getattr(module, "_diffusers_hook", None)
        assert registry is None or all(registry.get_hook(name) is None for name in (HOOK_NAME, WINDOW_PASSES_HOOK))


@pytest.mark.parametrize("method", CACHES)
def test_windows_and_a_cache_give_tier_nones_frames_under_block_swap(tiny_loaded, method):
    loaded, cache = tiny_loaded(VARIANT), CACHES[method]
    reference = run(loaded, cache)
    counted = reference.receipt["cache"]
    assert counted["blocks_skipped"] > 0, "the test's cache must skip something"
    assert reference.receipt["windows"]["windows"] == ["0-3", "2-5"]
    passes = reference.receipt["windows"]["passes"]  # window passes: steps x windows x (cond, uncond)
    assert counted["blocks_computed"] + counted["blocks_skipped"] == passes * block_count(loaded)
    assert sum(counted["blocks_computed_per_window"]) == counted["blocks_computed"]
    assert sum(counted["blocks_skipped_per_window"]) == counted["blocks_skipped"]
    for name, strategy in swap_tiers(loaded).items():
        result = run(loaded, cache, strategy)
        assert torch.equal(result.latent["samples"], reference.latent["samples"]), name
        assert result.receipt["cache"]["blocks_computed_per_window"] == counted["blocks_computed_per_window"], name
    assert not torch.equal(run(loaded, StepCache()).latent["samples"], reference.latent["samples"])  # it skipped
    assert_nothing_left(loaded)


@pytest.mark.parametrize("variant", ["wan2.1-i2v", "wan2.2-a14b", "cogvideox-t2v"])
def test_other_families_windowed_and_cached_give_tier_nones_frames_on_every_tier(tiny_loaded, variant):
    """I2V's condition channels, Wan 2.2's two experts (each with its windows and states), CogVideoX's
    one batched pass a step ("cond_uncond:window0"): model, block swap and sequential give tier none's frames."""
    loaded = tiny_loaded(variant)
    request = request_for(variant, steps=STEPS, cache=MAG)
    reference = sample(loaded, MemoryStrategy(offload="none"), request, backend=StrictBackend())
    counted = reference.receipt["cache"]
    assert counted["blocks_skipped"] > 0 and len(counted["blocks_computed_per_window"]) == WINDOWS
    for strategy in (MemoryStrategy(offload="model"), MemoryStrategy(offload="sequential", prefetch_blocks=1),
                     MemoryStrategy(offload="block_swap", blocks_to_swap=block_count(loaded), prefetch_blocks=1)):
        result = sample(loaded, strategy, request, backend=StrictBackend())
        assert torch.equal(result.latent["samples"], reference.latent["samples"]), strategy.offload
        assert result.receipt["cache"]["blocks_computed"] == counted["blocks_computed"], strategy.offload
    assert_nothing_left(loaded)


@pytest.mark.parametrize("prefetch", [0, 1])
def test_a_skipped_window_pass_copies_nothing_under_block_swap(tiny_loaded, prefetch):
    """MagCache's look-ahead works per window: with every block swapped, the copies are those of the
    window passes that compute (and, with prefetch, the next call's opening block), none for the rest."""
    loaded = tiny_loaded(VARIANT)
    blocks = block_count(loaded)
    result = run(loaded, MAG, MemoryStrategy(offload="block_swap", blocks_to_swap=blocks, prefetch_blocks=prefetch))
    counted = result.receipt["cache"]
    computed_passes = sum(mag_schedule(MAG, STEPS)) * 2 * WINDOWS  # cond and uncond, in each window
    assert counted["blocks_computed"] == computed_passes * blocks
    assert counted["streamed_copies"] == computed_passes * blocks + prefetch
    assert counted["streamed_copies_skipped"] == counted["blocks_skipped"]


def test_a_window_covering_the_clip_is_the_cached_clip(tiny_loaded):
    loaded = tiny_loaded(VARIANT)
    for cache in CACHES.values():
        whole = run(loaded, cache, window=0, window_overlap=0)
        covering = run(loaded, cache, window=17, window_overlap=0)
        assert torch.equal(whole.latent["samples"], covering.latent["samples"])
        assert covering.receipt["cache"] == whole.receipt["cache"]  # no per-window counts: one clip
        assert covering.receipt["windows"]["note"].startswith("window=17 covers all 17 frames")


def test_one_window_over_the_clip_through_the_hook_is_the_cached_clip(tiny_loaded, monkeypatch):
    """The windows hook itself, with a single window spanning every latent frame (what the Sampler
    never builds: it samples the clip unwindowed), runs the cache in the window's own state and gives
    the cached clip bit for bit."""
    from vidmem.memory.windows import WindowSchedule
    from vidmem.pipelines import sample as sampling
    from vidmem.pipelines.context_windows import context_windows

    loaded = tiny_loaded(VARIANT)
    whole = run(loaded, MAG, window=0, window_overlap=0)

    def one_window(loaded, request, *_resume):  # the run's windows, as one window over the 5 latent frames
        return context_windows(denoisers(loaded.pipe, loaded.spec), loaded.spec.name, WindowSchedule(5, 5, 0))

    monkeypatch.setattr(sampling, "windows_for_call", one_window)
    windowed = run(loaded, MAG, window=0, window_overlap=0)
    assert windowed.receipt["windows"]["passes"] == 2 * STEPS
    assert windowed.receipt["cache"]["blocks_computed_per_window"] == [whole.receipt["cache"]["blocks_computed"]]
    assert torch.equal(whole.latent["samples"], windowed.latent["samples"])


@pytest.mark.parametrize("method", NEVER_SKIP)
def test_a_cache_that_never_skips_leaves_the_windowed_run_bit_for_bit(tiny_loaded, method):
    loaded = tiny_loaded(VARIANT)
    alone = run(loaded, StepCache())
    cached = run(loaded, NEVER_SKIP[method])
    assert cached.receipt["cache"]["blocks_skipped"] == 0
    assert torch.equal(alone.latent["samples"], cached.latent["samples"])


def observed_passes(loaded, cache) -> dict[str, list[bool]]:
    """Cache context -> whether each of its passes computed its last block, in order."""
    transformer = loaded.pipe.transformer
    tail = transformer.blocks[-1]
    passes: dict[str, list[bool]] = {}
    opened = []

    def open_pass(module, args):
        context = current_cache_context(transformer)
        opened.append(context.name)
        passes.setdefault(context.name, []).append(False)

    def computed(module, args, out):  # a child of the tail block runs only when the block computes
        passes[opened[-1]][-1] = True

    handles = [transformer.blocks[0].register_forward_pre_hook(open_pass),
               tail.norm2.register_forward_hook(computed)]
    try:
        run(loaded, cache)
    finally:
        for handle in handles:
            handle.remove()
    return passes


def test_each_window_takes_magcaches_decisions_from_its_own_steps_alone(tiny_loaded):
    """MagCache decides from its ratios and its own step count: in every window and cache context,
    the pass at step s computes exactly when an unwindowed run's pass at step s does. Shared between
    windows, one state would count two passes a step and skip on another schedule."""
    passes = observed_passes(tiny_loaded(VARIANT), MAG)
    expected = mag_schedule(MAG, STEPS)
    assert sorted(passes) == sorted(f"{c}:window{w}" for c in ("cond", "uncond") for w in range(WINDOWS))
    assert not all(expected)
    for context, computed in passes.items():
        assert computed == expected, context


def test_each_window_counts_taylor_seers_steps_alone_and_copies_only_computed_passes(tiny_loaded):
    """TaylorSeer counts the passes of each window and cache context: the pass at step s computes
    exactly when an unwindowed run's does (one count shared by the windows would run twice as fast and
    predict on another schedule); with every block swapped, only computed window passes copy."""
    from vidmem.pipelines.step_cache import taylor_schedule

    loaded = tiny_loaded(VARIANT)
    expected = taylor_schedule(TAYLOR, STEPS)
    passes = observed_passes(loaded, TAYLOR)
    assert sorted(passes) == sorted(f"{c}:window{w}" for c in ("cond", "uncond") for w in range(WINDOWS))
    assert not all(expected) and all(computed == expected for computed in passes.values()), passes
    blocks = block_count(loaded)
    counted = run(loaded, TAYLOR, MemoryStrategy(offload="block_swap", blocks_to_swap=blocks, prefetch_blocks=1)).receipt["cache"]
    computed_passes = sum(expected) * 2 * WINDOWS
    assert counted["blocks_computed"] == computed_passes * blocks
    assert counted["streamed_copies"] == computed_passes * blocks + 1  # + the next call's opening block
    assert counted["streamed_copies_skipped"] == counted["blocks_skipped"]


def test_first_block_cache_compares_a_window_only_with_itself(tiny_loaded):
    """A window's first pass has nothing of its own to compare with, so it computes; after that, the
    windows skip on their own evidence (their decisions differ somewhere). Shared between windows, the
    second window's first pass would be compared with the first window's and could skip."""
    passes = observed_passes(tiny_loaded(VARIANT), FIRST_BLOCK)
    assert len(passes) == 2 * WINDOWS
    for context, computed in passes.items():
        assert len(computed) == STEPS and computed[0], context
        assert not all(computed), context  # the threshold skips in every window


def test_the_plans_cached_time_scales_every_window_pass():
    """The plan's denoise stage counts a pass per window (steps x cfg passes x windows); the cache's
    time line scales all of them by the share computed, as each window skips the same steps."""
    from vidmem.memory.plan.planner import PlanOptions, VideoShape, plan_run
    from vidmem.pipelines.configs import load_model
    from vidmem.pipelines.step_cache import cached_time_line

    plan = plan_run(load_model("wan2.1-t2v-1.3b", "bf16"), VideoShape(832, 480, 161, window=81, window_overlap=16),
                    MemoryStrategy(offload="block_swap", blocks_to_swap=15), PlanOptions(steps=50, device="cuda"))
    (work,) = [w for w in plan.stage("denoise").work if w.passes > 1]
    assert work.passes == 50 * 2 * 3  # cond and uncond, three windows
    whole = plan.seconds_with_denoise_share(1.0)
    denoise = whole - plan.seconds_with_denoise_share(0.0)
    assert 0 < denoise < whole
    assert f"about x{(whole - 0.6 * denoise) / whole:.2f} of the same run uncached" in cached_time_line(plan, 0.4)


def test_a_calibration_run_with_windows_measures_the_first_windows_ratios(tiny_loaded):
    loaded = tiny_loaded(VARIANT)
    counted = run(loaded, StepCache("mag_cache", calibrate=True)).receipt["cache"]
    ratios = counted["mag_ratios"]["transformer"]
    assert counted["blocks_skipped"] == 0 and len(ratios) == STEPS and ratios[0] == 1.0
    assert all(r > 0 for r in ratios)


def test_windows_and_the_cache_are_removed_when_the_run_fails(tiny_loaded):
    from vidmem.pipelines.hooks import RunHooks

    loaded = tiny_loaded(VARIANT)
    before = run(loaded, MAG)

    def stop(step, total):
        if step == 3:
            raise RuntimeError("stop")

    request = request_for(VARIANT, steps=STEPS, cache=MAG)
    with pytest.raises(RuntimeError, match="stop"):
        sample(loaded, MemoryStrategy(offload="block_swap", blocks_to_swap=1), request, RunHooks(on_step=stop),
               backend=StrictBackend())
    assert_nothing_left(loaded)
    assert current_cache_context(loaded.pipe.transformer) is None
    assert torch.equal(run(loaded, MAG).latent["samples"], before.latent["samples"])  # no state carried over


@pytest.mark.parametrize("method", CACHES)
def test_the_cuda_path_keeps_its_promises_with_windows_and_the_cache(tiny_folder, monkeypatch, method):
    """CudaBackend under the recording CUDA fake (tests/test_cuda_path.py's audit), windowed and
    cached: copies on the side stream, compute waiting only on the block it runs, at most prefetch + 2
    streamed groups on the device, and the CPU backend's latent at tier none."""
    from test_step_cache import assert_cuda_path_with_the_cache
    from vidmem.pipelines.loader import load_pipeline

    assert_cuda_path_with_the_cache(load_pipeline(tiny_folder(VARIANT), "fp32"),
                                    request_for(VARIANT, steps=STEPS, cache=CACHES[method]), monkeypatch)
