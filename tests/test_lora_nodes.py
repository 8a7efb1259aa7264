"""Load LoRA as ComfyUI caches it: a file rewritten under the same name (Train LoRA writes
models/loras/<name>.safetensors) is read again, an untouched one is not; an empty LoRA folder's
placeholder is refused as the pack's ModelError, naming the input and the folder."""

from __future__ import annotations

import os

import pytest

from vidmem.nodes.lora import NO_LORAS, VidMemLoadLoRA
from vidmem.nodes.model_folders import MODELS_DIR_ENV
from vidmem.pipelines.family import ModelError
from vidmem.pipelines.loader import LoadedPipeline
from vidmem.pipelines.tiny import build_tiny_pipeline
from vidmem.pipelines.wan import WAN

SECOND = 1_000_000_000  # ns


@pytest.fixture
def loras(tmp_path, monkeypatch):
    """models/loras under a $VIDMEM_MODELS_DIR root (the host's folders without ComfyUI)."""
    monkeypatch.setenv(MODELS_DIR_ENV, str(tmp_path))
    folder = tmp_path / "loras"
    folder.mkdir()
    return folder


def write(path, data: bytes, mtime_ns: int):
    path.write_bytes(data)
    os.utime(path, ns=(mtime_ns, mtime_ns))  # set, not waited for: no test depends on the clock


def test_a_lora_rewritten_under_the_same_name_changes_the_cache_key(loras):
    path = loras / "mine.safetensors"
    write(path, b"trained once", 1_700_000_000 * SECOND)
    first = VidMemLoadLoRA.IS_CHANGED(pipeline=None, lora_name="mine.safetensors", strength=1.0, expert="both")
    assert VidMemLoadLoRA.IS_CHANGED(pipeline=None, lora_name="mine.safetensors", strength=1.0, expert="both") == first
    write(path, b"trained twice", 1_700_000_000 * SECOND)  # same time, another size
    resized = VidMemLoadLoRA.IS_CHANGED(lora_name="mine.safetensors")
    write(path, b"trained again", 1_700_000_100 * SECOND)  # same size, a later write
    rewritten = VidMemLoadLoRA.IS_CHANGED(lora_name="mine.safetensors")
    assert len({first, resized, rewritten}) == 3


def test_a_missing_or_linked_lora_gives_a_constant_key(loras):
    assert VidMemLoadLoRA.IS_CHANGED(lora_name="gone.safetensors") == VidMemLoadLoRA.IS_CHANGED(lora_name=None) == ""


def test_the_placeholder_of_an_empty_lora_folder_is_refused_as_a_model_error(loras):
    assert VidMemLoadLoRA.INPUT_TYPES()["required"]["lora_name"][0] == [NO_LORAS]
    loaded = LoadedPipeline(build_tiny_pipeline("wan2.1-t2v"), WAN, "WanPipeline", "tiny", "fp32")
    with pytest.raises(ModelError, match=r"lora_name '\(no LoRAs found in models/loras\)' was not found in .*loras; "
                                         "put the file there"):
        VidMemLoadLoRA().load(loaded, NO_LORAS, 1.0)
