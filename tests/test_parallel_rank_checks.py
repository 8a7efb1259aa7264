"""A rank (torchrun's above all, which has no coordinator) checks the pipeline it opened before
diffusers splits it: CogVideoX gets vidmem's refusal, not diffusers' "`cp_plan` must be provided"."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vidmem.memory import MemoryStrategy
from vidmem.memory.strategy import Parallelism
from vidmem.pipelines.family import ModelError
from vidmem.pipelines.parallel import PipelineSource
from vidmem.pipelines.parallel import job as job_module
from vidmem.pipelines.parallel.job import ParallelSampleJob
from vidmem.pipelines.sample import SampleRequest


def test_a_rank_refuses_cogvideox_before_splitting_it(tiny_folder, monkeypatch):
    split = []
    monkeypatch.setattr(job_module, "enable_context_parallel", lambda *args: split.append(args))
    job = ParallelSampleJob(PipelineSource(str(tiny_folder("cogvideox-t2v")), "fp32"),
                            MemoryStrategy(offload="none", parallel=Parallelism(context_parallel="ulysses", degree=2)),
                            SampleRequest("a cat", "", 32, 32, 9, 2, 5.0))
    context = SimpleNamespace(state={}, world_size=2, device=torch.device("cpu"))
    with pytest.raises(ModelError, match="CogVideoXPipeline has no context-parallel plan.*context_parallel to off"):
        job._pipeline(context)
    assert not split and "loaded" not in context.state
