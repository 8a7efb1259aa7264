"""docs/gpu.md quotes the H200's 2026-11-27 and 2026-11-28 results files: a rerun that moves a figure cannot
leave the doc behind (as tests/test_bench_published.py holds docs/long-video.md to its JSON)."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
DOC = (ROOT / "docs" / "gpu.md").read_text()
GIB = 2**30


def _section(heading: str) -> str:
    """docs/gpu.md's section under the `## ` heading that starts with `heading`, up to the next one."""
    start = DOC.index(f"\n{heading}") + 1
    end = DOC.find("\n## ", start)
    return DOC[start:] if end < 0 else DOC[start:end]


SECTION = _section("## On the H200 again (2026-11-27)")  # the lease these files came from
THIRD = _section("## A third H200 lease (2026-11-28)")


def _rows(prefix: str, section: str = SECTION) -> list[list[str]]:
    """The cells of the lease's table rows in docs/gpu.md that start with `prefix`."""
    return [[cell.strip().strip("*`") for cell in line.strip("|").split("|")]
            for line in section.splitlines() if line.startswith(prefix)]


def test_the_activation_chunks_table_quotes_its_json():
    found = json.loads((RESULTS / "activations-gpu-h200-2026-11-27.json").read_text())["block_cuda"]["tokens"]
    rows = _rows("| 32,760 (") + _rows("| 75,600 (")
    assert len(rows) == 10
    for cells in rows:
        tokens, chunks = re.sub(r"\D", "", cells[0].split(" ")[0]), cells[1]
        row = found[tokens]["rows"][chunks]
        assert cells[2] == f"{row['measured_peak_bytes'] / GIB:.3f}" and cells[3] == f"{row['predicted_peak_bytes'] / GIB:.3f}"
        assert cells[5] == f"{row['seconds'] * 1000:.1f}" and cells[6] == f"x{row['time_ratio']:.3f}"
        assert cells[7] == ("yes" if row["bitwise_equal"] else "no")


def test_the_third_leases_activation_chunks_table_quotes_its_json_and_the_earlier_ratio():
    found = json.loads((RESULTS / "activations-gpu-h200-2026-11-28.json").read_text())["block_cuda"]["tokens"]
    before = json.loads((RESULTS / "activations-gpu-h200-2026-11-27.json").read_text())["block_cuda"]["tokens"]
    rows = _rows("| 32,760 (", THIRD) + _rows("| 75,600 (", THIRD)
    assert len(rows) == 10
    for cells in rows:
        tokens, chunks = re.sub(r"\D", "", cells[0].split(" ")[0]), cells[1]
        row, earlier = found[tokens]["rows"][chunks], before[tokens]["rows"][chunks]
        assert cells[2] == f"{row['measured_peak_bytes'] / GIB:.3f}" and cells[3] == f"{row['predicted_peak_bytes'] / GIB:.3f}"
        assert cells[4] == f"{row['seconds'] * 1000:.1f}"
        assert cells[5].replace("*", "").startswith(f"x{row['time_ratio']:.3f}")
        assert chunks == "1" or f"(x{earlier['time_ratio']:.3f})" in cells[5]
        assert cells[6] == ("yes" if row["bitwise_equal"] else "no")


def test_the_stream_and_cold_disk_tables_quote_their_json():
    for name, file in (("block_swap_30", "gpu-stream-h200-2026-11-27.json"),
                       ("cold_disk_fp8_block_swap_40", "gpu-h200-2026-11-27-cold-disk.json")):
        rows = json.loads((RESULTS / file).read_text())["rows"]
        for row_name, row in rows.items():
            (cells,) = _rows(f"| `{row_name}` |")
            places = 3 if name == "block_swap_30" else 2
            assert cells[1] == f"{row['step_seconds']:.{places}f}", row_name
            hidden = f"{row['profile']['overlap'] * 100:.1f}%"
            assert hidden in cells, (row_name, hidden)


def test_the_keep_rows_warm_call_streams_nothing_as_the_doc_says():
    rows = json.loads((RESULTS / "gpu-warm-h200-2026-11-27-block-swap.json").read_text())["rows"]
    keep = rows["warm_block_swap_15_keep"]["calls"]["warm"]
    assert keep["streamed_bytes"] == 0 and keep["uploaded_bytes"] == 0
    (cells,) = _rows("| `warm_block_swap_15_keep` |")
    assert cells[7] == "0 B"
