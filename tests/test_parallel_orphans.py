"""Ranks die with their coordinator: a coordinator killed with SIGKILL (no atexit, no finalizer)
leaves no rank behind holding a pipeline or a GPU."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

COORDINATOR = """
import sys
sys.path.insert(0, {tests!r})
from parallel_jobs import SumRanks
from vidmem.memory.parallel import PoolConfig, WorkerPool
pool = WorkerPool(PoolConfig.for_cpu(2, threads=1))
assert pool.run(SumRanks())["sum"] == 3
print("pids", *pool.pids, flush=True)
sys.stdin.read()  # wait to be killed
"""


def alive(pid: int) -> bool:
    """Running or sleeping; a zombie waiting for init to reap it holds no memory and counts as gone."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL is POSIX")
def test_ranks_exit_when_the_coordinator_is_killed():
    script = COORDINATOR.format(tests=str(Path(__file__).parent))
    coordinator = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   text=True)
    try:
        # The ranks share the coordinator's stdout (torch 2.9's gloo prints "[Gloo] Rank 0 is connected ...").
        line = next((line for line in coordinator.stdout if line.startswith("pids ")), "pids")
        pids = [int(pid) for pid in line.split()[1:]]
        assert len(pids) == 2 and all(alive(pid) for pid in pids)
        os.kill(coordinator.pid, signal.SIGKILL)
        coordinator.wait(10)
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and any(alive(pid) for pid in pids):
            time.sleep(0.1)
        left = [pid for pid in pids if alive(pid)]
    finally:
        coordinator.kill()
    for pid in left:  # do not leave them to the next test; the assertion below still fails
        os.kill(pid, signal.SIGKILL)
    assert not left, f"ranks {left} outlived their coordinator"
