"""Step-cache refusals come before ComfyUI is asked to make room (review: TaylorSeer's step arithmetic, per-expert
ratios and First Block Cache on a one-block model were refused only after make_room, when ComfyUI had already
unloaded its own models), and TaylorSeer's end steps bind the last denoiser that runs steps."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from backends import StrictBackend  # noqa: E402
from test_tiers import block_count, request_for  # noqa: E402
from vidmem.memory import MemoryStrategy  # noqa: E402
from vidmem.memory.strategy import StrategyError  # noqa: E402
from vidmem.pipelines.family import denoiser_blocks  # noqa: E402
from vidmem.pipelines.hooks import RunHooks  # noqa: E402
from vidmem.pipelines.sample import sample  # noqa: E402
from vidmem.pipelines.step_cache import StepCache, check_cache_fits, taylor_schedule  # noqa: E402

STEPS = 10
REFUSED = {
    "taylor leaves nothing to predict": (
        "wan2.1-t2v", StepCache("taylor_seer", warmup_steps=6, end_steps=4),
        "warmup_steps=6 and end_steps=4, which leave nothing to predict in 10 steps"),
    "per-expert ratios at another step count": (
        "wan2.1-t2v", StepCache("mag_cache", expert_ratios=(("transformer", (1.0,) * 10), ("transformer_2", (1.0,) * 10)),
                                ratio_steps=40),
        "measured per expert at 40 steps"),
    "per-expert ratios of another step split": (
        "wan2.2-a14b", StepCache("mag_cache", expert_ratios=(("transformer", (1.0,) * 3), ("transformer_2", (1.0,) * 7)),
                                 ratio_steps=10),
        "cover 3 steps of transformer, but with this sampler, shift and boundary_ratio it runs 4"),
    "first block cache on one block": (
        "cogvideox-t2v", StepCache("first_block_cache", threshold=0.9, retention=0.0),
        "first_block_cache decides after the first block whether to run the rest; transformer has 1 block"),
}


def _hook_names(module: torch.nn.Module) -> set[str]:
    registry = getattr(module, "_diffusers_hook", None)
    return set(registry.hooks) if registry is not None else set()


@pytest.mark.parametrize("variant, cache, message", REFUSED.values(), ids=REFUSED.keys())
def test_the_refusal_comes_before_room_is_made_and_leaves_nothing_applied(tiny_loaded, variant, cache, message):
    loaded = tiny_loaded(variant)
    rooms = []
    hooks = RunHooks(make_room=lambda nbytes, device, **_: rooms.append(nbytes))
    blocks = [b for group in denoiser_blocks(loaded.pipe, loaded.spec).values() for b in group]
    before = [(_hook_names(b), len(b._forward_hooks)) for b in blocks]
    request = replace(request_for(variant, steps=STEPS), cache=cache)
    with pytest.raises(StrategyError, match=message):
        sample(loaded, MemoryStrategy(offload="block_swap", blocks_to_swap=1), request, hooks, backend=StrictBackend())
    assert rooms == []  # refused before ComfyUI was asked to make room
    assert [(_hook_names(b), len(b._forward_hooks)) for b in blocks] == before
    assert not loaded.pipe.transformer.is_cache_enabled


def test_taylor_without_an_output_projection_is_refused_by_the_early_check():
    from test_step_cache import NoProjection

    bare = NoProjection()
    with pytest.raises(StrategyError, match=r"taylor_seer extrapolates .*\(NoProjection\) has no proj_out"):
        check_cache_fits(StepCache("taylor_seer"), {"transformer": bare}, {"transformer": bare.blocks}, STEPS)


@pytest.mark.parametrize("boundary_ratio", [0.005, 0.5])
def test_taylor_end_steps_bind_the_last_expert_that_runs_steps(tiny_loaded, boundary_ratio):
    """boundary_ratio 0.005 leaves Wan 2.2 A14B's low-noise expert no step: the high-noise one runs the run's last
    steps, which end_steps must compute (they were predicted)."""
    variant = "wan2.2-a14b"
    loaded = tiny_loaded(variant)
    cache = StepCache("taylor_seer", interval=3, warmup_steps=2, end_steps=2)
    passes = {"transformer": 0, "transformer_2": 0}
    handles = [getattr(loaded.pipe, name).register_forward_pre_hook(
        lambda m, args, name=name: passes.__setitem__(name, passes[name] + 1)) for name in passes]
    try:
        request = replace(request_for(variant, steps=STEPS), cache=cache, boundary_ratio=boundary_ratio)
        receipt = sample(loaded, MemoryStrategy(offload="none"), request, backend=StrictBackend()).receipt["cache"]
    finally:
        for handle in handles:
            handle.remove()
    steps = {name: count // 2 for name, count in passes.items()}  # cond and uncond per step
    assert sum(steps.values()) == STEPS and (steps["transformer_2"] == 0) == (boundary_ratio < 0.1)
    last = [name for name in steps if steps[name]][-1]
    expected = sum(sum(taylor_schedule(cache, steps[name], final=name == last)) * 2 * block_count(loaded)
                   for name in steps if steps[name])
    assert taylor_schedule(cache, steps[last], final=True)[-2:] == [True, True]
    assert receipt["blocks_computed"] == expected
