"""LoRAs already on the pipeline while training (a distill LoRA): the plan counts them, the receipt
measures them as the sampler does, the checkpoint and the file record them, and resume refuses a
different stack naming both."""

from __future__ import annotations

import json

import pytest
import safetensors

from test_lora import WAN_LAYERS, peft_keys, random_lora, write
from test_train_support import make_dataset, prepare_tiny
from vidmem.memory import MemoryStrategy
from vidmem.memory.device import CpuBackend
from vidmem.memory.units import GiB
from vidmem.pipelines.lora import load_lora, with_lora
from vidmem.training import TrainingError, TrainOutputs, TrainSettings, train_lora
from vidmem.training.plan import applied_lora_bytes, choose_training_strategy

SETTINGS = TrainSettings(rank=4, steps=1)


@pytest.fixture(scope="module")
def setup(tiny_loaded, tmp_path_factory):
    """(plain pipeline, the same carrying a rank-24 LoRA, prepared data, the LoRA's file)."""
    root = tmp_path_factory.mktemp("trained-over")
    loaded = tiny_loaded("wan2.1-t2v")
    data = prepare_tiny(loaded, make_dataset(root / "data", clips=1), root / "cache")
    big = write(root / "distill.safetensors", peft_keys(random_lora(loaded.pipe.transformer, WAN_LAYERS, rank=24), None))
    return loaded, with_lora(loaded, load_lora(big, loaded.pipe, 1.0, name="distill")), data, big


def test_the_plan_counts_the_pipelines_loras(setup):
    loaded, carrying, data, _ = setup
    extra = applied_lora_bytes(carrying, "transformer")
    assert extra == carrying.loras[0].nbytes > 0
    plain = choose_training_strategy(loaded, data, SETTINGS, MemoryStrategy(offload="none"), 64 * GiB, 64 * GiB, can_pin=False)
    over = choose_training_strategy(carrying, data, SETTINGS, MemoryStrategy(offload="none"), 64 * GiB, 64 * GiB, can_pin=False)
    assert over.plan.peak_vram_bytes == plain.plan.peak_vram_bytes + extra
    assert over.receipt({})["pipeline_lora_bytes"] == extra
    # a budget the plain step just fits: with the LoRA that tier no longer does
    tight = plain.plan.peak_vram_bytes
    assert choose_training_strategy(loaded, data, SETTINGS, MemoryStrategy(offload="none"), tight, 64 * GiB,
                                     can_pin=False).plan.tier == plain.plan.tier
    try:
        squeezed = choose_training_strategy(carrying, data, SETTINGS, MemoryStrategy(offload="none"), tight, 64 * GiB,
                                            can_pin=False)
    except TrainingError as error:
        assert "the pipeline's LoRAs take" in str(error)
    else:
        assert (squeezed.plan.tier, squeezed.plan.blocks_to_swap) != (plain.plan.tier, plain.plan.blocks_to_swap)
        assert squeezed.plan.peak_vram_bytes <= tight


def test_the_receipt_measures_the_weights_with_the_loras(setup, tmp_path):
    loaded, carrying, data, _ = setup
    strategy = MemoryStrategy(offload="none")
    over = train_lora(carrying, data, strategy, SETTINGS, TrainOutputs(tmp_path / "a.safetensors", tmp_path / "a"), CpuBackend())
    plain = train_lora(loaded, data, strategy, SETTINGS, TrainOutputs(tmp_path / "b.safetensors", tmp_path / "b"), CpuBackend())
    extra = carrying.loras[0].nbytes
    assert over.receipt["device_weight_bytes"] == plain.receipt["device_weight_bytes"] + extra
    assert over.receipt["lora_bytes"] == extra and plain.receipt["lora_bytes"] == 0


def test_the_stack_is_recorded_and_resume_refuses_another(setup, tmp_path):
    loaded, carrying, data, big = setup
    outputs = TrainOutputs(tmp_path / "o.safetensors", tmp_path / "ck")
    train_lora(carrying, data, MemoryStrategy(offload="none"), SETTINGS, outputs, CpuBackend())
    state = json.loads((tmp_path / "ck" / "state.json").read_text())
    [entry] = state["trained_over"]
    assert (entry["name"], entry["strength"], entry["expert"], entry["size"]) == ("distill", 1.0, "both", big.stat().st_size)
    with safetensors.safe_open(str(outputs.lora_path), "pt") as opened:
        assert json.loads(opened.metadata()["vidmem_training"])["trained_over"] == state["trained_over"]
    more = TrainSettings(rank=4, steps=2)
    with pytest.raises(TrainingError, match=r"trained over \[distill x1 \(both, \d+ bytes, sha256 \w{12}\)\], but this "
                                            r"pipeline carries no LoRA.*set resume to false"):
        train_lora(loaded, data, MemoryStrategy(offload="none"), more, outputs, CpuBackend(), resume=True)
    weaker = with_lora(loaded, load_lora(big, loaded.pipe, 0.5, name="distill"))
    with pytest.raises(TrainingError, match=r"but this pipeline carries \[distill x0.5 "):
        train_lora(weaker, data, MemoryStrategy(offload="none"), more, outputs, CpuBackend(), resume=True)
    resumed = train_lora(carrying, data, MemoryStrategy(offload="none"), more, outputs, CpuBackend(), resume=True)
    assert resumed.receipt["start_step"] == 1


def test_another_file_under_the_same_name_is_another_stack(setup, tmp_path):
    loaded, _, data, _ = setup
    first = write(tmp_path / "d.safetensors", peft_keys(random_lora(loaded.pipe.transformer, WAN_LAYERS, seed=1), None))
    outputs = TrainOutputs(tmp_path / "o.safetensors", tmp_path / "ck")
    train_lora(with_lora(loaded, load_lora(first, loaded.pipe, 1.0)), data, MemoryStrategy(offload="none"), SETTINGS,
               outputs, CpuBackend())
    write(first, peft_keys(random_lora(loaded.pipe.transformer, WAN_LAYERS, seed=2), None))  # same size, other weights
    with pytest.raises(TrainingError, match="was trained over"):
        train_lora(with_lora(loaded, load_lora(first, loaded.pipe, 1.0)), data, MemoryStrategy(offload="none"),
                   TrainSettings(rank=4, steps=2), outputs, CpuBackend(), resume=True)
