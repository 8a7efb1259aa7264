"""bench/planner.py's published figures: every entry names its source and what the source leaves
unstated, and is planned at a shot its model accepts. Planning them is the bench's job (about 40 s),
so this checks the declarations only."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.planner import published_figures  # noqa: E402

FIGURES = published_figures()


def test_each_family_with_a_published_figure_has_its_rows():
    assert {f.model.split("-")[0] for f in FIGURES} >= {"cogvideox", "hunyuanvideo1.5"}


@pytest.mark.parametrize("figure", FIGURES, ids=[f.case for f in FIGURES])
def test_a_published_figure_names_its_source_and_its_unstated_settings_at_a_valid_shot(figure):
    from vidmem.pipelines.configs import load_model
    from vidmem.pipelines.loader import family_for

    assert figure.figure and any(ch.isdigit() for ch in figure.figure), figure
    assert len(figure.source) > 20 and len(figure.settings) > 10, figure
    model = load_model(figure.model)
    width, height, frames = figure.shape
    spec = family_for(model.pipeline_class)
    assert spec.frames_error(frames) is None, spec.frames_error(frames)
    grid = model.components["vae"].config.get("spatial_compression_ratio", 8)
    assert width % grid == 0 and height % grid == 0, (figure.shape, grid)
