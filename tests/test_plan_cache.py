"""The planner's disk cache (pipelines/configs/plan_cache.py): a hit gives exactly the plan a cold
computation gives, anything the numbers depend on misses when it changes, a damaged file is ignored."""

from __future__ import annotations

import json
import logging

import pytest

from vidmem.memory import MemoryStrategy
from vidmem.memory.offload import streamed_units
from vidmem.memory.plan.planner import GiB, PlanOptions, VideoShape, candidate_plans, recommended
from vidmem.memory.plan.advice import nothing_fits_message
from vidmem.memory.plan.schedule import slot_table, tensor_sizes
from vidmem.memory.residency import partition_slots
from vidmem.pipelines.configs import MODELS_DIR, _from_json, load_model
from vidmem.pipelines.configs import plan_cache

SHAPE = VideoShape(480, 320, 17)
BUDGETS = (6 * GiB, 16 * GiB)  # tight: block swap, tiling and the disk tier are all searched


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("VIDMEM_PLAN_CACHE", "1")
    monkeypatch.setenv("VIDMEM_CACHE_DIR", str(tmp_path))
    return tmp_path / "plan"


def _config(name: str = "wan2.1-t2v-1.3b") -> dict:
    return json.loads((MODELS_DIR / f"{name}.json").read_text())


def _plans(model):
    plans = candidate_plans(model, SHAPE, *BUDGETS)
    return plans, recommended(plans)


def test_a_hit_gives_the_plan_a_cold_computation_gives(cache_dir):
    cold = _plans(_from_json(_config(), None, disk_cache=False))
    first = _from_json(_config(), None)  # measures, and writes what it measured
    assert _plans(first) == cold
    assert any(cache_dir.rglob("traces-*.json")) and any(cache_dir.rglob("weights.json"))
    again = _from_json(_config(), None)  # a fresh process would start here
    assert _plans(again) == cold
    assert again._built == {}  # nothing built on meta: every number came from the cache


def test_a_hit_gives_the_advice_a_cold_computation_gives(cache_dir):
    """Nothing fits 3 GiB: the advice plans smaller shapes, each kept in its own file."""
    def advice(model):
        plans = candidate_plans(model, SHAPE, 3 * GiB, 16 * GiB)
        return nothing_fits_message(model, SHAPE, plans, MemoryStrategy(), PlanOptions())

    cold = advice(_from_json(_config(), None, disk_cache=False))
    assert advice(_from_json(_config(), None)) == cold
    again = _from_json(_config(), None)
    assert advice(again) == cold and again._built == {}


def test_a_changed_config_misses(cache_dir):
    _plans(_from_json(_config(), None))
    changed = _config()
    changed["components"]["transformer"]["config"]["num_layers"] = 29
    model = _from_json(changed, None)
    assert model._disk.folder != _from_json(_config(), None)._disk.folder
    plans, _ = _plans(model)
    assert model._built  # measured again
    assert model.weights("transformer").block_count == 29
    assert plans == _plans(_from_json(changed, None, disk_cache=False))[0]


@pytest.mark.parametrize("component", ["torch", "diffusers", "transformers", "source", "format"])
def test_a_changed_code_or_library_misses(cache_dir, monkeypatch, component):
    before = _from_json(_config(), None)
    _plans(before)
    identity = dict(plan_cache.code_identity(), **{component: "changed"})
    monkeypatch.setattr(plan_cache, "code_identity", lambda: identity)
    after = _from_json(_config(), None)
    assert after._disk.folder != before._disk.folder
    _plans(after)
    assert after._built


def test_the_cache_can_be_turned_off(cache_dir, monkeypatch):
    monkeypatch.setenv("VIDMEM_PLAN_CACHE", "0")
    model = _from_json(_config(), None)
    _plans(model)
    assert model._disk is None and not cache_dir.exists()


@pytest.mark.parametrize("damage", [b"{not json", b"[1, 2]", b'{"transformer|": {"table": 3}}'])
def test_a_damaged_file_is_ignored_with_a_log_line(cache_dir, caplog, damage):
    expected = _plans(_from_json(_config(), None, disk_cache=False))
    _plans(_from_json(_config(), None))
    for file in [*cache_dir.rglob("weights.json"), *cache_dir.rglob("traces-*.json")]:
        file.write_bytes(damage)
    with caplog.at_level(logging.WARNING, logger="vidmem"):
        model = _from_json(_config(), None)
        assert _plans(model) == expected
    assert "damaged plan cache" in caplog.text
    assert _plans(_from_json(_config(), None)) == expected  # rewritten whole by the measurement


def test_load_model_uses_the_cache():
    assert load_model("wan2.1-t2v-1.3b").disk_cache  # the CLI's and the node's path: the shipped model


@pytest.mark.parametrize("strategy", [MemoryStrategy(offload="sequential"), MemoryStrategy(offload="model"),
                                      *(MemoryStrategy(offload="block_swap", blocks_to_swap=n) for n in (1, 15, 30))])
def test_the_slot_table_splits_as_the_engine_does(strategy):
    model = load_model("wan2.1-t2v-1.3b")
    for name in ("transformer", "text_encoder", "vae"):
        module, blocks = model.module(name), model.blocks(name)
        table = slot_table(module, blocks)
        resident, per_unit, _ = table.units(strategy)
        units = streamed_units(module, blocks, strategy)
        if not units:
            assert per_unit == []
            continue
        expected_resident, expected_units = partition_slots(module, [members for _, members in units])
        assert table.nbytes(resident) == tensor_sizes(expected_resident)
        assert [table.nbytes(unit) for unit in per_unit] == [tensor_sizes(slots) for slots in expected_units]


def test_a_context_parallel_ranks_trace_is_cached_apart_from_the_one_gpu_trace(cache_dir):
    """Each rank's share of the sequence is its own trace: with the cache warm from a one-GPU plan, a 2-GPU plan
    (cold and from the cache) is still the plan a cold computation gives (it read the one-GPU trace back before)."""
    from vidmem.memory.plan.parallel import MultiGpu, plan_parallel

    def ranks(model):
        return plan_parallel(model, SHAPE, MemoryStrategy(), MultiGpu(2)).gpus[0]

    cold = ranks(_from_json(_config(), None, disk_cache=False))
    warm = _from_json(_config(), None)
    _plans(warm)  # the one-GPU traces, written to the cache first
    assert ranks(warm) == cold
    assert ranks(_from_json(_config(), None)) == cold  # a fresh process, every trace from the cache
