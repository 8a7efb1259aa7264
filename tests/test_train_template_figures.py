"""The train templates' notes quote the training planner (a predicted peak, and the sequential peak an
8-12 GB card falls back to): each quoted figure is what the quoted `vidmem plan` command prints today,
so a planner change that moves them cannot leave the templates promising old numbers."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from vidmem.cli import main

WORKFLOWS = Path(__file__).resolve().parents[1] / "workflows"
QUOTE = re.compile(r"predicted peak ([\d.]+) GiB \(vidmem plan ([^)]*)\)")
SEQUENTIAL = re.compile(r"offload = sequential \(([\d.]+) GiB")


def _notes(path: Path) -> str:
    """Every string of the workflow (its notes among them), joined."""
    def strings(value):
        if isinstance(value, str):
            yield value
        elif isinstance(value, dict):
            for item in value.values():
                yield from strings(item)
        elif isinstance(value, list):
            for item in value:
                yield from strings(item)
    return "\n".join(strings(json.loads(path.read_text())))


def _peaks(output: str) -> dict[str, float]:
    """Strategy -> peak VRAM (GiB) from the training plan's table."""
    lines = output.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("strategy"))
    peaks = {}
    for line in lines[header + 1:]:
        if not line.strip():
            break
        cells = re.split(r"\s{2,}", line.strip())
        peaks[cells[0]] = float(cells[4].split()[0])  # strategy, weights, LoRA+grads+states, activations, peak VRAM
    return peaks


TRAIN_TEMPLATES = sorted(WORKFLOWS.glob("Train *.json"))


@pytest.mark.parametrize("path", TRAIN_TEMPLATES, ids=lambda p: p.stem)
def test_the_quoted_training_peaks_are_the_planners(path, capsys, monkeypatch):
    monkeypatch.setenv("VIDMEM_PLAN_CACHE", "0")
    notes = _notes(path)
    quoted = QUOTE.search(notes)
    assert quoted, f"{path.name} quotes no predicted peak"
    assert main(["plan", *shlex.split(quoted.group(2))]) == 0
    peaks = _peaks(capsys.readouterr().out)
    assert f"{peaks['model']:.1f}" == quoted.group(1), (path.name, peaks)
    fallback = SEQUENTIAL.search(notes)
    assert fallback and f"{peaks['sequential']:.1f}" == fallback.group(1), (path.name, peaks)


def test_there_are_train_templates_to_check():
    assert len(TRAIN_TEMPLATES) >= 3


def test_the_readme_quotes_the_templates_figures():
    """README's train-template paragraph repeats the three peaks: the same figures as the templates."""
    readme = " ".join((WORKFLOWS.parent / "README.md").read_text().split())
    quoted = re.search(r"predicted training peaks ([\d.]+) GiB for Wan 1\.3B .*?, ([\d.]+) GiB for CogVideoX-2b .*?, "
                       r"([\d.]+) GiB for TI2V-5B", readme)
    assert quoted, "README no longer quotes the train templates' peaks"
    names = ("Train Wan 2.1 1.3B LoRA", "Train CogVideoX-2b LoRA", "Train Wan 2.2 5B LoRA")
    for name, figure in zip(names, quoted.groups()):
        path = next(p for p in TRAIN_TEMPLATES if p.stem.startswith(name))
        assert QUOTE.search(_notes(path)).group(1) == figure, name
