"""bench/planner.py's published figures: every entry names its source and what the source leaves
unstated, and is planned at a shot its model accepts. Planning them is the bench's job (about 40 s),
so this checks the declarations only. And docs/long-video.md quotes the JSON it names
(bench/long_video.py writes it), so a re-plan that moves a figure cannot leave the doc behind."""

from __future__ import annotations

import json
import re
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


ROOT = Path(__file__).resolve().parents[1]


def test_the_long_video_doc_quotes_the_json_it_names():
    doc = (ROOT / "docs" / "long-video.md").read_text()
    (source,) = re.findall(r"From (bench/results/long-video-[\w.-]+\.json)", doc)
    found = json.loads((ROOT / source).read_text())
    rows = [line for line in doc.splitlines() if line.startswith("| ") and line.rstrip().endswith(" |") and " GiB |" in line]
    assert len(rows) == len(found["plans"]), rows
    for row, plan in zip(rows, found["plans"]):
        cells = [cell.strip() for cell in row.strip().strip("|").split("|")]
        width, height = plan["size"]
        assert f"{width}x{height}, {plan['window']} / {plan['frames']}" in cells[0], (cells[0], plan["model"])
        peaks = [f"{plan[shape]['sequential_peak_gib']:.2f} GiB" for shape in ("one_window", "windowed", "clip")]
        assert cells[1:] == [*peaks, f"x{plan['windowed_over_window']:.3f}"], (plan["model"], cells)
    run = found["run"]
    for case in ("window", "windowed", "clip"):
        assert f"+{run[case]['peak_growth_bytes'] / 2**20:.1f} MiB" in doc, case
    assert f"(latent {', '.join(run['windowed']['windows'])})" in doc
    assert f"(x{found['run_windowed_over_window']:.2f})" in doc
    decode = {plan["model"]: plan for plan in found["plans"]}
    for model, words in (("wan2.1-t2v-14b", "{:.1f} GiB with 256 px"), ("cogvideox-5b", "({:.1f} GiB tiled)")):
        figures = {f"{decode[model][shape]['sequential_decode_gib']:.1f}" for shape in ("one_window", "clip")}
        assert len(figures) == 1 and words.format(float(figures.pop())) in doc, model  # "the same for both lengths"


def test_the_activation_chunks_doc_quotes_the_plans_json_it_names():
    """docs/activation-chunks.md's 'What it buys' tables: the peaks per chunk count and the 8 GiB cells that
    chunks make fit are the named JSON's (bench/activations.py --skip-block writes it)."""
    doc = (ROOT / "docs" / "activation-chunks.md").read_text()
    heading = r"## What it buys \(planned, [\d-]+, `(bench/results/activations-plans-[\w.-]+\.json)`\)"
    (source,) = re.findall(heading, doc)
    plans = {(row["model"], row["weights"]): row for row in json.loads((ROOT / source).read_text())["plans"]}
    peaks = plans[("wan2.1-t2v-14b", "fp8_scaled")]["denoise_peak_by_chunks"]
    for label, key in (("allocated", "allocated_gib"), ("reserved (native allocator)", "device_gib")):
        (line,) = [line for line in doc.splitlines() if line.startswith(f"| {label} |")]
        cells = [cell.strip().split(" ")[0] for cell in line.strip().strip("|").split("|")[1:]]
        assert cells == [f"{peaks[count][key]:.2f}" for count in ("1", "2", "4", "8", "16", "32")], (label, cells)
    cells = (("wan2.1-t2v-14b", "fp8_scaled", "auto: block_swap {blocks}, {chunks} chunks, {gib:.1f} GiB"),
             ("hunyuanvideo1.5-t2v-720p", "bf16", "auto: sequential, {chunks} chunks, on disk, {gib:.1f} GiB"))
    for model, weights, words in cells:
        cards = plans[(model, weights)]["cards"]["8GiB"]
        auto = cards["auto"]
        assert not cards["off"]["fits"] and auto["fits"] and auto["activation_chunks"] > 1, model
        assert words.format(blocks=auto["blocks_to_swap"], chunks=auto["activation_chunks"],
                            gib=auto["peak_vram_gib"]) in doc, model
