"""LoRAs on LTX-2 and HunyuanVideo 1.5: every key naming their trainers publish resolves to the same
layers (LTX-2's audio branch and cross-modal attention included; HunyuanVideo 1.5's fused qkv split
onto q, k and v), and sampling with the LoRA beside the layers gives, on tiers none, block_swap and
sequential, the frames of the same LoRA merged into the weights by hand; keys that cannot apply are
skipped with their reason.

Tolerance: beside the layer computes W x + s B (A x), merged computes (W + s B A) x; they differ by
fp32 rounding only, amplified by two denoising steps: measured 5e-7 to 8e-7 of the latents' magnitude,
asserted at 1e-5.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from contextlib import contextmanager

import pytest
import torch

from backends import StrictBackend
from test_lora import kohya_keys, peft_keys, random_lora, write
from test_tiers import request_for
from vidmem.memory import MemoryStrategy
from vidmem.pipelines.lora import LoraError, load_lora, with_lora
from vidmem.pipelines.sample import sample

LTX2, HY15 = "ltx2-t2v", "hunyuanvideo1.5-t2v"
TIERS = {
    "none": MemoryStrategy(offload="none"),
    "block_swap": MemoryStrategy(offload="block_swap", blocks_to_swap=1, prefetch_blocks=1),
    "sequential": MemoryStrategy(offload="sequential", prefetch_blocks=1),  # a fused layer's parts stream apart
}
RELATIVE_TOLERANCE = 1e-5

# --- LTX-2 ------------------------------------------------------------------------------------------

LTX2_ATTENTIONS = ("attn1", "attn2", "audio_attn1", "audio_attn2", "audio_to_video_attn", "video_to_audio_attn")
LTX2_BLOCK = tuple(f"{a}.{p}" for a in LTX2_ATTENTIONS for p in ("to_q", "to_k", "to_v", "to_out.0")) + (
    "ff.net.0.proj", "ff.net.2", "audio_ff.net.0.proj", "audio_ff.net.2")
LTX2_AUDIO = tuple(n for n in LTX2_BLOCK if "audio" in n)  # the audio branch and the cross-modal attention
LTX2_TOP = ("proj_in", "audio_proj_in", "time_embed.linear", "audio_time_embed.linear",
            "av_cross_attn_video_a2v_gate.linear", "caption_projection.linear_1", "proj_out")
# diffusers name -> LTX-2's own (ltx-core's module names; written here from the model definitions, not
# from the converter the loader uses, so a wrong mapping there fails here). Block layers keep their names.
LTX2_ORIGINAL = {"proj_in": "patchify_proj", "audio_proj_in": "audio_patchify_proj", "time_embed.linear": "adaln_single.linear",
                 "audio_time_embed.linear": "audio_adaln_single.linear",
                 "av_cross_attn_video_a2v_gate.linear": "av_ca_a2v_gate_adaln_single.linear"}


def ltx2_layers(blocks=LTX2_BLOCK, top=LTX2_TOP) -> list[str]:
    return [f"transformer_blocks.{i}.{name}" for i in range(2) for name in blocks] + list(top)


def ltx2_original(name: str) -> str:
    return LTX2_ORIGINAL.get(name, name)


# writer, alpha stored (None: none, scale 1), the naming the loader should report
LTX2_FORMATS = {
    "diffusers-peft": (peft_keys, None, "diffusers"),
    # Lightricks' own LoRAs (camera control, IC-LoRAs), ltx-trainer and ai-toolkit: PEFT tensors, original names
    "lightricks-diffusion_model-lora_A": (kohya_keys("diffusion_model.", False, "lora_A", "lora_B", naming=ltx2_original), None, "original"),
    "comfyui-model.diffusion_model-lora_down": (kohya_keys("model.diffusion_model.", False, naming=ltx2_original), 2.0, "original"),
    "kohya-flattened-original": (kohya_keys("lora_unet_", True, naming=ltx2_original), 2.0, "original (flattened)"),
}

# --- HunyuanVideo 1.5 -------------------------------------------------------------------------------

HY15_BLOCK = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
              "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
              "ff_context.net.2", "norm1.linear", "norm1_context.linear")
HY15_LAYERS = [f"transformer_blocks.{i}.{name}" for i in range(2) for name in HY15_BLOCK] + [
    "proj_out", "context_embedder.proj_in", "context_embedder.token_refiner.refiner_blocks.0.attn.to_out.0"]
# diffusers name -> Tencent's (hyvideo's HunyuanVideo 1.5 transformer), written from its model definition
HY15_ORIGINAL = (
    ("transformer_blocks.", "double_blocks."), ("attn.to_out.0", "img_attn_proj"), ("attn.to_add_out", "txt_attn_proj"),
    ("attn.add_q_proj", "txt_attn_q"), ("attn.add_k_proj", "txt_attn_k"), ("attn.add_v_proj", "txt_attn_v"),
    ("attn.to_q", "img_attn_q"), ("attn.to_k", "img_attn_k"), ("attn.to_v", "img_attn_v"),
    ("ff_context.net.0.proj", "txt_mlp.fc1"), ("ff_context.net.2", "txt_mlp.fc2"), ("ff.net.0.proj", "img_mlp.fc1"),
    ("ff.net.2", "img_mlp.fc2"), ("norm1_context.linear", "txt_mod.linear"), ("norm1.linear", "img_mod.linear"),
)
HY15_ORIGINAL_TOP = {"proj_out": "final_layer.linear", "context_embedder.proj_in": "txt_in.input_embedder",
                     "context_embedder.token_refiner.refiner_blocks.0.attn.to_out.0": "txt_in.individual_token_refiner.blocks.0.self_attn_proj"}


def hy15_original(name: str) -> str:
    if name in HY15_ORIGINAL_TOP:
        return HY15_ORIGINAL_TOP[name]
    for new, old in HY15_ORIGINAL:
        name = name.replace(new, old)
    return name


# diffusers name -> ComfyUI's (its HunyuanVideo model, Flux-style), for the one-to-one layers
HY15_COMFY = (
    ("transformer_blocks.", "double_blocks."), ("attn.to_out.0", "img_attn.proj"), ("attn.to_add_out", "txt_attn.proj"),
    ("ff_context.net.0.proj", "txt_mlp.0"), ("ff_context.net.2", "txt_mlp.2"), ("ff.net.0.proj", "img_mlp.0"),
    ("ff.net.2", "img_mlp.2"), ("norm1_context.linear", "txt_mod.lin"), ("norm1.linear", "img_mod.lin"),
)
HY15_COMFY_TOP = {"proj_out": "final_layer.linear", "context_embedder.proj_in": "txt_in.input_embedder",
                  "context_embedder.token_refiner.refiner_blocks.0.attn.to_out.0": "txt_in.individual_token_refiner.blocks.0.self_attn.proj"}
HY15_FUSED = {"img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"), "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")}


def comfy_original(name: str) -> str:
    if name in HY15_COMFY_TOP:
        return HY15_COMFY_TOP[name]
    for new, old in HY15_COMFY:
        name = name.replace(new, old)
    return name


def comfy_fused_keys(prefix, flatten):
    """ComfyUI's layout: q, k and v are one layer (`img_attn.qkv`). The three diffusers LoRAs become one
    of rank 3r (down stacked, up block-diagonal), whose product is exactly theirs stacked; PEFT
    tensors, no alpha (scale 1)."""
    def name(original):
        return prefix + (original.replace(".", "_") if flatten else original)

    def writer(lora, alpha):
        out = {}
        for layer, (down, up) in lora.items():
            if any(layer.endswith(part) for parts in HY15_FUSED.values() for part in parts):
                continue
            original = comfy_original(layer)
            out[f"{name(original)}.lora_A.weight"], out[f"{name(original)}.lora_B.weight"] = down, up
        for index in range(2):
            for fused, parts in HY15_FUSED.items():
                pairs = [lora[f"transformer_blocks.{index}.{part}"] for part in parts]
                out[f"{name(f'double_blocks.{index}.{fused}')}.lora_A.weight"] = torch.cat([down for down, _ in pairs])
                out[f"{name(f'double_blocks.{index}.{fused}')}.lora_B.weight"] = torch.block_diag(*[up for _, up in pairs])
        return out
    return writer


HY15_FORMATS = {
    "diffusers-peft": (peft_keys, None, "diffusers"),
    "kohya-flattened-diffusers": (kohya_keys("lora_unet_", True, naming=lambda n: n), 2.0, "diffusers (flattened)"),
    # Tencent's train.py (PEFT on its own model, saved without a prefix); its alpha is in the metadata (below)
    "tencent-original": (kohya_keys("", False, "lora_A", "lora_B", naming=hy15_original), None, "original"),
    "comfyui-diffusion_model-original": (kohya_keys("diffusion_model.", False, naming=hy15_original), 2.0, "original"),
    "musubi-flattened-original": (kohya_keys("lora_unet_", True, naming=hy15_original), 2.0, "original (flattened)"),
    # LoRAs made for ComfyUI's own model: fused q, k, v
    "comfyui-fused-qkv": (comfy_fused_keys("diffusion_model.", False), None, "original"),
    "comfyui-fused-qkv-flattened": (comfy_fused_keys("lora_unet_", True), None, "original (flattened)"),
}

# --- helpers ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def loaded(tiny_loaded):
    def get(variant):
        value = tiny_loaded(variant)
        latents(value, variant)  # transformers adds hooks of its own on first use
        return value
    return get


def latents(value, variant, strategy=TIERS["none"]) -> torch.Tensor:
    request = dataclasses.replace(request_for(variant), steps=2)
    return sample(value, strategy, request, backend=StrictBackend()).latent["samples"]


@contextmanager
def merged_by_hand(model, lora, scale):
    """W += scale * up @ down in place for each layer; every weight restored bit for bit afterwards."""
    saved = {}
    try:
        with torch.no_grad():
            for name, (down, up) in lora.items():
                weight = model.get_submodule(name).weight
                saved[name] = weight.detach().clone()
                weight += scale * (up @ down)
        yield
    finally:
        with torch.no_grad():
            for name, weight in saved.items():
                model.get_submodule(name).weight.copy_(weight)


def assert_close(ours, theirs, label):
    error, scale = (ours - theirs).abs().max(), theirs.abs().max()
    assert error <= RELATIVE_TOLERANCE * scale, f"{label}: max error {error:.3g} vs latent scale {scale:.3g}"


def check_sampling(value, variant, spec, lora, alpha, label):
    """`spec` (the LoRA `lora` as loaded) beside the layers on every tier: bit-identical across tiers,
    different from the base, and equal to the LoRA merged into the weights by hand."""
    strength = spec.strength
    styled = with_lora(value, spec)
    ours = {tier: latents(styled, variant, strategy) for tier, strategy in TIERS.items()}
    assert all(torch.equal(ours["none"], out) for out in ours.values()), f"{label}: tiers differ"
    base = latents(value, variant)
    assert (ours["none"] - base).abs().max() > 100 * RELATIVE_TOLERANCE * base.abs().max(), f"{label}: the LoRA changed nothing"
    scale = strength * (1.0 if alpha is None else alpha / next(iter(lora.values()))[0].shape[0])
    with merged_by_hand(value.pipe.transformer, lora, scale):
        theirs = latents(value, variant)
    assert_close(ours["none"], theirs, label)
    assert torch.equal(latents(value, variant), base), "the merged weights were not restored"


# --- tests --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", list(LTX2_FORMATS))
def test_ltx2_namings_resolve_every_layer_audio_branch_included(fmt, loaded, tmp_path):
    value = loaded(LTX2)
    writer, alpha, naming = LTX2_FORMATS[fmt]
    layers = ltx2_layers()
    path = write(tmp_path / f"{fmt}.safetensors", writer(random_lora(value.pipe.transformer, layers), alpha))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing skipped, so nothing warned
        spec = load_lora(path, value.pipe, 1.0)
    assert spec.naming == naming and not spec.skipped
    assert sorted(layer.module for layer in spec.layers["transformer"]) == sorted(layers)


@pytest.mark.parametrize("fmt", ["diffusers-peft", "lightricks-diffusion_model-lora_A"])
def test_ltx2_layers_agree_with_diffusers_own_lora_conversion(fmt, loaded, tmp_path):
    """LTX2Pipeline.lora_state_dict (diffusers' converter for LTX-2 LoRAs) names the same layers."""
    import diffusers

    value = loaded(LTX2)
    writer, alpha, _ = LTX2_FORMATS[fmt]
    path = write(tmp_path / "a.safetensors", writer(random_lora(value.pipe.transformer, ltx2_layers()), alpha))
    theirs = {key.removeprefix("transformer.").rsplit(".lora_", 1)[0] for key in diffusers.LTX2Pipeline.lora_state_dict(str(path))}
    ours = {layer.module for layer in load_lora(path, value.pipe, 1.0).layers["transformer"]}
    assert ours == theirs


@pytest.mark.parametrize("fmt, layers", [
    ("lightricks-diffusion_model-lora_A", ltx2_layers()),
    ("kohya-flattened-original", ltx2_layers()),
    ("lightricks-diffusion_model-lora_A", ltx2_layers(LTX2_AUDIO, ())),  # an audio-only LoRA changes the video too
])
def test_ltx2_lora_samples_as_merged_by_hand(fmt, layers, loaded, tmp_path):
    value = loaded(LTX2)
    writer, alpha, _ = LTX2_FORMATS[fmt]
    lora = random_lora(value.pipe.transformer, layers)
    path = write(tmp_path / f"{fmt}.safetensors", writer(lora, alpha))
    check_sampling(value, LTX2, load_lora(path, value.pipe, 0.8), lora, alpha, fmt)


def test_ltx2_keys_outside_the_transformer_are_skipped_and_worded(loaded, tmp_path):
    """The text connectors (diffusers keeps them outside the transformer) and a norm's delta are
    listed with their reason; the attention layers still apply."""
    value = loaded(LTX2)
    keys = LTX2_FORMATS["lightricks-diffusion_model-lora_A"][0](random_lora(value.pipe.transformer, ltx2_layers(("attn1.to_q",), ())), None)
    connector = "diffusion_model.video_embeddings_connector.transformer_1d_blocks.0.attn1.to_q"
    keys.update({f"{connector}.lora_A.weight": torch.ones(4, 16), f"{connector}.lora_B.weight": torch.ones(16, 4),
                 "text_embedding_projection.aggregate_embed.lora_A.weight": torch.ones(4, 48),
                 "text_embedding_projection.aggregate_embed.lora_B.weight": torch.ones(16, 4),
                 "diffusion_model.transformer_blocks.0.attn1.q_norm.diff": torch.zeros(16)})
    path = write(tmp_path / "mixed.safetensors", keys)
    with pytest.warns(UserWarning, match="5 key\\(s\\) not applied") as caught:
        spec = load_lora(path, value.pipe, 1.0)
    text = str(caught[0].message)
    assert f"{connector}.lora_A.weight: no layer '{connector}' in this LTX2VideoTransformer3DModel (original naming)" in text
    assert "text_embedding_projection.aggregate_embed.lora_B.weight: no layer" in text
    assert "q_norm.diff: transformer_blocks.0.attn1.norm_q is not a linear layer (its delta is all zeros)" in text
    assert [layer.module for layer in spec.layers["transformer"]] == ["transformer_blocks.0.attn1.to_q", "transformer_blocks.1.attn1.to_q"]


@pytest.mark.parametrize("fmt", list(HY15_FORMATS))
def test_hunyuan15_namings_resolve_and_sample_as_merged_by_hand(fmt, loaded, tmp_path):
    value = loaded(HY15)
    writer, alpha, naming = HY15_FORMATS[fmt]
    lora = random_lora(value.pipe.transformer, HY15_LAYERS)
    path = write(tmp_path / f"{fmt}.safetensors", writer(lora, alpha))
    spec = load_lora(path, value.pipe, 0.8)
    assert spec.naming == naming and not spec.skipped
    assert sorted(layer.module for layer in spec.layers["transformer"]) == sorted(HY15_LAYERS)
    check_sampling(value, HY15, spec, lora, alpha, fmt)


def test_hunyuan15_tencent_lora_takes_its_alpha_from_peft_metadata_and_splits_the_fused_refiner_qkv(loaded, tmp_path):
    """Tencent's saver writes PEFT's config (r, lora_alpha) as metadata. Its default targets every
    linear layer: the refiner's fused qkv too (split by rows onto to_q, to_k, to_v), and the final
    modulation, whose rows diffusers reorders: that one is listed as not applied."""
    value = loaded(HY15)
    model = value.pipe.transformer
    lora = random_lora(model, HY15_LAYERS)
    keys = HY15_FORMATS["tencent-original"][0](lora, None)
    refiner = "context_embedder.token_refiner.refiner_blocks.0.attn"
    gen = torch.Generator().manual_seed(3)
    down = torch.randn(4, model.get_submodule(f"{refiner}.to_q").in_features, generator=gen) * 0.2
    ups = [torch.randn(model.get_submodule(f"{refiner}.to_{x}").out_features, 4, generator=gen) * 0.2 for x in "qkv"]
    keys.update({"txt_in.individual_token_refiner.blocks.0.self_attn_qkv.lora_A.weight": down,
                 "txt_in.individual_token_refiner.blocks.0.self_attn_qkv.lora_B.weight": torch.cat(ups),
                 "final_layer.adaLN_modulation.1.lora_A.weight": torch.ones(4, 16),
                 "final_layer.adaLN_modulation.1.lora_B.weight": torch.ones(32, 4)})
    meta = {"lora_adapter_metadata": json.dumps({"r": 4, "lora_alpha": 8, "target_modules": "all-linear"})}
    path = write(tmp_path / "tencent.safetensors", keys, meta)
    with pytest.warns(UserWarning, match="2 key\\(s\\) not applied") as caught:
        spec = load_lora(path, value.pipe, 1.0)
    assert ("final_layer.adaLN_modulation.1.lora_B.weight: no layer 'final_layer.adaLN_modulation.1' in this "
            "HunyuanVideo15Transformer3DModel (original naming)") in str(caught[0].message)
    assert {layer.alpha for layer in spec.layers["transformer"]} == {8.0}
    merged = dict(lora) | {f"{refiner}.to_{x}": (down, up) for x, up in zip("qkv", ups)}
    assert sorted(layer.module for layer in spec.layers["transformer"]) == sorted(merged)
    check_sampling(value, HY15, spec, merged, 8.0, "tencent with metadata")


def test_a_fused_layer_of_another_size_is_refused_naming_its_parts(loaded, tmp_path):
    value = loaded(HY15)
    keys = {"diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight": torch.ones(4, 16),
            "diffusion_model.double_blocks.0.img_attn.qkv.lora_B.weight": torch.ones(40, 4)}
    with pytest.raises(LoraError, match=r"'diffusion_model.double_blocks.0.img_attn.qkv' has 40 output rows \(up\); it is "
                       r"transformer_blocks.0.attn.to_q \+ transformer_blocks.0.attn.to_k \+ transformer_blocks.0.attn.to_v fused, "
                       r"48 rows in this model"):
        load_lora(write(tmp_path / "big.safetensors", keys), value.pipe, 1.0)


def test_hunyuan15_names_come_from_the_file_readers_table():
    """Tencent's and ComfyUI's names for one layer resolve alike (comfy_files/hy15.py's table and
    ComfyUI's renames, shared with the file reader); the final modulation, whose shift and scale
    rows diffusers swaps, resolves to nothing, so a LoRA on it is reported rather than misapplied."""
    from vidmem.pipelines.lora.names import hunyuan15_original_to_diffusers

    pairs = {"txt_in.t_embedder.mlp.0": "txt_in.t_embedder.in_layer", "time_r_in.mlp.2": "time_r_in.out_layer",
             "double_blocks.4.txt_mod.linear": "double_blocks.4.txt_mod.lin",
             "txt_in.individual_token_refiner.blocks.1.mlp.fc2": "txt_in.individual_token_refiner.blocks.1.mlp.2",
             "txt_in.individual_token_refiner.blocks.1.self_attn_qkv": "txt_in.individual_token_refiner.blocks.1.self_attn.qkv"}
    found = hunyuan15_original_to_diffusers([*pairs, *pairs.values(), "final_layer.adaLN_modulation.1"])
    assert all(found[tencent] == found[comfy] for tencent, comfy in pairs.items())
    assert found["time_r_in.mlp.2"] == "time_embed.timestep_embedder_r.linear_2"
    assert found["txt_in.individual_token_refiner.blocks.1.self_attn_qkv"] == tuple(
        f"context_embedder.token_refiner.refiner_blocks.1.attn.to_{x}" for x in "qkv")
    assert "final_layer.adaLN_modulation.1" not in found


def test_ltx2_names_follow_diffusers_lora_converter_ltx23_included():
    """diffusers' LTX-2 LoRA converter, not its single-file one: LTX-2.3's prompt modulations
    (`prompt_adaln_single`, `audio_prompt_adaln_single`) get their diffusers names too."""
    from vidmem.pipelines.lora.names import ltx2_original_to_diffusers

    names = ["adaln_single.linear", "prompt_adaln_single.linear", "audio_prompt_adaln_single.linear",
             "transformer_blocks.0.attn1.to_q", "av_ca_a2v_gate_adaln_single.linear"]
    assert ltx2_original_to_diffusers(names) == {
        "adaln_single.linear": "time_embed.linear",
        "prompt_adaln_single.linear": "prompt_adaln.linear",
        "audio_prompt_adaln_single.linear": "audio_prompt_adaln.linear",
        "transformer_blocks.0.attn1.to_q": "transformer_blocks.0.attn1.to_q",
        "av_ca_a2v_gate_adaln_single.linear": "av_cross_attn_video_a2v_gate.linear",
    }
