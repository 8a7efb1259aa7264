"""Step caches on the two families whose blocks diffusers 0.42.1's block registry does not know.

HunyuanVideo 1.5's block fits the contract of diffusers' First Block Cache and MagCache hooks, so vidmem
registers it: the caches run there, give every tier the same latent and skip. LTX-2's block returns
video and audio hidden states, which the hooks cannot carry: First Block Cache and MagCache are refused
by name before anything is placed or made room for, and every message that names a cache offers only
what works for the family; TaylorSeer runs on both."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from backends import StrictBackend
from test_tiers import request_for
from vidmem.memory import MemoryStrategy
from vidmem.memory.strategy import StrategyError
from vidmem.pipelines.family import denoiser_blocks
from vidmem.pipelines.hooks import RunHooks
from vidmem.pipelines.sample import sample
from vidmem.pipelines.step_cache import StepCache, cache_plan, cache_with_ratios, layout_key, model_key

REFUSAL = "first_block_cache / mag_cache need diffusers' block metadata, which {} lacks; choose taylor_seer or off"
FAMILIES = {"ltx2-t2v": "LTX2VideoTransformerBlock"}  # the refused ones, by the block class named
HY15 = "hunyuanvideo1.5-t2v"
STEPS = 6
CACHES = {"first_block_cache": StepCache("first_block_cache", threshold=0.5),
          "mag_cache": StepCache("mag_cache", mag_ratios=(1.0,) * STEPS, threshold=0.5),
          "mag_cache calibrate": StepCache("mag_cache", calibrate=True)}


def _hook_names(module: torch.nn.Module) -> set[str]:
    registry = getattr(module, "_diffusers_hook", None)
    return set(registry.hooks) if registry is not None else set()


@pytest.mark.parametrize("cache", CACHES.values(), ids=CACHES.keys())
@pytest.mark.parametrize("variant", FAMILIES)
def test_the_cache_is_refused_by_name_before_room_is_made(tiny_loaded, variant, cache):
    loaded = tiny_loaded(variant)
    rooms = []
    hooks = RunHooks(make_room=lambda nbytes, device, **_: rooms.append(nbytes))
    request = replace(request_for(variant, steps=STEPS), cache=cache)
    blocks = [b for group in denoiser_blocks(loaded.pipe, loaded.spec).values() for b in group]
    before = [_hook_names(b) for b in blocks]
    with pytest.raises(StrategyError, match=REFUSAL.format(FAMILIES[variant])):
        sample(loaded, MemoryStrategy(offload="block_swap", blocks_to_swap=1), request, hooks, backend=StrictBackend())
    assert rooms == []  # refused before make_room asked the host for anything
    assert [_hook_names(b) for b in blocks] == before and not loaded.pipe.transformer.is_cache_enabled


@pytest.mark.parametrize("variant", [*FAMILIES, HY15])
def test_taylor_seer_still_runs_and_skips_there(tiny_loaded, variant):
    loaded = tiny_loaded(variant)
    cache = StepCache("taylor_seer", interval=2, warmup_steps=1)
    request = replace(request_for(variant, steps=4), cache=cache)
    results = [sample(loaded, strategy, request, backend=StrictBackend())
               for strategy in (MemoryStrategy(offload="none"), MemoryStrategy(offload="block_swap", blocks_to_swap=1))]
    assert results[0].receipt["cache"]["blocks_skipped"] > 0
    assert torch.equal(results[0].latent["samples"], results[1].latent["samples"])


@pytest.mark.parametrize("ratios", ["auto", "calibrate"])
@pytest.mark.parametrize("variant", FAMILIES)
def test_the_step_cache_nodes_ratios_offer_only_what_works(tiny_loaded, variant, ratios):
    """'auto' used to advise 'calibrate ... or choose first_block_cache', neither of which runs there."""
    loaded = tiny_loaded(variant)
    with pytest.raises(StrategyError, match=REFUSAL.format(FAMILIES[variant])):
        cache_with_ratios(StepCache("mag_cache", mag_ratios=(1.0,)), loaded, ratios, None)
    with pytest.raises(StrategyError, match=REFUSAL.format(FAMILIES[variant])):
        cache_with_ratios(StepCache("first_block_cache"), loaded, ratios, None)


@pytest.mark.parametrize("variant", FAMILIES)
def test_the_plan_refuses_them_instead_of_promising_a_calibration(tiny_loaded, variant):
    loaded = tiny_loaded(variant)
    layout, names = model_key(loaded), list(denoiser_blocks(loaded.pipe, loaded.spec))
    for cache, ratios in ((None, "auto"), (StepCache("mag_cache", calibrate=True), "calibrate"),
                          (StepCache("first_block_cache"), "auto")):
        text = cache_plan(layout, 8, names, cache, ratios).text
        assert REFUSAL.format(FAMILIES[variant]) in text and "calibrate" not in text, text
    taylor = cache_plan(layout, 8, names, StepCache("taylor_seer", interval=2, warmup_steps=1)).text
    assert taylor.startswith("taylor_seer") and "block metadata" not in taylor


HY15_TIERS = {"none": MemoryStrategy(offload="none"), "model": MemoryStrategy(offload="model"),
              "block_swap:1:1": MemoryStrategy(offload="block_swap", blocks_to_swap=1, prefetch_blocks=1),
              "sequential": MemoryStrategy(offload="sequential", prefetch_blocks=1)}


@pytest.mark.parametrize("cache", [CACHES["first_block_cache"], CACHES["mag_cache"]], ids=["first_block_cache", "mag_cache"])
def test_hunyuan_video15_runs_them_the_same_on_every_tier_and_skips(tiny_loaded, cache):
    loaded = tiny_loaded(HY15)
    request = replace(request_for(HY15, steps=STEPS), cache=cache)
    results = {name: sample(loaded, strategy, request, backend=StrictBackend()) for name, strategy in HY15_TIERS.items()}
    reference = results["none"]
    assert reference.receipt["cache"]["blocks_skipped"] > 0
    for name, result in results.items():
        assert torch.equal(result.latent["samples"], reference.latent["samples"]), name
        assert result.receipt["cache"]["blocks_computed"] == reference.receipt["cache"]["blocks_computed"], name
    uncached = sample(loaded, HY15_TIERS["none"], replace(request, cache=StepCache()), backend=StrictBackend())
    assert not torch.equal(uncached.latent["samples"], reference.latent["samples"])


def test_hunyuan_video15_never_skipping_equals_the_uncached_run(tiny_loaded):
    """With nothing skipped the hooks change nothing: what they hand on is what the blocks computed."""
    loaded = tiny_loaded(HY15)
    request = request_for(HY15, steps=STEPS)
    uncached = sample(loaded, MemoryStrategy(), request, backend=StrictBackend())
    for cache in (StepCache("first_block_cache", threshold=1e-12), StepCache("mag_cache", calibrate=True)):
        cached = sample(loaded, MemoryStrategy(), replace(request, cache=cache), backend=StrictBackend())
        assert cached.receipt["cache"]["blocks_skipped"] == 0
        assert torch.equal(cached.latent["samples"], uncached.latent["samples"]), cache.method


def test_hunyuan_video15_plans_them_like_any_registered_family(tiny_loaded):
    loaded = tiny_loaded(HY15)
    layout, names = model_key(loaded), list(denoiser_blocks(loaded.pipe, loaded.spec))
    assert "block metadata" not in cache_plan(layout, 8, names, StepCache("first_block_cache")).text
    assert "'calibrate' measures" in cache_plan(layout, 8, names).text  # no published ratios: calibrate works there


def test_families_whose_blocks_diffusers_knows_keep_their_plans():
    wan = layout_key("WanPipeline", {"transformer": (30, {"num_attention_heads": 12, "attention_head_dim": 128})})
    assert "block metadata" not in cache_plan(wan, 50, ["transformer"], StepCache("first_block_cache")).text
    assert "block metadata" not in cache_plan(wan, 50, ["transformer"]).text


def test_vidmem_plan_says_mag_cache_does_not_run_on_ltx2(capsys):
    from vidmem.cli import main

    main(["plan", "--model", "ltx2-t2v-19b", "--cache", "mag_cache", "--vram", "24", "--ram", "64"])
    out = capsys.readouterr().out
    assert REFUSAL.format("LTX2VideoTransformerBlock") in out and "'calibrate' measures" not in out


def test_a_diffusers_without_hunyuan_video15_still_checks_other_families(monkeypatch, tiny_loaded):
    """The pack allows diffusers 0.35, which has no HunyuanVideo 1.5 module: registering its block is skipped,
    and a Wan block (which diffusers knows) is still found, instead of a raw ModuleNotFoundError."""
    import sys
    import types

    from vidmem.pipelines.step_cache import blocks_without_metadata

    wan = tiny_loaded("wan2.1-t2v")
    blocks = {type(block) for block_list in denoiser_blocks(wan.pipe, wan.spec).values() for block in block_list}
    # diffusers' transformers package as 0.35 has it: no such submodule to find
    monkeypatch.setitem(sys.modules, "diffusers.models.transformers", types.ModuleType("diffusers.models.transformers"))
    monkeypatch.delitem(sys.modules, "diffusers.models.transformers.transformer_hunyuan_video15", raising=False)
    assert blocks_without_metadata(blocks) == []
