"""MagCache ratio files and the Step Cache node's words about them (review): a file whose ratios are not lists is
refused by name (it was a bare TypeError), models of one class and block count get files of their own, and the
node does not call a threshold of 0 "0.06" when the ratios bring their own."""

from __future__ import annotations

import json

import pytest

from vidmem.memory.strategy import StrategyError
from vidmem.nodes.cache import VidMemStepCache
from vidmem.pipelines.step_cache import StepCache, cache_with_ratios, model_key, ratio_file_name, write_ratio_file

NODE_CACHE = StepCache("mag_cache", threshold=0.5, mag_ratios=(1.0,))


@pytest.mark.parametrize("ratios", [5, None, "1.0, 0.9", {"a": 1}])
def test_a_ratio_file_whose_ratios_are_not_lists_is_refused_by_name(tiny_loaded, tmp_path, ratios):
    loaded = tiny_loaded("wan2.1-t2v")
    path = tmp_path / "odd.json"
    path.write_text(json.dumps({"version": 1, "model": model_key(loaded), "steps": 10,
                                "ratios": {"transformer": ratios}}), encoding="utf-8")
    with pytest.raises(StrategyError, match="mag_ratios 'odd.json' is not a ratio file vidmem wrote"):
        cache_with_ratios(NODE_CACHE, loaded, path.name, tmp_path)


def test_models_of_one_class_and_block_count_calibrate_into_files_of_their_own(tiny_loaded, tmp_path):
    """Tiny Wan 2.1 and Wan 2.2 A14B are both WanPipeline with 2 blocks (as real Wan 2.1 1.3B and Wan 2.2 TI2V-5B
    both have 30): one name for both let one calibration overwrite the other."""
    one, two = tiny_loaded("wan2.1-t2v"), tiny_loaded("wan2.2-a14b")
    assert one.class_name == two.class_name and model_key(one) != model_key(two)
    assert ratio_file_name(one, 10) != ratio_file_name(two, 10)
    first = write_ratio_file(tmp_path, one, 10, {"transformer": [1.0] * 10}, "default")
    second = write_ratio_file(tmp_path, two, 10, {"transformer": [1.0] * 4, "transformer_2": [1.0] * 6}, "default")
    assert first != second and first.is_file() and second.is_file()
    assert cache_with_ratios(NODE_CACHE, one, first.name, tmp_path).ratio_steps == 10
    with pytest.raises(StrategyError, match="was measured on"):
        cache_with_ratios(NODE_CACHE, one, second.name, tmp_path)


def test_a_file_named_the_older_way_is_still_read_and_checked_by_its_model(tiny_loaded, tmp_path):
    loaded = tiny_loaded("wan2.1-t2v")
    written = write_ratio_file(tmp_path, loaded, 10, {"transformer": [1.0] * 10}, "default")
    old = written.rename(tmp_path / "WanPipeline-2blocks-10steps.json")
    assert dict(cache_with_ratios(NODE_CACHE, loaded, old.name, tmp_path).expert_ratios)["transformer"] == (1.0,) * 10
    with pytest.raises(StrategyError, match="was measured on"):
        cache_with_ratios(NODE_CACHE, tiny_loaded("wan2.2-a14b"), old.name, tmp_path)


def test_the_node_does_not_name_0_06_for_a_threshold_the_ratios_bring():
    tooltip = VidMemStepCache.INPUT_TYPES()["required"]["threshold"][1]["tooltip"]
    assert "published" in tooltip and "retention and max_skip_steps stay this node's values" in tooltip
    args = dict(method="mag_cache", retention=0.2, max_skip_steps=3)
    (text,) = VidMemStepCache().build(threshold=0.0, mag_ratios="auto", **args)["ui"]["text"]
    assert "threshold=0.06" not in text and "published with the ratios" in text and "max_skip_steps=3" in text, text
    (chosen,) = VidMemStepCache().build(threshold=0.1, mag_ratios="auto", **args)["ui"]["text"]
    assert "threshold=0.1 " in chosen, chosen
    (fbc,) = VidMemStepCache().build(threshold=0.0, mag_ratios="auto", **dict(args, method="first_block_cache"))["ui"]["text"]
    assert fbc == "Step Cache: first_block_cache threshold=0.05", fbc


def test_the_plan_names_the_threshold_the_run_uses_for_a_calibrated_file(tiny_loaded, tmp_path):
    """A file vidmem calibrated carries no threshold, so a node threshold of 0 runs at MagCache's default: the plan
    said "threshold 0" while the run used 0.06. The plan, describe() and diffusers' config read one value."""
    from vidmem.pipelines.step_cache import DEFAULT_THRESHOLDS, CacheMethod, cache_plan

    loaded = tiny_loaded("wan2.1-t2v")
    written = write_ratio_file(tmp_path, loaded, 10, {"transformer": [1.0] * 10}, "default")
    assert "threshold" not in json.loads(written.read_text(encoding="utf-8"))
    default = DEFAULT_THRESHOLDS[CacheMethod.MAG]
    for node_threshold, expected in ((0.0, default), (0.3, 0.3)):
        node = StepCache("mag_cache", threshold=node_threshold, mag_ratios=(1.0,))
        plan = cache_plan(model_key(loaded), 10, ["transformer"], node, written.name, tmp_path)
        assert f"(threshold {expected:g}," in plan.text, plan.text
        run = cache_with_ratios(node, loaded, written.name, tmp_path)
        assert run.effective_threshold == expected and f"threshold={expected:g} " in run.describe()
        assert run.diffusers_config(10, "transformer").threshold == expected


def test_a_ratio_file_nested_past_pythons_stack_is_refused_by_name(tiny_loaded, tmp_path):
    """Under the size cap, "[" * 200000 made json raise RecursionError, which escaped raw from the Sampler's
    reading of the file and from the plan."""
    from vidmem.pipelines.step_cache import cache_plan, read_json_file

    loaded = tiny_loaded("wan2.1-t2v")
    (tmp_path / "deep.json").write_text("[" * 200000, encoding="utf-8")
    with pytest.raises(StrategyError, match="mag_ratios 'deep.json' is not a readable JSON ratio file"):
        read_json_file(tmp_path / "deep.json", "mag_ratios")
    with pytest.raises(StrategyError, match="'deep.json' is not a readable JSON ratio file"):
        cache_with_ratios(NODE_CACHE, loaded, "deep.json", tmp_path)
    plan = cache_plan(model_key(loaded), 10, ["transformer"], NODE_CACHE, "deep.json", tmp_path)
    assert "'deep.json' is not a readable JSON ratio file" in plan.text, plan.text
