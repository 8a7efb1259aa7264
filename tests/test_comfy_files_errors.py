"""Bad ComfyUI model files are refused before any model is built, with the file and the fix named."""

from __future__ import annotations

import json
import pickle
import shutil
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import safetensors.torch
import torch

from vidmem.nodes import host
from vidmem.nodes.load_files import NONE, SAME, VidMemLoadModelFiles
from vidmem.pipelines.comfy_files import LoadOptions, detect, load_model_files, read_weight_file
from vidmem.pipelines.family import ModelError
from vidmem.pipelines.tiny_files import save_tiny_comfy_files, tiny_catalogue


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cache = {}

    def get(variant, **kwargs):
        key = (variant, tuple(kwargs.items()))
        if key not in cache:
            cache[key] = save_tiny_comfy_files(variant, tmp_path_factory.mktemp(variant), "bf16", **kwargs).files
        return cache[key]

    return get


def load(files):
    return load_model_files(files, LoadOptions(dtype="fp32"), tiny_catalogue())


class _Marker:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):  # unpickling this creates the file: proof that nothing unpickled it
        return (open, (str(self.path), "w"))


@pytest.mark.parametrize("name", ["wan.safetensors", "wan.sft", "wan.gguf"])
def test_a_pickle_is_refused_unread_whatever_its_name(tiny, tmp_path, name):
    pickled = tmp_path / name
    pickled.write_bytes(pickle.dumps(_Marker(tmp_path / "unpickled")))
    with pytest.raises(ModelError, match="model: .*pickle"):
        load(replace(tiny("wan2.1-t2v"), model=pickled))
    zipped = tmp_path / f"zip_{name}"
    torch.save({"weight": torch.zeros(2)}, zipped)  # torch.save's zip format
    with pytest.raises(ModelError, match="vae: .*pickle"):
        load(replace(tiny("wan2.1-t2v"), vae=zipped))
    assert not (tmp_path / "unpickled").exists()


def test_a_truncated_file_says_so(tiny, tmp_path):
    whole = tiny("wan2.1-t2v").model.read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ModelError, match="model: .*truncated.*download it again"):
        load(replace(tiny("wan2.1-t2v"), model=cut))


def test_an_unknown_key_layout_is_named(tiny, tmp_path):
    odd = tmp_path / "odd.safetensors"
    safetensors.torch.save_file({"net.layer0.weight": torch.zeros(2, 2)}, str(odd))
    with pytest.raises(ModelError, match="model: 'odd.safetensors' has a key layout vidmem does not know.*net.layer0.weight"):
        load(replace(tiny("wan2.1-t2v"), model=odd))


def test_an_unsupported_gguf_quant_type_is_named(tiny, tmp_path):
    import gguf

    path = tmp_path / "wan_q2k.gguf"
    writer = gguf.GGUFWriter(str(path), arch="wan")
    writer.add_tensor("blocks.0.ffn.0.weight", np.zeros((4, 84), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q2_K)
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file, writer.close):
        write()
    with pytest.raises(ModelError, match="model: .*Q2_K.*supported"):
        load(replace(tiny("wan2.1-t2v"), model=path))


def test_a_file_in_the_wrong_slot_is_named(tiny):
    files = tiny("wan2.1-t2v")
    with pytest.raises(ModelError, match="text_encoder: .* holds a Wan VAE, but this input takes a T5 / UMT5 text encoder"):
        load(replace(files, text_encoder=files.vae))


def test_experts_must_share_one_architecture(tiny):
    with pytest.raises(ModelError, match="model_2: .* is not the other expert .*in_channels 48"):
        load(replace(tiny("wan2.2-a14b"), model_2=tiny("wan2.2-ti2v").model))
    # (one expert alone: test_comfy_detect, on the real I2V A14B shapes; the tiny A14B has Wan 2.1's)


def test_a_vae_of_the_other_latent_size_is_refused(tiny):
    with pytest.raises(ModelError, match="vae: .* has 48 latent channels but tiny-wan2.1-t2v works in 16"):
        load(replace(tiny("wan2.1-t2v"), vae=tiny("wan2.2-ti2v").vae))


def test_a_text_encoder_without_its_tokenizer_says_what_is_missing(tiny):
    bare = tiny("wan2.1-t2v", with_tokenizer=False)
    with pytest.raises(ModelError, match="no embedded tokenizer \\(no 'spiece_model' tensor\\).*umt5_xxl_fp8_e4m3fn_scaled"):
        load(bare)


def test_clip_vision_only_where_the_model_uses_it(tiny):
    with pytest.raises(ModelError, match="clip_vision: .*set clip_vision to clip_vision_h.safetensors"):
        load(replace(tiny("wan2.1-i2v"), clip_vision=None))
    with pytest.raises(ModelError, match="clip_vision: .*has no image encoder; set clip_vision to \\(none\\)"):
        load(replace(tiny("wan2.1-t2v"), clip_vision=tiny("wan2.1-i2v").clip_vision))


@pytest.mark.parametrize("options,message", [
    (dict(dtype="fp8"), "dtype='fp8'"), (dict(vae_dtype="int8"), "vae_dtype='int8'"),
    (dict(weight_dtype="q3"), "weight_dtype='q3' is not a storage format"),
])
def test_bad_options_are_refused(options, message):
    with pytest.raises(ModelError, match=message):
        LoadOptions(**options)


def test_the_node_lists_comfyuis_folders_and_loads_from_them(tiny, tmp_path, monkeypatch):
    """A stand-in for ComfyUI's folder_paths over a models/ tree (legacy 'unet' and 'clip' included)."""
    files = tiny("wan2.1-t2v")
    root = files.model.parent.parent
    folders = {"diffusion_models": [root / "diffusion_models"], "unet": [root / "diffusion_models"],
               "text_encoders": [root / "text_encoders"], "clip": [root / "text_encoders"], "vae": [root / "vae"],
               "clip_vision": [root / "clip_vision"]}
    gguf_copy = root / "diffusion_models" / "sub" / "copy.gguf"
    gguf_copy.parent.mkdir(exist_ok=True)
    shutil.copy(files.model, gguf_copy)  # listed by name only; never loaded here
    fake = SimpleNamespace(
        models_dir=str(root),
        get_folder_paths=lambda key: [str(p) for p in folders[key]],
        get_filename_list=lambda key: sorted(p.name for d in folders[key] if d.is_dir() for p in d.iterdir() if p.is_file()),
    )
    monkeypatch.setattr(host, "folder_paths", fake)
    inputs = VidMemLoadModelFiles.INPUT_TYPES()
    assert inputs["required"]["model"][0] == sorted([files.model.name, "sub/copy.gguf"])
    assert inputs["optional"]["model_2"][0][0] == NONE
    node_inputs = (files.model.name, files.text_encoder.name, files.vae.name, "fp32", SAME, "default", True)
    configs = root / "vidmem_configs"
    hidden = configs.rename(root / "configs_elsewhere")
    with pytest.raises(ModelError, match="no config for \\(width 24, 2 blocks.*vidmem knows .*wan2.1-i2v-14b-480p"):
        VidMemLoadModelFiles().load(*node_inputs)  # without models/vidmem_configs: the shipped configs only
    hidden.rename(configs)
    (loaded,) = VidMemLoadModelFiles().load(*node_inputs)
    assert loaded.class_name == "WanPipeline" and loaded.on_disk and loaded.storage["transformer"] == "bf16"
    with pytest.raises(FileNotFoundError, match="models/vae"):
        host.resolve_model_file("vae", "missing.safetensors")


def test_a_text_encoder_saved_under_a_prefix_is_read(tiny, tmp_path):
    """ComfyUI saves text encoders inside its own files as `<name>.transformer.*` with a prefixed marker."""
    files = tiny("wan2.1-t2v")
    tensors = safetensors.torch.load_file(str(files.text_encoder))
    prefixed = {("" if name == "spiece_model" else "umt5xxl.transformer.") + name: t for name, t in tensors.items()}
    prefixed["umt5xxl.transformer.scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    path = tmp_path / "umt5_prefixed.safetensors"
    safetensors.torch.save_file(prefixed, str(path))
    loaded = load(replace(files, text_encoder=path))
    assert loaded.pipe.tokenizer("a cat").input_ids == load(files).pipe.tokenizer("a cat").input_ids


def test_files_copied_into_ram_are_refused_when_ram_and_swap_cannot_hold_them(tiny, monkeypatch):
    """The machine's RAM is read at load time; weights_on_disk leaves the files mapped, so it still loads."""
    import psutil

    files = tiny("wan2.1-t2v")
    too_small = sum(p.stat().st_size for p in (files.model, files.text_encoder, files.vae)) // 2
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(total=too_small, available=too_small))
    monkeypatch.setattr(psutil, "swap_memory", lambda: SimpleNamespace(total=0))
    with pytest.raises(ModelError, match="weights_on_disk off.* of RAM .*model '.*'.*Turn weights_on_disk on"):
        load_model_files(files, LoadOptions(dtype="fp32", weights_on_disk=False), tiny_catalogue())
    assert load_model_files(files, LoadOptions(dtype="fp32", weights_on_disk=True), tiny_catalogue()).on_disk


def test_a_catalogue_config_that_does_not_describe_the_file_is_refused_before_building(tiny):
    """A model config (e.g. one in models/vidmem_configs) whose shape fields match but whose other
    sizes imply far more weights than the file holds is refused from the config, not allocated."""
    files = tiny("wan2.1-t2v")
    entries = []
    for entry in tiny_catalogue():
        vae = entry.components["vae"]
        huge = replace(vae, config={**vae.config, "dim_mult": [1, 2, 4, 4096]})
        entries.append(replace(entry, components={**entry.components, "vae": huge}))
    with pytest.raises(ModelError, match="vae: .* describes .* weights .* but vae '.*' hold only"):
        load_model_files(files, LoadOptions(dtype="fp32"), entries)


def test_shipped_wan_configs_carry_their_scheduler_and_vae_statistics():
    """What single-file loads sample and decode with comes from the shipped JSON, not from code."""
    import diffusers

    from vidmem.pipelines.comfy_files import shipped_catalogue

    entries = {entry.name: entry for entry in shipped_catalogue()}
    assert {"wan2.1-t2v-14b", "wan2.2-ti2v-5b", "wan2.2-i2v-a14b"} <= entries.keys()
    for entry in entries.values():
        scheduler = getattr(diffusers, entry.scheduler_class)(**entry.scheduler_config)
        assert scheduler.config.prediction_type == "flow_prediction" and scheduler.config.use_flow_sigmas
        # diffusers' conversion script: 5.0 for TI2V, 16.0 for FLF2V, 3.0 for every other model
        shift = {"wan2.2-ti2v-5b": 5.0, "wan2.1-flf2v-14b-720p": 16.0}.get(entry.name, 3.0)
        assert scheduler.config.flow_shift == shift, entry.name
    vae = entries["wan2.2-ti2v-5b"].config("vae")
    assert len(vae["latents_mean"]) == len(vae["latents_std"]) == vae["z_dim"] == 48


def test_an_extra_model_config_without_a_scheduler_is_named(tmp_path):
    from vidmem.pipelines.comfy_files import shipped_catalogue
    from vidmem.pipelines.tiny_files import tiny_model_config

    config = tiny_model_config("wan2.1-t2v")
    del config["scheduler"]
    (tmp_path / "mine.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match="mine.json has no \"scheduler\" entry"):
        shipped_catalogue([tmp_path])
    (tmp_path / "mine.json").write_text("{broken")
    with pytest.raises(ModelError, match="mine.json' is not valid JSON"):
        shipped_catalogue([tmp_path])


@pytest.mark.parametrize("spiece", [b"", bytes(range(256)) * 4])
def test_a_damaged_embedded_tokenizer_is_named_before_anything_is_built(tiny, tmp_path, spiece):
    files = tiny("wan2.1-t2v")
    tensors = safetensors.torch.load_file(str(files.text_encoder))
    tensors["spiece_model"] = torch.frombuffer(bytearray(spiece or b"\0"), dtype=torch.uint8)[: len(spiece)].clone()
    bad = tmp_path / "umt5.safetensors"
    safetensors.torch.save_file(tensors, str(bad))
    with pytest.raises(ModelError, match="text_encoder: 'umt5.safetensors' embeds a tokenizer .* not a SentencePiece model"):
        load(replace(files, text_encoder=bad))


@pytest.mark.parametrize("dropped,named_tensor", [
    ("shared.weight", "shared.weight"),
    ("encoder.block.0.layer.1.DenseReluDense.wi_0.weight", "encoder.block.0.layer.1.DenseReluDense.wi_0.weight"),
    ("encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight", "relative_attention_bias"),
])
def test_a_t5_file_missing_a_tensor_names_the_tensor_the_input_and_the_file(tiny, tmp_path, dropped, named_tensor):
    tensors = safetensors.torch.load_file(str(tiny("wan2.1-t2v").text_encoder))
    del tensors[dropped]
    cut = tmp_path / "umt5_cut.safetensors"
    safetensors.torch.save_file(tensors, str(cut))
    with pytest.raises(ModelError, match=rf"lacks the tensor '.*{named_tensor}.*': text_encoder 'umt5_cut.safetensors' is incomplete"):
        read_weight_file(cut, "text_encoder", detect.TEXT_ENCODER)


@pytest.mark.parametrize("key", ["tokenizer.ggml.scores", "tokenizer.ggml.token_type"])
def test_gguf_tokenizer_lists_shorter_than_its_tokens_are_named(tiny, tmp_path, key):
    from vidmem.pipelines.comfy_files.gguf_tokenizer import tokenizer_metadata
    from vidmem.pipelines.comfy_files.write import write_llama_cpp_text_encoder

    tensors = safetensors.torch.load_file(str(tiny("wan2.1-t2v").text_encoder))
    metadata = tokenizer_metadata(bytes(tensors.pop("spiece_model").numpy().tobytes()))
    metadata[key] = metadata[key][:-3]
    path = write_llama_cpp_text_encoder(tensors, tmp_path / "umt5_bad_tokenizer.gguf", "t5encoder", metadata)
    with pytest.raises(ModelError, match=rf"umt5_bad_tokenizer.gguf' has a damaged tokenizer: {key} lists"):
        read_weight_file(path, "text_encoder", detect.TEXT_ENCODER)


def _wan_tensors(tiny) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(str(tiny("wan2.1-t2v").model))


def test_a_matrix_of_the_wrong_rank_is_named_as_an_incomplete_file_not_raised_raw(tiny, tmp_path):
    """A 1-D `text_embedding.0.weight`: the shape readers index its second dimension (IndexError before the fix)."""
    tensors = _wan_tensors(tiny)
    tensors["text_embedding.0.weight"] = tensors["text_embedding.0.weight"].reshape(-1).contiguous()
    flat = tmp_path / "wan_rank1.safetensors"
    safetensors.torch.save_file(tensors, str(flat))
    with pytest.raises(ModelError, match=r"fewer dimensions than it should: model 'wan_rank1.safetensors' is incomplete"
                                         r" or of another variant"):
        read_weight_file(flat, "model", detect.TRANSFORMER)


def _write_gguf_as_is(tensors: dict[str, torch.Tensor], path) -> None:
    """`tensors` into a GGUF file in their own dtypes (bf16 as F32; integers stay integers, int8 as I8)."""
    import gguf

    from vidmem.pipelines.comfy_files.write import GGUF_ORIG_SHAPE

    writer = gguf.GGUFWriter(str(path), arch="wan")
    for name, tensor in tensors.items():
        array = (tensor.float() if tensor.is_floating_point() else tensor).numpy()
        if array.ndim > 4:  # GGUF holds at most four dimensions (as write.py writes them)
            writer.add_array(GGUF_ORIG_SHAPE + name, list(array.shape))
            array = array.reshape(array.shape[0], -1)
        writer.add_tensor(name, np.ascontiguousarray(array))
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file, writer.close):
        write()


@pytest.mark.parametrize("suffix", ["safetensors", "gguf"])
def test_an_integer_matrix_without_a_scale_is_named_with_the_file_and_the_fix(tiny, tmp_path, suffix):
    """int8 without a scale (safetensors) or GGUF's I8: an integer quantization vidmem does not read. Before the
    fix a bare StorageError naming only the dtype, neither the input nor the file."""
    tensors = _wan_tensors(tiny)
    name = "blocks.0.self_attn.q.weight"
    tensors[name] = torch.ones(tensors[name].shape, dtype=torch.int8)
    path = tmp_path / f"wan_int8.{suffix}"
    if suffix == "gguf":
        _write_gguf_as_is(tensors, path)
    else:
        safetensors.torch.save_file(tensors, str(path))
    with pytest.raises(ModelError, match=rf"model: 'wan_int8.{suffix}': the weight matrix '.*' is stored as torch.int8 "
                                         r"with no scale, an integer quantization vidmem does not read; use an fp8"):
        read_weight_file(path, "model", detect.TRANSFORMER)
    with pytest.raises(ModelError, match=rf"model: 'wan_int8.{suffix}': .*integer quantization"):
        load(replace(tiny("wan2.1-t2v"), model=path))
