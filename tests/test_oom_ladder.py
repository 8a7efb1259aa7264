"""The out-of-memory ladder: an OOM injected at block k of step s frees, escalates and resumes from
the last finished step; the latents equal an uninterrupted run under the final strategy bit for
bit (StrictBackend poisons evicted weights), and nothing is left applied on any path."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from backends import StrictBackend
from test_tiers import hooks_of, request_for, storage_map
from vidmem.memory import MemoryStrategy
from vidmem.pipelines.family import denoiser_blocks
from vidmem.pipelines.sample import RunHooks, sample
from vidmem.memory.cleanup import is_out_of_memory
from vidmem.memory.plan.candidates import CHUNK_STEPS
from vidmem.pipelines.sample_ladder import SamplingOutOfMemory, fixed_ladder, planned_rung

STEPS = 4


class InjectOOM:
    """Raises an out-of-memory error before the n-th forward (1-based, counted across attempts) of
    `module`, for each n in `at_calls`: what a CUDA allocation failing in that block looks like."""

    def __init__(self, module: torch.nn.Module, at_calls, error=lambda: torch.OutOfMemoryError("CUDA out of memory (injected)")):
        self.calls, self.at, self.error, self.raised = 0, set(at_calls), error, 0
        self.handle = module.register_forward_pre_hook(self._before)

    def _before(self, module, args):
        self.calls += 1
        if self.calls in self.at:
            self.raised += 1
            raise self.error()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def passes_per_step(loaded) -> int:
    """Forwards of a denoiser per step: Wan runs cond and uncond separately, CogVideoX batches them."""
    return 2 if loaded.spec.name == "wan" else 1


def run(loaded, strategy, request, hooks=RunHooks()):
    return sample(loaded, strategy, request, hooks=hooks, backend=StrictBackend())


@pytest.mark.parametrize("variant,scheduler", [("wan2.1-t2v", "default"), ("wan2.1-t2v", "dpmpp_2m"),
                                               ("wan2.1-t2v", "flow_match_euler"), ("cogvideox-t2v", "default"),
                                               ("cogvideox1.5-t2v", "default"), ("cogvideox-i2v", "unipc"),
                                               ("wan2.1-i2v", "default")])
def test_resumed_run_equals_an_uninterrupted_run_under_the_final_strategy(variant, scheduler, tiny_loaded):
    loaded = tiny_loaded(variant)
    request = dataclasses.replace(request_for(variant, steps=STEPS), scheduler=scheduler)
    final = MemoryStrategy(offload="block_swap", blocks_to_swap=fixed_ladder(MemoryStrategy(), block_count(loaded))[0].blocks_to_swap)
    reference = run(loaded, final, request).latent["samples"]  # first: transformers adds hooks of its own on first use
    before, hooks_before = storage_map(loaded.pipe), hooks_of(loaded.pipe)
    block = getattr(loaded.pipe.transformer, loaded.spec.blocks_attr)[-1]
    at_step = 3  # steps 1 and 2 finish, step 3 fails
    with InjectOOM(block, [passes_per_step(loaded) * (at_step - 1) + 1]) as oom:
        result = run(loaded, MemoryStrategy(offload="model"), request)
    assert oom.raised == 1
    (rung,) = result.receipt["oom_ladder"]
    assert rung["at_step"] == at_step and rung["resumed_from_step"] == at_step - 1
    assert rung["chosen_by"] == "fixed ladder" and rung["failed"].startswith("offload=model")
    assert result.receipt["strategy"] == final.describe() == rung["next"]
    assert torch.equal(result.latent["samples"], reference)
    assert storage_map(loaded.pipe) == before and hooks_of(loaded.pipe) == hooks_before


def block_count(loaded) -> int:
    blocks = [getattr(getattr(loaded.pipe, n), loaded.spec.blocks_attr) for n in loaded.spec.denoisers if getattr(loaded.pipe, n, None) is not None]
    return min(len(b) for b in blocks)


def test_resume_does_not_restart_the_loop(tiny_loaded):
    """The finished steps are not run again: total forwards = uninterrupted forwards + the failed one."""
    loaded = tiny_loaded("wan2.1-t2v")
    block = loaded.pipe.transformer.blocks[0]
    with InjectOOM(block, [5]) as oom:  # step 3's cond pass
        run(loaded, MemoryStrategy(offload="model"), request_for("wan2.1-t2v", steps=STEPS))
    assert oom.calls == STEPS * 2 + 1


def test_climbs_several_rungs_to_sequential(tiny_loaded):
    loaded = tiny_loaded("wan2.1-t2v")
    request = request_for("wan2.1-t2v", steps=STEPS)
    block = loaded.pipe.transformer.blocks[0]
    with InjectOOM(block, [2, 5, 9]) as oom:  # steps 1, 2 and 3 (counting the passes run again)
        result = run(loaded, MemoryStrategy(offload="model", prefetch_blocks=2), request)
    assert oom.raised == 3
    ladder = result.receipt["oom_ladder"]
    assert [r["next"].split()[0:2] for r in ladder] == [["offload=block_swap", "blocks_to_swap=1"],
                                                        ["offload=block_swap", "blocks_to_swap=2"],
                                                        ["offload=sequential", "prefetch=2"]]
    assert [r["resumed_from_step"] for r in ladder] == [0, 1, 2]
    reference = run(loaded, MemoryStrategy(offload="sequential", prefetch_blocks=2), request).latent["samples"]
    assert torch.equal(result.latent["samples"], reference)
    assert result.receipt["requested_strategy"].startswith("offload=model")


def test_two_expert_model_resumes_across_the_expert_switch(tiny_loaded):
    """Wan 2.2 A14B: the first low-noise step fails; the resumed run starts on transformer_2."""
    loaded = tiny_loaded("wan2.2-a14b")
    request = dataclasses.replace(request_for("wan2.2-a14b", steps=STEPS), cfg_2=3.0)
    before, hooks_before = storage_map(loaded.pipe), hooks_of(loaded.pipe)
    with InjectOOM(loaded.pipe.transformer_2.blocks[1], [1]) as low, InjectOOM(loaded.pipe.transformer.blocks[0], [2]) as high:
        result = run(loaded, MemoryStrategy(offload="model"), request)
    assert low.raised == high.raised == 1
    ladder = result.receipt["oom_ladder"]
    high_steps = ladder[1]["resumed_from_step"]
    assert ladder[0]["resumed_from_step"] == 0 and 0 < high_steps < STEPS
    reference = run(loaded, MemoryStrategy(offload="block_swap", blocks_to_swap=2), request).latent["samples"]
    assert torch.equal(result.latent["samples"], reference)
    assert storage_map(loaded.pipe) == before and hooks_of(loaded.pipe) == hooks_before


def test_out_of_memory_under_the_last_rung_names_what_to_change(tiny_loaded):
    """Sequential with the most activation chunks is the last rung."""
    loaded = tiny_loaded("cogvideox-t2v")
    before, hooks_before = storage_map(loaded.pipe), hooks_of(loaded.pipe)
    last = MemoryStrategy(offload="sequential", activation_chunks=CHUNK_STEPS[-1])
    with InjectOOM(loaded.pipe.transformer.transformer_blocks[0], [2]):
        with pytest.raises(SamplingOutOfMemory, match=r"step 2/4 even with offload=sequential.*activation_chunks=32.*"
                                                      r"Lower width, height or frames") as caught:
            run(loaded, last, request_for("cogvideox-t2v", steps=STEPS))
    assert is_out_of_memory(caught.value.__cause__)
    assert storage_map(loaded.pipe) == before and hooks_of(loaded.pipe) == hooks_before


def test_out_of_memory_at_the_end_of_the_ladder_lists_the_rungs_tried(tiny_loaded):
    loaded = tiny_loaded("cogvideox-t2v")
    with InjectOOM(loaded.pipe.transformer.transformer_blocks[0], range(1, 30)):
        with pytest.raises(SamplingOutOfMemory, match=r"tried: offload=model .* -> offload=block_swap blocks_to_swap=1 .* -> "
                                                      r"offload=sequential .* -> offload=sequential .*activation_chunks=2 .*"
                                                      r"-> offload=sequential .*activation_chunks=32\)\. Lower"):
            run(loaded, MemoryStrategy(offload="model"), request_for("cogvideox-t2v", steps=STEPS))


def test_a_runtime_error_saying_out_of_memory_climbs_and_other_errors_do_not(tiny_loaded):
    loaded = tiny_loaded("wan2.1-t2v")
    request = request_for("wan2.1-t2v", steps=2)
    block = loaded.pipe.transformer.blocks[0]
    with InjectOOM(block, [1], error=lambda: RuntimeError("HIP out of memory. Tried to allocate 2 GiB")):
        assert len(run(loaded, MemoryStrategy(offload="model"), request).receipt["oom_ladder"]) == 1
    before, hooks_before = storage_map(loaded.pipe), hooks_of(loaded.pipe)
    with InjectOOM(block, [1], error=lambda: RuntimeError("shape mismatch")), pytest.raises(RuntimeError, match="shape mismatch"):
        run(loaded, MemoryStrategy(offload="model"), request)
    assert storage_map(loaded.pipe) == before and hooks_of(loaded.pipe) == hooks_before


def test_lora_and_ladder_together_leave_nothing_applied(tiny_loaded, tmp_path):
    from test_lora import peft_keys, random_lora, write
    from test_lora_sampling import lora_buffers
    from vidmem.pipelines.lora import load_lora, with_lora

    base = tiny_loaded("wan2.1-t2v")
    layers = [f"blocks.{i}.attn1.to_q" for i in range(2)]
    spec = load_lora(write(tmp_path / "l.safetensors", peft_keys(random_lora(base.pipe.transformer, layers), None)), base.pipe, 1.0)
    loaded = with_lora(base, spec)
    request = request_for("wan2.1-t2v", steps=3)
    with InjectOOM(base.pipe.transformer.blocks[1], [3]):
        result = run(loaded, MemoryStrategy(offload="model"), request)
    assert torch.equal(result.latent["samples"], run(loaded, MemoryStrategy(offload="block_swap", blocks_to_swap=1), request).latent["samples"])
    assert lora_buffers(base.pipe) == []


def test_fixed_ladder_rungs():
    model, n = MemoryStrategy(offload="model", prefetch_blocks=2), 40
    names = lambda rungs: [(r.offload.value, r.blocks_to_swap, r.prefetch_blocks) for r in rungs]  # noqa: E731
    assert names(fixed_ladder(model, n)) == [("block_swap", 20, 2), ("block_swap", 40, 2), ("sequential", 0, 2)]
    assert names(fixed_ladder(MemoryStrategy(offload="block_swap", blocks_to_swap=10), n)) == [
        ("block_swap", 25, 1), ("block_swap", 40, 1), ("sequential", 0, 1)]
    assert names(fixed_ladder(MemoryStrategy(offload="block_swap", blocks_to_swap=39), n)) == [("block_swap", 40, 1), ("sequential", 0, 1)]
    assert names(fixed_ladder(MemoryStrategy(offload="block_swap", blocks_to_swap=40), n)) == [("sequential", 0, 1)]
    assert fixed_ladder(MemoryStrategy(offload="sequential"), n) == []
    # Half of an odd count of unswapped blocks rounds up: the first rung always adds at least half.
    assert names(fixed_ladder(model, 41))[0] == ("block_swap", 21, 2)
    assert names(fixed_ladder(MemoryStrategy(offload="block_swap", blocks_to_swap=10), 41))[0] == ("block_swap", 26, 1)
    assert names(fixed_ladder(MemoryStrategy(offload="block_swap", blocks_to_swap=40), 41)) == [("block_swap", 41, 1),
                                                                                              ("sequential", 0, 1)]


def test_planner_rung_is_the_fewest_blocks_predicted_to_fit():
    model = MemoryStrategy(offload="model")
    asked = []

    def fits(strategy):
        asked.append(strategy.blocks_to_swap)
        return strategy.blocks_to_swap >= 13

    chosen = planned_rung(model, 40, fits)
    assert (chosen.offload.value, chosen.blocks_to_swap) == ("block_swap", 13)
    assert len(asked) <= 7  # a binary search, not 40 plans
    assert planned_rung(model, 40, lambda s: False).offload.value == "sequential"
    assert planned_rung(model, 40, lambda s: None) is None
    assert planned_rung(MemoryStrategy(offload="block_swap", blocks_to_swap=40), 40, fits).offload.value == "sequential"


def test_the_host_budget_lets_the_planner_choose(tiny_loaded, monkeypatch):
    """With a device budget from the host, the rung comes from the planner's prediction."""
    import vidmem.pipelines.sample as sample_module

    loaded = tiny_loaded("wan2.1-t2v")
    seen = []

    def fake_planner_fits(loaded_, shape, steps, budget, attention, cache_state=None):
        seen.append(budget)
        return lambda strategy: strategy.offload.value == "block_swap" and strategy.blocks_to_swap >= 2

    monkeypatch.setattr(sample_module, "planner_fits", fake_planner_fits)
    with InjectOOM(loaded.pipe.transformer.blocks[0], [1]):
        result = run(loaded, MemoryStrategy(offload="model"), request_for("wan2.1-t2v", steps=2),
                     RunHooks(device_budget=lambda device: 123))
    (rung,) = result.receipt["oom_ladder"]
    assert seen == [123] and rung["chosen_by"] == "planner" and "blocks_to_swap=2" in rung["next"]


@pytest.mark.parametrize("failing_call, restarts", [(1, True), (3, False)])
def test_the_rung_leaves_room_for_the_step_caches_state_only_where_the_next_attempt_runs_cached(
        tiny_loaded, monkeypatch, failing_call, restarts):
    """An error before any step finished restarts the run from its first step, with the step cache, so the rung is
    planned beside its state; an attempt that resumes after a finished step runs uncached and is planned without."""
    from dataclasses import replace

    import vidmem.pipelines.sample as sample_module
    from vidmem.memory.plan.types import CacheState
    from vidmem.pipelines.step_cache import StepCache

    loaded = tiny_loaded("wan2.1-t2v")
    seen = []

    def recording_planner_fits(loaded_, shape, steps, budget, attention, cache_state=None):
        seen.append(dict(cache_state or {}))
        return lambda strategy: strategy.offload.value == "block_swap"

    monkeypatch.setattr(sample_module, "planner_fits", recording_planner_fits)
    request = replace(request_for("wan2.1-t2v", steps=2), cache=StepCache("mag_cache", mag_ratios=(1.0,) * 2))
    with InjectOOM(loaded.pipe.transformer.blocks[0], [failing_call]):
        run(loaded, MemoryStrategy(offload="model"), request, RunHooks(device_budget=lambda device: 1 << 40))
    assert seen == [{"transformer": CacheState(hidden=2)} if restarts else {}]


def test_a_run_that_may_not_climb_raises_at_once_and_restores_everything(tiny_loaded):
    """climb_on_oom=False (a context-parallel rank): the first out-of-memory error is raised, naming
    the strategy to change, with no rung tried and every weight back where it was."""
    loaded = tiny_loaded("wan2.1-t2v")
    before, hooks_before = storage_map(loaded.pipe), hooks_of(loaded.pipe)
    with InjectOOM(loaded.pipe.transformer.blocks[0], [3]) as oom:
        with pytest.raises(SamplingOutOfMemory, match=r"step 2/4 under offload=model.*keep the strategy") as caught:
            run(loaded, MemoryStrategy(offload="model"), request_for("wan2.1-t2v", steps=STEPS), RunHooks(climb_on_oom=False))
    assert oom.raised == 1 and oom.calls == 3 and is_out_of_memory(caught.value.__cause__)
    assert storage_map(loaded.pipe) == before and hooks_of(loaded.pipe) == hooks_before


@pytest.mark.parametrize("message", [
    "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
    "cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
    "CUDA out of memory. Tried to allocate 2.00 GiB",
])
def test_allocation_failures_below_torch_count_as_out_of_memory(message):
    """cuBLAS and cuDNN report a failed workspace allocation as a RuntimeError that need not say
    "out of memory"; both ladders (sampling and decode) climb on it, and on nothing else."""
    assert is_out_of_memory(RuntimeError(message))
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_out_of_memory(ValueError("out of memory"))  # only runtime errors come from allocations


def test_the_decode_ladder_climbs_on_a_cublas_allocation_failure_and_on_nothing_else():
    from test_vae_stages import COG, nearest_decode
    from vidmem.memory.vae import DecodeReport, decode_with_fallback

    decode, calls = nearest_decode(COG), []

    def failing_once(message):
        def run(z):
            calls.append(message)
            if len(calls) == 1:
                raise RuntimeError(message)
            return decode(z)
        return run

    latents, report = torch.randn(1, 16, 3, 16, 16), DecodeReport()
    out = decode_with_fallback(failing_once("CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"), latents,
                               COG, None, free_memory=lambda: None, report=report)
    assert out.shape == (1, 3, 9, 128, 128) and len(report.fallbacks) == 1
    calls.clear()
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        decode_with_fallback(failing_once("mat1 and mat2 shapes cannot be multiplied"), latents, COG, None,
                             free_memory=lambda: None)


def test_fixed_ladder_adds_activation_chunks_after_sequential_where_blocks_chunk():
    names = lambda rungs: [(r.offload.value, r.blocks_to_swap, r.chunk_count) for r in rungs]  # noqa: E731
    assert names(fixed_ladder(MemoryStrategy(offload="block_swap", blocks_to_swap=40), 40, chunkable=True)) == [
        ("sequential", 0, 1), ("sequential", 0, 2), ("sequential", 0, 4), ("sequential", 0, 8), ("sequential", 0, 16),
        ("sequential", 0, 32)]
    assert names(fixed_ladder(MemoryStrategy(offload="sequential", activation_chunks=4), 40, chunkable=True)) == [
        ("sequential", 0, 8), ("sequential", 0, 16), ("sequential", 0, 32)]
    assert names(fixed_ladder(MemoryStrategy(offload="sequential", activation_chunks="auto"), 40, chunkable=True))[0] == (
        "sequential", 0, 2)
    assert fixed_ladder(MemoryStrategy(offload="sequential"), 40, chunkable=False) == []
    # auto resolved to 8 in the attempt that failed: the chunk rungs start above 8, not at 2.
    assert names(fixed_ladder(MemoryStrategy(offload="sequential", activation_chunks="auto"), 40, chunkable=True,
                              chunks_ran=8)) == [("sequential", 0, 16), ("sequential", 0, 32)]


def test_planner_rung_adds_chunks_where_activations_are_the_wall():
    """Not even every block swapped fits at the current count: the fewest chunks under which some
    block count fits, with the fewest such blocks; under sequential, the fewest chunks that fit."""
    model = MemoryStrategy(offload="model")
    chosen = planned_rung(model, 40, lambda s: s.chunk_count >= 4 and s.blocks_to_swap >= 30, chunkable=True)
    assert (chosen.offload.value, chosen.blocks_to_swap, chosen.chunk_count) == ("block_swap", 30, 4)
    # More chunks at the blocks already swapped is a rung of its own.
    swapped = MemoryStrategy(offload="block_swap", blocks_to_swap=12)
    chosen = planned_rung(swapped, 40, lambda s: s.chunk_count >= 2 and s.blocks_to_swap >= 12, chunkable=True)
    assert (chosen.blocks_to_swap, chosen.chunk_count) == (12, 2)
    sequential_only = lambda s: s.offload.value == "sequential" and s.chunk_count >= 8  # noqa: E731
    chosen = planned_rung(model, 40, sequential_only, chunkable=True)
    assert (chosen.offload.value, chosen.chunk_count) == ("sequential", 8)
    assert planned_rung(model, 40, lambda s: False, chunkable=True).chunk_count == CHUNK_STEPS[-1]
    assert planned_rung(model, 40, lambda s: s.chunk_count >= 4, chunkable=False).offload.value == "sequential"
    assert planned_rung(MemoryStrategy(offload="sequential"), 40, sequential_only, chunkable=True).chunk_count == 8
    auto = MemoryStrategy(offload="sequential", activation_chunks="auto")
    assert planned_rung(auto, 40, sequential_only, chunkable=True, chunks_ran=8).chunk_count == 16


@pytest.mark.parametrize("variant", ["wan2.1-t2v", "hunyuanvideo1.5-t2v"])
def test_a_chunk_rung_gives_the_uninterrupted_chunked_run(tiny_loaded, variant):
    loaded = tiny_loaded(variant)
    request = request_for(variant, steps=STEPS)
    first_block = denoiser_blocks(loaded.pipe, loaded.spec)["transformer"][0]
    with InjectOOM(first_block, [3]):  # step 2 (two passes a step)
        result = run(loaded, MemoryStrategy(offload="sequential"), request)
    (rung,) = result.receipt["oom_ladder"]
    assert "activation_chunks=2" in rung["next"] and rung["resumed_from_step"] == 1
    assert result.receipt["activation_chunks"]["chunks"] == 2
    reference = run(loaded, MemoryStrategy(offload="sequential", activation_chunks=2), request).latent["samples"]
    assert torch.equal(result.latent["samples"], reference)


def test_a_model_that_cannot_chunk_stops_after_sequential(tiny_loaded):
    ltx2 = tiny_loaded("ltx2-t2v")  # LTX-2's audio-video blocks are not chunked
    with InjectOOM(ltx2.pipe.transformer.transformer_blocks[0], [2]):
        with pytest.raises(SamplingOutOfMemory, match="even with offload=sequential"):
            run(ltx2, MemoryStrategy(offload="sequential"), request_for("ltx2-t2v", steps=STEPS))


def test_the_chunk_rung_after_auto_starts_above_what_auto_ran(tiny_loaded, monkeypatch):
    """The strategy says auto; the attempt ran with the count auto chose (4 here): the next rung is 8."""
    import vidmem.pipelines.sample_chunks as sample_chunks

    monkeypatch.setattr(sample_chunks, "_auto_count", lambda *args: (4, ""))
    loaded = tiny_loaded("wan2.1-t2v")
    with InjectOOM(loaded.pipe.transformer.blocks[0], [1]):
        result = run(loaded, MemoryStrategy(offload="sequential", activation_chunks="auto"), request_for("wan2.1-t2v", steps=2))
    (rung,) = result.receipt["oom_ladder"]
    assert "activation_chunks=8" in rung["next"] and result.receipt["activation_chunks"]["chunks"] == 8


def test_sage_attention_1_forbids_chunk_rungs_and_the_last_message_says_what_would_allow_them(tiny_loaded):
    from vidmem.pipelines.attention import SAGE1, AttentionKernel, ResolvedAttention
    from vidmem.pipelines.sample import _Run
    from vidmem.pipelines.speed import NO_SPEED_NODE, ResolvedSpeed

    sage1 = ResolvedSpeed(NO_SPEED_NODE, ResolvedAttention(AttentionKernel.SAGE, AttentionKernel.SAGE, SAGE1, "cpu", "float32", "test"))
    assert not sage1.takes_chunks
    sdpa = ResolvedSpeed(NO_SPEED_NODE, ResolvedAttention(AttentionKernel.SDPA, AttentionKernel.SDPA, "native", "cpu", "float32", "test"))
    assert sdpa.takes_chunks
    loaded = tiny_loaded("wan2.1-t2v")
    run_state = _Run(loaded, request_for("wan2.1-t2v"), None, RunHooks(), None, None, None, 0, {}, sage1)
    assert not run_state.chunkable and "attention 'auto'" in run_state._ladder_hint()
    assert fixed_ladder(MemoryStrategy(offload="sequential"), 2, chunkable=run_state.chunkable) == []


# --- out of memory before the loop: placing the weights, encoding the prompt ----------------------------
class OOMAtCopy(StrictBackend):
    """Raises an out-of-memory error at the `at`-th copy of a weight group to the device (1-based,
    counted across attempts): a device allocation failing while weights are placed. `failed`: the
    host tensors of the group that failed."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at, self.calls, self.failed = at, 0, None

    def copy_group(self, hosts, non_blocking, side_stream, timed):
        self.calls += 1
        if self.calls == self.at:
            self.failed = hosts
            raise torch.OutOfMemoryError("CUDA out of memory (injected while copying weights)")
        return super().copy_group(hosts, non_blocking, side_stream, timed)


def owners(pipe, hosts) -> set[str]:
    """The components whose own tensors `hosts` are."""
    owner = {t.data_ptr(): name for name, c in pipe.components.items() if isinstance(c, torch.nn.Module)
             for t in [*c.parameters(), *c.buffers()]}
    return {owner.get(host.data_ptr(), "?") for host in hosts}


@pytest.mark.parametrize("offload, at, component", [("none", 1, "text_encoder"), ("none", 2, "transformer"),
                                                    ("model", 2, "transformer")])
def test_out_of_memory_placing_weights_climbs_and_starts_from_the_first_step(offload, at, component, tiny_loaded):
    """offload=none places every weight before the first step (the text encoder's group, then the
    transformer's): an error there has lost nothing, so the next rung runs from the start (at_step 0).
    Under model the transformer's copy comes with its first forward: step 1."""
    loaded = tiny_loaded("wan2.1-t2v")
    request = request_for("wan2.1-t2v", steps=2)
    final = fixed_ladder(MemoryStrategy(offload=offload), block_count(loaded))[0]
    reference = run(loaded, final, request).latent["samples"]
    before, hooks_before = storage_map(loaded.pipe), hooks_of(loaded.pipe)
    backend = OOMAtCopy(at)
    result = sample(loaded, MemoryStrategy(offload=offload), request, hooks=RunHooks(), backend=backend)
    assert owners(loaded.pipe, backend.failed) == {component}
    (rung,) = result.receipt["oom_ladder"]
    assert rung["at_step"] == (0 if offload == "none" else 1) and rung["resumed_from_step"] == 0
    assert rung["failed"].startswith(f"offload={offload}") and result.receipt["strategy"] == final.describe()
    assert torch.equal(result.latent["samples"], reference)
    assert result.receipt["text_encode"]["cache"]  # the prompt was encoded once, by the attempt that ran
    assert storage_map(loaded.pipe) == before and hooks_of(loaded.pipe) == hooks_before


def test_a_run_that_may_not_climb_says_the_weights_were_being_placed(tiny_loaded):
    loaded = tiny_loaded("wan2.1-t2v")
    with pytest.raises(SamplingOutOfMemory, match=r"while placing the weights on the device \(before the first step\) "
                                                  r"under offload=none.*keep the strategy"):
        sample(loaded, MemoryStrategy(offload="none"), request_for("wan2.1-t2v", steps=2),
               hooks=RunHooks(climb_on_oom=False), backend=OOMAtCopy(2))


TEXT_ENCODER_FIXES = {"none": ["text_encoder=cpu", "leaner offload tier"],
                      "model": ["text_encoder=cpu", "offload=sequential \\(the encoder streams"],
                      "sequential": ["text_encoder=cpu"]}


@pytest.mark.parametrize("offload", list(TEXT_ENCODER_FIXES))
def test_out_of_memory_in_the_text_encoder_is_named_with_its_fixes_and_restores_everything(offload, tiny_loaded):
    """The ladder's rungs stream the denoiser, so none makes the prompt encoder fit: its error is a
    SamplingOutOfMemory naming text_encoder=cpu (and a leaner tier where there is one), not the
    bare torch error, with every weight and hook as before."""
    loaded = tiny_loaded("wan2.1-t2v")
    request = request_for("wan2.1-t2v", steps=2)
    strategy = MemoryStrategy(offload=offload)
    run(loaded, strategy, request)  # first: transformers adds hooks of its own on first use
    before, hooks_before = storage_map(loaded.pipe), hooks_of(loaded.pipe)
    with InjectOOM(loaded.pipe.text_encoder.encoder.block[0], [1]) as oom, \
            pytest.raises(SamplingOutOfMemory, match=f"while encoding the prompt under offload={offload}") as caught:
        run(loaded, strategy, request)
    assert oom.raised == 1 and is_out_of_memory(caught.value.__cause__)
    message = str(caught.value)
    for fix in TEXT_ENCODER_FIXES[offload]:
        assert re.search(fix, message), (fix, message)
    assert ("leaner offload tier" in message) == (offload == "none")
    assert ("choose offload=sequential" in message) == (offload == "model")
    assert storage_map(loaded.pipe) == before and hooks_of(loaded.pipe) == hooks_before


def test_out_of_memory_copying_the_text_encoder_in_is_the_text_encoders(tiny_loaded):
    """Under model the text encoder's weights are copied in when it runs (copy 1): the same message."""
    loaded = tiny_loaded("wan2.1-t2v")
    before, hooks_before = storage_map(loaded.pipe), hooks_of(loaded.pipe)
    backend = OOMAtCopy(1)
    with pytest.raises(SamplingOutOfMemory, match="while encoding the prompt under offload=model.*text_encoder=cpu"):
        sample(loaded, MemoryStrategy(offload="model"), request_for("wan2.1-t2v", steps=2), hooks=RunHooks(),
               backend=backend)
    assert owners(loaded.pipe, backend.failed) == {"text_encoder"}
    assert storage_map(loaded.pipe) == before and hooks_of(loaded.pipe) == hooks_before


def test_a_climb_leaves_no_figure_of_the_failed_attempt_in_the_receipt(tiny_loaded, monkeypatch):
    """auto ran 4 activation chunks in the attempt that failed and 1 in the one that finished: the
    receipt has no activation_chunks entry (written only for more than one chunk), not the stale 4."""
    import vidmem.pipelines.sample_chunks as sample_chunks

    answers = iter([(4, ""), (1, "")])
    monkeypatch.setattr(sample_chunks, "_auto_count", lambda *args: next(answers))
    loaded = tiny_loaded("wan2.1-t2v")
    with InjectOOM(loaded.pipe.transformer.blocks[0], [3]) as oom:
        result = run(loaded, MemoryStrategy(offload="block_swap", blocks_to_swap=1, activation_chunks="auto"),
                     request_for("wan2.1-t2v", steps=3))
    assert oom.raised == 1 and len(result.receipt["oom_ladder"]) == 1
    assert "activation_chunks" not in result.receipt


@pytest.mark.parametrize("variant, part", [("wan2.1-i2v", "image_encoder"), ("cogvideox-i2v", "vae")])
def test_an_out_of_memory_error_encoding_the_start_image_climbs_offload_rungs_only(tiny_loaded, variant, part):
    """The start image is encoded inside the pipeline call, before the first denoiser pass: an error
    there is before the first step (at_step 0), climbs the offload tiers only (activation chunks split
    the transformer's passes, not the image encoder's), and once they are spent says where it ran out
    and what helps there."""
    loaded = tiny_loaded(variant)
    module = getattr(loaded.pipe, part)
    target = module.encoder if part == "vae" else module
    request = request_for(variant, steps=2)
    with InjectOOM(target, [1]) as oom:
        result = run(loaded, MemoryStrategy(offload="none"), request)
    rung = result.receipt["oom_ladder"][0]
    assert oom.raised == 1 and (rung["at_step"], rung["resumed_from_step"]) == (0, 0)
    assert "activation_chunks" not in rung["next"] and rung["next"].startswith("offload=")
    with InjectOOM(target, range(1, 100)) as oom, pytest.raises(SamplingOutOfMemory) as raised:
        run(loaded, MemoryStrategy(offload="sequential"), request)
    assert oom.raised == 1  # sequential is the last offload rung; chunk rungs are not tried for the image
    message = str(raised.value)
    assert "while encoding the start image (before the first step)" in message
    assert "Lower width or height (the start image is encoded" in message and "fp8" not in message
