"""A training folder: media files with their captions, decoded and fitted to resolution/frame buckets.

Layout: `clip.mp4` + `clip.txt`, `photo.png` + `photo.txt` (any depth). Each video is assigned the
largest frame bucket it has frames for (its first frames are used), each image the 1-frame
bucket; the resolution bucket is the one whose aspect ratio is closest to the clip's, which it is
scaled to cover and then centre-cropped to. Every problem (an empty folder, a missing caption, a
file that does not decode, a bucket the family cannot take) is found here, before anything is
encoded or written.
"""

from __future__ import annotations

import math
import re
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
        caption = path.with_suffix(".txt").read_text(encoding="utf-8", errors="replace").strip()
        if not caption:
            raise TrainingError(f"caption {path.with_suffix('.txt')} is empty; describe the clip in it.")
        clips.append(Clip(path, caption, path.suffix.lower() in IMAGE_SUFFIXES))
    return clips


def read_frames(clip: Clip, max_frames: int) -> torch.Tensor:
    """Up to `max_frames` RGB frames as uint8 [F, H, W, 3]; TrainingError if the file does not decode."""
    try:
        if clip.is_image:
            from PIL import Image

            with Image.open(clip.path) as image:
                return torch.from_numpy(np.asarray(image.convert("RGB")).copy())[None]
        return _decode_video(clip.path, max_frames)
    except TrainingError:
        raise
    except Exception as error:  # noqa: BLE001 - PyAV and PIL raise many types for a broken file
        raise TrainingError(f"'{clip.path}' cannot be decoded ({type(error).__name__}: {error}); re-encode it "
                            "(e.g. to H.264 .mp4) or remove it with its caption.") from None


def _decode_video(path: Path, max_frames: int) -> torch.Tensor:
    import av

    frames = []
    with av.open(str(path)) as container:
        if not container.streams.video:
            raise TrainingError(f"'{path}' has no video stream; remove it or replace it with a video.")
        for frame in container.decode(video=0):
            frames.append(frame.to_ndarray(format="rgb24"))
            if len(frames) >= max_frames:
                break
    if not frames:
        raise TrainingError(f"'{path}' has no decodable frames; re-encode it or remove it with its caption.")
    return torch.from_numpy(np.stack(frames))


def choose_bucket(clip: Clip, frame_count: int, width: int, height: int, buckets: BucketSettings) -> Bucket:
    frames = 1 if clip.is_image else next((f for f in buckets.frames if f <= frame_count), None)
    if frames is None:
        raise TrainingError(f"'{clip.path}' has {frame_count} frames, fewer than the smallest frame bucket "
                            f"({min(buckets.frames)}); add a smaller frame bucket or remove the clip.")
    aspect = math.log(width / height)
    best = min(buckets.resolutions, key=lambda r: (abs(math.log(r[0] / r[1]) - aspect), -r[0] * r[1]))
    return Bucket(best[0], best[1], frames)


def fit_to_bucket(frames: torch.Tensor, bucket: Bucket) -> torch.Tensor:
    """uint8 [F, H, W, 3] -> float [3, frames, height, width] in [-1, 1]: scaled to cover, centre-cropped."""
    video = frames[: bucket.frames].permute(0, 3, 1, 2).float() / 127.5 - 1.0
    height, width = video.shape[-2:]
    scale = max(bucket.width / width, bucket.height / height)
    size = (max(bucket.height, round(height * scale)), max(bucket.width, round(width * scale)))
    if size != (height, width):
        video = F.interpolate(video, size=size, mode="bilinear", align_corners=False, antialias=True).clamp(-1, 1)
    top, left = (size[0] - bucket.height) // 2, (size[1] - bucket.width) // 2
    return video[:, :, top : top + bucket.height, left : left + bucket.width].permute(1, 0, 2, 3).contiguous()
