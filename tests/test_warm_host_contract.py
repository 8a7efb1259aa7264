"""The contract between vidmem's warm stores and the REAL ComfyUI memory manager (0.8.0), where
tests/test_warm_host.py checks it against a stand-in (tests/comfy_fake.py).

Runs only when $VIDMEM_COMFYUI_ROOT names a ComfyUI checkout whose requirements this Python has:

    VIDMEM_COMFYUI_ROOT=/path/to/ComfyUI python -m pytest tests/test_warm_host_contract.py

How ComfyUI is imported. Its modules are imported in a child process started the way ComfyUI is,
`python <this file> --cpu`: the child calls `comfy.options.enable_args_parsing()` as main.py does,
so comfy/cli_args.py parses that argv at its import (without the call it parses `[]`, the
defaults), and ComfyUI's device is then `cpu`. Not in the pytest process, because the import
changes it for every later test: it flips a torch-wide flag
(`allow_fp16_bf16_reduction_math_sdp(True)`), installs a root log handler, loads ~1,300 modules
(comfy_kitchen's custom ops among them), leaves ComfyUI's globals (`args`, `current_loaded_models`)
behind, and nodes/host.py caches its ModelPatcher subclass for the process, so the fake's tests
would then get a subclass of the real class, or this test one of the fake's.

The child runs each scenario on fresh `WarmStore`s holding real tensors, with
`host.model_management` pointed at the real module, and reports what ComfyUI saw as JSON; the tests
below state what it must be. Every scenario must also leave no "memory leak" line in ComfyUI's log
and no exception raised in a `__del__`.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import subprocess
import sys
import threading
import traceback
import weakref
from pathlib import Path

import pytest
import torch

from vidmem.memory.warm import ACTIVE_CORE, IDLE_CORE, STREAMED, WarmStore
from vidmem.nodes import host

ROOT_ENV = "VIDMEM_COMFYUI_ROOT"
COMFY_FLAGS = ["--cpu"]  # ComfyUI's command line in the child
REPORT = "vidmem-contract-report: "  # the child's last line of stdout, before its JSON

MiB = 1 << 20
KEPT_RANKS = (STREAMED, STREAMED, IDLE_CORE, ACTIVE_CORE)  # one 1 MiB copy each: 4 MiB held
WEIGHT_BYTES = 6 * MiB  # the stage's device weights under its strategy (more than the store holds yet)
NEEDED_BYTES = 8 * MiB  # weights + activations, as the Sampler asks
FREE_BESIDE = MiB  # what the "full" CPU has free beside the store (cpu_looks_full)
REQUIRED = 5 * MiB // 2  # another model's free_memory request
ASKED = REQUIRED - FREE_BESIDE  # what ComfyUI then asks the store for: two streamed blocks cover it

pytestmark = pytest.mark.skipif(
    not os.environ.get(ROOT_ENV),
    reason=f"set {ROOT_ENV} to a ComfyUI 0.8.0 checkout (its requirements installed in this Python) to check "
           "nodes/host.py against the real comfy.model_management")


# --- the tests (pytest process) ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def contract():
    """Run every scenario once in a child process that imported ComfyUI; scenario name -> facts."""
    root = Path(os.environ[ROOT_ENV]).expanduser()
    if not (root / "comfy" / "model_management.py").is_file():
        pytest.fail(f"{ROOT_ENV}={root} is not a ComfyUI checkout: it has no comfy/model_management.py")
    vidmem_parent = str(Path(host.__file__).resolve().parents[2])  # the folder `import vidmem` finds it in
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [vidmem_parent, os.environ.get("PYTHONPATH")]))}
    child = subprocess.run([sys.executable, __file__, *COMFY_FLAGS], env=env, capture_output=True, text=True,
                           timeout=600)
    report = [line for line in child.stdout.splitlines() if line.startswith(REPORT)]
    if child.returncode != 0 or not report:
        pytest.fail(f"the ComfyUI child exited {child.returncode} without a report:\n{child.stderr[-6000:]}")
    return json.loads(report[-1][len(REPORT):])


def facts_of(contract: dict, scenario: str) -> dict:
    facts = contract[scenario]
    if "error" in facts:
        pytest.fail(f"{scenario} raised in the ComfyUI child:\n{facts['error']}")
    assert facts["leak_lines"] == [], "ComfyUI found an entry whose patcher died before its module"
    assert facts["unraisable"] == [], "an exception was raised (and ignored) in a __del__ or a finalizer"
    assert facts["cleanup_error"] is None, "ComfyUI's unload_all_models failed after the scenario"
    return facts


def test_a_registration_is_one_entry_that_counts_what_the_store_holds(contract):
    facts = facts_of(contract, "registration")
    first, second = facts["first"], facts["second"]
    assert first["entries"] == first["entries_for_store"] == 1
    assert first["loaded_memory"] == first["held_bytes"] == len(KEPT_RANKS) * MiB
    assert first["model_memory"] == WEIGHT_BYTES and first["entry_device"] == facts["comfy_device"] == "cpu"
    # Registering again: ComfyUI pops its own entry as a clone (detach(unpatch_all=False)) and re-inserts it.
    assert second == {**first, "same_entry": True}
    # Then the scenario drops the store, and its patcher's __del__ detaches with unpatch_all=False.
    assert facts["calls"] == [["partially_load"], ["detach", False], ["partially_load"], ["detach", False]]


def test_make_room_registers_the_store_on_comfyuis_own_device(contract):
    assert facts_of(contract, "make_room")["entries_for_store"] == 1


def test_unload_all_models_empties_the_store_and_removes_its_entry(contract):
    facts = facts_of(contract, "unload_all")
    assert facts["held_bytes"] == 0 and facts["released_bytes"] == len(KEPT_RANKS) * MiB
    assert facts["entries"] == 0 and facts["calls"] == [["partially_load"], ["detach", True], ["detach", False]]


def test_free_memory_asks_for_part_and_the_store_gives_it_back_streamed_blocks_first(contract):
    facts = facts_of(contract, "free_memory")
    assert facts["smart_memory"] and facts["free_before"] == FREE_BESIDE
    assert facts["calls"] == [["partially_load"], ["partially_unload", "cpu", ASKED, 2 * MiB]]
    assert facts["released_bytes"] >= ASKED and facts["free_after"] > REQUIRED
    assert facts["kept_ranks"] == [IDLE_CORE, ACTIVE_CORE]  # the streamed blocks went first
    assert facts["entries_for_store"] == 1 and facts["loaded_memory"] == facts["held_bytes"] == 2 * MiB


def test_a_dropped_store_takes_its_entry_with_it_without_a_leak_warning(contract):
    facts = facts_of(contract, "dropped")  # facts_of: no "Potential memory leak" line
    assert facts["entries_before"] == 1
    assert facts["module_alive"] is False and facts["entries_after_drop"] == 0  # refcounting alone, gc off
    assert facts["entries_after_cleanup"] == 0


def test_a_request_from_another_thread_mid_call_is_deferred_then_honoured(contract):
    """Nothing raises into ComfyUI: while a call holds the store it gives nothing back (0 from
    partially_unload, so ComfyUI detaches the entry and drops it from its list), and the store
    releases what was asked when the call ends; the next call registers again."""
    facts = facts_of(contract, "busy")
    partial, whole = facts["partial"], facts["whole"]
    for request in (partial, whole):
        assert request["raised"] is None
        assert request["held_during"] == request["held_before"] > 0  # nothing taken from a running call
        assert request["entries_during"] == request["entries_after"] == 0
        assert request["held_after"] == 0  # honoured when the call ended
    assert partial["calls"] == [["partially_load"], ["partially_unload", "cpu", ASKED, 0], ["detach", True]]
    assert whole["calls"] == [["partially_load"], ["detach", True]]


def test_the_base_class_del_runs_on_our_patcher_and_gives_nothing_back(contract):
    facts = facts_of(contract, "base_del")  # facts_of: no exception in the patcher's real __del__ either
    assert facts["raised"] is None  # called by hand, then by Python when the store (and so the patcher) goes:
    assert facts["calls"] == [["partially_load"], ["detach", False], ["detach", False]]
    assert facts["held_after"] == facts["held_before"] > 0 and facts["entries"] == 1


def test_a_deferred_request_strands_no_model_comfyui_unloaded_before_it(contract):
    facts = contract["stranded"]
    assert "error" not in facts, facts.get("error")
    assert facts["half_unloaded"] == 0 and facts["next_cleanup"] is None
    assert facts["idle_held"] == 0 and facts["running_held"] == 0  # all given back, the running one at its end
    facts_of(contract, "stranded")


# --- the scenarios (ComfyUI child process) --------------------------------------------------------------

def new_store(label: str) -> WarmStore:
    store = WarmStore(f"vidmem contract {label}")
    for rank in KEPT_RANKS:
        host_tensor = torch.randn(256, 1024)  # 1 MiB of fp32
        store.keep([(host_tensor, host_tensor.clone())], rank=rank)
    return store


def register(store: WarmStore, device, weight_bytes: int = WEIGHT_BYTES) -> None:
    """As a Sampler or Decode call does before its first onload (nodes/host.py make_room)."""
    host.make_room(NEEDED_BYTES, device, warm=store, weight_bytes=weight_bytes)


def entries_of(mm, store: WarmStore) -> list:
    return [entry for entry in mm.current_loaded_models if entry.model is store.host_entry]


def spy_on_requests(patch, store: WarmStore, device) -> list:
    """What ComfyUI asks the store's patcher, in order: [method, arguments..., answer or exception name].
    Recorded on the class: a method stored on the instance would hold it in a reference cycle."""
    calls, cls = [], type(host.registered_patcher(store, device))

    def recorded(name, arguments):
        original = getattr(cls, name)

        def method(self, *args, **kwargs):
            call = [name, *arguments(*args, **kwargs)]
            calls.append(call)
            try:
                answer = original(self, *args, **kwargs)
            except Exception as error:
                call.append(type(error).__name__)
                raise
            if name == "partially_unload":
                call.append(answer)
            return answer

        patch.setattr(cls, name, method)

    recorded("partially_load", lambda *args, **kwargs: [])
    recorded("partially_unload", lambda device_to, memory_to_free=0, **kwargs: [str(device_to), memory_to_free])
    recorded("detach", lambda unpatch_all=True: [unpatch_all])
    return calls


def cpu_looks_full(patch, mm, store: WarmStore) -> None:
    """ComfyUI reads the CPU's free memory from psutil (get_free_memory), where there is always room:
    make the CPU a device on which the store's copies are the only use and FREE_BESIDE is left."""
    capacity = store.held_bytes + FREE_BESIDE

    def get_free_memory(dev=None, torch_free_too=False):
        free = capacity - store.held_bytes
        return (free, 0) if torch_free_too else free

    patch.setattr(mm, "get_free_memory", get_free_memory)


def registration(mm, mp, patch) -> dict:
    device = mm.get_torch_device()
    store = new_store("registration")
    calls = spy_on_requests(patch, store, device)
    register(store, device)
    first_entry = entries_of(mm, store)[0]

    def seen() -> dict:
        entry = entries_of(mm, store)[0]
        return {"entries": len(mm.current_loaded_models), "entries_for_store": len(entries_of(mm, store)),
                "loaded_memory": entry.model_loaded_memory(), "held_bytes": store.held_bytes,
                "model_memory": entry.model_memory(), "entry_device": str(entry.device),
                "same_entry": entry is first_entry}

    first = seen()
    register(store, device)
    return {"comfy_device": str(device), "first": first, "second": seen(), "calls": calls}


def make_room(mm, mp, patch) -> dict:
    store = new_store("make_room")
    host.make_room(NEEDED_BYTES, mm.get_torch_device(), warm=store, weight_bytes=WEIGHT_BYTES)
    return {"entries_for_store": len(entries_of(mm, store)) if store.host_entry is not None else 0}


def unload_all(mm, mp, patch) -> dict:
    store = new_store("unload_all")
    calls = spy_on_requests(patch, store, mm.get_torch_device())
    register(store, mm.get_torch_device())
    mm.unload_all_models()
    return {"held_bytes": store.held_bytes, "released_bytes": store.released_bytes,
            "entries": len(entries_of(mm, store)), "calls": calls}


def free_memory(mm, mp, patch) -> dict:
    device = mm.get_torch_device()
    store = new_store("free_memory")
    calls = spy_on_requests(patch, store, device)
    register(store, device)
    cpu_looks_full(patch, mm, store)
    free_before = mm.get_free_memory(device)
    mm.free_memory(REQUIRED, device)
    return {"smart_memory": not mm.DISABLE_SMART_MEMORY, "free_before": free_before, "calls": calls,
            "free_after": mm.get_free_memory(device), "released_bytes": store.released_bytes,
            "kept_ranks": sorted(kept.rank for kept in store._kept.values()),
            "entries_for_store": len(entries_of(mm, store)),
            "loaded_memory": entries_of(mm, store)[0].model_loaded_memory(), "held_bytes": store.held_bytes}


def dropped(mm, mp, patch) -> dict:
    store = new_store("dropped")
    register(store, mm.get_torch_device())
    entries_before = len(entries_of(mm, store))
    module = weakref.ref(store.host_entry.model)
    gc.disable()  # an automatic collection must not hide a reference cycle
    try:
        del store
        entries_after_drop = len(mm.current_loaded_models)
        mm.cleanup_models_gc()  # logs "Potential memory leak" for an entry whose patcher died before its module
        mm.cleanup_models()
    finally:
        gc.enable()
    return {"entries_before": entries_before, "module_alive": module() is not None,
            "entries_after_drop": entries_after_drop, "entries_after_cleanup": len(mm.current_loaded_models)}


def busy(mm, mp, patch) -> dict:
    device = mm.get_torch_device()

    def mid_call(request) -> dict:
        with pytest.MonkeyPatch.context() as own:  # undone before the next request: one store at a time
            store = new_store("busy")
            calls = spy_on_requests(own, store, device)
            register(store, device)
            cpu_looks_full(own, mm, store)
            facts = {"held_before": store.held_bytes}
            with store.in_use(device):  # a vidmem call holds the store; ComfyUI asks from another thread
                facts["raised"] = on_another_thread(request)
                facts.update(entries_during=len(entries_of(mm, store)), held_during=store.held_bytes)
            facts.update(held_after=store.held_bytes, entries_after=len(entries_of(mm, store)), calls=calls)
        return facts

    return {"partial": mid_call(lambda: mm.free_memory(REQUIRED, device)), "whole": mid_call(mm.unload_all_models)}


def stranded(mm, mp, patch) -> dict:
    """Two stores (the Decode's idle, the Sampler's mid-call): ComfyUI's free_memory visits the idle one
    first (more of it offloaded), unloads it, then the busy one defers: the idle entry must not be stranded."""
    device = mm.get_torch_device()
    idle, running = new_store("idle decode"), new_store("running sampler")
    register(idle, device, weight_bytes=2 * WEIGHT_BYTES)
    register(running, device)
    with running.in_use(device):
        raised = on_another_thread(mm.unload_all_models)
    half_unloaded = [entry for entry in mm.current_loaded_models if entry.real_model is None]
    try:
        mm.cleanup_models_gc()  # the first step of every later load_models_gpu and free_memory
        next_cleanup = None
    except Exception as error:
        next_cleanup = f"{type(error).__name__}: {error}"
    return {"raised": raised, "half_unloaded": len(half_unloaded), "next_cleanup": next_cleanup,
            "idle_held": idle.held_bytes, "running_held": running.held_bytes}


def on_another_thread(call) -> str | None:
    """Run `call` on a second thread (as one of ComfyUI's server handlers would); what it raised, or None."""
    raised = []

    def target():
        try:
            call()
        except Exception as error:
            raised.append(f"{type(error).__name__}: {error}")

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(timeout=60)
    return raised[0] if raised else None


def base_del(mm, mp, patch) -> dict:
    store = new_store("base_del")
    calls = spy_on_requests(patch, store, mm.get_torch_device())
    register(store, mm.get_torch_device())
    held_before = store.held_bytes
    try:
        mp.ModelPatcher.__del__(store.host_entry)  # unpin_all_weights(), then detach(unpatch_all=False)
        raised = None
    except Exception as error:
        raised = f"{type(error).__name__}: {error}"
    facts = {"raised": raised, "calls": calls, "held_before": held_before, "held_after": store.held_bytes,
             "entries": len(entries_of(mm, store))}
    del store  # the patcher goes with it: its real __del__ runs (an exception there lands in "unraisable")
    return facts


SCENARIOS = {"registration": registration, "make_room": make_room, "unload_all": unload_all, "free_memory": free_memory,
             "dropped": dropped, "busy": busy, "base_del": base_del,
             "stranded": stranded}  # last: it can leave ComfyUI unable to load anything


class LeakLines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "memory leak" in record.getMessage():
            self.lines.append(record.getMessage())


def run_scenario(scenario, mm, mp) -> dict:
    leaks, unraisable = LeakLines(), []
    logging.getLogger().addHandler(leaks)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(host, "model_management", mm)
        patch.setattr(sys, "unraisablehook", lambda hook: unraisable.append(
            f"{hook.exc_type.__name__}: {hook.exc_value} in {hook.object!r}"))
        try:
            assert mm.current_loaded_models == [], "the previous scenario left an entry"
            facts = json.loads(json.dumps(scenario(mm, mp, patch)))  # as they were when it returned
        except Exception:
            facts = {"error": traceback.format_exc()}
        gc.collect()
        try:
            mm.unload_all_models()
            facts["cleanup_error"] = None
        except Exception as error:
            facts["cleanup_error"] = f"{type(error).__name__}: {error}"
    logging.getLogger().removeHandler(leaks)
    return {**facts, "leak_lines": leaks.lines, "unraisable": unraisable}


def import_comfyui(root: str):
    """comfy.model_management and comfy.model_patcher as `python main.py <this process's argv>` imports them."""
    sys.path.insert(0, root)
    import comfy.options

    comfy.options.enable_args_parsing()  # main.py's first step: comfy/cli_args.py then parses sys.argv
    import comfy.model_management
    import comfy.model_patcher

    return comfy.model_management, comfy.model_patcher


def child_main() -> int:
    mm, mp = import_comfyui(os.environ[ROOT_ENV])
    logging.getLogger().setLevel(logging.INFO)  # cleanup_models_gc's leak line is an INFO
    report = {name: run_scenario(scenario, mm, mp) for name, scenario in SCENARIOS.items()}
    print(REPORT + json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(child_main())
