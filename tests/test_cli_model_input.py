"""`vidmem plan --model` given the wrong kind of file or folder: one line naming the input and the fix,
exit 2 (bad input), never a traceback or exit 1 (which says "nothing fits")."""

from __future__ import annotations

import json
import shutil

import pytest

from vidmem.cli import main

PLAN = ["plan", "--vram", "8", "--ram", "16", "--size", "32x32", "--frames", "9"]


def plan(capsys, model: str) -> tuple[int, str, str]:
    code = main(PLAN + ["--model", model])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def partial_folder(source, target, keep: tuple[str, ...]):
    """A copy of `source`'s configs (no weights) whose model_index.json lists only `keep` of its modules."""
    index = json.loads((source / "model_index.json").read_text())
    kept = {k: v for k, v in index.items() if not (isinstance(v, list) and k in ("transformer", "vae")) or k in keep}
    target.mkdir()
    (target / "model_index.json").write_text(json.dumps(kept))
    for name, value in kept.items():
        if isinstance(value, list) and (source / name / "config.json").is_file():
            (target / name).mkdir()
            shutil.copy(source / name / "config.json", target / name / "config.json")
    return target


def test_a_workflow_json_is_not_a_model_config(tmp_path, capsys):
    workflow = tmp_path / "workflow.json"
    workflow.write_text(json.dumps({"3": {"class_type": "VidMemVideoSampler", "inputs": {}}}))
    code, _, err = plan(capsys, str(workflow))
    assert code == 2 and "Traceback" not in err
    assert f"'{workflow}' is not a vidmem model config" in err and "for a diffusers folder give the folder" in err


def test_a_model_index_json_plans_its_folder(tiny_folder, capsys):
    folder = tiny_folder("wan2.1-t2v")
    capsys.readouterr()  # the fixture's own progress output
    by_index = plan(capsys, str(folder / "model_index.json"))
    by_folder = plan(capsys, str(folder))
    assert by_index[0] == 0 and by_index[1] == by_folder[1] and "Traceback" not in by_index[2]


@pytest.mark.parametrize("keep, missing", [(("vae",), "lists no denoiser (transformer"), (("transformer",), "lists no vae")])
def test_a_folder_without_a_denoiser_or_a_vae_is_named(tiny_folder, tmp_path, capsys, keep, missing):
    folder = partial_folder(tiny_folder("wan2.1-t2v"), tmp_path / "partial", keep)
    code, _, err = plan(capsys, str(folder))
    assert code == 2 and f"model folder '{folder}' {missing}" in err, err
