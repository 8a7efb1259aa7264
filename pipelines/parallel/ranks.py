"""Where a context-parallel run's ranks run: CUDA GPUs, or CPU processes on a machine without GPUs."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...memory.parallel import PoolConfig
from ...memory.strategy import Parallelism
from ..family import ModelError


@dataclass(frozen=True)
class Ranks:
    """Where the ranks run: CUDA GPU indices, or `cpu_processes` gloo processes on a machine without GPUs."""

    gpus: tuple[int, ...] = ()
    cpu_processes: int = 0

    @property
    def degree(self) -> int:
        return len(self.gpus) or self.cpu_processes

    def pool_config(self) -> PoolConfig:
        if self.gpus:
            return PoolConfig.for_gpus(self.gpus)
        # The machine's threads shared between the ranks, so N ranks do not oversubscribe the cores.
        return PoolConfig.for_cpu(self.cpu_processes, threads=max(1, torch.get_num_threads() // self.cpu_processes))


def resolve_ranks(parallel: Parallelism, visible_gpus: int) -> Ranks:
    """The ranks `parallel` asks for on a machine with `visible_gpus` CUDA GPUs; ModelError when impossible.

    CPU processes when `parallel.cpu` asks for them (gpus=cpu:N), whatever GPUs are visible; a bare
    degree runs CPU processes only on a machine without GPUs."""
    if parallel.cpu:
        return Ranks(cpu_processes=parallel.degree)
    if visible_gpus == 0:
        if parallel.gpus is not None:
            raise ModelError(f"gpus={','.join(map(str, parallel.gpus))} but no CUDA GPU is visible; set gpus to auto.")
        if parallel.degree < 2:
            raise ModelError(f"context_parallel={parallel.context_parallel.value} needs two or more GPUs and this machine "
                             "has none; set context_parallel to off (or, to test on the CPU, gpus to cpu:2 for two CPU "
                             "processes, which is slow).")
        return Ranks(cpu_processes=parallel.degree)
    gpus = parallel.gpus if parallel.gpus is not None else tuple(range(visible_gpus))
    missing = [g for g in gpus if g >= visible_gpus]
    if missing:
        raise ModelError(f"gpus lists {','.join(map(str, missing))} but only GPUs 0..{visible_gpus - 1} are visible.")
    if parallel.degree and parallel.degree != len(gpus):
        raise ModelError(f"degree={parallel.degree} but {len(gpus)} GPUs are used; context parallelism runs one rank "
                         f"per GPU: list {parallel.degree} GPUs in gpus (e.g. "
                         f"{','.join(map(str, range(parallel.degree)))}), or for CPU processes gpus=cpu:{parallel.degree} "
                         "(Parallelism(cpu=True)).")
    if len(gpus) < 2:
        raise ModelError(f"context_parallel={parallel.context_parallel.value} needs two or more GPUs; only GPU "
                         f"{gpus[0]} is used. List more in gpus, or set context_parallel to off.")
    if not (dist.is_available() and dist.is_nccl_available()):
        # Checked before any rank starts: otherwise each rank fails in init_process_group.
        raise ModelError("context parallelism on GPUs needs NCCL, which this PyTorch build does not have (PyTorch's "
                         "Windows builds ship without it); run on Linux (or WSL2), or set context_parallel to off.")
    return Ranks(gpus=tuple(gpus))
