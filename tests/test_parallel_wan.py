"""Wan with Ulysses degree 2 over two CPU processes (gloo, loopback) gives the frames of one process.

One pool serves every test of the module: a rank holds one pipeline at a time and reopens it
from the folder when another is asked for, as it would when the user loads another model.
Tolerance: T2V and A14B are bit-identical. The image-conditioned variants (I2V, first-last-frame,
Wan 2.2 I2V A14B) were bit-identical on an AMD EPYC, and I2V differed by at most 9.5e-7 (about two
float32 ulps at the latents' magnitude) elsewhere, measured by bench/support/parallel_cpu.py: 2e-6.
TI2V 5B differs by 3.1e-6 (its per-token timesteps are split with the tokens): 5e-6. The
single-process run is itself deterministic (two runs agree bit for bit), so a difference comes from
the split run.
"""

from __future__ import annotations

import pytest
import torch

from vidmem.memory import MemoryStrategy
from vidmem.memory.parallel import PoolConfig, WorkerPool
from vidmem.memory.strategy import Parallelism
from vidmem.pipelines.hooks import RunHooks
from vidmem.pipelines.parallel import Ranks, sample_parallel
from vidmem.pipelines.sample import SampleRequest, sample
from vidmem.pipelines.tiny import tiny_spec

TOLERANCE = {"wan2.1-t2v": 0.0, "wan2.2-a14b": 0.0, "wan2.1-i2v": 2e-6, "wan2.1-flf2v": 2e-6, "wan2.2-i2v-a14b": 2e-6,
             "wan2.2-ti2v": 5e-6}
TIERS = {"none": dict(offload="none"), "block_swap": dict(offload="block_swap", blocks_to_swap=1)}
RANKS = Ranks(cpu_processes=2)


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(PoolConfig.for_cpu(2, threads=1)) as pool:
        yield pool


def request_for(variant: str, steps: int = 2) -> SampleRequest:
    spec = tiny_spec(variant)
    image = torch.full((1, spec.height, spec.width, 3), 0.5) if spec.needs_image else None
    last = torch.full((1, spec.height, spec.width, 3), 0.7) if spec.last_image else None
    return SampleRequest("a cat", "a dog", spec.width, spec.height, spec.frames, steps, 5.0, seed=3, image=image,
                         last_image=last)


@pytest.mark.parametrize("variant", list(TOLERANCE))
def test_ulysses_2_gives_the_frames_of_one_process_under_each_tier(tiny_loaded, pool, variant):
    loaded, request = tiny_loaded(variant), request_for(variant)
    pids = None
    for tier, fields in TIERS.items():
        single = sample(loaded, MemoryStrategy(**fields), request, device=torch.device("cpu")).latent["samples"]
        steps = []
        strategy = MemoryStrategy(**fields, parallel=Parallelism(context_parallel="ulysses", degree=2))
        result = sample_parallel(loaded, strategy, request, RANKS, RunHooks(on_step=lambda s, t: steps.append(s)), pool)
        split = result.latent["samples"]
        assert split.shape == single.shape
        assert not split.is_shared(), "ComfyUI's cache gets an ordinary tensor, not rank 0's shared-memory one"
        assert (split - single).abs().max().item() <= TOLERANCE[variant], f"{variant} under {tier}"
        assert steps == [1, 2]
        receipt = result.receipt["parallel"]
        assert receipt["ranks"] == receipt["degree"] == 2 and receipt["backend"] == "gloo"
        assert all(peak["peak_rss_bytes"] > 0 for peak in receipt["per_rank_peak_bytes"])
        assert "ulysses degree=2" in result.receipt["strategy"]
        assert pids in (None, pool.pids), "the second run reuses the ranks (and the pipeline they hold)"
        pids = pool.pids


def test_a_different_seed_changes_the_split_run(tiny_loaded, pool):
    """The comparison above can fail: the ranks really sample (a seed they ignored would pass it)."""
    loaded = tiny_loaded("wan2.1-t2v")
    strategy = MemoryStrategy(offload="none", parallel=Parallelism(context_parallel="ulysses", degree=2))
    first = sample_parallel(loaded, strategy, request_for("wan2.1-t2v"), RANKS, pool=pool).latent["samples"]
    other = SampleRequest(**{**request_for("wan2.1-t2v").__dict__, "seed": 4})
    second = sample_parallel(loaded, strategy, other, RANKS, pool=pool).latent["samples"]
    assert (first - second).abs().max().item() > 1e-3


@pytest.mark.parametrize("variant, tier", [("wan2.1-t2v", "none"), ("wan2.1-t2v", "block_swap"),
                                           ("wan2.2-a14b", "none"), ("wan2.2-a14b", "block_swap")])
def test_each_rank_runs_its_share_of_the_tokens(tiny_loaded, pool, variant, tier):
    """The parity above would also hold if the ranks silently computed the whole sequence: here every
    rank's blocks see tokens / degree, where one process sees them all; for Wan 2.2 A14B each expert
    on its own, over enough steps to cross the boundary between them (an expert left unsplit shows)."""
    from parallel_jobs import CountTokens
    from vidmem.pipelines.parallel import ParallelSampleJob, PipelineSource

    loaded, request = tiny_loaded(variant), request_for(variant, steps=4)
    whole: dict[str, set] = {}
    experts = [name for name in loaded.spec.denoisers if getattr(loaded.pipe, name, None) is not None]
    handles = [getattr(loaded.pipe, name).blocks[1].register_forward_pre_hook(
        lambda m, args, name=name: whole.setdefault(name, set()).add(args[0].shape[1])) for name in experts]
    try:
        sample(loaded, MemoryStrategy(**TIERS[tier]), request, device=torch.device("cpu"))
    finally:
        for handle in handles:
            handle.remove()
    assert sorted(whole) == sorted(experts), "every expert ran in the one-process run"
    strategy = MemoryStrategy(**TIERS[tier], parallel=Parallelism(context_parallel="ulysses", degree=2))
    per_rank = pool.run(CountTokens(ParallelSampleJob(PipelineSource.of(loaded), strategy, request)))
    halves = {name: [tokens // 2 for tokens in counts] for name, counts in whole.items()}
    assert all(tokens % 2 == 0 for counts in whole.values() for tokens in counts)
    assert per_rank == [halves, halves]


def test_taylor_seer_runs_split_and_the_caches_that_keep_the_first_blocks_input_are_refused(tiny_loaded, pool):
    """TaylorSeer decides from the step count and extrapolates the gathered output: the split run gives the frames of
    one process. MagCache and First Block Cache hook the first block outside the split of the tokens (the first
    block's input is the whole video's, the last block's output one rank's share: two CPU ranks failed on the first
    step), so they are refused before any rank starts, naming what runs."""
    from dataclasses import replace

    from vidmem.pipelines.family import ModelError
    from vidmem.pipelines.step_cache import StepCache

    loaded = tiny_loaded("wan2.1-t2v")
    strategy = MemoryStrategy(offload="none", parallel=Parallelism(context_parallel="ulysses", degree=2))
    taylor = replace(request_for("wan2.1-t2v", steps=6), cache=StepCache("taylor_seer", interval=2, warmup_steps=1))
    single = sample(loaded, MemoryStrategy(offload="none"), taylor, device=torch.device("cpu"))
    split = sample_parallel(loaded, strategy, taylor, RANKS, pool=pool)
    assert torch.equal(split.latent["samples"], single.latent["samples"])
    assert split.receipt["cache"]["blocks_skipped"] == single.receipt["cache"]["blocks_skipped"] > 0
    for cache in (StepCache("mag_cache", mag_ratios=(1.0,) * 6), StepCache("first_block_cache")):
        with pytest.raises(ModelError, match=f"cache {cache.method.value} does not run with context parallelism.*"
                                             "choose taylor_seer"):
            sample_parallel(loaded, strategy, replace(taylor, cache=cache), RANKS, pool=pool)
