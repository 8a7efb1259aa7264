"""vidmem as a good neighbour in ComfyUI's memory manager, against a stand-in of ComfyUI 0.8.0's
(tests/comfy_fake.py): the weights a warm store keeps are one of ComfyUI's loaded models, counted in
its free figure, given back when another model needs the room, on `POST /free` and after an
out-of-memory error, and gone from its list when the pipeline goes.

The tiny pipelines run on the CPU through CudaBackend under the CUDA fake, so their warm stores
hold real copies; the host sees them on ComfyUI's device, `cuda:0`, as inside ComfyUI.
"""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from comfy_fake import GiB, FakeComfy
from cuda_fake import FakeCuda
from test_tiers import request_for
from vidmem.memory import MemoryStrategy
from vidmem.memory.device import CudaBackend
from vidmem.memory.offload import stage_tensors
from vidmem.nodes import host
from vidmem.pipelines.hooks import RunHooks
from vidmem.pipelines.loader import load_pipeline
from vidmem.pipelines.prompt_cache import PromptCache
from vidmem.pipelines.sample import sample, sample_stage

VARIANT = "wan2.1-t2v"
ENTRY = "VidmemWeights"


@pytest.fixture
def comfy(monkeypatch):
    fake = FakeComfy.install(monkeypatch)
    monkeypatch.setattr(host, "model_management", fake.mm)
    return fake


@pytest.fixture
def run(tiny_folder, tmp_path, comfy, monkeypatch):
    """Sample on a pipeline of this test's own, asking the (fake) ComfyUI for room on cuda:0 as the
    Sampler node does; returns (loaded, backend, run_once)."""
    loaded = load_pipeline(tiny_folder(VARIANT), "fp32")  # before the CUDA fake: diffusers imports torch.cuda names
    FakeCuda().install(monkeypatch)
    backend = CudaBackend(torch.device("cpu"))
    cache = PromptCache(tmp_path / "prompts")

    def room(nbytes, device, warm=None, weight_bytes=0):
        host.make_room(nbytes, comfy.device, warm=warm, weight_bytes=weight_bytes)

    def once(strategy=MemoryStrategy(offload="none")):
        return sample(loaded, strategy, request_for(VARIANT), hooks=RunHooks(make_room=room, prompt_cache=cache),
                      backend=backend)

    return loaded, backend, once


def store_of(loaded, backend):
    return loaded.warm_store("sample", backend)


def test_a_run_registers_its_store_as_one_loaded_model_that_counts_what_it_keeps(comfy, run):
    loaded, backend, once = run
    receipt = once().receipt
    store = store_of(loaded, backend)
    assert comfy.entries() == [ENTRY] and comfy.calls("load_models_gpu") == [("load_models_gpu", [ENTRY])]
    entry = comfy.mm.current_loaded_models[0]
    assert entry.model_loaded_memory() == store.held_bytes == receipt["warm"]["kept_bytes"] > 0
    assert entry.device == torch.device("cuda", 0)  # ComfyUI's device object: free_memory compares exactly
    assert comfy.free_bytes() == comfy.total_bytes - store.held_bytes  # its free figure counts vidmem's share


def test_the_second_run_re_registers_without_evicting_itself(comfy, run):
    loaded, backend, once = run
    once()
    held = store_of(loaded, backend).held_bytes
    second = once().receipt["warm"]
    assert second["uploaded_bytes"] == 0 and second["reused_bytes"] == held
    assert comfy.entries() == [ENTRY]  # one entry, not two
    assert not comfy.calls("partially_unload")


def test_another_model_that_needs_the_room_takes_it_back_partly(comfy, run):
    loaded, backend, once = run
    once()
    store = store_of(loaded, backend)
    held = store.held_bytes
    # The rest of the card is taken by something outside the manager; an upscaler wants a little.
    comfy.other_used = comfy.free_bytes() - comfy.mm.minimum_inference_memory() - held // 16
    upscaler = comfy.native_model(held // 8, "Upscaler", blocks=1)
    comfy.mm.load_models_gpu([upscaler])
    assert comfy.calls("partially_unload") and 0 < store.held_bytes < held  # given back in part
    assert ENTRY in comfy.entries()  # the entry stays: it still holds the rest


def test_unload_all_models_post_free_and_the_oom_handler_empty_vidmems_share(comfy, run):
    loaded, backend, once = run
    for empty in (comfy.mm.unload_all_models, lambda: comfy.between_prompts(unload_models=True),
                  lambda: comfy.between_prompts(free_memory=True), comfy.after_oom):
        once()
        assert store_of(loaded, backend).held_bytes > 0 and ENTRY in comfy.entries()
        empty()
        assert store_of(loaded, backend).held_bytes == 0 and ENTRY not in comfy.entries()
        assert comfy.free_bytes() == comfy.total_bytes


def test_a_run_after_comfyui_took_everything_back_is_cold_and_identical(comfy, run):
    loaded, backend, once = run
    first = once()
    comfy.mm.unload_all_models()
    again = once()
    assert again.receipt["warm"]["reused_bytes"] == 0 and again.receipt["warm"]["uploaded_bytes"] > 0
    assert torch.equal(first.latent["samples"], again.latent["samples"])


def test_the_entry_leaves_with_the_pipeline_and_no_leak_is_reported(comfy, tiny_folder, caplog, monkeypatch):
    loaded = load_pipeline(tiny_folder(VARIANT), "fp32")
    FakeCuda().install(monkeypatch)
    backend = CudaBackend(torch.device("cpu"))
    sample(loaded, MemoryStrategy(offload="none"), request_for(VARIANT), backend=backend,
           hooks=RunHooks(make_room=lambda n, d, warm=None, weight_bytes=0: host.make_room(n, comfy.device, warm, weight_bytes)))
    assert comfy.entries() == [ENTRY]
    del loaded, backend
    gc.collect()
    comfy.mm.cleanup_models_gc()
    comfy.mm.cleanup_models()
    assert comfy.entries() == [] and comfy.free_bytes() == comfy.total_bytes
    assert "leak" not in caplog.text.lower()


def test_a_request_from_another_thread_mid_call_never_raises_into_comfyui_and_is_honoured_at_the_end(comfy, run):
    """ComfyUI pops the models it unloaded only after its loop: an exception from vidmem's entry
    would strand the upscaler it unloaded first, and its next load would fail on it."""
    loaded, backend, once = run
    once()
    store = store_of(loaded, backend)
    upscaler = comfy.native_model(GiB, "Upscaler")
    comfy.mm.load_models_gpu([upscaler])
    errors = []

    def other_thread():
        try:
            comfy.mm.unload_all_models()
        except Exception as error:  # noqa: BLE001 - what ComfyUI would have seen
            errors.append(error)

    with store.in_use(torch.device("cpu")):
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
        assert store.held_bytes > 0  # nothing given back while the call runs
    assert errors == []
    assert store.held_bytes == 0  # honoured when the call ended
    comfy.mm.load_models_gpu([upscaler])  # nothing stranded: ComfyUI loads again
    assert comfy.entries() == ["Upscaler"]


def test_without_a_store_make_room_frees_as_before(comfy):
    comfy.native_model(2 * GiB, "Other")
    comfy.mm.load_models_gpu([comfy.natives[0]])
    comfy.other_used = comfy.total_bytes - 3 * GiB
    host.make_room(2 * GiB, comfy.device)
    asked = 2 * GiB + comfy.mm.extra_reserved_memory()
    assert comfy.calls("free_memory")[-1] == ("free_memory", asked)
    assert comfy.free_bytes() > asked  # the other model made room


def test_a_negative_weight_grant_shrinks_the_store_streamed_blocks_first(comfy, run):
    """ComfyUI's grant is the room less what is loaded: negative when the store holds more than
    fits, and the patcher then gives the difference back."""
    loaded, backend, once = run
    once(MemoryStrategy(offload="block_swap", blocks_to_swap=1, prefetch_blocks=1))
    store = store_of(loaded, backend)
    held = store.held_bytes
    patcher = host.registered_patcher(store, comfy.device)
    assert patcher.partially_load(comfy.device, -1) == -store.released_bytes < 0
    assert 0 < store.held_bytes < held  # one kept streamed block went, the core stayed


def request_on_step(loaded, backend, ask, at_step=1):
    """RunHooks whose on_step runs `ask(store)` once, at `at_step`, inside the sampler's call."""
    done = []

    def on_step(step, total):
        if step == at_step and not done:
            done.append(ask(store_of(loaded, backend)))

    return on_step, done


def sample_with(loaded, backend, comfy, strategy, on_step=lambda step, total: None):
    room = lambda n, d, warm=None, weight_bytes=0: host.make_room(n, comfy.device, warm=warm, weight_bytes=weight_bytes)  # noqa: E731
    return sample(loaded, strategy, request_for(VARIANT), hooks=RunHooks(make_room=room, on_step=on_step), backend=backend)


def test_copies_the_call_will_not_take_are_dropped_before_comfyui_is_asked_for_room(comfy, tiny_folder, monkeypatch):
    """A text encoder the last run kept (text_encoder 'device'), left out of this run (text_encoder
    'cpu'), after ComfyUI took the rest back: ComfyUI must not count the text encoder as loaded (it
    would free too little for the transformer), and it must not sit on the device during the call.
    The request for room equals a fresh pipeline's."""
    stale, fresh = load_pipeline(tiny_folder(VARIANT), "fp32"), load_pipeline(tiny_folder(VARIANT), "fp32")
    FakeCuda().install(monkeypatch)
    on_cpu = MemoryStrategy(offload="none", text_encoder="cpu")
    backend = CudaBackend(torch.device("cpu"))
    sample_with(stale, backend, comfy, MemoryStrategy(offload="none", text_encoder="device"))
    this_stage = stage_tensors(sample_stage(stale, on_cpu, encode_text=True))
    store = store_of(stale, backend)
    store.take(this_stage)  # as if ComfyUI had taken the transformer back: only the text encoder is kept
    assert store.held_bytes > 0 and store.held_bytes_of(this_stage) == 0
    requests = []
    for loaded, on in ((stale, backend), (fresh, CudaBackend(torch.device("cpu")))):
        comfy.log.clear()
        on_step, mid_call = request_on_step(loaded, on, lambda store: store.held_bytes - store.held_bytes_of(this_stage))
        sample_with(loaded, on, comfy, on_cpu, on_step)
        assert mid_call == [0]  # nothing but this stage's copies on the device while it runs
        requests.append(comfy.calls("free_memory"))
    assert requests[0] == requests[1] and requests[0]


def fire_from_another_thread(request):
    """What ComfyUI's memory manager does from a second thread: never raises into it."""
    errors = []

    def other_thread():
        try:
            request()
        except Exception as error:  # noqa: BLE001 - what ComfyUI would have seen
            errors.append(error)

    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join()
    return errors


@pytest.mark.parametrize("first", ["device", "cpu"])
def test_unload_all_models_from_another_thread_during_a_real_call_leaves_nothing_kept(comfy, tiny_folder, first,
                                                                                       monkeypatch):
    """Mid-call the groups have taken the copies (the store may hold nothing): ComfyUI drops the entry,
    so when the call ends the store must keep nothing that ComfyUI no longer counts."""
    loaded = load_pipeline(tiny_folder(VARIANT), "fp32")
    FakeCuda().install(monkeypatch)
    backend = CudaBackend(torch.device("cpu"))
    sample_with(loaded, backend, comfy, MemoryStrategy(offload="none", text_encoder=first))
    assert store_of(loaded, backend).held_bytes > 0 and comfy.entries() == [ENTRY]
    on_step, errors = request_on_step(loaded, backend, lambda store: fire_from_another_thread(comfy.mm.unload_all_models))
    sample_with(loaded, backend, comfy, MemoryStrategy(offload="none", text_encoder="cpu"), on_step)
    assert errors == [[]] and comfy.entries() == []
    assert store_of(loaded, backend).held_bytes == 0  # applied in full when the call ended


def test_a_partial_request_from_another_thread_during_a_real_call_is_applied_when_it_ends(comfy, run):
    loaded, backend, once = run
    once()
    store = store_of(loaded, backend)
    held = store.held_bytes
    patcher = host.registered_patcher(store, comfy.device)
    answers = []

    def ask(store):
        return fire_from_another_thread(lambda: answers.append(patcher.partially_unload(comfy.device, held // 2)))

    on_step, errors = request_on_step(loaded, backend, ask)
    sample_with(loaded, backend, comfy, MemoryStrategy(offload="none"), on_step)
    assert errors == [[]] and answers == [0]  # nothing given mid-call (the store held nothing then), nothing raised
    assert 0 < store.held_bytes <= held - held // 2
