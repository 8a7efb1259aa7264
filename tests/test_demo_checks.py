"""`vidmem demo` refuses what the nodes would refuse before it creates --out or builds the model:
a refused run leaves no folder behind and costs no model build."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vidmem.cli import main
from vidmem.pipelines import tiny


@pytest.fixture
def nothing_built(monkeypatch):
    def build(*args, **kwargs):
        raise AssertionError("the tiny model must not be built for a refused run")

    monkeypatch.setattr(tiny, "save_tiny_pipeline", build)


@pytest.mark.parametrize("flags, message", [
    (["--frames", "16"], "--frames 16 is not valid for wan: use 4k+1 frames"),
    (["--frames", "0"], "--frames 0 is not valid"),
    (["--steps", "0"], "--steps 0 must be at least 1"),
    (["--blocks-to-swap", "0"], "--blocks-to-swap 0 must be at least 1 for --offload block_swap"),
    (["--blocks-to-swap", "99"], "--blocks-to-swap 99 is more than --variant wan2.1-t2v's 2 transformer blocks; use "
                                 "1..2 (or --offload sequential to stream every layer)"),
    (["--size", "60x60"], "--size width 60 must be a multiple of 16"),
    (["--size", "0x0"], "--size width 0 must be from 16 to"),
    (["--seed", "-1"], "--seed -1 must be from 0 to 18446744073709551615"),
])
def test_a_run_the_nodes_would_refuse_is_refused_before_out_is_made(nothing_built, tmp_path, flags, message, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), *flags]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_an_unknown_offload_tier_is_refused_by_the_parser(nothing_built, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--out", str(tmp_path / "demo"), "--offload", "swap"])
    assert exit_.value.code == 2 and "invalid choice: 'swap'" in capsys.readouterr().err
    assert not (tmp_path / "demo").exists()


def test_out_that_is_a_file_is_refused_before_the_render(nothing_built, tmp_path, capsys):
    out = tmp_path / "afile"
    out.write_text("x")
    assert main(["demo", "--out", str(out)]) == 2
    assert f"--out {out} is a file, not a folder" in capsys.readouterr().err
    assert out.read_text() == "x"


def test_the_offload_choices_are_the_strategy_nodes():
    from vidmem.cli.demo import OFFLOAD_TIERS
    from vidmem.nodes.strategy import VidMemMemoryStrategy

    assert set(OFFLOAD_TIERS) == set(VidMemMemoryStrategy.INPUT_TYPES()["required"]["offload"][0])


TEXT_TO_VIDEO = [name for name, spec in tiny.TINY_SPECS.items() if not spec.needs_image]


@pytest.mark.parametrize("variant", TEXT_TO_VIDEO)
def test_every_listed_text_to_video_variant_runs_at_its_defaults(variant, tmp_path, capsys):
    """The default size and frames are the variant's own: CogVideoX 1.5's tiny rotary table covers 32 px,
    and a fixed 64x64 default crashed it inside diffusers."""
    steps = "2" if variant.startswith("ltx2") else "1"  # LTX-2's stretched schedule refuses one step (NaN latents)
    assert main(["demo", "--out", str(tmp_path), "--variant", variant, "--steps", steps]) == 0
    spec = tiny.tiny_spec(variant)
    video = json.loads((tmp_path / "receipt.json").read_text())["video"]
    assert video["size"] == [spec.width, spec.height] and video["frames"] == spec.frames


def test_cogvideox15_beyond_its_rotary_table_is_refused_by_name(nothing_built, tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), "--variant", "cogvideox1.5-t2v", "--size", "64x32"]) == 2
    assert ("--size width 64 is more than --variant cogvideox1.5-t2v can place: its positional embedding covers 2 "
            "patches of 16 px (32 px); use width 32 or less (its own size is 32x32)") in capsys.readouterr().err
    assert not out.exists()


def test_out_where_nothing_can_be_written_is_refused_before_the_build(nothing_built, tmp_path, capsys):
    """A folder under a file (NotADirectoryError, as /proc/self refuses files): refused by name, not a traceback
    after the render."""
    (tmp_path / "afile").write_text("x")
    out = tmp_path / "afile" / "sub"
    assert main(["demo", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"--out {out}: cannot write there (" in err and "give a writable folder" in err, err
    assert "Traceback" not in err


def test_a_failed_video_write_leaves_the_earlier_demo_as_it_was(tmp_path, monkeypatch):
    """demo.mp4 and receipt.json are replaced whole or not at all; the receipt names the variant, not the
    temporary folder the model was built in (gone when the demo ends)."""
    from vidmem.cli import demo

    assert main(["demo", "--out", str(tmp_path), "--steps", "1"]) == 0
    before = {path.name: path.read_bytes() for path in tmp_path.iterdir()}
    model = json.loads(before["receipt.json"])["model"]
    assert "--variant wan2.1-t2v" in model and "vidmem-demo-" not in model, model

    def disk_full(frames, path):
        Path(path).write_bytes(b"half a video")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(demo, "write_mp4", disk_full)
    with pytest.raises(OSError):
        main(["demo", "--out", str(tmp_path), "--steps", "1", "--seed", "1"])
    assert {path.name: path.read_bytes() for path in tmp_path.iterdir()} == before, "no half file, nothing replaced"
