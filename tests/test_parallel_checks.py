"""What context parallelism refuses, before any rank starts, with messages that name the fix."""

from __future__ import annotations

import re

import pytest

from vidmem.memory import MemoryStrategy, StrategyError
from vidmem.memory.strategy import Parallelism
from vidmem.pipelines.family import ModelError
from vidmem.pipelines.parallel import Ranks, TokenGrid, resolve_ranks, sample_parallel, sequence_problem
from vidmem.pipelines.parallel.run import POOL_ATTRIBUTE
from vidmem.pipelines.sample import SampleRequest

ULYSSES_2 = MemoryStrategy(offload="none", parallel=Parallelism(context_parallel="ulysses", degree=2))
WAN = TokenGrid(unit=16, frame_step=4)


def test_token_counts_follow_the_latent_grid():
    assert WAN.tokens(832, 480, 81) == 21 * 30 * 52
    assert WAN.tokens(48, 48, 9) == 3 * 3 * 3


@pytest.mark.parametrize("degree", [2, 4, 8])
def test_an_uneven_sequence_names_sizes_that_divide(degree):
    message = sequence_problem(WAN, 48, 48, 9, degree)
    assert "27 video tokens" in message and f"{degree} ranks" in message
    suggested = {name: [int(v) for v in values.split(", ")]
                 for name, values in re.findall(r"(width|height|frames) ([\d, ]+\d)", message)}
    assert set(suggested) == {"width", "height", "frames"}
    for width in suggested["width"]:
        assert sequence_problem(WAN, width, 48, 9, degree) is None
    for frames in suggested["frames"]:
        assert (frames - 1) % 4 == 0 and sequence_problem(WAN, 48, 48, frames, degree) is None


def test_even_sizes_pass():
    assert sequence_problem(WAN, 832, 480, 81, 2) is None
    assert sequence_problem(WAN, 1280, 720, 81, 8) is None


def test_an_uneven_run_is_refused_before_any_rank_starts(tiny_loaded):
    loaded = tiny_loaded("wan2.1-t2v")
    request = SampleRequest("a cat", "", 48, 48, 9, steps=1, cfg=1.0)
    with pytest.raises(ModelError, match=r"48x48x9 makes 27 video tokens.*width 32, 64, 96"):
        sample_parallel(loaded, ULYSSES_2, request, Ranks(cpu_processes=2))
    assert getattr(loaded.pipe, POOL_ATTRIBUTE, None) is None


def test_cogvideox_is_refused_for_context_parallelism(tiny_loaded):
    loaded = tiny_loaded("cogvideox-t2v")
    with pytest.raises(ModelError, match="CogVideoXPipeline has no context-parallel plan.*context_parallel to off"):
        sample_parallel(loaded, ULYSSES_2, SampleRequest("a cat", "", 32, 32, 9, steps=1), Ranks(cpu_processes=2))
    assert getattr(loaded.pipe, POOL_ATTRIBUTE, None) is None


def test_ring_is_refused_on_the_cpu(tiny_loaded):
    ring = MemoryStrategy(parallel=Parallelism(context_parallel="ring", degree=2))
    with pytest.raises(ModelError, match="ring needs an attention kernel that returns the log-sum-exp.*ulysses"):
        sample_parallel(tiny_loaded("wan2.1-t2v"), ring, SampleRequest("a cat", "", 32, 32, 9, steps=1),
                        Ranks(cpu_processes=2))


def test_heads_must_divide_by_the_degree(tiny_loaded):
    four = MemoryStrategy(parallel=Parallelism(context_parallel="ulysses", degree=4))
    with pytest.raises(ModelError, match=r"2 attention heads, which do not divide between 4 ranks; use 2 GPUs \(or CPU processes, gpus=cpu:N\)"):
        sample_parallel(tiny_loaded("wan2.1-t2v"), four, SampleRequest("a cat", "", 32, 32, 9, steps=1),
                        Ranks(cpu_processes=4))


@pytest.mark.parametrize("parallel, gpus, expected", [
    (Parallelism(context_parallel="ulysses"), 4, Ranks(gpus=(0, 1, 2, 3))),
    (Parallelism(gpus=(1, 3), context_parallel="ulysses"), 4, Ranks(gpus=(1, 3))),
    (Parallelism(context_parallel="ulysses", degree=2), 0, Ranks(cpu_processes=2)),
])
def test_ranks_resolve_from_the_visible_gpus(parallel, gpus, expected, monkeypatch):
    from vidmem.pipelines.parallel import ranks

    monkeypatch.setattr(ranks.dist, "is_nccl_available", lambda: True)  # this CPU build has none
    assert resolve_ranks(parallel, gpus) == expected


@pytest.mark.parametrize("parallel, gpus, message", [
    (Parallelism(context_parallel="ulysses"), 0, "needs two or more GPUs and this machine has none"),
    (Parallelism(gpus=(0, 1), context_parallel="ulysses"), 0, "no CUDA GPU is visible"),
    (Parallelism(context_parallel="ulysses"), 1, "needs two or more GPUs; only GPU 0"),
    (Parallelism(gpus=(0, 5), context_parallel="ulysses"), 2, "lists 5 but only GPUs 0..1"),
    (Parallelism(context_parallel="ulysses", degree=2), 4, "degree=2 but 4 GPUs are used"),
])
def test_impossible_ranks_are_named(parallel, gpus, message):
    with pytest.raises(ModelError, match=re.escape(message)):
        resolve_ranks(parallel, gpus)


@pytest.mark.parametrize("fields, message", [
    (dict(degree=1), "degree=1 must be 0"),
    (dict(degree=2), "degree=2 only applies with context_parallel on"),
    (dict(context_parallel="tensor"), "context_parallel='tensor' is not one of"),
    (dict(gpus=(0, 0)), "distinct GPU indices"),
    (dict(gpus=[0, 1]), "must be a tuple"),
    (dict(gpus=(0, 1, 2), context_parallel="ulysses", degree=2), "degree=2 but gpus lists 3 GPUs"),
])
def test_parallelism_validates_its_fields(fields, message):
    with pytest.raises(StrategyError, match=re.escape(message)):
        Parallelism(**fields)


def test_strategy_describes_its_parallelism():
    assert Parallelism(gpus=(0, 1)).balanced
    assert not Parallelism(gpus=(0, 1), context_parallel="ulysses").balanced
    assert "ulysses degree=2 gpus=auto" in ULYSSES_2.describe()
    assert MemoryStrategy().describe() == "offload=model text_encoder=offload_after_encoding"
    # what changes how weights are copied is in the receipt's strategy too (an unpinned run read as a pinned one)
    assert MemoryStrategy(offload="block_swap", blocks_to_swap=2, max_pinned_ram_gb=0, non_blocking=False).describe() == \
        "offload=block_swap blocks_to_swap=2 prefetch=1 max_pinned_ram_gb=0 non_blocking=False text_encoder=offload_after_encoding"
    assert "max_pinned_ram_gb=2.5" in MemoryStrategy(max_pinned_ram_gb=2.5).describe()


def test_gpus_without_nccl_are_refused_before_any_rank_starts(monkeypatch):
    """PyTorch's Windows builds have no NCCL: refused by name, not as each rank's init failure."""
    from vidmem.pipelines.parallel import ranks

    monkeypatch.setattr(ranks.dist, "is_nccl_available", lambda: False)
    with pytest.raises(ModelError, match="needs NCCL, which this PyTorch build does not have"):
        resolve_ranks(Parallelism(context_parallel="ulysses"), 2)
    assert resolve_ranks(Parallelism(context_parallel="ulysses", degree=2), 0) == Ranks(cpu_processes=2)  # gloo


@pytest.mark.parametrize("visible", [0, 2, 4])
def test_gpus_cpu_n_runs_cpu_processes_whatever_gpus_are_visible(visible, monkeypatch):
    from vidmem.nodes.strategy import parse_parallel
    from vidmem.pipelines.parallel import ranks

    monkeypatch.setattr(ranks.dist, "is_nccl_available", lambda: True)  # so a GPU answer would not be refused
    parallel = parse_parallel("cpu:2", "ulysses")
    assert resolve_ranks(parallel, visible) == Ranks(cpu_processes=2)
    assert parallel.describe() == "ulysses degree=2 gpus=cpu:2"


@pytest.mark.parametrize("fields", [dict(cpu=True, context_parallel="ulysses"),
                                    dict(cpu=True, context_parallel="ulysses", degree=2, gpus=(0, 1)),
                                    dict(cpu=True, degree=0)])
def test_cpu_processes_need_a_degree_and_context_parallelism(fields):
    with pytest.raises(StrategyError, match="cpu=True runs `degree` CPU processes"):
        Parallelism(**fields)
