"""Node contracts, loading the pack the way ComfyUI does, and the nodes run end to end."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

from vidmem.nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS, host
from vidmem.nodes.free import VidMemFreeVRAM
from vidmem.memory import StrategyError
from vidmem.nodes.strategy import StrategyChoice, VidMemMemoryStrategy

ROOT = Path(__file__).resolve().parents[1]
LINK_TYPES = {"VIDMEM_PIPELINE", "VIDMEM_STRATEGY", "LATENT", "IMAGE", "*"}
WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN"}


def all_inputs(cls):
    spec = cls.INPUT_TYPES()
    assert set(spec) <= {"required", "optional", "hidden"}
    return {**spec.get("required", {}), **spec.get("optional", {})}


@pytest.mark.parametrize("node_id", list(NODE_CLASS_MAPPINGS))
def test_node_contract(node_id):
    cls = NODE_CLASS_MAPPINGS[node_id]
    assert node_id.startswith("VidMem") and node_id in NODE_DISPLAY_NAME_MAPPINGS
    assert NODE_DISPLAY_NAME_MAPPINGS[node_id].endswith("(VidMem)")
    assert cls.CATEGORY.startswith("vidmem") and cls.DESCRIPTION
    assert callable(getattr(cls, cls.FUNCTION))
    assert len(cls.RETURN_TYPES) == len(cls.RETURN_NAMES) == len(cls.OUTPUT_TOOLTIPS)
    for name, entry in all_inputs(cls).items():
        kind, options = entry
        assert isinstance(kind, list) or kind in LINK_TYPES | WIDGET_TYPES or kind.startswith("VIDMEM_"), (node_id, name)
        assert options.get("tooltip"), f"{node_id}.{name} has no tooltip"
        if isinstance(kind, list):
            assert kind and options.get("default", kind[0]) in kind
        if kind in ("INT", "FLOAT"):
            assert options["min"] <= options["default"] <= options["max"], (node_id, name)


def test_pack_loads_by_file_location_under_any_folder_name(tmp_path):
    """As ComfyUI's nodes.load_custom_node: spec_from_file_location on <folder>/__init__.py."""
    folder = tmp_path / "ComfyUI-vidmem_test pack"
    folder.symlink_to(ROOT, target_is_directory=True)
    module_name = str(folder).replace(".", "_x_")
    spec = importlib.util.spec_from_file_location(module_name, folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
        assert set(module.NODE_CLASS_MAPPINGS) == set(NODE_CLASS_MAPPINGS)
        assert module.NODE_DISPLAY_NAME_MAPPINGS == NODE_DISPLAY_NAME_MAPPINGS
        assert (folder / module.WEB_DIRECTORY).is_dir()
        assert "comfy" not in sys.modules  # the pack never needs the host to import
    finally:
        for name in [n for n in sys.modules if n == module_name or n.startswith(module_name + ".")]:
            del sys.modules[name]


def strategy_inputs(**change):
    defaults = dict(offload="model", blocks_to_swap=0, prefetch_blocks=1, max_pinned_ram_gb=-1.0, non_blocking=True,
                    text_encoder="offload_after_encoding",
                    vae_slicing=False, vae_tiling=False, tile_size=256, overlap=64, temporal_size=64,
                    temporal_overlap=8)
    return defaults | change


def test_strategy_widget_names_match_the_builder():
    assert set(VidMemMemoryStrategy.INPUT_TYPES()["required"]) == set(strategy_inputs())


def test_strategy_node_has_no_shape_of_its_own_and_drops_an_old_workflows_shape():
    spec = VidMemMemoryStrategy.INPUT_TYPES()
    assert not {"width", "height", "frames"} & {*spec["required"], *spec["optional"]}
    out = VidMemMemoryStrategy().build(width=832, height=480, frames=81, vram_budget_gb=6.0,
                                       **strategy_inputs(offload="block_swap", blocks_to_swap=4))
    (choice,) = out["result"]
    assert isinstance(choice, StrategyChoice) and not choice.auto and choice.vram_budget_gb == 6.0
    assert choice.strategy.blocks_to_swap == 4 and "blocks_to_swap=4" in out["ui"]["text"][0]


def test_auto_is_chosen_by_the_sampler_at_its_own_shape(tiny_loaded):
    from vidmem.memory.plan.planner import PlanError
    from vidmem.nodes.sampler import _strategy_for_run
    from vidmem.memory.plan.stages import VideoShape

    loaded = tiny_loaded("wan2.1-t2v")
    (auto,) = VidMemMemoryStrategy().build(vram_budget_gb=8.0, ram_budget_gb=64.0, **strategy_inputs(offload="auto"))["result"]
    assert auto.auto and "Sampler's planner chooses" in auto.describe()
    run, line = _strategy_for_run(loaded, auto, VideoShape(32, 32, 9), torch.device("cpu"))
    assert run.offload.value == "none" and line.startswith("auto chose at 32x32x9: offload=none")
    # On a CPU device compute and process share the RAM: its budget is what starves the run, not the VRAM's.
    assert _strategy_for_run(loaded, StrategyChoice(auto.strategy, auto=True, vram_budget_gb=1e-4, ram_budget_gb=64.0),
                             VideoShape(32, 32, 9), torch.device("cpu"))[0].offload.value == "none"
    starved = StrategyChoice(auto.strategy, auto=True, vram_budget_gb=64.0, ram_budget_gb=1e-4)
    with pytest.raises(PlanError, match="nothing fits"):
        _strategy_for_run(loaded, starved, VideoShape(32, 32, 9), torch.device("cpu"))
    # blocks_to_swap left from a block_swap template: ignored (the planner chooses), with a note
    out = VidMemMemoryStrategy().build(**strategy_inputs(offload="auto", blocks_to_swap=3))
    (kept,) = out["result"]
    assert kept.auto and kept.strategy.blocks_to_swap == 0
    assert kept.notes == ("blocks_to_swap=3 ignored: offload=auto chooses the blocks itself.",)
    assert "note: blocks_to_swap=3 ignored" in out["ui"]["text"][0]


@pytest.mark.parametrize("offload", ["none", "model", "sequential"])
def test_a_blocks_to_swap_the_tier_does_not_use_is_ignored_with_a_note(offload):
    """Switching a shipped block-swap template to another tier must not fail the run."""
    out = VidMemMemoryStrategy().build(**strategy_inputs(offload=offload, blocks_to_swap=20))
    (choice,) = out["result"]
    assert choice.strategy.offload.value == offload and choice.strategy.blocks_to_swap == 0
    assert choice.notes == (f"blocks_to_swap=20 ignored: it applies only to offload=block_swap (offload is {offload}).",)
    assert out["ui"]["text"][0].endswith(f"note: {choice.notes[0]}")
    (swap,) = VidMemMemoryStrategy().build(**strategy_inputs(offload="block_swap", blocks_to_swap=20))["result"]
    assert swap.notes == () and swap.strategy.blocks_to_swap == 20


def test_the_note_reaches_the_sampler_and_decode_receipts(tiny_loaded):
    from vidmem.nodes.decode import VidMemVAEDecode
    from vidmem.nodes.sampler import VidMemVideoSampler

    loaded = tiny_loaded("wan2.1-t2v")
    (choice,) = VidMemMemoryStrategy().build(**strategy_inputs(offload="model", blocks_to_swap=20))["result"]
    out = VidMemVideoSampler().sample(loaded, choice, "a cat", "", 32, 32, 9, 1, 1.0, 0)
    note = "blocks_to_swap=20 ignored: it applies only to offload=block_swap (offload is model)."
    assert out["ui"]["vidmem_receipt"][0]["note"] == note and f"note: {note}" in out["ui"]["text"][0]
    decoded = VidMemVAEDecode().decode(loaded, out["result"][0], strategy=choice)
    assert decoded["ui"]["vidmem_receipt"][0]["note"] == note


def test_an_explicit_strategy_is_planned_at_the_samplers_shape_as_advice(tiny_loaded):
    from vidmem.nodes.sampler import _strategy_for_run
    from vidmem.memory.plan.stages import VideoShape

    loaded = tiny_loaded("wan2.1-t2v")
    (choice,) = VidMemMemoryStrategy().build(vram_budget_gb=1.0, **strategy_inputs(offload="block_swap", blocks_to_swap=1))["result"]
    run, line = _strategy_for_run(loaded, choice, VideoShape(32, 32, 9), torch.device("cpu"))
    assert line.startswith("planned at 32x32x9: offload=block_swap") and "fits" in line
    assert choice.strategy.chunks_auto and run == dataclasses.replace(choice.strategy, activation_chunks=1)  # auto's, planned
    run, line = _strategy_for_run(loaded, choice, VideoShape(832, 480, 81), torch.device("cpu"))
    assert run is choice.strategy and line.startswith("no prediction at 832x480x81")  # tiny rope table: advice only


def test_an_explicit_tier_runs_the_chunk_count_its_plan_line_names(tiny_loaded, monkeypatch):
    """activation_chunks auto under a tier the user set: the Sampler plans it within the budgets and
    runs that count; left to the engine, auto chose again from the memory free at the call (a warm
    run's kept weights missing from it, the user's vram_budget_gb unread)."""
    from dataclasses import replace as replaced

    from vidmem.memory.plan import candidates
    from vidmem.memory.plan.stages import VideoShape
    from vidmem.nodes.sampler import _strategy_for_run

    monkeypatch.setattr(candidates, "fewest_chunks", lambda model, shape, strategy, options, vram, leanest_blocks=False:
                        replaced(strategy, activation_chunks=4))  # what a budget at a real size would need
    (choice,) = VidMemMemoryStrategy().build(vram_budget_gb=1.0, **strategy_inputs(offload="none"),
                                             activation_chunks="auto")["result"]
    assert choice.strategy.chunks_auto
    run, line = _strategy_for_run(tiny_loaded("wan2.1-t2v"), choice, VideoShape(32, 32, 9), torch.device("cpu"))
    assert run == replaced(choice.strategy, activation_chunks=4) and "activation_chunks=4" in line


def test_auto_chunks_are_planned_off_under_sageattention_1_with_a_note(tiny_loaded, monkeypatch):
    """The kernel cannot run in slices: the Sampler plans and runs unchunked and says why, instead of
    planning a count the run then refuses."""
    from test_attention import SAGE1_RESOLVED
    from vidmem.nodes import sampler as sampler_node
    from vidmem.pipelines.speed import ResolvedSpeed

    seen = []

    class Planned(Exception):
        pass

    def strategy_for_run(pipeline, choice, shape, device, options):
        seen.append(choice)
        raise Planned

    monkeypatch.setattr(sampler_node, "check_before_planning", lambda *args: ResolvedSpeed(None, SAGE1_RESOLVED))
    monkeypatch.setattr(sampler_node, "_strategy_for_run", strategy_for_run)
    (choice,) = VidMemMemoryStrategy().build(**strategy_inputs(offload="none"), activation_chunks="auto")["result"]
    with pytest.raises(Planned):
        sampler_node.VidMemVideoSampler().sample(tiny_loaded("wan2.1-t2v"), choice, "a cat", "", 32, 32, 9, 1, 1.0, 0)
    assert seen[0].strategy.activation_chunks == 1
    assert "sageattention 1.x cannot run in slices" in seen[0].notes[-1]


@pytest.mark.parametrize("tile_size, ok", [(256, True), (100, False), (32, False), (8192, False), (None, True)])
def test_strategy_queue_check_of_tile_size(tile_size, ok):
    import inspect

    named = list(inspect.signature(VidMemMemoryStrategy.VALIDATE_INPUTS).parameters)
    assert named == ["tile_size", "max_pinned_ram_gb", "vram_budget_gb", "ram_budget_gb"]  # what ComfyUI cannot check
    result = VidMemMemoryStrategy.VALIDATE_INPUTS(tile_size=tile_size)
    assert (result is True) == ok
    if not ok:
        assert result.startswith(f"tile_size={tile_size!r}")


@pytest.mark.parametrize("name, value, message", [
    ("max_pinned_ram_gb", float("nan"), "max_pinned_ram_gb=nan is not a finite number"),
    ("max_pinned_ram_gb", float("inf"), "max_pinned_ram_gb=inf is not a finite number"),
    ("max_pinned_ram_gb", -0.5, "max_pinned_ram_gb=-0.5 must be -1 (automatic), 0 (no pinning) or more"),
    ("max_pinned_ram_gb", 2000.0, "max_pinned_ram_gb=2000.0 must be from -1.0 to 1024.0"),
    ("vram_budget_gb", float("nan"), "vram_budget_gb=nan is not a finite number"),
    ("ram_budget_gb", float("-inf"), "ram_budget_gb=-inf is not a finite number"),
    ("ram_budget_gb", -1.0, "ram_budget_gb=-1.0 must be from 0.0 to 4096.0"),
])
def test_strategy_queue_check_refuses_non_finite_and_out_of_range_floats(name, value, message):
    assert message in VidMemMemoryStrategy.VALIDATE_INPUTS(tile_size=256, **{name: value})
    assert VidMemMemoryStrategy.VALIDATE_INPUTS(tile_size=256, **{name: None}) is True  # linked: no value yet


@pytest.mark.parametrize("frames, ok", [(49, True), (81, True), (9, True), (50, False), (0, False), (None, True)])
def test_sampler_queue_check_of_frames(frames, ok):
    from vidmem.nodes.sampler import VidMemVideoSampler

    result = VidMemVideoSampler.VALIDATE_INPUTS(frames=frames)
    assert (result is True) == ok, result
    if frames == 50:
        assert "use 49 or 53" in result and "wan 4k+1" in result


@pytest.mark.parametrize("inputs, message", [
    (dict(width=840), "width=840 must be a multiple of 16 for every model vidmem runs (32 for Wan 2.2 TI2V-5B); use 832 or 848"),
    (dict(height=8), "height=8 must be from 16 to 4096"),
    (dict(height=4100), "height=4100 must be from 16 to 4096"),
    (dict(cfg=float("nan")), "cfg=nan is not a finite number; give a number from 0.0 to 30.0"),
    (dict(cfg=float("inf")), "cfg=inf is not a finite number"),
    (dict(cfg=31.0), "cfg=31.0 must be from 0.0 to 30.0"),
    (dict(shift=float("nan")), "shift=nan is not a finite number"),
    (dict(cfg_2=float("-inf")), "cfg_2=-inf is not a finite number"),
    (dict(boundary_ratio=float("nan")), "boundary_ratio=nan is not a finite number"),
    (dict(boundary_ratio=1.0), "boundary_ratio=1.0 must be from 0.0 to 0.999"),
])
def test_sampler_queue_check_of_size_and_floats(inputs, message):
    from vidmem.nodes.sampler import VidMemVideoSampler

    good = dict(frames=81, width=832, height=480, cfg=5.0, shift=0.0, cfg_2=-1.0, boundary_ratio=0.0)
    assert VidMemVideoSampler.VALIDATE_INPUTS(**good) is True
    assert message in VidMemVideoSampler.VALIDATE_INPUTS(**{**good, **inputs})
    assert VidMemVideoSampler.VALIDATE_INPUTS(**{**good, **{name: None for name in inputs}}) is True  # linked


@pytest.mark.parametrize("node_id, inputs, message", [
    ("VidMemLoadLoRA", dict(strength=float("nan")), "strength=nan is not a finite number"),
    ("VidMemLoadLoRA", dict(strength=float("inf")), "strength=inf is not a finite number"),
    ("VidMemTrainLoRA", dict(alpha=float("inf")), "alpha=inf is not a finite number"),
    ("VidMemTrainLoRA", dict(learning_rate=float("nan")), "learning_rate=nan is not a finite number"),
    ("VidMemTrainLoRA", dict(learning_rate=0.5), "learning_rate=0.5 must be from 1e-07 to 0.1"),
])
def test_float_widgets_of_other_nodes_are_checked_when_queued(node_id, inputs, message):
    from vidmem.nodes import NODE_CLASS_MAPPINGS

    assert message in NODE_CLASS_MAPPINGS[node_id].VALIDATE_INPUTS(**inputs)


def test_every_float_widget_is_checked_when_queued():
    """NaN passes ComfyUI's min/max: a FLOAT widget no VALIDATE_INPUTS names would let it into the queue."""
    import inspect

    from vidmem.nodes import NODE_CLASS_MAPPINGS

    for node_id, cls in NODE_CLASS_MAPPINGS.items():
        spec = cls.INPUT_TYPES()
        floats = {name for category in ("required", "optional") for name, entry in spec.get(category, {}).items()
                  if entry[0] == "FLOAT"}
        named = set(inspect.signature(cls.VALIDATE_INPUTS).parameters) if hasattr(cls, "VALIDATE_INPUTS") else set()
        assert floats <= named, (node_id, floats - named)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(offload="block_swap"), "blocks_to_swap"),
        (dict(vae_tiling=True, tile_size=128, overlap=64), "overlap=64"),
        (dict(offload="block_swap", blocks_to_swap=-1), "blocks_to_swap=-1 must be 0 or more"),
    ],
)
def test_cross_input_problems_stop_the_strategy_node_naming_the_input(change, message):
    with pytest.raises(StrategyError, match=message):
        VidMemMemoryStrategy().build(**strategy_inputs(**change))


def _widget_default(entry):
    """What a fresh node holds in a widget: its default, else a list's first choice (None for a socket)."""
    kind, options = entry[0], (entry[1] if len(entry) > 1 else {})
    if "default" in options:
        return options["default"]
    return kind[0] if isinstance(kind, list) and kind else None


@pytest.mark.parametrize("node_id", sorted(n for n, c in NODE_CLASS_MAPPINGS.items() if hasattr(c, "VALIDATE_INPUTS")))
def test_a_linked_input_passes_every_queue_check(node_id):
    """ComfyUI 0.8.0 hands VALIDATE_INPUTS None for a linked input (its value does not exist when
    queued; nodes/checks.py): None never refuses a prompt, the value is checked when it arrives."""
    import inspect

    cls = NODE_CLASS_MAPPINGS[node_id]
    named = list(inspect.signature(cls.VALIDATE_INPUTS).parameters)
    inputs = all_inputs(cls)
    widgets = {name: _widget_default(inputs[name]) for name in named}
    assert cls.VALIDATE_INPUTS(**widgets) is True, "a fresh node queues"
    for name in named:
        assert cls.VALIDATE_INPUTS(**{**widgets, name: None}) is True, f"{node_id}.{name} linked"


def test_free_vram_passes_its_input_through_and_always_reruns():
    value = object()
    out = VidMemFreeVRAM().free(value)
    assert out["result"] == (value,)
    assert "rss_bytes" in out["ui"]["vidmem_receipt"][0]["before"]
    changed = VidMemFreeVRAM.IS_CHANGED(anything=value)
    assert math.isnan(changed) and changed != VidMemFreeVRAM.IS_CHANGED(anything=value)
    # So it says what that costs: a cold next queue, and every node after it run again.
    said = " ".join([VidMemFreeVRAM.DESCRIPTION, VidMemFreeVRAM.INPUT_TYPES()["required"]["anything"][1]["tooltip"],
                     *VidMemFreeVRAM.OUTPUT_TOOLTIPS])
    assert "the next queue is cold" in said and "runs again on every queue" in said


def test_host_without_comfyui_degrades_to_explicit_paths(tmp_path):
    assert not host.in_comfyui()
    assert host.diffusers_model_names() == []
    with pytest.raises(FileNotFoundError, match="give its full path in the 'path' input"):
        host.resolve_model_folder("Wan2.1-T2V-1.3B-Diffusers", "")
    assert host.resolve_model_folder("ignored", str(tmp_path)) == tmp_path
    host.check_interrupt()  # no host: never raises


def test_nodes_run_in_graph_order_and_return_core_types(tiny_folder):
    N = NODE_CLASS_MAPPINGS
    (pipeline,) = N["VidMemLoadPipeline"]().load(model="ignored", dtype="fp32", path=str(tiny_folder("wan2.1-t2v")))
    built = N["VidMemMemoryStrategy"]().build(**strategy_inputs(offload="block_swap", blocks_to_swap=1))
    (strategy,) = built["result"]
    assert strategy.strategy.blocks_to_swap == 1
    sampled = N["VidMemVideoSampler"]().sample(pipeline, strategy, "a cat", "", 32, 32, 9, 2, 5.0, 0)
    assert len(sampled["result"]) == len(N["VidMemVideoSampler"].RETURN_TYPES)
    (latent,) = sampled["result"]
    assert latent["samples"].shape == (1, 16, 3, 4, 4) and latent["samples"].device.type == "cpu"
    decoded = N["VidMemVAEDecode"]().decode(pipeline, latent, strategy)
    (frames,) = decoded["result"]
    assert frames.shape == (9, 32, 32, 3) and frames.dtype == torch.float32
    assert "Video Sampler" in sampled["ui"]["text"][0] and "decode" in decoded["ui"]["text"][0]


@pytest.mark.parametrize("latent, message", [("not a latent", "latent must be a LATENT"),
                                             ({"noise": 1}, "latent has no 'samples'"),
                                             ({"samples": torch.zeros(1, 16, 4, 4)}, "is not|shape")])
def test_save_latents_writes_nothing_for_a_bad_latent(latent, message, tiny_loaded, tmp_path, monkeypatch):
    from vidmem.nodes.decode import VidMemVAEDecode
    from vidmem.pipelines.family import ModelError

    folder = tmp_path / "input"
    monkeypatch.setattr(host, "latents_folder", lambda: folder)
    with pytest.raises(ModelError, match=message):
        VidMemVAEDecode().decode(tiny_loaded("wan2.1-t2v"), latent, None, save_latents=True)
    assert not folder.exists()


def test_saved_latents_go_where_core_load_latent_lists_them():
    """Core Load Latent lists the .latent files directly in input/ (not output/latents)."""
    assert host.latents_folder() == Path.cwd() / "input"
    source = (ROOT / "nodes" / "host.py").read_text()
    assert "get_input_directory()" in source.split("def latents_folder", 1)[1].split("\ndef ", 1)[0]


def test_decode_resolves_auto_at_the_latents_video_size(tiny_loaded):
    from vidmem.nodes.decode import _strategy_for_decode

    loaded = tiny_loaded("wan2.1-t2v")
    (auto,) = VidMemMemoryStrategy().build(vram_budget_gb=8.0, ram_budget_gb=64.0, **strategy_inputs(offload="auto"))["result"]
    chosen = _strategy_for_decode(loaded, auto, (1, 16, 3, 4, 4))  # the tiny model's 32x32x9 latent
    assert chosen.offload.value == "none" and chosen.vae_tiling is None  # everything fits 8 GiB
    (explicit,) = VidMemMemoryStrategy().build(**strategy_inputs(offload="model"))["result"]
    assert _strategy_for_decode(loaded, explicit, (1, 16, 3, 4, 4)) is explicit.strategy
    assert _strategy_for_decode(loaded, None, (1, 16, 3, 4, 4)) is None


def test_free_vram_stops_every_pipelines_parallel_ranks(tiny_loaded, monkeypatch):
    """Templates feed Free VRAM the decoded frames, not the pipeline: it stops every pool it knows."""
    from vidmem.pipelines.parallel import run as parallel_run

    class Pool:
        closed = 0

        def __init__(self, config):
            pass

        def close(self):
            Pool.closed += 1

    monkeypatch.setattr(parallel_run, "WorkerPool", Pool)
    monkeypatch.setattr(parallel_run.Ranks, "pool_config", lambda self: None)
    loaded = tiny_loaded("wan2.1-t2v")
    parallel_run.pool_for(loaded, parallel_run.Ranks(gpus=()))
    frames = torch.zeros(1, 8, 8, 3)
    out = VidMemFreeVRAM().free(frames)
    assert out["result"] == (frames,) and Pool.closed == 1
    assert getattr(loaded.pipe, parallel_run.POOL_ATTRIBUTE) is None and out["ui"]["vidmem_receipt"][0]["parallel_pools_stopped"] == 1
    assert VidMemFreeVRAM().free(frames)["ui"]["vidmem_receipt"][0]["parallel_pools_stopped"] == 0
