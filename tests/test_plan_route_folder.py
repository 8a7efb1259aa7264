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


def test_a_wan_folder_at_a_size_beyond_its_positional_table_is_refused_in_words(tiny_folder, monkeypatch):
    """The tiny Wan's rotary table covers 32 patches (512 px): at a template's 832x480x81 the plan
    once gave diffusers' bare "shape '[1, 1, 52, -1]' is invalid"; it names the input and the fix."""
    path = tiny_folder("wan2.1-t2v")
    monkeypatch.setattr(host, "resolve_model_folder", lambda name, given: path)
    plan = answer(path, width="832", height="480", frames="81")
    assert plan["status"] == "error" and plan["input"] == "width", plan
    assert "positional embedding covers 32 patches of 16 px (512 px); use width 512 or less" in plan["error"]
    assert "shape" not in plan["error"]
    plan = answer(path, width="512", height="480", frames="129")
    assert plan["input"] == "frames" and "use frames 125 or less" in plan["error"], plan
    assert answer(path, width="512", height="512", frames="125")["status"] == "ok"


def test_a_size_the_model_cannot_run_for_another_reason_still_names_the_inputs(tiny_folder, monkeypatch):
    from vidmem.memory.plan.planner import plan_run
    from vidmem.memory.plan.stages import VideoShape
    from vidmem.memory import MemoryStrategy
    from vidmem.pipelines.family import ModelError

    model = load_model(str(tiny_folder("wan2.1-t2v")), "fp32")
    monkeypatch.setattr(type(model), "check_shape", lambda self, shape: None)  # past the named checks, into diffusers
    model._traces.clear()
    with pytest.raises(ModelError, match=r"^width=832, height=480, frames=9: .* cannot run .* change width, height or frames"):
        plan_run(model, VideoShape(832, 480, 9), MemoryStrategy())


def test_a_folder_changed_on_disk_is_planned_again(folder, tmp_path, monkeypatch):
    """The answer cache is keyed by the request: a folder's request carries its files' stamp, so a config edited
    (or weights swapped under the same names) is not served the old plan."""
    import json
    import shutil

    from vidmem.nodes.plan_route import PlanService

    copy = tmp_path / "folder"
    shutil.copytree(folder, copy)
    monkeypatch.setattr(host, "resolve_model_folder", lambda name, given: copy)
    query = {"model": NAME, "dtype": "fp32", "width": "32", "height": "32", "frames": "9"}
    before = parse_request(query, [NAME], list(DTYPES))
    assert parse_request(query, [NAME], list(DTYPES)) == before  # unchanged: the same request, served from the cache
    planned = plan_answer(before, lambda name, dtype: load_model(str(copy), dtype), BUDGETS)
    config = copy / "transformer" / "config.json"
    values = json.loads(config.read_text())
    values["num_layers"] += 6
    config.write_text(json.dumps(values))
    after = parse_request(query, [NAME], list(DTYPES))
    assert after != before and after.folder_stamp != before.folder_stamp
    assert PlanService(lambda request: {"status": "ok"})._cached(after) is None
    replanned = plan_answer(after, lambda name, dtype: load_model(str(copy), dtype), BUDGETS)
    assert replanned["rows"][0]["peak_ram_bytes"] > planned["rows"][0]["peak_ram_bytes"]  # the model read again
