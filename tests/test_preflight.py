"""The loaders check, before loading, what the graph's Video Samplers and Memory Strategies will ask
of the model (nodes/preflight.py): a size or a block count the model's config refuses stops the
prompt with nothing loaded, naming the node and the input. So do a training graph's settings and
Strategies (Train LoRA's rules between inputs, no gpus list or context parallelism for training)."""

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
from vidmem.training import TrainingError


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


STRATEGY = dict(offload="model", blocks_to_swap=0, prefetch_blocks=1, max_pinned_ram_gb=-1.0, non_blocking=True,
                text_encoder="device", vae_slicing=False, vae_tiling=False, tile_size=256, overlap=32, temporal_size=64,
                temporal_overlap=8)
TRAIN = dict(lora_name="my_lora", rank=4, alpha=4.0, learning_rate=1e-4, steps=2, batch_size=1, seed=0,
             target_modules="to_q,to_k", gradient_checkpointing=True, optimizer="adamw", checkpoint_every=0,
             resume=False, expert="both", activation_offload="off")


def training_graph(strategy: dict | None = None, train: dict | None = None, prepare_strategy: dict | None = None,
                   output: bool = True) -> dict:
    """loader 1 -> Prepare Training Data 3 -> Train LoRA 4 -> Save 5 (its lora_name output); Strategy 2 for
    Train LoRA, Strategy 6 for Prepare (both the same unless `prepare_strategy`)."""
    prompt = {
        "1": {"class_type": "VidMemLoadPipeline", "inputs": {}},
        "2": {"class_type": "VidMemMemoryStrategy", "inputs": STRATEGY | (strategy or {})},
        "6": {"class_type": "VidMemMemoryStrategy", "inputs": STRATEGY | (prepare_strategy or {})},
        "3": {"class_type": "VidMemPrepareTrainingData", "inputs": {"pipeline": ["1", 0], "strategy": ["6", 0],
                                                                   "folder": "", "resolutions": "32x32",
                                                                   "frame_buckets": "9"}},
        "4": {"class_type": "VidMemTrainLoRA", "inputs": {"pipeline": ["1", 0], "data": ["3", 0], "strategy": ["2", 0],
                                                         **TRAIN, **(train or {})}},
    }
    if output:
        prompt["5"] = {"class_type": "PreviewAny", "inputs": {"source": ["4", 1]}}
    return prompt


@pytest.mark.parametrize("bad, error, refusal", [
    (dict(train=dict(activation_offload="on", gradient_checkpointing=False)), TrainingError,
     r"Train LoRA \(node 4\), checked before loading the model: activation_offload needs gradient_checkpointing on"),
    (dict(train=dict(optimizer="sgd")), TrainingError, r"Train LoRA \(node 4\), .*: optimizer='sgd' is not one of"),
    (dict(strategy=dict(gpus="0,1")), StrategyError,
     r"Memory Strategy \(node 2\) of Train LoRA \(node 4\), checked before loading the model: Train LoRA runs on "
     r"ComfyUI's device only; the Memory Strategy asks for balanced gpus=0,1"),
    (dict(strategy=dict(context_parallel="ulysses")), StrategyError,
     r"Memory Strategy \(node 2\) of Train LoRA \(node 4\), .*asks for ulysses"),
    (dict(prepare_strategy=dict(gpus="cpu:2", context_parallel="ulysses")), StrategyError,
     r"Memory Strategy \(node 6\) of Prepare Training Data \(node 3\), .*: Prepare Training Data runs on ComfyUI's device"),
])
def test_a_training_graph_is_checked_before_loading(folder_loader, bad, error, refusal):
    """Train LoRA's settings and the training nodes' Strategy used to be refused only after the model loaded."""
    load, loads = folder_loader
    with pytest.raises(error, match=refusal):
        load(training_graph(**bad))
    assert loads == []


@pytest.mark.parametrize("prompt", [
    training_graph(),
    training_graph(train=dict(activation_offload="on", gradient_checkpointing=["9", 0])),  # linked: checked when it runs
    training_graph(strategy=dict(gpus="0,1", offload=["9", 0])),  # a Strategy not understood: left to the run
    training_graph(strategy=dict(gpus="0,1"), train=dict(activation_offload="on", gradient_checkpointing=False),
                   output=False),  # Train LoRA feeds no output: ComfyUI does not run it
])
def test_a_good_training_graph_or_one_it_cannot_read_loads(folder_loader, prompt):
    load, loads = folder_loader
    (loaded,) = load(prompt)
    assert loaded.class_name == "WanPipeline" and len(loads) == 1
