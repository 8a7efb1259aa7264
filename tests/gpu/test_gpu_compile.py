"""Compiled blocks on CUDA (inductor, Triton kernels) under none, block_swap and sequential: the eager
latents within inductor's rounding, and a second run that compiles nothing while block swap
re-points weights to fresh device copies every step (CudaBackend: side stream, pinned host copies).

Tolerance: inductor fuses and reorders reductions, and CUDA matmuls may use TF32 in fused kernels;
1e-3 relative and absolute on latents of magnitude ~4 (a skipped hook gives NaN or the wrong weights,
errors of order 1).
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from test_tiers import request_for
from vidmem.memory import MemoryStrategy
from vidmem.pipelines.compile import CompileSettings, compiled_blocks
from vidmem.pipelines.family import denoiser_blocks
from vidmem.pipelines.sample import sample

TIERS = {
    "none": MemoryStrategy(offload="none"),
    "block_swap": MemoryStrategy(offload="block_swap", blocks_to_swap=2, prefetch_blocks=1),
    "sequential": MemoryStrategy(offload="sequential"),
}


def run(loaded, strategy, settings, device):
    loaded.release_warm()
    with compiled_blocks(denoiser_blocks(loaded.pipe, loaded.spec), settings) as compiled:
        result = sample(loaded, strategy, request_for("wan2.1-t2v"), device=device)
    return result.latent["samples"], compiled.as_dict()


@pytest.mark.parametrize("tier", list(TIERS))
def test_inductor_on_cuda_matches_eager_and_does_not_recompile(tiny_loaded, cuda, tier):
    torch._dynamo.reset()
    loaded = tiny_loaded("wan2.1-t2v")
    eager, _ = run(loaded, TIERS[tier], CompileSettings(), cuda)
    settings = CompileSettings(on=True)
    first, report = run(loaded, TIERS[tier], settings, cuda)
    assert report["compiled"], report["fallback"]
    torch.testing.assert_close(first, eager, rtol=1e-3, atol=1e-3)
    second, report = run(loaded, TIERS[tier], settings, cuda)
    assert (report["frames_compiled"], report["recompiles"]) == (0, 0), report["recompile_reasons"]
    torch.testing.assert_close(second, eager, rtol=1e-3, atol=1e-3)
