"""WorkerPool: spawned ranks (one per GPU, or N CPU processes on gloo) that run jobs in lockstep.

The coordinator (ComfyUI's process, the CLI, a test) sends every rank the same job and waits
for rank 0's result, forwarding progress and Cancel. Failure of any rank ends the whole run:
a rank that raises reports its traceback, a rank that dies is noticed by its exit code, and
in both cases every rank is stopped (the others may be blocked in a collective forever) and
`RankError` is raised here with that rank's number and text. The pool is then closed; the next
`run` starts a new one. Ranks are joined with a timeout, then terminated, then killed, and an
atexit hook closes any pool still open, so no process outlives its coordinator.
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import runpy
import signal
import socket
import sys
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import torch.multiprocessing as mp

from ..strategy import StrategyError
from .bootstrap import RUN_NAME
from .rank import Job, RankSetup

# The pack's package name in this process ("vidmem", or under ComfyUI a name made from its folder)
# and its folder: a rank imports the pack under the same name (bootstrap.py).
PACKAGE = __name__.rsplit(".memory.parallel.pool", 1)[0]
PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
BOOTSTRAP = str(Path(__file__).with_name("bootstrap.py"))

log = logging.getLogger("vidmem")
POLL_S = 0.05
SETTLE_S = 1.0  # after a rank fails, how long to collect the other ranks' news before blaming one


class RankError(RuntimeError):
    """A rank raised or died; the message carries the rank number and its own error text."""

    def __init__(self, rank: int, text: str) -> None:
        lines = text.strip().splitlines() or ["(no message)"]
        super().__init__(f"rank {rank} failed: {lines[-1]}")
        self.rank = rank
        self.text = text  # the rank's whole traceback
        if len(lines) > 1:
            log.error("vidmem: rank %d failed:\n%s", rank, text)


@dataclass(frozen=True)
class PoolConfig:
    """How many ranks, on what. Build with `PoolConfig.for_gpus` or `PoolConfig.for_cpu`."""

    setup: RankSetup
    start_timeout_s: float = 300.0  # joining the group (NCCL init on 8 GPUs can take a while)
    cancel_grace_s: float = 10.0  # after Cancel, how long ranks get to stop by themselves
    join_timeout_s: float = 10.0  # on close, how long a rank gets to exit before it is terminated

    @classmethod
    def for_gpus(cls, gpus: tuple[int, ...], **options) -> "PoolConfig":
        """Ranks on `gpus`, CUDA indices as this process sees them (through its CUDA_VISIBLE_DEVICES)."""
        return cls(RankSetup(len(gpus), "nccl", "cuda", physical_gpus(gpus), free_port()), **options)

    @classmethod
    def for_cpu(cls, world_size: int, threads: int | None = None, **options) -> "PoolConfig":
        return cls(RankSetup(world_size, "gloo", "cpu", (), free_port(), threads=threads), **options)

    @property
    def world_size(self) -> int:
        return self.setup.world_size


def physical_gpus(gpus: tuple[int, ...], visible: str | None = None) -> tuple[str, ...]:
    """What each rank puts in its CUDA_VISIBLE_DEVICES for this process's CUDA indices `gpus`.

    A rank sees only its GPU; set to the bare index, it would be the *physical* GPU of that
    number. When this process is itself restricted (ComfyUI started with CUDA_VISIBLE_DEVICES=2,3,
    or `--default-device 1`, which reorders the list), its cuda:i is the i-th entry of that list,
    an index, a UUID or a MIG id, which is what the rank must be given.
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    if visible is None or not visible.strip():
        return tuple(str(g) for g in gpus)
    entries = [entry.strip() for entry in visible.split(",") if entry.strip()]
    missing = [g for g in gpus if not 0 <= g < len(entries)]
    if missing:
        raise StrategyError(f"gpus lists {','.join(map(str, missing))} but CUDA_VISIBLE_DEVICES={visible} makes only "
                         f"{len(entries)} GPU(s) visible (0..{len(entries) - 1}); list GPUs by their number in this process.")
    return tuple(entries[g] for g in gpus)


def free_port() -> int:
    """A loopback port free now (the OS picks it), for the group's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class WorkerPool:
    """Ranks kept alive between runs. Use `run(job)`; `close()` (or `with`) stops them."""

    def __init__(self, config: PoolConfig) -> None:
        self.config = config
        self._processes: list = []
        self._jobs: list = []
        self._events = None
        self._stop = None
        self._finalizer = None

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        setup = self.config.setup
        return f"WorkerPool({setup.world_size} ranks, {setup.backend}, {'open' if self.alive else 'closed'})"

    @property
    def alive(self) -> bool:
        return bool(self._processes) and all(p.is_alive() for p in self._processes)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._processes]

    def run(self, job: Job, on_progress: Callable[[int, int], None] = lambda step, total: None,
            check_interrupt: Callable[[], None] = lambda: None) -> Any:
        """Run `job` on every rank and return rank 0's result.

        `check_interrupt` is the host's (it raises to cancel): it is polled while ranks work;
        when it raises, the ranks are told to stop, the pool is closed and the exception re-raised.
        """
        try:
            if not self.alive:
                self.close()
                self._start()
            self._stop.clear()
            for jobs in self._jobs:
                jobs.put(job)
            return self._wait_for_result(on_progress, check_interrupt)
        except BaseException:
            # The other ranks may wait in a collective forever: no polite join, stop them now.
            self.close(graceful=False)
            raise

    def close(self, graceful: bool = True) -> None:
        """Stop every rank: ask politely (graceful), then terminate, then kill. Safe to call twice."""
        if self._finalizer is not None and self._finalizer.detach() is not None:
            _shut_down(self._processes, self._jobs + [self._events], self.config.join_timeout_s if graceful else 0.0)
        # The queues and the stop Event hold named semaphores until they are collected: let go now.
        self._processes, self._jobs, self._events, self._stop, self._finalizer = [], [], None, None, None

    def _start(self) -> None:
        # A fresh port per start: the previous group's port may still be in TIME_WAIT.
        config = replace(self.config, setup=replace(self.config.setup, master_port=free_port()))
        context = mp.get_context("spawn")
        self._events, self._stop = context.Queue(), context.Event()
        self._jobs = [context.Queue() for _ in range(config.world_size)]
        setup = pickle.dumps(config.setup)
        self._processes = [
            context.Process(target=runpy.run_path, args=(BOOTSTRAP,), kwargs=dict(run_name=RUN_NAME, init_globals=dict(
                PACKAGE=PACKAGE, ROOT=PACKAGE_ROOT, RANK=rank, SETUP=setup, JOBS=self._jobs[rank], EVENTS=self._events,
                STOP=self._stop, GPU=str(config.setup.gpus[rank]) if config.setup.gpus else None)),
                name=f"vidmem-rank{rank}", daemon=True)
            for rank in range(config.world_size)
        ]
        self._finalizer = weakref.finalize(self, _shut_down, list(self._processes), self._jobs + [self._events],
                                           self.config.join_timeout_s)
        with _host_main_hidden():
            for process in self._processes:
                process.start()
        ready: set[int] = set()
        deadline = time.monotonic() + config.start_timeout_s
        while len(ready) < config.world_size:
            message = self._next_event(deadline, "joining the process group")
            if message is None:
                continue
            if message[0] == "ready":
                ready.add(message[1])
            else:
                self._raise_rank_error(message)

    def _wait_for_result(self, on_progress, check_interrupt) -> Any:
        finished: dict[int, Any] = {}
        while len(finished) < self.config.world_size:
            try:
                check_interrupt()
            except BaseException:
                self._cancel()
                raise
            message = self._next_event(None, "running")
            if message is None:
                continue
            if message[0] == "progress":
                on_progress(message[1], message[2])
            elif message[0] == "result":
                finished[message[1]] = message[2]
            else:
                self._raise_rank_error(message)
        return finished[0]

    def _next_event(self, deadline: float | None, doing: str):
        """The next message from a rank; None after one poll with nothing new. Raises RankError
        when a rank has died without a word, or the deadline passed."""
        try:
            return self._events.get(timeout=POLL_S)
        except queue.Empty:
            pass
        for rank, process in enumerate(self._processes):
            if process.exitcode is not None:
                try:  # its last words may have arrived just after the poll
                    return self._events.get(timeout=POLL_S)
                except queue.Empty:
                    raise RankError(rank, f"{_death(process.exitcode)} while {doing}") from None
        if deadline is not None and time.monotonic() > deadline:
            raise RankError(0, f"timed out after {self.config.start_timeout_s:.0f} s while {doing}")
        return None

    def _raise_rank_error(self, message: tuple) -> None:
        """Raise for the rank that caused the failure, not a peer that merely lost its connection.

        A rank that raises reports first and its peers' broken collectives follow; a rank that
        dies says nothing, so its peers' errors arrive before its exit code is seen. Hence: wait
        a moment, and blame a rank that died silently if there is one, else the first report.
        """
        reported = {message[1]}
        deadline = time.monotonic() + SETTLE_S
        while time.monotonic() < deadline and any(p.is_alive() for p in self._processes):
            try:
                reported |= _speaker(self._events.get(timeout=POLL_S))
            except queue.Empty:
                pass
        while True:  # what the ranks said before exiting (their queues flush at exit)
            try:
                reported |= _speaker(self._events.get(timeout=POLL_S))
            except queue.Empty:
                break
        for rank, process in enumerate(self._processes):
            if rank not in reported and process.exitcode not in (None, 0):
                raise RankError(rank, _death(process.exitcode))
        kind, rank, text = message
        raise RankError(rank, text if kind == "error" else f"stopped ({text})")

    def _cancel(self) -> None:
        """Ask every rank to stop at its next check, give them `cancel_grace_s`, then close."""
        self._stop.set()
        deadline = time.monotonic() + self.config.cancel_grace_s
        while time.monotonic() < deadline and any(p.is_alive() for p in self._processes):
            time.sleep(POLL_S)


def _death(exitcode: int) -> str:
    """How a rank's process ended, in words: a negative exit code is the signal that ended it."""
    text = f"the process died with exit code {exitcode}"
    if exitcode >= 0:
        return text
    try:
        name = signal.Signals(-exitcode).name
    except ValueError:
        return text
    if -exitcode == signal.SIGKILL:  # nobody else sends it to a rank: the pool kills only ranks it stops itself
        return (f"{text} ({name}: on Linux most often the out-of-memory killer; each rank holds its own copy of the "
                "pipeline in RAM, so use fewer GPUs or keep the weights mapped from their files)")
    return f"{text} ({name})"


def _speaker(message: tuple) -> set[int]:
    """The rank a message is from, for blame; none for progress, whose second field is a step."""
    return set() if message[0] == "progress" else {message[1]}


@contextmanager
def _host_main_hidden() -> Iterator[None]:
    """Start processes without re-running the host's main script in them.

    A spawned child imports the parent's `__main__` (ComfyUI's main.py: argument parsing,
    prestartup scripts of every custom node) unless `__main__` names no file. Jobs live in
    importable modules, so the ranks never need it. Restored as soon as the ranks have started.
    """
    main = sys.modules["__main__"]
    saved = {name: main.__dict__[name] for name in ("__spec__", "__file__") if name in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


def _shut_down(processes: list, queues: list, join_timeout_s: float) -> None:
    """Close a pool's ranks, then its queues (each rank's jobs, then the events); a finalizer, so it
    also runs at exit or when the pool is collected."""
    for process, job_queue in zip(processes, queues):
        if join_timeout_s and process.is_alive():
            try:
                job_queue.put(None)
            except (OSError, ValueError):
                pass
    deadline = time.monotonic() + join_timeout_s
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.terminate()
            process.join(2.0)
        if process.is_alive():
            process.kill()
            process.join(2.0)
    for each_queue in queues:
        each_queue.close()
        each_queue.cancel_join_thread()

