"""A host request from ComfyUI's thread racing with the end of a vidmem call: the busy check and the
recording of the refused request are one step under the store's lock, and so are the call's end
clearing its owner and taking the recorded requests. The request is then either applied by the call
it waited for, or sees the call over; it is never recorded after the call ended, to drop what the
next call keeps."""

from __future__ import annotations

import threading
import types

import pytest
import torch

import vidmem.memory.warm as warm_module
from vidmem.memory.warm import ACTIVE_CORE, WarmStore, WarmStoreBusy

KEPT = 1000  # float32 elements the last call left on the device


class SpyLock:
    """The store's lock, saying when a thread is about to wait for it."""

    def __init__(self, about_to_wait) -> None:
        self._lock = threading.Lock()
        self._about_to_wait = about_to_wait

    def __enter__(self) -> "SpyLock":
        self._about_to_wait()
        self._lock.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


class Backend:
    """Stands for the device backend whose copies the stores keep (held weakly, compared by identity)."""


def kept_store() -> WarmStore:
    store = WarmStore("probe")
    host = torch.zeros(KEPT)
    store.keep([(host, host.clone())], ACTIVE_CORE)
    return store


@pytest.mark.parametrize("request_", ["everything", "bytes"])
def test_a_request_checked_as_the_call_ends_is_applied_by_that_call_not_the_next(request_, monkeypatch):
    """ComfyUI's thread finds the store busy, then is switched out before recording its request; the
    call ends meanwhile. The old code recorded the request after the end, so the call kept what it
    had been asked for and the next call, which nobody asked, gave it all back."""
    store = kept_store()
    checking, go = threading.Event(), threading.Event()
    answers = []

    def ask() -> None:
        try:
            answers.append(store.release_all() if request_ == "everything" else store.release(KEPT * 4))
        except WarmStoreBusy as refusal:
            answers.append(refusal)

    comfy = threading.Thread(target=ask)
    call = store.in_use(torch.device("cpu"))
    call.__enter__()

    def end_call() -> None:
        call.__exit__(None, None, None)
        go.set()

    ender = threading.Thread(target=end_call)
    store._lock = SpyLock(lambda: go.set() if threading.current_thread() is ender else None)

    def get_ident() -> int:  # the scheduler switching threads between the busy check and the recording
        if threading.current_thread() is comfy:
            checking.set()
            go.wait(10)  # the call has ended, or its end waits for this request to be recorded
        return threading.get_ident()

    monkeypatch.setattr(warm_module, "threading", types.SimpleNamespace(get_ident=get_ident))
    comfy.start()
    assert checking.wait(10)
    ender.start()
    comfy.join(10)
    ender.join(10)
    assert isinstance(answers[0], WarmStoreBusy)  # refused mid-call, and promised for the call's end
    assert store.held_bytes == 0  # ... where it was applied
    with store.in_use(torch.device("cpu")):  # the next call, which nobody asked to give anything back
        host = torch.ones(KEPT)
        store.keep([(host, host.clone())], ACTIVE_CORE)
    assert store.held_bytes == KEPT * 4


def test_two_sibling_stores_taking_over_each_other_at_once_do_not_deadlock():
    """Each takeover holds both stores' locks, taken in one order whichever store asks."""
    first, second = WarmStore("sample"), WarmStore("decode")
    first.share_with(second)
    backend = Backend()  # one backend: copies made by it may move between the stores
    hosts = [torch.zeros(10) for _ in range(200)]
    for store, mine in ((first, hosts[::2]), (second, hosts[1::2])):
        with store.in_use(torch.device("cpu"), backend):
            store.keep([(host, host.clone()) for host in mine], ACTIVE_CORE)
    first.retain(hosts, take_over=True)
    assert first.held_bytes == len(hosts) * 10 * 4 and second.held_bytes == 0  # the takeover moves copies
    start = threading.Barrier(2)

    def take_over(store: WarmStore) -> None:
        start.wait()
        for _ in range(200):
            store.retain(hosts, take_over=True)

    threads = [threading.Thread(target=take_over, args=(store,), daemon=True) for store in (first, second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not any(thread.is_alive() for thread in threads)
    assert first.held_bytes + second.held_bytes == len(hosts) * 10 * 4  # every copy in exactly one store
