"""Block swap and sequential offload during training: blocks stream in for the forward and again, in
reverse order, for the backward, and the backward prefetches too: the block it needs next (the
previous one in forward order) is copied on the side stream while the current one re-runs.

Checked on the CPU with the recording CUDA fake (tests/cuda_fake.py): the engine's CudaBackend
copies on the fake's side stream; a forward pre-hook on every block, registered before the
strategy's, writes ("run", block) into the same log, so the log says which copy came before which
re-run. The trained LoRA equals the one trained without any offload, bit for bit.
"""

from __future__ import annotations

import copy

import pytest
import safetensors.torch
import torch

from backends import StrictBackend
from cuda_fake import FakeCuda
from test_train_support import make_dataset, prepare_tiny
from vidmem.memory import MemoryStrategy
from vidmem.memory.device import CpuBackend, CudaBackend
from vidmem.pipelines.loader import load_pipeline
from vidmem.training import TrainOutputs, TrainSettings, train_lora

BLOCKS = 4
STEPS = 2


@pytest.fixture(scope="module")
def deep(tiny_folder, tmp_path_factory):
    """A tiny Wan pipeline of its own with 4 transformer blocks (the tiny model has 2: too few to
    tell the backward's order from the forward's), and data prepared with it."""
    loaded = load_pipeline(tiny_folder("wan2.1-t2v"), "fp32")
    blocks = loaded.pipe.transformer.blocks
    torch.manual_seed(5)
    for block in list(blocks):
        extra = copy.deepcopy(block)
        with torch.no_grad():
            for p in extra.parameters():
                p.add_(torch.randn_like(p) * 0.01)
        blocks.append(extra)
    assert len(blocks) == BLOCKS
    root = tmp_path_factory.mktemp("backward-prefetch")
    data = prepare_tiny(loaded, make_dataset(root / "data", clips=2), root / "cache")
    return loaded, data


def train(loaded, data, strategy, backend, tmp_path, name, observer=None):
    settings = TrainSettings(rank=4, alpha=4.0, learning_rate=1e-2, steps=STEPS, batch_size=1, seed=3)
    outputs = TrainOutputs(tmp_path / "loras" / f"{name}.safetensors", tmp_path / "checkpoints" / name)
    result = train_lora(loaded, data, strategy, settings, outputs, backend, observer=observer)
    return safetensors.torch.load_file(str(result.lora_path))


def logging_runs(blocks, log: list):
    """Pre-hooks that log every block's forward (and re-run); registered before the strategy's, so
    they run first."""
    return [block.register_forward_pre_hook(lambda m, args, i=i: log.append(("run", f"transformer.blocks.{i}")))
            for i, block in enumerate(blocks)]


def backward_runs(log: list) -> list[list[tuple[int, str]]]:
    """Per step, the (log index, block) of the backward's re-runs: runs after the forward's BLOCKS."""
    runs = [(i, e[1]) for i, e in enumerate(log) if e[0] == "run"]
    per_step = [runs[k:k + 2 * BLOCKS] for k in range(0, len(runs), 2 * BLOCKS)]
    return [step[BLOCKS:] for step in per_step]


def copies_of(log: list, block: str, start: int, end: int) -> list[str]:
    """Observer events for `block` between two log indices (onload = on demand, prefetch = ahead)."""
    return [e[0] for e in log[start:end] if e[0] in ("onload", "prefetch") and e[1] == block]


@pytest.mark.parametrize("prefetch", [1, 2])
def test_block_swap_backward_prefetches_the_previous_block_on_the_side_stream(deep, tmp_path, monkeypatch, prefetch):
    loaded, data = deep
    reference = train(loaded, data, MemoryStrategy(offload="none"), CpuBackend(), tmp_path, "ref")
    strategy = MemoryStrategy(offload="block_swap", blocks_to_swap=BLOCKS, prefetch_blocks=prefetch)
    with monkeypatch.context() as patch:
        fake = FakeCuda().install(patch)
        hooks = logging_runs(loaded.pipe.transformer.blocks, fake.log)
        try:
            weights = train(loaded, data, strategy, CudaBackend(torch.device("cpu")), tmp_path, "swap", fake.observe)
        finally:
            for hook in hooks:
                hook.remove()
    for key in reference:
        assert torch.equal(weights[key], reference[key]), key
    log = fake.log
    for step in backward_runs(log):
        assert [block for _, block in step] == [f"transformer.blocks.{i}" for i in reversed(range(BLOCKS))]
        forward_end = max(i for i, e in enumerate(log[:step[0][0]]) if e[0] == "run")
        for position, (at, block) in enumerate(step):
            # copied once since the forward ended, ahead of its re-run, never on demand
            assert copies_of(log, block, forward_end, at) == ["prefetch"], (block, log[forward_end:at + 1])
            assert "onload" not in copies_of(log, block, at, at + 3), block
            if position >= prefetch:  # the copy ran while an earlier re-run (a later block) computed
                assert copies_of(log, block, step[position - prefetch][0], at) == ["prefetch"], block
    sides = {e[1] for e in log if e[0] == "copy"}
    assert "side" in sides


def test_block_swap_backward_prefetch_keeps_the_device_bound(deep, tmp_path):
    """Poisoned eviction (a read of a block not brought back gives NaN) and at most prefetch + 1
    streamed blocks resident at once, for every prefetch depth and swapped count."""
    from backends import Recorder

    loaded, data = deep
    reference = train(loaded, data, MemoryStrategy(offload="none"), CpuBackend(), tmp_path, "ref")
    for swapped in (1, 3, BLOCKS):
        for prefetch in (0, 1, 2):
            recorder = Recorder()
            strategy = MemoryStrategy(offload="block_swap", blocks_to_swap=swapped, prefetch_blocks=prefetch)
            weights = train(loaded, data, strategy, StrictBackend(), tmp_path, f"s{swapped}{prefetch}", recorder)
            assert all(torch.equal(weights[k], reference[k]) for k in reference), (swapped, prefetch)
            assert 0 < recorder.peak_streamed <= prefetch + 1, (swapped, prefetch)


def test_sequential_learns_the_backward_order_and_prefetches_along_it(deep, tmp_path, monkeypatch):
    """Sequential streams leaf layers: the backward re-runs each block's layers, blocks in reverse;
    that order is learned on the first backward, and from the second step on no layer the
    backward re-runs waits for an on-demand copy."""
    loaded, data = deep
    reference = train(loaded, data, MemoryStrategy(offload="none"), CpuBackend(), tmp_path, "ref")
    with monkeypatch.context() as patch:
        fake = FakeCuda().install(patch)
        hooks = logging_runs(loaded.pipe.transformer.blocks, fake.log)
        try:
            weights = train(loaded, data, MemoryStrategy(offload="sequential", prefetch_blocks=1),
                            CudaBackend(torch.device("cpu")), tmp_path, "seq", fake.observe)
        finally:
            for hook in hooks:
                hook.remove()
    for key in reference:
        assert torch.equal(weights[key], reference[key]), key
    last = backward_runs(fake.log)[-1]
    inside = [e for e in fake.log[last[0][0]:] if e[0] in ("onload", "prefetch") and ".blocks." in e[1]]
    assert inside and all(kind == "prefetch" for kind, _ in inside), inside
