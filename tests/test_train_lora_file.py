"""The trained LoRA as a file: read by the pack's LoRA loader, it lowers the loss and changes the
frames; at strength 0 it is the base model exactly; a file the trainer did not write is never replaced."""

from __future__ import annotations

import json

import pytest
import safetensors
import torch

from test_train_support import make_dataset, prepare_tiny
from vidmem.memory import MemoryStrategy
from vidmem.memory.device import CpuBackend
from vidmem.memory.lora import apply_loras
from vidmem.pipelines.lora import load_lora, lora_patches
from vidmem.pipelines.tiny import tiny_call_kwargs
from vidmem.training import TrainingError, TrainOutputs, TrainSettings, train_lora
from vidmem.training.batches import BatchOrder, step_generator
from vidmem.training.objective import objective_for


@pytest.fixture(scope="module")
def trained(tiny_loaded, tmp_path_factory):
    """variant -> (prepared data, TrainResult) after 40 steps on one clip (a fixed batch)."""
    root = tmp_path_factory.mktemp("train-file")
    data_dir = make_dataset(root / "data", clips=1)
    cache = {}

    def get(variant):
        if variant not in cache:
            loaded = tiny_loaded(variant)
            data = prepare_tiny(loaded, data_dir, root / "cache")
            settings = TrainSettings(rank=4, alpha=2.0, learning_rate=2e-2, steps=40, seed=1)
            outputs = TrainOutputs(root / "loras" / f"{variant}.safetensors", root / "checkpoints" / variant)
            cache[variant] = (data, train_lora(loaded, data, MemoryStrategy(offload="model"), settings, outputs, CpuBackend()))
        return cache[variant]

    return get


def fixed_loss(loaded, data, patches, seeds=range(8)) -> float:
    """The family's loss on the one clip at fixed noise draws, with `patches` applied as at sampling."""
    model = loaded.pipe.transformer
    objective = objective_for(loaded, "transformer")
    batch = BatchOrder(data, 1, 0).batch(0)
    with torch.no_grad(), apply_loras(patches):
        return sum(float(objective.loss(model, batch, step_generator(99, s), torch.device("cpu"))) for s in seeds) / len(seeds)


@pytest.mark.parametrize("variant", ["wan2.1-t2v", "cogvideox-t2v"])
def test_saved_lora_loads_and_lowers_the_loss(tiny_loaded, trained, variant):
    loaded = tiny_loaded(variant)
    data, result = trained(variant)
    spec = load_lora(result.lora_path, loaded.pipe, strength=1.0)
    assert spec.naming and not spec.skipped
    assert len(spec.layers["transformer"]) == result.receipt["layers"]
    base = fixed_loss(loaded, data, [])
    assert fixed_loss(loaded, data, lora_patches(loaded.pipe, [spec])) < 0.9 * base


def test_file_carries_alpha_and_rank_for_the_loader(trained):
    _, result = trained("wan2.1-t2v")
    with safetensors.safe_open(str(result.lora_path), "pt") as opened:
        adapter = json.loads(opened.metadata()["lora_adapter_metadata"])
        keys = list(opened.keys())
    # diffusers' prefixed form; alpha / rank folded into lora_B, so alpha is the rank (training/save.py)
    assert adapter["transformer.r"] == 4 and adapter["transformer.lora_alpha"] == 4
    assert all(k.startswith("diffusion_model.blocks.") and k.endswith((".lora_A.weight", ".lora_B.weight")) for k in keys)


@pytest.mark.parametrize("variant", ["wan2.1-t2v", "cogvideox-t2v"])
def test_lora_changes_the_frames_and_strength_zero_is_the_base(tiny_loaded, trained, variant):
    loaded = tiny_loaded(variant)
    _, result = trained(variant)

    def frames(strength):
        patches = lora_patches(loaded.pipe, [load_lora(result.lora_path, loaded.pipe, strength)]) if strength is not None else []
        with apply_loras(patches):
            return loaded.pipe(**tiny_call_kwargs(variant, seed=5)).frames

    base = frames(None)
    assert torch.equal(frames(0.0), base)
    assert not torch.allclose(frames(1.0), base, atol=1e-4)


def test_a_lora_the_trainer_did_not_write_is_never_replaced(tiny_loaded, trained, tmp_path):
    data, _ = trained("wan2.1-t2v")
    downloaded = tmp_path / "style.safetensors"
    safetensors.torch.save_file({"x": torch.zeros(1)}, str(downloaded))
    before = downloaded.read_bytes()
    with pytest.raises(TrainingError, match="not written by vidmem"):
        train_lora(tiny_loaded("wan2.1-t2v"), data, MemoryStrategy(offload="none"), TrainSettings(steps=1),
                   TrainOutputs(downloaded, tmp_path / "ck"), CpuBackend())
    assert downloaded.read_bytes() == before and not (tmp_path / "ck").exists()


def test_retraining_replaces_its_own_lora(tiny_loaded, trained, tmp_path):
    data, first = trained("wan2.1-t2v")
    target = tmp_path / "mine.safetensors"
    target.write_bytes(first.lora_path.read_bytes())
    train_lora(tiny_loaded("wan2.1-t2v"), data, MemoryStrategy(offload="none"), TrainSettings(rank=4, steps=1),
               TrainOutputs(target, tmp_path / "ck"), CpuBackend())
    assert target.read_bytes() != first.lora_path.read_bytes()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary left


def test_training_applies_the_pipelines_own_loras_and_leaves_them_as_found(tiny_loaded, trained, tmp_path):
    """A pipeline that already carries a LoRA (e.g. a distill LoRA) trains the new one on top of it."""
    from vidmem.pipelines.lora import with_lora

    loaded = tiny_loaded("wan2.1-t2v")
    data, first = trained("wan2.1-t2v")
    carrying = with_lora(loaded, load_lora(first.lora_path, loaded.pipe, 1.0, name="first"))
    settings = TrainSettings(rank=4, alpha=4.0, learning_rate=1e-2, steps=2, seed=4)
    plain = train_lora(loaded, data, MemoryStrategy(offload="none"), settings, TrainOutputs(tmp_path / "a.safetensors", tmp_path / "a"), CpuBackend())
    over = train_lora(carrying, data, MemoryStrategy(offload="sequential"), settings, TrainOutputs(tmp_path / "b.safetensors", tmp_path / "b"), CpuBackend())
    assert over.losses[0] != plain.losses[0] and "first" in over.receipt["trained_over"]
    assert not any(name.startswith("_vidmem_lora") for m in loaded.pipe.transformer.modules() for name in m._buffers)
