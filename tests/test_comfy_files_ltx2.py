"""LTX-2 from the single files users download for ComfyUI (Lightricks' ltx-2-19b-dev*.safetensors:
transformer, video VAE and audio VAE in one file; Comfy-Org's transformer-only files), over a
diffusers folder that supplies the rest (Gemma 3, the text connectors, the configs).

The tiny files are written from the tiny pipeline's own weights under the checkpoint's names (the
reverse of diffusers' converters), so the file-loaded pipeline must sample and decode bit for bit as
the folder-loaded one; a wrong name table fails the round trip or the detection keys below."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from test_ltx2 import TIERS, VARIANT, request
from vidmem.memory.device import CpuBackend
from vidmem.pipelines.comfy_files import ltx2
from vidmem.pipelines.comfy_files.write import dequantized, store_tensors, write_ltx2_checkpoint
from vidmem.pipelines.decode import decode
from vidmem.pipelines.family import ModelError
from vidmem.pipelines.loader import load_pipeline
from vidmem.pipelines.sample import sample
from vidmem.pipelines.weight_storage import matrices_mapped

# What the tiny checkpoint carries besides the three parts, as the released file does: the text
# connectors inside the transformer's prefix (diffusers keeps them apart: the folder's are used)
# and the vocoder; none of it may reach the loaded transformer or VAE.
EXTRAS = {
    ltx2.TRANSFORMER_PREFIX + "video_embeddings_connector.transformer_1d_blocks.0.attn1.to_q.weight": torch.ones(4, 4),
    ltx2.TRANSFORMER_PREFIX + "audio_embeddings_connector.transformer_1d_blocks.0.attn1.to_q.weight": torch.ones(4, 4),
    "vocoder.conv_pre.weight": torch.ones(2, 2, 3),
}
# diffusers-only name fragments: a checkpoint written under original names has none of them.
DIFFUSERS_ONLY = ("proj_in.", "time_embed.", "norm_q.", "norm_k.", "av_cross_attn_", "_cross_attn_scale_shift_table",
                  ".resnets.", "mid_block", "latents_mean", "latents_std", "upsamplers", "downsamplers")


def parts_of(pipe, names=("transformer", "vae", "audio_vae")) -> dict[str, dict]:
    return {name: store_tensors(getattr(pipe, name), "fp32") for name in names}


@pytest.fixture(scope="module")
def plain_parts():
    """The tiny weights with the audio VAE (the folder-loaded pipeline never loads it)."""
    from vidmem.pipelines.tiny import build_tiny_pipeline

    return parts_of(build_tiny_pipeline(VARIANT))


@pytest.fixture(scope="module")
def checkpoint(plain_parts, tiny_folder, tmp_path_factory):
    tiny_folder(VARIANT)  # the folder is saved from the same seed: the same weights
    return write_ltx2_checkpoint(plain_parts, tmp_path_factory.mktemp("ltx2") / "ltx-2-19b-dev-tiny.safetensors", EXTRAS)


def file_names(path) -> set[str]:
    with safe_open(str(path), "pt") as file:
        return set(file.keys())


def latents(loaded, tier: str) -> torch.Tensor:
    return sample(loaded, TIERS[tier], request(), backend=CpuBackend()).latent


# --- the layout -----------------------------------------------------------------------------------

def test_the_written_names_are_the_checkpoints_and_diffusers_reads_them_back(plain_parts, checkpoint):
    from diffusers.loaders.single_file_utils import CHECKPOINT_KEY_NAMES

    names = file_names(checkpoint)
    assert set(CHECKPOINT_KEY_NAMES["ltx2"]) <= names  # diffusers' own detection keys of an LTX-2 checkpoint
    assert not [n for n in names if any(fragment in n for fragment in DIFFUSERS_ONLY)]
    assert ltx2.parts_in(names) == ("transformer", "vae", "audio_vae")
    for part, tensors in plain_parts.items():
        with safe_open(str(checkpoint), "pt") as file:
            back = ltx2.part_tensors({n: file.get_tensor(n) for n in names}, part)
        assert set(back) == set(tensors) and all(torch.equal(back[n], tensors[n]) for n in tensors), part


def test_a_wrong_name_table_is_caught_by_the_converter(monkeypatch):
    wrong = tuple((new, old) for new, old in ltx2._TRANSFORMER_TO_ORIGINAL if new != "norm_q")
    monkeypatch.setattr(ltx2, "_TRANSFORMER_TO_ORIGINAL", wrong + (("norm_q", "query_norm"),))
    with pytest.raises(ModelError, match="disagrees with diffusers' converter"):
        ltx2.original_names("transformer", ["transformer_blocks.0.attn1.norm_q.weight"])


def test_the_config_fields_match_the_files_shapes(plain_parts, tiny_loaded):
    config = dict(tiny_loaded(VARIANT).pipe.transformer.config)
    assert ltx2.transformer_fields(plain_parts["transformer"]) == ltx2.transformer_config_fields(config)


# --- loaded and sampled ---------------------------------------------------------------------------

def test_the_full_checkpoint_samples_and_decodes_bit_for_bit_as_the_folder(checkpoint, tiny_folder, tiny_loaded):
    reference = tiny_loaded(VARIANT)
    loaded = load_pipeline(tiny_folder(VARIANT), "fp32", checkpoint)
    assert loaded.source.endswith("+ ltx-2-19b-dev-tiny.safetensors")
    assert set(loaded.storage) >= {"transformer", "vae"} and loaded.storage["transformer"] == "fp32"
    assert loaded.pipe.audio_vae is None and loaded.pipe.vocoder is None  # video only: never read
    assert matrices_mapped(loaded.pipe.transformer)  # used in place from the file's mapping, not copied
    for name in ("transformer", "vae"):
        ours, theirs = getattr(loaded.pipe, name).state_dict(), getattr(reference.pipe, name).state_dict()
        assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours), name
    for tier in ("none", "block_swap:1", "block_swap:2"):
        ours, theirs = latents(loaded, tier), latents(reference, tier)
        assert torch.equal(ours["samples"], theirs["samples"]), tier
    frames = decode(loaded, ours, backend=CpuBackend()).frames
    assert torch.equal(frames, decode(reference, theirs, backend=CpuBackend()).frames)


def unprefixed(path, tmp_path):
    with safe_open(str(path), "pt") as file:
        tensors = {name.removeprefix(ltx2.TRANSFORMER_PREFIX): file.get_tensor(name) for name in file.keys()}
    save_file(tensors, str(tmp_path / "ltx-2-unprefixed.safetensors"))
    return tmp_path / "ltx-2-unprefixed.safetensors"


def diffusers_named(path, tmp_path):
    with safe_open(str(path), "pt") as file:
        tensors = ltx2.part_tensors({name: file.get_tensor(name) for name in file.keys()}, "transformer")
    save_file(tensors, str(tmp_path / "ltx-2-diffusers.safetensors"))
    return tmp_path / "ltx-2-diffusers.safetensors"


@pytest.mark.parametrize("layout", [None, unprefixed, diffusers_named], ids=["prefixed", "unprefixed", "diffusers"])
def test_a_transformer_only_file_takes_the_folders_vae(layout, plain_parts, tiny_folder, tiny_loaded, tmp_path):
    path = write_ltx2_checkpoint({"transformer": plain_parts["transformer"]}, tmp_path / "ltx-2-transformer.safetensors")
    path = layout(path, tmp_path) if layout else path
    loaded = load_pipeline(tiny_folder(VARIANT), "fp32", path)
    assert set(loaded.storage) == {"transformer"}
    assert torch.equal(latents(loaded, "none")["samples"], latents(tiny_loaded(VARIANT), "none")["samples"])


@pytest.mark.parametrize("storage", ["fp8_e4m3fn", "fp8_scaled"])
def test_an_fp8_checkpoint_runs_as_stored(storage, plain_parts, tiny_folder, tiny_loaded, tmp_path):
    """fp8 storage stays fp8 in the file's mapping and is upcast per layer (scaled: times its
    scale_weight): the same latents as the dequantized weights in fresh memory."""
    stored = store_tensors(tiny_loaded(VARIANT).pipe.transformer, storage)
    path = write_ltx2_checkpoint({"transformer": stored, "vae": plain_parts["vae"]}, tmp_path / f"ltx-2-{storage}.safetensors")
    loaded = load_pipeline(tiny_folder(VARIANT), "fp32", path)
    assert loaded.storage["transformer"] == storage
    twin = load_pipeline(tiny_folder(VARIANT), "fp32")
    twin.pipe.transformer.load_state_dict(dequantized(stored), assign=True)
    assert torch.equal(latents(loaded, "block_swap:1")["samples"], latents(twin, "block_swap:1")["samples"])


# --- bad input, worded ----------------------------------------------------------------------------

def test_a_file_without_the_vae_over_a_folder_without_one_names_both_and_the_fix(plain_parts, tiny_folder, tmp_path):
    folder = shutil.copytree(tiny_folder(VARIANT), tmp_path / "folder")
    for weights in (folder / "vae").glob("*.safetensors"):
        weights.unlink()
    path = write_ltx2_checkpoint({"transformer": plain_parts["transformer"]}, tmp_path / "ltx-2-transformer.safetensors")
    with pytest.raises(ModelError, match=r"'ltx-2-transformer.safetensors' is an LTX-2 transformer without its video VAE"
                                         r".*ltx-2-19b-dev\*.safetensors"):
        load_pipeline(folder, "fp32", path)
    full = write_ltx2_checkpoint(plain_parts, tmp_path / "ltx-2-full.safetensors")
    assert load_pipeline(folder, "fp32", full).pipe.vae is not None  # the file's own VAE needs no folder weights


def test_a_vae_without_its_latent_std_is_refused_by_name_not_loaded_with_a_std_of_one(plain_parts, tiny_folder, tmp_path):
    """`ltx2.VAE_MARKER` requires the statistics' mean only; the std is a persistent buffer the model builds as
    1.0, so a file without it would denormalise every latent wrongly with no word."""
    vae = {name: t for name, t in plain_parts["vae"].items() if name != "latents_std"}
    path = write_ltx2_checkpoint({**plain_parts, "vae": vae}, tmp_path / "ltx-2-nostd.safetensors")
    with pytest.raises(ModelError, match=r"'ltx-2-nostd.safetensors' do not match the model: .*missing \(latents_std\)"):
        load_pipeline(tiny_folder(VARIANT), "fp32", path)


NEWER = {  # what an LTX-2.3 checkpoint has that LTX-2.0's converter does not map: gated attention, 9-way modulation
    "gated attention": {"transformer_blocks.0.attn1.to_gate_logits.weight": torch.zeros(2, 16)},
    "prompt modulation": {"adaln_single.linear.weight": torch.zeros(9 * 16, 16)},
}


@pytest.mark.parametrize("added", NEWER.values(), ids=NEWER.keys())
def test_an_ltx_2_3_checkpoint_is_refused_by_name(added, checkpoint, tiny_folder, tmp_path):
    with safe_open(str(checkpoint), "pt") as file:
        tensors = {name: file.get_tensor(name) for name in file.keys()}
    tensors.update({ltx2.TRANSFORMER_PREFIX + name: tensor for name, tensor in added.items()})
    newer = tmp_path / "ltx-2.3-22b-dev.safetensors"
    save_file(tensors, str(newer))
    with pytest.raises(ModelError, match=r"'ltx-2.3-22b-dev.safetensors' is an LTX-2.3 .*diffusers folder"):
        load_pipeline(tiny_folder(VARIANT), "fp32", newer)


def test_a_vae_only_file_is_no_transformer(plain_parts, tiny_folder, tmp_path):
    path = write_ltx2_checkpoint({"vae": plain_parts["vae"]}, tmp_path / "ltx-2-vae.safetensors")
    with pytest.raises(ModelError, match=r"'ltx-2-vae.safetensors' holds only LTX-2's vae .*transformer-only"):
        load_pipeline(tiny_folder(VARIANT), "fp32", path)


def test_an_ltx2_file_over_a_wan_folder_names_the_mismatch(checkpoint, tiny_folder):
    with pytest.raises(ModelError, match="is not the transformer of"):
        load_pipeline(tiny_folder("wan2.1-t2v"), "fp32", checkpoint)


def test_the_plan_route_reads_the_file_as_the_loader_does(tmp_path, tiny_loaded):
    """nodes/plan_files.py reads a transformer_file with read_weight_file: its storage and shapes."""
    from vidmem.pipelines.comfy_files import detect
    from vidmem.pipelines.comfy_files.files import read_weight_file

    stored = store_tensors(tiny_loaded(VARIANT).pipe.transformer, "fp8_scaled")
    path = write_ltx2_checkpoint({"transformer": stored}, tmp_path / "ltx-2-19b-dev-fp8.safetensors")
    file = read_weight_file(path, "transformer_file", detect.TRANSFORMER)
    assert file.storage == "fp8_scaled" and file.layout.value == "prefixed"
    assert file.fields == detect.transformer_config_fields(dict(tiny_loaded(VARIANT).pipe.transformer.config))


def test_the_wan_files_loader_sends_an_ltx2_checkpoint_to_the_folder_loader(checkpoint):
    from vidmem.pipelines.comfy_files import detect, match, shipped_catalogue
    from vidmem.pipelines.comfy_files.files import read_weight_file

    file = read_weight_file(checkpoint, "model", detect.TRANSFORMER)
    with pytest.raises(ModelError, match=r"'ltx-2-19b-dev-tiny.safetensors' is an LTX-2 checkpoint.*transformer_file"):
        match.choose_model(file, 1, shipped_catalogue())


def test_the_released_19b_configs_fit_the_converters_tables(tmp_path):
    """The shipped LTX-2 19B transformer and VAE configs written at real size (sparse: headers and
    holes, no weights) in the checkpoint layout: the VAE's stage order fits diffusers' table (the
    names round-trip), and the transformer file's shapes give the config's fields."""
    from vidmem.pipelines.comfy_files import detect
    from vidmem.pipelines.comfy_files.catalogue import entry_from_json
    from vidmem.pipelines.comfy_files.files import ltx2_part, read_weight_file
    from vidmem.pipelines.comfy_files.random_files import write_random_file
    from vidmem.pipelines.configs import MODELS_DIR
    from vidmem.pipelines.json_files import read_json_object

    entry = entry_from_json(read_json_object(MODELS_DIR / "ltx2-t2v-19b.json", "model config"))
    transformer = write_random_file(entry.components["transformer"], tmp_path / "ltx-2-19b-dev.safetensors", "fp8_e4m3fn",
                                    holes=True)
    file = read_weight_file(transformer, "transformer_file", detect.TRANSFORMER)
    assert file.storage == "fp8_e4m3fn" and file.fields == detect.transformer_config_fields(entry.config("transformer"))
    assert file.fields["num_layers"] == 48 and file.fields["inner_dim"] == 4096
    vae = write_random_file(entry.components["vae"], tmp_path / "ltx-2-vae.safetensors", "bf16", holes=True)
    assert ltx2.parts_in(file_names(vae)) == ("vae",)
    assert len(ltx2_part(vae, "vae", "vae")) == len(file_names(vae))


def test_weight_dtype_lowers_the_files_transformer_and_the_vae_is_held_at_its_dtype(tiny_loaded, tiny_folder, tmp_path):
    pipe = tiny_loaded(VARIANT).pipe
    parts = {name: store_tensors(getattr(pipe, name), "bf16") for name in ("transformer", "vae")}
    path = write_ltx2_checkpoint(parts, tmp_path / "ltx-2-19b-dev-bf16.safetensors")
    loaded = load_pipeline(tiny_folder(VARIANT), "fp32", path, weight_dtype="fp8_scaled")
    assert loaded.storage["transformer"] == "fp8_scaled" and loaded.storage["vae"] == "fp32"  # cast at load
    assert torch.isfinite(latents(loaded, "block_swap:1")["samples"]).all()


@pytest.mark.parametrize("folder_vae", [True, False], ids=["folder with VAE weights", "folder with vae/config.json only"])
def test_vae_dtype_holds_the_checkpoints_own_vae(folder_vae, plain_parts, tiny_folder, tmp_path):
    """vae_dtype applies to the VAE the checkpoint brings: never the folder's VAE read in its place (a folder
    with VAE weights), never a failed re-read of the folder (one with vae/config.json only)."""
    folder = shutil.copytree(tiny_folder(VARIANT), tmp_path / "folder")
    if not folder_vae:
        for weights in (folder / "vae").glob("*.safetensors"):
            weights.unlink()
    parts = dict(plain_parts, vae={name: t + 1 for name, t in plain_parts["vae"].items()})  # not the folder's values
    path = write_ltx2_checkpoint(parts, tmp_path / "ltx-2-19b-dev-other-vae.safetensors")
    loaded = load_pipeline(folder, "fp32", path, vae_dtype="bf16")
    assert loaded.vae_dtype_name == "bf16" and {t.dtype for t in loaded.pipe.vae.parameters()} == {torch.bfloat16}
    wide = load_pipeline(folder, "fp32", path).pipe.vae.state_dict()  # the checkpoint's VAE, as stored
    held = loaded.pipe.vae.state_dict()
    assert held.keys() == wide.keys() and all(torch.equal(held[k], wide[k].to(torch.bfloat16)) for k in wide)
    assert {t.dtype for t in loaded.pipe.transformer.parameters()} == {torch.float32}
