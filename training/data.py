"""A training folder: media files with their captions, decoded and fitted to resolution/frame buckets.

Layout: `clip.mp4` + `clip.txt`, `photo.png` + `photo.txt` (any depth); captions are UTF-8 (a
BOM is dropped; any other encoding is refused by name). Each video is assigned the largest frame
bucket it has frames for (its first frames are used), each image the 1-frame bucket; the
resolution bucket is the one whose aspect ratio is closest to the clip's, which it is scaled to
cover and then centre-cropped to. Media are read upright, as a viewer shows them: a photo's EXIF
Orientation and a video's display rotation (a phone's portrait clip is stored sideways) are
applied before bucketing. Every problem (an empty folder, a missing or non-UTF-8 caption, a file
that does not decode, a bucket the family cannot take) is found here, before anything is encoded
or written.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .errors import TrainingError

VIDEO_SUFFIXES = (".mp4", ".mov", ".webm", ".mkv", ".avi", ".gif")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
SHOWN = 5  # files named in one message


@dataclass(frozen=True)
class Clip:
    path: Path
    caption: str
    is_image: bool


@dataclass(frozen=True)
class Bucket:
    width: int
    height: int
    frames: int

    def label(self) -> str:
        return f"{self.width}x{self.height}x{self.frames}"


@dataclass(frozen=True)
class BucketSettings:
    """Resolutions (width, height) and frame counts clips are fitted to."""

    resolutions: tuple[tuple[int, int], ...]
    frames: tuple[int, ...]

    def check(self, frames_error, multiple: int) -> None:
        """`frames_error(n)` is the family's rule (FamilySpec.frames_error); `multiple` its pixel step."""
        if not self.resolutions:
            raise TrainingError("resolutions is empty; give at least one, e.g. '832x480'.")
        if not self.frames:
            raise TrainingError("frame_buckets is empty; give at least one frame count, e.g. '33'.")
        for width, height in self.resolutions:
            for name, value in (("width", width), ("height", height)):
                if value < multiple or value % multiple:
                    fix = max(multiple, value // multiple * multiple)
                    raise TrainingError(f"resolution {width}x{height}: {name} {value} must be a multiple of {multiple} "
                                        f"for this model; use {fix} or {fix + multiple}.")
        for count in self.frames:
            problem = frames_error(count)
            if problem:
                raise TrainingError(f"frame_buckets: {problem}")


def parse_resolutions(text: str) -> tuple[tuple[int, int], ...]:
    found = []
    for part in filter(None, (p.strip() for p in re.split(r"[,;\s]+", text))):
        match = re.fullmatch(r"(\d+)\s*[xX*]\s*(\d+)", part)
        if not match:
            raise TrainingError(f"resolutions: '{part}' is not WIDTHxHEIGHT; write e.g. '832x480, 480x832'.")
        found.append((int(match.group(1)), int(match.group(2))))
    return tuple(dict.fromkeys(found))


def parse_frames(text: str) -> tuple[int, ...]:
    found = []
    for part in filter(None, (p.strip() for p in re.split(r"[,;\s]+", text))):
        if not part.isdigit() or int(part) < 1:
            raise TrainingError(f"frame_buckets: '{part}' is not a frame count; write e.g. '49, 25' (1 is added for images).")
        found.append(int(part))
    return tuple(sorted(set(found), reverse=True))


def scan_folder(folder: str | Path) -> list[Clip]:
    """Every video and image under `folder` with its caption; TrainingError naming what is wrong."""
    root = Path(str(folder).strip()).expanduser()
    if not str(folder).strip() or not root.is_dir():
        raise TrainingError(f"folder '{folder}' is not a folder; give the folder holding clip.mp4 + clip.txt pairs.")
    media = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in VIDEO_SUFFIXES + IMAGE_SUFFIXES
                   and not any(part.startswith(".") for part in p.relative_to(root).parts))
    if not media:
        raise TrainingError(f"folder '{root}' has no videos ({', '.join(VIDEO_SUFFIXES)}) or images "
                            f"({', '.join(IMAGE_SUFFIXES)}); put clip.mp4 + clip.txt pairs in it.")
    missing = [p for p in media if not p.with_suffix(".txt").is_file()]
    if missing:
        names = ", ".join(str(p.relative_to(root)) for p in missing[:SHOWN]) + (f" and {len(missing) - SHOWN} more" if len(missing) > SHOWN else "")
        raise TrainingError(f"{len(missing)} file(s) in '{root}' have no caption: {names}. Add a .txt with the same "
                            "name beside each (clip.mp4 -> clip.txt).")
    clips = []
    for path in media:
        caption = read_caption(path.with_suffix(".txt"))
        if not caption:
            raise TrainingError(f"caption {path.with_suffix('.txt')} is empty; describe the clip in it.")
        clips.append(Clip(path, caption, path.suffix.lower() in IMAGE_SUFFIXES))
    return clips


def read_caption(path: Path) -> str:
    """A caption file's text: UTF-8, a BOM dropped (Notepad writes one). Other encodings are refused:
    decoded as UTF-8 with replacement they became garbage the text encoder trained on silently."""
    try:
        return path.read_bytes().decode("utf-8-sig").strip()
    except UnicodeDecodeError as error:
        raise TrainingError(f"caption {path} is not UTF-8 text (byte {error.start} is 0x{error.object[error.start]:02x}); "
                            "save it as UTF-8 (e.g. 'Save as... > Encoding: UTF-8' in your editor).") from None


def read_frames(clip: Clip, max_frames: int) -> torch.Tensor:
    """Up to `max_frames` upright RGB frames as uint8 [F, H, W, 3]; TrainingError if the file does not decode."""
    with _named_if_broken(clip):
        return _read_image(clip.path) if clip.is_image else _decode_video(clip.path, max_frames)


def probe_clip(clip: Clip, max_frames: int) -> tuple[int, int, int]:
    """(frames up to `max_frames`, width, height) as shown upright, from the file's headers where they
    say it (the image header and EXIF; the container's frame count and one decoded frame), so a
    cached clip is not decoded whole on every run. TrainingError if the file does not open."""
    with _named_if_broken(clip):
        return _probe_image(clip.path) if clip.is_image else _probe_video(clip.path, max_frames)


@contextmanager
def _named_if_broken(clip: Clip) -> Iterator[None]:
    """PyAV and PIL raise many types for a broken file: each becomes a TrainingError naming it."""
    try:
        yield
    except TrainingError:
        raise
    except Exception as error:  # noqa: BLE001 - see the docstring
        raise TrainingError(f"'{clip.path}' cannot be decoded ({type(error).__name__}: {error}); re-encode it "
                            "(e.g. to H.264 .mp4) or remove it with its caption.") from None


EXIF_ORIENTATION = 0x0112
TRANSPOSED_ORIENTATIONS = (5, 6, 7, 8)  # EXIF Orientation values that turn the image a quarter: width and height swap


def _read_image(path: Path) -> torch.Tensor:
    from PIL import Image, ImageOps

    with Image.open(path) as image:
        upright = ImageOps.exif_transpose(image)  # a phone's portrait photo is stored sideways plus a tag
        return torch.from_numpy(_rgb_array(upright))[None]


def _rgb_array(image) -> np.ndarray:
    """uint8 [H, W, 3]. 16-bit greyscale (PNG mode I;16, or I) is scaled to 8 bits first: PIL's
    convert("RGB") clips every value above 255, so mid-grey (32768) became white."""
    if image.mode == "I" or image.mode.startswith("I;16"):
        grey = np.round(np.asarray(image).astype(np.float64) / 257.0).clip(0, 255).astype(np.uint8)
        return np.repeat(grey[..., None], 3, axis=2)
    return np.asarray(image.convert("RGB")).copy()


def _probe_image(path: Path) -> tuple[int, int, int]:
    from PIL import Image

    with Image.open(path) as image:  # reads the header only
        width, height = image.size
        if image.getexif().get(EXIF_ORIENTATION) in TRANSPOSED_ORIENTATIONS:
            width, height = height, width
    return 1, width, height


def upright_frame(frame: np.ndarray, rotation: float) -> np.ndarray:
    """A decoded frame [H, W, 3] turned as a player shows it. `rotation` is PyAV's `frame.rotation`:
    the display matrix's counter-clockwise angle (FFmpeg's av_display_rotation_get); a phone's
    portrait clip reads -90, which FFmpeg's autorotate shows turned 90 degrees clockwise. np.rot90
    turns counter-clockwise for positive k, so k = rotation / 90 (quarter turns; flips are ignored)."""
    turns = round(rotation / 90) % 4
    return np.rot90(frame, k=turns) if turns else frame


def _rotation(frame) -> float:
    """PyAV's display rotation of a decoded frame; 0 where PyAV is too old to read it (before 14)."""
    return getattr(frame, "rotation", 0) or 0


def _first_video_stream(container, path: Path):
    if not container.streams.video:
        raise TrainingError(f"'{path}' has no video stream; remove it or replace it with a video.")
    return container.streams.video[0]


def _no_frames(path: Path) -> TrainingError:
    return TrainingError(f"'{path}' has no decodable frames; re-encode it or remove it with its caption.")


def _decode_video(path: Path, max_frames: int) -> torch.Tensor:
    import av

    frames = []
    with av.open(str(path)) as container:
        for frame in container.decode(_first_video_stream(container, path)):
            frames.append(upright_frame(frame.to_ndarray(format="rgb24"), _rotation(frame)))
            if len(frames) >= max_frames:
                break
    if not frames:
        raise _no_frames(path)
    return torch.from_numpy(np.stack(frames))


def _probe_video(path: Path, max_frames: int) -> tuple[int, int, int]:
    import av

    with av.open(str(path)) as container:
        stream = _first_video_stream(container, path)
        decoded = container.decode(stream)
        first = next(decoded, None)  # one frame: its size and display rotation (PyAV reads rotation per frame)
        if first is None:
            raise _no_frames(path)
        count = stream.frames  # the container's own count (MP4, MOV); 0 where it keeps none (WebM, MKV, GIF)
        if count <= 0:
            count = 1 + sum(1 for _ in itertools.islice(decoded, max_frames - 1))
    width, height = first.width, first.height
    if round(_rotation(first) / 90) % 2:  # a quarter turn: width and height swap
        width, height = height, width
    return min(count, max_frames), width, height


def choose_bucket(clip: Clip, frame_count: int, width: int, height: int, buckets: BucketSettings) -> Bucket:
    frames = 1 if clip.is_image else next((f for f in buckets.frames if f <= frame_count), None)
    if frames is None:
        raise TrainingError(f"'{clip.path}' has {frame_count} frames, fewer than the smallest frame bucket "
                            f"({min(buckets.frames)}); add a smaller frame bucket or remove the clip.")
    aspect = math.log(width / height)
    best = min(buckets.resolutions, key=lambda r: (abs(math.log(r[0] / r[1]) - aspect), -r[0] * r[1]))
    return Bucket(best[0], best[1], frames)


def fit_to_bucket(frames: torch.Tensor, bucket: Bucket) -> torch.Tensor:
    """uint8 [F, H, W, 3] -> float [3, frames, height, width] in [-1, 1]: scaled to cover, centre-cropped.
    One frame is in float at a time: a whole 1080p clip of 81 frames would be 2 GiB of float."""
    clip = frames[: bucket.frames]
    fitted = torch.empty(3, clip.shape[0], bucket.height, bucket.width)
    for index, frame in enumerate(clip):
        fitted[:, index] = _fit_frame(frame, bucket)
    return fitted


def _fit_frame(frame: torch.Tensor, bucket: Bucket) -> torch.Tensor:
    """uint8 [H, W, 3] -> float [3, height, width] in [-1, 1]."""
    image = frame.permute(2, 0, 1)[None].float() / 127.5 - 1.0
    height, width = image.shape[-2:]
    scale = max(bucket.width / width, bucket.height / height)
    size = (max(bucket.height, round(height * scale)), max(bucket.width, round(width * scale)))
    if size != (height, width):
        image = F.interpolate(image, size=size, mode="bilinear", align_corners=False, antialias=True).clamp(-1, 1)
    top, left = (size[0] - bucket.height) // 2, (size[1] - bucket.width) // 2
    return image[0, :, top : top + bucket.height, left : left + bucket.width]
