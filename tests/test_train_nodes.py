"""Prepare Training Data and Train LoRA as ComfyUI runs them (host folders redirected to tmp)."""

from __future__ import annotations

import pytest

from test_train_support import make_dataset
from vidmem.memory import MemoryStrategy
from vidmem.nodes import host
from vidmem.nodes.strategy import StrategyChoice
from vidmem.nodes.train import VidMemPrepareTrainingData, VidMemTrainLoRA
from vidmem.training import TrainingError

TRAIN = dict(lora_name="corgi", rank=4, alpha=4.0, learning_rate=1e-3, steps=2, batch_size=1, seed=0,
             target_modules="to_q,to_v", gradient_checkpointing=True, optimizer="adamw", checkpoint_every=0,
             resume=True, expert="both")


@pytest.fixture
def folders(tmp_path, monkeypatch):
    monkeypatch.setattr(host, "loras_folder", lambda: tmp_path / "models" / "loras")
    monkeypatch.setattr(host, "training_folder", lambda: tmp_path / "output" / "vidmem_training")
    return tmp_path


def test_prepare_then_train_then_the_pipeline_carries_the_lora(tiny_loaded, folders, monkeypatch):
    shown = []
    monkeypatch.setattr(host, "progress_text", lambda text, node: shown.append((text, node)))
    loaded = tiny_loaded("wan2.1-t2v")
    data_dir = make_dataset(folders / "clips", clips=2)
    strategy = StrategyChoice(MemoryStrategy(offload="block_swap", blocks_to_swap=1))
    prepared = VidMemPrepareTrainingData().prepare(loaded, strategy, str(data_dir), "32x32", "9")
    data = prepared["result"][0]
    assert "2 encoded" in prepared["ui"]["text"][0] and "unloaded" in prepared["ui"]["text"][0]
    again = VidMemPrepareTrainingData().prepare(loaded, strategy, str(data_dir), "32x32", "9")
    assert "2 reused from the cache" in again["ui"]["text"][0] and "not loaded" in again["ui"]["text"][0]
    out = VidMemTrainLoRA().train(loaded, data, strategy, **TRAIN, unique_id="7")
    assert [node for _, node in shown] == ["7", "7"] and shown[-1][0].startswith("step 2/2, loss ")
    pipeline, name = out["result"]
    assert name == "corgi.safetensors" and (folders / "models" / "loras" / name).is_file()
    assert pipeline.loras[-1].name == name and loaded.loras == ()  # the input pipeline is unchanged
    text = out["ui"]["text"][0]
    assert "LoRA rank 4 on 8 layers" in text and "steps 2" in text and "block_swap" in text
    resumed = VidMemTrainLoRA().train(loaded, data, strategy, **dict(TRAIN, steps=3))
    assert "resumed at step 2" in resumed["ui"]["text"][0]


def test_auto_strategy_trains_with_model_offload_and_says_so(tiny_loaded, folders):
    loaded = tiny_loaded("cogvideox-t2v")
    auto = StrategyChoice(MemoryStrategy(offload="model"), auto=True)
    data = VidMemPrepareTrainingData().prepare(loaded, auto, str(make_dataset(folders / "clips", clips=1)), "32x32", "9")["result"][0]
    out = VidMemTrainLoRA().train(loaded, data, auto, **dict(TRAIN, steps=1))
    assert "offload=auto" in out["ui"]["text"][0] and "offload=model" in out["ui"]["text"][0]


@pytest.mark.parametrize("changes, match", [
    (dict(lora_name="../corgi"), "plain file name"), (dict(rank=100), "rank=100 is larger"),
    (dict(optimizer="adamw_cpu_offload", gradient_checkpointing=False, strategy="sequential"), "needs gradient_checkpointing"),
])
def test_bad_training_inputs_write_nothing(tiny_loaded, folders, changes, match):
    loaded = tiny_loaded("wan2.1-t2v")
    choice = StrategyChoice(MemoryStrategy(offload="model"))
    data = VidMemPrepareTrainingData().prepare(loaded, choice, str(make_dataset(folders / "clips", clips=1)), "32x32", "9")["result"][0]
    tier = changes.pop("strategy", None)
    strategy = StrategyChoice(MemoryStrategy(offload=tier)) if tier else choice
    with pytest.raises(TrainingError, match=match):
        VidMemTrainLoRA().train(loaded, data, strategy, **dict(TRAIN, **changes))
    assert not (folders / "models").exists() and not (folders / "output" / "vidmem_training" / "checkpoints").exists()
