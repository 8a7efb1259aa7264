"""Load Video Pipeline's vae_file: a folder's VAE replaced by a single VAE file, read by its tensors.

HunyuanVideo 1.5's VAE is written as Comfy-Org ships it (hunyuanvideo15_vae_fp16.safetensors: Tencent's
names, comfy_files/hy15_vae.py's table reversed) from the tiny folder's own VAE, so the file-loaded
pipeline must decode bit for bit as the folder-loaded one: a wrong rule fails the round trip. The names
themselves are checked against the ones diffusers' conversion script reads (its loops, restated here)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from test_hunyuan_video15 import TIERS, VARIANT, request
from vidmem.memory.device import CpuBackend
from vidmem.pipelines.comfy_files import hy15_vae
from vidmem.pipelines.comfy_files.files import read_weight_file
from vidmem.pipelines.comfy_files.write import write_hy15_transformer, write_hy15_vae, write_vae
from vidmem.pipelines.decode import decode
from vidmem.pipelines.family import ModelError
from vidmem.pipelines.loader import load_pipeline
from vidmem.pipelines.sample import sample

WAN = "wan2.1-t2v"


def vae_state(loaded) -> dict[str, torch.Tensor]:
    return {name: t.detach() for name, t in loaded.pipe.vae.state_dict().items()}


@pytest.fixture(scope="module")
def hy15_file(tiny_loaded, tmp_path_factory):
    path = tmp_path_factory.mktemp("vae") / "hunyuanvideo15_vae_tiny_fp32.safetensors"
    return write_hy15_vae(vae_state(tiny_loaded(VARIANT)), path, torch.float32)


@pytest.fixture(scope="module")
def hy15_latent(tiny_loaded):
    return sample(tiny_loaded(VARIANT), TIERS["none"], request(), backend=CpuBackend()).latent


def converter_pairs(block_out_channels=(128, 256, 512, 1024, 1024), layers_per_block=2) -> dict[str, str]:
    """Tencent name -> diffusers name, as diffusers' scripts/convert_hunyuan_video1_5_to_diffusers.py
    (convert_hunyuan_video_15_vae_checkpoint_to_diffusers) pairs them, its loops restated; 4 stages resample."""
    pairs = {}

    def conv(original: str, diffusers: str) -> None:
        pairs.update({f"{original}.conv.{w}": f"{diffusers}.conv.{w}" for w in ("weight", "bias")})

    def resnet(original: str, diffusers: str) -> None:
        pairs.update({f"{original}.{n}.gamma": f"{diffusers}.{n}.gamma" for n in ("norm1", "norm2")})
        conv(f"{original}.conv1", f"{diffusers}.conv1")
        conv(f"{original}.conv2", f"{diffusers}.conv2")

    for side in ("encoder", "decoder"):
        for stem in ("conv_in", "conv_out"):
            conv(f"{side}.{stem}", f"{side}.{stem}")
        pairs[f"{side}.norm_out.gamma"] = f"{side}.norm_out.gamma"
        resnet(f"{side}.mid.block_1", f"{side}.mid_block.resnets.0")
        resnet(f"{side}.mid.block_2", f"{side}.mid_block.resnets.1")
        pairs[f"{side}.mid.attn_1.norm.gamma"] = f"{side}.mid_block.attentions.0.norm.gamma"
        for original, diffusers in (("q", "to_q"), ("k", "to_k"), ("v", "to_v"), ("proj_out", "proj_out")):
            pairs.update({f"{side}.mid.attn_1.{original}.{w}": f"{side}.mid_block.attentions.0.{diffusers}.{w}"
                          for w in ("weight", "bias")})
    for i in range(len(block_out_channels)):
        for j in range(layers_per_block):
            resnet(f"encoder.down.{i}.block.{j}", f"encoder.down_blocks.{i}.resnets.{j}")
        for j in range(layers_per_block + 1):
            resnet(f"decoder.up.{i}.block.{j}", f"decoder.up_blocks.{i}.resnets.{j}")
        if i < 4:
            conv(f"encoder.down.{i}.downsample.conv", f"encoder.down_blocks.{i}.downsamplers.0.conv")
            conv(f"decoder.up.{i}.upsample.conv", f"decoder.up_blocks.{i}.upsamplers.0.conv")
    return pairs


def test_the_rules_pair_names_as_the_conversion_script_for_the_real_vae():
    import diffusers

    with torch.device("meta"):
        vae = diffusers.AutoencoderKLHunyuanVideo15()  # the released 8.3B model's VAE config is the default
    pairs = converter_pairs()
    assert set(pairs.values()) == set(vae.state_dict())
    assert {original: hy15_vae.diffusers_name(original) for original in pairs} == pairs
    assert {hy15_vae.original_name(name): name for name in pairs.values()} == pairs


def test_the_file_decodes_bit_for_bit_as_the_folder(hy15_file, hy15_latent, tiny_folder, tiny_loaded):
    reference = tiny_loaded(VARIANT)
    loaded = load_pipeline(tiny_folder(VARIANT), "fp32", vae_file=hy15_file)
    assert loaded.source.endswith("+ " + hy15_file.name) and loaded.vae_file == str(hy15_file)
    assert loaded.storage["vae"] == "fp32" and loaded.pipe.vae is not reference.pipe.vae
    ours, theirs = vae_state(loaded), vae_state(reference)
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    frames = decode(loaded, hy15_latent, backend=CpuBackend()).frames
    assert torch.equal(frames, decode(reference, hy15_latent, backend=CpuBackend()).frames)


def test_an_fp16_file_over_an_fp32_folder_runs_and_is_planned_at_the_loaders_dtype(tiny_loaded, tiny_folder, tmp_path):
    """The file's own dtype never reaches the VAE: it is cast to dtype (or vae_dtype) at load, as diffusers casts a
    folder's, so the planner (which budgets the VAE at dtype / vae_dtype) plans it as the folder's."""
    from vidmem.memory.plan.types import VideoShape
    from vidmem.pipelines.planning import plan_options, plan_strategy, planner_model

    reference = tiny_loaded(VARIANT)
    path = write_hy15_vae(vae_state(reference), tmp_path / "hunyuanvideo15_vae_fp16.safetensors")
    assert read_weight_file(path, "vae_file", "vae").storage == "fp16"
    loaded = load_pipeline(tiny_folder(VARIANT), "fp32", vae_file=path)
    assert {t.dtype for t in loaded.pipe.vae.parameters()} == {torch.float32} and loaded.storage["vae"] == "fp32"
    assert dict(plan_options(loaded).storage) == {"vae": "fp32"}
    assert planner_model(loaded).dtype_of("vae") == planner_model(reference).dtype_of("vae") == torch.float32
    shape = VideoShape(64, 64, 9)
    ours, theirs = (plan_strategy(p, shape, TIERS["none"], None, None, device="cpu") for p in (loaded, reference))
    assert [s.name for s in ours.stages] == [s.name for s in theirs.stages]
    for stage in (s.name for s in theirs.stages):  # the same bytes and time (the recorded format changes no weight's width)
        mine, folder_s = ours.stage(stage), theirs.stage(stage)
        assert (mine.phases, mine.host_bytes, mine.page_cache_bytes) == (folder_s.phases, folder_s.host_bytes,
                                                                         folder_s.page_cache_bytes)
        assert mine.seconds() == folder_s.seconds()
    wide = load_pipeline(tiny_folder(VARIANT), "bf16", vae_file=path, vae_dtype="fp32")
    assert wide.vae_dtype_name == "fp32" and {t.dtype for t in wide.pipe.vae.parameters()} == {torch.float32}
    assert planner_model(wide).dtype_of("vae") == torch.float32 and planner_model(wide).dtype_of("transformer") == torch.bfloat16
    assert torch.equal(wide.pipe.vae.decoder.conv_in.conv.weight, loaded.pipe.vae.decoder.conv_in.conv.weight)


def test_the_folder_needs_only_its_vae_config(hy15_file, hy15_latent, tiny_folder, tiny_loaded, tmp_path):
    folder = shutil.copytree(tiny_folder(VARIANT), tmp_path / "hy15")
    for weights in (folder / "vae").glob("*.safetensors"):
        weights.unlink()
    loaded = load_pipeline(folder, "fp32", vae_file=hy15_file)
    frames = decode(loaded, hy15_latent, backend=CpuBackend()).frames
    assert torch.equal(frames, decode(tiny_loaded(VARIANT), hy15_latent, backend=CpuBackend()).frames)


def test_a_wan_vae_file_over_a_wan_folder_decodes_as_the_folder(tiny_folder, tiny_loaded, tmp_path):
    reference = tiny_loaded(WAN)
    path = write_vae(vae_state(reference), tmp_path / "wan_2.1_vae.safetensors")
    loaded = load_pipeline(tiny_folder(WAN), "fp32", vae_file=path)
    ours, theirs = vae_state(loaded), vae_state(reference)
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    z = torch.randn(1, reference.pipe.vae.config.z_dim, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded.pipe.vae.decode(z).sample, reference.pipe.vae.decode(z).sample)


def test_a_file_of_the_other_family_is_refused_naming_both(hy15_file, tiny_folder, tiny_loaded, tmp_path):
    with pytest.raises(ModelError, match=r"vae_file 'hunyuanvideo15_vae_tiny_fp32.safetensors' is HunyuanVideo 1.5's VAE, "
                                         r"but 'wan2.1-t2v' uses a Wan VAE .*leave vae_file at \(from the folder\)"):
        load_pipeline(tiny_folder(WAN), "fp32", vae_file=hy15_file)
    wan = write_vae(vae_state(tiny_loaded(WAN)), tmp_path / "wan_2.1_vae.safetensors")
    with pytest.raises(ModelError, match="vae_file 'wan_2.1_vae.safetensors' is a Wan VAE, but 'hunyuanvideo1.5-t2v' uses "
                                         "HunyuanVideo 1.5's VAE"):
        load_pipeline(tiny_folder(VARIANT), "fp32", vae_file=wan)


def rewritten(path, target, rename=lambda name: name, added=None):
    """The VAE file at `path` written again at `target` with its names renamed and `added` tensors."""
    from safetensors.torch import load_file, save_file

    tensors = {rename(name): t for name, t in load_file(str(path)).items()}
    save_file(dict(tensors, **(added or {})), str(target))
    return target


def comfy_projections(channels: int) -> dict[str, torch.Tensor]:
    """ComfyUI's vae_refiner mid-block time projections (ResnetBlock's default temb_channels=512 ->
    channels), as its Save VAE writes them (comfy/ldm/hunyuan_video/vae_refiner.py, mid.block_1/2)."""
    return {f"{side}.mid.block_{n}.temb_proj.{w}": torch.randn(channels, 512) if w == "weight" else torch.randn(channels)
            for side in ("encoder", "decoder") for n in (1, 2) for w in ("weight", "bias")}


def test_a_vae_saved_by_comfyuis_save_vae_loads_without_its_unused_projections(hy15_file, tiny_folder, tiny_loaded,
                                                                               tmp_path):
    reference = tiny_loaded(VARIANT)
    channels = reference.pipe.vae.config.block_out_channels[-1]
    added = comfy_projections(channels)
    assert len(added) == 8
    saved = rewritten(hy15_file, tmp_path / "ComfyUI_vae.safetensors", added=added)
    loaded = load_pipeline(tiny_folder(VARIANT), "fp32", vae_file=saved)
    ours, theirs = vae_state(loaded), vae_state(reference)
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    stray = {"encoder.down.0.block.0.temb_proj.weight": torch.randn(8, 512)}  # not ComfyUI's: still refused
    other = rewritten(hy15_file, tmp_path / "stray_vae.safetensors", added=dict(added, **stray))
    with pytest.raises(ModelError, match="not part of the model"):
        load_pipeline(tiny_folder(VARIANT), "fp32", vae_file=other)


@pytest.mark.parametrize("prefix", ["vae.", "first_stage_model."])
def test_a_prefixed_vae_loads_as_the_folder(prefix, hy15_file, tiny_folder, tiny_loaded, tmp_path):
    """A VAE cut from a checkpoint keeps the checkpoint's prefix: found before the marker, as a Wan VAE's is."""
    path = rewritten(hy15_file, tmp_path / "prefixed_vae.safetensors", rename=lambda name: prefix + name,
                     added={prefix + n: t for n, t in comfy_projections(8).items()})
    loaded = load_pipeline(tiny_folder(VARIANT), "fp32", vae_file=path)
    ours, theirs = vae_state(loaded), vae_state(tiny_loaded(VARIANT))
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_a_vae_of_another_size_is_refused_naming_the_fields(tiny_folder, tiny_loaded, tmp_path):
    folder = shutil.copytree(tiny_folder(VARIANT), tmp_path / "wide")
    config = json.loads((folder / "vae" / "config.json").read_text())
    config["layers_per_block"] = 2
    (folder / "vae" / "config.json").write_text(json.dumps(config))
    path = write_hy15_vae(vae_state(tiny_loaded(VARIANT)), tmp_path / "hunyuanvideo15_vae_fp16.safetensors")
    with pytest.raises(ModelError, match=r"vae_file 'hunyuanvideo15_vae_fp16.safetensors' is not the VAE of 'wide' "
                                         r"\(layers_per_block 1 \(the model has 2\)\)"):
        load_pipeline(folder, "fp32", vae_file=path)


def test_cogvideox_and_ltx2_folders_refuse_a_vae_file_before_reading_it(tiny_folder, tmp_path):
    missing = tmp_path / "never_read.safetensors"
    with pytest.raises(ModelError, match=r"vae_file is not supported for CogVideoX .*leave vae_file at \(from the folder\)"):
        load_pipeline(tiny_folder("cogvideox-t2v"), "fp32", vae_file=missing)
    with pytest.raises(ModelError, match="vae_file is not supported for LTX-2 .*pick it as transformer_file"):
        load_pipeline(tiny_folder("ltx2-t2v"), "fp32", vae_file=missing)


def test_a_transformer_file_as_vae_file_is_refused_naming_the_input(tiny_folder, tiny_loaded, tmp_path):
    state = {n: t.detach() for n, t in tiny_loaded(VARIANT).pipe.transformer.state_dict().items()}
    path = write_hy15_transformer(state, tmp_path / "hunyuanvideo1.5_480p_t2v_fp16.safetensors", "fp32")
    with pytest.raises(ModelError, match=r"vae_file: 'hunyuanvideo1.5_480p_t2v_fp16.safetensors' holds a HunyuanVideo 1.5 "
                                         r"transformer, but this input takes HunyuanVideo 1.5's VAE \(hunyuanvideo15_vae_fp16"):
        load_pipeline(tiny_folder(VARIANT), "fp32", vae_file=path)
    with pytest.raises(ModelError, match=r"holds a HunyuanVideo 1.5 transformer, but this input takes a Wan VAE \(wan_2.1_vae"):
        load_pipeline(tiny_folder(WAN), "fp32", vae_file=path)  # the VAE each folder takes, named


@pytest.fixture(scope="module")
def ltx2_parts():
    from vidmem.pipelines.comfy_files.write import store_tensors
    from vidmem.pipelines.tiny import build_tiny_pipeline

    pipe = build_tiny_pipeline("ltx2-t2v")
    return {name: store_tensors(getattr(pipe, name), "fp32") for name in ("vae", "audio_vae")}


@pytest.mark.parametrize("folder", [WAN, VARIANT])
def test_ltx2s_video_vae_is_named_with_where_it_comes_from(folder, ltx2_parts, tiny_folder, tmp_path):
    from vidmem.pipelines.comfy_files.write import write_ltx2_checkpoint

    for parts in ({"vae": ltx2_parts["vae"]}, ltx2_parts):
        path = write_ltx2_checkpoint(parts, tmp_path / "ltx-2-19b-vae.safetensors")
        with pytest.raises(ModelError, match=r"^vae_file: 'ltx-2-19b-vae.safetensors' is LTX-2's video VAE .*vae_file takes "
                                             r"Wan and HunyuanVideo 1.5 VAEs, and LTX-2's VAE comes with its checkpoint.*"
                                             r"transformer_file"):
            load_pipeline(tiny_folder(folder), "fp32", vae_file=path)


def test_ltx2s_audio_vae_and_cogvideoxs_vae_are_named(ltx2_parts, tiny_folder, tiny_loaded, tmp_path):
    from safetensors.torch import save_file

    from vidmem.pipelines.comfy_files.write import write_ltx2_checkpoint

    audio = write_ltx2_checkpoint({"audio_vae": ltx2_parts["audio_vae"]}, tmp_path / "ltx-2-audio-vae.safetensors")
    with pytest.raises(ModelError, match=r"^vae_file: 'ltx-2-audio-vae.safetensors' is LTX-2's audio VAE, which only "
                                         r"Decode Audio reads"):
        load_pipeline(tiny_folder(WAN), "fp32", vae_file=audio)
    cogvideox = tmp_path / "cogvideox_vae.safetensors"
    save_file(vae_state(tiny_loaded("cogvideox-t2v")), str(cogvideox))
    for folder in (WAN, VARIANT):
        with pytest.raises(ModelError, match=r"^vae_file: 'cogvideox_vae.safetensors' is CogVideoX's VAE, which vidmem reads "
                                             r"from its diffusers folder only"):
            load_pipeline(tiny_folder(folder), "fp32", vae_file=cogvideox)
    with pytest.raises(ModelError, match=r"^vae: 'cogvideox_vae.safetensors' is CogVideoX's VAE"):  # Load Video Model Files
        read_weight_file(cogvideox, "vae", "vae")


def test_no_wan_or_hy15_vae_has_cogvideoxs_marker(hy15_file, tiny_loaded):
    """The CogVideoX VAE is told by its decoder's spatial norms: no Wan or HunyuanVideo 1.5 VAE, in any
    layout or size, has them (and CogVideoX's own does, so the check can fail)."""
    import diffusers
    from safetensors import safe_open

    from vidmem.pipelines.comfy_files import detect
    from vidmem.pipelines.comfy_files.keys import vae_original_names

    with torch.device("meta"):
        real = {cls.__name__: list(cls().state_dict()) for cls in (diffusers.AutoencoderKLWan, diffusers.AutoencoderKLHunyuanVideo15,
                                                                   diffusers.AutoencoderKLCogVideoX)}
        wan22 = list(diffusers.AutoencoderKLWan(base_dim=160, z_dim=48, is_residual=True).state_dict())
    with safe_open(str(hy15_file), "pt") as file:
        comfy_hy15 = list(file.keys())
    names = {"wan 2.1": real["AutoencoderKLWan"], "wan 2.2": wan22, "hy15": real["AutoencoderKLHunyuanVideo15"],
             "wan 2.1 original": list(vae_original_names(real["AutoencoderKLWan"]).values()),
             "wan 2.2 original": list(vae_original_names(wan22).values()), "hy15 comfy": comfy_hy15,
             "hy15 original": [hy15_vae.original_name(n) for n in real["AutoencoderKLHunyuanVideo15"]]}
    for label, file_names in names.items():
        assert detect.find_prefix(file_names, detect.COGVIDEOX_VAE_MARKER) is None, label
    assert detect.find_prefix(real["AutoencoderKLCogVideoX"], detect.COGVIDEOX_VAE_MARKER) == ""


def test_an_incomplete_hy15_vae_is_named_as_hy15s(hy15_file, tmp_path):
    path = tmp_path / "hunyuanvideo15_vae_cut.safetensors"
    from safetensors.torch import load_file, save_file

    save_file({n: t for n, t in load_file(str(hy15_file)).items() if n != "encoder.conv_in.conv.weight"}, str(path))
    with pytest.raises(ModelError, match=r"^a HunyuanVideo 1.5 VAE file lacks the tensor 'encoder.conv_in.conv.weight'"):
        read_weight_file(path, "vae_file", "vae")


def test_the_file_is_read_as_a_hy15_vae_in_either_layout_and_refused_by_the_wan_files_loader(hy15_file, tmp_path):
    from safetensors.torch import load_file, save_file

    from vidmem.pipelines.comfy_files import match
    from vidmem.pipelines.comfy_files.catalogue import shipped_catalogue

    original = read_weight_file(hy15_file, "vae_file", "vae")
    diffusers_names = tmp_path / "diffusers_vae.safetensors"
    save_file(hy15_vae.vae_tensors(load_file(str(hy15_file)), hy15_vae.vae_layout(load_file(str(hy15_file)))), str(diffusers_names))
    same = read_weight_file(diffusers_names, "vae_file", "vae")
    assert set(original.tensors) == set(same.tensors) and original.fields == same.fields
    assert original.fields["layers_per_block"] == 1 and original.fields["block_out_channels"] == [8] * 5
    entry = next(e for e in shipped_catalogue() if e.name.startswith("wan2.1-t2v"))
    with pytest.raises(ModelError, match="vae: 'hunyuanvideo15_vae_tiny_fp32.safetensors' is HunyuanVideo 1.5's VAE, but "):
        match.check_vae(entry, original)


def test_hunyuanvideo_1_0_style_names_are_not_taken_for_1_5():
    """1.0's VAE norms are GroupNorms (`norm1.weight`): no gamma marker, so not read as 1.5's."""
    assert hy15_vae.vae_layout(["decoder.conv_in.conv.weight", "decoder.mid.block_1.norm1.weight"]) is None
    assert hy15_vae.vae_layout(["decoder.conv_in.weight", "decoder.mid_block.resnets.0.norm1.gamma"]) is None  # Wan's


def test_the_node_lists_models_vae_and_loads_the_file_at_vae_dtype(hy15_file, hy15_latent, tiny_folder, tiny_loaded,
                                                                  tmp_path, monkeypatch):
    from types import SimpleNamespace

    from vidmem.nodes import host
    from vidmem.nodes.loader import FOLDER_VAE, VidMemLoadPipeline

    vaes = tmp_path / "vae"
    vaes.mkdir()
    shutil.copy(hy15_file, vaes / hy15_file.name)
    (vaes / "old.ckpt").write_bytes(b"x")
    fake = SimpleNamespace(get_filename_list=lambda key: sorted(p.name for p in vaes.iterdir()) if key == "vae" else [],
                           get_folder_paths=lambda key: [str(vaes)] if key == "vae" else [])
    monkeypatch.setattr(host, "folder_paths", fake)
    monkeypatch.setenv("VIDMEM_ALLOW_ANY_PATH", "1")  # the folder is given by path, outside this fake's model folders
    choices, options = VidMemLoadPipeline.INPUT_TYPES()["optional"]["vae_file"]
    assert choices == [FOLDER_VAE, hy15_file.name] and "hunyuanvideo15_vae_fp16" in options["tooltip"]  # never a pickle
    # appended after vae_dtype (then the text encoder files): saved widget values are positional
    assert list(VidMemLoadPipeline.INPUT_TYPES()["optional"])[-3:] == ["vae_file", "text_encoder_file", "text_encoder_2_file"]
    folder = str(tiny_folder(VARIANT))
    (loaded,) = VidMemLoadPipeline().load("x", "fp32", folder, vae_file=hy15_file.name)
    assert loaded.vae_file == str(vaes / hy15_file.name)
    assert torch.equal(decode(loaded, hy15_latent, backend=CpuBackend()).frames,
                       decode(tiny_loaded(VARIANT), hy15_latent, backend=CpuBackend()).frames)
    (wide,) = VidMemLoadPipeline().load("x", "bf16", folder, vae_dtype="fp32", vae_file=hy15_file.name)
    assert wide.vae_dtype_name == "fp32" and wide.pipe.vae.dtype == torch.float32 and wide.vae_file
    with pytest.raises(ModelError, match="vae_file 'gone.safetensors' was not found in models/vae"):
        VidMemLoadPipeline().load("x", "fp32", folder, vae_file="gone.safetensors")
