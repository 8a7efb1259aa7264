"""vidmem in the real ComfyUI frontend, in a real browser: skipped unless VIDMEM_COMFYUI_URL and
VIDMEM_BROWSER are set.

`tests/browser/check_templates.mjs` (run here with `node`) opens the running ComfyUI in headless
Chromium through playwright-core, closes the first-visit Templates overlay, and for every UI
template in workflows/: loads it with `app.loadGraphData(json)`, checks that no node type is
missing and every node loaded, checks that the frontend's own `app.graphToPrompt()` gives exactly
the API file in workflows/api/, and takes a screenshot. It also checks that the `vidmem.ui`
extension registered, the memory meter shows figures from GET /vidmem/memory, the five help pages
are served, then runs one template from the browser at the tiny models' size and waits for the
receipts on the Memory Strategy, Sampler, Decode and Free VRAM nodes (screenshot
`<template>_receipts.png`), and that "Free VRAM now" posts ComfyUI's /free. Screenshots go to
docs/screenshots/ (or VIDMEM_SCREENSHOTS), re-encoded with a 128-colour palette to stay small.

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
RUN_TEMPLATE = "wan21_t2v_blockswap"  # run from the browser to see the receipts on the nodes

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
               "--workflows", str(REPO / "workflows"), "--screenshots", str(SCREENSHOTS), "--run", RUN_TEMPLATE]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    if "Cannot find module 'playwright-core'" in result.stderr:
        pytest.fail("playwright-core not found: `npm install playwright-core` in a scratch folder and set VIDMEM_NODE_PATH "
                    "to its node_modules")
    assert result.stdout.strip(), f"no report (exit {result.returncode}): {result.stderr[-3000:]}"
    data = json.loads(result.stdout)
    data["exit"] = result.returncode
    print(json.dumps({k: v for k, v in data.items() if k != "templates"}, indent=1))
    return data


def test_no_problems_reported(report):
    assert report["problems"] == [] and report["exit"] == 0, report["problems"]


def test_extension_meter_and_help_pages(report):
    assert report["extensions"] == ["vidmem.ui"]
    assert "RAM" in report["meter"] and "Free VRAM now" in report["meter"]
    assert set(report["helpPages"].values()) == {200}


def test_every_template_loads_with_no_missing_nodes_and_matches_its_api_file(report):
    names = {p.stem for p in (REPO / "workflows").glob("*.json")}
    assert {t["name"] for t in report["templates"]} == names
    for t in report["templates"]:
        assert t["missing"] == [] and t["loaded"] == t["expected"], t["name"]
        assert t["apiDifferences"] == [] and t["extraApiNodes"] == [], t["name"]


def test_screenshots_are_small_pngs(report):
    shots = [Path(t["screenshot"]) for t in report["templates"]] + [Path(report["run"]["screenshot"])]
    sizes = {shot.name: shrink_png(shot) for shot in shots}
    print(json.dumps(sizes, indent=1))
    assert all(shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for shot in shots)
    assert max(sizes.values()) < 250_000, sizes


def test_receipts_appear_on_the_nodes_after_a_run(report):
    run = report["run"]
    assert "tier: block_swap" in run["strategy"]
    assert "denoise:" in run["sampler"] and "swap cost:" in run["sampler"] and "peak RSS" in run["sampler"]
    assert "VAE:" in run["decode"] and "freed" in run["free"]
    assert report["freeRequests"] == [json.dumps({"unload_models": True, "free_memory": True}, separators=(",", ":"))]
