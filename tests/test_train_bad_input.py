"""Bad training input: a clear TrainingError naming the input and the fix, and nothing written."""

from __future__ import annotations

import pytest

from test_train_support import make_dataset, prepare_tiny
from vidmem.memory import MemoryStrategy
from vidmem.memory.device import CpuBackend
from vidmem.training import BucketSettings, TrainingError, TrainOutputs, TrainSettings, prepare_training_data, train_lora


def prepare(loaded, folder, cache, size=(32, 32), frames=(9,)):
    return prepare_training_data(loaded, folder, BucketSettings((size,), frames), MemoryStrategy(), cache, CpuBackend())


def refused(match, call, *written):
    with pytest.raises(TrainingError, match=match):
        call()
    for path in written:
        assert not path.exists(), f"{path} was written"


def test_empty_folder(tiny_loaded, tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "notes.txt").write_text("not a clip")
    refused("no videos", lambda: prepare(tiny_loaded("wan2.1-t2v"), tmp_path / "data", tmp_path / "cache"), tmp_path / "cache")
    refused("not a folder", lambda: prepare(tiny_loaded("wan2.1-t2v"), tmp_path / "nowhere", tmp_path / "cache"), tmp_path / "cache")


def test_missing_caption_names_the_file(tiny_loaded, tmp_path):
    folder = make_dataset(tmp_path / "data", clips=2)
    (folder / "clip1.txt").unlink()
    refused(r"no caption: clip1\.mp4", lambda: prepare(tiny_loaded("wan2.1-t2v"), folder, tmp_path / "cache"), tmp_path / "cache")


def test_undecodable_video_names_the_file(tiny_loaded, tmp_path):
    folder = make_dataset(tmp_path / "data", clips=1)
    (folder / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 this is not a video")
    (folder / "broken.txt").write_text("a cat")
    refused(r"broken\.mp4' cannot be decoded", lambda: prepare(tiny_loaded("wan2.1-t2v"), folder, tmp_path / "cache"),
            tmp_path / "cache")


@pytest.mark.parametrize("variant, frames, rule", [("wan2.1-t2v", 10, "4k\\+1"), ("cogvideox-t2v", 13, "8k\\+1")])
def test_frames_the_family_cannot_take(tiny_loaded, tmp_path, variant, frames, rule):
    folder = make_dataset(tmp_path / "data", clips=1, frames=17)
    refused(rule, lambda: prepare(tiny_loaded(variant), folder, tmp_path / "cache", frames=(frames,)), tmp_path / "cache")


def test_clip_shorter_than_every_frame_bucket(tiny_loaded, tmp_path):
    folder = make_dataset(tmp_path / "data", clips=1, frames=5)
    refused(r"clip0\.mp4' has 5 frames", lambda: prepare(tiny_loaded("wan2.1-t2v"), folder, tmp_path / "cache"), tmp_path / "cache")


def test_resolution_not_a_multiple(tiny_loaded, tmp_path):
    folder = make_dataset(tmp_path / "data", clips=1)
    refused("multiple of 16", lambda: prepare(tiny_loaded("wan2.1-t2v"), folder, tmp_path / "cache", size=(40, 32)), tmp_path / "cache")


def test_image_to_video_pipeline_is_refused(tiny_loaded, tmp_path):
    folder = make_dataset(tmp_path / "data", clips=1)
    refused("text-to-video", lambda: prepare(tiny_loaded("wan2.1-i2v"), folder, tmp_path / "cache"), tmp_path / "cache")


@pytest.fixture(scope="module")
def wan_data(tiny_loaded, tmp_path_factory):
    root = tmp_path_factory.mktemp("bad-train")
    return prepare_tiny(tiny_loaded("wan2.1-t2v"), make_dataset(root / "data", clips=1), root / "cache")


@pytest.mark.parametrize("settings, match", [
    (dict(rank=32), r"rank=32 is larger than layer blocks\.0\.attn1\.to_q allows \(\[out, in\] = \[24, 24\]\); use rank <= 24"),
    (dict(target_modules="to_nothing"), "matches no linear layer.*attn1.to_q"),
    (dict(expert="high_noise"), "needs a two-expert model"),
])
def test_training_settings_the_model_cannot_take(tiny_loaded, wan_data, tmp_path, settings, match):
    loras = tmp_path / "loras"
    outputs = TrainOutputs(loras / "x.safetensors", tmp_path / "checkpoints" / "x")
    refused(match, lambda: train_lora(tiny_loaded("wan2.1-t2v"), wan_data, MemoryStrategy(), TrainSettings(steps=2, **settings),
                                      outputs, CpuBackend()), loras, tmp_path / "checkpoints")


@pytest.mark.parametrize("settings, match", [
    (dict(rank=0), "rank=0 must be a whole number of at least 1"), (dict(learning_rate=float("nan")), "learning_rate"),
    (dict(optimizer="sgd"), "optimizer='sgd' is not one of"), (dict(steps=2.5), "steps=2.5"), (dict(target_modules=" , "), "empty"),
])
def test_invalid_settings(settings, match):
    with pytest.raises(TrainingError, match=match):
        TrainSettings(**settings)


def test_two_expert_model_needs_an_expert(tiny_loaded, tmp_path):
    data = prepare_tiny(tiny_loaded("wan2.2-a14b"), make_dataset(tmp_path / "data", clips=1), tmp_path / "cache")
    refused("high_noise' or 'low_noise", lambda: train_lora(tiny_loaded("wan2.2-a14b"), data, MemoryStrategy(), TrainSettings(steps=1),
            TrainOutputs(tmp_path / "loras" / "x.safetensors", tmp_path / "ck"), CpuBackend()), tmp_path / "loras")


def test_data_of_another_family_is_refused(tiny_loaded, wan_data, tmp_path):
    refused("prepared for wan", lambda: train_lora(tiny_loaded("cogvideox-t2v"), wan_data, MemoryStrategy(), TrainSettings(steps=1),
            TrainOutputs(tmp_path / "loras" / "x.safetensors", tmp_path / "ck"), CpuBackend()), tmp_path / "loras")


@pytest.mark.parametrize("name", ["../escape", "sub/dir", ".hidden", ""])
def test_lora_name_must_be_a_plain_file_name(name):
    from vidmem.training.save import lora_file_name

    with pytest.raises(TrainingError, match="plain file name"):
        lora_file_name(name)


def test_an_output_folder_that_cannot_be_written_is_refused_before_training(tiny_loaded, wan_data, tmp_path):
    """A file where the LoRA's or the checkpoint's folder must be: refused by name before any step
    (it used to train every step and then fail with a raw OSError), and the folders the check made
    are gone again."""
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where a folder is needed")
    loras, checkpoints = tmp_path / "loras" / "deeper", tmp_path / "checkpoints"
    cases = [(TrainOutputs(blocker / "x.safetensors", checkpoints / "x"), r"LoRA's folder .*not-a-folder cannot be written"),
             (TrainOutputs(blocker / "sub" / "x.safetensors", checkpoints / "x"), r"LoRA's folder .*not-a-folder.sub cannot"),
             (TrainOutputs(loras / "x.safetensors", blocker / "x"), r"folder of checkpoint x .*not-a-folder cannot be written"),
             (TrainOutputs(loras / "x.safetensors", blocker), r"checkpoint folder .*not-a-folder is a file, not a folder")]
    done = []
    for outputs, match in cases:
        refused(match, lambda: train_lora(tiny_loaded("wan2.1-t2v"), wan_data, MemoryStrategy(), TrainSettings(steps=2), outputs,
                                          CpuBackend(), progress=lambda step, total, loss: done.append(step)),
                tmp_path / "loras", checkpoints)
    assert done == [], "steps ran before the refusal"
    assert blocker.read_text() == "a file where a folder is needed"
