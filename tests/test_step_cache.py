"""Step caching (pipelines/step_cache.py): diffusers' First Block Cache and MagCache on the tiny
pipelines, under every tier. The strict backend poisons evicted weights, so a block that computed
with weights the engine did not copy (because the cache was said to skip it) would ruin the latent:
every tier's latent must equal tier none's, bit for bit, with caching on.
"""

from __future__ import annotations

import re

from dataclasses import replace

import pytest
import torch

from backends import StrictBackend
from test_tiers import block_count, request_for
from vidmem.memory import MemoryStrategy
from vidmem.memory.strategy import StrategyError
from vidmem.pipelines.family import ModelError, denoiser_blocks
from vidmem.pipelines.hook_attributes import as_found
from vidmem.pipelines.sample import sample
from vidmem.pipelines.step_cache import CacheMethod, StepCache

STEPS = 10
FIRST_BLOCK = StepCache("first_block_cache", threshold=0.9, retention=0.0)  # bold: skips on random weights
MAG = StepCache("mag_cache", mag_ratios=(1.0,) * STEPS, threshold=0.5, retention=0.2, max_skip_steps=3)
TAYLOR = StepCache("taylor_seer", interval=3, warmup_steps=2, end_steps=1, order=2)  # computes 6 of 10 steps


def schedule(cache, steps=STEPS) -> list[bool]:
    """The steps a foreseen cache computes (True): MagCache's and TaylorSeer's, from diffusers' own hooks."""
    from vidmem.pipelines.step_cache import mag_schedule, taylor_schedule

    return taylor_schedule(cache, steps) if cache.method is CacheMethod.TAYLOR else mag_schedule(cache, steps)


def tiers(loaded) -> dict[str, MemoryStrategy]:
    blocks = block_count(loaded)
    return {"none": MemoryStrategy(offload="none"), "model": MemoryStrategy(offload="model"),
            **{f"block_swap:{n}:{p}": MemoryStrategy(offload="block_swap", blocks_to_swap=n, prefetch_blocks=p)
               for n in sorted({1, blocks}) for p in (0, 1)},
            "sequential": MemoryStrategy(offload="sequential", prefetch_blocks=1)}


def run(loaded, variant, strategy, cache, steps=STEPS):
    request = replace(request_for(variant, steps=steps), cache=cache)
    return sample(loaded, strategy, request, backend=StrictBackend())


@pytest.mark.parametrize("cache", [FIRST_BLOCK, MAG, TAYLOR], ids=["first_block_cache", "mag_cache", "taylor_seer"])
@pytest.mark.parametrize("variant", ["wan2.1-t2v", "cogvideox-t2v", "wan2.2-a14b"])
def test_every_tier_gives_tier_nones_latent_with_caching_on(tiny_loaded, variant, cache):
    loaded = tiny_loaded(variant)
    if cache.method is CacheMethod.FIRST_BLOCK and block_count(loaded) < 2:
        with pytest.raises(StrategyError, match="first_block_cache decides after the first block"):
            run(loaded, variant, MemoryStrategy(offload="none"), cache)
        assert not loaded.pipe.transformer.is_cache_enabled  # nothing left half-applied
        return
    results = {name: run(loaded, variant, strategy, cache) for name, strategy in tiers(loaded).items()}
    reference = results["none"]
    assert reference.receipt["cache"]["blocks_skipped"] > 0, "the test's cache must skip something"
    for name, result in results.items():
        assert torch.equal(result.latent["samples"], reference.latent["samples"]), name
        assert result.receipt["cache"]["blocks_computed"] == reference.receipt["cache"]["blocks_computed"], name
    uncached = run(loaded, variant, MemoryStrategy(offload="none"), StepCache())
    assert not torch.equal(uncached.latent["samples"], reference.latent["samples"])  # the cache changed something
    assert "cache" not in uncached.receipt


def run_observed(loaded, variant, strategy, cache):
    """A run, and what the engine copied pass by pass: one list of (kind, group) per denoiser pass."""
    passes: list[list[tuple[str, str]]] = []
    marker = loaded.pipe.transformer.register_forward_pre_hook(lambda m, args: passes.append([]))
    try:
        request = replace(request_for(variant, steps=STEPS), cache=cache)
        observer = lambda kind, group: passes[-1].append((kind, group.name)) if passes and group.streamed else None
        result = sample(loaded, strategy, request, backend=StrictBackend(), observer=observer)
    finally:
        marker.remove()
    return result, passes


@pytest.mark.parametrize("cache", [MAG, TAYLOR], ids=["mag_cache", "taylor_seer"])
@pytest.mark.parametrize("prefetch", [0, 1])
@pytest.mark.parametrize("swapped", ["one", "all"])
def test_a_skipped_pass_copies_nothing_and_the_next_computed_pass_finds_its_blocks(tiny_loaded, swapped, prefetch,
                                                                                   cache):
    """MagCache's and TaylorSeer's decisions are foreseen: under block swap a skipped pass copies no
    block weight, not even the first block's, and the pass before it prefetches nothing for it; the
    computed pass after it still finds its first block prefetched (with prefetch), copied at the end
    of the skipped pass."""
    variant = "wan2.1-t2v"
    loaded = tiny_loaded(variant)
    blocks = block_count(loaded)
    swap = blocks if swapped == "all" else 1
    strategy = MemoryStrategy(offload="block_swap", blocks_to_swap=swap, prefetch_blocks=prefetch)
    result, passes = run_observed(loaded, variant, strategy, cache)
    computes = [step for step in schedule(cache) for _ in range(2)]  # cfg: cond and uncond per step
    assert len(passes) == len(computes) and not all(computes)
    opening = f"transformer.blocks.{blocks - swap}"
    for index, (events, computed) in enumerate(zip(passes, computes)):
        copies = [(kind, name) for kind, name in events if kind in ("onload", "prefetch")]
        if computed:
            on_demand = [name for kind, name in copies if kind == "onload"]
            # Only the very first pass (or one without prefetch) waits for a copy of its opening block.
            assert on_demand == ([] if index and prefetch else on_demand), (index, events)
            continue
        following = computes[index + 1] if index + 1 < len(computes) else True  # the next call's first pass computes
        # A skipped pass copies nothing for itself; at its end it prefetches for a computed next pass.
        assert copies == ([("prefetch", opening)] if prefetch and following else []), (index, events)
    cache = result.receipt["cache"]
    computed_passes = sum(computes)
    assert cache["blocks_skipped"] == (len(computes) - computed_passes) * blocks
    assert cache["streamed_copies"] == computed_passes * swap + (1 if prefetch else 0)  # + the next call's opening
    assert cache["streamed_copies_skipped"] == (len(computes) - computed_passes) * swap


@pytest.mark.parametrize("cache", [MAG, TAYLOR], ids=["mag_cache", "taylor_seer"])
def test_the_disk_tier_copies_nothing_for_a_skipped_pass_either(tiny_folder, cache):
    """Weights memory-mapped from the folder's files stream through the same schedule: a skipped pass
    reads no block from the file, and the latent is tier none's (of the same mapped pipeline)."""
    from vidmem.memory.storage import is_file_backed
    from vidmem.pipelines.loader import load_pipeline

    variant = "wan2.1-t2v"
    mapped = load_pipeline(tiny_folder(variant), "fp32", weight_dtype="fp32")
    assert mapped.on_disk and is_file_backed(mapped.pipe.transformer.blocks[0].attn1.to_q.weight)
    blocks = block_count(mapped)
    strategy = MemoryStrategy(offload="block_swap", blocks_to_swap=blocks, prefetch_blocks=1)
    result, passes = run_observed(mapped, variant, strategy, cache)
    computes = [step for step in schedule(cache) for _ in range(2)]
    for index, (events, computed) in enumerate(zip(passes, computes)):
        copies = [(kind, name) for kind, name in events if kind in ("onload", "prefetch")]
        if not computed:
            following = computes[index + 1] if index + 1 < len(computes) else True
            assert copies == ([("prefetch", "transformer.blocks.0")] if following else []), (index, events)
    reference = run(mapped, variant, MemoryStrategy(offload="none"), cache)
    assert torch.equal(result.latent["samples"], reference.latent["samples"])
    assert result.receipt["cache"]["streamed_copies"] == sum(computes) * blocks + 1


@pytest.mark.parametrize("swapped", ["one", "all"])
def test_first_block_cache_copies_only_the_deciding_block_in_a_skipped_pass(tiny_loaded, swapped):
    """First Block Cache decides from its first block's output: that block is copied (it computes on
    every pass); the blocks after it are held until it has decided, so a skipped pass copies no other.
    Blocks prefetched for the next pass stay through the passes that skip them: no pass but the
    first waits for a copy of its first swapped block."""
    variant = "wan2.1-t2v"
    loaded = tiny_loaded(variant)
    blocks = denoiser_blocks(loaded.pipe, loaded.spec)["transformer"]
    leaf = next(m for m in blocks[-1].modules() if isinstance(m, torch.nn.Linear))  # runs only when its block computes
    ran: list[int] = []
    probe = leaf.register_forward_hook(lambda m, args, out: ran.append(1))
    marker = loaded.pipe.transformer.register_forward_pre_hook(lambda m, args: ran.append(0))
    try:
        swap = len(blocks) if swapped == "all" else 1
        strategy = MemoryStrategy(offload="block_swap", blocks_to_swap=swap, prefetch_blocks=1)
        result, passes = run_observed(loaded, variant, strategy, FIRST_BLOCK)
    finally:
        probe.remove()
        marker.remove()
    computed = [any(flags) for flags in "".join(map(str, ran)).split("0")[1:]]
    assert len(computed) == len(passes) and not all(computed) and any(computed)
    opening = f"transformer.blocks.{len(blocks) - swap}"
    for index, (events, pass_computed) in enumerate(zip(passes, computed)):
        copied = {name for kind, name in events if kind in ("onload", "prefetch")}
        if not pass_computed:
            assert copied <= {"transformer.blocks.0"}, events
        if index:
            assert ("onload", opening) not in events, (index, events)
    assert result.receipt["cache"]["streamed_copies_skipped"] == result.receipt["cache"]["blocks_skipped"]


def test_a_skipped_block_is_not_copied_under_block_swap(tiny_loaded):
    variant = "wan2.1-t2v"
    loaded = tiny_loaded(variant)
    strategy = MemoryStrategy(offload="block_swap", blocks_to_swap=block_count(loaded), prefetch_blocks=0)
    cached = run(loaded, variant, strategy, MAG).receipt["cache"]
    calibration = run(loaded, variant, strategy, StepCache("mag_cache", calibrate=True)).receipt["cache"]
    assert calibration["blocks_skipped"] == 0 and calibration["streamed_copies_skipped"] == 0
    blocks = block_count(loaded)
    skipped_passes = cached["blocks_skipped"] // blocks  # MagCache skips whole passes
    assert skipped_passes > 0 and cached["blocks_skipped"] == skipped_passes * blocks
    # Each skipped pass saves the copies of every block, the first included (its decision is foreseen).
    assert cached["streamed_copies_skipped"] == skipped_passes * blocks
    assert calibration["streamed_copies"] - cached["streamed_copies"] == cached["streamed_copies_skipped"]


@pytest.mark.parametrize("prefetch", [0, 1])
@pytest.mark.parametrize("room_for", ["all", "one"])
def test_a_skipped_block_kept_on_the_device_counts_no_copy_saved(tiny_folder, monkeypatch, room_for, prefetch):
    """Free memory keeps streamed blocks on the device after their first use, cached or not: a skipped
    pass saves a copy only of a block that is not there. Copies made plus copies saved is what the
    same call copies computing every block (a calibration run), and nothing is saved when every block
    is kept (the receipt once counted every skipped call of a kept block as saved)."""
    from cuda_fake import FakeCuda
    from vidmem.memory.device import CudaBackend
    from vidmem.pipelines.hooks import RunHooks
    from vidmem.pipelines.loader import load_pipeline
    from vidmem.pipelines.room import KEEP_MARGIN_BYTES

    variant = "wan2.1-t2v"
    fresh = lambda: load_pipeline(tiny_folder(variant), "fp32")  # noqa: E731 (no call finds blocks a previous call kept)
    loaded = fresh()  # before the fake: transformers' lazy imports read torch.cuda.Stream in annotations
    FakeCuda().install(monkeypatch)
    backend = CudaBackend(torch.device("cpu"))
    blocks = block_count(loaded)
    strategy = MemoryStrategy(offload="block_swap", blocks_to_swap=blocks, prefetch_blocks=prefetch)
    request = replace(request_for(variant, steps=STEPS), cache=MAG)
    weights = sample(loaded, strategy, request, backend=backend).receipt["device_weight_bytes"]
    one_block = sum(p.numel() * p.element_size() for p in loaded.pipe.transformer.blocks[0].parameters())
    extra = {"all": 1 << 30, "one": one_block}[room_for]
    budget = RunHooks(device_budget=lambda device: weights + KEEP_MARGIN_BYTES + extra)
    kept = {"all": blocks, "one": 1}[room_for]

    cached = sample(fresh(), strategy, request, hooks=budget, backend=backend).receipt
    calibration = sample(fresh(), strategy, replace(request, cache=StepCache("mag_cache", calibrate=True)),
                         hooks=budget, backend=backend).receipt
    assert cached["residency"]["kept_groups"] == kept and calibration["residency"]["kept_groups"] == kept
    skipped_passes = cached["cache"]["blocks_skipped"] // blocks
    assert skipped_passes > 0
    assert cached["cache"]["streamed_copies_skipped"] == skipped_passes * (blocks - kept)
    assert cached["cache"]["streamed_copies"] + cached["cache"]["streamed_copies_skipped"] \
        == calibration["cache"]["streamed_copies"]


@pytest.mark.parametrize("cache", [MAG, TAYLOR], ids=["mag_cache", "taylor_seer"])
def test_a_skipped_pass_copies_no_leaf_of_a_block_under_sequential(tiny_loaded, cache):
    """Under sequential every leaf streams: the leaves outside the blocks run on every pass, those of
    a skipped pass's blocks are neither called nor prefetched (the leaf before the first block used to
    prefetch it), and a computed pass after the first finds each of its blocks' leaves prefetched, as
    uncached (the leaves inside the first block ask after its head hook decided: they used to foresee
    from the state that decision had already changed, and copied on demand)."""
    variant = "wan2.1-t2v"
    loaded = tiny_loaded(variant)
    result, passes = run_observed(loaded, variant, MemoryStrategy(offload="sequential", prefetch_blocks=1), cache)
    computes = [step for step in schedule(cache) for _ in range(2)]
    skipped = [events for events, computed in zip(passes, computes) if not computed]
    assert skipped
    for events in skipped:
        copied = [name for kind, name in events if kind in ("onload", "prefetch")]
        assert copied and not [name for name in copied if ".blocks." in name], events
    for index, (events, computed) in enumerate(zip(passes, computes)):
        on_demand = [name for kind, name in events if kind == "onload" and ".blocks." in name]
        assert not (index and computed and on_demand), (index, on_demand)
    assert result.receipt["cache"]["blocks_skipped"] > 0


def test_calibration_skips_nothing_and_returns_the_ratios_per_step(tiny_loaded):
    loaded = tiny_loaded("wan2.1-t2v")
    cache = run(loaded, "wan2.1-t2v", MemoryStrategy(offload="none"), StepCache("mag_cache", calibrate=True)).receipt["cache"]
    ratios = cache["mag_ratios"]["transformer"]
    assert cache["blocks_skipped"] == 0 and len(ratios) == STEPS and ratios[0] == 1.0
    assert all(r > 0 for r in ratios)
    again = run(loaded, "wan2.1-t2v", MemoryStrategy(offload="none"), StepCache("mag_cache", calibrate=True))
    assert again.receipt["cache"]["mag_ratios"] == cache["mag_ratios"]  # the same run measures the same


@pytest.mark.parametrize("cache", [FIRST_BLOCK, MAG, TAYLOR], ids=["first_block_cache", "mag_cache", "taylor_seer"])
def test_the_cache_is_removed_after_the_call_even_when_it_fails(tiny_loaded, cache):
    loaded = tiny_loaded("wan2.1-t2v")
    transformer = loaded.pipe.transformer

    def cancel():
        raise InterruptedError("cancelled")

    from vidmem.pipelines.hooks import RunHooks

    request = replace(request_for("wan2.1-t2v", steps=STEPS), cache=cache)
    found = [(m, as_found(m)) for m in transformer.modules()]
    with pytest.raises(InterruptedError):
        sample(loaded, MemoryStrategy(offload="none"), request, hooks=RunHooks(on_step=lambda *a: cancel()),
               backend=StrictBackend())
    assert not transformer.is_cache_enabled
    blocks = denoiser_blocks(loaded.pipe, loaded.spec)["transformer"]
    # the gate's counters are forward hooks on the blocks and a pre-hook on the denoiser (its pass's start)
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in blocks)
    assert not transformer._forward_pre_hooks and not transformer._forward_hooks
    # and no registry or hooked forward left behind on any module (diffusers' disable_cache leaves them)
    assert all(as_found(m) == before for m, before in found)
    run(loaded, "wan2.1-t2v", MemoryStrategy(offload="none"), cache)  # and the next call enables it again
    assert not any(m._forward_hooks for m in blocks) and not transformer._forward_pre_hooks
    assert all(as_found(m) == before for m, before in found)


def test_the_cache_is_never_left_on_when_entering_the_call_fails_before_it(tiny_loaded, monkeypatch):
    """The cache's hooks go on inside the call's `with`: a failure entering what comes before them (the warm
    store's `call_on`) leaves none behind."""
    import contextlib

    import vidmem.pipelines.sample as sample_module

    @contextlib.contextmanager
    def refused(*_args, **_kwargs):
        raise RuntimeError("the warm store refused the call")
        yield

    loaded = tiny_loaded("wan2.1-t2v")
    transformer = loaded.pipe.transformer
    found = [(m, as_found(m)) for m in transformer.modules()]
    monkeypatch.setattr(sample_module, "call_on", refused)
    with pytest.raises(RuntimeError, match="warm store refused"):
        sample(loaded, MemoryStrategy(offload="none"), replace(request_for("wan2.1-t2v", steps=STEPS), cache=MAG),
               backend=StrictBackend())
    blocks = denoiser_blocks(loaded.pipe, loaded.spec)["transformer"]
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in blocks)
    assert not transformer._forward_pre_hooks
    assert all(as_found(m) == before for m, before in found)


@pytest.mark.parametrize("kwargs,named", [
    ({"method": "teacache"}, "method"),
    ({"method": "first_block_cache", "threshold": float("nan")}, "threshold"),
    ({"method": "first_block_cache", "threshold": 2.0}, "threshold"),
    ({"method": "first_block_cache", "retention": -0.1}, "retention"),
    ({"method": "mag_cache"}, "mag_ratios"),
    ({"method": "mag_cache", "mag_ratios": (1.0, 0.0)}, "mag_ratios"),
    ({"method": "mag_cache", "mag_ratios": (1.0,), "max_skip_steps": 0}, "max_skip_steps"),
    ({"method": "taylor_seer", "interval": 0}, "interval"),
    ({"method": "taylor_seer", "warmup_steps": 0}, "warmup_steps=0 .*predicts from computed steps"),
    ({"method": "taylor_seer", "end_steps": -1}, "end_steps"),
    ({"method": "taylor_seer", "order": 4}, "order=4 must be a whole number from 1 to 3"),
    ({"method": "taylor_seer", "interval": 2.5}, "interval"),
    # not lists at all (each was a bare TypeError)
    ({"method": "mag_cache", "mag_ratios": 5}, "mag_ratios must be a non-empty list"),
    ({"method": "mag_cache", "mag_ratios": "1.0"}, "mag_ratios must be a non-empty list"),
    ({"method": "mag_cache", "expert_ratios": (("transformer", 5),)}, "mag_ratios of transformer must be"),
    ({"method": "mag_cache", "expert_ratios": 5}, "expert_ratios=5 must be pairs"),
    ({"method": "mag_cache", "expert_ratios": ((1.0, 0.9),)}, "expert_ratios=.* must be pairs"),
    ({"method": "mag_cache", "expert_ratios": (("transformer",),)}, "expert_ratios=.* must be pairs"),
])
def test_bad_cache_settings_are_refused_by_name(kwargs, named):
    with pytest.raises(StrategyError, match=named):
        StepCache(**kwargs)


def test_a_cache_that_is_not_a_step_cache_is_refused_before_anything_runs(tiny_loaded):
    loaded = tiny_loaded("wan2.1-t2v")
    request = replace(request_for("wan2.1-t2v"), cache={"method": "mag_cache"})
    with pytest.raises(ModelError, match="cache must be a step cache"):
        sample(loaded, MemoryStrategy(offload="none"), request, backend=StrictBackend())
    assert not loaded.pipe.transformer.is_cache_enabled


def test_describe_says_what_runs():
    assert StepCache().describe() == "off" and not StepCache().on
    assert StepCache("mag_cache", calibrate=True).describe() == "mag_cache calibration (nothing skipped)"
    assert MAG.describe() == "mag_cache threshold=0.5 retention=0.2 max_skip_steps=3"
    assert StepCache(CacheMethod.FIRST_BLOCK).describe() == "first_block_cache threshold=0.05"  # retention is MagCache's


def test_a_calibration_file_is_written_read_back_and_refused_on_another_model(tiny_loaded, tmp_path):
    from vidmem.pipelines.step_cache import cache_with_ratios, ratio_files, write_ratio_file

    loaded = tiny_loaded("wan2.1-t2v")
    measured = run(loaded, "wan2.1-t2v", MemoryStrategy(offload="none"), StepCache("mag_cache", calibrate=True))
    path = write_ratio_file(tmp_path, loaded, STEPS, measured.receipt["cache"]["mag_ratios"], "default")
    assert ratio_files(tmp_path) == [path.name] and re.fullmatch(rf"WanPipeline-2blocks-{STEPS}steps-[0-9a-f]{{8}}\.json",
                                                                 path.name), path.name
    node_cache = StepCache("mag_cache", threshold=0.5, mag_ratios=(1.0,))
    cache = cache_with_ratios(node_cache, loaded, path.name, tmp_path)
    assert dict(cache.expert_ratios)["transformer"] == tuple(measured.receipt["cache"]["mag_ratios"]["transformer"])
    receipt = run(loaded, "wan2.1-t2v", MemoryStrategy(offload="none"), cache).receipt["cache"]
    assert path.name in receipt["ratios"]
    with pytest.raises(StrategyError, match="was measured on"):
        cache_with_ratios(node_cache, tiny_loaded("wan2.2-a14b"), path.name, tmp_path)
    with pytest.raises(StrategyError, match="no published MagCache ratios"):
        cache_with_ratios(node_cache, loaded, "auto", tmp_path)


def test_the_published_ratios_name_the_layouts_of_the_models_vidmem_runs():
    """Every shipped entry's key is the layout of one of the shipped model configs (so 'auto' finds it)."""
    import json
    from pathlib import Path

    from vidmem.pipelines.step_cache import SHIPPED_RATIOS, layout_key

    configs = Path(SHIPPED_RATIOS).parent / "models"
    layouts = {}
    for path in configs.glob("*.json"):
        model = json.loads(path.read_text())
        denoisers = {name: (c["config"]["num_layers"], c["config"]) for name, c in model["components"].items()
                     if name.startswith("transformer")}
        layouts[layout_key(model["pipeline"], denoisers)] = model["name"]
    shipped = json.loads(Path(SHIPPED_RATIOS).read_text())["models"]
    assert {entry["model"] for entry in shipped} <= set(layouts)
    for entry in shipped:
        assert entry["source"].startswith("github.com/Zehong-Ma/MagCache/") and entry["ratios"]
        for ratios in entry["ratios"].values():
            assert ratios[0] == 1.0 and all(0.5 < r < 1.5 for r in ratios)
        StepCache("mag_cache", expert_ratios=tuple((k, tuple(v)) for k, v in entry["ratios"].items()))  # valid


@pytest.mark.parametrize("steps", [STEPS, 7])
def test_the_planned_schedule_is_the_one_a_run_takes_and_ratios_stretch_to_other_step_counts(tiny_loaded, steps):
    """mag_schedule runs diffusers' own hooks on a stand-in: the steps it says compute are those a
    real run computes (each step's conditional and unconditional pass), at the ratios' own step
    count and stretched to another."""
    from vidmem.pipelines.step_cache import mag_schedule

    loaded = tiny_loaded("wan2.1-t2v")
    ratios = (1.0, 1.0, 0.99, 0.98, 1.0, 0.97, 0.99, 1.0, 0.96, 0.95)
    cache = StepCache("mag_cache", threshold=0.05, retention=0.2, max_skip_steps=2,
                      expert_ratios=(("transformer", ratios),), ratio_steps=STEPS)
    planned = mag_schedule(cache, steps)
    assert len(planned) == steps and 0 < sum(planned) < steps
    receipt = run(loaded, "wan2.1-t2v", MemoryStrategy(offload="none"), cache, steps=steps).receipt["cache"]
    passes_per_step = 2  # cfg: conditional and unconditional
    assert receipt["blocks_computed"] == sum(planned) * passes_per_step * block_count(loaded)


def test_vidmem_plan_says_what_the_published_ratios_compute(capsys):
    from vidmem.cli import main

    main(["plan", "--model", "wan2.1-t2v-1.3b", "--vram", "8", "--ram", "32", "--cache", "mag_cache"])
    out = capsys.readouterr().out
    assert "mag_cache with the published ratios (threshold 0.12, K 4, retention 0.2): steps computed transformer 21 of 50" in out
    assert re.search(r"Time with the cache: about x0\.\d\d of the same run uncached \(42% of the denoise passes", out), out
    main(["plan", "--model", "cogvideox-2b", "--vram", "12", "--ram", "32", "--cache", "mag_cache"])
    assert "no published MagCache ratios for this model" in capsys.readouterr().out
    main(["plan", "--model", "wan2.1-t2v-1.3b", "--vram", "8", "--ram", "32", "--cache", "mag_cache", "--frames", "161",
          "--window", "81", "--window-overlap", "16"])  # each window keeps its own cache state: the same share
    out = capsys.readouterr().out
    assert ("steps computed transformer 21 of 50 in each of the 3 context windows (each with its own cache state) (42%)"
            in out), out


def test_per_expert_ratios_for_another_split_of_the_steps_are_refused_by_name(tiny_loaded):
    """Wan 2.2 A14B: each expert's ratios cover its own steps; a shift or boundary that moves the
    hand-over would apply them to the wrong steps."""
    from vidmem.pipelines.sample import expert_steps
    from vidmem.pipelines.sample_call import call_pipeline
    from vidmem.pipelines.schedulers import build_scheduler

    loaded = tiny_loaded("wan2.2-a14b")
    request = request_for("wan2.2-a14b", steps=STEPS)
    from vidmem.pipelines.sample_checks import validate_request

    choice = validate_request(loaded, request)
    call = call_pipeline(loaded.pipe, build_scheduler(loaded.pipe.scheduler, choice), choice.boundary_ratio)
    split = expert_steps(call, STEPS)
    assert sum(split.values()) == STEPS
    fits = StepCache("mag_cache", threshold=0.5, ratio_steps=STEPS, expert_ratios=tuple(
        (name, (1.0,) * count) for name, count in split.items()))
    assert run(loaded, "wan2.2-a14b", MemoryStrategy(offload="none"), fits).receipt["cache"]["blocks_skipped"] > 0
    off = replace(fits, expert_ratios=(("transformer", (1.0,) * (split["transformer"] + 1)),
                                       ("transformer_2", (1.0,) * (split["transformer_2"] - 1))))
    with pytest.raises(StrategyError, match="cover .* steps of transformer, but with this sampler"):
        run(loaded, "wan2.2-a14b", MemoryStrategy(offload="none"), off)
    assert not loaded.pipe.transformer.is_cache_enabled and not loaded.pipe.transformer_2.is_cache_enabled


def _published_configs():
    """(what, MagCacheConfig) for every published ratio set, at its own step count (and, for ratios of a
    whole run, stretched to others), at its published threshold and bolder and shyer ones."""
    import json

    from vidmem.pipelines.step_cache import SHIPPED_RATIOS, published_cache

    for entry in json.loads(SHIPPED_RATIOS.read_text())["models"]:
        cache = published_cache(entry["model"])
        step_counts = [entry["steps"]] if cache.per_expert else [entry["steps"], 20, 30]
        for denoiser in dict(cache.expert_ratios):
            for threshold in sorted({cache.threshold, 0.02, 0.06, 0.12, 0.25, 0.5}):
                for steps in step_counts:
                    config = replace(cache, threshold=threshold).diffusers_config(steps, denoiser)
                    yield f"{entry['model']} {denoiser} threshold={threshold} steps={steps}", config


def _same_view(found, expected) -> bool:
    fields = ("step_index", "accumulated_ratio", "accumulated_err", "accumulated_steps", "has_residual")
    return all(type(getattr(found, f)) is type(getattr(expected, f)) and bool(getattr(found, f) == getattr(expected, f))
               for f in fields)


def test_the_look_ahead_takes_diffusers_decision_on_every_step_of_every_published_ratio_set():
    """`mag_decides` (before a pass) and `mag_after_pass` (after it) against diffusers' own MagCache
    hooks, pass by pass: conditional and unconditional passes interleaved, over two whole runs (the
    hooks reset their state after the last step), for every published ratio set and several thresholds."""
    from diffusers.hooks import apply_mag_cache

    from vidmem.pipelines.step_cache import MagView, _ScheduleModel, mag_after_pass, mag_decides

    checked = skipped = 0
    for what, config in _published_configs():
        model = _ScheduleModel()
        apply_mag_cache(model, config)
        states = model.blocks[0]._diffusers_hook.get_hook("mag_cache_leader_block_hook").state_manager._state_cache
        foreseen = {}  # context -> the view its next pass starts from, foreseen at the end of its last pass
        with torch.no_grad():
            for index in range(2 * 2 * config.num_inference_steps):
                context = ("cond", "uncond")[index % 2]
                view = MagView.of(states[context]) if context in states else MagView()
                if context in foreseen:
                    assert _same_view(foreseen[context], view), (what, index)
                will_compute, decided = mag_decides(view, config)
                computed = model(torch.zeros(1, 1), context)
                assert will_compute == computed, (what, index)
                foreseen[context] = mag_after_pass(decided, config, computed)
                checked, skipped = checked + 1, skipped + (not computed)
    assert skipped > 0 and checked > skipped  # the ratio sets skip some passes and compute others


@pytest.mark.parametrize("contexts", [("cond", "uncond"), ("cond_uncond",)], ids=["wan", "cogvideox"])
def test_the_gate_foresees_every_pass_from_anywhere_in_the_pass_before(contexts):
    """BlockGate on diffusers' MagCache hooks, four blocks, passes in the cache contexts of Wan (a
    conditional and an unconditional pass per step) or CogVideoX (one batched pass per step): asked
    before the first block, between blocks (the first has decided, the last has not) and after the
    last, it says what the pass under way and the next pass of the denoiser will do, as they then do."""
    from diffusers.hooks import apply_mag_cache
    from diffusers.hooks.hooks import CacheContext, _set_cache_context

    from vidmem.pipelines.step_cache import BlockGate, CacheTally, _ScheduleBlock, _ScheduleModel

    cache = StepCache("mag_cache", mag_ratios=(1.0, 0.99, 0.98, 0.99, 1.0, 0.97, 0.99, 1.0, 0.96, 0.95),
                      threshold=0.06, retention=0.2, max_skip_steps=2)
    model = _ScheduleModel()
    model.blocks = torch.nn.ModuleList([_ScheduleBlock() for _ in range(4)])
    apply_mag_cache(model, cache.diffusers_config(STEPS))
    gate = BlockGate(CacheMethod.MAG, {"transformer": model.blocks}, CacheTally())
    said: list[tuple[int, bool, bool]] = []  # (pass, this pass computes, the next pass computes)
    passes = [0]

    def ask(block):
        said.append((passes[0], gate.ahead(block, next_pass=False), gate.ahead(model.blocks[0], next_pass=True)))

    handles = [model.register_forward_pre_hook(lambda m, args: gate.begin("transformer"))]
    for block in model.blocks:
        handles.append(block.register_forward_pre_hook(lambda m, args: ask(m)))
        handles.append(block.register_forward_hook(lambda m, args, out: gate.count(m), prepend=True))
        handles.append(block.register_forward_hook(lambda m, args, out: ask(m)))
    head_said, computed = [], []
    handles.append(model.blocks[0].register_forward_pre_hook(lambda m, args: head_said.append(gate(m)), prepend=True))
    with torch.no_grad():
        for index in range(2 * len(contexts) * STEPS):  # two whole runs
            passes[0] = index
            context = contexts[index % len(contexts)]
            _set_cache_context(model, CacheContext(context))
            computed.append(model(torch.zeros(1, 1), context))
    for handle in handles:
        handle.remove()
    assert head_said == computed and not all(computed) and any(computed)
    for index, this_pass, next_pass in said:
        assert this_pass == computed[index], index
        if index >= len(contexts):  # the round of contexts is known once one repeats (before: prefetch, as uncached)
            assert next_pass == (computed[index + 1] if index + 1 < len(computed) else True), index


@pytest.mark.parametrize("cache", [FIRST_BLOCK, MAG, TAYLOR], ids=["first_block_cache", "mag_cache", "taylor_seer"])
def test_the_cuda_path_keeps_its_promises_with_the_cache_on(tiny_folder, monkeypatch, cache):
    """CudaBackend under the recording CUDA fake (tests/test_cuda_path.py's audit): with copies held
    for skipped passes and made at the end of a skipped pass, copies stay on the side stream, compute
    waits only on the block it runs, at most prefetch + 2 streamed groups hold device memory, and
    the latent is the CPU backend's at tier none."""
    from vidmem.pipelines.loader import load_pipeline

    variant = "wan2.1-t2v"
    assert_cuda_path_with_the_cache(load_pipeline(tiny_folder(variant), "fp32"),
                                    replace(request_for(variant, steps=STEPS), cache=cache), monkeypatch)


def assert_cuda_path_with_the_cache(loaded, request, monkeypatch) -> None:
    """`request` (a step cache on) under block swap and sequential on CudaBackend with the recording CUDA fake:
    the CPU backend's latent at tier none, passes skipped, and the audit of tests/test_cuda_path.py clean."""
    from cuda_fake import FakeCuda
    from test_cuda_path import Audit

    from vidmem.memory.device import CpuBackend, CudaBackend

    reference = sample(loaded, MemoryStrategy(offload="none"), request, backend=CpuBackend()).latent["samples"]
    blocks = block_count(loaded)
    for strategy in (*(MemoryStrategy(offload="block_swap", blocks_to_swap=n, prefetch_blocks=p)
                       for n in (1, blocks) for p in (1, 2)), MemoryStrategy(offload="sequential", prefetch_blocks=2)):
        with monkeypatch.context() as patch:
            fake = FakeCuda().install(patch)
            result = sample(loaded, strategy, request, backend=CudaBackend(torch.device("cpu")), observer=fake.observe)
        label = strategy.describe()
        assert torch.equal(result.latent["samples"], reference), label
        assert result.receipt["cache"]["blocks_skipped"] > 0, label
        audit = Audit(fake.log).run(strategy.prefetch_blocks)
        assert not audit.problems, f"{label}: " + "; ".join(audit.problems[:5])


def test_the_plans_time_with_a_cache_scales_the_denoise_stage_only():
    from vidmem.memory.plan.planner import PlanOptions, VideoShape, plan_run
    from vidmem.pipelines.configs import load_model
    from vidmem.pipelines.step_cache import cached_time_line

    plan = plan_run(load_model("wan2.1-t2v-1.3b", "bf16"), VideoShape(832, 480, 81),
                    MemoryStrategy(offload="block_swap", blocks_to_swap=15), PlanOptions(steps=50, device="cuda"))
    whole = plan.seconds_with_denoise_share(1.0)
    denoise = whole - plan.seconds_with_denoise_share(0.0)
    assert 0 < denoise < whole  # encoding and decoding take time too
    assert plan.seconds_with_denoise_share(0.4) == pytest.approx(whole - 0.6 * denoise)
    assert f"about x{(whole - 0.6 * denoise) / whole:.2f} of the same run uncached" in cached_time_line(plan, 0.4)


@pytest.mark.parametrize("contexts", [("cond", "uncond"), ("cond_uncond",)], ids=["wan", "cogvideox"])
@pytest.mark.parametrize("cache", [TAYLOR, StepCache("taylor_seer"), StepCache("taylor_seer", interval=1, end_steps=3),
                                   StepCache("taylor_seer", interval=2, warmup_steps=1, order=3)],
                         ids=["test", "defaults", "interval1", "order3"])
def test_the_gate_foresees_taylor_seers_every_pass_from_anywhere_in_the_pass_before(contexts, cache):
    """BlockGate on diffusers' TaylorSeer hooks (lite mode, four blocks and an output projection),
    passes in Wan's or CogVideoX's cache contexts, over two whole runs with the pipeline's reset of the
    hooks' state between them: asked before the first block, between blocks and after the last, it
    says what the pass under way and the denoiser's next pass do, as diffusers' hook state then shows;
    and a predicted pass runs no block's own forward."""
    from diffusers.hooks import HookRegistry
    from diffusers.hooks.hooks import CacheContext, _set_cache_context

    from vidmem.pipelines.step_cache import BlockGate, CacheTally, _ScheduleBlock, _taylor_ran

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([_ScheduleBlock() for _ in range(4)])
            self.proj_out = torch.nn.Linear(1, 1)

        def forward(self, hidden_states):
            for block in self.blocks:
                block.ran = False
                hidden_states = block(hidden_states)
            self.proj_out(hidden_states)
            return [block.ran for block in self.blocks]

    model = Model()
    from diffusers.hooks import apply_taylorseer_cache

    apply_taylorseer_cache(model, cache.diffusers_config(STEPS))
    tally = CacheTally()
    gate = BlockGate(CacheMethod.TAYLOR, {"transformer": model.blocks}, tally)
    gate.expect({"transformer": STEPS})
    said: list[tuple[int, bool, bool]] = []  # (pass, this pass computes, the next pass computes)
    passes, context = [0], [contexts[0]]

    def ask(block):
        said.append((passes[0], gate.ahead(block, next_pass=False), gate.ahead(model.blocks[0], next_pass=True)))

    handles = [model.register_forward_pre_hook(lambda m, args: gate.begin("transformer"))]
    for block in model.blocks:
        handles.append(block.register_forward_pre_hook(lambda m, args: ask(m)))
        handles.append(block.register_forward_pre_hook(lambda m, args: gate_said.append(gate(m)), prepend=True))
        handles.append(block.register_forward_hook(lambda m, args, out: gate.count(m), prepend=True))
        handles.append(block.register_forward_hook(lambda m, args, out: ask(m)))
    gate_said, computed, ran = [], [], []
    with torch.no_grad():
        for run_index in range(2):  # two whole runs
            for step in range(STEPS):
                for name in contexts:
                    passes[0], context[0] = len(computed), name
                    _set_cache_context(model, CacheContext(name))
                    ran.append(model(torch.zeros(1, 1)))
                    computed.append(_taylor_ran(model.blocks[-1], name))  # diffusers' own state says what it did
                    _set_cache_context(model, None)
            HookRegistry.check_if_exists_or_initialize(model).reset_stateful_hooks()  # as the pipeline does at its end
    for handle in handles:
        handle.remove()
    assert computed[:len(contexts) * STEPS] == computed[len(contexts) * STEPS:]
    assert computed == [step for step in schedule(cache) for _ in contexts] * 2
    assert ran == [[c] * 4 for c in computed]  # a predicted pass runs no block
    assert gate_said == [c for c in computed for _ in range(4)]
    for index, this_pass, next_pass in said:
        assert this_pass == computed[index], index
        if index >= len(contexts):  # the round of contexts is known once one repeats
            assert next_pass == (computed[index + 1] if index + 1 < len(computed) else True), index
    assert tally.computed == 4 * sum(computed) and tally.skipped == 4 * (len(computed) - sum(computed))
    if cache.interval > 1:
        assert not all(computed) and any(computed)


def test_taylor_seer_that_leaves_nothing_to_predict_is_refused_before_anything_runs(tiny_loaded):
    from vidmem.pipelines.hooks import RunHooks

    loaded = tiny_loaded("wan2.1-t2v")
    cache = StepCache("taylor_seer", warmup_steps=6, end_steps=4)
    rooms = []
    hooks = RunHooks(make_room=lambda nbytes, device, **_: rooms.append(nbytes))
    request = replace(request_for("wan2.1-t2v", steps=STEPS), cache=cache)
    with pytest.raises(StrategyError, match="warmup_steps=6 and end_steps=4, which leave nothing to predict in 10 steps"):
        sample(loaded, MemoryStrategy(offload="block_swap", blocks_to_swap=1), request, hooks, backend=StrictBackend())
    assert rooms == []  # before ComfyUI was asked to make room (it unloads its own models for it)
    assert not loaded.pipe.transformer.is_cache_enabled  # nothing left half-applied
    assert not any(m._forward_hooks for m in denoiser_blocks(loaded.pipe, loaded.spec)["transformer"])
    assert StepCache("taylor_seer").describe() == "taylor_seer interval=5 warmup_steps=3 end_steps=0 order=1"


def test_taylor_seer_counts_each_experts_own_steps_and_the_end_steps_bind_the_last(tiny_loaded):
    """Wan 2.2 A14B: each expert warms up on its own passes (its Taylor factors start empty), and the
    steps always computed at the end are the run's, so the low-noise expert's."""
    from vidmem.pipelines.step_cache import taylor_schedule

    variant = "wan2.2-a14b"
    loaded = tiny_loaded(variant)
    passes = {"transformer": 0, "transformer_2": 0}
    handles = [getattr(loaded.pipe, name).register_forward_pre_hook(
        lambda m, args, name=name: passes.__setitem__(name, passes[name] + 1)) for name in passes]
    try:
        receipt = run(loaded, variant, MemoryStrategy(offload="none"), TAYLOR).receipt["cache"]
    finally:
        for handle in handles:
            handle.remove()
    steps = {name: count // 2 for name, count in passes.items()}  # cond and uncond per step
    assert all(steps.values()) and sum(steps.values()) == STEPS
    blocks = block_count(loaded)
    expected = sum(sum(taylor_schedule(TAYLOR, steps[name], final=name == "transformer_2")) * 2 * blocks
                   for name in steps)
    assert receipt["blocks_computed"] == expected
    assert receipt["blocks_computed"] + receipt["blocks_skipped"] == 2 * STEPS * blocks


def test_vidmem_plan_says_what_taylor_seer_computes_from_its_step_arithmetic(capsys):
    from vidmem.cli import main
    from vidmem.pipelines.step_cache import cache_plan, taylor_computes

    main(["plan", "--model", "wan2.1-t2v-1.3b", "--vram", "8", "--ram", "32", "--cache", "taylor_seer"])
    out = capsys.readouterr().out
    expected = sum(taylor_computes(step, 5, 3, None) for step in range(50))
    assert f"taylor_seer (interval 5, warm-up 3, end steps 0, order 1): steps computed {expected} of 50 (" in out, out
    assert re.search(rf"Time with the cache: about x0\.\d\d of the same run uncached \({expected / 50:.0%} of the", out), out
    main(["plan", "--model", "wan2.1-t2v-1.3b", "--vram", "8", "--ram", "32", "--cache", "taylor_seer", "--frames", "161",
          "--window", "81", "--window-overlap", "16"])  # each window counts its own steps: the same share
    assert f"steps computed {expected} of 50 in each of the 3 context windows" in capsys.readouterr().out
    bold = cache_plan("any", 20, ["transformer"], StepCache("taylor_seer", interval=2, warmup_steps=2, end_steps=2))
    assert bold.share == sum(taylor_computes(step, 2, 2, 18) for step in range(20)) / 20 and bold.share < 1
    experts = cache_plan("any", 40, ["transformer", "transformer_2"], StepCache("taylor_seer"))
    assert experts.share is None and "warms up on its own steps" in experts.text  # the split is not known here
    refused = cache_plan("any", 3, ["transformer"], StepCache("taylor_seer"))
    assert refused.share is None and "leave nothing to predict in 3 steps" in refused.text


def test_taylor_seer_with_a_lora_gives_tier_nones_latent_on_every_tier(tiny_loaded, tmp_path):
    """A LoRA's layers sit inside the blocks TaylorSeer's hooks wrap: the LoRA acts on computed passes,
    predicted passes run no block, and every tier gives tier none's latent."""
    from test_lora_sampling import lora_file

    from vidmem.pipelines.lora import load_lora, with_lora

    variant = "wan2.1-t2v"
    base = tiny_loaded(variant)
    styled = with_lora(base, load_lora(lora_file(tmp_path, base.pipe.transformer), base.pipe, 0.8))
    reference = run(styled, variant, MemoryStrategy(offload="none"), TAYLOR)
    assert reference.receipt["cache"]["blocks_skipped"] > 0
    assert not torch.equal(reference.latent["samples"], run(base, variant, MemoryStrategy(offload="none"), TAYLOR).latent["samples"])
    for name, strategy in tiers(styled).items():
        result = run(styled, variant, strategy, TAYLOR)
        assert torch.equal(result.latent["samples"], reference.latent["samples"]), name
        assert result.receipt["cache"]["blocks_computed"] == reference.receipt["cache"]["blocks_computed"], name


@pytest.mark.parametrize("resumed_fails_at", [None, 5], ids=["once", "again_in_the_resumed_attempt"])
def test_an_out_of_memory_error_under_taylor_seer_resumes_uncached_and_leaves_nothing(tiny_loaded, resumed_fails_at):
    """The ladder resumes from the last finished step without the cache (its pass counts would restart
    at 0 halfway through); the receipt says so and counts true: the failed attempt's finished steps as
    TaylorSeer ran them, and every block of every step a resumed attempt ran (one that fails in turn
    included). No hook is left, and the next call caches again."""
    from test_oom_ladder import InjectOOM

    variant = "wan2.1-t2v"
    loaded = tiny_loaded(variant)
    blocks = denoiser_blocks(loaded.pipe, loaded.spec)["transformer"]
    failed_at = 3
    # Block 0's forwards, counted across attempts: step 3's cond pass (computed under TAYLOR), then
    # the resumed attempt's step `resumed_fails_at` (one more forward: step 3's failed cond pass).
    calls = [2 * failed_at + 1] + ([2 * resumed_fails_at + 2] if resumed_fails_at else [])
    with InjectOOM(blocks[0], calls) as oom:
        result = run(loaded, variant, MemoryStrategy(offload="model"), TAYLOR)
    assert oom.raised == len(calls)
    assert [rung["resumed_from_step"] for rung in result.receipt["oom_ladder"]] == [failed_at, resumed_fails_at or failed_at][:len(calls)]
    cache = result.receipt["cache"]
    assert "ran uncached" in cache["note"]
    per_step = 2 * len(blocks)  # cond and uncond passes
    skipped_before = (failed_at - sum(schedule(TAYLOR)[:failed_at])) * per_step
    assert skipped_before > 0  # the failed attempt's skips are in the count, not lost
    assert cache["blocks_skipped"] == skipped_before
    assert cache["blocks_computed"] == STEPS * per_step - skipped_before  # the resumed steps computed every block
    assert cache["blocks_computed_share"] == round(cache["blocks_computed"] / (STEPS * per_step), 4)
    assert not loaded.pipe.transformer.is_cache_enabled
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in blocks)
    assert run(loaded, variant, MemoryStrategy(offload="none"), TAYLOR).receipt["cache"]["blocks_skipped"] > 0


@pytest.mark.parametrize("variant", ["wan2.1-t2v", "cogvideox-t2v", "hunyuanvideo1.5-t2v", "ltx2-t2v"])
def test_taylor_seer_hooks_exactly_the_declared_blocks_and_every_output_projection(tiny_loaded, variant):
    """Zeros from the declared blocks, extrapolation of each output projection: LTX-2's audio branch has
    its own (`audio_proj_out`), which diffusers' lite patterns would leave to be computed from zeros.
    A denoiser without an output projection is refused by name, with nothing applied."""
    from vidmem.pipelines.step_cache import AppliedCache, _TAYLOR_HOOK
    from vidmem.pipelines.family import denoisers

    loaded = tiny_loaded(variant)
    transformer = loaded.pipe.transformer
    blocks = denoiser_blocks(loaded.pipe, loaded.spec)
    with AppliedCache(TAYLOR, denoisers(loaded.pipe, loaded.spec), blocks).apply(STEPS):
        hooked = {path for path, m in transformer.named_modules()
                  if getattr(m, "_diffusers_hook", None) is not None and m._diffusers_hook.get_hook(_TAYLOR_HOOK)}
    declared = {path for path, m in transformer.named_modules() if any(m is b for b in blocks["transformer"])}
    outputs = {"proj_out", "audio_proj_out"} if variant == "ltx2-t2v" else {"proj_out"}
    assert hooked == declared | outputs
    assert not transformer.is_cache_enabled

    bare = NoProjection()
    with pytest.raises(StrategyError, match=r"taylor_seer extrapolates .*\(NoProjection\) has no proj_out"):
        AppliedCache(TAYLOR, {"transformer": bare}, {"transformer": bare.blocks}).apply(STEPS)


class NoProjection(torch.nn.Module):
    """A denoiser with blocks and cache switches but no proj_out: TaylorSeer has nothing to extrapolate."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(1, 1)])

    enable_cache = disable_cache = lambda self, *a: None


@pytest.mark.parametrize("name", ["/etc/passwd", "../secret.json", "sub/ratios.json", "..", "a\\b.json", "D:secret.json"])
def test_mag_ratios_names_a_file_in_the_folder_never_a_path(tiny_loaded, tmp_path, name):
    """The name comes from a widget (the plan route takes it from an HTTP query): a path is refused unopened."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "secret.json").write_text('{"model": "SECRET"}')
    with pytest.raises(StrategyError, match="is not a ratio file's name") as refused:
        cache_with_ratios_for(tiny_loaded("wan2.1-t2v"), name, tmp_path / "sub")
    assert "SECRET" not in str(refused.value)


def test_mag_ratios_that_is_not_a_regular_file_is_refused_unread(tiny_loaded, tmp_path):
    """A FIFO in the folder would block the read forever (one plan worker serves every chart)."""
    import os

    import threading

    os.mkfifo(tmp_path / "stuck.json")
    loaded, outcome = tiny_loaded("wan2.1-t2v"), []

    def read():
        try:
            cache_with_ratios_for(loaded, "stuck.json", tmp_path)
        except StrategyError as error:
            outcome.append(str(error))

    reader = threading.Thread(target=read, daemon=True)  # a blocked read fails the test instead of hanging it
    reader.start()
    reader.join(timeout=30)
    assert outcome and "is not a regular file" in outcome[0]


def test_mag_ratios_whose_name_the_system_refuses_is_a_worded_error(tiny_loaded, tmp_path):
    with pytest.raises(StrategyError, match="cannot be opened"):
        cache_with_ratios_for(tiny_loaded("wan2.1-t2v"), "x" * 300 + ".json", tmp_path)


def cache_with_ratios_for(loaded, name, folder):
    from vidmem.pipelines.step_cache import cache_with_ratios

    return cache_with_ratios(StepCache("mag_cache", mag_ratios=(1.0,)), loaded, name, folder)
