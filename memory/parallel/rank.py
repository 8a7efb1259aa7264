"""What runs inside one rank: joining the process group, and the loop that runs jobs in lockstep.

A job is any picklable object with `run(context) -> result` (a frozen dataclass by convention).
It describes what to run, never the weights: each rank opens the files itself. Every rank runs
the same job at the same time; the collectives inside it (diffusers' all-to-all) keep them in
step. `RankContext.state` survives from job to job, so a pipeline loaded by the first run is
reused by the next.
"""

from __future__ import annotations

import ctypes
import gc
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist


class RunCancelled(RuntimeError):
    """Raised inside a rank when the coordinator asked the run to stop."""


class Job(Protocol):
    def run(self, context: "RankContext") -> Any: ...


@dataclass(frozen=True)
class RankSetup:
    """Everything a spawned rank needs to join the group (picklable; no tensors)."""

    world_size: int
    backend: str  # "nccl" on CUDA, "gloo" on CPU
    device_type: str  # "cuda" or "cpu"
    gpus: tuple[str, ...]  # per rank, the CUDA_VISIBLE_DEVICES entry of its GPU (index, UUID or MIG id); () on CPU
    master_port: int
    master_addr: str = "127.0.0.1"
    threads: int | None = None  # CPU threads per rank (None: torch's default)
    timeout_s: float = 1800.0  # a collective waiting longer than this fails the run


@dataclass
class RankContext:
    """A rank's view of the run: who it is, its device, its state, and its channels to the coordinator."""

    rank: int
    world_size: int
    device: torch.device
    state: dict = field(default_factory=dict)
    _report: Callable[[tuple], None] = lambda message: None
    _stop_requested: Callable[[], bool] = lambda: False

    def progress(self, step: int, total: int) -> None:
        """Forward progress to the coordinator (rank 0 only: every rank is at the same step)."""
        if self.rank == 0:
            self._report(("progress", step, total))

    def check_stop(self) -> None:
        """Raise RunCancelled when the coordinator asked to stop (checked per step and per block)."""
        if self._stop_requested():
            raise RunCancelled(f"rank {self.rank}: cancelled by the coordinator")


def join_group(rank: int, setup: RankSetup) -> torch.device:
    """Initialise this process's rank in the group and return its device."""
    if setup.device_type == "cuda":
        # One visible GPU per rank: cuda:0 in this process is the chosen GPU, so libraries that
        # compute `rank % device_count()` (diffusers' enable_parallelism) land on the right one.
        # bootstrap.py sets it before anything can initialise CUDA; this keeps direct callers right.
        os.environ["CUDA_VISIBLE_DEVICES"] = str(setup.gpus[rank])
    elif sys.platform.startswith("linux"):
        # Loopback only: never bind a public interface. Linux's loopback is "lo" (macOS: "lo0",
        # Windows: no such name); elsewhere gloo resolves MASTER_ADDR, 127.0.0.1, itself.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.update(MASTER_ADDR=setup.master_addr, MASTER_PORT=str(setup.master_port))
    if setup.threads:
        torch.set_num_threads(setup.threads)
    device = torch.device("cuda", 0) if setup.device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(setup.backend, rank=rank, world_size=setup.world_size,
                            timeout=timedelta(seconds=setup.timeout_s), device_id=device if device.type == "cuda" else None)
    return device


def die_with_coordinator() -> None:
    """End this rank when its coordinator dies, however it dies (kill -9, the OOM killer, a crash).

    Without this a rank outlives a killed ComfyUI, reparented to init, holding its copy of the
    pipeline (and its GPU) until killed by hand. Two guards: on Linux the kernel sends SIGKILL
    when the parent goes (prctl PR_SET_PDEATHSIG: works even while the rank is stuck in C code,
    e.g. a collective); everywhere, a daemon thread waits on the parent's sentinel (or polls the
    parent pid) and exits the process. PDEATHSIG fires when the *thread* that started the rank
    ends: a pool started from a short-lived thread loses its ranks then, and the next run
    starts new ones (the pool checks its ranks are alive first).
    """
    parent_pid = os.getppid()
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG = 1
        except (OSError, AttributeError):
            pass
    parent = multiprocessing.parent_process()
    threading.Thread(target=_exit_when_parent_goes, args=(parent, parent_pid), name="vidmem-watch-coordinator",
                     daemon=True).start()
    if os.getppid() != parent_pid:  # the parent died before the guards were in place
        os._exit(1)


def _exit_when_parent_goes(parent, parent_pid: int) -> None:
    if parent is not None:
        multiprocessing.connection.wait([parent.sentinel])
    else:  # not started by multiprocessing: the parent pid changes when the parent dies
        while os.getppid() == parent_pid:
            time.sleep(1.0)
    os._exit(1)


def rank_main(rank: int, setup: RankSetup, jobs, events, stop) -> None:
    """Entry point of a spawned rank: join, then run jobs until a None arrives.

    Any exception (in joining or in a job) is reported with its traceback and ends the process:
    the coordinator then stops every other rank, which may be waiting in a collective.
    """
    die_with_coordinator()
    state: dict = {}
    try:
        device = join_group(rank, setup)
        context = RankContext(rank, setup.world_size, device, state, _report=events.put, _stop_requested=stop.is_set)
        events.put(("ready", rank))
        while (job := jobs.get()) is not None:
            result = job.run(context)
            events.put(("result", rank, result if rank == 0 else None))
    except BaseException as error:  # noqa: BLE001 - every failure must reach the coordinator
        kind = "cancelled" if isinstance(error, RunCancelled) else "error"
        events.put((kind, rank, "".join(traceback.format_exception(error)).strip()))
        traceback.clear_frames(error.__traceback__)  # its frames hold the pipeline: leave_group must free it
        raise SystemExit(1) from None
    finally:
        leave_group(state)


def leave_group(state: dict | None = None) -> None:
    """Let go of what this rank kept (its pipeline), then destroy the process group.

    A model under context parallelism holds its device mesh, and the mesh holds its process groups
    (torch 2.13; 2.9's mesh keeps their names). A pipeline's modules and hooks form reference
    cycles, so they are freed only when the cyclic collector next runs: without the collection here
    the groups outlive destroy_process_group and die whenever that is, at worst while the
    interpreter exits, where gloo ends a rank that had finished its run with "terminate called
    without an active exception" (SIGABRT; one torchrun run in 40 on a CPU). Collected here, the
    mesh goes first and destroy_process_group drops the groups' last references while everything
    is still alive. A failed run's traceback holds the pipeline too: callers clear its frames first.
    """
    if state is not None:
        state.clear()
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def run_in_process_group(job: Job, state: dict | None = None) -> Any:
    """Run `job` in an already initialised process group (e.g. under torchrun, env:// rendezvous).

    Every process launched by torchrun calls this with the same job; the result is rank 0's.
    Progress and cancel are not forwarded: torchrun's processes have no coordinator.
    """
    if not dist.is_initialized():
        raise RuntimeError("run_in_process_group needs torch.distributed initialised (launch with torchrun and call "
                           "torch.distributed.init_process_group() first).")
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    context = RankContext(dist.get_rank(), dist.get_world_size(), device, state if state is not None else {})
    return job.run(context)
