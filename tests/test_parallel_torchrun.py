"""The torchrun entry: two gloo processes launched by PyTorch's own launcher give the latent of one
process, and the output file is written whole or not at all. Both launchers (torchrun's and the
pool's ranks) free what holds the process group before destroying it, after a run or a failure."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import weakref

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.device_mesh import init_device_mesh

from vidmem.memory import MemoryStrategy
from vidmem.memory.strategy import Parallelism
from vidmem.memory.parallel import free_port, leave_group
from vidmem.pipelines.parallel import torchrun
from vidmem.pipelines.sample import SampleRequest, sample


def test_torchrun_two_processes_give_the_latent_of_one(tiny_folder, tiny_loaded, tmp_path):
    out = tmp_path / "latent.safetensors"
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    if sys.platform.startswith("linux"):
        env["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "vidmem.pipelines.parallel.torchrun", str(tiny_folder("wan2.1-t2v")), str(out),
               "--prompt", "a cat", "--width", "32", "--height", "32", "--frames", "9", "--steps", "2",
               "--dtype", "fp32", "--seed", "5"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "'ranks': 2" in done.stdout and "'mode': 'ulysses'" in done.stdout
    request = SampleRequest("a cat", "", 32, 32, 9, 2, 5.0, seed=5)
    single = sample(tiny_loaded("wan2.1-t2v"), MemoryStrategy(offload="none"), request, device=torch.device("cpu"))
    split = load_file(str(out))["latent"]
    assert split.shape == single.latent["samples"].shape
    assert split.equal(single.latent["samples"].cpu())
    assert not [p for p in tmp_path.iterdir() if p.name != out.name], "no temporary file left"


def test_an_interrupted_write_leaves_no_file(tmp_path, monkeypatch):
    import safetensors.torch

    out = tmp_path / "latent.safetensors"

    def broken_save(tensors, path):
        with open(path, "wb") as handle:
            handle.write(b"half")
        raise OSError("No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", broken_save)
    with pytest.raises(OSError, match="No space left"):
        torchrun.write_latent(torch.zeros(1, 2), out)
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def collector_off():
    """Only leave_group collects while the test runs."""
    collecting = gc.isenabled()
    gc.disable()
    yield
    if collecting:
        gc.enable()


@pytest.fixture
def group_checks(monkeypatch):
    """A weak reference to a device mesh held only by a reference cycle (as a pipeline's modules and
    hooks hold theirs), and whether it was still alive each time the process group was destroyed;
    the group is destroyed after the test whatever happened."""
    checks = {"meshes": [], "alive_at_destroy": []}
    destroy = dist.destroy_process_group

    def recording_destroy(*args, **kwargs):
        checks["alive_at_destroy"].append(any(mesh() is not None for mesh in checks["meshes"]))
        destroy(*args, **kwargs)

    monkeypatch.setattr(dist, "destroy_process_group", recording_destroy)
    yield checks
    if dist.is_initialized():
        destroy()


def mesh_in_a_cycle(checks) -> dict:
    loaded = {"mesh": init_device_mesh("cpu", (1,), mesh_dim_names=("ulysses",))}
    loaded["self"] = loaded
    checks["meshes"].append(weakref.ref(loaded["mesh"]))
    return loaded


def test_leaving_the_group_frees_what_holds_its_groups_first(collector_off, group_checks):
    """A pipeline's reference cycles hold its device mesh (and the mesh its process groups): they are
    collected before the group is destroyed, never left to die as the interpreter exits (where gloo
    aborted a rank that had finished its run)."""
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    state = {"loaded": mesh_in_a_cycle(group_checks)}
    leave_group(state)
    assert group_checks["alive_at_destroy"] == [False]
    assert state == {} and not dist.is_initialized()


def test_a_failed_torchrun_run_frees_its_pipeline_before_the_group_goes(monkeypatch, collector_off, group_checks,
                                                                       tmp_path):
    """The error's traceback holds the failed run's frames, and they hold the pipeline."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")

    def failing_run(job):
        loaded = mesh_in_a_cycle(group_checks)  # a local of the failed frame
        raise RuntimeError(f"the run failed with {len(loaded)} things loaded")

    monkeypatch.setattr(torchrun, "run_in_process_group", failing_run)
    monkeypatch.setattr(torchrun, "Parallelism", lambda *split: Parallelism(None, split[1], 2))  # one process here
    with pytest.raises(RuntimeError, match="the run failed"):
        torchrun.main([str(tmp_path), str(tmp_path / "latent.safetensors")])
    assert group_checks["alive_at_destroy"] == [False]
    assert not dist.is_initialized()


@pytest.mark.parametrize("argv, share", [([], 5.0), (["--max-pinned-ram-gb", "3"], 3.0)])
def test_torchrun_processes_on_one_machine_share_the_pinned_ceiling(monkeypatch, tmp_path, argv, share):
    """Each of torchrun's processes would size its pinned pool from the same free RAM (N x half of
    it): they take cap / LOCAL_WORLD_SIZE of one automatic ceiling; a ceiling the user gives is kept."""
    from vidmem.memory.units import GiB
    from vidmem.pipelines.parallel import run

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(run, "pinned_cap_bytes", lambda gb, room: 10 * GiB)
    monkeypatch.setattr(torchrun, "Parallelism", lambda *split: Parallelism(None, split[1], 2))  # one process here
    sent = []
    monkeypatch.setattr(torchrun, "run_in_process_group", lambda job: sent.append(job) or 1 / 0)
    with pytest.raises(ZeroDivisionError):
        torchrun.main([str(tmp_path), str(tmp_path / "latent.safetensors"), *argv])
    assert sent[0].strategy.max_pinned_ram_gb == share


def test_a_failed_job_in_a_spawned_rank_frees_its_pipeline_before_the_group_goes(monkeypatch, collector_off,
                                                                                 group_checks):
    """The same in the pool's ranks (memory/parallel/rank.py), run here in this process: the error is
    reported, the frames holding the pipeline are cleared, and the rank ends."""
    import queue
    import threading

    from vidmem.memory.parallel import rank as rank_module

    class FailingJob:
        def run(self, context):
            loaded = mesh_in_a_cycle(group_checks)  # a local of the failed frame
            raise RuntimeError(f"the job failed with {len(loaded)} things loaded")

    def join_alone(rank, setup):
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
        return torch.device("cpu")

    monkeypatch.setattr(rank_module, "die_with_coordinator", lambda: None)  # never arm PDEATHSIG on pytest
    monkeypatch.setattr(rank_module, "join_group", join_alone)
    jobs, events = queue.Queue(), queue.Queue()
    jobs.put(FailingJob())
    with pytest.raises(SystemExit):
        rank_module.rank_main(0, rank_module.RankSetup(1, "gloo", "cpu", (), free_port()), jobs, events,
                              threading.Event())
    reported = [events.get_nowait() for _ in range(events.qsize())]
    assert reported[0] == ("ready", 0) and reported[1][:2] == ("error", 0) and "the job failed" in reported[1][2]
    assert group_checks["alive_at_destroy"] == [False]
    assert not dist.is_initialized()
