"""Helpers for the training tests: tiny clips written with PyAV, prepared with a tiny pipeline.

(A test module so it can live beside the tests it serves; its own tests check the helpers.)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from vidmem.memory import MemoryStrategy
from vidmem.memory.device import CpuBackend
from vidmem.training import BucketSettings, prepare_training_data

CAPTIONS = ("a cat dance", "a dog in the video", "a monkey with a cat", "the dog is on a cat")


def write_video(path: Path, frames: int, width: int, height: int, seed: int) -> Path:
    """A small H.264-free clip (MPEG-4 part 2, so any PyAV build encodes it) of moving colour."""
    import av

    rng = np.random.default_rng(seed)
    base = rng.integers(0, 255, size=(height, width, 3), dtype=np.uint8)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=8)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for index in range(frames):
            image = np.roll(base, index * 2, axis=1)
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def make_dataset(folder: Path, clips: int = 2, frames: int = 9, width: int = 48, height: int = 32, image: bool = False) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for index in range(clips):
        write_video(folder / f"clip{index}.mp4", frames, width, height, seed=index)
        (folder / f"clip{index}.txt").write_text(CAPTIONS[index % len(CAPTIONS)])
    if image:
        from PIL import Image

        Image.fromarray(np.full((height, width, 3), 90, dtype=np.uint8)).save(folder / "still.png")
        (folder / "still.txt").write_text("a cat")
    return folder


def prepare_tiny(loaded, folder: Path, cache: Path, size=(32, 32), frames=(9,)):
    buckets = BucketSettings((size,), tuple(frames))
    return prepare_training_data(loaded, folder, buckets, MemoryStrategy(offload="model"), cache, CpuBackend())


def prepared_per_variant(tiny_loaded, root: Path, clips: int):
    """variant -> its tiny pipeline's prepared data from one dataset of `clips` clips, prepared once."""
    data_dir = make_dataset(root / "data", clips=clips)
    cache: dict = {}

    def get(variant: str):
        if variant not in cache:
            cache[variant] = prepare_tiny(tiny_loaded(variant), data_dir, root / "cache")
        return cache[variant]

    return get


def test_written_clip_decodes_to_its_frames(tmp_path):
    from vidmem.training.data import Clip, read_frames

    path = write_video(tmp_path / "c.mp4", 9, 48, 32, seed=0)
    frames = read_frames(Clip(path, "x", False), 100)
    assert frames.shape == (9, 32, 48, 3) and frames.dtype == torch.uint8
