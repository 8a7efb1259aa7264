"""Wan image-to-video's conditioning video: the image padded with empty frames to the whole clip.

diffusers' `WanImageToVideoPipeline.__call__` hands `prepare_latents` the image in float32, which
concatenates it with empty frames in float32 and casts the clip to the VAE's dtype afterwards: two
float32 clips on the device at once (21 GiB at 1280x720x1025). vidmem's call (pipelines/sample_call.py)
hands it the image already in the VAE's dtype: the same values, half the bytes; the planner traces that
(configs/workloads.py, `wan_condition_video`). Here: bit for bit with plain diffusers, no float32 clip
anywhere in a run, and the planner's trace at least the engine's measured peak for the same shape.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from test_tiers import request_for
from vidmem.memory import MemoryStrategy
from vidmem.memory.accounting import Attention, trace
from vidmem.memory.device import CpuBackend
from vidmem.memory.plan.planner import Call, VideoShape
from vidmem.pipelines.configs import load_model
from vidmem.pipelines.configs.workloads import takes_last_image
from vidmem.pipelines.loader import load_pipeline
from vidmem.pipelines.sample import sample
from vidmem.pipelines.sample_call import call_pipeline
from vidmem.pipelines.tiny import tiny_call_kwargs, tiny_image, tiny_picture, tiny_spec

I2V, FLF2V, A14B = "wan2.1-i2v", "wan2.1-flf2v", "wan2.2-i2v-a14b"
# (variant, whether the call takes a last image): every Wan pipeline whose prepare_latents pads the image
CASES = [(I2V, False), (FLF2V, True), (A14B, False), (A14B, True)]
VAE_DTYPES = ["bf16", "fp32"]


@pytest.fixture(scope="module")
def loaded_at(tiny_folder):
    """(variant, VAE dtype) -> a pipeline loaded in fp32 with its VAE at that dtype, shared by this module."""
    cache = {}

    def get(variant: str, vae_dtype: str):
        if (variant, vae_dtype) not in cache:
            cache[variant, vae_dtype] = load_pipeline(tiny_folder(variant), "fp32", vae_dtype=vae_dtype)
        return cache[variant, vae_dtype]
    return get


def request(variant: str, last: bool):
    """Pictures with whole 8-bit levels that bf16 does not hold exactly once preprocessed to -1..1
    (a flat grey would hide a cast made in the wrong place)."""
    base = replace(request_for(variant), image=tiny_image(variant))
    return replace(base, last_image=tiny_image(variant, last=True) if last else None)


@pytest.mark.parametrize("vae_dtype", VAE_DTYPES)
@pytest.mark.parametrize("variant,last", CASES)
def test_conditioning_in_the_vae_dtype_is_bit_identical_to_diffusers(loaded_at, variant, last, vae_dtype):
    """The whole run, and prepare_latents' latents and conditioning alone, as plain diffusers makes them."""
    loaded = loaded_at(variant, vae_dtype)
    kwargs = tiny_call_kwargs(variant, structured=True)
    kwargs["last_image"] = tiny_picture(tiny_image(variant, last=True)) if last else None
    reference = loaded.pipe(**kwargs).frames
    ours = sample(loaded, MemoryStrategy(offload="none"), request(variant, last), backend=CpuBackend())
    assert torch.equal(ours.latent["samples"], reference)

    pipe, spec = loaded.pipe, tiny_spec(variant)
    image, last_image = (torch.rand(1, 3, spec.height, spec.width) * 2 - 1 for _ in range(2))

    def arguments():
        return (image, 1, pipe.vae.config.z_dim, spec.height, spec.width, spec.frames, torch.float32,
                torch.device("cpu"), torch.Generator().manual_seed(0), None, last_image if last else None)
    plain = pipe.prepare_latents(*arguments())  # diffusers' own: the loaded class does not override it
    called = call_pipeline(pipe, pipe.scheduler, None).prepare_latents(*arguments())
    assert all(torch.equal(a, b) for a, b in zip(plain, called, strict=True))


class ClipSizedTensors(TorchDispatchMode):
    """The dtypes of every tensor an op makes that holds at least a whole clip of pixels."""

    def __init__(self, clip_values: int) -> None:
        super().__init__()
        self.clip_values, self.dtypes = clip_values, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor) and tensor.ndim == 5 and tensor.numel() >= self.clip_values:
                self.dtypes.append((str(func), tensor.dtype))
        return out


@pytest.mark.parametrize("variant,last", CASES)
def test_a_bf16_vae_run_makes_no_float32_clip(loaded_at, variant, last):
    """The conditioning video, its empty frames and their concatenation exist in bf16 only."""
    spec = tiny_spec(variant)
    seen = ClipSizedTensors(3 * spec.frames * spec.height * spec.width)
    with seen:
        sample(loaded_at(variant, "bf16"), MemoryStrategy(offload="none"), request(variant, last), backend=CpuBackend())
    assert seen.dtypes and all(dtype == torch.bfloat16 for _, dtype in seen.dtypes), seen.dtypes


@pytest.mark.parametrize("vae_dtype", VAE_DTYPES)
@pytest.mark.parametrize("variant,last", [(I2V, False), (FLF2V, True), (A14B, True)])
def test_the_plan_traces_at_least_what_the_engine_holds(loaded_at, tiny_folder, variant, last, vae_dtype):
    """The engine's prepare_latents measured by the planner's own ledger on real CPU tensors (the float32
    image(s) made inside, as diffusers' preprocess puts them on the device) against the planner's meta
    trace of the conditioning: never below it, and within 2% (it follows the engine, it does not pad)."""
    pipe, spec = loaded_at(variant, vae_dtype).pipe, tiny_spec(variant)

    def engine():
        pixels = [torch.empty(1, 3, spec.height, spec.width).uniform_(-1, 1) for _ in range(2 if last else 1)]
        image, last_image = pixels[0], pixels[1] if last else None
        return call_pipeline(pipe, pipe.scheduler, None).prepare_latents(
            image, 1, pipe.vae.config.z_dim, spec.height, spec.width, spec.frames, torch.float32, torch.device("cpu"),
            torch.Generator().manual_seed(0), None, last_image)

    measured = trace(engine).peak_bytes
    model = load_model(str(tiny_folder(variant)), "fp32", vae_dtype=vae_dtype)
    planned = model.trace(Call("condition", "vae", VideoShape(spec.width, spec.height, spec.frames)), Attention.FUSED)
    assert measured <= planned.peak_bytes <= measured * 1.02, (measured, planned.peak_bytes)


@pytest.mark.parametrize("variant,takes", [(I2V, False), (FLF2V, True), (A14B, True)])
def test_the_planner_traces_a_last_image_where_the_model_takes_one(tiny_folder, variant, takes):
    assert takes_last_image(load_model(str(tiny_folder(variant)), "fp32")) is takes


@pytest.mark.parametrize("variant,pads", [(I2V, True), (FLF2V, True), (A14B, True), ("wan2.2-ti2v", False),
                                          ("cogvideox-i2v", False), ("hunyuanvideo1.5-i2v", False)])
def test_only_wan_pipelines_that_pad_the_image_get_it_cast(tiny_loaded, variant, pads):
    """Wan 2.2 TI2V-5B (`expand_timesteps`) encodes its image as a one-frame clip: diffusers' own path."""
    pipe = tiny_loaded(variant).image_mode().pipe
    assert call_pipeline(pipe, pipe.scheduler, None)._builds_condition_video() is pads
