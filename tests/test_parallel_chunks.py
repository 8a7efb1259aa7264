"""Activation chunks and context parallelism: a rank's blocks already hold 1/N of the tokens, so the
ranks run unchunked. offload=auto never picks slices for them, an explicit count is refused before
any rank starts (naming both inputs), and a rank that meets one names context parallelism."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest

from fuzz_support import strategy_widgets
from vidmem.memory import MemoryStrategy
from vidmem.memory.plan.parallel import MultiGpu, ParallelError, plan_parallel
from vidmem.memory.plan.planner import PlanOptions, VideoShape
from vidmem.memory.strategy import Parallelism
from vidmem.memory.units import GiB
from vidmem.nodes import NODE_CLASS_MAPPINGS as N
from vidmem.pipelines.activation_chunks import chunk_problem
from vidmem.pipelines.configs import load_model
from vidmem.pipelines.family import ModelError
from vidmem.pipelines.parallel import Ranks, planning, sample_parallel
from vidmem.pipelines.parallel.run import POOL_ATTRIBUTE
from vidmem.pipelines.sample import SampleRequest

BOTH_INPUTS = "activation_chunks=2 with context_parallel=ulysses.*Set activation_chunks to off"


def test_offload_auto_sends_no_chunks_to_the_ranks(monkeypatch):
    """Wan 2.1 14B at 720p in 12 GiB: the one-GPU rows chunk (fewest_chunks over one GPU's whole
    sequence); the rows the Sampler runs the ranks with must not."""
    model = load_model("wan2.1-t2v-14b", "bf16", None)
    monkeypatch.setattr(planning, "sampling_model", lambda loaded: model)  # stands in for a loaded 14B folder
    monkeypatch.setattr(planning, "plan_options", lambda loaded, options=PlanOptions(), device=None:
                        replace(options, device=device))
    (choice,) = N["VidMemMemoryStrategy"]().build(**strategy_widgets(offload="auto", vram_budget_gb=12, ram_budget_gb=512),
                                                  gpus="0,1", context_parallel="ulysses")["result"]
    assert choice.auto and choice.strategy.chunks_auto
    plan = planning.choose_parallel(None, VideoShape(1280, 720, 81, cfg=True), choice.strategy, Ranks(gpus=(0, 1)),
                                    12 * GiB, 512 * GiB)
    assert plan.strategy.activation_chunks == 1


def test_an_explicit_count_is_refused_by_the_sampler_node_before_any_rank_starts(tiny_loaded):
    loaded = tiny_loaded("wan2.1-t2v")
    (choice,) = N["VidMemMemoryStrategy"]().build(**strategy_widgets(offload="none"), gpus="cpu:2",
                                                  context_parallel="ulysses", activation_chunks="2")["result"]
    with pytest.raises(ModelError, match=BOTH_INPUTS):
        N["VidMemVideoSampler"]().sample(loaded, choice, "a cat", "", 32, 32, 9, 2, 1.0, 0)
    assert getattr(loaded.pipe, POOL_ATTRIBUTE, None) is None


def test_an_explicit_count_is_refused_by_sample_parallel_and_the_planner(tiny_loaded):
    loaded = tiny_loaded("wan2.1-t2v")
    chunked = MemoryStrategy(offload="none", activation_chunks=2, parallel=Parallelism(context_parallel="ulysses", degree=2))
    with pytest.raises(ModelError, match=BOTH_INPUTS):
        sample_parallel(loaded, chunked, SampleRequest("a cat", "", 32, 32, 9, steps=2, cfg=1.0), Ranks(cpu_processes=2))
    assert getattr(loaded.pipe, POOL_ATTRIBUTE, None) is None
    with pytest.raises(ParallelError, match=BOTH_INPUTS):
        plan_parallel(load_model("wan2.1-t2v-1.3b"), VideoShape(480, 320, 33), chunked, MultiGpu(2))


def test_a_split_block_is_named_as_split_not_as_wrapped(tiny_loaded):
    """diffusers' context-parallel hooks wrap block 0 as well: the rank's refusal must say why it really is."""
    block = copy.deepcopy(tiny_loaded("wan2.1-t2v").pipe.transformer.blocks[0])
    block.attn1.processor._parallel_config = object()  # what diffusers' enable_parallelism sets
    block.forward = lambda *args, **kwargs: None  # a wrapper, as its split-input hook installs
    assert chunk_problem(block) == "context parallelism splits the tokens across GPUs already"


def test_a_split_hunyuanvideo15_block_is_named_as_split():
    """HunyuanVideo 1.5's joint attention module is `attn`, not `attn1`: its split is seen there, and behind
    vidmem's key-masked wrapper (what the sampler's call puts on every block)."""
    from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15TransformerBlock

    from vidmem.pipelines.hunyuan_video15_attention import KeyMaskedAttention

    block = HunyuanVideo15TransformerBlock(2, 8, mlp_ratio=2.0)
    assert chunk_problem(block) is None
    block.attn.processor = KeyMaskedAttention(block.attn.processor)
    assert chunk_problem(block) is None
    block.attn.processor.exact._parallel_config = object()
    assert chunk_problem(block) == "context parallelism splits the tokens across GPUs already"
    block.attn.processor = block.attn.processor.exact
    assert chunk_problem(block) == "context parallelism splits the tokens across GPUs already"
