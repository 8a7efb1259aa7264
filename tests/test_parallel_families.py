"""Context parallelism runs the Wan family only: every other model is refused by name before any
rank starts, by the runtime, the planner and the Sampler node alike (diffusers 0.42.1 declares a
context-parallel plan for LTX-2 too, whose ranks crashed mid-run)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fuzz_support import strategy_widgets
from vidmem.memory import MemoryStrategy
from vidmem.memory.plan.parallel import ParallelError, check_traceable
from vidmem.memory.plan.stages import VideoShape
from vidmem.memory.strategy import Parallelism
from vidmem.nodes import NODE_CLASS_MAPPINGS as N
from vidmem.pipelines.family import ModelError
from vidmem.pipelines.parallel import Ranks, sample_parallel
from vidmem.pipelines.parallel.planning import choose_parallel, plan_explicit
from vidmem.pipelines.parallel.run import POOL_ATTRIBUTE
from vidmem.pipelines.sample import SampleRequest
from vidmem.pipelines.tiny import tiny_spec

ULYSSES_2 = Parallelism(context_parallel="ulysses", degree=2)
NOT_SPLIT = {"ltx2-t2v": "LTX2Pipeline is not split by vidmem: only the Wan family",
             "hunyuanvideo1.5-t2v": "HunyuanVideo15Pipeline has no context-parallel plan"}


def _shape_of(variant):
    spec = tiny_spec(variant)
    return spec.width, spec.height, spec.frames


@pytest.mark.parametrize("variant", sorted(NOT_SPLIT))
def test_the_runtime_refuses_models_other_than_wan_before_any_rank_starts(tiny_loaded, variant):
    loaded = tiny_loaded(variant)
    width, height, frames = _shape_of(variant)
    with pytest.raises(ModelError, match=f"{NOT_SPLIT[variant]}.*Set context_parallel to off"):
        sample_parallel(loaded, MemoryStrategy(offload="none", parallel=ULYSSES_2),
                        SampleRequest("a cat", "", width, height, frames, steps=2, cfg=1.0), Ranks(cpu_processes=2))
    assert getattr(loaded.pipe, POOL_ATTRIBUTE, None) is None


@pytest.mark.parametrize("variant", sorted(NOT_SPLIT))
def test_the_planner_refuses_them_in_the_same_words(tiny_loaded, variant):
    loaded = tiny_loaded(variant)
    shape = VideoShape(*_shape_of(variant), cfg=True)
    auto = MemoryStrategy(activation_chunks="auto", parallel=ULYSSES_2)
    with pytest.raises(ParallelError, match=f"{NOT_SPLIT[variant]}.*Set context_parallel to off"):
        choose_parallel(loaded, shape, auto, Ranks(cpu_processes=2), 1 << 36, 1 << 38)
    with pytest.raises(ParallelError, match=f"{NOT_SPLIT[variant]}.*Set context_parallel to off"):
        plan_explicit(loaded, shape, MemoryStrategy(offload="none", parallel=ULYSSES_2), Ranks(cpu_processes=2),
                      1 << 36, 1 << 38)


def test_the_sampler_node_shows_the_refusal_not_a_traceback(tiny_loaded):
    loaded = tiny_loaded("ltx2-t2v")
    width, height, frames = _shape_of("ltx2-t2v")
    (choice,) = N["VidMemMemoryStrategy"]().build(**strategy_widgets(offload="none"), gpus="cpu:2",
                                                  context_parallel="ulysses")["result"]
    with pytest.raises(ValueError, match="LTX2Pipeline is not split by vidmem.*Set context_parallel to off"):
        N["VidMemVideoSampler"]().sample(loaded, choice, "a cat", "", width, height, frames, 2, 1.0, 0)
    assert getattr(loaded.pipe, POOL_ATTRIBUTE, None) is None


def test_a_transformer_the_rank_trace_cannot_follow_is_a_parallel_error():
    with torch.device("meta"):
        stranger = nn.Module()
        stranger.transformer_blocks = nn.ModuleList([nn.Linear(2, 2)])
    with pytest.raises(ParallelError, match="Module cannot be planned per rank.*missing: rope, blocks, proj_out"):
        check_traceable(stranger, "ulysses")
