"""The newer families on a real GPU (issue 27): LTX-2 and HunyuanVideo 1.5 give resident's latents on
every tier, and LTX-2's sound decodes on the GPU with nothing of its audio parts left there.

The CPU suite proves the same against plain diffusers (tests/test_ltx2.py, tests/test_hunyuan_video15.py,
tests/test_ltx2_audio.py); on CUDA the copies are asynchronous and the kernels are the GPU's, so what
is compared is vidmem's tiers with each other, on the same device, bit for bit."""

from __future__ import annotations

import pytest
import torch

from vidmem.memory import MemoryStrategy
from vidmem.memory.cleanup import free_memory
from vidmem.memory.strategy import TextEncoderPlacement
from vidmem.pipelines.sample import sample

FAMILIES = ("test_ltx2", "test_hunyuan_video15")  # the CPU suite's modules: their VARIANT, TIERS, request


@pytest.mark.parametrize("family", FAMILIES)
def test_every_tier_gives_resident_bit_for_bit(family, tiny_loaded, cuda):
    module = pytest.importorskip(family)
    loaded = tiny_loaded(module.VARIANT)
    outputs = {label: sample(loaded, strategy, module.request(), device=cuda).latent
               for label, strategy in module.TIERS.items()}
    # A text encoder run on the CPU gives the CPU's rounding to the prompt embeddings (the CPU suite cannot
    # see it: there both encoders are the CPU's): such tiers are compared with resident, text encoder on the CPU.
    te_cpu = sample(loaded, MemoryStrategy(offload="none", text_encoder="cpu"), module.request(), device=cuda).latent
    for label, latent in outputs.items():
        reference = te_cpu if module.TIERS[label].text_encoder is TextEncoderPlacement.CPU else outputs["none"]
        assert torch.equal(latent["samples"], reference["samples"]), f"{module.VARIANT} {label}"
        if "audio_samples" in reference:
            assert torch.equal(latent["audio_samples"], reference["audio_samples"]), f"{module.VARIANT} {label}: sound"


def test_ltx2_sound_decodes_on_the_gpu_and_leaves_nothing_there(tiny_loaded, cuda):
    from test_ltx2 import TIERS, VARIANT, request
    from vidmem.pipelines.ltx2_audio import decode_audio

    loaded = tiny_loaded(VARIANT)
    latent = sample(loaded, TIERS["block_swap:1"], request(), device=cuda).latent
    free_memory(cuda)
    baseline = torch.cuda.memory_allocated(cuda)
    on_gpu = decode_audio(loaded, latent, device=cuda)
    assert torch.cuda.memory_allocated(cuda) <= baseline, "the audio VAE or vocoder stayed on the GPU"
    on_cpu = decode_audio(loaded, latent, device=torch.device("cpu"))
    wave = on_gpu.as_comfy()
    assert wave["waveform"].device.type == "cpu" and wave["waveform"].dtype == torch.float32
    assert on_gpu.sample_rate == on_cpu.sample_rate and on_gpu.waveform.shape == on_cpu.waveform.shape
    # GPU and CPU convolutions differ in their last bits: the same sound, within fp32 rounding
    torch.testing.assert_close(on_gpu.waveform, on_cpu.waveform, rtol=1e-3, atol=1e-4)
