"""GET /vidmem/plan for Load Video Pipeline with weight_dtype: the folder planned as the loader holds it."""

from __future__ import annotations

import pytest

from vidmem.nodes import host, plan_files
from vidmem.nodes.plan_route import PlanRequestError, parse_request, plan_answer
from vidmem.pipelines.configs import load_model
from vidmem.pipelines.loader import DTYPES, load_pipeline
from vidmem.pipelines.planning import plan_options

BUDGETS = (8 * 2**30, 32 * 2**30)
NAME = "CogVideoX-tiny"


@pytest.fixture
def folder(tiny_folder, monkeypatch):
    path = tiny_folder("cogvideox-t2v")
    monkeypatch.setattr(host, "resolve_model_folder", lambda name, given: path)
    plan_files._folder_storage.cache_clear()
    return path


def answer(folder, **fields):
    query = {"model": NAME, "dtype": "fp32", "width": "32", "height": "32", "frames": "9", **fields}
    return plan_answer(parse_request(query, [NAME], list(DTYPES)), lambda name, dtype: load_model(str(folder), dtype), BUDGETS)


@pytest.mark.parametrize("weight_dtype", ["default", "fp8_scaled", "gguf_q8_0", "fp32", "bf16"])
def test_the_route_plans_the_storage_the_loader_holds(folder, weight_dtype):
    plan = answer(folder, weight_dtype=weight_dtype)
    assert plan["status"] == "ok", plan
    loaded = plan_options(load_pipeline(folder, "fp32", weight_dtype=weight_dtype))
    assert plan["storage"] == dict(loaded.storage) and plan["on_disk"] is loaded.on_disk


def test_a_lower_weight_dtype_lowers_the_planned_ram_and_the_folders_own_format_is_the_disk_tier(folder):
    default, lowered, own = (answer(folder, weight_dtype=w) for w in ("default", "fp8_scaled", "fp32"))
    assert lowered["storage"] == {"transformer": "fp8_scaled", "text_encoder": "fp8_scaled"} and not lowered["on_disk"]
    assert lowered["rows"][0]["peak_ram_bytes"] < default["rows"][0]["peak_ram_bytes"]
    assert own["on_disk"] is True and default["storage"] == {} and default["on_disk"] is False


def test_a_bad_weight_dtype_names_the_widget(folder):
    with pytest.raises(PlanRequestError, match="weight_dtype='fp4'") as error:
        parse_request({"model": NAME, "width": "32", "height": "32", "frames": "9", "weight_dtype": "fp4"}, [NAME], list(DTYPES))
    assert error.value.name == "weight_dtype"
