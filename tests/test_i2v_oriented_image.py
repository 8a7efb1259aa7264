"""Image-to-video against plain diffusers with a picture that has an orientation.

The tier tests (test_tiers) give every image model a flat grey picture, which an image path that
flips, transposes or swaps channels would pass unnoticed. Here each image model samples from
`tiny_image` (red rising across, green down, a bright top-left quarter) and must give diffusers'
latents for the same picture bit for bit, while the picture mirrored gives other latents: the
comparison can fail.
"""

from __future__ import annotations

import dataclasses

import numpy
import pytest
import torch

from vidmem.memory import MemoryStrategy
from vidmem.memory.device import CpuBackend
from vidmem.pipelines.sample import SampleRequest, comfy_image_to_pil, sample
from vidmem.pipelines.tiny import tiny_call_kwargs, tiny_image, tiny_picture, tiny_spec

IMAGE_VARIANTS = ("cogvideox-i2v", "wan2.1-i2v", "wan2.1-flf2v", "wan2.2-i2v-a14b", "wan2.2-ti2v", "hunyuanvideo1.5-i2v")
STEPS = 2


def test_the_picture_changes_under_every_flip_transpose_and_channel_swap():
    image = tiny_image("wan2.1-i2v")  # square: a transpose keeps the shape
    changed = {"left-right": image.flip(2), "up-down": image.flip(1), "transposed": image.transpose(1, 2),
               "channels reversed": image.flip(3), "turned half round": image.flip(1, 2),
               "last frame": tiny_image("wan2.1-i2v", last=True)}
    assert [name for name, other in changed.items() if torch.equal(other, image)] == []
    for picture in (comfy_image_to_pil(image), tiny_picture(image)):
        as_tensor = torch.from_numpy(numpy.array(picture)).float().unsqueeze(0) / 255
        assert torch.equal(as_tensor, image)  # whole 8-bit levels: the Sampler and diffusers get exactly this


def reference_pipeline(loaded, variant: str):
    """The diffusers pipeline the Sampler runs: TI2V's folder is a WanPipeline that runs diffusers'
    I2V class (expand_timesteps) when given an image."""
    if variant != "wan2.2-ti2v":
        return loaded.image_mode().pipe
    from diffusers import WanImageToVideoPipeline

    pipe = WanImageToVideoPipeline(**loaded.pipe.components, expand_timesteps=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize("variant", IMAGE_VARIANTS)
def test_an_oriented_picture_reaches_the_model_as_diffusers_gives_it(variant, tiny_loaded):
    loaded = tiny_loaded(variant)
    spec = tiny_spec(variant)
    kwargs = tiny_call_kwargs(variant, steps=STEPS, structured=True)
    kwargs.setdefault("image", tiny_picture(tiny_image(variant)))  # TI2V's folder is text-to-video: no image in its kwargs
    pipe = reference_pipeline(loaded, variant)
    with torch.no_grad():
        reference = loaded.spec.to_comfy_latent(pipe, pipe(**kwargs).frames, spec.frames)
    last = tiny_image(variant, last=True) if spec.last_image else None
    request = SampleRequest("a cat", "", spec.width, spec.height, spec.frames, STEPS, 5.0, 0, tiny_image(variant),
                            last_image=last)
    ours = sample(loaded, MemoryStrategy(offload="none"), request, backend=CpuBackend()).latent["samples"]
    assert torch.equal(ours, reference)
    mirrored = dataclasses.replace(request, image=request.image.flip(2))
    assert not torch.equal(sample(loaded, MemoryStrategy(offload="none"), mirrored, backend=CpuBackend()).latent["samples"],
                           reference)
