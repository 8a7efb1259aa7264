"""Training checkpoints survive a crash between their two renames, and a damaged one is named."""

from __future__ import annotations

import os

import pytest
import torch

from vidmem.training.errors import TrainingError
from vidmem.training.save import read_checkpoint, write_checkpoint


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
    (folder / "state.json").write_text("{}")
    (folder / "optimizer.safetensors").write_bytes(b"\x00" * 5)
    with pytest.raises(TrainingError, match="damaged"):
        read_checkpoint(folder)


def test_no_checkpoint_is_none(tmp_path):
    assert read_checkpoint(tmp_path / "absent") is None
