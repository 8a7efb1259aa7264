"""The trained LoRA file as other tools read it: diffusers' own load_lora_weights gives our loader's
output; ComfyUI's rules (keys it maps for Wan, alpha only from `.alpha` tensors) give the trained
scale; a LoRA trained on one Wan 2.2 expert is named like any other and refused on the other one.

ComfyUI itself is not imported here (not a test dependency): its rules are restated from
comfy/lora.py (0.8.0): `model_lora_keys_unet` maps `diffusion_model.<its own module name>` (Wan's
original layout) and `lora_unet_<flattened>`; `load_lora` reads alpha from `<key>.alpha` alone,
and applies `alpha / rank` (1 without one) x up @ down.
"""

from __future__ import annotations

import json
import warnings

import pytest
import safetensors
import safetensors.torch
import torch

from test_lora import WAN_LAYERS, assert_close, cog_inputs, needs_peft, run, wan_inputs, wan_original
from test_train_support import make_dataset, prepare_tiny
from vidmem.memory import MemoryStrategy
from vidmem.memory.device import CpuBackend
from vidmem.pipelines.loader import load_pipeline
from vidmem.pipelines.lora import LoraError, load_lora
from vidmem.training import TrainOutputs, TrainSettings, train_lora

RANK, ALPHA = 4, 2.0  # alpha != rank: a scale of 0.5 that every reader must apply
TARGETS = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "ffn.net.0.proj", "ffn.net.2")


@pytest.fixture(scope="module")
def trained(tiny_loaded, tmp_path_factory):
    """(variant, expert) -> TrainResult of a short run with alpha != rank."""
    root = tmp_path_factory.mktemp("trained-readers")
    data_dir = make_dataset(root / "data", clips=1)
    cache = {}

    def get(variant, expert="both"):
        if (variant, expert) not in cache:
            loaded = tiny_loaded(variant)
            data = prepare_tiny(loaded, data_dir, root / f"cache-{variant}")
            targets = TARGETS if variant.startswith("wan") else ("to_q", "to_k", "to_v", "to_out.0")
            settings = TrainSettings(rank=RANK, alpha=ALPHA, learning_rate=2e-2, steps=3, seed=1, expert=expert,
                                     target_modules=targets)
            name = f"{variant}-{expert}"
            cache[variant, expert] = train_lora(loaded, data, MemoryStrategy(offload="none"), settings,
                                                TrainOutputs(root / f"{name}.safetensors", root / f"ck-{name}"), CpuBackend())
        return cache[variant, expert]

    return get


def file_of(path):
    with safetensors.safe_open(str(path), "pt") as opened:
        return {k: opened.get_tensor(k) for k in opened.keys()}, opened.metadata()


def diffusers_reference(tiny_folder, variant, path, **load):
    """A fresh pipeline from the same folder (a reloaded pipeline runs a little differently from a
    built one), with diffusers' own LoRA loading and fusing."""
    pipe = load_pipeline(tiny_folder(variant), "fp32").pipe
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe.load_lora_weights(str(path), **load)
        pipe.fuse_lora(lora_scale=1.0, components=["transformer_2" if load.get("load_into_transformer_2") else "transformer"])
    return pipe


@needs_peft
@pytest.mark.parametrize("variant", ["wan2.1-t2v", "cogvideox-t2v"])
def test_diffusers_reads_the_trained_file_as_our_loader_does(tiny_loaded, tiny_folder, trained, variant):
    loaded = tiny_loaded(variant)
    result = trained(variant)
    inputs = wan_inputs() if variant.startswith("wan") else cog_inputs()
    spec = load_lora(result.lora_path, loaded.pipe, 1.0)
    assert not spec.skipped
    ours = run(loaded.pipe, inputs, [spec])
    # the checkpoint's raw tensors with the trained alpha in its metadata: the scale the run trained with
    raw = run(loaded.pipe, inputs, [load_lora(result.receipt["checkpoint"] + "/lora.safetensors", loaded.pipe, 1.0)])
    theirs = diffusers_reference(tiny_folder, variant, result.lora_path).transformer(**inputs)[0].detach()
    assert not torch.allclose(ours, run(loaded.pipe, inputs), atol=1e-6), "the LoRA changed nothing"
    assert_close(ours, raw, f"{variant}: file vs checkpoint")
    assert_close(ours, theirs, f"{variant}: ours vs diffusers")


def test_metadata_is_in_the_prefixed_form_diffusers_writes(trained):
    _, metadata = file_of(trained("wan2.1-t2v").lora_path)
    adapter = json.loads(metadata["lora_adapter_metadata"])
    # the alpha / rank scale is folded into lora_B, so alpha is recorded as the rank (scale 1)
    assert adapter["transformer.r"] == RANK and adapter["transformer.lora_alpha"] == RANK
    record = json.loads(metadata["vidmem_training"])
    assert record["alpha"] == ALPHA and record["rank"] == RANK and record["folded_scale"] == ALPHA / RANK


def comfy_wan_deltas(tensors):
    """ComfyUI 0.8.0's reading of a Wan LoRA (comfy/lora.py): stems it maps -> the weight delta it adds."""
    deltas = {}
    for key in tensors:
        if key.endswith(".lora_B.weight"):
            stem = key.removesuffix(".lora_B.weight")
            up, down = tensors[key], tensors[f"{stem}.lora_A.weight"]
            alpha = tensors[f"{stem}.alpha"].item() / down.shape[0] if f"{stem}.alpha" in tensors else 1.0
            deltas[stem] = alpha * (up @ down)
    return deltas


def test_comfyui_maps_every_key_and_applies_the_trained_scale(tiny_loaded, trained):
    loaded = tiny_loaded("wan2.1-t2v")
    result = trained("wan2.1-t2v")
    tensors, _ = file_of(result.lora_path)
    spec = load_lora(result.lora_path, loaded.pipe, 1.0)
    expected = {f"diffusion_model.{wan_original(layer.module)}": layer for layer in spec.layers["transformer"]}
    deltas = comfy_wan_deltas(tensors)
    assert set(deltas) == set(expected)  # every layer under a name ComfyUI maps for Wan
    checkpoint, _ = file_of(result.receipt["checkpoint"] + "/lora.safetensors")
    for stem, layer in expected.items():
        down, up = (checkpoint[f"transformer.{layer.module}.lora_{ab}.weight"] for ab in "AB")
        torch.testing.assert_close(deltas[stem], (ALPHA / RANK) * (up @ down), rtol=1e-6, atol=1e-7)


def test_wan_layer_names_match_the_independent_table():
    """The writer's Wan names (diffusers' converter run forwards) agree with test_lora's own table."""
    from vidmem.pipelines.lora.names import wan_diffusers_to_original

    assert wan_diffusers_to_original(WAN_LAYERS) == {path: wan_original(path) for path in WAN_LAYERS}
    with pytest.raises(LoraError, match="no original Wan name for condition_embedder"):
        wan_diffusers_to_original(["condition_embedder.time_proj"])


@needs_peft
def test_a_low_noise_expert_lora_is_named_for_diffusers_transformer_2_loading(tiny_loaded, tiny_folder, trained):
    loaded = tiny_loaded("wan2.2-a14b")
    result = trained("wan2.2-a14b", "low_noise")
    tensors, metadata = file_of(result.lora_path)
    assert all(k.startswith("diffusion_model.blocks.") for k in tensors)
    assert json.loads(metadata["vidmem_training"])["expert"] == "low_noise"
    spec = load_lora(result.lora_path, loaded.pipe, 1.0, "low_noise")
    inputs = wan_inputs()
    with torch.no_grad():
        from vidmem.memory.lora import apply_loras
        from vidmem.pipelines.lora import lora_patches

        with apply_loras(lora_patches(loaded.pipe, [spec])):
            ours = loaded.pipe.transformer_2(**inputs)[0]
    theirs = diffusers_reference(tiny_folder, "wan2.2-a14b", result.lora_path, load_into_transformer_2=True)
    assert_close(ours, theirs.transformer_2(**inputs)[0].detach(), "low-noise expert")


@pytest.mark.parametrize("expert", ["both", "high_noise"])
def test_a_low_noise_expert_lora_is_refused_on_the_other_expert(tiny_loaded, trained, expert):
    loaded = tiny_loaded("wan2.2-a14b")
    result = trained("wan2.2-a14b", "low_noise")
    with pytest.raises(LoraError, match=r"trained on Wan 2.2 A14B's low-noise expert \(transformer_2\).*Set expert to 'low_noise'"):
        load_lora(result.lora_path, loaded.pipe, 1.0, expert)


def test_an_expert_record_from_an_older_file_is_read_from_its_component(tiny_loaded, tmp_path):
    """Files written before `expert` was recorded name only the component."""
    loaded = tiny_loaded("wan2.2-a14b")
    layer = loaded.pipe.transformer_2.blocks[0].attn1.to_q
    tensors = {"transformer.blocks.0.attn1.to_q.lora_A.weight": torch.ones(2, layer.in_features),
               "transformer.blocks.0.attn1.to_q.lora_B.weight": torch.ones(layer.out_features, 2)}
    path = tmp_path / "old.safetensors"
    safetensors.torch.save_file(tensors, str(path), metadata={"vidmem_training": json.dumps({"component": "transformer_2"})})
    with pytest.raises(LoraError, match="low-noise expert"):
        load_lora(path, loaded.pipe, 1.0, "both")
    assert load_lora(path, loaded.pipe, 1.0, "low_noise").layers.keys() == {"transformer_2"}
    with pytest.warns(UserWarning, match="has one transformer"):
        load_lora(path, tiny_loaded("wan2.1-t2v").pipe, 1.0)
