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


@pytest.mark.parametrize("tier", ["none", "block_swap"])
def test_a_lora_traced_into_the_graphs_on_cuda_keeps_its_strength(tiny_loaded, cuda, tier, tmp_path):
    """Through the Speed node a LoRA's hooks are traced into the compiled blocks (no graph break where the weights
    do not stream inside a block); another strength compiles nothing and is the one computed, its buffers moved
    to the GPU with their layers."""
    import dataclasses

    from test_lora import peft_keys, random_lora, write
    from test_lora_sampling import WAN_TARGETS
    from vidmem.pipelines.lora import load_lora, with_lora
    from vidmem.pipelines.speed import Speed

    torch._dynamo.reset()
    loaded = tiny_loaded("wan2.1-t2v")
    path = write(tmp_path / "style.safetensors", peft_keys(random_lora(loaded.pipe.transformer, WAN_TARGETS), None))
    request = request_for("wan2.1-t2v")
    for call, strength in enumerate((0.8, 0.3)):
        styled = with_lora(loaded, load_lora(path, loaded.pipe, strength))
        styled.release_warm()
        eager = sample(styled, TIERS[tier], request, device=cuda).latent["samples"]
        styled.release_warm()
        result = sample(styled, TIERS[tier], dataclasses.replace(request, speed=Speed("auto", CompileSettings(on=True))),
                        device=cuda)
        report = result.receipt["speed"]["compile"]
        assert report["compiled"], report["fallback"]
        torch.testing.assert_close(result.latent["samples"], eager, rtol=1e-3, atol=1e-3)
        if call == 0:
            assert report["graph_breaks"] == 0, report
        else:
            assert report["frames_compiled"] == 0, report["recompile_reasons"]
