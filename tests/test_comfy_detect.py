"""Every shipped Wan variant is recognised from its tensors' shapes alone (real sizes, on meta).

The files are stood in for by their tensors' shapes: each shipped config is built on the meta
device, its state renamed to the file layout, read back through the same readers the loader uses.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vidmem.pipelines.comfy_files import detect, match, shipped_catalogue
from vidmem.pipelines.comfy_files.build import build_empty
from vidmem.pipelines.comfy_files.files import WeightFile
from vidmem.pipelines.comfy_files.keys import (KeyLayout, original_transformer_names, transformer_to_diffusers,
                                               vae_original_names)
from vidmem.pipelines.family import ModelError

CATALOGUE = {entry.name: entry for entry in shipped_catalogue()}
# Wan 2.1 I2V 480p and 720p are one architecture (only their default sizes differ): the first is chosen.
SAME_WEIGHTS_AS = {"wan2.1-i2v-14b-720p": "wan2.1-i2v-14b-480p"}


def meta_state(entry, component: str) -> dict:
    with torch.device("meta"):
        return dict(build_empty(entry.components[component]).state_dict())


def transformer_file(entry, layout: KeyLayout, component: str = "transformer") -> WeightFile:
    state = meta_state(entry, component)
    if layout is not KeyLayout.DIFFUSERS:
        names = original_transformer_names(state, "model.diffusion_model." if layout is KeyLayout.PREFIXED else "")
        state = transformer_to_diffusers({names[n]: t for n, t in state.items()}, layout)
    return WeightFile(Path(f"{entry.name}.safetensors"), detect.TRANSFORMER, layout, "bf16", state, detect.transformer_fields(state))


@pytest.mark.parametrize("name", sorted(CATALOGUE))
@pytest.mark.parametrize("layout", list(KeyLayout))
def test_each_shipped_transformer_is_recognised_in_each_layout(name, layout):
    entry = CATALOGUE[name]
    file = transformer_file(entry, layout)
    assert match.choose_model(file, entry.experts, CATALOGUE.values()).name == SAME_WEIGHTS_AS.get(name, name)


def test_a_single_a14b_expert_asks_for_its_partner_and_a14b_experts_are_not_wan21():
    a14b = CATALOGUE["wan2.2-i2v-a14b"]
    with pytest.raises(ModelError, match="set model_2 to its low-noise expert"):
        match.choose_model(transformer_file(a14b, KeyLayout.ORIGINAL), 1, CATALOGUE.values())
    # Wan 2.2 T2V A14B's experts have Wan 2.1 T2V 14B's shapes: one file is 2.1, two files are 2.2.
    t2v = transformer_file(CATALOGUE["wan2.2-t2v-a14b"], KeyLayout.ORIGINAL)
    assert match.choose_model(t2v, 1, CATALOGUE.values()).name == "wan2.1-t2v-14b"
    assert match.choose_model(t2v, 2, CATALOGUE.values()).name == "wan2.2-t2v-a14b"


@pytest.mark.parametrize("model,z_dim", [("wan2.1-t2v-14b", 16), ("wan2.2-ti2v-5b", 48)])
def test_wan_vaes_are_told_apart_by_latent_channels_in_both_layouts(model, z_dim):
    entry = CATALOGUE[model]
    state = meta_state(entry, "vae")
    original = {name: state[d] for d, name in vae_original_names(state).items()}
    for tensors, is_original in ((state, False), (original, True)):
        fields = detect.vae_fields(tensors, original=is_original)
        assert fields == detect.vae_config_fields(entry.config("vae")) and fields["z_dim"] == z_dim
    other = CATALOGUE["wan2.2-ti2v-5b" if z_dim == 16 else "wan2.1-t2v-14b"]
    vae = WeightFile(Path("vae.safetensors"), detect.VAE, KeyLayout.ORIGINAL, "bf16", original, detect.vae_fields(original, True))
    with pytest.raises(ModelError, match=f"has {z_dim} latent channels"):
        match.check_vae(other, vae)


def test_umt5_xxl_and_clip_vision_h_fit_their_configs_and_t5_xxl_is_refused():
    entry = CATALOGUE["wan2.1-i2v-14b-480p"]
    umt5 = meta_state(entry, "text_encoder")
    fields = detect.text_encoder_fields(umt5)
    assert fields["class"] == "UMT5EncoderModel" and fields["vocab_size"] == 256384
    text = WeightFile(Path("umt5.safetensors"), detect.TEXT_ENCODER, KeyLayout.DIFFUSERS, "bf16", umt5, fields, b"spiece")
    match.check_text_encoder(entry, text)
    clip = meta_state(entry, "image_encoder")
    clip = {n.removeprefix("vision_model."): t for n, t in clip.items()}
    match.check_clip_vision(entry, WeightFile(Path("clip.safetensors"), detect.CLIP_VISION, KeyLayout.DIFFUSERS, "bf16", clip,
                                              detect.clip_vision_fields(clip)))
    from vidmem.pipelines.comfy_files.catalogue import read_component  # the shipped t5-v1_1-xxl, as CogVideoX uses it
    with torch.device("meta"):
        t5 = dict(build_empty(read_component("text_encoder", {"ref": "t5-v1_1-xxl"})).state_dict())
    wrong = WeightFile(Path("t5xxl.safetensors"), detect.TEXT_ENCODER, KeyLayout.DIFFUSERS, "bf16", t5, detect.text_encoder_fields(t5), b"x")
    with pytest.raises(ModelError, match="umt5-xxl"):
        match.check_text_encoder(entry, wrong)


def test_storage_is_the_matrices_format():
    fp8 = torch.zeros(4, 4, dtype=torch.float8_e4m3fn)
    assert detect.storage_name({"a.weight": fp8, "b.weight": fp8, "norm.weight": torch.zeros(4, 4)}) == "fp8_e4m3fn"
    assert detect.storage_name({"a.weight": torch.zeros(4, 4, dtype=torch.float16), "a.bias": torch.zeros(4)}) == "fp16"
