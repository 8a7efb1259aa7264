"""An attention kernel without a context-parallel version is refused before any rank starts, in the
rank's own words (diffusers' registry of backends that support context parallelism)."""

from __future__ import annotations

import pytest

from vidmem.memory import MemoryStrategy
from vidmem.memory.strategy import Parallelism
from vidmem.pipelines.attention import AttentionError
from vidmem.pipelines.parallel import Ranks, sample_parallel
from vidmem.pipelines.parallel.run import POOL_ATTRIBUTE
from vidmem.pipelines.sample import SampleRequest
from vidmem.pipelines.speed import Speed

ULYSSES_2 = MemoryStrategy(offload="none", parallel=Parallelism(context_parallel="ulysses", degree=2))


@pytest.mark.parametrize("kernel", ["math", "flex"])
def test_a_kernel_without_a_parallel_version_is_refused_before_any_rank_starts(tiny_loaded, kernel):
    loaded = tiny_loaded("wan2.1-t2v")
    request = SampleRequest("a cat", "", 32, 32, 9, steps=2, cfg=1.0, speed=Speed(attention=kernel))
    with pytest.raises(AttentionError, match=f"attention='{kernel}': transformer is split across GPUs.*has no "
                                             "context-parallel version; choose 'auto'"):
        sample_parallel(loaded, ULYSSES_2, request, Ranks(cpu_processes=2))
    assert getattr(loaded.pipe, POOL_ATTRIBUTE, None) is None


def test_the_sampler_node_refuses_it_too(tiny_loaded):
    from fuzz_support import strategy_widgets
    from vidmem.nodes import NODE_CLASS_MAPPINGS as N

    loaded = tiny_loaded("wan2.1-t2v")
    (choice,) = N["VidMemMemoryStrategy"]().build(**strategy_widgets(offload="none"), gpus="cpu:2",
                                                  context_parallel="ulysses")["result"]
    with pytest.raises(AttentionError, match="attention='math': transformer is split across GPUs"):
        N["VidMemVideoSampler"]().sample(loaded, choice, "a cat", "", 32, 32, 9, 2, 1.0, 0, speed=Speed(attention="math"))
    assert getattr(loaded.pipe, POOL_ATTRIBUTE, None) is None


@pytest.mark.parametrize("kernel, backend, refused", [("sdpa", "native", True), ("auto", "native", False),
                                                      ("cudnn", "_native_cudnn", False), ("flash", "_native_flash", False)])
def test_ring_refuses_a_kernel_set_explicitly_that_returns_no_log_sum_exp(kernel, backend, refused):
    """diffusers' native backend raises for return_lse=True inside ring's merge; auto keeps ring's cuDNN."""
    from types import SimpleNamespace

    from vidmem.pipelines.attention import ResolvedAttention
    from vidmem.pipelines.parallel import check_parallel_attention

    resolved = SimpleNamespace(attention=ResolvedAttention(kernel if kernel != "auto" else "sdpa", kernel, backend,
                                                           "cuda", "bf16", "test"))
    check_parallel_attention(resolved, ["transformer"], "ulysses")  # ulysses needs no log-sum-exp
    if refused:
        with pytest.raises(AttentionError, match=f"attention='{kernel}' with context_parallel=ring.*no log-sum-exp"):
            check_parallel_attention(resolved, ["transformer"], "ring")
    else:
        check_parallel_attention(resolved, ["transformer"], "ring")


def test_under_ring_the_refusal_of_a_kernel_without_a_parallel_version_offers_only_kernels_ring_takes():
    """flex has no context-parallel version; under ring 'sdpa' (native, no log-sum-exp) is refused too, so the
    message must not offer it (it did: following the advice met the next refusal)."""
    from types import SimpleNamespace

    from vidmem.pipelines.attention import ResolvedAttention
    from vidmem.pipelines.parallel import check_parallel_attention

    resolved = SimpleNamespace(attention=ResolvedAttention("flex", "flex", "flex", "cuda", "bf16", "test"))
    for mode, offers_sdpa in (("ring", False), ("ulysses", True)):
        with pytest.raises(AttentionError, match="has no context-parallel version") as refused:
            check_parallel_attention(resolved, ["transformer"], mode)
        offered = str(refused.value).split("one of ", 1)[1]
        assert ("'sdpa'" in offered) is offers_sdpa and "'cudnn'" in offered, offered
