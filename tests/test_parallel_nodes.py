"""The node inputs are enough: Memory Strategy (gpus, context_parallel) -> Video Sampler runs the ranks."""

from __future__ import annotations

import psutil
import pytest
import torch

from fuzz_support import strategy_widgets
from vidmem.memory import StrategyError
from vidmem.memory.strategy import Parallelism
from vidmem.memory.units import GiB as GiB_
from vidmem.nodes import NODE_CLASS_MAPPINGS as N
from vidmem.nodes.strategy import PARALLEL_WIDGETS, VidMemMemoryStrategy, parse_parallel
from vidmem.pipelines.parallel import close_pool
from vidmem.pipelines.parallel.run import POOL_ATTRIBUTE


def build(**changes):
    (choice,) = N["VidMemMemoryStrategy"]().build(**strategy_widgets(offload="none"), **changes)["result"]
    return choice


def test_parallel_widgets_come_last_so_older_workflows_keep_their_values():
    spec = VidMemMemoryStrategy.INPUT_TYPES()
    # After the budgets, in the order they were added: the parallel widgets, then activation_chunks.
    optional = list(spec["optional"])
    assert optional[optional.index("ram_budget_gb") + 1:] == [*PARALLEL_WIDGETS, "activation_chunks"]
    assert build().strategy.parallel == Parallelism()  # defaults: one process, as before


@pytest.mark.parametrize("gpus, mode, expected", [
    ("auto", "off", Parallelism()),
    (" 0, 1 ", "off", Parallelism((0, 1))),
    ("0,2", "ulysses", Parallelism((0, 2), "ulysses")),
    ("CPU:2", "ulysses", Parallelism(None, "ulysses", 2, cpu=True)),
])
def test_gpus_text(gpus, mode, expected):
    assert parse_parallel(gpus, mode) == expected


@pytest.mark.parametrize("gpus, mode, message", [("0;1", "off", "GPU indices separated by commas"),
                                                 ("cpu:2", "off", "needs context_parallel ulysses"),
                                                 ("cpu:1", "ulysses", "N 2 or more"),
                                                 ("cpu:2", "ring", "ring needs an attention kernel that returns the log-sum-exp"),
                                                 ("1", "off", "lists one GPU: vidmem runs on ComfyUI's GPU"),
                                                 ("0,1,0", "ulysses", "lists a GPU twice")])
def test_bad_gpus_text_is_named(gpus, mode, message):
    with pytest.raises(StrategyError, match=f"gpus={gpus!r}.*{message}"):
        build(gpus=gpus, context_parallel=mode)


def test_sampler_node_runs_the_ranks_with_progress_and_a_receipt(tiny_folder, monkeypatch):
    from vidmem.nodes import host

    steps = []
    monkeypatch.setattr(host.Progress, "step", lambda self, step, total=None: steps.append(step))
    (pipeline,) = N["VidMemLoadPipeline"]().load(model="ignored", dtype="fp32", path=str(tiny_folder("wan2.1-t2v")))
    sampler = N["VidMemVideoSampler"]()
    try:
        single = sampler.sample(pipeline, build(), "a cat", "", 32, 32, 9, 2, 5.0, 7)
        split = sampler.sample(pipeline, build(gpus="cpu:2", context_parallel="ulysses"), "a cat", "", 32, 32, 9, 2, 5.0, 7)
        pids = getattr(pipeline.pipe, POOL_ATTRIBUTE)[1].pids
        assert split["result"][0]["samples"].equal(single["result"][0]["samples"])
        text = split["ui"]["text"][0]
        assert "2 ranks (gloo), ulysses degree 2; peak: rank 0 RSS" in text and "rank 1 RSS" in text
        assert steps[-2:] == [1, 2]
    finally:
        close_pool(pipeline)
    assert not any(psutil.pid_exists(pid) for pid in pids)


def test_balanced_gpus_without_gpus_are_refused_by_name(tiny_loaded):
    from vidmem.pipelines.family import ModelError

    with pytest.raises(ModelError, match="gpus=0,1: GPU 0,1 is not visible"):
        N["VidMemVideoSampler"]().sample(tiny_loaded("wan2.1-t2v"), build(gpus="0,1"), "a cat", "", 32, 32, 9, 1, 1.0, 0)


def test_auto_with_context_parallel_plans_every_rank_s_copy(tiny_loaded):
    """offload=auto plans N ranks plus this process, each holding the pipeline: a RAM budget that one
    copy fits and three do not is refused by name before any rank starts (the one-GPU plan said it fits)."""
    from vidmem.memory.plan.planner import PlanError
    from vidmem.memory.plan.stages import VideoShape
    from vidmem.memory.units import GiB
    from vidmem.pipelines.planning import plan_strategy

    loaded = tiny_loaded("wan2.1-t2v")
    one_copy = plan_strategy(loaded, VideoShape(32, 32, 9), build().strategy, None, None, device="cpu").peak_ram_bytes
    ram_gb = 2 * one_copy / GiB  # between one copy and three
    (choice,) = N["VidMemMemoryStrategy"]().build(**strategy_widgets(offload="auto", ram_budget_gb=ram_gb),
                                                  gpus="cpu:2", context_parallel="ulysses")["result"]
    (alone,) = N["VidMemMemoryStrategy"]().build(**strategy_widgets(offload="auto", ram_budget_gb=ram_gb))["result"]
    from vidmem.nodes.sampler import _strategy_for_run

    assert "fits" in _strategy_for_run(loaded, alone, VideoShape(32, 32, 9), torch.device("cpu"))[1]
    pool = getattr(loaded.pipe, POOL_ATTRIBUTE, None)
    with pytest.raises(PlanError, match=r"RAM .* for 2 ranks and this process.*ram_budget_gb"):
        N["VidMemVideoSampler"]().sample(loaded, choice, "a cat", "", 32, 32, 9, 1, 1.0, 0)
    assert getattr(loaded.pipe, POOL_ATTRIBUTE, None) is pool, "refused before any rank started"
    (roomy,) = N["VidMemMemoryStrategy"]().build(**strategy_widgets(offload="auto", ram_budget_gb=8 * ram_gb),
                                                 gpus="cpu:2", context_parallel="ulysses")["result"]
    strategy, line = _strategy_for_run(loaded, roomy, VideoShape(32, 32, 9), torch.device("cpu"))
    assert "per rank, 2-way ulysses" in line and "for all processes; fits" in line


@pytest.fixture
def two_gpus(monkeypatch):
    """Two made-up CUDA GPUs of the given sizes (bytes by index), with nothing free on either:
    whatever reads free memory instead of what the GPUs hold (or reads the wrong GPU) shows."""
    from types import SimpleNamespace

    sizes = {}
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(sizes))
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: SimpleNamespace(total_memory=sizes[torch.device("cuda", index).index
                                                                         if isinstance(index, int) else index.index]))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index=None: (0, sizes[index]))
    return sizes


def test_balanced_placement_checks_what_the_gpus_hold_not_what_is_free_now(tiny_loaded, two_gpus):
    """After a first run the warm store holds the transformers on the first GPU (and inside ComfyUI
    its own models may fill both, which the run asks the host to unload): placement must not refuse
    the second run for memory the run itself will use."""
    from vidmem.nodes.sampler import _placement

    two_gpus.update({0: 8 * GiB_, 1: 8 * GiB_})
    strategy = build(gpus="1,0").strategy
    placement = _placement(tiny_loaded("wan2.1-t2v"), strategy, torch.device("cuda", 0))
    assert (placement.denoisers, placement.prompt_encoder) == ("cuda:1", "cuda:0")


def test_balanced_auto_is_planned_per_gpu_on_the_transformers_gpu(tiny_loaded, two_gpus):
    """offload=auto under balanced placement chooses from the chart's balanced rows within the first
    listed GPU's memory (the transformers' GPU: GPU 1 for gpus=1,0, not ComfyUI's GPU 0), and says
    so in the receipt's plan line."""
    from vidmem.memory.plan.planner import PlanError
    from vidmem.memory.plan.stages import VideoShape
    from vidmem.nodes.sampler import _strategy_for_run
    from vidmem.pipelines.parallel.planning import choose_balanced

    loaded, shape = tiny_loaded("wan2.1-t2v"), VideoShape(32, 32, 9, cfg=True)
    (choice,) = N["VidMemMemoryStrategy"]().build(**strategy_widgets(offload="auto", ram_budget_gb=64),
                                                  gpus="1,0")["result"]
    leanest = choose_balanced(loaded, shape, choice.strategy, 2, 64 * GiB_, 64 * GiB_).per_gpu_peak_bytes
    two_gpus.update({0: 64 * GiB_, 1: leanest - 1})
    with pytest.raises(PlanError, match=r"no tier fits 2-way balanced .*list the roomiest GPU first in gpus"):
        _strategy_for_run(loaded, choice, shape, torch.device("cuda", 0))
    two_gpus.update({0: leanest - 1, 1: leanest})
    strategy, line = _strategy_for_run(loaded, choice, shape, torch.device("cuda", 0))
    assert strategy == choose_balanced(loaded, shape, choice.strategy, 2, leanest, 64 * GiB_).strategy
    assert line.startswith("auto chose at 32x32x9: offload=") and line.endswith("; fits")
    assert "on the transformers' GPU, the text encoder on the second, balanced over 2 GPUs; peak per GPU" in line


def test_balanced_placement_under_a_tier_set_by_hand_runs_the_planned_chunk_count(tiny_loaded, two_gpus):
    """activation_chunks auto is resolved by the plan within the first GPU's memory and run so, as on one GPU
    (left to the engine it chose again from the memory free at the call)."""
    from vidmem.memory.plan.stages import VideoShape
    from vidmem.nodes.sampler import _strategy_for_run

    two_gpus.update({0: 64 * GiB_, 1: 64 * GiB_})
    (choice,) = N["VidMemMemoryStrategy"]().build(**strategy_widgets(offload="none"), gpus="0,1",
                                                  activation_chunks="auto")["result"]
    assert choice.strategy.chunks_auto
    strategy, line = _strategy_for_run(tiny_loaded("wan2.1-t2v"), choice, VideoShape(32, 32, 9, cfg=True),
                                       torch.device("cuda", 0))
    assert not strategy.chunks_auto and strategy.activation_chunks == 1 and "balanced over 2 GPUs" in line
