"""`vidmem demo` writes a playable video and its memory receipt, with no downloads."""

from __future__ import annotations

import json

import av

from vidmem.cli import main


def test_demo_writes_video_and_receipt(tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path), "--size", "64x64", "--frames", "9", "--steps", "2"]) == 0
    receipt = json.loads((tmp_path / "receipt.json").read_text())
    assert receipt["video"]["frames"] == 9
    assert {"sampler", "decode", "free"} <= set(receipt)
    assert receipt["sampler"]["stages"][1]["stage"] == "denoise"
    with av.open(str(tmp_path / "demo.mp4")) as container:
        frames = list(container.decode(video=0))
    assert len(frames) == 9 and (frames[0].width, frames[0].height) == (64, 64)
    assert json.loads(capsys.readouterr().out) == receipt  # the receipt is printed too


def test_demo_reports_bad_input_in_one_line(tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path), "--size", "64by64"]) == 2
    assert "--size '64by64' must look like WIDTHxHEIGHT" in capsys.readouterr().err
