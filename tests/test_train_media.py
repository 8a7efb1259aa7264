"""Training media read as a viewer shows them: EXIF orientation, a video's display rotation, 16-bit
greyscale, UTF-8 captions; headers probed instead of whole clips decoded; frames fitted one at a time."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from test_train_support import make_dataset, prepare_tiny, write_video
from vidmem.training import BucketSettings, TrainingError
from vidmem.training.data import Clip, choose_bucket, fit_to_bucket, probe_clip, read_frames, scan_folder, upright_frame

WIDE, TALL = (64, 32), (32, 64)  # (width, height) buckets: a clip read sideways lands in the other one
BUCKETS = BucketSettings((WIDE, TALL), (5, 1))


def bright_corner(height: int, width: int) -> np.ndarray:
    """Black, with a white 16x16 block in the top-left corner (survives JPEG and MPEG-4)."""
    image = np.zeros((height, width, 3), dtype=np.uint8)
    image[:16, :16] = 255
    return image


def assert_upright(frames: torch.Tensor) -> None:
    """A stored 64x32 (W x H) bright_corner shown turned 90 degrees clockwise: 32 wide, 64 high,
    the block top right."""
    assert tuple(frames.shape[1:]) == (64, 32, 3)
    frame = frames[0].float().mean(-1)
    assert frame[:16, 16:].mean() > 200 and frame[:16, :16].mean() < 50 and frame[16:].mean() < 50


def test_a_photos_exif_orientation_is_applied(tmp_path):
    from PIL import Image

    image = Image.fromarray(bright_corner(32, 64))  # stored 64 wide, 32 high, as a phone stores a portrait
    exif = image.getexif()
    exif[0x0112] = 6  # Orientation 6: shown turned 90 degrees clockwise
    image.save(tmp_path / "photo.jpg", exif=exif, quality=95)
    clip = Clip(tmp_path / "photo.jpg", "x", True)
    assert_upright(read_frames(clip, 1))
    assert probe_clip(clip, 5) == (1, 32, 64)
    assert choose_bucket(clip, *probe_clip(clip, 5), BUCKETS).label() == "32x64x1"


def test_16_bit_greyscale_is_scaled_to_8_bits(tmp_path):
    from PIL import Image

    values = np.array([[0, 32768, 65535, 257 * 40]], dtype=np.uint16).repeat(4, axis=0)
    Image.fromarray(values).save(tmp_path / "depth.png")  # PIL writes mode I;16 as a 16-bit greyscale PNG
    with Image.open(tmp_path / "depth.png") as image:
        assert image.mode.startswith("I")
    frames = read_frames(Clip(tmp_path / "depth.png", "x", True), 1)
    assert frames.dtype == torch.uint8 and frames.shape == (1, 4, 4, 3)
    assert frames[0, 0, :, 0].tolist() == [0, 128, 255, 40]  # mid-grey stays mid-grey (it became 255, white)
    assert torch.equal(frames[..., 0], frames[..., 2])


def rotated_video(path, frames: int = 5):
    """A 64x32 clip whose track header says: show it turned 90 degrees clockwise (a phone's portrait
    clip; FFmpeg reads the display matrix's rotation as -90). The matrix is patched into the MP4's
    track header (the last identity matrix: the movie header's comes first)."""
    import av

    if not hasattr(av.VideoFrame, "rotation"):
        pytest.skip("PyAV before 14 does not read a frame's display rotation")
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=8)
        stream.width, stream.height, stream.pix_fmt = 64, 32, "yuv420p"
        for _ in range(frames):
            for packet in stream.encode(av.VideoFrame.from_ndarray(bright_corner(32, 64), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    data = path.read_bytes()
    identity = struct.pack(">9I", 0x10000, 0, 0, 0, 0x10000, 0, 0, 0, 0x40000000)
    clockwise = struct.pack(">9I", 0, 0x10000, 0, 0xFFFF0000, 0, 0, 0, 0, 0x40000000)
    at = data.rfind(identity)
    assert data.count(identity) == 2, "the muxer wrote other headers than this test expects"
    path.write_bytes(data[:at] + clockwise + data[at + len(identity):])
    with av.open(str(path)) as container:
        assert next(container.decode(video=0)).rotation == -90
    return path


def test_a_videos_display_rotation_is_applied(tmp_path):
    clip = Clip(rotated_video(tmp_path / "portrait.mp4"), "x", False)
    frames = read_frames(clip, 5)
    assert frames.shape[0] == 5
    assert_upright(frames)
    assert probe_clip(clip, 5) == (5, 32, 64)
    assert choose_bucket(clip, *probe_clip(clip, 5), BUCKETS).label() == "32x64x5"


@pytest.mark.parametrize("rotation, expected", [(0, [[1, 2], [3, 4]]), (-90, [[3, 1], [4, 2]]), (90, [[2, 4], [1, 3]]),
                                                (180, [[4, 3], [2, 1]]), (-180, [[4, 3], [2, 1]])])
def test_upright_frame_turns_by_the_display_matrix_counter_clockwise(rotation, expected):
    """PyAV's frame.rotation is FFmpeg's av_display_rotation_get: counter-clockwise degrees; -90 is
    what FFmpeg's autorotate shows turned clockwise."""
    frame = np.array([[1, 2], [3, 4]])[..., None]
    assert upright_frame(frame, rotation)[..., 0].tolist() == expected


def test_captions_must_be_utf8_and_a_bom_is_dropped(tmp_path):
    folder = make_dataset(tmp_path / "data", clips=1)
    (folder / "clip0.txt").write_bytes("a cat on a sofa".encode("utf-8-sig"))
    assert [c.caption for c in scan_folder(folder)] == ["a cat on a sofa"]
    for encoding, text in (("utf-16", "a cat on a sofa"), ("cp1252", "a café scene")):
        (folder / "clip0.txt").write_bytes(text.encode(encoding))
        with pytest.raises(TrainingError, match=r"caption .*clip0\.txt is not UTF-8 text.*save it as UTF-8"):
            scan_folder(folder)


def test_probe_reads_headers_and_agrees_with_decoding(tmp_path):
    for suffix in (".mp4", ".mkv"):  # Matroska keeps no frame count: counted by decoding, up to the largest bucket
        path = write_video(tmp_path / f"clip{suffix}", 7, 48, 32, seed=1)
        clip = Clip(path, "x", False)
        assert probe_clip(clip, 5) == (5, 48, 32) and probe_clip(clip, 100) == (7, 48, 32), suffix
        assert tuple(read_frames(clip, 100).shape) == (7, 32, 48, 3)


def test_a_cached_folder_is_not_decoded_again(tiny_loaded, tmp_path, monkeypatch):
    loaded = tiny_loaded("wan2.1-t2v")
    folder = make_dataset(tmp_path / "data", clips=2, image=True)
    first = prepare_tiny(loaded, folder, tmp_path / "cache", frames=(9,))

    def no_decoding(clip, max_frames):
        raise AssertionError(f"{clip.path} was decoded, though its entry is cached")
    monkeypatch.setattr("vidmem.training.prepare.read_frames", no_decoding)
    again = prepare_tiny(loaded, folder, tmp_path / "cache", frames=(9,))
    assert again.receipt["reused"] == 3 and again.samples == first.samples


def test_a_clip_with_fewer_frames_than_its_header_says_takes_the_bucket_it_decodes_to(tiny_loaded, tmp_path,
                                                                                     monkeypatch):
    """An MP4 whose header counts frames an edit list cuts decodes to fewer: it trains in the bucket its
    frames allow (as it did when buckets came from decoding), and is named, before any model work, when
    it decodes to fewer than the smallest bucket."""
    folder = make_dataset(tmp_path / "data", clips=1, frames=5)
    monkeypatch.setattr("vidmem.training.prepare.probe_clip", lambda clip, max_frames: (9, 48, 32))
    data = prepare_tiny(tiny_loaded("wan2.1-t2v"), folder, tmp_path / "cache", frames=(9, 5))
    assert [sample.bucket.frames for sample in data.samples] == [5]
    again = prepare_tiny(tiny_loaded("wan2.1-t2v"), folder, tmp_path / "cache", frames=(9, 5))
    assert again.receipt["reused"] == 1 and again.samples == data.samples  # the decoded bucket's entry found
    with pytest.raises(TrainingError, match=r"clip0\.mp4' has 5 frames, fewer than the smallest frame bucket \(9\)"):
        prepare_tiny(tiny_loaded("wan2.1-t2v"), folder, tmp_path / "cache9", frames=(9,))
    assert not (tmp_path / "cache9").exists()


def test_frames_are_fitted_one_at_a_time(monkeypatch):
    """A clip is scaled frame by frame: the whole clip in float at full size was 2 GiB for 81 frames
    of 1080p, beside the uint8 frames."""
    frames = torch.randint(0, 255, (5, 40, 80, 3), dtype=torch.uint8)
    bucket = choose_bucket(Clip("a", "x", False), 5, 80, 40, BucketSettings(((32, 16),), (5,)))
    expected = fit_to_bucket(frames, bucket)
    batches = []
    interpolate = torch.nn.functional.interpolate

    def spy(image, *args, **kwargs):
        batches.append(image.shape[0])
        return interpolate(image, *args, **kwargs)
    monkeypatch.setattr(torch.nn.functional, "interpolate", spy)
    fitted = fit_to_bucket(frames, bucket)
    assert batches == [1] * 5
    assert fitted.shape == (3, 5, 16, 32) and torch.equal(fitted, expected)
