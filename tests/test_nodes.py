"""Node contracts, loading the pack the way ComfyUI does, and the nodes run end to end."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

from vidmem.nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS, host
from vidmem.nodes.free import VidMemFreeVRAM
from vidmem.memory import StrategyError
from vidmem.nodes.strategy import VidMemMemoryStrategy

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
        assert isinstance(kind, list) or kind in LINK_TYPES | WIDGET_TYPES, (node_id, name)
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


def test_strategy_node_predicts_peaks_for_a_connected_pipeline(tiny_loaded):
    loaded = tiny_loaded("wan2.1-t2v")
    out = VidMemMemoryStrategy().build(pipeline=loaded, width=32, height=32, frames=9, vram_budget_gb=1.0,
                                       ram_budget_gb=64.0, **strategy_inputs(offload="block_swap", blocks_to_swap=1))
    (strategy,) = out["result"]
    assert strategy.offload.value == "block_swap" and strategy.blocks_to_swap == 1
    assert out["ui"]["text"][0].startswith("predicted: ") and "denoise" in out["ui"]["text"][0]
    plan = out["ui"]["vidmem_plan"][0]
    assert plan["fits"] is True and plan["peak_vram_bytes"] == max(plan["stages"].values()) > 0


def test_auto_chooses_a_strategy_that_fits_or_says_what_would(tiny_loaded):
    from vidmem.memory.planner import PlanError

    loaded = tiny_loaded("wan2.1-t2v")
    auto = strategy_inputs(offload="auto")
    roomy = VidMemMemoryStrategy().build(pipeline=loaded, width=32, height=32, frames=9, vram_budget_gb=8.0,
                                         ram_budget_gb=64.0, **auto)
    assert roomy["result"][0].offload.value == "none" and roomy["ui"]["text"][0].startswith("auto chose: ")
    with pytest.raises(PlanError, match="nothing fits"):
        VidMemMemoryStrategy().build(pipeline=loaded, width=32, height=32, frames=9, vram_budget_gb=1e-4,
                                     ram_budget_gb=64.0, **auto)
    with pytest.raises(StrategyError, match="needs the pipeline input connected"):
        VidMemMemoryStrategy().build(**auto)
    assert "blocks_to_swap must be 0" in VidMemMemoryStrategy.VALIDATE_INPUTS(**strategy_inputs(offload="auto", blocks_to_swap=3))


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(offload="block_swap"), "blocks_to_swap"),
        (dict(vae_tiling=True, tile_size=128, overlap=64), "overlap=64"),
        (dict(offload="none", blocks_to_swap=3), "blocks_to_swap=3 only applies"),
    ],
)
def test_strategy_validation_errors_reach_the_queue(change, message):
    result = VidMemMemoryStrategy.VALIDATE_INPUTS(**strategy_inputs(**change))
    assert isinstance(result, str) and message in result


def test_strategy_validation_accepts_good_and_linked_inputs():
    assert VidMemMemoryStrategy.VALIDATE_INPUTS(**strategy_inputs()) is True
    assert VidMemMemoryStrategy.VALIDATE_INPUTS(**strategy_inputs(offload=None)) is True


def test_free_vram_passes_its_input_through_and_always_reruns():
    value = object()
    out = VidMemFreeVRAM().free(value)
    assert out["result"] == (value,)
    assert "rss_bytes" in out["ui"]["vidmem_receipt"][0]["before"]
    changed = VidMemFreeVRAM.IS_CHANGED(anything=value)
    assert math.isnan(changed) and changed != VidMemFreeVRAM.IS_CHANGED(anything=value)


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
    sampled = N["VidMemVideoSampler"]().sample(pipeline, strategy, "a cat", "", 32, 32, 9, 2, 5.0, 0)
    assert len(sampled["result"]) == len(N["VidMemVideoSampler"].RETURN_TYPES)
    (latent,) = sampled["result"]
    assert latent["samples"].shape == (1, 16, 3, 4, 4) and latent["samples"].device.type == "cpu"
    decoded = N["VidMemVAEDecode"]().decode(pipeline, latent, strategy)
    (frames,) = decoded["result"]
    assert frames.shape == (9, 32, 32, 3) and frames.dtype == torch.float32
    assert "Video Sampler" in sampled["ui"]["text"][0] and "decode" in decoded["ui"]["text"][0]


def test_a_prediction_that_cannot_be_made_does_not_stop_the_run(tiny_loaded):
    loaded = tiny_loaded("wan2.1-t2v")  # the tiny model cannot run at 832x480 (rope table of 32)
    out = VidMemMemoryStrategy().build(pipeline=loaded, width=832, height=480, frames=81, **strategy_inputs())
    assert out["result"][0].offload.value == "model"
    assert "prediction unavailable" in out["ui"]["text"][0]
