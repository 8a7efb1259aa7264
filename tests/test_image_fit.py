"""fit_image: a ComfyUI IMAGE of any size becomes the video's first frame by crop, pad or stretch."""

from __future__ import annotations

import pytest
import torch

from vidmem.pipelines.family import ModelError
from vidmem.pipelines.image_fit import RESIZE_CHOICES, fit_image


def two_tone(width: int, height: int, split: int) -> torch.Tensor:
    """[1, H, W, 3]: columns left of `split` white, the rest grey (0.5)."""
    image = torch.full((1, height, width, 3), 0.5)
    image[:, :, :split] = 1.0
    return image


def bordered(width: int, height: int, border: int) -> torch.Tensor:
    """[1, H, W, 3]: a red frame `border` pixels wide around a green centre."""
    image = torch.zeros(1, height, width, 3)
    image[..., 0] = 1.0
    image[:, border:height - border, border:width - border] = torch.tensor([0.0, 1.0, 0.0])
    return image


@pytest.mark.parametrize("resize", RESIZE_CHOICES)
def test_every_choice_gives_exactly_the_videos_size_in_comfys_layout(resize):
    image = torch.rand(1, 37, 61, 3)
    fitted = fit_image(image, 32, 48, resize)
    assert fitted.image.shape == (1, 48, 32, 3) and fitted.image.dtype == torch.float32
    assert 0 <= fitted.image.min() and fitted.image.max() <= 1
    assert "61x37" in fitted.note and "32x48" in fitted.note


def test_an_image_of_the_videos_size_is_passed_through_untouched():
    image = torch.rand(1, 48, 64, 3)
    for resize in RESIZE_CHOICES:
        fitted = fit_image(image, 64, 48, resize)
        assert torch.equal(fitted.image, image) and fitted.image.data_ptr() != image.data_ptr()
        assert fitted.note == ""


def test_crop_cuts_the_overflow_evenly_and_keeps_the_proportions():
    """A 2:1 image into a square: the middle half stays, both side quarters go; no grey-white
    boundary moves (a stretch would move it)."""
    image = bordered(64, 32, 8)  # the red frame's sides lie in the quarters that are cut
    fitted = fit_image(image, 32, 32, "crop").image[0]
    assert torch.allclose(fitted[16, :, 1], torch.ones(32), atol=1e-3)  # the middle row: no red side bars left
    assert fitted[0, 16, 0] > 0.99 and fitted[16, 16, 1] > 0.99  # top border kept (red), centre green


def test_pad_keeps_everything_and_adds_black_bars():
    image = torch.ones(1, 20, 40, 3)  # white, 2:1
    fitted = fit_image(image, 40, 40, "pad").image[0]
    assert torch.equal(fitted[:10], torch.zeros(10, 40, 3)) and torch.equal(fitted[30:], torch.zeros(10, 40, 3))
    assert torch.equal(fitted[10:30], torch.ones(20, 40, 3))


def test_stretch_keeps_everything_and_changes_proportions():
    image = two_tone(40, 20, split=10)  # white quarter on the left
    fitted = fit_image(image, 40, 40, "stretch").image[0]
    assert torch.allclose(fitted[:, :9], torch.ones(40, 9, 3)) and torch.allclose(fitted[:, 11:], torch.full((40, 29, 3), 0.5))


def test_crop_and_pad_agree_with_stretch_when_the_aspect_ratio_already_matches():
    image = torch.rand(1, 60, 90, 3)
    stretched = fit_image(image, 30, 20, "stretch").image
    assert torch.allclose(fit_image(image, 30, 20, "crop").image, stretched)
    assert torch.allclose(fit_image(image, 30, 20, "pad").image, stretched)


def test_a_batch_uses_its_first_image_and_says_so_and_alpha_is_dropped():
    batch = torch.rand(4, 16, 16, 4)
    fitted = fit_image(batch, 16, 16, "crop")
    assert torch.equal(fitted.image, batch[:1, ..., :3])
    assert "batch of 4 images" in fitted.note and "first" in fitted.note and "Image From Batch" in fitted.note


def test_the_input_is_never_modified():
    image = torch.rand(2, 30, 50, 3)
    before = image.clone()
    for resize in RESIZE_CHOICES:
        fit_image(image, 32, 32, resize)
    assert torch.equal(image, before)


@pytest.mark.parametrize("args,message", [
    ((torch.rand(1, 8, 8, 3), 8, 8, "zoom"), "resize='zoom' is not a choice; use one of crop, pad, stretch"),
    ((torch.rand(1, 8, 8, 3), 0, 8, "crop"), "width=0 must be a whole number of pixels"),
    ((torch.rand(1, 8, 8, 3), 8, 8.5, "crop"), "height=8.5 must be a whole number"),
    ((torch.rand(8, 8, 3), 8, 8, "crop"), "image has shape \\(8, 8, 3\\); expected a ComfyUI IMAGE"),
    ((torch.full((1, 8, 8, 3), float("nan")), 8, 8, "crop"), "image contains NaN"),
    (("picture.png", 8, 8, "crop"), "image is a str, not an IMAGE"),
])
def test_bad_input_is_named_with_its_fix(args, message):
    with pytest.raises(ModelError, match=message):
        fit_image(*args)


def scale_then_crop(pixels: torch.Tensor, width: int, height: int) -> torch.Tensor:
    """How crop worked before it cut first: scale until the image covers the frame, then cut the
    overflow (rounding the scaled size and the cut in scaled pixels). [1, 3, H, W]."""
    import torch.nn.functional as F

    source_h, source_w = pixels.shape[-2:]
    scale = max(width / source_w, height / source_h)
    covered_w, covered_h = max(width, round(source_w * scale)), max(height, round(source_h * scale))
    scaled = F.interpolate(pixels, size=(covered_h, covered_w), mode="bicubic", align_corners=False, antialias=True)
    top, left = (covered_h - height) // 2, (covered_w - width) // 2
    return scaled.clamp(0, 1)[..., top:top + height, left:left + width]


def smooth_photo(width: int, height: int, seed: int) -> torch.Tensor:
    """[1, H, W, 3]: a random 10x7 picture scaled up: detail no finer than a photo's at this size."""
    coarse = torch.rand(1, 3, 7, 10, generator=torch.Generator().manual_seed(seed))
    fine = torch.nn.functional.interpolate(coarse, size=(height, width), mode="bicubic", align_corners=False)
    return fine.clamp(0, 1).permute(0, 2, 3, 1)


@pytest.mark.parametrize("source, frame", [((1000, 700), (832, 480)), ((1920, 1080), (832, 480)),
                                           ((1080, 1920), (480, 832)), ((640, 480), (832, 480))])
def test_crop_gives_an_ordinary_image_what_scaling_first_gave_to_within_a_sub_pixel_shift(source, frame):
    """Cutting in source pixels, then scaling, places the cut's edges within half a source pixel of the
    exact centred crop; scaling first rounded the scaled size and the cut in scaled pixels instead.
    Neither is exact, so the two differ by a shift of under a pixel: invisible in a photo (within
    2.5/255 on a smooth picture), though white noise, where every pixel is an edge, differs by up to
    half its range (measured 0.54 at 1000x700 into 832x480)."""
    image = smooth_photo(*source, seed=sum(source))
    before = scale_then_crop(image.permute(0, 3, 1, 2), *frame).permute(0, 2, 3, 1)
    assert (fit_image(image, *frame, "crop").image - before).abs().max() <= 2.5 / 255


def test_crop_on_whole_pixels_gives_what_scaling_first_gave_bit_for_bit_inside_the_kernels_reach():
    """Where both cut on whole source pixels (1000x700 into 350x350 halves, so the 150 source columns cut
    from each side are 75 scaled ones) random pixels come out the same, except the frame's outer
    two columns: scaled whole, their bicubic kernel (4 source pixels each side when halving) reached
    past the cut; cut first, it stops at the cut as at any image's border. With no cut, or no
    scaling, every pixel is the same."""
    noise = torch.rand(1, 700, 1000, 3, generator=torch.Generator().manual_seed(0))
    fitted, before = (fit_image(noise, 350, 350, "crop").image,
                      scale_then_crop(noise.permute(0, 3, 1, 2), 350, 350).permute(0, 2, 3, 1))
    assert torch.equal(fitted[:, :, 2:-2], before[:, :, 2:-2])
    for frame in ((500, 350), (1000, 500)):  # scaled, no cut; cut (100 rows each side), not scaled
        before = scale_then_crop(noise.permute(0, 3, 1, 2), *frame).permute(0, 2, 3, 1)
        assert torch.equal(fit_image(noise, *frame, "crop").image, before), frame


@pytest.mark.parametrize("source, frame", [((2000, 4), (832, 480)), ((1200, 1), (1280, 720)), ((3, 500), (64, 16))])
def test_crop_of_a_thin_strip_never_scales_more_than_the_frame(source, frame, monkeypatch):
    """A 2000x4 strip into 832x480 scaled whole would be 240000x480 before the cut (1.3 GiB; 1200x1
    into 1280x720, 7 GiB): the cut comes first, so nothing larger than the frame is ever made."""
    import torch.nn.functional as F

    asked, interpolate = [], F.interpolate

    def watched(pixels, size=None, **kwargs):
        asked.append(tuple(size))
        assert size[0] * size[1] <= frame[0] * frame[1], f"scaled to {size}, larger than the frame"
        return interpolate(pixels, size=size, **kwargs)

    monkeypatch.setattr(F, "interpolate", watched)
    width, height = source
    fitted = fit_image(torch.rand(1, height, width, 3), *frame, "crop").image
    assert asked == [(frame[1], frame[0])] and fitted.shape == (1, frame[1], frame[0], 3)


def test_crop_keeps_the_centre_of_the_image_at_the_centre_of_the_frame():
    """A horizontal ramp (each column's value is its centre's x, over the width): the frame's two middle
    columns average the source's middle, to within half a source pixel."""
    width = 1001
    ramp = ((torch.arange(width) + 0.5) / width).view(1, 1, width, 1).expand(1, 300, width, 3).contiguous()
    fitted = fit_image(ramp, 64, 48, "crop").image[0, 24, :, 0]
    assert abs(float(fitted[31:33].mean()) - 0.5) <= 0.5 / width
    assert float(fitted[0]) > 0.5 - 0.5 * (300 * 64 / 48) / width  # the cut spans 400 source columns, not more


def test_extreme_aspect_ratios_still_fill_the_frame():
    tall = torch.rand(1, 500, 3, 3)
    assert fit_image(tall, 64, 16, "crop").image.shape == (1, 16, 64, 3)
    padded = fit_image(tall, 64, 16, "pad").image
    assert padded.shape == (1, 16, 64, 3) and padded[0, :, 0].abs().sum() == 0  # left bar black


def test_the_sampler_node_fits_its_image_with_the_resize_choice(tiny_folder):
    """Wired in nodes/sampler.py (input `resize`, after `image`): the node samples from the fitted
    image and its receipt says what was done; a picture already fitted by crop samples the same."""
    from test_nodes import strategy_inputs
    from vidmem.nodes import NODE_CLASS_MAPPINGS as N

    sampler = N["VidMemVideoSampler"]
    assert "resize" in sampler.INPUT_TYPES()["optional"], "nodes/sampler.py lost its resize input"
    (pipeline,) = N["VidMemLoadPipeline"]().load(model="ignored", dtype="fp32", path=str(tiny_folder("wan2.1-i2v")))
    (strategy,) = N["VidMemMemoryStrategy"]().build(**strategy_inputs())["result"]
    picture = torch.rand(2, 45, 70, 3, generator=torch.Generator().manual_seed(3))

    def run(image, resize):
        out = sampler().sample(pipeline, strategy, "a cat", "", 32, 32, 9, 2, 5.0, 0, image=image, resize=resize)
        return out["result"][0]["samples"], out["ui"]["vidmem_receipt"][0].get("note", "")

    cropped, note = run(picture, "crop")
    assert "70x45 scaled and cropped to 32x32" in note and "batch of 2 images" in note
    assert torch.equal(run(fit_image(picture, 32, 32, "crop").image, "stretch")[0], cropped)
    assert not torch.equal(run(picture, "stretch")[0], cropped)
    with pytest.raises(ModelError, match="resize='fill' is not a choice"):
        run(picture, "fill")


@pytest.mark.parametrize("size, kept", [(6, 3), (10, 7), (1926, 1923), (622, 614.6), (480, 369.23), (5, 0.2), (7, 7)])
def test_the_crop_keeps_a_span_within_a_pixel_of_the_frames_aspect_centred(size, kept):
    """Rounding each end half to even could shrink the span by a pixel (6 keeping 3 gave 2: the
    picture stretched by 1.5x); the span is within a pixel of `kept`, centred exactly where a length
    that close splits the margins evenly, else half a pixel off."""
    from vidmem.pipelines.image_fit import _centred

    start, stop = _centred(size, kept)
    assert abs((stop - start) - max(1, kept)) < 1 and 0 <= start and stop <= size
    assert abs((start + stop) - size) <= (0 if kept % 1 else 1)
