"""The ComfyUI 0.8.0 behaviours vidmem's warm runs rely on, pinned on tests/comfy_fake.py.

Each test states one behaviour of 0.8.0 (cited as `MM:` comfy/model_management.py, `MP:`
comfy/model_patcher.py, as in docs/design/warm-runs.md section 2) and fails if the fake drifts from it.
`WarmPatcher` answers as the design's VidmemPatcher will (section 4), over a plain byte count.
"""

from __future__ import annotations

import gc

import pytest
import torch

from comfy_fake import CPU, GiB, MiB, FakeComfy, ModelPatcher, VRAMState, stub_module

CUDA0 = torch.device("cuda", 0)
RESERVE = 400 * MiB  # MM:568, Linux without --reserve-vram
MIN_INFERENCE = 0.8 * GiB + RESERVE  # MM:581


class WarmPatcher(ModelPatcher):
    """Holds `held` of the `want` bytes it would like on the device; gives them back on request."""

    def __init__(self, want: int, held: int = 0, refuse: bool = False) -> None:
        self.want, self.held, self.refuse, self.grants = want, held, refuse, []
        super().__init__(stub_module(0, "VidMemStage"), load_device=CUDA0, offload_device=CPU)

    def model_size(self):
        return self.want

    def loaded_size(self):
        return self.held

    def current_loaded_device(self):
        return self.load_device if self.held else self.offload_device

    def partially_load(self, device_to, extra_memory=0, force_patch_weights=False):
        self.grants.append(extra_memory)
        return 0

    def partially_unload(self, device_to, memory_to_free=0, force_patch_weights=False):
        if self.refuse:
            raise RuntimeError("vidmem: busy")
        released = min(self.held, memory_to_free)
        self.held -= released
        return released

    def detach(self, unpatch_all=True):
        if unpatch_all:
            self.held = 0
        return self.model


@pytest.fixture
def fake(monkeypatch):
    return FakeComfy.install(monkeypatch, total_bytes=16 * GiB)


def partially_loaded(fake, nbytes: int, name: str):
    """A native model loaded while only 2 GiB were free: 0.5 GiB of it (one block) on the device."""
    fake.other_used = 14 * GiB
    patcher = fake.native_model(nbytes, name)
    fake.mm.load_models_gpu([patcher])
    fake.other_used = 0
    return patcher


def test_import_comfy_finds_the_fake(fake):
    import comfy.model_management
    import comfy.model_patcher

    assert comfy.model_management is fake.mm
    assert comfy.model_patcher.ModelPatcher is ModelPatcher


def test_the_free_figure_is_total_less_what_models_and_others_hold_with_torchs_cache_counted_free(fake):
    # MM:1278-1322: driver free + (reserved - active); the cache is also the second figure.
    fake.mm.load_models_gpu([fake.native_model(4 * GiB, "Upscaler")])
    fake.other_used, fake.cached = 2 * GiB, 1 * GiB
    assert fake.mm.get_free_memory(CUDA0) == 10 * GiB
    assert fake.mm.get_free_memory(CUDA0, torch_free_too=True) == (10 * GiB, 1 * GiB)
    fake.mm.soft_empty_cache()
    assert (fake.cached, fake.empty_cache_calls) == (0, 1)


def test_the_torch_device_is_cuda_0_and_entries_on_bare_cuda_escape_unload_all_models(fake):
    # MM:171-189 get_torch_device is cuda:0; MM:1552 frees only that device, compared exactly (MM:592),
    # while the memory of an entry registered on `cuda` is on the same GPU.
    assert fake.mm.get_torch_device() == CUDA0 != torch.device("cuda")
    bare = ModelPatcher(stub_module(2 * GiB, "BareCuda"), load_device=torch.device("cuda"), offload_device=CPU)
    fake.mm.load_models_gpu([bare])
    fake.mm.unload_all_models()
    assert fake.entries() == ["BareCuda"]
    assert bare.loaded_size() == 2 * GiB and fake.free_bytes() == 14 * GiB


def test_free_memory_unloads_partially_loaded_models_first_and_stops_once_enough_is_free(fake):
    # MM:594 sort key (-offloaded, refcount, size, index); MM:597-606 stop rule and shortfall;
    # MM:526-536 partial when it covers the shortfall, else a full detach (popped, MM:609-610).
    image = partially_loaded(fake, 4 * GiB, "ImageModel")
    upscaler = fake.native_model(4 * GiB, "Upscaler")
    fake.mm.load_models_gpu([upscaler])
    assert fake.entries() == ["Upscaler", "ImageModel"] and fake.free_bytes() == 11.5 * GiB
    fake.log.clear()

    fake.mm.free_memory(12.5 * GiB, CUDA0)
    assert fake.log == [("free_memory", 12.5 * GiB), ("detach", "ImageModel", True),
                        ("partially_unload", "Upscaler", 0.5 * GiB), ("soft_empty_cache",)]
    assert fake.entries() == ["Upscaler"] and image.loaded_size() == 0
    assert upscaler.loaded_size() == 3 * GiB  # whole 0.5 GiB blocks until more than asked is freed (MP:872)

    fake.log.clear()
    fake.mm.free_memory(1 * GiB, CUDA0)
    assert fake.log == [("free_memory", 1 * GiB)] and upscaler.loaded_size() == 3 * GiB


@pytest.mark.parametrize("cached_share, state, empties", [(0.3, "NORMAL_VRAM", True), (0.2, "NORMAL_VRAM", False),
                                                           (0.3, "HIGH_VRAM", False)])
def test_without_a_full_unload_the_cache_is_emptied_only_over_a_quarter_of_free(fake, cached_share, state, empties):
    # MM:612-618
    fake.mm.vram_state = VRAMState[state]
    fake.cached = int(cached_share * fake.free_bytes())
    fake.mm.free_memory(1 * GiB, CUDA0)
    assert (("soft_empty_cache",) in fake.log) == empties


def test_without_smart_memory_every_load_evicts_every_other_model_fully(monkeypatch):
    # MM:598-604: --disable-smart-memory passes no shortfall, so model_unload detaches whatever the
    # request; keep_loaded is compared with LoadedModel.__eq__, the patcher's identity (MM:541).
    fake = FakeComfy.install(monkeypatch, total_bytes=16 * GiB, smart_memory=False)
    first, second = fake.native_model(2 * GiB, "First"), fake.native_model(2 * GiB, "Second")
    fake.mm.load_models_gpu([first])
    fake.mm.load_models_gpu([second])
    assert fake.entries() == ["Second"] and ("detach", "First", True) in fake.log and first.loaded_size() == 0
    fake.mm.free_memory(0, CUDA0, keep_loaded=[fake.mm.LoadedModel(second)])
    assert fake.entries() == ["Second"] and second.loaded_size() == 2 * GiB
    fake.mm.free_memory(0, CUDA0)
    assert fake.entries() == [] and second.loaded_size() == 0


def test_loading_a_listed_patcher_reuses_its_entry_and_evicts_nothing_when_there_is_room(fake):
    # MM:644-656 reuse; MM:658-666 the entry itself is popped with detach(unpatch_all=False) before
    # free_memory, so it is never its own candidate; MM:705 it goes back at the front.
    warm = WarmPatcher(want=6 * GiB, held=6 * GiB)
    upscaler = fake.native_model(6 * GiB, "Upscaler")
    fake.mm.load_models_gpu([warm])
    fake.mm.load_models_gpu([upscaler])
    entry = fake.mm.current_loaded_models[1]
    fake.log.clear()

    fake.mm.load_models_gpu([warm])
    assert fake.log[:3] == [("load_models_gpu", ["VidMemStage"]), ("detach", "VidMemStage", False),
                            ("free_memory", MIN_INFERENCE)]
    assert [c[0] for c in fake.log[3:]] == ["partially_load"]
    assert fake.mm.current_loaded_models[0] is entry and fake.entries() == ["VidMemStage", "Upscaler"]
    assert warm.held == 6 * GiB and upscaler.loaded_size() == 6 * GiB


def test_a_patcher_popped_for_re_registration_still_holds_device_memory(fake):
    # The pop (MM:660-666) leaves the weights where they are: get_free_memory still sees them, so a
    # short device makes ComfyUI free other models, not count ours as free.
    warm = WarmPatcher(want=6 * GiB, held=6 * GiB)
    fake.mm.load_models_gpu([warm])
    fake.mm.load_models_gpu([fake.native_model(6 * GiB, "Upscaler")])
    fake.other_used = 3 * GiB  # 1 GiB free
    fake.mm.load_models_gpu([warm])
    assert ("partially_unload", "Upscaler", MIN_INFERENCE - 1 * GiB) in fake.log
    assert warm.held == 6 * GiB


@pytest.mark.parametrize("held, required, asked", [
    (1 * GiB, 2 * GiB, 3 * GiB * 1.1 + 2 * GiB + RESERVE),  # the request + reserve is the larger
    (1 * GiB, 0, 3 * GiB * 1.1 + MIN_INFERENCE),  # minimum_inference_memory is the larger
    (0, 0, 4 * GiB * 1.1 + MIN_INFERENCE),  # nothing held: current_loaded_device is the CPU, all of it counts
])
def test_load_models_gpu_frees_1_1x_what_is_missing_plus_room_for_inference(fake, held, required, asked):
    # MM:627 extra_mem; MM:495-499 model_memory_required; MM:672-674 the 1.1 factor.
    fake.mm.load_models_gpu([WarmPatcher(want=4 * GiB, held=held)], memory_required=required)
    assert fake.calls("free_memory")[0][1] == pytest.approx(asked)


def test_a_patcher_that_reports_bare_cuda_is_asked_for_its_whole_size(fake):
    # MM:495-499 compares the entry's device (load_device, cuda:0) with current_loaded_device() exactly:
    # `cuda` there makes ComfyUI free room for all of it again, held bytes included.
    class BareCuda(WarmPatcher):
        def current_loaded_device(self):
            return torch.device("cuda")

    fake.mm.load_models_gpu([BareCuda(want=4 * GiB, held=3 * GiB)])
    assert fake.calls("free_memory")[0][1] == pytest.approx(4 * GiB * 1.1 + MIN_INFERENCE)


def test_load_models_gpu_frees_up_to_the_minimum_when_still_short(fake):
    # MM:629-632 minimum_memory_required = max(min inference, minimum + reserve); MM:676-680.
    fake.other_used = 15 * GiB
    fake.mm.load_models_gpu([WarmPatcher(want=1 * GiB)], minimum_memory_required=2 * GiB)
    assert [c[1] for c in fake.calls("free_memory")] == pytest.approx([1.1 * GiB + MIN_INFERENCE, 2 * GiB + RESERVE])


GRANT_NORMAL = (4 + 2) * GiB - (1 * GiB + RESERVE) - 2 * GiB  # room - minimum required - loaded (MM:693-696)


@pytest.mark.parametrize("state, force_full, grant", [
    ("NORMAL_VRAM", False, GRANT_NORMAL), ("LOW_VRAM", False, GRANT_NORMAL),
    ("NORMAL_VRAM", True, 1e32), ("HIGH_VRAM", False, 1e32), ("NO_VRAM", False, 0.1),
])
def test_the_weight_grant_per_vram_state(monkeypatch, state, force_full, grant):
    # MM:682-701, then model_load turns 0 into 1e32 (MM:507-509). On NVIDIA MIN_WEIGHT_MEMORY_RATIO
    # is 0 (MM:313-315), so the grant is what is free beyond the minimum.
    fake = FakeComfy.install(monkeypatch, total_bytes=16 * GiB, vram_state=state)
    fake.other_used = 10 * GiB  # 4 GiB free beside the 2 GiB held
    warm = WarmPatcher(want=4 * GiB, held=2 * GiB)
    fake.mm.load_models_gpu([warm], memory_required=1 * GiB, force_full_load=force_full)
    assert warm.grants == [pytest.approx(grant)]
    assert ("partially_load", "VidMemStage", warm.grants[0]) in fake.log


def test_no_room_beyond_the_minimum_grants_0_1_bytes_not_everything(fake):
    # MM:698-699: a grant of exactly 0 would mean "load it all" to model_load, so it becomes 0.1.
    warm = WarmPatcher(want=4 * GiB)
    fake.other_used = 15.5 * GiB
    fake.mm.load_models_gpu([warm])
    assert warm.grants == [0.1]


def test_a_short_device_gives_a_negative_grant(fake):
    # MM:695-696 subtracts what is loaded after the max(0, ...): a patcher holding more than the room
    # beyond the minimum is asked for less than nothing.
    warm = WarmPatcher(want=4 * GiB, held=2 * GiB)
    fake.other_used = 13.5 * GiB  # 0.5 GiB free
    fake.mm.load_models_gpu([warm], memory_required=1 * GiB)
    assert warm.grants == [pytest.approx(0.5 * GiB - (1 * GiB + RESERVE))]


def test_a_native_model_answers_a_negative_grant_by_unloading(fake):
    # MP:963-965: partially_load with extra < 0 calls partially_unload(-extra).
    upscaler = fake.native_model(4 * GiB, "Upscaler")
    fake.mm.load_models_gpu([upscaler])
    fake.other_used = 11.5 * GiB  # 0.5 GiB free
    fake.mm.load_models_gpu([upscaler])
    assert upscaler.loaded_size() == 3 * GiB  # asked to give back 0.69 GiB, it freed two 0.5 GiB blocks


def test_unload_all_models_detaches_everything_with_unpatch_all_true(fake):
    # MM:1552 free_memory(1e30, cuda:0): every shortfall exceeds what a model holds, so each detaches.
    warm = WarmPatcher(want=4 * GiB, held=3 * GiB)
    a, b = fake.native_model(2 * GiB, "A"), fake.native_model(2 * GiB, "B")
    for patcher in (warm, a, b):
        fake.mm.load_models_gpu([patcher])
    fake.log.clear()
    fake.mm.unload_all_models()
    assert fake.entries() == []
    assert sorted(fake.calls("detach")) == [("detach", name, True) for name in ("A", "B", "VidMemStage")]
    assert (warm.held, a.loaded_size(), b.loaded_size()) == (0, 0, 0) and fake.free_bytes() == 16 * GiB
    assert fake.log[-1] == ("soft_empty_cache",)


def test_a_partially_unload_that_raises_leaves_current_loaded_models_intact(fake):
    # MM:597-610: pops come after the loop; the partially loaded patcher is the first candidate.
    upscaler = fake.native_model(4 * GiB, "Upscaler")
    fake.mm.load_models_gpu([upscaler])
    warm = WarmPatcher(want=4 * GiB, held=2 * GiB, refuse=True)
    fake.mm.load_models_gpu([warm])
    with pytest.raises(RuntimeError, match="vidmem: busy"):
        fake.mm.free_memory(11 * GiB, CUDA0)
    assert fake.entries() == ["VidMemStage", "Upscaler"]
    assert warm.held == 2 * GiB and upscaler.loaded_size() == 4 * GiB
    warm.refuse = False
    fake.mm.free_memory(11 * GiB, CUDA0)
    assert warm.held == 1 * GiB and fake.entries() == ["VidMemStage", "Upscaler"]


def test_a_raise_after_another_model_was_detached_leaves_an_entry_that_breaks_the_next_call(fake):
    # 0.8.0 hazard: model_unload clears real_model (MM:533-535) but the pop waits for the loop's end, so
    # a raise from a later candidate leaves a detached entry whose is_dead() then raises (MM:549).
    partially_loaded(fake, 4 * GiB, "ImageModel")  # 3.5 GiB offloaded: the first candidate
    warm = WarmPatcher(want=4 * GiB, held=2 * GiB, refuse=True)
    fake.mm.load_models_gpu([warm])
    with pytest.raises(RuntimeError, match="vidmem: busy"):
        fake.mm.free_memory(14.2 * GiB, CUDA0)  # ImageModel detaches (0.7 > 0.5 held), then 0.2 from warm
    assert fake.entries() == ["VidMemStage", "ImageModel"]
    assert fake.mm.current_loaded_models[1].real_model is None
    with pytest.raises(TypeError):
        fake.mm.free_memory(1 * GiB, CUDA0)
    fake.mm.current_loaded_models.clear()  # else the modules' finalizers hit the same TypeError at teardown


def test_a_dropped_patcher_whose_module_lives_is_dead_and_costs_a_gc_on_every_load(fake, caplog):
    # MM:548 is_dead; MM:722-739 cleanup_models_gc collects, which frees a module kept only by a cycle;
    # MM:518 + MM:742 the module's finalizer then drops the entry.
    module = stub_module(1 * GiB, "Leaky")
    module.cycle = [module]  # only the garbage collector can free it
    patcher = ModelPatcher(module, load_device=CUDA0, offload_device=CPU)
    fake.mm.load_models_gpu([patcher])
    # An automatic collection (its timing depends on everything allocated before, e.g. the rest of the
    # suite) would free the cycle early and leave nothing dead: only the host's own gc.collect may run.
    gc.disable()
    try:
        del patcher, module
        assert fake.mm.current_loaded_models[0].is_dead() and ("__del__", "Leaky") in fake.log
        assert fake.free_bytes() == 15 * GiB  # its weights are still on the device

        with caplog.at_level("INFO", logger="comfy"):
            fake.mm.load_models_gpu([fake.native_model(1 * GiB, "Upscaler")])
    finally:
        gc.enable()
    assert ("gc_collect",) in fake.log and "Potential memory leak" in caplog.text
    assert "WARNING, memory leak" not in caplog.text and fake.entries() == ["Upscaler"]


def test_loading_a_clone_replaces_the_originals_entry_and_keeps_its_weights(fake):
    # MP:346 is_clone (same module); MM:658-666 pop + detach(False); MM:471-481 a clone's entry moves
    # to its parent when the clone dies.
    original = fake.native_model(4 * GiB, "Upscaler")
    fake.mm.load_models_gpu([original])
    clone = original.clone()
    fake.mm.load_models_gpu([clone])
    assert ("detach", "Upscaler", False) in fake.log and original.loaded_size() == 4 * GiB
    entry = fake.mm.current_loaded_models[0]
    assert len(fake.mm.current_loaded_models) == 1 and entry.model is clone
    del clone
    assert entry.model is original and not entry.is_dead()


@pytest.mark.parametrize("unload_models, free_memory, unloads, resets", [
    (False, False, False, False), (True, False, True, False), (False, True, True, True), (True, True, True, True),
])
def test_between_prompts_follows_the_free_flags(fake, unload_models, free_memory, unloads, resets):
    # main.py:253-262: unload_models defaults to free_memory; free_memory also resets the caches.
    fake.mm.load_models_gpu([fake.native_model(2 * GiB, "Upscaler")])
    seen = []
    fake.on_reset = lambda: seen.append("reset")
    fake.between_prompts(unload_models=unload_models, free_memory=free_memory)
    assert (("unload_all_models",) in fake.log, fake.entries() == []) == (unloads, unloads)
    assert (seen == ["reset"]) == resets and (("reset_caches",) in fake.log) == resets


def test_without_smart_memory_every_prompt_ends_by_unloading_all(monkeypatch):
    # execution.py:746-747
    fake = FakeComfy.install(monkeypatch, total_bytes=16 * GiB, smart_memory=False)
    fake.mm.load_models_gpu([fake.native_model(2 * GiB, "Upscaler")])
    fake.between_prompts()
    assert fake.entries() == []


def test_after_an_oom_all_models_are_unloaded(fake):
    # execution.py:602-606
    warm = WarmPatcher(want=4 * GiB, held=4 * GiB)
    fake.mm.load_models_gpu([warm])
    fake.after_oom()
    assert fake.entries() == [] and warm.held == 0 and ("detach", "VidMemStage", True) in fake.log


def test_pin_memory_takes_only_parameters_on_the_cpu_within_the_budget(fake):
    # MM:1127 type *names*; MM:1139-1175 checks and budget; MM:1177-1206 unpin by pointer and size.
    fake.mm.MAX_PINNED_MEMORY = 1000
    plain, param = torch.zeros(64), torch.nn.Parameter(torch.zeros(64))
    assert not fake.mm.pin_memory(plain)
    assert fake.mm.pin_memory(param) and fake.mm.TOTAL_PINNED_MEMORY == 256
    assert not fake.mm.pin_memory(param)  # already pinned
    assert not fake.mm.pin_memory(torch.nn.Parameter(torch.zeros(200)))  # 256 + 800 > 1000
    assert fake.mm.unpin_memory(param) and fake.mm.TOTAL_PINNED_MEMORY == 0
    assert not fake.mm.unpin_memory(param)
    fake.mm.MAX_PINNED_MEMORY = -1  # --disable-pinned-memory
    assert not fake.mm.pin_memory(param)
