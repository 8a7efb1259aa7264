"""WorkerPool: spawned gloo ranks on loopback run jobs in lockstep; a rank that raises or dies
stops the run with its own error, leaves no process behind, and the next run works."""

from __future__ import annotations

import psutil
import pytest

from parallel_jobs import DieOn, KilledOn, RaiseOn, SilentDeathAmidNews, Steps, SumRanks
from vidmem.memory.parallel import PoolConfig, RankError, WorkerPool


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(PoolConfig.for_cpu(2, threads=1, join_timeout_s=5.0)) as pool:
        yield pool


def gone(pids) -> bool:
    """No process of `pids` is left, not even as a zombie (joined processes are reaped)."""
    return not any(psutil.pid_exists(pid) for pid in pids)


def test_ranks_share_a_group_and_keep_state_between_runs(pool):
    steps = []
    first = pool.run(SumRanks(), on_progress=lambda step, total: steps.append((step, total)))
    second = pool.run(SumRanks())
    assert first["sum"] == second["sum"] == 1 + 2
    assert second["runs"] == first["runs"] + 1  # the same processes, with their state
    assert first["pid"] == second["pid"] in pool.pids
    assert steps == [(1, 1)]  # progress forwarded from rank 0 only


@pytest.mark.parametrize("job, rank, text", [(RaiseOn(1, "rank one broke"), 1, "ValueError: rank one broke"),
                                            (DieOn(0), 0, "exit code 3"),
                                            (KilledOn(1), 1, r"exit code -9 \(SIGKILL: .*out-of-memory killer")])
def test_a_failing_rank_stops_the_run_with_its_error_and_the_next_run_works(pool, job, rank, text):
    pool.run(SumRanks())
    pids = pool.pids
    with pytest.raises(RankError, match=f"rank {rank} failed: .*{text}") as error:
        pool.run(job)
    assert error.value.rank == rank
    assert gone(pids), "every rank of the failed run is stopped"
    assert not pool.alive
    assert pool.run(SumRanks())["sum"] == 3  # a new pool, started by the run
    assert not set(pids) & set(pool.pids)


def test_progress_is_not_news_from_a_rank_when_blaming_one():
    """Progress messages carry a step number where others carry a rank: a step numbered like the rank
    that died silently must not count as that rank having spoken."""
    with WorkerPool(PoolConfig.for_cpu(3, threads=1, join_timeout_s=5.0)) as three:
        with pytest.raises(RankError, match="rank 2 failed: the process died with exit code 9"):
            three.run(SilentDeathAmidNews())


def test_close_lets_go_of_the_queues_and_the_stop_event():
    """They hold named semaphores (and the events queue a pipe) until collected: a closed pool, kept
    by its pipeline until the next run, must not keep them."""
    import gc
    import weakref

    pool = WorkerPool(PoolConfig.for_cpu(2, threads=1))
    pool.run(SumRanks())
    held = [weakref.ref(pool._events), weakref.ref(pool._stop)] + [weakref.ref(jobs) for jobs in pool._jobs]
    pool.close()
    gc.collect()
    assert [ref() for ref in held] == [None] * len(held)
    assert pool.run(SumRanks())["sum"] == 3  # and the pool starts again
    pool.close()


def test_cancel_stops_every_rank_and_re_raises_the_hosts_exception(pool):
    pool.run(SumRanks())
    pids, seen = pool.pids, []

    def check_interrupt():
        if seen:
            raise KeyboardInterrupt("cancel pressed")

    with pytest.raises(KeyboardInterrupt, match="cancel pressed"):
        pool.run(Steps(200, 0.05), on_progress=lambda step, total: seen.append(step), check_interrupt=check_interrupt)
    assert gone(pids)
    assert pool.run(SumRanks())["sum"] == 3


def test_close_leaves_no_process_and_is_idempotent():
    pool = WorkerPool(PoolConfig.for_cpu(2, threads=1))
    pool.run(SumRanks())
    pids = pool.pids
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    assert set(pids) <= children
    pool.close()
    pool.close()
    assert gone(pids)
    assert repr(pool) == "WorkerPool(2 ranks, gloo, closed)"


def test_ranks_start_when_the_pack_is_loaded_as_comfyui_loads_it(tmp_path):
    """ComfyUI imports the pack under a name made from its folder's path, which a fresh process
    cannot import; the ranks import it under the same name from the folder (bootstrap.py)."""
    import importlib
    import importlib.util
    import sys
    from pathlib import Path

    folder = tmp_path / "ComfyUI-vidmem rank test"
    folder.symlink_to(Path(__file__).resolve().parents[1], target_is_directory=True)
    name = str(folder).replace(".", "_x_")
    spec = importlib.util.spec_from_file_location(name, folder / "__init__.py", submodule_search_locations=[str(folder)])
    sys.modules[name] = module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        parallel = importlib.import_module(name + ".memory.parallel")
        assert parallel.PoolConfig.__module__.startswith(name)
        with parallel.WorkerPool(parallel.PoolConfig.for_cpu(2, threads=1)) as pool:
            assert pool.run(SumRanks())["sum"] == 3
    finally:
        for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
            del sys.modules[key]


@pytest.mark.parametrize("visible, gpus, expected", [
    (None, (0, 1), ("0", "1")),
    ("5,7", (0, 1), ("5", "7")),
    ("1,0,2,3", (0, 2), ("1", "2")),  # ComfyUI's --default-device 1 reorders the list
    ("GPU-aaaa, MIG-bbbb", (1,), ("MIG-bbbb",)),
])
def test_ranks_get_the_gpus_this_process_sees(monkeypatch, visible, gpus, expected):
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert PoolConfig.for_gpus(gpus).setup.gpus == expected


def test_a_gpu_outside_the_visible_list_is_named(monkeypatch):
    from vidmem.memory.strategy import StrategyError

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    with pytest.raises(StrategyError, match="gpus lists 2 but CUDA_VISIBLE_DEVICES=5,7"):
        PoolConfig.for_gpus((0, 2))
