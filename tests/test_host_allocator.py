"""The host path plans for the allocator backend the process runs (torch.cuda.get_allocator_backend,
faked): ComfyUI sets cudaMallocAsync on recent NVIDIA drivers, where the footprint is the live bytes
rather than PyTorch's cached segments. Every plan a node makes for a loaded pipeline (the Sampler's
`auto`, the OOM ladder's check, make_room's prediction, the decode's rung check) goes through
`plan_options`, and the live plan route through `_model_and_options`: none may pin the allocator."""

from __future__ import annotations

import pytest
import torch

from cuda_fake import FakeCuda
from test_tiers import request_for
from vidmem.memory import MemoryStrategy
from vidmem.memory.plan.costs import CUDA_CONTEXT_BYTES
from vidmem.memory.plan.types import Allocator, PlanOptions, VideoShape
from vidmem.nodes import plan_route
from vidmem.pipelines import room
from vidmem.pipelines.planning import plan_options, plan_strategy


def denoise_phases(loaded, shape):
    return plan_strategy(loaded, shape, MemoryStrategy(offload="model"), None, None).stage("denoise").phases


@pytest.fixture
def shape():
    request = request_for("wan2.1-t2v")
    return VideoShape(request.width, request.height, request.frames)


def test_every_plan_for_a_loaded_pipeline_follows_the_processs_allocator(tiny_loaded, shape):
    loaded = tiny_loaded("wan2.1-t2v")
    assert plan_options(loaded).allocator is Allocator.AUTO
    assert plan_options(loaded, PlanOptions(steps=3)).allocator is Allocator.AUTO


@pytest.mark.parametrize("backend, footprint", [("native", "reserved"), ("cudaMallocAsync", "allocated")])
def test_the_samplers_plan_counts_what_the_probed_allocator_holds(tiny_loaded, shape, monkeypatch, backend, footprint):
    loaded = tiny_loaded("wan2.1-t2v")
    fake = FakeCuda(allocator=backend).install(monkeypatch)
    phases = denoise_phases(loaded, shape)
    assert ("get_allocator_backend",) in fake.log
    assert any(p.peak.reserved > p.peak.allocated for p in phases)  # the two backends differ here
    for p in phases:
        assert p.device_bytes == CUDA_CONTEXT_BYTES + getattr(p.peak, footprint)


def test_make_rooms_prediction_is_smaller_under_cudamallocasync(tiny_loaded, shape, monkeypatch):
    loaded = tiny_loaded("wan2.1-t2v")
    asked = {}
    for backend in ("native", "cudaMallocAsync"):
        with monkeypatch.context() as patch:
            FakeCuda(allocator=backend).install(patch)
            asked[backend] = room.sample_room(loaded, MemoryStrategy(offload="model"), shape, 2, True, 0,
                                              torch.device("cuda", 0)).activation_bytes
    assert 0 < asked["cudaMallocAsync"] < asked["native"]


def test_the_live_plan_route_follows_the_processs_allocator():
    request = plan_route.PlanRequest("m", "bf16", VideoShape(64, 64, 5), (), 8.0, 32.0)
    _model, options = plan_route._model_and_options(request, lambda name, dtype: None)
    assert options.allocator is Allocator.AUTO
