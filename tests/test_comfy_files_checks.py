"""Load Video Model Files checks every file before it reads any weight, and counts what it re-stores per tensor.

A broken VAE or text encoder is refused before the transformer is filled; a GGUF file that mixes quant types
is counted tensor by tensor (the RAM check and the plan agree with the load); files whose shapes cannot tell
Wan 2.1 14B from the Wan 2.2 A14B experts are checked by path and warned about by name.
"""

from __future__ import annotations

import logging
import re
from dataclasses import replace
from pathlib import Path

import pytest
import safetensors.torch
import torch

from vidmem.memory.storage import StoredTensor, is_file_backed, open_gguf
from vidmem.pipelines.comfy_files import LoadOptions, build, detect, load, load_model_files, match
from vidmem.pipelines.comfy_files.catalogue import shipped_catalogue
from vidmem.pipelines.comfy_files.files import WeightFile, read_weight_file
from vidmem.pipelines.comfy_files.keys import KeyLayout
from vidmem.pipelines.comfy_files.write import _write_gguf
from vidmem.pipelines.family import ModelError
from vidmem.pipelines.tiny_files import save_tiny_comfy_files, tiny_catalogue


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cache = {}

    def get(variant, storage="bf16"):
        if (variant, storage) not in cache:
            folder = tmp_path_factory.mktemp(f"{variant}-{storage}")
            cache[variant, storage] = save_tiny_comfy_files(variant, folder, storage, reference=False).files
        return cache[variant, storage]

    return get


@pytest.fixture
def filled(monkeypatch):
    """The components given weights, in order (build.fill is where a load first reads a file's weights)."""
    seen, fill = [], build.fill
    monkeypatch.setattr(build, "fill", lambda module, tensors, dtype, source: (seen.append(source), fill(module, tensors, dtype, source))[1])
    return seen


def rewritten(path: Path, out: Path, change) -> Path:
    tensors = safetensors.torch.load_file(str(path))
    change(tensors)
    safetensors.torch.save_file(tensors, str(out))
    return out


def last_decoder_weight(tensors):
    del tensors[sorted(n for n in tensors if n.startswith("decoder.") and n.endswith(".weight"))[-1]]


def wider_final_norm(tensors):
    norm = tensors["encoder.final_layer_norm.weight"]
    tensors["encoder.final_layer_norm.weight"] = torch.ones(norm.shape[0] + 1, dtype=norm.dtype)


@pytest.mark.parametrize("role,change,message", [
    ("vae", last_decoder_weight, r"vae: 'broken.safetensors' do not match the model: 1 tensors the model needs are missing"),
    ("text_encoder", lambda t: t.pop("encoder.block.0.layer.1.DenseReluDense.wo.weight"),
     r"text_encoder: 'broken.safetensors' do not match the model: .*DenseReluDense.wo.weight"),
    ("text_encoder", wider_final_norm,
     r"text_encoder: 'broken.safetensors': 'encoder.final_layer_norm.weight' has shape \[\d+\] in the file"),
])
def test_a_broken_vae_or_text_encoder_is_refused_before_any_weight_is_read(tiny, tmp_path, filled, role, change, message):
    files = tiny("wan2.1-t2v")
    broken = rewritten(getattr(files, role), tmp_path / "broken.safetensors", change)
    with pytest.raises(ModelError, match=message):
        load_model_files(replace(files, **{role: broken}), LoadOptions(dtype="fp32", weights_on_disk=False), tiny_catalogue())
    assert filled == []  # not even the transformer was filled (or copied into RAM)


def mixed_gguf(q8_0: Path, out: Path) -> Path:
    """`q8_0` with a third of its matrices F16, as llama.cpp's mixes keep some matrices wider (Q6_K in Q4_K_M)."""
    tensors = dict(open_gguf(q8_0).tensors)
    stored = [name for name, t in tensors.items() if isinstance(t, StoredTensor)]
    for name in stored[::3]:
        tensors[name] = tensors[name].dequantize(torch.float16)
    _write_gguf(tensors, out)
    return out


def test_a_mixed_gguf_is_counted_and_held_per_tensor(tiny, tmp_path, monkeypatch):
    files = tiny("wan2.1-t2v", "gguf_q8_0")
    files = replace(files, model=mixed_gguf(files.model, tmp_path / "mixed_q8_0.gguf"))
    assert read_weight_file(files.model, "model", detect.TRANSFORMER).storage == "gguf_q8_0"  # by its majority
    counted, check = [], load.check_against_ram
    monkeypatch.setattr(load, "check_against_ram", lambda needs, *args: (counted.extend(needs), check(needs, *args)))
    loaded = load_model_files(files, LoadOptions(dtype="fp32", weight_dtype="gguf_q8_0"), tiny_catalogue())
    restored = sum(m.weight_stored.nbytes for m in loaded.pipe.transformer.modules()
                   if getattr(m, "weight_stored", None) is not None and not is_file_backed(m.weight_stored))
    assert restored > 0 and loaded.on_disk is False
    assert [nbytes for label, nbytes in counted if label.startswith("model ")] == [restored]


def test_one_file_as_both_experts_is_refused_naming_both_inputs(tiny):
    files = tiny("wan2.2-a14b")
    with pytest.raises(ModelError, match=r"model_2: '.*' is the same file as model \('.*'\).*set model_2 to \(none\)"):
        load_model_files(replace(files, model_2=files.model), LoadOptions(dtype="fp32"), tiny_catalogue())


def test_a_symlink_to_the_model_is_the_same_file(tiny, tmp_path):
    files = tiny("wan2.2-a14b")
    link = tmp_path / "wan2.2_t2v_low_noise_14B.safetensors"
    link.symlink_to(files.model)
    with pytest.raises(ModelError, match="is the same file as model"):
        load_model_files(replace(files, model_2=link), LoadOptions(dtype="fp32"), tiny_catalogue())


def named(name: str, fields) -> WeightFile:
    return WeightFile(Path(name), detect.TRANSFORMER, KeyLayout.ORIGINAL, "fp8_scaled", {}, fields)


@pytest.fixture(scope="module")
def a14b():
    entry = next(e for e in shipped_catalogue() if e.name == "wan2.2-t2v-a14b")
    return entry, detect.transformer_config_fields(entry.config("transformer"))


def test_the_a14b_experts_and_wan21_14b_have_one_shape(a14b):
    """Why the names are read: the shapes alone take a high-noise expert for Wan 2.1 T2V 14B."""
    entry, fields = a14b
    assert match.choose_model(named("wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors", fields), 1, shipped_catalogue()).name == "wan2.1-t2v-14b"


@pytest.mark.parametrize("model,model_2,claims", [
    ("wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors", None, [r"model: .*high-noise expert.*set model_2"]),
    ("wan2.1_t2v_14B_fp8_scaled.safetensors", "wan2.1_t2v_14B_bf16.safetensors",
     [r"model: .* named Wan 2.1", r"model_2: .* named Wan 2.1"]),
    ("wan2.2_t2v_low_noise_14B_fp8_scaled.safetensors", "wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors",
     [r"model: .*low-noise expert, but model takes the high-noise one; swap", r"model_2: .*high-noise expert, but model_2 takes the low-noise"]),
    ("wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors", "wan2.2_t2v_low_noise_14B_fp8_scaled.safetensors", []),
    ("wan2.1_t2v_14B_fp8_scaled.safetensors", None, []),
    ("my_wan_14B.safetensors", "my_other_wan_14B.safetensors", []),
])
def test_names_that_disagree_with_the_inputs_are_warned_about(a14b, model, model_2, claims):
    entry, fields = a14b
    found = match.name_disagreements(entry, named(model, fields), model_2 and named(model_2, fields))
    assert len(found) == len(claims)
    for claim, pattern in zip(found, claims):
        assert re.search(pattern, claim), claim


def test_the_loader_logs_a_name_disagreement(tiny, tmp_path, caplog):
    files = tiny("wan2.1-t2v")
    renamed = tmp_path / "wan2.2_t2v_high_noise_14B_bf16.safetensors"
    renamed.symlink_to(files.model)
    with caplog.at_level(logging.WARNING, logger="vidmem"):
        load_model_files(replace(files, model=renamed), LoadOptions(dtype="fp32"), tiny_catalogue())
    assert any("high-noise expert" in r.getMessage() and "tiny-wan2.1-t2v" in r.getMessage() for r in caplog.records)


@pytest.fixture
def plan_models(tmp_path, monkeypatch):
    """Tiny Q8_0 Wan 2.1 files, the model a mixed GGUF and the text encoder fp8 scaled (so that neither file's
    majority format says weight_dtype=gguf_q8_0 lowers it), in a models/ tree a stand-in folder_paths lists."""
    from types import SimpleNamespace

    from vidmem.nodes import host, plan_files
    from test_plan_route_files import FOLDERS

    files = save_tiny_comfy_files("wan2.1-t2v", tmp_path, "gguf_q8_0", reference=False).files
    mixed_gguf(files.model, tmp_path / "mixed.gguf").replace(files.model)
    fp8 = save_tiny_comfy_files("wan2.1-t2v", tmp_path / "fp8", "fp8_scaled", reference=False).files.text_encoder
    files.text_encoder.unlink()
    files = replace(files, text_encoder=fp8.replace(files.text_encoder.with_name(fp8.name)))
    folders = {key: tmp_path / sub for key, sub in FOLDERS.items()}
    monkeypatch.setattr(host, "folder_paths", SimpleNamespace(
        models_dir=str(tmp_path), get_folder_paths=lambda key: [str(folders[key])],
        get_filename_list=lambda key: sorted(p.name for p in folders[key].glob("*") if p.is_file())))
    plan_files.recognise.cache_clear()
    return files


@pytest.mark.parametrize("weight_dtype", ["gguf_q8_0", "default"])
def test_the_plan_says_on_disk_exactly_when_the_load_does(plan_models, weight_dtype):
    from test_plan_route_files import answer, query

    plan = answer(query(plan_models, weight_dtype=weight_dtype, dtype="fp32"))
    loaded = load_model_files(plan_models, LoadOptions(dtype="fp32", vae_dtype="fp32", weight_dtype=weight_dtype),
                              tiny_catalogue())
    assert plan["status"] == "ok", plan
    assert plan["on_disk"] is loaded.on_disk is (weight_dtype == "default")
