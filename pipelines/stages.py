"""Which components a sampling stage places on the device: one declaration, engine and planner.

`pipelines/sample.py` applies the strategy to these components and the planner
(`configs/meta.py` MetaModel, through `PlannerModel.stage_components`) counts exactly these, so a
change here changes what runs and what is predicted together.

The rules, from the family's declaration (`FamilySpec`):
- the family's `encoders` are placed on the device, except the prompt encoder when the strategy
  keeps it on the CPU (`text_encoder = cpu`) or when nothing needs encoding (every prompt
  embedding came from the cache). An image encoder (Wan 2.1 I2V's CLIP) follows the tier: the
  `text_encoder` input places the prompt encoder only;
- every denoiser;
- the VAE, for image-to-video: it encodes the input image before the loop.
Components the pipeline does not have (`present`) are left out.
"""

from __future__ import annotations

from collections.abc import Collection

from torch import nn

from ..memory.strategy import TextEncoderPlacement
from .family import FamilySpec

PROMPT_ENCODER = "text_encoder"  # the component the strategy's `text_encoder` input places
IMAGE_VAE = "vae"  # image-to-video encodes the input image with it before the loop


def stage_components(spec: FamilySpec, present: Collection[str], text_encoder: TextEncoderPlacement,
                     image: bool, encode_text: bool = True) -> tuple[str, ...]:
    """The sampling stage's components, in the order the strategy is applied to them."""
    on_cpu = {PROMPT_ENCODER} if text_encoder is TextEncoderPlacement.CPU or not encode_text else set()
    names = [name for name in spec.encoders if name not in on_cpu] + list(spec.denoisers)
    if image:
        names.append(IMAGE_VAE)
    return tuple(name for name in dict.fromkeys(names) if name in present)


def stage_modules(pipe, spec: FamilySpec, text_encoder: TextEncoderPlacement, image: bool,
                  encode_text: bool = True) -> dict[str, nn.Module]:
    """`stage_components` of a loaded pipeline, as {name: module} (absent components skipped)."""
    present = [name for name in (*spec.encoders, *spec.denoisers, IMAGE_VAE) if getattr(pipe, name, None) is not None]
    return {name: getattr(pipe, name) for name in stage_components(spec, present, text_encoder, image, encode_text)}
