"""Prepare Training Data and Train LoRA as ComfyUI runs them (host folders redirected to tmp)."""

from __future__ import annotations

import json

import pytest
import torch

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
    for ui in (prepared["ui"], out["ui"]):  # the web extension draws these; ComfyUI sends `ui` as JSON
        receipt = ui["vidmem_receipt"][0]
        assert json.loads(json.dumps(receipt)) == receipt
    assert out["ui"]["vidmem_receipt"][0]["lora"].endswith(name) and prepared["ui"]["vidmem_receipt"][0]["clips"] == 2


def auto_data(loaded, folders):
    auto = StrategyChoice(MemoryStrategy(offload="model"), auto=True)
    return VidMemPrepareTrainingData().prepare(loaded, auto, str(make_dataset(folders / "clips", clips=1)), "32x32", "9")["result"][0]


def tiny_plans(loaded, data, vram_bytes: int, ram_bytes: int = 1 << 40):
    """The training planner's plans for TRAIN on this pipeline and data, as auto plans them."""
    from vidmem.pipelines.planning import planner_model
    from vidmem.training.plan import plan_training_step, planned_shape, training_request
    from vidmem.training.settings import TrainSettings

    settings = TrainSettings(**{k: v for k, v in TRAIN.items() if k not in ("lora_name", "resume")})
    request = training_request(settings, MemoryStrategy(offload="model"), None)
    return plan_training_step(planner_model(loaded), "transformer", planned_shape(data, settings), vram_bytes,
                              ram_bytes, request)


@pytest.fixture(scope="module")
def deep_wan(tmp_path_factory):
    """A tiny Wan pipeline saved with 6 transformer blocks: with the tiny model's 2 the planner's
    block swap holds as much as model offload (prefetch + 1 + one in flight), so no budget tells them apart."""
    import copy

    from vidmem.pipelines.loader import load_pipeline
    from vidmem.pipelines.tiny import build_tiny_pipeline

    pipe = build_tiny_pipeline("wan2.1-t2v")
    blocks = pipe.transformer.blocks
    for block in list(blocks) * 2:
        blocks.append(copy.deepcopy(block))
    pipe.transformer.register_to_config(num_layers=len(blocks))
    folder = tmp_path_factory.mktemp("deep-wan") / "wan"
    pipe.save_pretrained(folder, safe_serialization=True)
    return load_pipeline(folder, "fp32")


def test_auto_trains_with_the_training_planners_choice_and_shows_predicted_and_measured(deep_wan, folders):
    """A VRAM budget that the no-offload plan exceeds but a block-swap plan fits: auto must train
    with block swap (it used to train with model offload whatever the budget)."""
    data = auto_data(deep_wan, folders)
    roomy_plans, _ = tiny_plans(deep_wan, data, 1 << 40)
    below_model = {p.tier: p for p in roomy_plans}["model"].peak_vram_bytes - 1
    plans, best = tiny_plans(deep_wan, data, below_model)
    by_tier = {p.tier: p for p in plans}
    assert plans[best].tier == "block_swap"
    budget = (by_tier["block_swap"].peak_vram_bytes + 0.5) / (1 << 30)
    auto = StrategyChoice(MemoryStrategy(offload="model"), auto=True, vram_budget_gb=budget, ram_budget_gb=1024.0)
    out = VidMemTrainLoRA().train(deep_wan, data, auto, **dict(TRAIN, steps=1))
    text = out["ui"]["text"][0]
    expected = MemoryStrategy(offload="block_swap", blocks_to_swap=by_tier["block_swap"].blocks_to_swap).describe().split(",")[0]
    assert f"auto chose {expected}" in text, text
    assert "predicted peak VRAM" in text and "measured peak" in text and "RAM (process RSS)" in text
    ran = out["ui"]["vidmem_receipt"][0]  # the trainer's own record of what it ran, not the plan's words
    assert ran["strategy"].startswith(expected), ran["strategy"]
    # with room for everything, auto trains with no offload (the fastest)
    roomy = StrategyChoice(MemoryStrategy(offload="model"), auto=True, vram_budget_gb=1024.0, ram_budget_gb=1024.0)
    with torch.inference_mode():  # as ComfyUI's executor runs the node: the plan's trace runs a backward
        out = VidMemTrainLoRA().train(deep_wan, data, roomy, **dict(TRAIN, lora_name="roomy", steps=1))
    assert "auto chose offload=none" in out["ui"]["text"][0], out["ui"]["text"][0]


def test_auto_with_nothing_fitting_is_refused_before_anything_is_written(tiny_loaded, folders):
    loaded = tiny_loaded("wan2.1-t2v")
    data = auto_data(loaded, folders)
    tiny = StrategyChoice(MemoryStrategy(offload="model"), auto=True, vram_budget_gb=0.01, ram_budget_gb=1024.0)
    with pytest.raises(TrainingError, match="no strategy fits a training step at 32x32x9"):
        VidMemTrainLoRA().train(loaded, data, tiny, **TRAIN)
    with pytest.raises(TrainingError, match="rank=100 is larger"):  # bad input is named as without auto
        VidMemTrainLoRA().train(loaded, data, tiny, **dict(TRAIN, rank=100))
    assert not (folders / "models" / "loras").exists() or not any((folders / "models" / "loras").iterdir())


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



def test_prepare_and_train_ask_the_host_for_room_before_their_weights_move(tiny_loaded, folders, monkeypatch):
    """ComfyUI's own models (and other pipelines' kept weights, which its memory manager can take back) make way
    before the encoders and the trained denoiser go to the device: Prepare asks for its encoders' weights and the
    sampler's stated margin, Train for the training plan's peak (less the CUDA context) where auto planned it."""
    from vidmem.memory import StageComponents
    from vidmem.memory.offload import device_weight_bytes
    from vidmem.memory.plan.costs import CUDA_CONTEXT_BYTES
    from vidmem.pipelines.room import FALLBACK_MARGIN_BYTES
    from vidmem.training import loop, prepare

    events = []
    monkeypatch.setattr(host, "make_room", lambda nbytes, device: events.append(("room", nbytes)))
    for module in (loop, prepare):
        real = module.apply_strategy
        monkeypatch.setattr(module, "apply_strategy",
                            lambda stage, *args, real=real, **kwargs: events.append(("place", None)) or real(stage, *args, **kwargs))
    loaded = tiny_loaded("wan2.1-t2v")
    data = auto_data(loaded, folders)  # Prepare under offload=model (auto: prepared as model)
    (room, nbytes), (place, _) = events
    encoders = StageComponents({"text_encoder": loaded.pipe.text_encoder, "vae": loaded.pipe.vae})
    on_device = device_weight_bytes(encoders, MemoryStrategy(offload="model"))  # one encoder at a time
    assert (room, place) == ("room", "place") and nbytes == on_device + FALLBACK_MARGIN_BYTES > FALLBACK_MARGIN_BYTES
    events.clear()
    roomy = StrategyChoice(MemoryStrategy(offload="model"), auto=True, vram_budget_gb=1024.0, ram_budget_gb=1024.0)
    out = VidMemTrainLoRA().train(loaded, data, roomy, **dict(TRAIN, lora_name="room", steps=1))
    (room, nbytes), (place, _) = events
    planned = out["ui"]["vidmem_receipt"][0]["training_plan"]["predicted_peak_vram_bytes"]
    assert (room, place) == ("room", "place") and nbytes == planned - CUDA_CONTEXT_BYTES
