"""Bad LoRA input fails with a LoraError naming the file and the fix; partial matches warn with
every skipped key; the Load LoRA node chains without mutating its input."""

from __future__ import annotations

import pytest
import torch

from test_lora import COG_LAYERS, WAN_LAYERS, kohya_keys, peft_keys, random_lora, write
from vidmem.nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS, host
from vidmem.nodes.lora import VidMemLoadLoRA
from vidmem.pipelines.loader import LoadedPipeline
from vidmem.pipelines.lora import LoraError, describe_loras, load_lora, lora_patches, read_lora_file
from vidmem.memory.units import human_bytes
from vidmem.pipelines.tiny import build_tiny_pipeline


@pytest.fixture(scope="module")
def wan():
    return build_tiny_pipeline("wan2.1-t2v")


@pytest.fixture(scope="module")
def cog():
    return build_tiny_pipeline("cogvideox-t2v")


def test_a_lora_for_another_size_names_the_layer_and_both_shapes(wan, tmp_path):
    wide = {n: (torch.zeros(4, 48), torch.zeros(48, 4)) for n in WAN_LAYERS[:1]}
    path = write(tmp_path / "wan14b_style.safetensors", peft_keys(wide, None))
    with pytest.raises(LoraError, match=r"wan14b_style.safetensors: LoRA on blocks.0.attn1.to_q: down \[4, 48\] / up \[48, 4\] do not fit: the model's layer is \[out, in\] = \[24, 24\]; this LoRA was made for another model family or size"):
        load_lora(path, wan)


def test_a_lora_for_another_family_matches_nothing(wan, cog, tmp_path):
    path = write(tmp_path / "cog_lora.safetensors", peft_keys(random_lora(cog.transformer, COG_LAYERS), None))
    with pytest.raises(LoraError, match=r"cog_lora.safetensors: none of its 12 keys apply to this WanTransformer3DModel.*another model family"):
        load_lora(path, wan)


def test_pickles_and_gguf_are_refused_naming_the_file(wan, tmp_path):
    pickled = tmp_path / "style.safetensors"
    torch.save({"a": torch.zeros(1)}, pickled)  # a pickle renamed .safetensors: refused by content
    with pytest.raises(LoraError, match=r"style.safetensors cannot be used: .* is a PyTorch pickle.*Convert it to .safetensors"):
        load_lora(pickled, wan)
    gguf = tmp_path / "style.gguf"
    gguf.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + bytes(56))  # a GGUF v3 header
    with pytest.raises(LoraError, match=r"style.gguf is a GGUF file; LoRAs are read from .safetensors files only"):
        load_lora(gguf, wan)
    with pytest.raises(LoraError, match="missing.safetensors cannot be used: .*no such file"):
        load_lora(tmp_path / "missing.safetensors", wan)


def test_expert_choice_on_a_single_expert_model_is_refused(wan, tmp_path):
    path = write(tmp_path / "lora.safetensors", peft_keys(random_lora(wan.transformer, WAN_LAYERS), None))
    with pytest.raises(LoraError, match=r"lora.safetensors: expert='high_noise' needs a two-expert model .* Set expert to 'both'"):
        load_lora(path, wan, 1.0, "high_noise")
    with pytest.raises(LoraError, match="strength 9 is outside"):
        load_lora(path, wan, 9)
    with pytest.raises(LoraError, match="expert='middle' is not valid"):
        load_lora(path, wan, 1.0, "middle")


def test_partial_matches_warn_with_every_skipped_key(wan, tmp_path):
    """An I2V LoRA (image attention) on a T2V model, plus a LoHa tensor the pack cannot apply."""
    keys = kohya_keys("diffusion_model.", False)(random_lora(wan.transformer, WAN_LAYERS), 4.0)
    keys["diffusion_model.blocks.0.cross_attn.k_img.lora_down.weight"] = torch.zeros(4, 24)
    keys["diffusion_model.blocks.0.cross_attn.k_img.lora_up.weight"] = torch.zeros(24, 4)
    keys["diffusion_model.blocks.0.self_attn.q.hada_w1_a"] = torch.ones(24, 2)
    path = write(tmp_path / "i2v.safetensors", keys)
    with pytest.warns(UserWarning, match="i2v.safetensors: 3 key") as record:
        spec = load_lora(path, wan)
    message = str(record[0].message)
    assert "cross_attn.k_img.lora_down.weight: no layer 'diffusion_model.blocks.0.cross_attn.k_img'" in message
    assert "cross_attn.k_img.lora_up.weight" in message
    assert "hada_w1_a: not a LoRA tensor vidmem reads (LoHa and LoKr" in message
    assert spec.skipped and len(spec.layers["transformer"]) == len(WAN_LAYERS)


@pytest.mark.parametrize("extra, metadata, evidence", [
    ({"transformer.blocks.0.attn1.to_q.lora_magnitude_vector": torch.ones(24)}, None,
     r"key 'transformer.blocks.0.attn1.to_q.lora_magnitude_vector'"),  # PEFT / diffusers save_lora_weights
    ({"diffusion_model.blocks.0.self_attn.q.dora_scale": torch.ones(1, 24)}, None,
     r"key 'diffusion_model.blocks.0.self_attn.q.dora_scale'"),  # kohya / LyCORIS, as ComfyUI reads it
    ({}, {"lora_adapter_metadata": '{"transformer.r": 4, "transformer.use_dora": true}'},
     r"'use_dora' in its 'lora_adapter_metadata' metadata"),
])
def test_a_dora_is_refused_naming_the_file_and_what_to_use_instead(wan, tmp_path, extra, metadata, evidence):
    """Its A/B without the magnitude would be neither the DoRA nor the base model: refused, also from the
    header alone (the plan's read), never half applied."""
    path = write(tmp_path / "dora.safetensors", {**peft_keys(random_lora(wan.transformer, WAN_LAYERS), None), **extra},
                 metadata)
    says = rf"dora.safetensors is a DoRA \({evidence}\); vidmem does not apply DoRA.*plain-LoRA release.*LoraLoaderModelOnly"
    with pytest.raises(LoraError, match=says):
        load_lora(path, wan)
    with pytest.raises(LoraError, match=says):
        read_lora_file(path, header_only=True)


def animate_keys(wan, face_adapter_names, flatten=False):
    """A Wan Animate LoRA in ComfyUI's naming: face-adapter layers (absent from a plain Wan) beside block layers."""
    keys = kohya_keys("lora_unet_" if flatten else "diffusion_model.", flatten)(random_lora(wan.transformer, WAN_LAYERS), 4.0)
    for name in face_adapter_names:
        stem = "lora_unet_" + name.replace(".", "_") if flatten else f"diffusion_model.{name}"
        keys[f"{stem}.lora_down.weight"], keys[f"{stem}.lora_up.weight"] = torch.randn(2, 8), torch.randn(16, 2)
    return keys


FACE_ADAPTER = ["face_adapter.fuser_blocks.0.linear1_kv", "face_adapter.fuser_blocks.0.linear1_q",
                "face_adapter.fuser_blocks.0.linear2"]


@pytest.mark.parametrize("flatten", [False, True])
def test_a_wan_animate_lora_applies_its_block_layers_and_lists_the_face_adapter(wan, tmp_path, flatten):
    """diffusers' Wan converter splits `linear1_kv` by its tensor's `.shape`: fed names, it raised an
    AttributeError out of Load LoRA. The names it cannot take are reported like any unknown layer."""
    path = write(tmp_path / "animate.safetensors", animate_keys(wan, FACE_ADAPTER, flatten))
    with pytest.warns(UserWarning, match=r"animate.safetensors: 6 key") as record:
        spec = load_lora(path, wan)
    assert "linear1_kv.lora_down.weight: no layer" in str(record[0].message)
    assert len(spec.layers["transformer"]) == len(WAN_LAYERS)
    plain = load_lora(write(tmp_path / "plain.safetensors", animate_keys(wan, [], flatten)), wan)
    assert [layer.module for layer in spec.layers["transformer"]] == [layer.module for layer in plain.layers["transformer"]]


def test_a_face_adapter_only_lora_is_refused_as_a_lora_for_another_model(wan, tmp_path):
    keys = animate_keys(wan, FACE_ADAPTER)
    path = write(tmp_path / "face_only.safetensors", {k: v for k, v in keys.items() if "face_adapter" in k})
    with pytest.raises(LoraError, match=r"face_only.safetensors: none of its 6 keys apply to this WanTransformer3DModel.*another model family"):
        load_lora(path, wan)


def test_incomplete_layer_is_refused(wan, tmp_path):
    keys = peft_keys(random_lora(wan.transformer, WAN_LAYERS), None)
    del keys["transformer.blocks.1.ffn.net.2.lora_B.weight"]
    with pytest.raises(LoraError, match=r"layer 'transformer.blocks.1.ffn.net.2' has no up \(lora_B/lora_up\) matrix"):
        load_lora(write(tmp_path / "cut.safetensors", keys), wan)


def test_node_chains_without_mutating_its_input(wan, tmp_path, monkeypatch):
    from vidmem.pipelines.wan import WAN

    write(tmp_path / "first.safetensors", peft_keys(random_lora(wan.transformer, WAN_LAYERS, seed=1), None))
    write(tmp_path / "second.safetensors", peft_keys(random_lora(wan.transformer, WAN_LAYERS, seed=2), None))
    monkeypatch.setattr(host, "resolve_lora", lambda name: tmp_path / name)
    loaded = LoadedPipeline(wan, WAN, "WanPipeline", "tiny", "fp32")
    node = VidMemLoadLoRA()
    first_run = node.load(loaded, "first.safetensors", 1.0, "both")
    (one,) = first_run["result"]
    assert first_run["ui"]["text"] == [f"first.safetensors x1 ({human_bytes(one.loras[0].nbytes)}): {len(WAN_LAYERS)} layers (diffusers key names)"]
    (two,) = node.load(one, "second.safetensors", -0.5, "both")["result"]
    assert loaded.loras == () and [s.name for s in one.loras] == ["first.safetensors"]
    assert [(s.name, s.strength) for s in two.loras] == [("first.safetensors", 1.0), ("second.safetensors", -0.5)]
    assert two.pipe is loaded.pipe  # the components are shared, never copied
    assert len(lora_patches(two.pipe, two.loras)) == 2 * len(WAN_LAYERS)
    assert "first.safetensors x1" in describe_loras(two.loras) and "second.safetensors x-0.5" in describe_loras(two.loras)
    # A tiny LoRA's bytes read in KiB, not as "0.0 MiB".
    assert one.loras[0].nbytes < 2**20 and " KiB)" in first_run["ui"]["text"][0] and " KiB beside the layers)" in describe_loras(two.loras)
    with pytest.raises(LoraError, match="needs a two-expert model"):
        node.load(loaded, "first.safetensors", 1.0, "low_noise")


def test_node_is_registered_with_tooltips():
    assert NODE_CLASS_MAPPINGS["VidMemLoadLoRA"] is VidMemLoadLoRA
    assert NODE_DISPLAY_NAME_MAPPINGS["VidMemLoadLoRA"] == "Load LoRA (VidMem)"
    inputs = VidMemLoadLoRA.INPUT_TYPES()["required"]
    assert list(inputs) == ["pipeline", "lora_name", "strength", "expert"]
    assert inputs["strength"][1]["min"] == -4.0 and inputs["strength"][1]["max"] == 4.0
    assert inputs["expert"][0] == ["both", "high_noise", "low_noise"]
    assert all(options[1].get("tooltip") for options in inputs.values())


def kohya_with_alpha(wan, alpha):
    """One layer in kohya form, its `.alpha` tensor replaced by `alpha`; (tensors, the alpha key)."""
    tensors = kohya_keys("diffusion_model.", False)(random_lora(wan.transformer, WAN_LAYERS[:1]), 4)
    key = next(k for k in tensors if k.endswith(".alpha"))
    tensors[key] = alpha
    return tensors, key


@pytest.mark.parametrize("alpha, says", [
    (torch.tensor(float("nan")), "is nan, not a finite number"),
    (torch.tensor(float("inf")), "is inf, not a finite number"),
    (torch.zeros(0), r"holds 0 values \(shape \[0\]\); an alpha is one number"),
    (torch.tensor([2.0, 9.0]), r"holds 2 values \(shape \[2\]\); an alpha is one number"),
])
def test_a_bad_alpha_tensor_is_refused_at_load_naming_the_file_and_key(wan, tmp_path, alpha, says):
    tensors, key = kohya_with_alpha(wan, alpha)
    path = write(tmp_path / "bad_alpha.safetensors", tensors)
    with pytest.raises(LoraError, match=rf"bad_alpha.safetensors: '{key}' {says}"):
        load_lora(path, wan)


@pytest.mark.parametrize("metadata, says", [
    ('{"lora_alpha": "abc"}', r"metadata 'lora_alpha' in 'lora_adapter_metadata' is 'abc', not a finite number"),
    ('{"transformer.lora_alpha": NaN}', r"metadata 'transformer.lora_alpha' .* is nan, not a finite number"),
    ('{"lora_alpha": true}', r"is True, not a finite number"),
    ('{"alpha_pattern": {"to_q": Infinity}}', r"'alpha_pattern' entry 'to_q' .* is inf"),
    ('[1, 2]', r"metadata is a JSON list, not an object of PEFT settings"),
])
def test_bad_peft_metadata_is_refused_at_load_naming_the_file(wan, tmp_path, metadata, says):
    path = write(tmp_path / "bad_meta.safetensors", peft_keys(random_lora(wan.transformer, WAN_LAYERS[:1]), None),
                 {"lora_adapter_metadata": metadata})
    with pytest.raises(LoraError, match=rf"bad_meta.safetensors: .*{says}.*re-save the LoRA"):
        load_lora(path, wan)


def test_a_rank_zero_layer_is_refused_at_load(wan, tmp_path):
    tensors = kohya_keys("diffusion_model.", False)(random_lora(wan.transformer, WAN_LAYERS[:1]), 4)
    for key, tensor in list(tensors.items()):
        if key.endswith("lora_down.weight"):
            tensors[key] = torch.zeros(0, tensor.shape[1])
        elif key.endswith("lora_up.weight"):
            tensors[key] = torch.zeros(tensor.shape[0], 0)
    path = write(tmp_path / "rank0.safetensors", tensors)
    with pytest.raises(LoraError, match=r"rank0.safetensors: layer 'diffusion_model.blocks.0.self_attn.q' has rank 0"):
        load_lora(path, wan)


@pytest.mark.parametrize("kind", ["lora_down.weight", "lora_up.weight"])
def test_a_matrix_that_is_not_2d_is_refused_with_both_shapes(wan, tmp_path, kind):
    """A 0-d matrix reaches the shape check (it raised a bare IndexError in the rank-0 check before it)."""
    tensors = kohya_keys("diffusion_model.", False)(random_lora(wan.transformer, WAN_LAYERS[:1]), 4)
    key = next(k for k in tensors if k.endswith(kind))
    tensors[key] = torch.tensor(1.0)
    path = write(tmp_path / "flat.safetensors", tensors)
    with pytest.raises(LoraError, match=r"flat.safetensors: .*do not fit"):
        load_lora(path, wan)


def test_a_metadata_alpha_written_as_a_number_string_is_read_as_the_number(wan, tmp_path):
    lora = random_lora(wan.transformer, WAN_LAYERS[:1])
    alphas = []
    for name, metadata in (("text", '{"lora_alpha": "2"}'), ("number", '{"lora_alpha": 2}')):
        spec = load_lora(write(tmp_path / f"{name}.safetensors", peft_keys(lora, None),
                               {"lora_adapter_metadata": metadata}), wan)
        alphas.append({layer.alpha for layers in spec.layers.values() for layer in layers})
    assert alphas[0] == alphas[1] == {2.0}
