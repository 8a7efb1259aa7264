"""The loaders check, before loading, what the graph's Video Samplers and Memory Strategies will ask
of the model (nodes/preflight.py): a size or a block count the model's config refuses stops the
prompt with nothing loaded, naming the node and the input."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vidmem.memory import StrategyError
from vidmem.nodes import host, plan_files
from vidmem.nodes.load_files import VidMemLoadModelFiles
from vidmem.nodes.loader import VidMemLoadPipeline
from vidmem.nodes.preflight import samplers_fed_by
from vidmem.pipelines.family import ModelError
from vidmem.pipelines.tiny_files import save_tiny_comfy_files


def graph(loader: str = "VidMemLoadPipeline", width=32, height=32, frames=9, offload="model", blocks=0, via_lora=True):
    """An API-format prompt: loader 1 -> (Load LoRA 2 ->) Sampler 4 <- Strategy 3 -> Decode 5 -> Save 6."""
    source = ["2", 0] if via_lora else ["1", 0]
    return {
        "1": {"class_type": loader, "inputs": {}},
        "2": {"class_type": "VidMemLoadLoRA", "inputs": {"pipeline": ["1", 0], "lora_name": "x", "strength": 1.0}},
        "3": {"class_type": "VidMemMemoryStrategy", "inputs": {"offload": offload, "blocks_to_swap": blocks}},
        "4": {"class_type": "VidMemVideoSampler", "inputs": {"pipeline": source, "strategy": ["3", 0],
                                                            "width": width, "height": height, "frames": frames}},
        "5": {"class_type": "VidMemVAEDecode", "inputs": {"pipeline": source, "latent": ["4", 0]}},
        "6": {"class_type": "SaveAnimatedWEBP", "inputs": {"images": ["5", 0]}},
    }


@pytest.fixture
def folder_loader(tiny_folder, monkeypatch):
    """Load Video Pipeline on the tiny Wan folder; `loads` records every real load."""
    loads = []
    import vidmem.nodes.loader as node_module

    real = node_module.load_pipeline
    monkeypatch.setattr(node_module, "load_pipeline", lambda *args, **kwargs: loads.append(args) or real(*args, **kwargs))
    path = str(tiny_folder("wan2.1-t2v"))
    return lambda prompt: VidMemLoadPipeline().load("x", "fp32", path=path, prompt=prompt, unique_id="1"), loads


def test_the_loader_finds_the_samplers_it_feeds_through_lora_nodes():
    assert [sid for sid, _ in samplers_fed_by(graph(), "1")] == ["4"]
    assert [sid for sid, _ in samplers_fed_by(graph(via_lora=False), "1")] == ["4"]
    assert samplers_fed_by(graph(), "3") == []


def test_a_size_the_model_cannot_place_is_refused_before_loading(folder_loader):
    load, loads = folder_loader
    with pytest.raises(ModelError, match=r"Video Sampler \(node 4\), checked against .* config before loading it: "
                                         r"width=832 is more than .* use width 512 or less"):
        load(graph(width=832, height=480))
    with pytest.raises(ModelError, match=r"Video Sampler \(node 4\), .*: frames=11 is not valid for wan"):
        load(graph(frames=11))
    assert loads == []


def test_more_blocks_than_the_model_has_are_refused_before_loading(folder_loader):
    load, loads = folder_loader
    with pytest.raises(StrategyError, match=r"Memory Strategy \(node 3\), checked against .* config before loading "
                                            r"it: blocks_to_swap=50 but its transformer has 2 blocks; use 1..2"):
        load(graph(offload="block_swap", blocks=50))
    assert loads == []


@pytest.mark.parametrize("prompt", [
    graph(), graph(offload="block_swap", blocks=2), graph(offload="model", blocks=50),  # ignored under model
    graph(width=["9", 0], height=480), graph(offload=["9", 0], blocks=50), None,  # values from other nodes: not checked
])
def test_a_good_graph_or_one_it_cannot_read_loads(folder_loader, prompt):
    load, loads = folder_loader
    (loaded,) = load(prompt)
    assert loaded.class_name == "WanPipeline" and len(loads) == 1


def with_node(prompt: dict, nid: str, class_type: str, **inputs) -> dict:
    return {**prompt, nid: {"class_type": class_type, "inputs": inputs}}


@pytest.mark.parametrize("extra", [
    {},  # a second Sampler left on the canvas, connected to nothing
    {"8": ("VidMemVAEDecode", {"latent": ["7", 0]})},  # decoded, and the frames go nowhere
])
def test_a_sampler_no_output_needs_is_not_checked(folder_loader, extra):
    """ComfyUI runs (and validates) only what an output node needs: a bad value on a Sampler it will
    not run must not stop the loader the rest of the graph uses."""
    load, loads = folder_loader
    prompt = with_node(graph(), "7", "VidMemVideoSampler", pipeline=["1", 0], width=32, height=32, frames=10)
    for nid, (class_type, inputs) in extra.items():
        prompt = with_node(prompt, nid, class_type, pipeline=["1", 0], **inputs)
    (loaded,) = load(prompt)
    assert loaded.class_name == "WanPipeline" and len(loads) == 1


@pytest.mark.parametrize("output", ["VidMemFreeVRAM", "VHS_VideoCombine"])  # an OUTPUT_NODE of ours; another pack's
def test_a_sampler_feeding_an_output_through_any_node_is_checked(folder_loader, output):
    load, loads = folder_loader
    prompt = with_node(graph(), "7", "VidMemVideoSampler", pipeline=["1", 0], width=32, height=32, frames=10)
    prompt = with_node(prompt, "8", "VidMemVAEDecode", pipeline=["1", 0], latent=["7", 0])
    prompt = with_node(prompt, "9", output, images=["8", 0])
    with pytest.raises(ModelError, match=r"Video Sampler \(node 7\), .*: frames=10 is not valid for wan"):
        load(prompt)
    assert loads == []


def test_the_files_loader_checks_from_the_files_headers(tmp_path, monkeypatch):
    written = save_tiny_comfy_files("wan2.1-t2v", tmp_path, "bf16", reference=False).files
    folders = {"diffusion_models": "diffusion_models", "unet": "diffusion_models", "text_encoders": "text_encoders",
               "clip": "text_encoders", "vae": "vae", "clip_vision": "clip_vision"}
    monkeypatch.setattr(host, "folder_paths", SimpleNamespace(
        models_dir=str(tmp_path), get_folder_paths=lambda key: [str(tmp_path / folders[key])]))
    plan_files.recognise.cache_clear()
    import vidmem.nodes.load_files as node_module

    loads = []
    monkeypatch.setattr(node_module, "load_model_files", lambda *args: loads.append(args))
    inputs = dict(model=written.model.name, text_encoder=written.text_encoder.name, vae=written.vae.name, dtype="fp32",
                  vae_dtype="same as dtype", weight_dtype="default", weights_on_disk=True, unique_id="1")
    with pytest.raises(ModelError, match=r"Video Sampler \(node 4\), .*: width=832 is more than tiny-wan2.1-t2v can place"):
        VidMemLoadModelFiles().load(**inputs, prompt=graph("VidMemLoadModelFiles", width=832, height=480))
    with pytest.raises(StrategyError, match=r"tiny-wan2.1-t2v's config .*: blocks_to_swap=3 but its transformer has 2 blocks"):
        VidMemLoadModelFiles().load(**inputs, prompt=graph("VidMemLoadModelFiles", offload="block_swap", blocks=3))
    assert loads == []
    VidMemLoadModelFiles().load(**inputs, prompt=graph("VidMemLoadModelFiles"))
    assert len(loads) == 1


def test_both_loaders_ask_comfyui_for_the_prompt():
    for node in (VidMemLoadPipeline, VidMemLoadModelFiles):
        assert node.INPUT_TYPES()["hidden"] == {"prompt": "PROMPT", "unique_id": "UNIQUE_ID"}
