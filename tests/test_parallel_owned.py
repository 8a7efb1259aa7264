"""A context-parallel run hands ComfyUI ordinary tensors: every tensor of rank 0's latent (the video,
LTX-2's audio latents, metadata) is copied out of the shared-memory segments it arrived in, which
ComfyUI's output cache would otherwise keep."""

from __future__ import annotations

import torch

from vidmem.memory import MemoryStrategy
from vidmem.memory.strategy import Parallelism
from vidmem.memory.warm import release_everywhere
from vidmem.pipelines.parallel import Ranks, run
from vidmem.pipelines.sample import SampleRequest, SampleResult


class SharedResultPool:
    """A pool without processes whose run returns a latent in shared memory, as rank 0's arrives."""

    alive = True

    def __init__(self, latent: dict) -> None:
        self.latent, self.config = latent, type("Config", (), {"world_size": 2})()

    def run(self, job, *args):
        return SampleResult(self.latent, {"parallel": {"per_rank_kept_bytes": [0, 0]}})


def tensors_in(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    return [tensor for item in items for tensor in tensors_in(item)]


def test_every_tensor_of_the_latent_leaves_shared_memory(tiny_loaded):
    loaded = tiny_loaded("wan2.1-t2v")
    shared = {"samples": torch.randn(1, 16, 3, 4, 4).share_memory_(),
              "audio_samples": torch.randn(1, 2, 9, 2).share_memory_(),
              "vidmem": {"family": "ltx2", "noise": [torch.ones(2).share_memory_()], "audio": {"normalised": True}}}
    assert len(tensors_in(shared)) == 3 and all(t.is_shared() for t in tensors_in(shared))  # the test can see sharing
    strategy = MemoryStrategy(offload="none", parallel=Parallelism(context_parallel="ulysses", degree=2))
    request = SampleRequest("a cat", "", 32, 32, 9, 1, 5.0, seed=0)
    try:
        result = run.sample_parallel(loaded, strategy, request, Ranks(cpu_processes=2), pool=SharedResultPool(shared))
    finally:
        release_everywhere()
        setattr(loaded.pipe, run.STORES_ATTRIBUTE, None)  # the shared pipeline, left as found
    copies = tensors_in(result.latent)
    assert len(copies) == 3 and not any(t.is_shared() for t in copies)
    assert all(torch.equal(a, b) for a, b in zip(copies, tensors_in(shared)))
    assert result.latent["vidmem"]["family"] == "ltx2" and result.latent["vidmem"]["audio"] == {"normalised": True}
