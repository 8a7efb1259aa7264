"""Prepare Training Data's `folder` as ComfyUI sees it: the node runs again when the folder's clips or
captions change (IS_CHANGED, stat only), and inside ComfyUI only its input folder may be read, unless
the server's operator sets VIDMEM_ALLOW_ANY_PATH=1 (as Load Video Pipeline's path: tests/test_loader_path.py)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from vidmem.nodes import host, model_folders
from vidmem.nodes.train import VidMemPrepareTrainingData
from vidmem.training import TrainingError

ENV = model_folders.ALLOW_ANY_PATH_ENV
SECOND = 1_000_000_000  # ns
NODE = VidMemPrepareTrainingData


def touch(path, data: bytes = b"x", mtime_s: int = 1_700_000_000):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    os.utime(path, ns=(mtime_s * SECOND, mtime_s * SECOND))  # set, not waited for: no test depends on the clock


def key(folder) -> str:
    return NODE.IS_CHANGED(pipeline=None, strategy=None, folder=str(folder), resolutions="32x32", frame_buckets="9")


def test_the_key_follows_the_clips_and_captions_and_nothing_else(tmp_path):
    clips = tmp_path / "clips"
    touch(clips / "walk.mp4", b"video")
    touch(clips / "walk.txt", b"a corgi walks")
    first = key(clips)
    assert first and key(clips) == first, "an unchanged folder keeps ComfyUI's cached result"
    touch(clips / "notes.md", b"not a clip")
    touch(clips / ".hidden" / "old.mp4", b"skipped as the scan skips it")
    assert key(clips) == first
    seen = {first}
    touch(clips / "walk.txt", b"a corgi runs", mtime_s=1_700_000_000)  # a caption edited: another size
    seen.add(key(clips))
    touch(clips / "walk.txt", b"a corgi trots", mtime_s=1_700_000_500)  # the same size, written later
    seen.add(key(clips))
    touch(clips / "sub" / "still.png", b"image")  # a clip added, in a subfolder
    seen.add(key(clips))
    (clips / "walk.mp4").rename(clips / "stroll.mp4")  # renamed
    seen.add(key(clips))
    assert len(seen) == 5


def test_a_linked_missing_or_empty_folder_gives_a_constant_key(tmp_path):
    (tmp_path / "empty").mkdir()
    assert NODE.IS_CHANGED(folder=None) == key(tmp_path / "empty") == key(tmp_path / "absent") == NODE.IS_CHANGED(folder="") == ""


@pytest.fixture
def comfy(tmp_path, monkeypatch):
    """A stand-in for ComfyUI's folder_paths: input/, output/ and models/ under a base folder."""
    base = tmp_path / "ComfyUI"
    for name in ("input", "output", "models"):
        (base / name).mkdir(parents=True)
    fake = SimpleNamespace(models_dir=str(base / "models"), folder_names_and_paths={},
                           get_folder_paths=lambda key: [], get_input_directory=lambda: str(base / "input"),
                           get_output_directory=lambda: str(base / "output"))
    monkeypatch.setattr(host, "folder_paths", fake)
    monkeypatch.delenv(ENV, raising=False)
    return SimpleNamespace(base=base, input=base / "input", outside=tmp_path / "elsewhere")


@pytest.mark.parametrize("folder", ["/etc", "~", "{base}/models", "{base}/output/vidmem_training", "{input}/../output",
                                    "{input}/clips/../../models", "{outside}/clips"])
def test_a_folder_outside_the_input_folder_is_refused_when_queued(comfy, folder):
    answer = NODE.VALIDATE_INPUTS(folder=folder.format(base=comfy.base, input=comfy.input, outside=comfy.outside))
    assert answer is not True, f"{folder} was accepted"
    assert "outside ComfyUI's input folder" in answer and f"{ENV}=1" in answer and str(comfy.input / "my_clips") in answer


def test_the_input_folder_and_links_placed_in_it_are_read(comfy):
    touch(comfy.outside / "big-disk" / "clips" / "walk.mp4")
    os.symlink(comfy.outside / "big-disk" / "clips", comfy.input / "linked")  # the operator linked it in
    for folder in (comfy.input / "clips", comfy.input, comfy.input / "linked"):
        assert NODE.VALIDATE_INPUTS(folder=str(folder)) is True, folder
    assert key(comfy.input / "linked"), "a linked-in folder is fingerprinted"
    assert NODE.VALIDATE_INPUTS(folder=None) is True, "linked: checked when it arrives"
    assert NODE.VALIDATE_INPUTS(folder="") is True, "empty: the node says it is not a folder when it runs"


def test_the_operator_may_allow_any_folder(comfy, monkeypatch):
    monkeypatch.setenv(ENV, "1")
    assert NODE.VALIDATE_INPUTS(folder="/etc") is True


def test_a_refused_folder_is_neither_fingerprinted_nor_read(comfy, monkeypatch):
    clips = comfy.outside / "clips"
    touch(clips / "walk.mp4")
    touch(clips / "walk.txt")
    assert key(clips) == ""
    read = []
    monkeypatch.setattr("vidmem.nodes.train.prepare_training_data", lambda *args, **kwargs: read.append(args))
    with pytest.raises(TrainingError, match=f"folder '{clips}' is outside ComfyUI's input folder.*{ENV}=1"):
        NODE().prepare(None, None, str(clips), "32x32", "9")  # a linked folder arrives only now
    assert read == []
