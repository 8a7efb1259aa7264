"""The training loop: checkpointing and every offload tier change memory, not results; interrupt and resume."""

from __future__ import annotations

import logging

import safetensors.torch
import pytest
import torch

from backends import Recorder, StrictBackend
from test_train_support import prepared_per_variant
from vidmem.memory import MemoryStrategy
from vidmem.memory.device import CpuBackend
from vidmem.training import TrainingError, TrainOutputs, TrainSettings, train_lora

STEPS = 3
TIERS = [MemoryStrategy(offload="none"), MemoryStrategy(offload="model"),
         MemoryStrategy(offload="block_swap", blocks_to_swap=2), MemoryStrategy(offload="block_swap", blocks_to_swap=1, prefetch_blocks=0),
         MemoryStrategy(offload="sequential")]


@pytest.fixture(scope="module")
def prepared(tiny_loaded, tmp_path_factory):
    return prepared_per_variant(tiny_loaded, tmp_path_factory.mktemp("train-loop"), clips=3)


def train(loaded, data, tmp_path, strategy=MemoryStrategy(offload="none"), backend=None, name="run", **settings):
    options = dict(rank=4, alpha=4.0, learning_rate=1e-2, steps=STEPS, batch_size=2, seed=3)
    options.update(settings)
    outputs = TrainOutputs(tmp_path / "loras" / f"{name}.safetensors", tmp_path / "checkpoints" / name)
    result = train_lora(loaded, data, strategy, TrainSettings(**options), outputs, backend or CpuBackend())
    return result, safetensors.torch.load_file(str(result.lora_path))


def assert_same_weights(a: dict, b: dict):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("variant", ["wan2.1-t2v", "cogvideox-t2v"])
def test_checkpointing_changes_nothing_in_the_weights(tiny_loaded, prepared, tmp_path, variant):
    loaded = tiny_loaded(variant)
    plain, plain_weights = train(loaded, prepared(variant), tmp_path, name="plain", gradient_checkpointing=False)
    checked, checked_weights = train(loaded, prepared(variant), tmp_path, name="ckpt", gradient_checkpointing=True)
    assert plain.losses == checked.losses
    assert_same_weights(plain_weights, checked_weights)
    assert any(t.abs().sum() > 0 for k, t in plain_weights.items() if "lora_B" in k)  # it trained


@pytest.mark.parametrize("strategy", TIERS, ids=lambda s: s.describe().split(" text")[0])
@pytest.mark.parametrize("variant", ["wan2.1-t2v", "cogvideox-t2v"])
def test_every_tier_trains_the_same_weights(tiny_loaded, prepared, tmp_path, strategy, variant):
    """StrictBackend poisons evicted weights: a forward or a backward that reads a block the
    schedule did not bring back in would give NaN (refused as a loss) or other weights.
    (CogVideoX's final LayerNorm, streamed by `sequential` outside the checkpointed blocks,
    saves its weight for the backward.)"""
    loaded = tiny_loaded(variant)
    if strategy.blocks_to_swap > len(loaded.pipe.transformer.transformer_blocks if variant.startswith("cog") else loaded.pipe.transformer.blocks):
        pytest.skip("the tiny model has fewer blocks")
    _, reference = train(loaded, prepared(variant), tmp_path, name="ref", gradient_checkpointing=False)
    recorder = Recorder()
    options = TrainSettings(rank=4, alpha=4.0, learning_rate=1e-2, steps=STEPS, batch_size=2, seed=3)
    outputs = TrainOutputs(tmp_path / "loras" / "tier.safetensors", tmp_path / "checkpoints" / "tier")
    result = train_lora(loaded, prepared(variant), strategy, options, outputs, StrictBackend(), observer=recorder)
    assert_same_weights(reference, safetensors.torch.load_file(str(result.lora_path)))
    if strategy.streams_blocks:
        assert 0 < recorder.peak_streamed <= strategy.prefetch_blocks + 1


def test_block_swap_streams_blocks_again_in_reverse_for_the_backward(tiny_loaded, prepared, tmp_path):
    recorder = Recorder()
    options = TrainSettings(rank=4, alpha=4.0, steps=1, batch_size=2, seed=3)
    outputs = TrainOutputs(tmp_path / "l.safetensors", tmp_path / "c")
    train_lora(tiny_loaded("wan2.1-t2v"), prepared("wan2.1-t2v"), MemoryStrategy(offload="block_swap", blocks_to_swap=2, prefetch_blocks=0),
               options, outputs, StrictBackend(), observer=recorder)
    onloads = [name for kind, name in recorder.events if kind == "onload" and ".blocks." in name]
    assert onloads == ["transformer.blocks.0", "transformer.blocks.1", "transformer.blocks.1", "transformer.blocks.0"]


def test_streamed_tier_without_checkpointing_is_refused(tiny_loaded, prepared, tmp_path):
    with pytest.raises(TrainingError, match="gradient_checkpointing"):
        train(tiny_loaded("wan2.1-t2v"), prepared("wan2.1-t2v"), tmp_path, MemoryStrategy(offload="sequential"),
              gradient_checkpointing=False)
    assert not (tmp_path / "loras").exists()


def test_the_pipeline_is_left_as_found(tiny_loaded, prepared, tmp_path):
    model = tiny_loaded("wan2.1-t2v").pipe.transformer
    before = {n: (p.data_ptr(), p.requires_grad) for n, p in model.named_parameters()}
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    train(tiny_loaded("wan2.1-t2v"), prepared("wan2.1-t2v"), tmp_path, MemoryStrategy(offload="sequential"))
    assert {n: (p.data_ptr(), p.requires_grad) for n, p in model.named_parameters()} == before
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()) == hooks
    assert not model.gradient_checkpointing


class Cancel(Exception):
    pass


def test_interrupt_saves_a_checkpoint_and_resume_ends_at_the_same_weights(tiny_loaded, prepared, tmp_path):
    loaded, data = tiny_loaded("wan2.1-t2v"), prepared("wan2.1-t2v")
    settings = TrainSettings(rank=4, alpha=4.0, learning_rate=1e-2, steps=5, batch_size=1, seed=7, optimizer="adamw")
    straight = train_lora(loaded, data, MemoryStrategy(offload="none"), settings,
                          TrainOutputs(tmp_path / "a.safetensors", tmp_path / "ck_a"), CpuBackend())
    calls = {"n": 0}

    def cancel_in_step_four():  # 2 blocks, checked in the forward and again in the checkpointed backward
        calls["n"] += 1
        if calls["n"] == 3 * 4 + 1:
            raise Cancel()

    outputs = TrainOutputs(tmp_path / "b.safetensors", tmp_path / "ck_b")
    with pytest.raises(Cancel):
        train_lora(loaded, data, MemoryStrategy(offload="block_swap", blocks_to_swap=1), settings, outputs, StrictBackend(),
                   check_interrupt=cancel_in_step_four)
    assert not outputs.lora_path.exists()  # nothing in models/loras until the run ends
    state = (outputs.checkpoint_folder / "state.json").read_text()
    assert '"step": 3' in state
    resumed = train_lora(loaded, data, MemoryStrategy(offload="none"), settings, outputs, CpuBackend(), resume=True)
    assert resumed.receipt["start_step"] == 3
    assert resumed.losses == straight.losses
    assert_same_weights(safetensors.torch.load_file(str(straight.lora_path)), safetensors.torch.load_file(str(resumed.lora_path)))


def test_a_checkpoint_that_cannot_be_saved_does_not_hide_why_the_run_stopped(tiny_loaded, prepared, tmp_path, monkeypatch, caplog):
    """Cancel after a step with the disk full: the Cancel comes out, and a warning names the folder."""
    from vidmem.training import loop

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(loop, "write_checkpoint", full_disk)
    done = []

    def cancel_after_a_step():
        if done:
            raise Cancel()

    outputs = TrainOutputs(tmp_path / "c.safetensors", tmp_path / "ck_c")
    with caplog.at_level(logging.WARNING, logger="vidmem"), pytest.raises(Cancel):
        train_lora(tiny_loaded("wan2.1-t2v"), prepared("wan2.1-t2v"), MemoryStrategy(offload="none"),
                   TrainSettings(rank=4, alpha=4.0, steps=3, batch_size=1, seed=3), outputs, CpuBackend(),
                   progress=lambda step, total, loss: done.append(step), check_interrupt=cancel_after_a_step)
    assert done == [1]
    assert f"could not be saved in {outputs.checkpoint_folder}" in caplog.text and "No space left" in caplog.text
    assert not outputs.lora_path.exists()


def test_periodic_checkpoints_and_resume_refuses_other_settings(tiny_loaded, prepared, tmp_path):
    loaded, data = tiny_loaded("wan2.1-t2v"), prepared("wan2.1-t2v")
    result, _ = train(loaded, data, tmp_path, name="p", checkpoint_every=2)
    assert '"step": 3' in (tmp_path / "checkpoints" / "p" / "state.json").read_text()
    with pytest.raises(TrainingError, match="settings"):
        train_lora(loaded, data, MemoryStrategy(offload="none"), TrainSettings(rank=8, alpha=4.0, steps=4),
                   TrainOutputs(result.lora_path, tmp_path / "checkpoints" / "p"), CpuBackend(), resume=True)


def test_without_torchs_hook_getter_sequential_is_refused_and_block_swap_still_trains(tiny_loaded, prepared, tmp_path, monkeypatch):
    """torch < 2.8 has no getter for the active saved-tensor hooks (training/autograd.py)."""
    from vidmem.training import autograd

    loaded = tiny_loaded("wan2.1-t2v")
    _, reference = train(loaded, prepared("wan2.1-t2v"), tmp_path, name="ref", gradient_checkpointing=False)
    monkeypatch.setattr(autograd, "_TOP_HOOKS", None)
    with pytest.raises(TrainingError, match="needs torch 2.8"):
        train(loaded, prepared("wan2.1-t2v"), tmp_path, MemoryStrategy(offload="sequential"), name="seq")
    _, swapped = train(loaded, prepared("wan2.1-t2v"), tmp_path, MemoryStrategy(offload="block_swap", blocks_to_swap=2),
                       StrictBackend(), name="swap")
    assert_same_weights(reference, swapped)
