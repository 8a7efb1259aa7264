"""Load Video Pipeline's one RAM check counts what the load makes in RAM, before anything is built.

A transformer_file that weight_dtype lowers is counted at the lowered bytes, by the loader's own rule
(`lowered_names`); a file used in place from its mapping counts nothing; a component a file replaces is never
counted at its folder config's full size (that would refuse a machine with room); a VAE counts at vae_dtype,
from the folder or from a file (then only what is cast into RAM). The machine's RAM is faked through psutil,
as the loader reads it there.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import test_gguf_text_encoders
from test_text_encoder_file import encoder, hy15_transformer_file, write_file
from vidmem.memory.storage import FORMATS
from vidmem.pipelines.comfy_files import detect
from vidmem.pipelines.comfy_files.files import read_weight_file
from vidmem.pipelines.comfy_files.keys import KeyLayout
from vidmem.pipelines.comfy_files.write import (store_tensors, write_llama_cpp_text_encoder, write_ltx2_checkpoint,
                                                write_transformer, write_vae)
from vidmem.pipelines.configs.meta import ComponentConfig
from vidmem.pipelines.family import ModelError
from vidmem.pipelines.loader import load_pipeline
from vidmem.pipelines.weight_check import implied_weights, ram_need
from vidmem.pipelines.weight_storage import lowered_names

WAN, LTX2, HY15 = "wan2.1-t2v", "ltx2-t2v", "hunyuanvideo1.5-t2v"
gguf_folder = test_gguf_text_encoders.gguf_folder  # a fixture: the tiny LTX-2 folder, its Gemma's norms exact


@pytest.fixture(scope="module")
def written(tiny_loaded, tmp_path_factory):
    """(part, storage) -> a file of the tiny Wan's part ("transformer", "text_encoder", "vae"), written once."""
    root, cache = tmp_path_factory.mktemp("wan-files"), {}

    def get(part: str, storage: str):
        if (part, storage) not in cache:
            loaded, path = tiny_loaded(WAN), root / f"wan-{part}-{storage}.safetensors"
            if part == "transformer":
                cache[part, storage] = write_transformer(store_tensors(loaded.pipe.transformer, storage), path,
                                                         KeyLayout.ORIGINAL)
            elif part == "vae":
                cache[part, storage] = write_vae(store_tensors(loaded.pipe.vae, storage), path)
            else:
                cache[part, storage] = write_file(loaded, part, storage, path)
        return cache[part, storage]

    return get


@pytest.fixture
def built(monkeypatch):
    """Every model build_empty makes during the test (a refusal must come before any)."""
    from vidmem.pipelines.comfy_files import build

    made, original = [], build.build_empty
    monkeypatch.setattr(build, "build_empty", lambda component: made.append(component.name) or original(component))
    return made


def ram_needs(monkeypatch, folder, dtype: str = "fp32", **inputs) -> dict[str, int]:
    """label -> bytes of the one RAM check `load_pipeline(folder, dtype, **inputs)` makes ({} when it makes none:
    nothing beyond the folder's own components takes RAM). The load runs."""
    from vidmem.pipelines import folder_storage

    seen, check = {}, folder_storage.check_against_ram
    monkeypatch.setattr(folder_storage, "check_against_ram",
                        lambda needs, *args: seen.update(needs) or check(needs, *args))
    load_pipeline(folder, dtype, **inputs)
    monkeypatch.setattr(folder_storage, "check_against_ram", check)
    return seen


def machine_with_ram(monkeypatch, ram: int) -> None:
    import psutil

    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(total=ram, available=ram))
    monkeypatch.setattr(psutil, "swap_memory", lambda: SimpleNamespace(total=0))


def folder_config_bytes(loaded, name: str, dtype: torch.dtype) -> int:
    """Bytes the folder's diffusers component `name` takes read into RAM at `dtype`, from its config."""
    module = getattr(loaded.pipe, name)
    config = ComponentConfig(name, "diffusers", type(module).__name__, dict(module.config))
    return ram_need(implied_weights(config, dtype))[1]


def from_folder_config(needs: dict[str, int], name: str) -> list[str]:
    """The labels of `needs` that count the folder's `name` from its config (ram_need's "name (source): ...")."""
    return [label for label in needs if label.startswith(f"{name} (")]


def test_a_lowered_transformer_file_counts_its_lowered_matrices_not_the_folders_config(
        tiny_loaded, tiny_folder, written, monkeypatch):
    path = written("transformer", "fp32")
    needs = ram_needs(monkeypatch, tiny_folder(WAN), transformer_file=path, weight_dtype="fp8_scaled")
    tensors = read_weight_file(path, "transformer_file", detect.TRANSFORMER).tensors
    matrices = lowered_names(tiny_loaded(WAN).pipe.transformer, tensors, "fp8_scaled", torch.float32)  # the loader's rule
    assert matrices and len(matrices) < len(tensors)  # the matrices only: norms, biases, patch embedding stay mapped
    lowered = FORMATS["fp8_scaled"].stored_bytes(sum(tensors[name].shape.numel() for name in matrices))
    assert needs[f"transformer_file '{path.name}' lowered to fp8_scaled"] == lowered
    assert from_folder_config(needs, "transformer") == []  # the file replaces it: never counted at dtype in full
    loaded = load_pipeline(tiny_folder(WAN), "fp32", path, weight_dtype="fp8_scaled")
    assert loaded.storage["transformer"] == "fp8_scaled"  # what was counted is what the loader lowered


def family_file(variant: str, tiny_loaded, path):
    """The tiny `variant`'s transformer as its single file (an LTX-2 checkpoint with its VAE), stored fp32."""
    pipe = tiny_loaded(variant).pipe
    if variant == HY15:
        return hy15_transformer_file(tiny_loaded, path / "hunyuanvideo1.5_t2v_tiny.safetensors")
    parts = {name: store_tensors(getattr(pipe, name), "fp32") for name in ("transformer", "vae")}
    return write_ltx2_checkpoint(parts, path / "ltx-2-19b-dev-fp32.safetensors")


@pytest.mark.parametrize("variant", [LTX2, HY15])
def test_the_lowered_transformer_files_of_the_other_families_count_by_the_same_rule(
        variant, tiny_loaded, tiny_folder, tmp_path, monkeypatch):
    path = family_file(variant, tiny_loaded, tmp_path)
    needs = ram_needs(monkeypatch, tiny_folder(variant), transformer_file=path, weight_dtype="gguf_q8_0")
    tensors = read_weight_file(path, "transformer_file", detect.TRANSFORMER).tensors  # under the model's names
    matrices = lowered_names(tiny_loaded(variant).pipe.transformer, tensors, "gguf_q8_0", torch.float32)
    assert matrices and len(matrices) < len(tensors)
    lowered = FORMATS["gguf_q8_0"].stored_bytes(sum(tensors[name].shape.numel() for name in matrices))
    assert needs[f"transformer_file '{path.name}' lowered to gguf_q8_0"] == lowered
    assert from_folder_config(needs, "transformer") == []


def test_a_lowered_transformer_file_that_does_not_fit_is_refused_before_anything_is_built(
        tiny_folder, written, monkeypatch, built):
    """The text encoder from a file already in weight_dtype's format: the transformer_file is all that is lowered."""
    lowered, in_place = written("transformer", "fp32"), written("transformer", "fp8_scaled")
    inputs = dict(weight_dtype="fp8_scaled", text_encoder_file=written("text_encoder", "fp8_scaled"))
    needs = ram_needs(monkeypatch, tiny_folder(WAN), transformer_file=lowered, **inputs)
    file_need = needs[f"transformer_file '{lowered.name}' lowered to fp8_scaled"]
    machine_with_ram(monkeypatch, sum(needs.values()) - file_need // 2)  # the rest fits; not with the lowered file
    built.clear()
    with pytest.raises(ModelError, match=rf"weight_dtype fp8_scaled needs .* of RAM .*"
                                         rf"transformer_file '{lowered.name}' lowered to fp8_scaled.*"
                                         r"a transformer_file already stored in weight_dtype's "
                                         r"format \(used in place"):
        load_pipeline(tiny_folder(WAN), "fp32", lowered, **inputs)
    assert built == []
    loaded = load_pipeline(tiny_folder(WAN), "fp32", in_place, **inputs)  # the same RAM: used in place, it loads
    assert loaded.storage["transformer"] == "fp8_scaled" and built == ["transformer", "text_encoder"]


def test_a_transformer_file_used_in_place_counts_nothing_and_loads_where_the_rest_just_fits(
        tiny_folder, written, monkeypatch):
    """The folder's text encoder lowered, the transformer from a file already in weight_dtype's format: counting
    the folder's transformer config at dtype would refuse a machine that has room."""
    path = written("transformer", "fp8_scaled")
    needs = ram_needs(monkeypatch, tiny_folder(WAN), transformer_file=path, weight_dtype="fp8_scaled")
    assert "text_encoder as fp8_scaled" in needs  # the check ran
    assert not [label for label in needs if label.startswith("transformer")]
    machine_with_ram(monkeypatch, sum(needs.values()))
    loaded = load_pipeline(tiny_folder(WAN), "fp32", path, weight_dtype="fp8_scaled")
    assert loaded.storage["transformer"] == "fp8_scaled"


def test_a_folder_already_in_weight_dtypes_format_counts_only_what_it_casts(tiny_folder, monkeypatch):
    """At weight_dtype fp32 the fp32 folder's transformer and text encoder are used in place (the disk tier)."""
    needs = ram_needs(monkeypatch, tiny_folder(WAN), weight_dtype="fp32")
    assert needs.keys() == set(from_folder_config(needs, "vae")) and len(needs) == 1  # the check ran: the VAE only


def test_the_folders_vae_counts_at_vae_dtype(tiny_loaded, tiny_folder, monkeypatch):
    needs = ram_needs(monkeypatch, tiny_folder(WAN), "bf16", weight_dtype="fp8_scaled", vae_dtype="fp32")
    (label,) = from_folder_config(needs, "vae")
    assert needs[label] == folder_config_bytes(tiny_loaded(WAN), "vae", torch.float32)  # read at fp32, not at bf16


def test_a_vae_file_counts_only_what_is_cast_into_ram(tiny_loaded, tiny_folder, written, monkeypatch):
    path = written("vae", "fp32")
    in_place = ram_needs(monkeypatch, tiny_folder(WAN), weight_dtype="fp8_scaled", vae_file=path)
    assert {"transformer as fp8_scaled", "text_encoder as fp8_scaled"} <= in_place.keys()  # the check ran
    assert not [label for label in in_place if label.startswith("vae")]  # fp32 at fp32: mapped, not counted
    cast = ram_needs(monkeypatch, tiny_folder(WAN), weight_dtype="fp8_scaled", vae_file=path, vae_dtype="bf16")
    assert from_folder_config(cast, "vae") == []
    vae = tiny_loaded(WAN).pipe.vae
    in_file = sum(t.numel() for t in vae.state_dict().values() if t.is_floating_point())
    assert cast[f"vae_file '{path.name}' cast to bf16"] == 2 * in_file  # every tensor copied at bf16


def test_an_ltx2_checkpoints_vae_counts_what_is_cast_at_vae_dtype(tiny_loaded, tiny_folder, tmp_path, monkeypatch):
    path = family_file(LTX2, tiny_loaded, tmp_path)
    needs = ram_needs(monkeypatch, tiny_folder(LTX2), weight_dtype="fp8_scaled", transformer_file=path,
                      vae_dtype="bf16")
    assert from_folder_config(needs, "vae") == [] and from_folder_config(needs, "transformer") == []
    in_file = sum(t.numel() for t in tiny_loaded(LTX2).pipe.vae.state_dict().values() if t.is_floating_point())
    assert needs[f"the VAE of transformer_file '{path.name}' cast to bf16"] == 2 * in_file
    in_place = ram_needs(monkeypatch, tiny_folder(LTX2), weight_dtype="fp8_scaled", transformer_file=path)
    assert f"transformer_file '{path.name}' lowered to fp8_scaled" in in_place  # the check ran
    assert not [label for label in in_place if "VAE" in label or label.startswith("vae")]


def test_an_ltx2_checkpoint_with_its_vae_over_a_folder_without_one_is_refused_before_anything_is_built(
        tiny_loaded, tiny_folder, tmp_path, built):
    import json
    import shutil

    folder = tmp_path / "ltx2-without-vae"
    shutil.copytree(tiny_folder(LTX2), folder)
    index = json.loads((folder / "model_index.json").read_text())
    del index["vae"]
    (folder / "model_index.json").write_text(json.dumps(index))
    path = family_file(LTX2, tiny_loaded, tmp_path)
    built.clear()
    with pytest.raises(ModelError, match=rf"'{path.name}' carries LTX-2's video VAE, but .*model_index.json' lists no "
                                         r"vae; use an LTX-2 diffusers folder"):
        load_pipeline(folder, "fp32", transformer_file=path, weight_dtype="gguf_q8_0")
    assert built == []  # the transformer was neither built nor lowered first


def test_one_refusal_lists_the_folder_and_the_files_each_with_its_size(tiny_folder, written, monkeypatch):
    """A machine short even of the folder's own components: the refusal still lists every part of the load (the
    folder's VAE, its lowered text encoder, the lowered transformer_file), so freeing RAM for what it lists
    cannot meet a second refusal for what it left out."""
    from vidmem.pipelines.weight_check import _size

    path = written("transformer", "fp32")
    needs = ram_needs(monkeypatch, tiny_folder(WAN), transformer_file=path, weight_dtype="fp8_scaled")
    assert len(needs) == 3 and f"transformer_file '{path.name}' lowered to fp8_scaled" in needs
    machine_with_ram(monkeypatch, 1)
    with pytest.raises(ModelError) as refused:
        load_pipeline(tiny_folder(WAN), "fp32", path, weight_dtype="fp8_scaled")
    for label, nbytes in needs.items():
        assert f"{_size(nbytes)} for {label}" in str(refused.value)


# --- text encoder files: counted as the transformer_file is, at every weight_dtype ---------------------------

def test_text_encoder_files_count_what_their_fill_copies_at_weight_dtype_default(tiny_loaded, tiny_folder, tmp_path,
                                                                                   monkeypatch):
    """bf16 files computed in fp32: their norms are cast into RAM (the matrices stay stored, upcast per call). The
    count is the fill's own report, for the lowered text_encoder and the never lowered ByT5 text_encoder_2 alike."""
    loaded = tiny_loaded(HY15)
    inputs = {f"{name}_file": write_file(loaded, name, "bf16", tmp_path / f"{name}-bf16.safetensors")
              for name in ("text_encoder", "text_encoder_2")}
    needs = ram_needs(monkeypatch, tiny_folder(HY15), "fp32", **inputs)
    got = load_pipeline(tiny_folder(HY15), "fp32", **inputs)
    for name, path in ((name, inputs[f"{name}_file"]) for name in ("text_encoder", "text_encoder_2")):
        copied = got.storage_reports[name].copied_bytes
        assert copied > 0  # the norms are cast: real RAM, which the old rule (lowered matrices only) never counted
        assert needs[f"{name}_file '{path.name}' cast to fp32"] == copied


def cut_gemma_file(gguf_folder, path, storage: str = "fp32", cut: int = 4):
    """The tiny Gemma as a llama.cpp GGUF whose token table lacks its last `cut` rows (as the converter cuts it)."""
    stored = store_tensors(encoder(load_pipeline(gguf_folder(LTX2), "fp32")), storage)
    name = "model.language_model.embed_tokens.weight"
    return write_llama_cpp_text_encoder({**stored, name: stored[name][:-cut]}, path, "gemma3")


@pytest.mark.parametrize("weight_dtype", ["default", "fp8_scaled"])
def test_a_cut_gemma_token_table_counts_the_padded_table_the_load_allocates(gguf_folder, tmp_path, monkeypatch,
                                                                              weight_dtype):
    """llama.cpp's Gemma 3 GGUFs cut the token table (262,144 of 262,208 rows): the load pads it into a new table
    at dtype (about 2 GB at Gemma 3 12B's size in bf16), at every weight_dtype, so the check counts it."""
    path = cut_gemma_file(gguf_folder, tmp_path / "gemma-cut-F32.gguf")
    needs = ram_needs(monkeypatch, gguf_folder(LTX2), "bf16", text_encoder_file=path, weight_dtype=weight_dtype)
    table = encoder(load_pipeline(gguf_folder(LTX2), "bf16", text_encoder_file=path,
                                  weight_dtype=weight_dtype)).get_input_embeddings().weight
    label = f"text_encoder_file '{path.name}': its token table padded to {table.shape[0]:,} rows at bf16"
    assert needs[label] == table.numel() * table.element_size() and table.dtype == torch.bfloat16


def test_a_cut_gemma_table_that_does_not_fit_is_refused_before_anything_is_built(gguf_folder, tmp_path, monkeypatch,
                                                                                  built):
    path = cut_gemma_file(gguf_folder, tmp_path / "gemma-cut-F32.gguf")
    needs = ram_needs(monkeypatch, gguf_folder(LTX2), "fp32", text_encoder_file=path)
    (label,) = [label for label in needs if "token table padded" in label]
    machine_with_ram(monkeypatch, sum(needs.values()) - needs[label] // 2)  # the rest fits; not with the table
    built.clear()
    with pytest.raises(ModelError, match=r"needs .* of RAM .*token table padded to .*"
                                         r"a text encoder file with the config's whole token table"):
        load_pipeline(gguf_folder(LTX2), "fp32", text_encoder_file=path)
    assert built == []
