"""Train LoRA as ComfyUI runs it: every node (the loader's too) under torch.inference_mode().

Weights loaded under inference mode are inference tensors, which autograd refuses (the loss had
no gradient). The trainer turns inference mode off for the run and points the denoiser's
inference tensors at normal aliases of the same storage; the result equals a run outside
inference mode bit for bit, and the pipeline keeps its own tensors afterwards.
"""

from __future__ import annotations

import pytest
import safetensors.torch
import torch

from backends import StrictBackend
from test_train_support import make_dataset, prepare_tiny
from vidmem.memory import MemoryStrategy
from vidmem.memory.device import CpuBackend
from vidmem.pipelines.loader import load_pipeline
from vidmem.training import TrainOutputs, TrainSettings, train_lora


def run(loaded, data, strategy, backend, tmp_path, name):
    settings = TrainSettings(rank=4, alpha=4.0, learning_rate=1e-2, steps=2, batch_size=1, seed=3)
    outputs = TrainOutputs(tmp_path / "loras" / f"{name}.safetensors", tmp_path / "checkpoints" / name)
    result = train_lora(loaded, data, strategy, settings, outputs, backend)
    return safetensors.torch.load_file(str(result.lora_path))


@pytest.mark.parametrize("variant", ["wan2.1-t2v", "cogvideox-t2v"])
def test_training_a_pipeline_loaded_under_inference_mode(tiny_folder, tmp_path, variant):
    with torch.inference_mode():
        loaded = load_pipeline(tiny_folder(variant), "fp32")
        data = prepare_tiny(loaded, make_dataset(tmp_path / "clips", clips=2), tmp_path / "cache")
    transformer = loaded.pipe.transformer
    assert all(p.is_inference() for p in transformer.parameters())
    before = {name: (p, p.data_ptr()) for name, p in transformer.named_parameters()}
    reference = run(load_pipeline(tiny_folder(variant), "fp32"), data, MemoryStrategy(offload="none"), CpuBackend(),
                    tmp_path, "reference")
    for strategy, backend in ((MemoryStrategy(offload="model"), CpuBackend()),
                              (MemoryStrategy(offload="block_swap", blocks_to_swap=1), StrictBackend())):
        with torch.inference_mode():
            weights = run(loaded, data, strategy, backend, tmp_path, strategy.offload.value)
        assert all(torch.equal(weights[k], reference[k]) for k in reference), strategy.offload.value
    after = dict(transformer.named_parameters())
    assert all(after[name] is p and p.data_ptr() == ptr and p.is_inference() for name, (p, ptr) in before.items())


def test_a_buffer_gets_the_same_normal_alias_run_after_run():
    """Load LoRA's matrices are inference buffers: the trainer's normal alias of one is the same object in every
    run (the host pool knows a source by identity: a new alias each run took a new pinned home each run), and
    a new one once the buffer's bytes changed."""
    from vidmem.training.inference import normal_tensors

    with torch.inference_mode():
        layer = torch.nn.Linear(4, 4)
        layer.register_buffer("lora_down", torch.randn(2, 4))
    seen = []
    for _ in range(2):
        with normal_tensors(layer):
            seen.append(layer._buffers["lora_down"])
    assert seen[0] is seen[1] and not seen[0].is_inference()
    with torch.inference_mode():
        layer._buffers["lora_down"].data = torch.randn(2, 4)  # other bytes
    with normal_tensors(layer):
        assert layer._buffers["lora_down"] is not seen[0]
