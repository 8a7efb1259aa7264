"""vidmem in the real ComfyUI frontend, in a real browser: skipped unless VIDMEM_COMFYUI_URL and
VIDMEM_BROWSER are set.

`tests/browser/check_templates.mjs` (run here with `node`) opens the running ComfyUI in headless
Chromium through playwright-core, closes the first-visit Templates overlay, and for every UI
template in workflows/: loads it with `app.loadGraphData(json)`, checks that no node type is
missing and every node loaded, checks that the frontend's own `app.graphToPrompt()` gives exactly
its API twin in workflows/api/, and takes a screenshot. On one template it then gives the Sampler
the tiny models' size and changes the Strategy's blocks_to_swap twice: the plan drawn on the node
(chart and text, from GET /vidmem/plan) must change each time with nothing queued (screenshot
`strategy_live_plan.png`). It loads an older Strategy layout (width/height/frames before the
budgets) and checks the budgets land on the right inputs. It runs templates from the browser at
the tiny size, waits for the receipts on the Sampler and Decode nodes, and checks that
afterwards no node overlaps another and every node stays inside its group (screenshot
`<template>_receipts.png`; RUN_TEMPLATES: the block-swap one and the fp8 single-file one); and
that "Free VRAM now" posts ComfyUI's /free. It also checks that
the `vidmem.ui` extension registered, the memory meter shows figures from GET /vidmem/memory and
sits clear of the canvas info in the bottom-left corner, and the five help pages are served.
Screenshots go to docs/screenshots/ (or VIDMEM_SCREENSHOTS), re-encoded with a 128-colour palette
to stay small. VIDMEM_RUN_ALL=1 runs and layout-checks every template, not only one;
VIDMEM_THUMBNAILS=1 rewrites each template's Templates-browser card image, workflows/<title>.jpg,
drawn from the template's extra.vidmem.card by tests/browser/template_cards.mjs. Every template
opens with its note below the workflow's name the frontend draws over the canvas.

How to run it (ComfyUI 0.8.0 on the CPU, loopback only; nothing here is a repo dependency):

    apt-get install -y chromium                       # Debian's Chromium
    mkdir -p /tmp/pw && (cd /tmp/pw && npm install playwright-core)
    ln -sfn "$PWD" /path/to/ComfyUI/custom_nodes/vidmem
    python tests/workflow_runner.py place-models /path/to/ComfyUI/models/diffusers
    (cd /path/to/ComfyUI && python main.py --cpu --listen 127.0.0.1 --port 8188) &
    VIDMEM_COMFYUI_URL=http://127.0.0.1:8188 VIDMEM_BROWSER=/usr/bin/chromium \\
        VIDMEM_NODE_PATH=/tmp/pw/node_modules python -m pytest -q -rA tests/test_web_browser.py

VIDMEM_NODE_PATH (or NODE_PATH) is where `require("playwright-core")` finds the package.
The API workflows are queued with `vidmem queue` by tests/test_live_host.py (same server URL).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
URL = os.environ.get("VIDMEM_COMFYUI_URL", "").rstrip("/")
BROWSER = os.environ.get("VIDMEM_BROWSER", "")
SCREENSHOTS = Path(os.environ.get("VIDMEM_SCREENSHOTS", REPO / "docs" / "screenshots"))
# Run from the browser to see the receipts on the nodes: the block-swap template (the live plan and
# the older layout are checked on it too), the fp8 single-file one (Load Video Model Files) and the
# A14B 4-step one (two Load LoRA nodes, one per expert, in the column between loader and Sampler) and
# the fast A14B one (a Step Cache under the Sampler; calibrated on the tiny models, which have no ratios).
RUN_TEMPLATES = ("wan21_t2v_blockswap", "wan21_t2v_14b_fp8_files", "wan22_t2v_a14b_lightx2v_4step",
                 "wan22_t2v_a14b_fp8_magcache")
RUN_ALL = os.environ.get("VIDMEM_RUN_ALL") == "1"
THUMBNAILS = os.environ.get("VIDMEM_THUMBNAILS") == "1"
THUMBNAIL_WIDTH = 800

pytestmark = pytest.mark.skipif(not (URL and BROWSER), reason="set VIDMEM_COMFYUI_URL and VIDMEM_BROWSER (path to chromium)")


def shrink_png(path: Path, colors: int = 128) -> int:
    """Re-encode a screenshot with an adaptive palette (UI screenshots have few colours)."""
    from PIL import Image

    with Image.open(path) as image:
        small = image.convert("RGB").quantize(colors=colors, method=Image.Quantize.MEDIANCUT)
    small.save(path, optimize=True)
    return path.stat().st_size


@pytest.fixture(scope="module")
def report():
    node = shutil.which("node")
    assert node, "Node.js (node) is needed to drive the browser"
    env = dict(os.environ)
    env["NODE_PATH"] = os.environ.get("VIDMEM_NODE_PATH", env.get("NODE_PATH", ""))
    command = [node, str(REPO / "tests" / "browser" / "check_templates.mjs"), "--url", URL, "--browser", BROWSER,
               "--workflows", str(REPO / "workflows"), "--screenshots", str(SCREENSHOTS), "--run", ",".join(RUN_TEMPLATES)]
    command += ["--run-all"] if RUN_ALL else []
    command += ["--thumbnails", str(REPO / "workflows")] if THUMBNAILS else []
    result = subprocess.run(command, capture_output=True, text=True, timeout=1800, env=env)
    if "Cannot find module 'playwright-core'" in result.stderr:
        pytest.fail("playwright-core not found: `npm install playwright-core` in a scratch folder and set VIDMEM_NODE_PATH "
                    "to its node_modules")
    assert result.stdout.strip(), f"no report (exit {result.returncode}): {result.stderr[-3000:]}"
    data = json.loads(result.stdout)
    data["exit"] = result.returncode
    print(json.dumps({k: v for k, v in data.items() if k not in ("templates", "livePlan")}, indent=1))
    if THUMBNAILS:
        for template in data["templates"]:
            shrink_jpeg(Path(template["thumbnail"]))
    return data


def shrink_jpeg(path: Path) -> int:
    """A Templates-browser card image scaled to THUMBNAIL_WIDTH, JPEG quality 75."""
    from PIL import Image

    with Image.open(path) as image:
        size = (THUMBNAIL_WIDTH, round(image.height * THUMBNAIL_WIDTH / image.width))
        small = image.convert("RGB").resize(size, Image.Resampling.LANCZOS)
    small.save(path, "JPEG", quality=75, optimize=True)
    return path.stat().st_size


def test_no_problems_reported(report):
    assert report["problems"] == [] and report["exit"] == 0, report["problems"]


def test_extension_meter_and_help_pages(report):
    assert report["extensions"] == ["vidmem.ui"]
    assert "RAM" in report["meter"] and "Free VRAM now" in report["meter"]
    assert set(report["helpPages"].values()) == {200}


def test_every_template_loads_with_no_missing_nodes_and_matches_its_api_file(report):
    titles = {p.stem for p in (REPO / "workflows").glob("*.json")}
    assert {t["title"] for t in report["templates"]} == titles
    for t in report["templates"]:
        assert t["missing"] == [] and t["loaded"] == t["expected"], t["name"]
        assert t["apiDifferences"] == [] and t["extraApiNodes"] == [], t["name"]


def test_screenshots_are_small_pngs(report):
    shots = [Path(t["screenshot"]) for t in report["templates"]] + [Path(r["screenshot"]) for r in report["runs"] if "screenshot" in r]
    shots += [Path(report["livePlan"]["screenshot"]), Path(report["templatesBrowser"]["screenshot"])]
    sizes = {shot.name: shrink_png(shot) for shot in shots}
    print(json.dumps(sizes, indent=1))
    assert all(shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for shot in shots)
    assert max(sizes.values()) < 250_000, sizes


def test_receipts_appear_on_the_nodes_after_a_run(report):
    run = report["run"]
    assert run["strategy"].startswith("your settings: fit") and "\noffload=block_swap" in run["strategy"]
    assert "denoise:" in run["sampler"] and "swap cost:" in run["sampler"] and "peak RSS" in run["sampler"]
    assert "VAE:" in run["decode"]


def test_the_fp8_file_template_runs_from_the_browser(report):
    """Load Video Model Files on the tiny files under Comfy-Org's names, block swap, receipts on the nodes.
    (The browser's receipt tooltip does not show the weights' storage yet; the node's text does, which
    tests/test_live_host.py reads through `vidmem queue`.)"""
    run = next(r for r in report["runs"] if r["name"] == RUN_TEMPLATES[1])
    assert not run.get("timeout") and run["layoutProblems"] == [], run
    assert "denoise:" in run["sampler"] and "swap cost:" in run["sampler"] and "VAE:" in run["decode"], run
    assert Path(run["screenshot"]).is_file()


def test_the_lora_template_runs_from_the_browser_with_its_receipts_clear_of_each_other(report):
    """Two Load LoRA nodes (tiny LoRAs under the Lightning file names), 4-step sampler controls."""
    run = next(r for r in report["runs"] if r["name"] == RUN_TEMPLATES[2])
    assert not run.get("timeout") and run["layoutProblems"] == [], run
    assert "denoise:" in run["sampler"] and "VAE:" in run["decode"], run
    assert Path(run["screenshot"]).is_file()


def test_the_fast_template_runs_its_step_cache_from_the_browser(report):
    """The Step Cache under the Sampler (tiny models have no published ratios: it calibrates there)."""
    run = next(r for r in report["runs"] if r["name"] == RUN_TEMPLATES[3])
    assert not run.get("timeout") and run["layoutProblems"] == [], run
    assert "step cache mag_cache" in run["sampler"] and "ratios saved as" in run["sampler"], run["sampler"]


def test_every_template_opens_with_its_note_below_the_workflows_name(report):
    assert all(t["noteBelowName"]["clear"] for t in report["templates"]), [t["noteBelowName"] for t in report["templates"]]


def test_the_strategy_plan_changes_with_blocks_to_swap_before_anything_is_queued(report):
    steps = report["livePlan"]["steps"]
    assert [s["status"] for s in steps[1:]] == ["ok", "ok"], [s["text"][:200] for s in steps]
    assert "blocks_to_swap=20" in steps[0]["text"], "the template's 20 blocks, more than the tiny model has"
    assert "blocks_to_swap=1" in steps[1]["text"] and "blocks_to_swap=2" in steps[2]["text"]
    assert len({s["text"] for s in steps}) == 3 and steps[1]["chart"] != steps[0]["chart"]
    assert "> your settings" in steps[2]["table"] and "budget" in steps[2]["table"]
    assert report["livePlan"]["queued"] == 0


def test_an_older_strategy_layout_keeps_its_budgets(report):
    legacy = report["legacy"]
    assert {key: legacy[key] for key in ("vram_budget_gb", "ram_budget_gb", "width")} == \
        {"vram_budget_gb": 6.5, "ram_budget_gb": 48, "width": None}
    assert legacy["loaded"] == legacy["nodes"] > 0  # every node of the template, whatever it holds


def test_no_node_overlaps_another_after_a_run_and_groups_hold_their_nodes(report):
    assert report["runs"] and all(run.get("layoutProblems") == [] for run in report["runs"]), \
        {run["name"]: run.get("layoutProblems") for run in report["runs"]}


def test_the_templates_browser_shows_each_template_by_its_title_with_its_card(report):
    browser = report["templatesBrowser"]
    titles = {p.stem for p in (REPO / "workflows").glob("*.json")}
    assert {name[:-4] for status, name in browser["cards"] if status == 200} == titles
    assert all(status == 200 for status, _name in browser["cards"]), browser["cards"]
    assert all(title.replace("-", " ") in browser["text"] for title in titles), browser["text"][:2000]


def test_the_meter_sits_clear_of_the_canvas_info_corner(report):
    box = report["meterBox"]
    assert box["left"] > 300 and box["bottom"] <= 900
    assert report["freeRequests"] == [json.dumps({"unload_models": True, "free_memory": True}, separators=(",", ":"))]
