"""The engine on a real GPU: every tier gives resident's result, copies hide behind compute from
pinned memory, nothing leaks, a real out-of-memory meets the ladder, LoRAs and Cancel behave as on
the CPU. Wan 2.1 1.3B at its real widths (30 blocks), random weights."""

from __future__ import annotations

import pytest
import torch

from gpu import seeded_step
from vidmem.memory import MemoryStrategy
from vidmem.memory.cleanup import free_memory
from vidmem.memory.device import backend_for
from vidmem.memory.offload import StageComponents, apply_strategy
from vidmem.memory.plan.planner import VideoShape

SMALL = VideoShape(480, 320, 21, cfg=False)  # big enough for real kernels, quick enough for a lease
FULL = VideoShape(832, 480, 81, cfg=False)  # the shape for the overlap goal
TIERS = {
    "model": MemoryStrategy(offload="model"),
    "block_swap_10": MemoryStrategy(offload="block_swap", blocks_to_swap=10),
    "block_swap_30_p0": MemoryStrategy(offload="block_swap", blocks_to_swap=30, prefetch_blocks=0),
    "block_swap_30_p2": MemoryStrategy(offload="block_swap", blocks_to_swap=30, prefetch_blocks=2),
    "sequential": MemoryStrategy(offload="sequential"),
}


def stage_of(module):
    return StageComponents({"transformer": module}, {"transformer": module.blocks})


def step_under(strategy, model, module, shape, device, pool, seed=0):
    with apply_strategy(stage_of(module), strategy, backend_for(device), host_pool=pool):
        return seeded_step(model, module, shape, device, seed)


def test_every_tier_gives_resident_bit_for_bit(wan13b, cuda, pool):
    """Same kernels on the same bytes: streaming changes where weights live, never what is computed,
    so equality is exact (no tolerance): a copy that raced its compute would show here."""
    model, module = wan13b
    reference = step_under(MemoryStrategy(offload="none"), model, module, SMALL, cuda, pool)
    assert torch.isfinite(reference).all()
    for name, strategy in TIERS.items():
        out = step_under(strategy, model, module, SMALL, cuda, pool)
        assert torch.equal(out, reference), f"{name}: max |diff| {(out - reference).abs().max().item():.3e}"


def test_fp8_and_disk_tiers_give_fp8_resident_bit_for_bit(wan13b, cuda, pool, tmp_path):
    from gpu import held_transformer, stored_fp8, write_safetensors
    from vidmem.memory.storage import open_safetensors

    model, module = wan13b
    state = stored_fp8(module)
    in_ram = held_transformer(model, state, "fp8 weights")
    write_safetensors(state, tmp_path / "fp8.safetensors")
    mapped = held_transformer(model, open_safetensors(tmp_path / "fp8.safetensors").tensors, "fp8 file")
    reference = step_under(MemoryStrategy(offload="none"), model, in_ram, SMALL, cuda, pool)
    for name, strategy in TIERS.items():
        assert torch.equal(step_under(strategy, model, in_ram, SMALL, cuda, pool), reference), f"fp8 {name}"
        assert torch.equal(step_under(strategy, model, mapped, SMALL, cuda, pool), reference), f"fp8 on disk {name}"


def test_block_swap_copies_hide_behind_compute_from_pinned_memory(wan13b, cuda, pool):
    """Goal: 95% of host-to-device copy time runs while a kernel runs; every streamed copy is from
    pinned memory (a pageable `non_blocking` copy is synchronous); no device-wide or stream
    synchronisation inside the step (the schedule's own event waits are counted and bounded)."""
    from gpu import profiled_step
    from vidmem.pipelines.configs.workloads import denoise_step

    model, module = wan13b
    strategy = MemoryStrategy(offload="block_swap", blocks_to_swap=30)
    step = denoise_step(model, "transformer", FULL, module, cuda)
    with torch.no_grad(), apply_strategy(stage_of(module), strategy, backend_for(cuda), host_pool=pool):
        step()  # warm-up: kernels chosen, the pool's arenas pinned
        profile = profiled_step(step, cuda)
    print("block_swap_30 at 832x480x81:", profile)
    assert profile["pageable_copies"] == 0, profile
    # device-wide syncs: the bench's own after the step and the profiler's when it stops (2 seen on an H200)
    assert profile["host_syncs"]["cudaDeviceSynchronize"] <= 2 and profile["host_syncs"]["cudaStreamSynchronize"] == 0, profile
    assert profile["host_syncs"]["cudaEventSynchronize"] <= 30, profile  # at most one throttle wait per streamed block
    assert profile["overlap"] >= 0.95, profile


def test_nothing_leaks_after_three_runs_and_free(wan13b, cuda, pool):
    model, module = wan13b
    strategy = MemoryStrategy(offload="block_swap", blocks_to_swap=20, prefetch_blocks=2)
    step_under(strategy, model, module, SMALL, cuda, pool)  # first use: cuBLAS handles and workspaces
    free_memory(cuda)
    baseline = torch.cuda.memory_allocated(cuda)
    pinned = []
    for _ in range(3):
        step_under(strategy, model, module, SMALL, cuda, pool)
        pinned.append(pool.pinned_bytes)
    free_memory(cuda)
    assert torch.cuda.memory_allocated(cuda) == baseline
    assert torch.cuda.memory_reserved(cuda) <= baseline + 64 * 2**20  # cached segments returned
    assert pinned[0] == pinned[1] == pinned[2], pinned  # the pool pins once, then reuses
    assert all(p.device.type == "cpu" for p in module.parameters())


def test_a_real_out_of_memory_meets_the_ladder(cuda):
    """The allocator capped between tier none's weights and its peak, so the weights load and the
    first step's activations do not fit: the run completes on a leaner rung, the receipt names it,
    and the latent is the final rung's own, bit for bit."""
    from bench.support.blockswap_cpu import build_pipeline
    from bench.support.blockswap_modelled import transformer_config
    from vidmem.pipelines.sample import SampleRequest, sample
    from vidmem.pipelines.sample_ladder import fixed_ladder

    loaded = build_pipeline(dict(transformer_config("wan2.1-t2v-1.3b")[1], text_dim=32))  # the tiny text encoder's width
    loaded.pipe.transformer.to(torch.bfloat16)  # the pipeline casts latents and embeddings to it
    request = SampleRequest("a cat", width=832, height=480, frames=33, steps=2, cfg=5.0, seed=0)
    none = MemoryStrategy(offload="none")
    free_memory(cuda)
    torch.cuda.reset_peak_memory_stats(cuda)
    uncapped = sample(loaded, none, request, device=cuda)
    peak, weights = torch.cuda.max_memory_reserved(cuda), uncapped.receipt["device_weight_bytes"]
    assert peak > weights * 1.2, (peak, weights)  # room between them for a cap
    free_memory(cuda)
    total = torch.cuda.get_device_properties(cuda).total_memory
    torch.cuda.set_per_process_memory_fraction((weights + peak) / 2 / total, cuda)
    try:
        result = sample(loaded, none, request, device=cuda)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, cuda)
    rungs = result.receipt.get("oom_ladder")
    assert rungs, result.receipt
    print("ladder:", [(r["failed"], r["next"], r["at_step"]) for r in rungs])
    final = rungs[-1]["next"]
    assert "block_swap" in final or "sequential" in final
    free_memory(cuda)
    rungs_known = {rung.describe(): rung for rung in fixed_ladder(none, len(loaded.pipe.transformer.blocks))}
    again = sample(loaded, rungs_known[final], request, device=cuda).latent["samples"]
    assert torch.equal(result.latent["samples"], again)


def test_lora_on_streamed_weights_matches_resident(cuda, tmp_path):
    from test_lora import peft_keys, random_lora, write
    from test_lora_tiers import ALL_LINEARS, snapshot
    from vidmem.memory.lora import apply_loras
    from vidmem.pipelines.lora import load_lora, lora_patches
    from vidmem.pipelines.tiny import build_tiny_pipeline

    wan = build_tiny_pipeline("wan2.1-t2v")
    spec = load_lora(write(tmp_path / "wan.safetensors", peft_keys(random_lora(wan.transformer, ALL_LINEARS), None)), wan, 0.9)
    model = wan.transformer
    before = snapshot(model)
    gen = torch.Generator().manual_seed(0)
    inputs = dict(hidden_states=torch.randn(1, 16, 3, 4, 4, generator=gen).to(cuda), timestep=torch.tensor([700], device=cuda),
                  encoder_hidden_states=torch.randn(1, 8, 32, generator=gen).to(cuda), return_dict=False)
    tiers = {"none": MemoryStrategy(offload="none"), "model": MemoryStrategy(offload="model"),
             "block_swap_1": MemoryStrategy(offload="block_swap", blocks_to_swap=1),
             "block_swap_2_p0": MemoryStrategy(offload="block_swap", blocks_to_swap=2, prefetch_blocks=0),
             "block_swap_2_p2": MemoryStrategy(offload="block_swap", blocks_to_swap=2, prefetch_blocks=2),
             "sequential": MemoryStrategy(offload="sequential")}
    outs = {}
    for name, strategy in tiers.items():
        with torch.no_grad(), apply_loras(lora_patches(wan, [spec])), \
                apply_strategy(stage_of(model), strategy, backend_for(cuda)):
            outs[name] = model(**inputs)[0]
    for name, out in outs.items():
        assert torch.equal(out, outs["none"]), name
    tensors, hooks = snapshot(model)
    assert hooks == before[1]
    for name, (ptr, value) in before[0].items():  # streamed tensors keep their pinned home: values, not addresses
        assert torch.equal(tensors[name][1], value) and tensors[name][1].device.type == "cpu", f"{name} changed"


@pytest.mark.parametrize("strategy, stop_after", [
    (MemoryStrategy(offload="block_swap", blocks_to_swap=1, prefetch_blocks=1), 5),
    (MemoryStrategy(offload="sequential"), 1),
], ids=["swap1", "sequential"])
def test_cancel_stops_within_one_block_and_leaves_nothing(strategy, stop_after, tiny_loaded, cuda):
    from test_interrupt import Cancelled, ForwardCounter, all_blocks, assert_restored, cancel_when
    from test_tiers import hooks_of, request_for, storage_map
    from vidmem.pipelines.sample import sample

    loaded = tiny_loaded("wan2.1-t2v")
    request = request_for("wan2.1-t2v", steps=4)
    reference = sample(loaded, strategy, request, device=cuda).latent["samples"]
    before, hooks_before = storage_map(loaded.pipe), hooks_of(loaded.pipe)
    counter = ForwardCounter(all_blocks(loaded))
    try:
        with pytest.raises(Cancelled):
            sample(loaded, strategy, request, cancel_when(lambda: counter.count >= stop_after), device=cuda)
        stopped_at = counter.count
    finally:
        counter.close()
    assert stopped_at == stop_after, f"ran {stopped_at - stop_after} block(s) after Cancel"
    assert_restored(loaded, before, hooks_before)
    assert torch.equal(sample(loaded, strategy, request, device=cuda).latent["samples"], reference)


def test_a_lowered_pinned_ceiling_unlocks_the_pinned_memory_on_the_driver(tiny_folder, cuda):
    """A ceiling lowered after a run unpins the pool's newest arenas and asks torch's host allocator to let
    go of them (`HostPool.fit_ceiling`, then `_host_emptyCache`); proven with the CUDA fake on the CPU
    (tests/test_warm_pinned_ceiling.py). Here: the page-locked bytes torch's host allocator holds from the
    driver (`allocated_bytes`, not `active_bytes`, which counts blocks handed out) fall by at least what
    was unpinned, less the staging slots the second run pins by design (its blocks, pageable now, are
    copied through them; the H200 on 2026-11-28: 1 MiB unpinned, 64 KiB of slots), and the frames stay
    the same."""
    from dataclasses import replace

    from test_tiers import block_count, request_for
    from vidmem.memory.cleanup import release_cached_pinned
    from vidmem.memory.hostpool import HostPool
    from vidmem.pipelines.loader import load_pipeline
    from vidmem.pipelines.sample import sample

    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None:
        pytest.skip("this torch has no torch.cuda.host_memory_stats to read the pinned bytes from")
    loaded = replace(load_pipeline(tiny_folder("wan2.1-t2v"), "fp32"), host_pool=HostPool(arena_bytes=1 << 20))
    swap = MemoryStrategy(offload="block_swap", blocks_to_swap=block_count(loaded), prefetch_blocks=1)
    request = request_for("wan2.1-t2v")
    backend = loaded.backend(cuda)  # the one sample() copies through: its staging slots live as long as it
    slots = lambda: backend.staging.pinned_bytes + backend.uploads.pinned_bytes  # noqa: E731
    try:
        first = sample(loaded, swap, request, device=cuda).latent["samples"]
        unpinned, slots_before = loaded.host_pool.pinned_bytes, slots()
        release_cached_pinned()
        before = stats()
        second = sample(loaded, replace(swap, max_pinned_ram_gb=0.0), request, device=cuda).latent["samples"]
        release_cached_pinned()
        after = stats()
        new_slots = slots() - slots_before
        fell = before["allocated_bytes.current"] - after["allocated_bytes.current"]
        print(f"\nunpinned {unpinned} B, staging slots pinned since {new_slots} B, held from the driver fell "
              f"{fell} B; host allocator before {before}; after {after}")
        assert unpinned > 0 and loaded.host_pool.pinned_bytes == 0 and new_slots < unpinned
        assert fell >= unpinned - new_slots, (before, after)
        assert torch.equal(first, second)
    finally:
        loaded.release_warm()
