"""What gradient checkpointing re-runs: every block but the last when the blocks stay resident (the
last block's backward comes right after the forward, so re-running it is pure cost), every block
when they stream (a kept block would hold its streamed weights on the device until its backward).
Either way the LoRA is bit-identical to training without checkpointing."""

from __future__ import annotations

import pytest
import safetensors.torch
import torch

from test_train_support import prepared_per_variant
from vidmem.memory import MemoryStrategy
from vidmem.memory.device import CpuBackend
from vidmem.training import TrainOutputs, TrainSettings, train_lora

STEPS = 2


@pytest.fixture(scope="module")
def prepared(tiny_loaded, tmp_path_factory):
    return prepared_per_variant(tiny_loaded, tmp_path_factory.mktemp("train-ckpt"), clips=2)


def blocks_of(loaded):
    transformer = loaded.pipe.transformer
    return list(getattr(transformer, loaded.spec.blocks_attr))


def counted_train(loaded, data, strategy, tmp_path, name, checkpointing=True):
    """Train, counting each block's forward calls (forward + re-runs); returns (counts, weights)."""
    blocks = blocks_of(loaded)
    counts = [0] * len(blocks)
    hooks = [b.register_forward_pre_hook(lambda m, a, i=i: counts.__setitem__(i, counts[i] + 1)) for i, b in enumerate(blocks)]
    settings = TrainSettings(rank=4, alpha=4.0, learning_rate=1e-2, steps=STEPS, batch_size=1, seed=3,
                             gradient_checkpointing=checkpointing)
    outputs = TrainOutputs(tmp_path / "loras" / f"{name}.safetensors", tmp_path / "checkpoints" / name)
    try:
        result = train_lora(loaded, data, strategy, settings, outputs, CpuBackend())
    finally:
        for hook in hooks:
            hook.remove()
    return counts, safetensors.torch.load_file(str(result.lora_path))


@pytest.mark.parametrize("variant", ["wan2.1-t2v", "cogvideox-t2v"])
def test_resident_blocks_rerun_all_but_the_last_and_train_the_same(tiny_loaded, prepared, tmp_path, variant):
    loaded, data = tiny_loaded(variant), prepared(variant)
    plain_counts, plain = counted_train(loaded, data, MemoryStrategy(offload="none"), tmp_path, "plain", checkpointing=False)
    assert plain_counts == [STEPS] * len(plain_counts)
    for strategy in (MemoryStrategy(offload="none"), MemoryStrategy(offload="model")):
        counts, weights = counted_train(loaded, data, strategy, tmp_path, strategy.offload.value)
        assert counts == [2 * STEPS] * (len(counts) - 1) + [STEPS], strategy.offload.value
        assert all(torch.equal(weights[k], plain[k]) for k in plain)


def test_streamed_blocks_rerun_every_block(tiny_loaded, prepared, tmp_path):
    loaded, data = tiny_loaded("wan2.1-t2v"), prepared("wan2.1-t2v")
    _, plain = counted_train(loaded, data, MemoryStrategy(offload="none"), tmp_path, "plain", checkpointing=False)
    for strategy in (MemoryStrategy(offload="block_swap", blocks_to_swap=1), MemoryStrategy(offload="sequential")):
        counts, weights = counted_train(loaded, data, strategy, tmp_path, strategy.offload.value)
        assert counts == [2 * STEPS] * len(counts), strategy.offload.value
        assert all(torch.equal(weights[k], plain[k]) for k in plain)


def attention_kernels(loaded, data, tmp_path, name, strategy, checkpointing=True) -> int:
    """Attention kernels run (forward and backward re-runs; not their backward) in one training
    step, counted below every other mode: a kept output returned by selective checkpointing's
    replay never reaches the kernel."""
    from torch.utils._python_dispatch import TorchDispatchMode

    kernels = {getattr(torch.ops.aten, n).default for n in ("_scaled_dot_product_flash_attention_for_cpu",
                                                            "_scaled_dot_product_efficient_attention") if hasattr(torch.ops.aten, n)}
    calls = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in kernels:
                calls.append(func)
            return func(*args, **(kwargs or {}))

    settings = TrainSettings(rank=4, alpha=4.0, learning_rate=1e-2, steps=1, batch_size=1, seed=3,
                             gradient_checkpointing=checkpointing)
    outputs = TrainOutputs(tmp_path / "loras" / f"{name}.safetensors", tmp_path / "checkpoints" / name)
    with Count():
        train_lora(loaded, data, strategy, settings, outputs, CpuBackend())
    return len(calls)


def test_the_rerun_skips_self_attention_but_not_cross_attention(tiny_loaded, prepared, tmp_path):
    """Wan's block: self-attention over the video tokens (kept) and cross-attention over the text
    (re-run). Two blocks, the last not re-run: plain 4 kernels, checkpointed 4 + block 0's cross-attention."""
    loaded, data = tiny_loaded("wan2.1-t2v"), prepared("wan2.1-t2v")
    none = MemoryStrategy(offload="none")
    plain = attention_kernels(loaded, data, tmp_path, "plain", none, checkpointing=False)
    assert plain == 2 * len(blocks_of(loaded))
    assert attention_kernels(loaded, data, tmp_path, "ckpt", none) == plain + 1
    # streamed: every block re-runs in full (selective replay cannot follow weights moved in the re-run)
    swap = MemoryStrategy(offload="block_swap", blocks_to_swap=1)
    assert attention_kernels(loaded, data, tmp_path, "swap", swap) == 2 * plain
