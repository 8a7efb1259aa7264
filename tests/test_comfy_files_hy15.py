"""HunyuanVideo 1.5 from Comfy-Org's single files (hunyuanvideo1.5_*_{fp16,bf16,fp8_scaled}.safetensors) as
Load Video Pipeline's transformer_file, over a HunyuanVideo 1.5 diffusers folder that supplies the rest.

The tiny files are written from the folder's own transformer under Comfy-Org's names (q/k/v fused,
the final modulation in Tencent's order: the reverse of comfy_files/hy15.py's table), so the
file-loaded pipeline must sample bit for bit as the folder-loaded one; a wrong table entry fails
the round trip, and the names are checked against the keys ComfyUI and musubi-tuner read."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from test_hunyuan_video15 import TIERS, VARIANT, request
from vidmem.memory.device import CpuBackend
from vidmem.memory.storage import fold_scaled_fp8, is_file_backed, open_weights
from vidmem.pipelines.comfy_files import detect, hy15
from vidmem.pipelines.comfy_files.files import read_weight_file
from vidmem.pipelines.comfy_files.keys import COMFY_PREFIX, KeyLayout
from vidmem.pipelines.comfy_files.write import dequantized, write_hy15_transformer
from vidmem.pipelines.decode import decode
from vidmem.pipelines.family import ModelError
from vidmem.pipelines.loader import load_pipeline
from vidmem.pipelines.sample import sample

HY15_CONFIGS = ("hunyuanvideo1.5-t2v-480p", "hunyuanvideo1.5-t2v-720p", "hunyuanvideo1.5-i2v-480p", "hunyuanvideo1.5-i2v-720p")
# Keys ComfyUI's comfy/model_detection.py reads to detect and configure HunyuanVideo (1.5: byt5_in,
# cond_type_embedding, vision_in), and the fused attention key musubi-tuner names "ComfyUI repackaged".
COMFY_KEYS = ("txt_in.individual_token_refiner.blocks.0.norm1.weight", "img_in.proj.weight", "final_layer.linear.weight",
              "txt_in.input_embedder.weight", "byt5_in.fc1.weight", "cond_type_embedding.weight", "vision_in.proj.0.weight",
              "double_blocks.0.img_attn_qkv.weight", "double_blocks.0.txt_attn_qkv.weight")
DIFFUSERS_ONLY = ("transformer_blocks.", "context_embedder", "x_embedder", "time_embed.", "to_q", "norm_out", "proj_out", "ff.net")


def plain_tensors(loaded) -> dict[str, torch.Tensor]:
    return {name: t.detach() for name, t in loaded.pipe.transformer.state_dict().items()}


@pytest.fixture(scope="module")
def comfy_file(tiny_loaded, tmp_path_factory):
    path = tmp_path_factory.mktemp("hy15") / "hunyuanvideo1.5_480p_t2v_tiny_fp32.safetensors"
    return write_hy15_transformer(plain_tensors(tiny_loaded(VARIANT)), path, "fp32")


def copied_matrices(module) -> list[str]:
    """The Linear / Embedding layers whose weight is not a view of a file mapping (copied at load)."""
    return [name for name, layer in module.named_modules() if isinstance(layer, (torch.nn.Linear, torch.nn.Embedding))
            and not is_file_backed(getattr(layer, "weight_stored", None) or layer.weight)]


def file_tensors(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), "pt") as file:
        return {name: file.get_tensor(name) for name in file.keys()}


def latents(loaded, tier: str) -> torch.Tensor:
    return sample(loaded, TIERS[tier], request(), backend=CpuBackend()).latent["samples"]


# --- the layout -----------------------------------------------------------------------------------

def test_the_written_names_are_comfy_orgs_and_read_back_to_the_same_tensors(comfy_file, tiny_loaded):
    tensors = file_tensors(comfy_file)
    assert set(COMFY_KEYS) <= set(tensors)
    assert not [n for n in tensors if any(fragment in n for fragment in DIFFUSERS_ONLY)]
    qkv, q = tensors["double_blocks.0.img_attn_qkv.weight"], plain_tensors(tiny_loaded(VARIANT))["transformer_blocks.0.attn.to_q.weight"]
    assert qkv.shape[0] == 3 * q.shape[0] and torch.equal(qkv[: q.shape[0]], q)  # rows q, k, v
    assert hy15.transformer_layout(tensors) is KeyLayout.ORIGINAL
    back = hy15.transformer_tensors(tensors, KeyLayout.ORIGINAL, comfy_file.name)
    plain = plain_tensors(tiny_loaded(VARIANT))
    assert set(back) == set(plain) and all(torch.equal(back[n], plain[n]) for n in plain)


# Spot checks written from diffusers' scripts/convert_hunyuan_video1_5_to_diffusers.py (not installed)
# rather than from the table, so an entry wrong both ways (which the round trips cannot see) fails here.
SCRIPT_PAIRS = {
    "double_blocks.3.img_mod.linear.weight": "transformer_blocks.3.norm1.linear.weight",
    "double_blocks.3.txt_mod.linear.bias": "transformer_blocks.3.norm1_context.linear.bias",
    "double_blocks.3.img_mlp.fc2.weight": "transformer_blocks.3.ff.net.2.weight",
    "double_blocks.3.txt_mlp.fc1.weight": "transformer_blocks.3.ff_context.net.0.proj.weight",
    "double_blocks.3.txt_attn_q_norm.weight": "transformer_blocks.3.attn.norm_added_q.weight",
    "double_blocks.3.txt_attn_proj.weight": "transformer_blocks.3.attn.to_add_out.weight",
    "double_blocks.3.img_attn_proj.bias": "transformer_blocks.3.attn.to_out.0.bias",
    "txt_in.individual_token_refiner.blocks.1.adaLN_modulation.1.weight":
        "context_embedder.token_refiner.refiner_blocks.1.norm_out.linear.weight",
    "txt_in.individual_token_refiner.blocks.1.self_attn_proj.weight": "context_embedder.token_refiner.refiner_blocks.1.attn.to_out.0.weight",
    "txt_in.t_embedder.mlp.2.weight": "context_embedder.time_text_embed.timestep_embedder.linear_2.weight",
    "txt_in.c_embedder.linear_1.weight": "context_embedder.time_text_embed.text_embedder.linear_1.weight",
    "vision_in.proj.3.weight": "image_embedder.linear_2.weight",
    "vision_in.proj.4.bias": "image_embedder.norm_out.bias",
    "byt5_in.fc3.weight": "context_embedder_2.linear_3.weight",
    "time_r_in.mlp.0.weight": "time_embed.timestep_embedder_r.linear_1.weight",
}


def test_the_table_agrees_with_diffusers_conversion_script():
    for original, name in SCRIPT_PAIRS.items():
        marker = torch.zeros(2, 2)
        assert hy15.transformer_tensors({original: marker}, KeyLayout.ORIGINAL, "x") == {name: marker}, original
        assert list(hy15.original_tensors({name: marker})) == [original], name
    q, k, v = torch.zeros(1, 2), torch.ones(1, 2), torch.full((1, 2), 2.0)
    split = hy15.transformer_tensors({"double_blocks.0.txt_attn_qkv.weight": torch.cat([q, k, v])}, KeyLayout.ORIGINAL, "x")
    assert [split[f"transformer_blocks.0.attn.add_{p}_proj.weight"].max().item() for p in "qkv"] == [0.0, 1.0, 2.0]


def test_the_final_modulation_is_stored_shift_first():
    """Tencent's final layer chunks (shift, scale), diffusers' AdaLayerNormContinuous (scale, shift)."""
    scale_then_shift = torch.cat([torch.full((2, 3), 1.0), torch.full((2, 3), 2.0)])
    written = hy15.original_tensors({"norm_out.linear.weight": scale_then_shift})
    assert torch.equal(written[hy15.SWAPPED + ".weight"][:2], torch.full((2, 3), 2.0))
    back = hy15.transformer_tensors(written, KeyLayout.ORIGINAL, "x")
    assert torch.equal(back["norm_out.linear.weight"], scale_then_shift)


@pytest.mark.parametrize("name", HY15_CONFIGS)
def test_the_shipped_8b_configs_round_trip_on_meta_and_their_shapes_give_their_fields(name):
    """Real-size names and shapes (on meta: no memory): every diffusers tensor has an original name,
    the ComfyUI keys are there, and the shapes give the config's fields back."""
    from vidmem.pipelines.comfy_files.build import build_empty
    from vidmem.pipelines.comfy_files.catalogue import entry_from_json
    from vidmem.pipelines.configs import MODELS_DIR
    from vidmem.pipelines.json_files import read_json_object

    entry = entry_from_json(read_json_object(MODELS_DIR / f"{name}.json", "model config"))
    with torch.device("meta"):
        state = build_empty(entry.components["transformer"]).state_dict()
    original = hy15.original_tensors(state)
    assert set(COMFY_KEYS) <= set(original) and hy15.transformer_layout(original) is KeyLayout.ORIGINAL
    assert original["txt_in.input_embedder.weight"].shape[1] == 3584 and original["img_in.proj.weight"].shape[:2] == (2048, 65)
    back = hy15.transformer_tensors(original, KeyLayout.ORIGINAL, name)
    assert {n: t.shape for n, t in back.items()} == {n: t.shape for n, t in state.items()}
    assert hy15.transformer_fields(back) == detect.transformer_config_fields(entry.config("transformer"))


def test_t2v_i2v_480p_and_720p_transformers_have_the_same_shapes():
    """What the tensors cannot tell (so the folder's config decides): the four released transformers
    differ only in task_type and target_size, which diffusers' model does not read."""
    from vidmem.pipelines.comfy_files.catalogue import entry_from_json
    from vidmem.pipelines.configs import MODELS_DIR
    from vidmem.pipelines.json_files import read_json_object

    fields = [detect.transformer_config_fields(entry_from_json(read_json_object(MODELS_DIR / f"{n}.json", "c")).config("transformer"))
              for n in HY15_CONFIGS]
    assert all(f == fields[0] for f in fields)


# --- loaded and sampled ---------------------------------------------------------------------------

def test_the_file_samples_and_decodes_bit_for_bit_as_the_folder(comfy_file, tiny_folder, tiny_loaded):
    reference = tiny_loaded(VARIANT)
    loaded = load_pipeline(tiny_folder(VARIANT), "fp32", comfy_file)
    assert loaded.source.endswith("+ " + comfy_file.name) and loaded.storage["transformer"] == "fp32"
    assert copied_matrices(loaded.pipe.transformer) == ["norm_out.linear"]  # the rest used in place from the file's mapping
    ours, theirs = loaded.pipe.transformer.state_dict(), reference.pipe.transformer.state_dict()
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    for tier in ("none", "block_swap:1", "block_swap:2"):
        assert torch.equal(latents(loaded, tier), latents(reference, tier)), tier
    result = sample(loaded, TIERS["none"], request(), backend=CpuBackend()).latent
    frames = decode(loaded, result, backend=CpuBackend()).frames
    assert torch.equal(frames, decode(reference, sample(reference, TIERS["none"], request(), backend=CpuBackend()).latent,
                                      backend=CpuBackend()).frames)


def test_an_i2v_file_over_its_i2v_folder_samples_as_the_folder(tiny_folder, tiny_loaded, tmp_path):
    """The image-conditioned pipeline (SigLIP tokens through the file's vision_in) from the file, bit for bit."""
    from test_hunyuan_video15 import I2V

    reference = tiny_loaded(I2V)
    path = write_hy15_transformer(plain_tensors(reference), tmp_path / "hunyuanvideo1.5_480p_i2v_tiny.safetensors", "fp32")
    loaded = load_pipeline(tiny_folder(I2V), "fp32", path)
    assert loaded.needs_image
    image = torch.full((1, 64, 64, 3), 128 / 255)
    for tier in ("none", "block_swap:1"):
        ours, theirs = (sample(p, TIERS[tier], request(image=image), backend=CpuBackend()).latent["samples"]
                        for p in (loaded, reference))
        assert torch.equal(ours, theirs), tier


def tencent_unfused(path, tmp_path):
    """Tencent's own checkpoint keeps the double blocks' q, k and v apart."""
    tensors = {}
    for name, tensor in file_tensors(path).items():
        if name.startswith("double_blocks.") and "_attn_qkv." in name:
            for part, rows in zip("qkv", tensor.chunk(3)):
                tensors[name.replace("_attn_qkv.", f"_attn_{part}.")] = rows.clone()
        else:
            tensors[name] = tensor
    save_file(tensors, str(tmp_path / "hunyuanvideo1.5_tencent.safetensors"))
    return tmp_path / "hunyuanvideo1.5_tencent.safetensors"


def prefixed(path, tmp_path):
    save_file({COMFY_PREFIX + n: t for n, t in file_tensors(path).items()}, str(tmp_path / "hy15_prefixed.safetensors"))
    return tmp_path / "hy15_prefixed.safetensors"


def diffusers_named(path, tmp_path):
    tensors = hy15.transformer_tensors(file_tensors(path), KeyLayout.ORIGINAL, path.name)
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(tmp_path / "hy15_diffusers.safetensors"))
    return tmp_path / "hy15_diffusers.safetensors"


# What ComfyUI's own model (comfy/ldm/hunyuan_video/model.py, Flux-style) names these parameters, and so
# what its ModelSave writes under `model.model.`: written from that model, not from hy15.COMFY_RENAMES.
COMFY_SAVED_KEYS = ("model.model.double_blocks.0.img_attn.qkv.weight", "model.model.double_blocks.1.txt_attn.qkv.bias",
                    "model.model.double_blocks.0.img_attn.norm.query_norm.scale",
                    "model.model.double_blocks.0.txt_attn.norm.key_norm.scale",
                    "model.model.double_blocks.1.img_mod.lin.weight", "model.model.double_blocks.0.txt_mlp.2.bias",
                    "model.model.double_blocks.0.img_attn.proj.weight", "model.model.txt_in.t_embedder.in_layer.weight",
                    "model.model.txt_in.c_embedder.out_layer.bias", "model.model.time_in.in_layer.weight",
                    "model.model.txt_in.individual_token_refiner.blocks.0.self_attn.qkv.weight",
                    "model.model.txt_in.individual_token_refiner.blocks.0.mlp.0.weight",
                    "model.model.final_layer.adaLN_modulation.1.weight", "model.model.cond_type_embedding.weight")


def comfy_saved(path, tmp_path):
    """As ComfyUI's ModelSave writes this family (process_unet_state_dict_for_saving): its model's names under `model.model.`."""
    plain = hy15.transformer_tensors(file_tensors(path), KeyLayout.ORIGINAL, path.name)
    written = write_hy15_transformer(plain, tmp_path / "hy15_saved_by_comfyui.safetensors", "fp32", KeyLayout.PREFIXED)
    names = set(file_tensors(written))
    assert set(COMFY_SAVED_KEYS) <= names and hy15.transformer_layout(names) is KeyLayout.PREFIXED
    assert not [n for n in names if "_attn_qkv." in n or "mlp.fc" in n or ".linear." in n.replace("final_layer.linear.", "")]
    return written


@pytest.mark.parametrize("layout", [tencent_unfused, prefixed, comfy_saved, diffusers_named],
                         ids=["tencent", "model.diffusion_model", "saved-by-comfyui", "diffusers"])
def test_the_other_layouts_load_the_same(layout, comfy_file, tiny_folder, tiny_loaded, tmp_path):
    path = layout(comfy_file, tmp_path)
    loaded = load_pipeline(tiny_folder(VARIANT), "fp32", path)
    assert torch.equal(latents(loaded, "none"), latents(tiny_loaded(VARIANT), "none"))


@pytest.mark.parametrize("storage", ["fp8_e4m3fn", "fp8_scaled", "gguf_q8_0"])
def test_a_quantized_file_runs_as_stored(storage, tiny_folder, tiny_loaded, tmp_path):
    """Stored matrices stay stored (fused q/k/v split into row ranges of the same data, one shared
    scale) and are upcast per layer: the same latents as the file's values dequantized first and
    then mapped in fresh memory."""
    suffix = "gguf" if storage.startswith("gguf") else "safetensors"
    path = write_hy15_transformer(plain_tensors(tiny_loaded(VARIANT)), tmp_path / f"hy15_{storage}.{suffix}", storage)
    loaded = load_pipeline(tiny_folder(VARIANT), "fp32", path)
    assert loaded.storage["transformer"] == storage
    file = read_weight_file(path, "transformer_file", detect.TRANSFORMER)
    assert file.storage == storage
    values = dequantized(fold_scaled_fp8(dict(open_weights(path).tensors)))  # the storage engine's reading, plain
    twin = load_pipeline(tiny_folder(VARIANT), "fp32")
    twin.pipe.transformer.load_state_dict(hy15.transformer_tensors(values, KeyLayout.ORIGINAL, path.name), assign=True)
    assert torch.equal(latents(loaded, "block_swap:1"), latents(twin, "block_swap:1"))


def test_weight_dtype_lowers_the_files_transformer(tiny_loaded, tiny_folder, tmp_path):
    path = write_hy15_transformer(plain_tensors(tiny_loaded(VARIANT)), tmp_path / "hy15_bf16.safetensors", "bf16")
    loaded = load_pipeline(tiny_folder(VARIANT), "fp32", path, weight_dtype="fp8_scaled")
    assert loaded.storage["transformer"] == "fp8_scaled"
    assert torch.isfinite(latents(loaded, "block_swap:1")).all()


def test_the_plan_route_reads_the_file_as_the_loader_does(tiny_loaded, tmp_path):
    """nodes/plan_files.py reads a transformer_file with read_weight_file: its storage and shapes."""
    path = write_hy15_transformer(plain_tensors(tiny_loaded(VARIANT)), tmp_path / "hy15_fp8_scaled.safetensors", "fp8_scaled")
    file = read_weight_file(path, "transformer_file", detect.TRANSFORMER)
    assert file.storage == "fp8_scaled" and file.layout is KeyLayout.ORIGINAL
    assert file.fields == detect.transformer_config_fields(dict(tiny_loaded(VARIANT).pipe.transformer.config))


# --- bad input, worded ----------------------------------------------------------------------------

def test_a_hy15_file_over_a_wan_folder_names_both_families(comfy_file, tiny_folder):
    with pytest.raises(ModelError, match=r"'hunyuanvideo1.5_480p_t2v_tiny_fp32.safetensors' is not the transformer of .*"
                                         r"the file is a HunyuanVideo 1.5 transformer, the folder a Wan model"):
        load_pipeline(tiny_folder("wan2.1-t2v"), "fp32", comfy_file)


def test_a_wan_file_over_a_hy15_folder_names_both_families(tiny_folder, tiny_loaded, tmp_path):
    from vidmem.pipelines.comfy_files.write import store_tensors, write_transformer

    wan = write_transformer(store_tensors(tiny_loaded("wan2.1-t2v").pipe.transformer, "fp32"), tmp_path / "wan2.1_t2v.safetensors")
    with pytest.raises(ModelError, match=r"'wan2.1_t2v.safetensors' is not the transformer of .*the file is a Wan "
                                         r"transformer, the folder a HunyuanVideo 1.5 model"):
        load_pipeline(tiny_folder(VARIANT), "fp32", wan)


def test_a_step_distilled_file_over_a_plain_folder_names_the_difference(tiny_loaded, tiny_folder, tmp_path):
    tensors = plain_tensors(tiny_loaded(VARIANT))
    tensors.update({name.replace("timestep_embedder.", "timestep_embedder_r."): t.clone()
                    for name, t in tensors.items() if name.startswith("time_embed.timestep_embedder.")})
    path = write_hy15_transformer(tensors, tmp_path / "hunyuanvideo1.5_480p_i2v_step_distilled.safetensors", "fp32")
    assert "time_r_in.mlp.0.weight" in file_tensors(path)
    with pytest.raises(ModelError, match=r"is not the transformer of .*use_meanflow True \(the model has False\)"):
        load_pipeline(tiny_folder(VARIANT), "fp32", path)


def test_hunyuanvideo_1_0_and_unknown_tensors_are_refused_by_name(comfy_file, tiny_folder, tmp_path):
    tensors = file_tensors(comfy_file)
    old = {n: t for n, t in tensors.items() if n != hy15.V15_MARKER}
    save_file(old, str(tmp_path / "hunyuan_video_t2v_720p_bf16.safetensors"))
    with pytest.raises(ModelError, match=r"^transformer_file: 'hunyuan_video_t2v_720p_bf16.safetensors' is a HunyuanVideo 1.0 "
                                         r"or HunyuanImage 2.1 transformer"):
        load_pipeline(tiny_folder(VARIANT), "fp32", tmp_path / "hunyuan_video_t2v_720p_bf16.safetensors")
    save_file(dict(tensors, **{"upsampler.conv.weight": torch.zeros(2, 2)}), str(tmp_path / "hunyuanvideo1.5_sr.safetensors"))
    with pytest.raises(ModelError, match=r"'hunyuanvideo1.5_sr.safetensors' is a HunyuanVideo 1.5 transformer with tensors "
                                         r".*upsampler.conv.weight"):
        load_pipeline(tiny_folder(VARIANT), "fp32", tmp_path / "hunyuanvideo1.5_sr.safetensors")


def test_the_wan_files_loader_sends_a_hy15_file_to_the_folder_loader(comfy_file):
    from vidmem.pipelines.comfy_files import match, shipped_catalogue

    file = read_weight_file(comfy_file, "model", detect.TRANSFORMER)
    with pytest.raises(ModelError, match=r"is a HunyuanVideo 1.5 transformer.*transformer_file"):
        match.choose_model(file, 1, shipped_catalogue())
    with pytest.raises(ModelError, match=r"vae: '.*' holds a HunyuanVideo 1.5 transformer, but this input takes a Wan VAE"):
        read_weight_file(comfy_file, "vae", detect.VAE)


def test_a_fused_matrix_that_does_not_split_in_three_is_named(comfy_file, tiny_folder, tmp_path):
    tensors = file_tensors(comfy_file)
    tensors["double_blocks.1.txt_attn_qkv.weight"] = tensors["double_blocks.1.txt_attn_qkv.weight"][:-1].clone()
    save_file(tensors, str(tmp_path / "hy15_damaged.safetensors"))
    with pytest.raises(ModelError, match=r"'hy15_damaged.safetensors': 'double_blocks.1.txt_attn_qkv.weight' has 47 rows"):
        load_pipeline(tiny_folder(VARIANT), "fp32", tmp_path / "hy15_damaged.safetensors")


def test_the_planner_plans_a_hy15_folder_with_a_file_in_the_files_storage(tiny_loaded, tiny_folder, tmp_path,
                                                                           monkeypatch):
    """The plan route (Load Video Pipeline's transformer_file) reads the HY15 file like the loader: the folder's
    architecture (the shipped 8.3B config here), the file's storage, copied to RAM as the folder loader holds it;
    the file checked against the folder first, as the loader checks it (the tiny folder: its file is the tiny one)."""
    import shutil
    from types import SimpleNamespace

    from vidmem.nodes import host, plan_files
    from vidmem.nodes.plan_route import parse_request, plan_answer
    from vidmem.pipelines.configs import load_model
    from vidmem.pipelines.loader import DTYPES

    models = tmp_path / "diffusion_models"
    path = write_hy15_transformer(plain_tensors(tiny_loaded(VARIANT)), models / "hunyuanvideo1.5_480p_t2v_fp8_scaled.safetensors",
                                  "fp8_scaled")
    shutil.copytree(tiny_folder(VARIANT), models / "HunyuanVideo-1.5-480p")
    fake = SimpleNamespace(models_dir=str(tmp_path), get_folder_paths=lambda key: [str(models)],
                           get_filename_list=lambda key: sorted(p.name for p in models.glob("*") if p.is_file()))
    monkeypatch.setattr(host, "folder_paths", fake)
    plan_files.recognise.cache_clear()
    plan_files.transformer_file_options.cache_clear()
    shape = {"model": "HunyuanVideo-1.5-480p", "dtype": "bf16", "width": "848", "height": "480", "frames": "121"}
    folder_model = lambda name, dtype: load_model("hunyuanvideo1.5-t2v-480p", dtype)  # noqa: E731
    budgets = (8 * 2**30, 32 * 2**30)
    with_file = plan_answer(parse_request({**shape, "transformer_file": path.name}, [shape["model"]], list(DTYPES)),
                            folder_model, budgets)
    assert with_file["status"] == "ok", with_file
    assert with_file["storage"] == {"transformer": "fp8_scaled"} and with_file["on_disk"] is False
    own = plan_answer(parse_request({**shape, "transformer_file": "(from the folder)"}, [shape["model"]], list(DTYPES)),
                      folder_model, budgets)
    assert own["storage"] == {} and own["rows"][0]["peak_ram_bytes"] > with_file["rows"][0]["peak_ram_bytes"]


def test_the_folder_needs_only_its_transformer_config(comfy_file, tiny_folder, tiny_loaded, tmp_path):
    """A folder downloaded without the transformer's weights (the file replaces them) loads with the file."""
    import shutil

    folder = shutil.copytree(tiny_folder(VARIANT), tmp_path / "folder")
    for weights in (folder / "transformer").glob("*.safetensors"):
        weights.unlink()
    loaded = load_pipeline(folder, "fp32", comfy_file)
    assert torch.equal(latents(loaded, "none"), latents(tiny_loaded(VARIANT), "none"))


@pytest.mark.parametrize("storage", ["fp8_scaled", "bf16"])
def test_a_real_size_comfy_file_reads_as_the_shipped_config(storage, tmp_path):
    """The 8.3B transformer written at real size (sparse: headers and holes) in Comfy-Org's layout:
    read as the loader reads it, its storage and the shipped config's fields (header only)."""
    from vidmem.pipelines.comfy_files.catalogue import entry_from_json
    from vidmem.pipelines.comfy_files.random_files import write_random_file
    from vidmem.pipelines.configs import MODELS_DIR
    from vidmem.pipelines.json_files import read_json_object

    entry = entry_from_json(read_json_object(MODELS_DIR / "hunyuanvideo1.5-t2v-720p.json", "model config"))
    path = write_random_file(entry.components["transformer"], tmp_path / f"hunyuanvideo1.5_720p_t2v_{storage}.safetensors",
                             storage, holes=True)
    with safe_open(str(path), "pt") as file:
        names = set(file.keys())
        assert set(COMFY_KEYS) <= names and file.get_slice("double_blocks.53.img_attn_qkv.weight").get_shape() == [3 * 2048, 2048]
    assert ("double_blocks.0.img_attn_qkv.scale_weight" in names) == (storage == "fp8_scaled")
    file = read_weight_file(path, "transformer_file", detect.TRANSFORMER)
    assert file.storage == storage and file.layout is KeyLayout.ORIGINAL
    assert file.fields == detect.transformer_config_fields(entry.config("transformer"))


@pytest.mark.parametrize("storage", ["fp32", "fp8_scaled"])
def test_the_cuda_path_streams_the_files_split_matrices_in_the_promised_order(storage, tiny_folder, tiny_loaded, tmp_path,
                                                                              monkeypatch):
    """q, k and v split from one fused matrix are views of one mapping: under the recording CUDA fake
    every tier copies, waits and evicts them in order, leaves nothing on the device, and samples bit
    for bit as the CPU backend."""
    from cuda_fake import FakeCuda
    from test_cuda_path import Audit, points_at_a_device_copy, tiers
    from test_tiers import block_count
    from vidmem.memory.device import CudaBackend

    path = write_hy15_transformer(plain_tensors(tiny_loaded(VARIANT)), tmp_path / f"hy15_{storage}.safetensors", storage)
    loaded = load_pipeline(tiny_folder(VARIANT), "fp32", path)
    reference = latents(loaded, "none")
    for label, strategy in tiers(block_count(loaded)).items():
        with monkeypatch.context() as patch:
            fake = FakeCuda().install(patch)
            result = sample(loaded, strategy, request(), backend=CudaBackend(torch.device("cpu")), observer=fake.observe)
        assert torch.equal(result.latent["samples"], reference), label
        assert not points_at_a_device_copy(loaded.pipe, fake), label
        problems = Audit(fake.log).run(strategy.prefetch_blocks).problems
        assert not problems, f"{label}: " + "; ".join(problems[:5])


def test_the_super_resolution_models_are_named(comfy_file, tmp_path):
    tensors = file_tensors(comfy_file)
    patch = tensors["img_in.proj.weight"]
    tensors["img_in.proj.weight"] = torch.zeros(patch.shape[0], hy15.SR_IN_CHANNELS, *patch.shape[2:])
    save_file(tensors, str(tmp_path / "hunyuanvideo1.5_720p_sr_distilled.safetensors"))
    with pytest.raises(ModelError, match=r"^transformer_file: 'hunyuanvideo1.5_720p_sr_distilled.safetensors' is a HunyuanVideo 1.5 "
                                         r"super-resolution transformer \(98 input channels"):
        read_weight_file(tmp_path / "hunyuanvideo1.5_720p_sr_distilled.safetensors", "transformer_file", detect.TRANSFORMER)


def test_an_all_in_one_checkpoint_is_named_with_the_fix(comfy_file, tmp_path):
    tensors = {COMFY_PREFIX + n: t for n, t in file_tensors(comfy_file).items()}
    tensors |= {"vae.decoder.conv_in.weight": torch.zeros(2, 2), "text_encoders.qwen25_7b.transformer.norm.weight": torch.zeros(2)}
    save_file(tensors, str(tmp_path / "hunyuanvideo1.5_aio.safetensors"))
    with pytest.raises(ModelError, match=r"^transformer_file: 'hunyuanvideo1.5_aio.safetensors' is an all-in-one HunyuanVideo 1.5 "
                                         r"checkpoint .*vidmem reads the transformer alone.*ModelSave"):
        read_weight_file(tmp_path / "hunyuanvideo1.5_aio.safetensors", "transformer_file", detect.TRANSFORMER)


def test_a_damaged_file_is_checked_against_its_input_before_its_names(comfy_file, tmp_path):
    """The kind is told by the markers alone: a transformer in the vae input is named as one, even
    when its names would not map; in its own input the mapping error carries the input's name."""
    tensors = file_tensors(comfy_file)
    tensors["double_blocks.1.txt_attn_qkv.weight"] = tensors["double_blocks.1.txt_attn_qkv.weight"][:-1].clone()
    save_file(tensors, str(tmp_path / "hy15_damaged.safetensors"))
    with pytest.raises(ModelError, match=r"^vae: 'hy15_damaged.safetensors' holds a HunyuanVideo 1.5 transformer, but this input "
                                         r"takes a Wan VAE"):
        read_weight_file(tmp_path / "hy15_damaged.safetensors", "vae", detect.VAE)
    with pytest.raises(ModelError, match=r"^transformer_file: 'hy15_damaged.safetensors': 'double_blocks.1.txt_attn_qkv.weight' "
                                         r"has 47 rows"):
        read_weight_file(tmp_path / "hy15_damaged.safetensors", "transformer_file", detect.TRANSFORMER)


def test_a_square_matrix_with_a_per_column_scale_splits_by_storeds_rule():
    """A per-column scale as long as the rows are many is not a per-row one: every row range keeps
    it whole (StoredTensor.row_range); a per-row scale ([rows, 1]) is cut with its rows."""
    from vidmem.memory.storage import StoredTensor, storage_format

    fmt = storage_format("fp8_scaled")
    data = torch.arange(16, dtype=torch.float32).reshape(4, 4).to(torch.float8_e4m3fn)
    for scale in (torch.tensor([1.0, 2.0, 4.0, 8.0]), torch.tensor([[1.0], [2.0], [4.0], [8.0]]), torch.tensor(0.5)):
        stored = StoredTensor(data, fmt, (4, 4), scale)
        whole = stored.dequantize(torch.float32)
        parts = hy15.split_rows(stored, 2)
        assert all(part.data.data_ptr() == data.data_ptr() + i * 8 for i, part in enumerate(parts))  # views of the file's rows
        assert torch.equal(torch.cat([part.dequantize(torch.float32) for part in parts]), whole)
        swapped = hy15.swap_halves(stored).dequantize(torch.float32)
        assert torch.equal(swapped, torch.cat([whole[2:], whole[:2]])), scale.shape


def test_a_flattened_final_modulation_is_named_as_such():
    from vidmem.memory.storage import StoredTensor, quantize, storage_format

    fmt = storage_format("gguf_q8_0")
    flattened = StoredTensor(quantize(torch.randn(1, 64), fmt).data, fmt, (2, 32))  # one row of blocks meaning two rows
    with pytest.raises(ModelError, match=r"flattened before quantizing, so its \(shift, scale\) halves cannot be swapped"):
        hy15.swap_halves(flattened)


def test_a_file_whose_name_contradicts_the_folder_loads_with_a_warning(comfy_file, tiny_folder, tmp_path, caplog):
    """t2v / i2v and 480p / 720p are config values the tensors cannot show: the folder decides, and
    a name that says otherwise is logged (a renamed file may be right), not refused."""
    import logging
    import shutil

    claimed = shutil.copy(comfy_file, tmp_path / "hunyuanvideo1.5_i2v_tiny.safetensors")
    with caplog.at_level(logging.WARNING, logger="vidmem"):
        load_pipeline(tiny_folder(VARIANT), "fp32", claimed)
    assert "transformer_file 'hunyuanvideo1.5_i2v_tiny.safetensors': its name says i2v, the folder's task_type is 't2v'" in caplog.text
    caplog.clear()
    plain = shutil.copy(comfy_file, tmp_path / "hunyuanvideo1.5_tiny.safetensors")
    with caplog.at_level(logging.WARNING, logger="vidmem"):
        load_pipeline(tiny_folder(VARIANT), "fp32", plain)
    assert "its name says" not in caplog.text
