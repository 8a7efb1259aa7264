"""Warm runs: weights a call leaves on the device are taken back by the next call, not copied again.

Runs the real tiny pipelines through CudaBackend under the recording CUDA fake (tests/cuda_fake.py):
a "copy" in the fake's log is a host-to-device copy, so a second identical run that copies no
resident weight shows as no compute-stream copy at all. Latents must equal the cold run's, bit for
bit, whatever was kept.
"""

from __future__ import annotations

import gc

import pytest
import torch

from backends import StrictBackend
from cuda_fake import FakeCuda
from test_tiers import block_count, request_for
from vidmem.memory import MemoryStrategy
from vidmem.memory.device import CpuBackend, CudaBackend
from vidmem.memory.warm import STREAMED, WarmStore, WarmStoreBusy, release_everywhere
from vidmem.pipelines.decode import decode
from vidmem.pipelines.hooks import RunHooks
from vidmem.pipelines.loader import load_pipeline
from vidmem.pipelines.prompt_cache import PromptCache
from vidmem.pipelines.sample import sample

VARIANT = "wan2.1-t2v"


@pytest.fixture
def loaded(tiny_folder):
    """A pipeline of this test's own: its warm stores must start empty and may be left full."""
    return load_pipeline(tiny_folder(VARIANT), "fp32")


@pytest.fixture
def hooks(tmp_path):
    """Cached prompts: the second run encodes nothing, so under tier model the text encoder does
    not evict the transformer (a run that encodes uploads the transformer again by design)."""
    return RunHooks(prompt_cache=PromptCache(tmp_path / "prompts"))


def tiers(loaded) -> dict[str, MemoryStrategy]:
    return {"none": MemoryStrategy(offload="none"), "model": MemoryStrategy(offload="model"),
            "block_swap": MemoryStrategy(offload="block_swap", blocks_to_swap=block_count(loaded), prefetch_blocks=1)}


def resident_copies(fake: FakeCuda) -> int:
    return sum(1 for entry in fake.log if entry[0] == "copy" and entry[1] == "compute")


@pytest.mark.parametrize("tier", ["none", "model", "block_swap"])
def test_a_second_identical_run_uploads_no_resident_weight(loaded, hooks, tier, monkeypatch):
    fake = FakeCuda().install(monkeypatch)
    backend = CudaBackend(torch.device("cpu"))
    strategy, request = tiers(loaded)[tier], request_for(VARIANT)
    first = sample(loaded, strategy, request, hooks=hooks, backend=backend)
    assert first.receipt["warm"]["uploaded_bytes"] > 0 and resident_copies(fake) > 0
    fake.log.clear()
    second = sample(loaded, strategy, request, hooks=hooks, backend=backend)
    warm = second.receipt["warm"]
    assert warm["uploaded_bytes"] == 0 and warm["summary"].startswith("warm: 0 B uploaded")
    assert resident_copies(fake) == 0  # nothing copied on the compute stream: every resident weight was kept
    assert warm["reused_bytes"] > 0 and warm["kept_bytes"] == first.receipt["warm"]["kept_bytes"]
    assert torch.equal(first.latent["samples"], second.latent["samples"])
    if tier == "block_swap":  # blocks still stream every step, by design
        assert warm["streamed_bytes"] > 0


def test_a_run_that_encodes_under_tier_model_uploads_the_transformer_again(loaded, monkeypatch):
    """Tier model keeps one component on the device: encoding the prompt evicts the kept
    transformer, so without cached prompts warm runs save only what the tier allows."""
    FakeCuda().install(monkeypatch)
    backend = CudaBackend(torch.device("cpu"))
    strategy, request = MemoryStrategy(offload="model"), request_for(VARIANT)
    sample(loaded, strategy, request, backend=backend)
    second = sample(loaded, strategy, request, backend=backend)
    transformer = sum(p.numel() * p.element_size() for p in loaded.pipe.transformer.parameters())
    assert second.receipt["warm"]["uploaded_bytes"] >= transformer


def test_more_blocks_swapped_uploads_nothing_and_fewer_uploads_only_the_difference(loaded, hooks, monkeypatch):
    FakeCuda().install(monkeypatch)
    backend = CudaBackend(torch.device("cpu"))
    blocks = loaded.pipe.transformer.blocks
    request = request_for(VARIANT)
    one = MemoryStrategy(offload="block_swap", blocks_to_swap=1, prefetch_blocks=0)
    two = MemoryStrategy(offload="block_swap", blocks_to_swap=2, prefetch_blocks=0)
    assert len(blocks) == 2
    sample(loaded, one, request, hooks=hooks, backend=backend)
    more = sample(loaded, two, request, hooks=hooks, backend=backend).receipt["warm"]
    assert more["uploaded_bytes"] == 0  # block 0 was resident: its kept copy serves the first stream
    fewer = sample(loaded, one, request, hooks=hooks, backend=backend).receipt["warm"]
    block0 = sum(p.numel() * p.element_size() for p in blocks[0].parameters())
    assert fewer["uploaded_bytes"] <= block0  # at most the block that became resident again


def test_a_failed_run_keeps_nothing_and_the_next_run_is_cold_and_correct(loaded, hooks, monkeypatch):
    FakeCuda().install(monkeypatch)
    backend = CudaBackend(torch.device("cpu"))
    strategy, request = MemoryStrategy(offload="none"), request_for(VARIANT)
    reference = sample(loaded, strategy, request, hooks=hooks, backend=backend)
    store = loaded.warm_store("sample", backend)
    assert store.held_bytes > 0

    def cancel():
        raise InterruptedError("cancelled")

    with pytest.raises(InterruptedError):
        sample(loaded, strategy, request, hooks=RunHooks(on_step=lambda *a: cancel(), prompt_cache=hooks.prompt_cache),
               backend=backend)
    assert store.held_bytes == 0
    again = sample(loaded, strategy, request, hooks=hooks, backend=backend)
    assert again.receipt["warm"]["reused_bytes"] == 0
    assert torch.equal(reference.latent["samples"], again.latent["samples"])


def test_between_runs_modules_sit_on_their_host_storage_and_no_hook_is_left(loaded, hooks, monkeypatch):
    FakeCuda().install(monkeypatch)
    backend = CudaBackend(torch.device("cpu"))
    transformer = loaded.pipe.transformer
    before = {name: p.data_ptr() for name, p in transformer.named_parameters()}
    sample(loaded, MemoryStrategy(offload="none"), request_for(VARIANT), hooks=hooks, backend=backend)
    assert {name: p.data_ptr() for name, p in transformer.named_parameters()} == before
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in transformer.modules())
    assert loaded.warm_store("sample", backend).held_bytes > 0


def test_a_keep_that_fails_restores_every_module_and_keeps_nothing(loaded, hooks, monkeypatch):
    """The end of a call that went well hands its copies to the store; if that raises half-way (a device
    error while claiming a pending copy), every module still goes back to its host tensors and the store
    keeps none of the copies, so the next call neither computes on stale copies nor keys them as hosts."""
    FakeCuda().install(monkeypatch)
    backend = CudaBackend(torch.device("cpu"))
    transformer = loaded.pipe.transformer
    before = {name: p.data_ptr() for name, p in transformer.named_parameters()}
    kept = []

    def keep_then_fail(self, pairs, rank):
        if kept:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        kept.append(real_keep(self, pairs, rank))

    real_keep = WarmStore.keep
    monkeypatch.setattr(WarmStore, "keep", keep_then_fail)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        sample(loaded, MemoryStrategy(offload="none"), request_for(VARIANT), hooks=hooks, backend=backend)
    assert kept  # the first group was kept before the second failed
    assert {name: p.data_ptr() for name, p in transformer.named_parameters()} == before
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in transformer.modules())
    assert loaded.warm_store("sample", backend).held_bytes == 0


def test_the_decode_keeps_its_vae_warm(loaded, hooks, monkeypatch):
    fake = FakeCuda().install(monkeypatch)
    backend = CudaBackend(torch.device("cpu"))
    latent = sample(loaded, MemoryStrategy(offload="model"), request_for(VARIANT), hooks=hooks, backend=backend).latent
    first = decode(loaded, latent, backend=backend)
    fake.log.clear()
    second = decode(loaded, latent, backend=backend)
    assert second.receipt["warm"]["uploaded_bytes"] == 0 and resident_copies(fake) == 0
    assert torch.equal(first.frames, second.frames)


def test_ten_runs_hold_constant_memory_and_leave_no_tensors_behind(loaded, hooks, monkeypatch):
    FakeCuda().install(monkeypatch)
    backend = CudaBackend(torch.device("cpu"))
    strategy, request = MemoryStrategy(offload="block_swap", blocks_to_swap=1, prefetch_blocks=1), request_for(VARIANT)
    store = loaded.warm_store("sample", backend)
    held, counts = [], []
    for _ in range(10):
        sample(loaded, strategy, request, hooks=hooks, backend=backend)
        gc.collect()
        held.append((store.held_bytes, store.tensors, loaded.host_pool.pinned_bytes))
        counts.append(sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor)))
    assert len(set(held[1:])) == 1
    assert max(counts[2:]) - min(counts[2:]) <= 2  # flat: no copies piling up run over run


def test_the_host_gets_memory_back_streamed_blocks_first():
    store = WarmStore("test")
    hosts = [torch.zeros(256) for _ in range(3)]
    store.keep([(hosts[0], hosts[0].clone())], rank=2)
    store.keep([(hosts[1], hosts[1].clone()), (hosts[2], hosts[2].clone())], rank=STREAMED)
    assert store.release(1) == 1024 and store.holds_all([hosts[0], hosts[1]]) and not store.holds_all([hosts[2]])
    assert store.release(2048) == 2048 and store.held_bytes == 0 and store.released_bytes == 3072


def test_a_call_on_another_device_takes_no_kept_copy_and_they_go_before_the_host_is_asked():
    """retain() is what the host's room request follows: copies kept for another device (a GPU changed in the
    loader or the placement) must be gone by then, not only when the call starts, or the host counts them as
    loaded on the new device and frees too little."""
    store = WarmStore("test")
    hosts = [torch.zeros(256) for _ in range(2)]
    with store.in_use(torch.device("cuda", 0)):
        store.keep([(host, host.clone()) for host in hosts], rank=STREAMED)
    assert store.retain(hosts, take_over=False, device=torch.device("cuda", 0)) == 0 and store.held_bytes == 2048
    assert store.retain(hosts, take_over=False, device=torch.device("cuda", 1)) == 2048 and store.held_bytes == 0


def test_a_request_from_another_thread_mid_call_is_refused_and_applied_at_the_end():
    import threading

    store, host = WarmStore("sampling"), torch.zeros(256)
    store.keep([(host, host.clone())], rank=2)
    errors = []
    with store.in_use(torch.device("cpu")):
        thread = threading.Thread(target=lambda: errors.append(_try(lambda: store.release(10))))
        thread.start()
        thread.join()
        assert store.held_bytes == 1024  # nothing given back while the call runs
        assert store.release(1) == 1024  # the call's own thread may
        store.keep([(host, host.clone())], rank=2)
    assert isinstance(errors[0], WarmStoreBusy) and "mid-call" in str(errors[0])
    assert store.held_bytes == 0  # the refused request was applied when the call ended


def test_free_vram_releases_every_pipelines_kept_weights(loaded, hooks, monkeypatch):
    FakeCuda().install(monkeypatch)
    backend = CudaBackend(torch.device("cpu"))
    sample(loaded, MemoryStrategy(offload="none"), request_for(VARIANT), hooks=hooks, backend=backend)
    held = loaded.warm_store("sample", backend).held_bytes
    assert held > 0 and release_everywhere() >= held
    assert loaded.warm_store("sample", backend).held_bytes == 0


def test_the_cpu_keeps_no_store_and_a_stand_in_device_does(loaded):
    assert loaded.warm_store("sample", CpuBackend()) is None
    assert isinstance(loaded.warm_store("sample", StrictBackend()), WarmStore)


def _try(call):
    try:
        call()
    except Exception as error:  # noqa: BLE001 - returned for the assertion
        return error
    return None


def block_bytes(loaded, index: int) -> int:
    return sum(p.numel() * p.element_size() for p in loaded.pipe.transformer.blocks[index].parameters())


@pytest.mark.parametrize("room_for", ["all", "one", "none"])
def test_free_memory_keeps_streamed_blocks_on_the_device(loaded, hooks, room_for, monkeypatch):
    """Residency follows free memory: blocks stay after their forward while the budget allows, so
    later steps copy nothing for them; the frames do not change."""
    from vidmem.pipelines.room import KEEP_MARGIN_BYTES

    FakeCuda().install(monkeypatch)
    backend = CudaBackend(torch.device("cpu"))
    blocks = block_count(loaded)
    strategy = MemoryStrategy(offload="block_swap", blocks_to_swap=blocks, prefetch_blocks=0)
    request = request_for(VARIANT)
    cold = sample(load_pipeline(loaded.folder, "fp32"), strategy, request, hooks=hooks, backend=backend)  # keeps nothing
    weights = cold.receipt["device_weight_bytes"]
    extra = {"all": 1 << 30, "one": block_bytes(loaded, 0), "none": 0}[room_for]
    budget = RunHooks(prompt_cache=hooks.prompt_cache, device_budget=lambda device: weights + KEEP_MARGIN_BYTES + extra)
    kept = sample(loaded, strategy, request, hooks=budget, backend=backend)
    residency = kept.receipt["residency"]
    assert residency["kept_groups"] == {"all": blocks, "one": 1, "none": 0}[room_for]
    assert residency["kept_bytes"] <= residency["limit_bytes"] and residency["why"]
    streamed_once = sum(block_bytes(loaded, i) for i in range(blocks))
    if room_for == "all":
        assert kept.receipt["warm"]["streamed_bytes"] == streamed_once  # each block copied once, then kept
    assert cold.receipt["residency"]["kept_groups"] == 0
    assert kept.receipt["warm"]["streamed_bytes"] < cold.receipt["warm"]["streamed_bytes"] or room_for == "none"
    assert torch.equal(cold.latent["samples"], kept.latent["samples"])
    if room_for == "all":
        # the next call finds every block where this one kept it (an H200 re-streamed all but the window's: 13 of 15)
        again = sample(loaded, strategy, request, hooks=budget, backend=backend)
        assert again.receipt["warm"]["streamed_bytes"] == 0
        assert again.receipt["residency"]["kept_groups"] == blocks
        assert torch.equal(cold.latent["samples"], again.latent["samples"])


def test_kept_blocks_beyond_a_smaller_budget_stream_again_and_the_budget_holds(loaded, hooks, monkeypatch):
    """A call that finds more blocks kept than its own budget allows keeps what fits and streams the rest."""
    from vidmem.pipelines.room import KEEP_MARGIN_BYTES

    FakeCuda().install(monkeypatch)
    backend = CudaBackend(torch.device("cpu"))
    blocks = block_count(loaded)
    strategy = MemoryStrategy(offload="block_swap", blocks_to_swap=blocks, prefetch_blocks=0)
    request = request_for(VARIANT)
    cold = sample(load_pipeline(loaded.folder, "fp32"), strategy, request, hooks=hooks, backend=backend)
    weights = cold.receipt["device_weight_bytes"]
    roomy = RunHooks(prompt_cache=hooks.prompt_cache, device_budget=lambda device: weights + KEEP_MARGIN_BYTES + (1 << 30))
    assert sample(loaded, strategy, request, hooks=roomy, backend=backend).receipt["residency"]["kept_groups"] == blocks
    store = loaded.warm_store("sample", backend)
    # as a GPU reports it: what the store holds is not free
    tight = RunHooks(prompt_cache=hooks.prompt_cache,
                     device_budget=lambda device: weights + KEEP_MARGIN_BYTES + block_bytes(loaded, 0) - store.held_bytes)
    again = sample(loaded, strategy, request, hooks=tight, backend=backend)
    residency = again.receipt["residency"]
    assert residency["kept_groups"] == 1 and residency["kept_bytes"] <= residency["limit_bytes"]
    assert 0 < again.receipt["warm"]["streamed_bytes"] < cold.receipt["warm"]["streamed_bytes"]
    assert torch.equal(cold.latent["samples"], again.latent["samples"])


def test_the_keep_budget_counts_only_the_copies_this_call_takes_back(loaded, hooks, monkeypatch):
    """A text encoder kept on the device by the last call (tier none, text_encoder 'device') is not in
    a call whose prompts are cached: its copies are dropped when that call ends, so the keep budget
    must not count them as room (they would let kept blocks take memory the activations need)."""
    import vidmem.pipelines.sample as sampling
    from vidmem.memory.offload import stage_tensors

    FakeCuda().install(monkeypatch)
    backend = CudaBackend(torch.device("cpu"))
    request = request_for(VARIANT)
    sample(loaded, MemoryStrategy(offload="none", text_encoder="device"), request, hooks=hooks, backend=backend)
    store = loaded.warm_store("sample", backend)
    swap = MemoryStrategy(offload="block_swap", blocks_to_swap=block_count(loaded), prefetch_blocks=0)
    taken_back = store.held_bytes_of(stage_tensors(sampling.sample_stage(loaded, swap, encode_text=False)))
    assert 0 < taken_back < store.held_bytes  # the text encoder's copies are held too
    counted = []
    monkeypatch.setattr(sampling, "keep_bytes", lambda free, room, held: counted.append(held) or 0)
    roomy = RunHooks(prompt_cache=hooks.prompt_cache, device_budget=lambda device: 1 << 40)
    sample(loaded, swap, request, hooks=roomy, backend=backend)
    assert counted == [taken_back]


def test_an_out_of_memory_cleanup_drops_every_kept_copy_first(loaded, hooks, monkeypatch):
    from vidmem.memory.cleanup import free_memory

    FakeCuda().install(monkeypatch)
    backend = CudaBackend(torch.device("cpu"))
    sample(loaded, MemoryStrategy(offload="none"), request_for(VARIANT), hooks=hooks, backend=backend)
    held = loaded.warm_store("sample", backend).held_bytes
    # a stage that only gives back what it used itself (Prepare Training Data) leaves the kept copies
    assert held > 0 and free_memory(torch.device("cpu"), release_kept=False).warm_released_bytes == 0
    assert loaded.warm_store("sample", backend).held_bytes == held
    assert free_memory(torch.device("cpu")).warm_released_bytes >= held
    assert loaded.warm_store("sample", backend).held_bytes == 0


def test_a_lora_beside_its_layers_is_kept_warm_with_them(loaded, hooks, tmp_path, monkeypatch):
    """LoRA tensors are the same host tensors every call (registered as buffers for the call), so
    the second run with the same LoRA uploads nothing either; a run without it leaves its copies,
    and computes the plain run's latents bit for bit (no LoRA term left on a kept layer)."""
    from dataclasses import replace

    from test_lora import WAN_LAYERS, peft_keys, random_lora, write
    from vidmem.pipelines.lora import load_lora

    path = write(tmp_path / "wan.safetensors", peft_keys(random_lora(loaded.pipe.transformer, WAN_LAYERS), None))
    with_lora = replace(loaded, loras=(load_lora(path, loaded.pipe, 0.8),))
    FakeCuda().install(monkeypatch)
    backend = CudaBackend(torch.device("cpu"))
    strategy, request = MemoryStrategy(offload="none"), request_for(VARIANT)
    plain_run = sample(loaded, strategy, request, hooks=hooks, backend=backend)
    plain = plain_run.receipt["warm"]
    first = sample(with_lora, strategy, request, hooks=hooks, backend=backend)
    lora_bytes = first.receipt["lora_bytes"]
    assert 0 < first.receipt["warm"]["uploaded_bytes"] == lora_bytes  # only the LoRA's tensors were new
    second = sample(with_lora, strategy, request, hooks=hooks, backend=backend)
    assert second.receipt["warm"]["uploaded_bytes"] == 0
    assert torch.equal(first.latent["samples"], second.latent["samples"])
    assert not torch.equal(first.latent["samples"], plain_run.latent["samples"])  # the LoRA changed the run
    back_run = sample(loaded, strategy, request, hooks=hooks, backend=backend)
    back = back_run.receipt["warm"]
    assert torch.equal(back_run.latent["samples"], plain_run.latent["samples"])  # no LoRA term left on a layer
    assert back["uploaded_bytes"] == 0 and back["kept_bytes"] == plain["kept_bytes"]  # the LoRA's copies dropped


def test_copies_made_by_another_backend_are_not_reused(loaded, hooks, monkeypatch):
    """A pipeline keeps one backend per device (its streams); copies another backend made are dropped."""
    FakeCuda().install(monkeypatch)
    strategy, request = MemoryStrategy(offload="none"), request_for(VARIANT)
    sample(loaded, strategy, request, hooks=hooks, backend=CudaBackend(torch.device("cpu")))
    other = sample(loaded, strategy, request, hooks=hooks, backend=CudaBackend(torch.device("cpu"))).receipt["warm"]
    assert other["reused_bytes"] == 0 and other["uploaded_bytes"] > 0


def test_vidmem_plan_shows_the_cold_and_the_warm_case(capsys):
    from vidmem.cli import main

    main(["plan", "--model", "wan2.1-t2v-1.3b", "--vram", "24", "--ram", "64"])
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("Cold and warm:"))
    assert "first run uploads" in line and "later runs of the same graph find them on the GPU" in line


def test_after_the_out_of_memory_ladder_climbed_the_residency_receipt_says_why_nothing_was_kept(loaded, hooks,
                                                                                                 monkeypatch):
    """Plenty of free memory is known, yet nothing is kept once a rung was climbed: the receipt must say
    so, not that free memory was unknown."""
    from dataclasses import replace

    FakeCuda(oom_at=3, oom_stream="side").install(monkeypatch)
    backend = CudaBackend(torch.device("cpu"))
    roomy = replace(hooks, device_budget=lambda device: 1 << 40)
    strategy = MemoryStrategy(offload="block_swap", blocks_to_swap=1, prefetch_blocks=1)
    receipt = sample(loaded, strategy, request_for(VARIANT), hooks=roomy, backend=backend).receipt
    assert receipt["oom_ladder"] and receipt["residency"]["kept_groups"] == 0
    assert "out-of-memory ladder climbed" in receipt["residency"]["why"]


def test_under_tier_none_a_text_encoder_that_ran_only_at_the_start_goes_before_the_transformer(loaded, monkeypatch):
    """When the host asks for part of the memory back, components not in use when the call ended go
    first (docs/warm-runs.md): under tier none every component stays, yet the text encoder ran only
    at the start and the transformer until the end."""
    FakeCuda().install(monkeypatch)
    backend = CudaBackend(torch.device("cpu"))
    sample(loaded, MemoryStrategy(offload="none", text_encoder="device"), request_for(VARIANT), backend=backend)
    store = loaded.warm_store("sample", backend)
    encoder = list(loaded.pipe.text_encoder.parameters()) + list(loaded.pipe.text_encoder.buffers())
    transformer = list(loaded.pipe.transformer.parameters()) + list(loaded.pipe.transformer.buffers())
    encoder_bytes, transformer_bytes = store.held_bytes_of(encoder), store.held_bytes_of(transformer)
    assert encoder_bytes > 0 and transformer_bytes > 0
    store.release(encoder_bytes)
    assert store.held_bytes_of(encoder) == 0 and store.held_bytes_of(transformer) == transformer_bytes
