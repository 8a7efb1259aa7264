"""The loader nodes' model lists: cached until a folder changes, finite on a symlink loop, and
read from $VIDMEM_MODELS_DIR when ComfyUI's folder_paths is absent."""

from __future__ import annotations

import os
import threading
from types import SimpleNamespace

import pytest

from vidmem.nodes import host, model_folders, model_lists

LIST_TIMEOUT_S = 20  # a listing of a handful of folders takes milliseconds; a loop never ends


def diffusers_folder(root, name: str) -> None:
    folder = root / name
    (folder / "transformer").mkdir(parents=True)
    (folder / "model_index.json").write_text("{}")
    (folder / "transformer" / "diffusion_pytorch_model.safetensors").write_bytes(b"")


@pytest.fixture
def comfy_models(tmp_path, monkeypatch):
    """A models/ tree that a stand-in for ComfyUI's folder_paths lists, with a fresh listing cache."""
    models = tmp_path / "models"
    for key in ("diffusers", "diffusion_models", "unet", "text_encoders", "vae", "clip_vision", "loras"):
        (models / key).mkdir(parents=True)
    monkeypatch.setattr(host, "folder_paths", SimpleNamespace(models_dir=str(models),
                                                              get_folder_paths=lambda key: [str(models / key)]))
    monkeypatch.setattr(model_folders, "LISTINGS", model_lists.ListingCache())
    return models


def within_timeout(function):
    """`function()`'s result, or a test failure if it has not returned after LIST_TIMEOUT_S."""
    result = {}
    worker = threading.Thread(target=lambda: result.setdefault("value", function()), daemon=True)
    worker.start()
    worker.join(LIST_TIMEOUT_S)
    assert not worker.is_alive(), f"listing did not finish within {LIST_TIMEOUT_S} s (a symlink loop?)"
    return result["value"]


def test_a_symlink_loop_in_a_model_folder_ends(comfy_models):
    diffusers = comfy_models / "diffusers"
    diffusers_folder(diffusers, "wan")
    os.symlink(diffusers, diffusers / "loop_a")  # two links back to the root: os.walk would descend
    os.symlink(diffusers, diffusers / "loop_b")  # 2**40 paths before the kernel's 40-link limit stops it
    os.symlink(diffusers / "wan", diffusers / "wan" / "transformer" / "up")
    assert within_timeout(host.diffusers_model_names) == ["wan"]


def test_a_symlink_loop_among_weight_files_ends(comfy_models):
    models = comfy_models / "diffusion_models"
    (models / "wan").mkdir()
    (models / "wan" / "t2v.gguf").write_bytes(b"")
    (models / "top.safetensors").write_bytes(b"")
    os.symlink(models, models / "wan" / "back")
    os.symlink(models, models / "wan" / "again")
    assert within_timeout(lambda: host.model_file_names("model")) == ["top.safetensors", os.path.join("wan", "t2v.gguf")]


def test_a_folder_linked_in_under_another_name_is_listed_under_both(comfy_models, tmp_path):
    elsewhere = tmp_path / "big_disk"
    diffusers_folder(elsewhere, "cogvideox")
    os.symlink(elsewhere / "cogvideox", comfy_models / "diffusers" / "cogvideox")
    os.symlink(elsewhere / "cogvideox", comfy_models / "diffusers" / "cogvideox-alias")
    assert host.diffusers_model_names() == ["cogvideox", "cogvideox-alias"]


def count_scans(monkeypatch) -> list[str]:
    scanned, original = [], os.scandir
    monkeypatch.setattr(os, "scandir", lambda path=".": scanned.append(str(path)) or original(path))
    return scanned


def test_lists_are_walked_once_until_a_folder_changes(comfy_models, monkeypatch):
    diffusers = comfy_models / "diffusers"
    diffusers_folder(diffusers, "wan")
    assert host.diffusers_model_names() == ["wan"]
    scanned = count_scans(monkeypatch)
    for _ in range(3):  # INPUT_TYPES again and again: no folder is read, only stat'ed
        assert host.diffusers_model_names() == ["wan"]
    assert scanned == []
    diffusers_folder(diffusers, "cogvideox")  # a new model folder changes the root's mtime
    assert host.diffusers_model_names() == ["cogvideox", "wan"] and scanned


def test_a_file_added_deep_inside_is_seen(comfy_models):
    models = comfy_models / "diffusion_models"
    (models / "wan" / "fp8").mkdir(parents=True)
    assert host.model_file_names("model") == []
    (models / "wan" / "fp8" / "t2v.safetensors").write_bytes(b"")  # only the innermost folder's mtime changes
    assert host.model_file_names("model") == [os.path.join("wan", "fp8", "t2v.safetensors")]
    (models / "wan" / "fp8" / "t2v.safetensors").unlink()
    assert host.model_file_names("model") == []


def test_a_removed_root_lists_nothing_and_a_new_one_is_walked(comfy_models):
    import shutil

    diffusers_folder(comfy_models / "diffusers", "wan")
    assert host.diffusers_model_names() == ["wan"]
    shutil.rmtree(comfy_models / "diffusers")
    assert host.diffusers_model_names() == []
    diffusers_folder(comfy_models / "diffusers", "wan2")
    assert host.diffusers_model_names() == ["wan2"]


def test_pickles_and_git_folders_are_not_offered(comfy_models):
    loras = comfy_models / "loras"
    (loras / ".git").mkdir()
    (loras / ".git" / "hidden.safetensors").write_bytes(b"")
    for name in ("style.safetensors", "old.ckpt", "Upper.SAFETENSORS", "x.sft"):
        (loras / name).write_bytes(b"")
    assert host.lora_names() == ["Upper.SAFETENSORS", "style.safetensors", "x.sft"]


# --- without ComfyUI: $VIDMEM_MODELS_DIR ----------------------------------------------------------

@pytest.fixture
def no_comfy(monkeypatch):
    monkeypatch.setattr(host, "folder_paths", None)
    monkeypatch.setattr(model_folders, "LISTINGS", model_lists.ListingCache())
    monkeypatch.delenv(host.MODELS_DIR_ENV, raising=False)


def test_without_comfyui_the_models_root_comes_from_the_environment(no_comfy, tmp_path, monkeypatch):
    root = tmp_path / "my_models"
    diffusers_folder(root / "diffusers", "wan")
    (root / "diffusion_models").mkdir()
    (root / "diffusion_models" / "wan.gguf").write_bytes(b"")
    (root / "loras").mkdir()
    (root / "loras" / "style.safetensors").write_bytes(b"")
    (root / "vidmem_configs").mkdir()
    monkeypatch.setenv(host.MODELS_DIR_ENV, str(root))

    assert host.diffusers_model_names() == ["wan"]
    assert host.resolve_model_folder("wan", "") == root / "diffusers" / "wan"
    assert host.model_file_names("model") == ["wan.gguf"]
    assert host.resolve_model_file("model", "wan.gguf") == root / "diffusion_models" / "wan.gguf"
    assert host.lora_names() == ["style.safetensors"]
    assert host.resolve_lora("style.safetensors") == root / "loras" / "style.safetensors"
    assert host.model_config_dirs() == [root / "vidmem_configs"]
    assert host.loras_folder() == root / "loras"
    assert not host.in_comfyui()


def test_without_comfyui_or_the_environment_the_error_says_how_to_point_at_models(no_comfy):
    assert host.diffusers_model_names() == [] and host.model_file_names("vae") == [] and host.lora_names() == []
    with pytest.raises(FileNotFoundError, match="VIDMEM_MODELS_DIR"):
        host.resolve_model_folder("wan", "")
    with pytest.raises(FileNotFoundError, match="VIDMEM_MODELS_DIR"):
        host.resolve_lora("style.safetensors")
    with pytest.raises(FileNotFoundError, match="text_encoder 'umt5.safetensors'.*VIDMEM_MODELS_DIR"):
        host.resolve_model_file("text_encoder", "umt5.safetensors")


def test_a_models_root_without_the_folder_names_the_folder_it_looked_in(no_comfy, tmp_path, monkeypatch):
    monkeypatch.setenv(host.MODELS_DIR_ENV, str(tmp_path))
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "vae").replace("\\", "\\\\")):
        host.resolve_model_file("vae", "wan_vae.safetensors")


def test_inside_comfyui_the_environment_is_not_read(comfy_models, tmp_path, monkeypatch):
    other = tmp_path / "other"
    diffusers_folder(other / "diffusers", "elsewhere")
    monkeypatch.setenv(host.MODELS_DIR_ENV, str(other))
    assert host.diffusers_model_names() == []
