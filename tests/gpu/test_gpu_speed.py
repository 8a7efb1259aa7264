"""What the CPU suite can only stand in for (docs/gpu.md, "Not measured yet"), on a real driver:

- a warm second, third and fourth call after block swap: the last prefetch of a call is claimed for the
  compute stream before the warm store keeps it (tests/test_warm_claim.py proves the order on the CUDA
  fake); here the copies are truly asynchronous, so a missing claim could give other frames;
- compiled blocks under inductor with CogVideoX's SDPA call rerouted to flex (the reroute counter is a
  device tensor added to in place inside the compiled graph; the CPU suite checks eager and aot_eager);
- `attention=cudnn` on LTX-2 and HunyuanVideo 1.5, whose attention passes a mask (flash and sage are
  refused there; cudnn is accepted and must run), and refused before the run on heads cuDNN will not take;
- `attention=sage` through vidmem's route for sageattention 1.x (pure Triton; carried as a wheel by
  `bench/gpu_check.sh --prepare-wheels`), which no GPU has run: Wan and CogVideoX with heads 64 wide.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch._dynamo

from test_tiers import request_for
from vidmem.memory import MemoryStrategy
from vidmem.pipelines.attention import AttentionError
from vidmem.pipelines.compile import CompileSettings
from vidmem.pipelines.loader import load_pipeline
from vidmem.pipelines.sample import sample
from vidmem.pipelines.speed import Speed

NONE = MemoryStrategy(offload="none")


def test_warm_calls_after_block_swap_give_residents_frames_every_time(tiny_loaded, cuda):
    loaded = tiny_loaded("wan2.1-t2v")
    request = request_for("wan2.1-t2v")
    loaded.release_warm()
    try:
        reference = sample(loaded, NONE, request, device=cuda).latent["samples"]
        loaded.release_warm()
        swap = MemoryStrategy(offload="block_swap", blocks_to_swap=2, prefetch_blocks=1)
        warm_seen = []
        for call in range(4):
            result = sample(loaded, swap, request, device=cuda)
            assert torch.equal(result.latent["samples"], reference), f"call {call}: warm frames differ"
            warm_seen.append(result.receipt.get("warm", {}).get("reused_bytes", 0))
        print(f"\nwarm reused bytes per call: {warm_seen}")
        assert warm_seen[0] == 0 and all(b > 0 for b in warm_seen[1:]), warm_seen
    finally:
        loaded.release_warm()


@pytest.mark.parametrize("tier", ["none", "block_swap"])
def test_inductor_with_cogvideox_sdpa_rerouted_to_flex(tiny_loaded, cuda, tier):
    torch._dynamo.reset()
    loaded = tiny_loaded("cogvideox1.5-t2v")  # heads 16 wide: inductor's flex lowering refuses narrower ones
    strategy = NONE if tier == "none" else MemoryStrategy(offload="block_swap", blocks_to_swap=1, prefetch_blocks=1)
    request = request_for("cogvideox1.5-t2v")
    loaded.release_warm()
    try:
        eager = sample(loaded, strategy, dataclasses.replace(request, speed=Speed("flex")), device=cuda)
        for call in range(2):
            result = sample(loaded, strategy, dataclasses.replace(request, speed=Speed("flex", CompileSettings(on=True))),
                            device=cuda)
            report = result.receipt["speed"]["compile"]
            assert report["compiled"], report.get("fallback")
            torch.testing.assert_close(result.latent["samples"], eager.latent["samples"], rtol=1e-3, atol=1e-3)
            assert result.receipt["speed"]["attention"]["calls_rerouted"] == \
                eager.receipt["speed"]["attention"]["calls_rerouted"] > 0
        assert (report["frames_compiled"], report["recompiles"]) == (0, 0), report["recompile_reasons"]
    finally:
        loaded.release_warm()


def folder_with_head_dims_cudnn_takes(variant: str, tmp_path, monkeypatch):
    """The tiny `variant` saved with every attention head 8 wide or more: cuDNN's attention refuses head
    dims that are not a multiple of 8 (the tiny LTX-2's sound heads are 4 wide; the real model's are 64)."""
    from vidmem.pipelines import tiny

    spec = tiny.tiny_spec(variant)
    config = spec.transformer_config
    if config.get("audio_attention_head_dim", 8) % 8:  # one head of 8 keeps the sound stream's width
        width = config["audio_num_attention_heads"] * config["audio_attention_head_dim"]
        config = {**config, "audio_num_attention_heads": width // 8, "audio_attention_head_dim": 8}
        monkeypatch.setitem(tiny.TINY_SPECS, variant, dataclasses.replace(spec, transformer_config=config))
    return tiny.save_tiny_pipeline(variant, tmp_path / variant)


@pytest.mark.parametrize("family", ["test_ltx2", "test_hunyuan_video15"])
def test_cudnn_runs_on_the_masked_families_within_bf16_rounding_of_auto(family, tmp_path, monkeypatch, cuda):
    module = pytest.importorskip(family)
    folder = folder_with_head_dims_cudnn_takes(module.VARIANT, tmp_path, monkeypatch)
    loaded = load_pipeline(folder, "bf16")  # cuDNN's attention takes fp16/bf16 only
    auto = sample(loaded, NONE, module.request(speed=Speed("auto")), device=cuda)
    cudnn = sample(loaded, NONE, module.request(speed=Speed("cudnn")), device=cuda)
    assert cudnn.receipt["speed"]["attention"]["kernel"] == "cudnn"
    a, b = cudnn.latent["samples"].float(), auto.latent["samples"].float()
    assert torch.isfinite(a).all()
    error = ((a - b).abs().max() / b.abs().max()).item()
    print(f"\n{module.VARIANT}: cudnn against auto, largest difference {error:.2e} of the largest value")
    assert error < 0.05, error  # a mask ignored or misread moves the latents by far more than bf16 rounding


def test_cudnn_on_heads_it_will_not_take_is_refused_before_the_run(tiny_folder, cuda):
    """The tiny LTX-2's sound heads are 4 wide: cuDNN refused them mid-run with SDPA's "No available kernel"
    (H200, 2026-11-27); now the kernel is asked first and the Sampler names the width and the fix."""
    from test_ltx2 import VARIANT, request

    loaded = load_pipeline(tiny_folder(VARIANT), "bf16")
    with pytest.raises(AttentionError, match=r"CUDNN_ATTENTION kernel does not run transformer's attention heads, 4 wide.*"
                                             r"choose 'auto'"):
        sample(loaded, NONE, request(speed=Speed("cudnn")), device=cuda)


def folder_with_heads_64_wide(variant: str, tmp_path, monkeypatch):
    """The tiny `variant` saved with two attention heads of 64: sageattention 1.0.6 takes heads 64, 96 or 128
    wide (the tiny models' are 8 to 12)."""
    from vidmem.pipelines import tiny

    spec = tiny.tiny_spec(variant)
    config = {**spec.transformer_config, "num_attention_heads": 2, "attention_head_dim": 64}
    monkeypatch.setitem(tiny.TINY_SPECS, variant, dataclasses.replace(spec, transformer_config=config))
    return tiny.save_tiny_pipeline(variant, tmp_path / variant)


@pytest.mark.parametrize("variant", ["wan2.1-t2v", "cogvideox-t2v"])
def test_sageattention_1_runs_within_int8_rounding_of_auto_on_every_tier(variant, tmp_path, monkeypatch, cuda):
    pytest.importorskip("sageattention", reason="sageattention 1.0.6 not installed (bench/gpu_check.sh --prepare-wheels)")
    loaded = load_pipeline(folder_with_heads_64_wide(variant, tmp_path, monkeypatch), "bf16")
    request = request_for(variant)
    loaded.release_warm()
    try:
        auto = sample(loaded, NONE, dataclasses.replace(request, speed=Speed("auto")), device=cuda)
        sage = sample(loaded, NONE, dataclasses.replace(request, speed=Speed("sage")), device=cuda)
        attention = sage.receipt["speed"]["attention"]
        assert attention["kernel"] == "sage" and attention["calls_rerouted"] > 0, attention
        a, b = sage.latent["samples"].float(), auto.latent["samples"].float()
        assert torch.isfinite(a).all()
        error = ((a - b).abs().max() / b.abs().max()).item()
        print(f"\n{variant}: sage 1.x against auto, largest difference {error:.2e} of the largest value")
        assert error < 0.05, error  # INT8 Q.K rounding; a wrong layout or scale moves the latents by far more
        loaded.release_warm()
        swapped = sample(loaded, MemoryStrategy(offload="block_swap", blocks_to_swap=1, prefetch_blocks=1),
                         dataclasses.replace(request, speed=Speed("sage")), device=cuda)
        assert torch.equal(swapped.latent["samples"], sage.latent["samples"])  # the tier changes no arithmetic
    finally:
        loaded.release_warm()
