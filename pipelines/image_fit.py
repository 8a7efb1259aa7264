"""The input image of image-to-video, fitted to the video's width x height the way users expect.

An I2V model conditions on its first frame at exactly the video's size, and diffusers' own
preprocessing stretches whatever it is given to that size: a 1920x1080 photo into 832x832 comes
out squashed. Users expect what core ComfyUI and the popular packs do (core's WanImageToVideo
scales and crops from the centre; kijai's resize nodes offer crop, pad and stretch):

- crop: cut the overflow past the frame's aspect ratio evenly from both sides, then scale to the
  frame. Nothing is distorted; the edges past the frame's aspect ratio are lost. The default.
- pad: scale until the image fits inside the frame, fill the rest with black bars. Nothing is
  lost, but the bars are part of the first frame, so the model animates them too.
- stretch: scale each side on its own. Nothing is lost; proportions change.

A batch of images uses its first image (image-to-video conditions on one frame), with a note
saying so; an alpha channel is dropped. Pure torch, no ComfyUI imports: the sampler node calls
`fit_image` and shows the note.

    fitted = fit_image(comfy_image, width=832, height=480, resize="crop")
    request = SampleRequest(..., image=fitted.image)
"""

from __future__ import annotations

import math

from dataclasses import dataclass
from enum import Enum
from numbers import Integral

import torch
import torch.nn.functional as F

from .family import ModelError
from .sample_checks import check_image


class Resize(str, Enum):
    CROP = "crop"
    PAD = "pad"
    STRETCH = "stretch"


RESIZE_CHOICES = tuple(choice.value for choice in Resize)
PAD_VALUE = 0.0  # black bars: the least distracting fill for the model to carry through the video


@dataclass(frozen=True)
class FittedImage:
    """The first image at the video's size, ComfyUI IMAGE layout [1, height, width, 3] in 0..1."""

    image: torch.Tensor
    notes: tuple[str, ...] = ()  # what was done that the user may not expect (empty: nothing to say)

    @property
    def note(self) -> str:
        return "; ".join(self.notes)


def fit_image(image: torch.Tensor, width: int, height: int, resize: str = Resize.CROP.value,
              name: str = "image") -> FittedImage:
    """`image` (a ComfyUI IMAGE [batch, H, W, 3 or 4]) as one image of exactly `width` x `height`.

    `resize` is "crop", "pad" or "stretch" (see the module doc). An image already of the video's
    size comes back unchanged (the same values, a new tensor). Bad input raises ModelError
    naming the input (`name`: the Sampler's image or last_image) and the fix; nothing is modified in place.
    """
    mode = _resize_choice(resize)
    _check_size("width", width)
    _check_size("height", height)
    check_image(image, name)
    notes = []
    if image.shape[0] > 1:
        notes.append(f"{name}: a batch of {image.shape[0]} images; the first is used "
                     "(pick another with core Image From Batch)")
    first = image[:1, ..., :3].float().clamp(0, 1)  # alpha is not part of a video frame
    source = (first.shape[2], first.shape[1])
    if source == (width, height):
        return FittedImage(first.clone(), tuple(notes))
    pixels = first.permute(0, 3, 1, 2)  # [1, 3, H, W] for torch's resampling
    fitted = {Resize.CROP: _crop, Resize.PAD: _pad, Resize.STRETCH: _stretch}[mode](pixels, int(width), int(height))
    notes.append(f"{name}: {source[0]}x{source[1]} {_DONE[mode]} {width}x{height}")
    return FittedImage(fitted.permute(0, 2, 3, 1).contiguous(), tuple(notes))


_DONE = {Resize.CROP: "scaled and cropped to", Resize.PAD: "scaled and padded to", Resize.STRETCH: "stretched to"}


def _resize_choice(resize: object) -> Resize:
    try:
        return Resize(resize)
    except ValueError:
        raise ModelError(f"resize={resize!r} is not a choice; use one of {', '.join(RESIZE_CHOICES)}.") from None


def _check_size(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, Integral) or value < 1:
        raise ModelError(f"{name}={value!r} must be a whole number of pixels, at least 1.")


def _scaled(pixels: torch.Tensor, width: int, height: int) -> torch.Tensor:
    """Bicubic with antialiasing (a downscale averages instead of aliasing), kept within 0..1
    (bicubic overshoots at sharp edges)."""
    if (pixels.shape[-1], pixels.shape[-2]) == (width, height):
        return pixels.clone()
    out = F.interpolate(pixels, size=(height, width), mode="bicubic", align_corners=False, antialias=True)
    return out.clamp(0, 1)


def _stretch(pixels: torch.Tensor, width: int, height: int) -> torch.Tensor:
    return _scaled(pixels, width, height)


def _crop(pixels: torch.Tensor, width: int, height: int) -> torch.Tensor:
    """Cut the image to the frame's aspect ratio around its centre, in source pixels, then scale
    (core ComfyUI's centre crop also cuts first). Scaling first would make an intermediate as long as
    the image's long side scaled to cover the frame: a 2000x4 strip into 832x480 is 240000x480 (1.3 GiB)."""
    source_h, source_w = pixels.shape[-2:]
    left, right = _centred(source_w, min(source_w, source_h * width / height))
    top, bottom = _centred(source_h, min(source_h, source_w * height / width))
    return _scaled(pixels[..., top:bottom, left:right], width, height)


def _centred(size: int, kept: float) -> tuple[int, int]:
    """The whole pixels (start, stop) of a span within a pixel of `kept` (at least one) centred in
    `size`. Of the two whole lengths around `kept`, the one whose margins split evenly: the cut is then
    exactly centred (rounding each end apart could shrink the span by a pixel: 6 keeping 3 kept 2,
    a 1.5x stretch). A whole `kept` of the other parity is kept as it is, half a pixel off centre."""
    lengths = {max(1, min(size, math.floor(kept))), max(1, min(size, math.ceil(kept)))}
    length = next((n for n in sorted(lengths) if (size - n) % 2 == 0), min(lengths))
    start = (size - length) // 2
    return start, start + length


def _pad(pixels: torch.Tensor, width: int, height: int) -> torch.Tensor:
    source_h, source_w = pixels.shape[-2:]
    scale = min(width / source_w, height / source_h)
    inner_w = min(width, max(1, round(source_w * scale)))
    inner_h = min(height, max(1, round(source_h * scale)))
    scaled = _scaled(pixels, inner_w, inner_h)
    out = torch.full((*pixels.shape[:2], height, width), PAD_VALUE, dtype=pixels.dtype)
    top, left = (height - inner_h) // 2, (width - inner_w) // 2
    out[..., top:top + inner_h, left:left + inner_w] = scaled
    return out
