"""The attention kernel as resolved on the run's GPU, which the run plans from and the Sampler refuses with
(review s-r34). An auto, or 'sdpa' chosen by name (review s-r35), that falls back to SDPA's math kernel (an sm75
card in bf16: no fused kernel SDPA would pick) holds the whole score matrix: the Sampler's plan, the run's room, the
out-of-memory ladder and activation_chunks=auto count it as they count 'math'. A model whose attention passes a
mask, on a GPU where torch's flags leave SDPA only FlashAttention (which takes none), is refused by every Sampler
path as the plan refuses it, before anything moves. The refusal of flash and cuDNN below sm80 offers 'efficient'
only where it runs.

A GPU is faked by its compute capability, as in test_attention.py; the tiny models run on the CPU, with the run's
kernel resolved as on that GPU."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from backends import StrictBackend
from test_oom_ladder import InjectOOM
from test_tiers import request_for
from vidmem.memory import MemoryStrategy
from vidmem.memory.accounting import Attention
from vidmem.memory.plan import candidates
from vidmem.memory.plan.costs import CUDA_CONTEXT_BYTES
from vidmem.memory.strategy import Parallelism
from vidmem.pipelines import attention
from vidmem.pipelines import sample as sample_module
from vidmem.pipelines.attention import AttentionError, resolve_attention
from vidmem.pipelines.family import denoisers
from vidmem.pipelines.hooks import RunHooks
from vidmem.pipelines.sample import sample
from vidmem.pipelines.speed import Speed, resolve_speed

CUDA = torch.device("cuda", 0)
OLD_GPU, HOPPER = (7, 5), (9, 0)
# The tiny Wan at this size: the planner's denoise footprint under offload none (CUDA context included) is ~575 MB
# for a fused kernel at any slice count, and for the math kernel 663, 621, 600 MB at 1, 2, 4 slices: this room fits
# the fused kernel unsliced and the math kernel only in 4 slices. The run's free figure leaves out the context, made
# already (memory.telemetry.device_room_for_plan adds it back).
SLICED_SHAPE = dict(width=256, height=256, frames=33)
BUDGET = 610_000_000 - CUDA_CONTEXT_BYTES


@pytest.fixture
def gpu(monkeypatch):
    """A CUDA GPU of a chosen compute capability, with torch's flash and cuDNN kernels built in."""

    def make(capability):
        monkeypatch.setattr(attention, "_capability", lambda device: capability)
        monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
        monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)

    return make


# --- 1. an auto that falls back to the math kernel is planned as math -------------------------------------------


@pytest.mark.parametrize("kernel", ["auto", "sdpa"])
def test_an_sdpa_that_falls_back_to_the_math_kernel_holds_the_score_matrix(gpu, kernel):
    """auto, and 'sdpa' chosen by name (where the sm80+ refusal of flash and cuDNN sends users): on an sm75 card in
    bf16 SDPA runs its math kernel, and the receipt says so."""
    gpu(OLD_GPU)
    fallen = resolve_speed(Speed(kernel), CUDA, torch.bfloat16)
    assert fallen.attention.fallback and fallen.attention.materialises_scores
    assert "SDPA will use its math kernel" in fallen.attention.why
    assert fallen.attention.requested.value == kernel and fallen.attention.kernel.value == "sdpa"
    assert fallen.planned_attention is resolve_speed(Speed("math"), CUDA, torch.bfloat16).planned_attention
    assert fallen.planned_attention is Attention.MATH
    assert resolve_speed(Speed(kernel), CUDA, torch.float16).planned_attention is Attention.FUSED  # efficient runs
    gpu(HOPPER)
    assert not resolve_attention(kernel, CUDA, torch.bfloat16).materialises_scores
    assert resolve_speed(Speed(kernel), CUDA, torch.bfloat16).planned_attention is Attention.FUSED


@pytest.fixture
def planned_run(tiny_loaded, gpu, monkeypatch):
    """(capability, kernel, ladder) -> (the attentions the run planned its room, auto's slices and, with `ladder`,
    the rung after an injected out-of-memory error with; the slices its last attempt ran): `kernel` resolved as on
    a GPU of `capability` in bf16, the tiny Wan sampled on the CPU at SLICED_SHAPE with BUDGET bytes free."""
    seen = set()
    real_room, real_fits, real_fewest = sample_module.sample_room, sample_module.planner_fits, candidates.fewest_chunks
    monkeypatch.setattr(sample_module, "resolve_speed", lambda speed, device, dtype, *args, **kwargs:
                        resolve_speed(speed, CUDA, torch.bfloat16))
    monkeypatch.setattr(sample_module, "sample_room", lambda *args: seen.add(("room", args[7])) or real_room(*args))
    monkeypatch.setattr(sample_module, "planner_fits", lambda *args: seen.add(("ladder", args[4])) or real_fits(*args))
    monkeypatch.setattr(candidates, "fewest_chunks", lambda model, shape, strategy, options, vram, **kwargs:
                        seen.add(("chunks", options.attention)) or real_fewest(model, shape, strategy, options, vram,
                                                                                 **kwargs))
    loaded = tiny_loaded("wan2.1-t2v")

    def run(capability, kernel: str, ladder: bool) -> tuple[set, int]:
        gpu(capability)
        seen.clear()
        request = replace(request_for("wan2.1-t2v", steps=1), speed=Speed(kernel), **SLICED_SHAPE)
        strategy = MemoryStrategy(offload="model" if ladder else "none", activation_chunks="auto")
        with InjectOOM(loaded.pipe.transformer.blocks[0], [1] if ladder else []):
            result = sample(loaded, strategy, request, RunHooks(device_budget=lambda device: BUDGET),
                            backend=StrictBackend())
        assert ("oom_ladder" in result.receipt) is ladder
        return set(seen), result.receipt.get("activation_chunks", {}).get("chunks", 1)

    return run


@pytest.mark.parametrize("kernel", ["auto", "sdpa"])
@pytest.mark.parametrize("ladder", [False, True])
def test_the_run_plans_a_fallen_back_auto_as_math(planned_run, ladder, kernel):
    """Room, the ladder's rung and auto's slices: planned as 'math' is, so auto slices the score matrix (4 slices
    unladdered here, where a fused kernel needs none). 'sdpa' by name runs what auto runs."""
    fallen, fallen_chunks = planned_run(OLD_GPU, kernel, ladder)
    math, math_chunks = planned_run(OLD_GPU, "math", ladder)
    steps = {"room", "chunks", "ladder"} if ladder else {"room", "chunks"}
    assert fallen == math == {(step, Attention.MATH) for step in steps}
    assert fallen_chunks == math_chunks > 1
    fused, fused_chunks = planned_run(HOPPER, kernel, ladder)  # SDPA has its fused kernels there
    assert fused == {(step, Attention.FUSED) for step in steps} and fused_chunks < fallen_chunks


def test_the_sampler_node_plans_a_fallen_back_auto_as_math(tiny_loaded, gpu, monkeypatch):
    """The Sampler's own plan (offload auto's choice, and the activation chunks it hands a tier set by hand) counts
    the kernel resolved on the device; its slice count for each attention is the planner's (the run's test above)."""
    from fuzz_support import strategy_widgets
    from vidmem.nodes import NODE_CLASS_MAPPINGS as N
    from vidmem.nodes import sampler as sampler_node

    class Planned(Exception):
        pass

    loaded, seen = tiny_loaded("wan2.1-t2v"), []
    monkeypatch.setattr(sampler_node, "resolve_speed", lambda speed, device, dtype, *args, **kwargs:
                        resolve_speed(speed, CUDA, torch.bfloat16))

    def strategy_for_run(pipeline, choice, shape, device, options):
        seen.append(options.attention)
        raise Planned

    monkeypatch.setattr(sampler_node, "_strategy_for_run", strategy_for_run)
    (choice,) = N["VidMemMemoryStrategy"]().build(**strategy_widgets(activation_chunks="auto"))["result"]
    for capability, kernel in ((OLD_GPU, "auto"), (OLD_GPU, "math"), (HOPPER, "auto")):
        gpu(capability)
        with pytest.raises(Planned):
            N["VidMemVideoSampler"]().sample(loaded, choice, "a cat", "", 32, 32, 9, 1, 5.0, 0, speed=Speed(kernel))
    assert seen == [Attention.MATH, Attention.MATH, Attention.FUSED]


def test_the_plan_route_plans_the_kernel_resolved_on_the_hosts_gpu(gpu, monkeypatch):
    """The chart (GET /vidmem/plan) counts attention as the run will: on an sm75 card in bf16 auto is math's score
    matrix; for a GPU this process cannot see, only math and flex chosen by name are."""
    from vidmem.nodes.plan_route import _planned_attention

    def planned(kernel, device="cuda", dtype=torch.bfloat16):
        return _planned_attention(SimpleNamespace(speed=(("attention", kernel),)), device, dtype)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    gpu(OLD_GPU)
    assert [planned("auto"), planned("math"), planned("auto", dtype=torch.float16)] == [
        Attention.MATH, Attention.MATH, Attention.FUSED]
    gpu(HOPPER)
    assert planned("auto") is Attention.FUSED
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # planning for a GPU this process cannot see
    assert [planned("auto"), planned("math"), planned("auto", device="cpu")] == [
        Attention.FUSED, Attention.MATH, Attention.FUSED]


# --- 2. a masked model with only FlashAttention left is refused by the Sampler --------------------------------------


@pytest.mark.parametrize("kernel", ["auto", "sdpa"])
def test_for_a_masked_model_flash_is_no_fused_kernel_sdpa_would_pick(gpu, monkeypatch, kernel):
    """A masked model (LTX-2, HunyuanVideo 1.5) on an sm86 card whose user switched off the memory-efficient kernel:
    FlashAttention takes no mask and cuDNN ranks after math there, so SDPA runs its math kernel: planned as math."""
    gpu((8, 6))
    monkeypatch.setattr(torch.backends.cuda, "mem_efficient_sdp_enabled", lambda: False)
    masked = resolve_attention(kernel, CUDA, torch.bfloat16, masked_by="ltx2")
    assert masked.materialises_scores and "flash: takes no attention mask, which ltx2's attention passes" in masked.fallback
    assert not resolve_attention(kernel, CUDA, torch.bfloat16).materialises_scores  # unmasked: flash runs


def test_the_math_kernel_warning_comes_from_the_run_once_not_from_checks(gpu, caplog):
    """The queue check and the chart resolve every dtype without running: only the run warns, once per case, and the
    reasons do not advise choosing the very kernel being resolved."""
    import logging

    from vidmem.pipelines import speed as speed_module

    speed_module._warn_math_kernel.cache_clear()
    gpu(OLD_GPU)
    with caplog.at_level(logging.WARNING):
        resolved = resolve_attention("sdpa", CUDA, torch.bfloat16)
        assert not caplog.records  # a check, not a run
        for _ in range(2):
            resolve_speed(Speed("sdpa"), CUDA, torch.bfloat16)
    assert len(caplog.records) == 1 and "SDPA will use its math kernel" in caplog.records[0].getMessage()
    assert "choose 'sdpa'" not in resolved.fallback and "choose 'efficient'" not in resolved.fallback


@pytest.fixture
def flash_only(gpu, monkeypatch):
    """A Hopper GPU whose user switched off SDPA's math, memory-efficient and cuDNN kernels: FlashAttention is left,
    which takes no mask."""
    gpu(HOPPER)
    for flag in ("math_sdp_enabled", "mem_efficient_sdp_enabled", "cudnn_sdp_enabled"):
        monkeypatch.setattr(torch.backends.cuda, flag, lambda: False)


@pytest.mark.parametrize("kernel", ["auto", "sdpa"])
def test_resolve_speed_refuses_a_masked_model_as_resolve_attention_does(flash_only, kernel):
    assert resolve_speed(Speed(kernel), CUDA, torch.bfloat16).attention.kernel.value == "sdpa"  # unmasked: flash runs
    with pytest.raises(AttentionError, match="no kernel left"):
        resolve_attention(kernel, CUDA, torch.bfloat16, masked_by="ltx2")
    with pytest.raises(AttentionError, match="no kernel left"):
        resolve_speed(Speed(kernel), CUDA, torch.bfloat16, masked_by="ltx2")


@pytest.mark.parametrize("variant", ["ltx2-t2v", "hunyuanvideo1.5-t2v"])
@pytest.mark.parametrize("kernel", ["auto", "sdpa"])
def test_every_sampler_path_refuses_a_masked_model_before_anything_moves(tiny_loaded, flash_only, monkeypatch,
                                                                         variant, kernel):
    """sample() (the run), the Sampler node's check before planning, and a context-parallel run before its ranks
    start: each refused as the plan route refuses it, where each went ahead to fail at the first attention call."""
    from vidmem.nodes.sampler import check_before_planning
    from vidmem.nodes.strategy import StrategyChoice
    from vidmem.pipelines.parallel import Ranks, sample_parallel
    from vidmem.pipelines.parallel.run import POOL_ATTRIBUTE

    loaded = replace(tiny_loaded(variant), dtype_name="bf16")  # as the real models compute: flash takes bf16, not fp32
    request = replace(request_for(variant, steps=2), speed=Speed(kernel))
    devices = {p.device for module in denoisers(loaded.pipe, loaded.spec).values() for p in module.parameters()}
    rooms = []
    hooks = RunHooks(make_room=lambda nbytes, device, **_: rooms.append(nbytes))
    refused = pytest.raises(AttentionError, match=f"attention={kernel!r}.*no kernel left")
    with refused:
        sample(loaded, MemoryStrategy(offload="none"), request, hooks, backend=SimpleNamespace(device=CUDA))
    with refused:
        check_before_planning(loaded, StrategyChoice(MemoryStrategy(offload="none")), request, CUDA)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    ulysses = MemoryStrategy(offload="none", parallel=Parallelism(context_parallel="ulysses", degree=2))
    with refused:
        sample_parallel(loaded, ulysses, request, Ranks(gpus=(0, 1)), hooks)
    assert rooms == [] and devices == {p.device for module in denoisers(loaded.pipe, loaded.spec).values()
                                       for p in module.parameters()}
    assert getattr(loaded.pipe, POOL_ATTRIBUTE, None) is None


# --- 3. flash and cuDNN below sm80 offer 'efficient' only where it runs ---------------------------------------------


@pytest.mark.parametrize("kernel", ["flash", "cudnn"])
def test_below_sm80_the_refusal_offers_efficient_only_where_it_runs(gpu, kernel):
    gpu(OLD_GPU)
    with pytest.raises(AttentionError, match=r"needs an sm80\+ GPU .* this one is sm75: choose 'sdpa'\.$") as error:
        resolve_attention(kernel, CUDA, torch.bfloat16)
    assert "'efficient'" not in str(error.value)
    with pytest.raises(AttentionError, match=r"efficient.*\(sm80\+ for bf16\)"):
        resolve_attention("efficient", CUDA, torch.bfloat16)  # why it is not offered
    with pytest.raises(AttentionError, match=r"this one is sm75: choose 'efficient' or 'sdpa'\.$"):
        resolve_attention(kernel, CUDA, torch.float16)
    assert resolve_attention("efficient", CUDA, torch.float16).kernel.value == "efficient"  # offered: it runs
