"""Train LoRA under a streaming tier on weights loaded under inference mode (ComfyUI's train -> sample
templates), before any sampler run has pinned them.

The trainer runs on normal aliases of the inference weights (training/inference.py); the pool gives
the aliases pinned homes. The streamed blocks must sit in RAM once while training (the pinned home
only, not the pageable original beside it), and the pipeline's own parameters must end in those
homes, so the next sampler run pins nothing new.
"""

from __future__ import annotations

import dataclasses

import torch

from backends import StrictBackend
from test_train_support import make_dataset, prepare_tiny
from vidmem.memory import MemoryStrategy
from vidmem.memory.hostpool import HostPool
from vidmem.memory.offload import StageComponents, apply_strategy
from vidmem.pipelines.loader import load_pipeline
from vidmem.training import TrainOutputs, TrainSettings, train_lora

ARENA = 1 << 16  # small arenas: the tiny blocks fill several, as real blocks fill 1 GiB ones


def outside_arenas(pool: HostPool, tensors) -> int:
    """Bytes of `tensors` held outside the pool's arenas (a tensor with no bytes holds none)."""
    def inside(t):
        return any(a.data_ptr() <= t.data_ptr() < a.data_ptr() + a.numel() for a in pool._arenas)
    return sum(t.untyped_storage().nbytes() for t in tensors if t.untyped_storage().nbytes() and not inside(t))


def test_streamed_weights_are_pinned_once_across_train_and_sample(tiny_folder, tmp_path):
    with torch.inference_mode():  # as ComfyUI's executor runs the loader node
        loaded = load_pipeline(tiny_folder("wan2.1-t2v"), "fp32")
        loaded = dataclasses.replace(loaded, host_pool=HostPool(arena_bytes=ARENA))
        data = prepare_tiny(loaded, make_dataset(tmp_path / "clips", clips=1), tmp_path / "cache")
    pool, transformer = loaded.host_pool, loaded.pipe.transformer
    streamed = list(transformer.blocks.parameters())
    values = [p.clone() for p in streamed]
    strategy = MemoryStrategy(offload="block_swap", blocks_to_swap=len(transformer.blocks))
    backend = StrictBackend(pinning=True)  # hands out arenas, as a CUDA backend pins them
    doubled = []  # per step: streamed bytes still held by the pipeline's own parameters outside the pool

    def progress(done, total, loss):
        doubled.append(outside_arenas(pool, streamed))

    settings = TrainSettings(rank=4, alpha=4.0, learning_rate=1e-2, steps=2, seed=3)
    with torch.inference_mode():
        train_lora(loaded, data, strategy, settings, TrainOutputs(tmp_path / "l.safetensors", tmp_path / "ck"),
                   backend, progress)
    assert doubled == [0, 0], "the streamed weights sat in RAM twice while training (pageable and pinned)"
    after_training = pool.stats()
    assert after_training["allocations"] == len(streamed)
    assert all(p is q for p, q in zip(transformer.blocks.parameters(), streamed))  # the same objects,
    assert all(p.is_inference() for p in streamed)  # inference tensors again,
    assert all(torch.equal(p, v) for p, v in zip(streamed, values))  # the same values,
    assert outside_arenas(pool, streamed) == 0  # now in their pinned homes

    stage = StageComponents({"transformer": transformer}, {"transformer": transformer.blocks})
    with torch.inference_mode(), apply_strategy(stage, strategy, backend, None, pool):  # what a sampler run applies
        pass
    assert pool.stats() == after_training, "the next sampler run pinned the streamed weights a second time"
