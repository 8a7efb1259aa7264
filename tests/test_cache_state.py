"""What a step cache keeps on the device between passes: planned (PlanOptions.cache_state) as the engine holds it.

diffusers' cache hooks keep hidden-state-sized tensors per cache context for a whole denoise (Wan 14B at
1280x720x81: 0.72 GiB each, four for MagCache under guidance). These tests read the tensors in the hooks'
states during a real tiny run and hold the planner's count to them, so that a plan, the room asked of the
host and activation_chunks=auto leave room for them.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.utils._pytree import tree_leaves

from backends import StrictBackend
from test_tiers import request_for
from vidmem.memory import MemoryStrategy
from vidmem.memory.accounting import rounded
from vidmem.memory.plan.stages import cache_state_bytes, denoise_stage, window_passes
from vidmem.memory.plan.types import CacheState, PlanOptions, VideoShape
from vidmem.pipelines.hooks import RunHooks
from vidmem.pipelines.planning import planner_model
from vidmem.pipelines.sample import sample
from vidmem.pipelines.step_cache import StepCache

STEPS = 8
CACHES = {
    "mag_cache": StepCache("mag_cache", mag_ratios=(1.0,) * STEPS, threshold=0.5),
    "first_block_cache": StepCache("first_block_cache", threshold=0.9, retention=0.0),
    "taylor_seer": StepCache("taylor_seer", interval=2, warmup_steps=1, order=2),
}


def held_state(denoiser: torch.nn.Module) -> dict[int, int]:
    """id -> bytes of every tensor in the cache hooks' states on `denoiser` and its modules (diffusers keeps
    one state per cache context in each hook's state manager; hooks of one cache share a manager)."""
    held = {}
    for module in denoiser.modules():
        registry = getattr(module, "_diffusers_hook", None)
        for hook in (registry.hooks.values() if registry is not None else ()):
            manager = getattr(hook, "state_manager", None)
            for state in (getattr(manager, "_state_cache", {}) or {}).values():
                for tensor in tree_leaves(vars(state)):
                    if isinstance(tensor, torch.Tensor) and tensor.numel() > 1:  # not scalars (errors, step counts)
                        held[id(tensor)] = tensor.numel() * tensor.element_size()
    return held


def run_reading_state(loaded, variant: str, cache: StepCache, read) -> None:
    request = replace(request_for(variant, steps=STEPS), cache=cache)
    sample(loaded, MemoryStrategy(offload="none"), request, backend=StrictBackend(), hooks=RunHooks(on_step=read))


def planned(loaded, variant: str, cache: StepCache) -> dict[str, int]:
    model, request = planner_model(loaded), request_for(variant)
    shape = VideoShape(request.width, request.height, request.frames, cfg=request.cfg > 1)
    return {name: sum(cache_state_bytes(model, shape, name, state))
            for name, state in cache.planned_state(model.layout.denoisers).items()}


@pytest.mark.parametrize("variant, method", [("wan2.1-t2v", method) for method in CACHES] + [
    ("cogvideox-t2v", "mag_cache"), ("cogvideox-t2v", "taylor_seer")])  # its one tiny block refuses first_block_cache
def test_the_plan_counts_the_state_the_cache_holds_between_passes(tiny_loaded, variant, method):
    """Late in the run (TaylorSeer has a factor of every order by then; MagCache lets go after the last step)
    the hooks hold what the plan counts; CogVideoX runs guidance as one batch (one context of two rows), Wan
    as two passes (two contexts)."""
    loaded = tiny_loaded(variant)
    denoiser = loaded.pipe.transformer
    seen = []
    run_reading_state(loaded, variant, CACHES[method],
                      lambda step, total: seen.append(sum(held_state(denoiser).values())) if step == STEPS - 2 else None)
    expected = planned(loaded, variant, CACHES[method])["transformer"]
    assert expected > 0 and seen == [expected]


def test_a_finished_expert_lets_its_state_go_at_the_hand_over(tiny_loaded):
    """Wan 2.2 A14B: once the low-noise expert takes over, the high-noise expert's state is gone, so the device
    holds one expert's state at a time, as the plan counts it (each expert's phase its own)."""
    loaded = tiny_loaded("wan2.2-a14b")
    experts = {"transformer": loaded.pipe.transformer, "transformer_2": loaded.pipe.transformer_2}
    seen = []
    run_reading_state(loaded, "wan2.2-a14b", CACHES["mag_cache"],
                      lambda step, total: seen.append({name: sum(held_state(m).values()) for name, m in experts.items()}))
    expected = planned(loaded, "wan2.2-a14b", CACHES["mag_cache"])
    assert expected["transformer"] == expected["transformer_2"] > 0
    first_low = next(i for i, held in enumerate(seen) if held["transformer_2"])
    assert 0 < first_low < STEPS - 1  # the run handed over mid-way
    assert all(held == {"transformer": expected["transformer"], "transformer_2": 0} for held in seen[:first_low - 1])
    assert all(held == {"transformer": 0, "transformer_2": expected["transformer_2"]} for held in seen[first_low:-1])


def test_the_denoise_phase_holds_the_state_beside_the_activations_not_as_weights(tiny_loaded):
    """The state is on the device through every denoiser phase: the peak grows by it, the weights do not
    (the room a host is asked for is the phase's bytes beyond its weights)."""
    loaded = tiny_loaded("wan2.1-t2v")
    model, request = planner_model(loaded), request_for("wan2.1-t2v")
    shape = VideoShape(request.width, request.height, request.frames, cfg=True)
    state = {"transformer": CacheState(hidden=2)}
    strategy = MemoryStrategy(offload="none")
    bare = denoise_stage(model, shape, strategy, PlanOptions(device="cuda"))
    cached = denoise_stage(model, shape, strategy, PlanOptions(device="cuda", cache_state=state))
    kept = sum(map(rounded, cache_state_bytes(model, shape, "transformer", state["transformer"])))
    assert kept > 0
    assert cached.phases[-1].weights_bytes == bare.phases[-1].weights_bytes
    assert cached.phases[-1].peak.allocated == bare.phases[-1].peak.allocated + kept


def test_each_context_window_keeps_its_own_state(tiny_loaded):
    """Windows each keep a state (pipelines/step_cache.py's WindowPasses): the windows' tokens, not the clip's."""
    loaded = tiny_loaded("wan2.1-t2v")
    model, request = planner_model(loaded), request_for("wan2.1-t2v")
    whole = VideoShape(request.width, request.height, 17, cfg=True)
    windowed = replace(whole, window=9, window_overlap=4)
    state = CacheState(hidden=2)
    windows = len(cache_state_bytes(model, windowed, "transformer", state)) // len(
        cache_state_bytes(model, whole, "transformer", state))
    assert windows == window_passes(model, windowed)[0] > 1
    assert cache_state_bytes(model, windowed, "transformer", state)[0] == cache_state_bytes(
        model, windowed.one_window(), "transformer", state)[0]


def test_the_advice_names_the_cache_when_its_state_is_what_does_not_fit(tiny_loaded):
    from vidmem.memory.plan.advice import nothing_fits_message
    from vidmem.memory.plan.candidates import candidate_plans, recommended

    loaded = tiny_loaded("wan2.1-t2v")
    model, request = planner_model(loaded), request_for("wan2.1-t2v")
    shape = VideoShape(request.width, request.height, request.frames, cfg=True)
    base = MemoryStrategy(offload="model")
    # named as the family declares its denoisers (Wan: both experts' names, whether this model has a second or not)
    options = PlanOptions(device="cuda", cache_state={name: CacheState(hidden=100_000)
                                                      for name in ("transformer", "transformer_2")})
    uncached = candidate_plans(model, shape, None, None, base, replace(options, cache_state=()))
    vram = max(p.peak_vram_bytes for p in uncached)  # everything fits uncached; nothing beside ~0.9 GB of state
    ram = max(p.peak_ram_bytes for p in uncached)
    plans = candidate_plans(model, shape, vram, ram, base, options)
    assert recommended(plans) is None
    message = nothing_fits_message(model, shape, plans, base, options)
    assert "The step cache keeps" in message and "with the cache off" in message


def test_the_strategy_nodes_plan_holds_the_connected_caches_state():
    """GET /vidmem/plan with a Step Cache on the Sampler's cache input: each row's denoise holds the cache's state
    (First Block Cache: three hidden-state tensors per guidance pass; Wan 2.1 1.3B at 832x480x81, 94 MiB each)."""
    from test_plan_route_windows import FBC, shipped_plan

    whole = shipped_plan("wan2.1-t2v-1.3b", frames=81)
    cached = shipped_plan("wan2.1-t2v-1.3b", frames=81, **FBC)
    state = 3 * 2 * 32760 * 1536 * 2  # tensors x guidance passes x tokens x width x bf16
    by_label = {row["label"]: row for row in whole["rows"]}
    for row in cached["rows"]:
        after = {stage["name"]: stage["vram_bytes"] for stage in row["stages"]}
        before = {stage["name"]: stage["vram_bytes"] for stage in by_label[row["label"]]["stages"]}
        assert state <= after["denoise"] - before["denoise"] <= state * 1.05, row["label"]
        assert after["decode"] == before["decode"]  # the state goes with the denoise
