"""The torchrun entry: two gloo processes launched by PyTorch's own launcher give the latent of one
process, and the output file is written whole or not at all."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from vidmem.memory import MemoryStrategy
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


def test_leaving_the_group_frees_what_holds_its_groups_first(monkeypatch):
    """A pipeline's reference cycles hold its device mesh (and the mesh its process groups): they are
    collected before the group is destroyed, never left to die as the interpreter exits (where gloo
    aborted a rank that had finished its run)."""
    import gc
    import weakref

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from vidmem.memory.parallel import leave_group

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    collecting = gc.isenabled()
    gc.disable()  # only leave_group may collect the cycle
    try:
        loaded = {"mesh": init_device_mesh("cpu", (1,), mesh_dim_names=("ulysses",))}
        loaded["self"] = loaded  # the cycle a pipeline's modules and hooks make
        mesh = weakref.ref(loaded["mesh"])
        state = {"loaded": loaded}
        del loaded
        mesh_alive_at_destroy = []
        destroy = dist.destroy_process_group
        monkeypatch.setattr(dist, "destroy_process_group",
                            lambda *a, **k: (mesh_alive_at_destroy.append(mesh() is not None), destroy(*a, **k)))
        leave_group(state)
    finally:
        if collecting:
            gc.enable()
        if dist.is_initialized():
            destroy()
    assert mesh_alive_at_destroy == [False]
    assert state == {} and not dist.is_initialized()
