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

from test_text_encoder_file import hy15_transformer_file, write_file
from vidmem.memory.storage import FORMATS
from vidmem.pipelines.comfy_files import detect
from vidmem.pipelines.comfy_files.files import read_weight_file
from vidmem.pipelines.comfy_files.keys import KeyLayout
from vidmem.pipelines.comfy_files.write import store_tensors, write_ltx2_checkpoint, write_transformer, write_vae
from vidmem.pipelines.configs.meta import ComponentConfig
from vidmem.pipelines.family import ModelError
from vidmem.pipelines.loader import load_pipeline
from vidmem.pipelines.weight_check import implied_weights, ram_need
from vidmem.pipelines.weight_storage import lowered_names

WAN, LTX2, HY15 = "wan2.1-t2v", "ltx2-t2v", "hunyuanvideo1.5-t2v"


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
    matrices = lowered_names(tiny_loaded(WAN).pipe.transformer, tensors, "fp8_scaled")  # the loader's rule
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
    matrices = lowered_names(tiny_loaded(variant).pipe.transformer, tensors, "gguf_q8_0")
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
