"""The Memory Strategy's `auto` row is the row the Sampler's `auto` runs.

The chart may show `+disk` rows (the weights memory-mapped from their files) when the loader holds
the weights in RAM and RAM is short, but the Sampler plans with the weights as loaded
(pipelines/planning.choose_for, consider_disk=False): a `+disk` row is information about another
load, never the chosen one.
"""

from __future__ import annotations

from dataclasses import replace

from vidmem.memory.plan.planner import PlanError, PlanOptions, choose_strategy
from vidmem.memory.strategy import MemoryStrategy
from vidmem.memory.units import GiB
from vidmem.nodes.plan_route import parse_request, plan_answer
from vidmem.pipelines.configs import load_model

MODEL = "wan2.1-t2v-1.3b"


def _auto_query(ram_gb: str) -> dict:
    return {"model": MODEL, "dtype": "bf16", "width": "832", "height": "480", "frames": "81", "offload": "auto",
            "vram_budget_gb": "8", "ram_budget_gb": ram_gb}


def test_auto_never_chooses_a_disk_row_the_loader_does_not_hold_and_agrees_with_the_sampler():
    """Wan 2.1 1.3B at 832x480x81 in 8 GiB VRAM / 3 GiB RAM, folder weights in RAM: only `+disk` rows
    fit, so nothing runs as loaded; the Sampler's auto says so too (PlanError)."""
    request = parse_request(_auto_query("3"), [MODEL], ["bf16"])
    answer = plan_answer(request, load_model, (8 * GiB, 3 * GiB), device="cuda")
    assert answer["status"] == "ok" and answer["on_disk"] is False
    model = load_model(MODEL, "bf16")
    options = PlanOptions(device="cuda")
    try:
        sampler = choose_strategy(model, request.shape, 8 * GiB, 3 * GiB, replace(MemoryStrategy(), offload="model"),
                                  options, consider_disk=False)
    except PlanError:
        sampler = None
    if sampler is None:
        assert answer["chosen"] is None
    else:
        chosen = answer["rows"][answer["chosen"]]
        assert not chosen["on_disk"] and chosen["strategy"] == sampler.strategy.describe()
    disk_rows = [row for row in answer["rows"] if row["on_disk"]]
    assert disk_rows and any(row["fits"] for row in disk_rows)  # the information stays on the chart
    assert all(row["label"].endswith("+disk") and "weight_dtype" in row["needs"] for row in disk_rows)
    assert all(row["needs"] == "" for row in answer["rows"] if not row["on_disk"])
