"""Load Video Pipeline's free-text `path`: inside ComfyUI only ComfyUI's model folders (models/ and
extra_model_paths.yaml's), unless the server's operator sets VIDMEM_ALLOW_ANY_PATH=1; outside
ComfyUI (scripts, the CLI, these tests' other files) the user is the operator and any folder loads."""

from __future__ import annotations

import os
import shutil
from types import SimpleNamespace

import pytest

from vidmem.nodes import host, model_folders, model_lists
from vidmem.nodes.loader import VidMemLoadPipeline
from vidmem.pipelines.family import ModelError

ENV = model_folders.ALLOW_ANY_PATH_ENV


@pytest.fixture
def comfy(tmp_path, monkeypatch):
    """A stand-in for ComfyUI's folder_paths: models/ under a base folder, an extra_model_paths.yaml
    folder for diffusers elsewhere, and custom_nodes (a key folder_paths has that holds no models)."""
    base, extra = tmp_path / "ComfyUI", tmp_path / "other-disk" / "diffusers"
    models = base / "models"
    keyed = {"diffusers": [models / "diffusers", extra], "loras": [models / "loras"],
             "custom_nodes": [base / "custom_nodes"]}
    for folder in (*keyed["diffusers"], *keyed["loras"], *keyed["custom_nodes"]):
        folder.mkdir(parents=True)
    fake = SimpleNamespace(models_dir=str(models),
                           folder_names_and_paths={k: ([str(p) for p in v], set()) for k, v in keyed.items()},
                           get_folder_paths=lambda key: [str(p) for p in keyed.get(key, [])])
    monkeypatch.setattr(host, "folder_paths", fake)
    monkeypatch.setattr(model_folders, "LISTINGS", model_lists.ListingCache())
    monkeypatch.delenv(ENV, raising=False)
    return SimpleNamespace(base=base, models=models, extra=extra, outside=tmp_path / "elsewhere")


def place(tiny_folder, target):
    shutil.copytree(tiny_folder("wan2.1-t2v"), target)
    return target


def refusal(path) -> str:
    answer = VidMemLoadPipeline.VALIDATE_INPUTS(path=str(path))
    assert answer is not True, f"{path} was accepted"
    return answer


@pytest.mark.parametrize("path", ["/etc", "../../../../etc", "~", "{models}/../../elsewhere", "{models}/diffusers/../..",
                                  "{base}/custom_nodes", "{base}/input"])
def test_a_path_outside_the_model_folders_is_refused_when_queued(comfy, path):
    message = refusal(path.format(models=comfy.models, base=comfy.base))
    assert "outside ComfyUI's model folders" in message and f"{ENV}=1" in message and "models/diffusers" in message


def test_the_node_refuses_it_too_before_reading_anything(comfy, tiny_folder, monkeypatch):
    folder = place(tiny_folder, comfy.outside / "wan")
    read = []
    monkeypatch.setattr("vidmem.nodes.loader.load_pipeline", lambda *args, **kwargs: read.append(args))
    with pytest.raises(ModelError, match=f"path '{folder}' is outside ComfyUI's model folders.*{ENV}=1"):
        VidMemLoadPipeline().load("(no diffusers models found)", "fp32", path=str(folder))
    assert read == []


def test_model_folders_and_extra_model_paths_and_links_placed_in_them_load(comfy, tiny_folder):
    inside = place(tiny_folder, comfy.models / "diffusers" / "wan")
    extra = place(tiny_folder, comfy.extra / "wan-extra")
    other_key = place(tiny_folder, comfy.models / "loras" / "odd-place")
    linked_target = place(tiny_folder, comfy.outside / "big-disk" / "wan")
    os.symlink(linked_target, comfy.models / "diffusers" / "linked")  # the operator linked it in
    for path in (inside, extra, other_key, comfy.models / "diffusers" / "linked"):
        assert VidMemLoadPipeline.VALIDATE_INPUTS(path=str(path)) is True
    (loaded,) = VidMemLoadPipeline().load("ignored", "fp32", path=str(comfy.models / "diffusers" / "linked"))
    assert loaded.class_name == "WanPipeline"


def test_empty_or_linked_path_is_not_checked(comfy):
    assert VidMemLoadPipeline.VALIDATE_INPUTS(path="") is True
    assert VidMemLoadPipeline.VALIDATE_INPUTS(path="   ") is True
    assert VidMemLoadPipeline.VALIDATE_INPUTS(path=None) is True  # a linked STRING has no value when queued


@pytest.mark.parametrize("value", ["1", "true", "YES"])
def test_the_servers_operator_may_allow_any_folder(comfy, tiny_folder, monkeypatch, value):
    folder = place(tiny_folder, comfy.outside / "wan")
    monkeypatch.setenv(ENV, value)
    assert VidMemLoadPipeline.VALIDATE_INPUTS(path=str(folder)) is True
    (loaded,) = VidMemLoadPipeline().load("ignored", "fp32", path=str(folder))
    assert loaded.class_name == "WanPipeline"
    monkeypatch.setenv(ENV, "0")
    assert "outside" in refusal(folder)


def test_outside_comfyui_any_folder_loads_as_before(tiny_folder, monkeypatch):
    monkeypatch.setattr(host, "folder_paths", None)
    monkeypatch.delenv(ENV, raising=False)
    assert VidMemLoadPipeline.VALIDATE_INPUTS(path=str(tiny_folder("wan2.1-t2v"))) is True
    (loaded,) = VidMemLoadPipeline().load("ignored", "fp32", path=str(tiny_folder("wan2.1-t2v")))
    assert loaded.class_name == "WanPipeline"


@pytest.mark.parametrize("name", ["{outside}/wan", "../../elsewhere/wan", "wan/../../../elsewhere/wan",
                                  "..\\..\\elsewhere\\wan", "C:\\elsewhere\\wan", "C:elsewhere\\wan",
                                  "\\elsewhere\\wan", "//server/share/wan"])
def test_a_listed_name_cannot_lead_out_of_the_model_folders(comfy, tiny_folder, monkeypatch, name):
    """ComfyUI checks a list widget's value only when typed in: a value linked in from another node (a `*`
    output such as Free VRAM's passthrough) reaches the loader as it is, so the names of models, files and
    LoRAs are kept inside their folders here, as a typed path is (and as ComfyUI's get_full_path does)."""
    from vidmem.nodes.lora import VidMemLoadLoRA

    place(tiny_folder, comfy.outside / "wan")
    secret = comfy.outside / "evil.safetensors"
    secret.write_bytes(b"{}")
    read = []
    monkeypatch.setattr("vidmem.nodes.loader.load_pipeline", lambda *args, **kwargs: read.append(args))
    name = name.format(outside=comfy.outside)
    with pytest.raises(ModelError, match=f"model '.*' is not a name from its list: listed names lie inside "
                                         f"models/diffusers.*{ENV}=1"):
        VidMemLoadPipeline().load(name, "fp32")
    lora = name.replace("wan", "evil.safetensors")
    with pytest.raises(FileNotFoundError, match="lora_name '.*' is not a name from its list"):
        host.resolve_lora(lora)
    assert VidMemLoadLoRA.IS_CHANGED(lora_name=lora) == ""  # not even a stat of the file outside
    with pytest.raises(FileNotFoundError, match="transformer_file '.*' is not a name from its list"):
        host.resolve_single_file(lora)
    assert read == []
    monkeypatch.setenv(ENV, "1")  # the operator's choice: any path
    assert host.resolve_lora(str(secret)) == secret


def test_names_in_subfolders_of_a_model_folder_still_resolve(comfy, tiny_folder):
    place(tiny_folder, comfy.models / "diffusers" / "video" / "wan")
    (comfy.models / "loras" / "styles").mkdir()
    (comfy.models / "loras" / "styles" / "a.safetensors").write_bytes(b"{}")
    assert host.resolve_model_folder("video/wan", "") == comfy.models / "diffusers" / "video" / "wan"
    assert host.resolve_lora("styles/a.safetensors") == comfy.models / "loras" / "styles" / "a.safetensors"
