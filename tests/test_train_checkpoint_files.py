"""Training checkpoints survive a crash between their two renames, a damaged one is named (when it is
read and when resume loads it, with nothing applied), and resume refuses one past the steps asked."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import safetensors
import safetensors.torch
import torch

from test_train_support import make_dataset, prepare_tiny
from vidmem.memory import MemoryStrategy
from vidmem.memory.device import CpuBackend
from vidmem.training import TrainOutputs, TrainSettings, train_lora
from vidmem.training.errors import TrainingError
from vidmem.training.save import CHECKPOINT_FILES, read_checkpoint, write_checkpoint


def checkpoint(folder, step):
    return write_checkpoint(folder, {"a.lora_A.weight": torch.ones(2, 2)}, {}, {"m": torch.full((2,), float(step))},
                            "{}", {"step": step})


def test_a_crash_between_the_renames_keeps_the_previous_checkpoint(tmp_path):
    folder = checkpoint(tmp_path / "run", 3)
    os.replace(folder, folder.with_name(".run.old"))  # where write_checkpoint leaves it before its second rename
    found = read_checkpoint(folder)
    assert found is not None and found[3] == {"step": 3} and torch.equal(found[1]["m"], torch.full((2,), 3.0))


def test_a_damaged_checkpoint_is_named_not_raised_raw(tmp_path):
    folder = checkpoint(tmp_path / "run", 5)
    (folder / "state.json").write_text("{not json")
    with pytest.raises(TrainingError, match="checkpoint in .*run is damaged"):
        read_checkpoint(folder)
    (folder / "state.json").write_text("[]")  # JSON, but not the object resume reads
    with pytest.raises(TrainingError, match="damaged"):
        read_checkpoint(folder)
    (folder / "state.json").write_text("{}")
    (folder / "optimizer.safetensors").write_bytes(b"\x00" * 5)
    with pytest.raises(TrainingError, match="damaged"):
        read_checkpoint(folder)


def test_no_checkpoint_is_none(tmp_path):
    assert read_checkpoint(tmp_path / "absent") is None


STEPS_DONE = 2


def settings(steps):
    return TrainSettings(rank=4, alpha=4.0, learning_rate=1e-2, steps=steps, batch_size=1, seed=3)


@pytest.fixture(scope="module")
def trained(tiny_loaded, tmp_path_factory):
    """(loaded, data, a LoRA and a checkpoint of a 2-step run), made once; tests damage copies."""
    root = tmp_path_factory.mktemp("checkpoint-files")
    loaded = tiny_loaded("wan2.1-t2v")
    data = prepare_tiny(loaded, make_dataset(root / "data", clips=1), root / "cache")
    outputs = TrainOutputs(root / "lora.safetensors", root / "checkpoint")
    train_lora(loaded, data, MemoryStrategy(offload="none"), settings(STEPS_DONE), outputs, CpuBackend())
    return loaded, data, outputs


def cut_lora_file(folder):
    path = folder / "lora.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def optimizer_json_not_json(folder):
    path = folder / "optimizer.safetensors"
    with safetensors.safe_open(str(path), "pt") as opened:
        tensors = {key: opened.get_tensor(key) for key in opened.keys()}
    safetensors.torch.save_file(tensors, str(path), metadata={"optimizer": '{"state": {"dict": [[0, {'})


def optimizer_group_one_short(folder):
    """Valid JSON whose parameter group lacks one weight: only the optimizer's own load sees it."""
    path = folder / "optimizer.safetensors"
    with safetensors.safe_open(str(path), "pt") as opened:
        tensors = {key: opened.get_tensor(key) for key in opened.keys()}
        meta = json.loads(opened.metadata()["optimizer"])
    groups = dict(meta["dict"])["param_groups"]
    params = dict(groups[0]["dict"])["params"]
    params.pop()  # the list inside `meta`, so this edits it
    safetensors.torch.save_file(tensors, str(path), metadata={"optimizer": json.dumps(meta)})


def state_without_step(folder):
    path = folder / "state.json"
    state = json.loads(path.read_text())
    del state["step"]
    path.write_text(json.dumps(state))


def model_as_found(model):
    return ({name: (p.data_ptr(), p.requires_grad, p.detach().clone()) for name, p in model.named_parameters()},
            sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()), len(list(model.modules())))


def assert_same_model(model, found):
    parameters, hooks, modules = model_as_found(model)
    assert parameters.keys() == found[0].keys()
    for name, (pointer, grad, value) in parameters.items():
        assert (pointer, grad) == found[0][name][:2] and torch.equal(value, found[0][name][2]), name
    assert (hooks, modules) == found[1:]


@pytest.mark.parametrize("damage, raised", [
    (cut_lora_file, "SafetensorError"), (optimizer_json_not_json, "JSONDecodeError"),
    (optimizer_group_one_short, "ValueError: loaded state dict contains a parameter group"), (state_without_step, "KeyError")])
def test_a_checkpoint_damaged_inside_its_files_is_named_on_resume_and_nothing_is_applied(trained, tmp_path, damage, raised):
    loaded, data, made = trained
    folder = shutil.copytree(made.checkpoint_folder, tmp_path / "checkpoint")
    damage(folder)
    files = {name: (folder / name).read_bytes() for name in CHECKPOINT_FILES}
    found = model_as_found(loaded.pipe.transformer)
    outputs = TrainOutputs(tmp_path / "lora.safetensors", folder)
    with pytest.raises(TrainingError, match=rf"checkpoint in .*checkpoint is damaged \({raised}.*delete that folder"):
        train_lora(loaded, data, MemoryStrategy(offload="none"), settings(STEPS_DONE + 1), outputs, CpuBackend(), resume=True)
    assert {name: (folder / name).read_bytes() for name in CHECKPOINT_FILES} == files  # not replaced
    assert not outputs.lora_path.exists()
    assert_same_model(loaded.pipe.transformer, found)


def test_resume_refuses_a_checkpoint_past_the_steps_asked(trained, tmp_path):
    """It used to run nothing and write the longer-trained LoRA as if it had `steps` steps."""
    loaded, data, made = trained
    folder = shutil.copytree(made.checkpoint_folder, tmp_path / "checkpoint")
    outputs = TrainOutputs(tmp_path / "lora.safetensors", folder)
    with pytest.raises(TrainingError, match=rf"checkpoint {re.escape(str(folder))} is at step {STEPS_DONE} and steps is 1: set steps to "
                                            rf"{STEPS_DONE} or more .* resume to false"):
        train_lora(loaded, data, MemoryStrategy(offload="none"), settings(1), outputs, CpuBackend(), resume=True)
    assert not outputs.lora_path.exists()
    # the same steps: nothing left to train, the checkpoint's LoRA is written again
    result = train_lora(loaded, data, MemoryStrategy(offload="none"), settings(STEPS_DONE), outputs, CpuBackend(), resume=True)
    assert result.receipt["start_step"] == STEPS_DONE and len(result.losses) == STEPS_DONE
    again, first = safetensors.torch.load_file(str(result.lora_path)), safetensors.torch.load_file(str(made.lora_path))
    assert again.keys() == first.keys() and all(torch.equal(again[key], first[key]) for key in first)
