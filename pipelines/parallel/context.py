"""Wan context parallelism through diffusers' own API (`ContextParallelConfig`, `enable_parallelism`).

diffusers holds the whole method: Wan's `_cp_plan` says where the token sequence is split and
gathered, and its attention dispatcher runs Ulysses' all-to-all (or ring's passes). vidmem only
builds the device mesh for this rank's device and calls `enable_parallelism` on each expert.
"""

from __future__ import annotations

from contextlib import contextmanager
from unittest import mock

import torch
from torch.distributed.device_mesh import init_device_mesh

from ...memory.strategy import ContextParallel

# Ring passes partial attention results round the ring and merges them by their log-sum-exp;
# the native backend does not return it, cuDNN attention does (CUDA only).
RING_BACKEND = "_native_cudnn"


def enable_context_parallel(pipe, denoisers: tuple[str, ...], mode: ContextParallel, degree: int,
                            device: torch.device) -> None:
    """Split every denoiser of `pipe` (Wan 2.2 A14B has two) `degree` ways; call once per loaded pipeline."""
    from diffusers import ContextParallelConfig

    ulysses, ring = (degree, 1) if mode is ContextParallel.ULYSSES else (1, degree)
    mesh = init_device_mesh(device.type, (ring, ulysses), mesh_dim_names=("ring", "ulysses"))
    for name in denoisers:
        model = getattr(pipe, name, None)
        if model is None:
            continue
        if mode is ContextParallel.RING:
            model.set_attention_backend(RING_BACKEND)
        config = ContextParallelConfig(ulysses_degree=ulysses, ring_degree=ring, mesh=mesh)
        with _one_device_per_rank(device):
            model.enable_parallelism(config=config)


@contextmanager
def _one_device_per_rank(device: torch.device):
    """diffusers computes this rank's device as `rank % torch.accelerator.device_count()`.

    On CUDA each rank sees only its own GPU (CUDA_VISIBLE_DEVICES, memory/parallel/rank.py), so
    that gives cuda:0, the right one. A CPU build has no accelerator: the count is 0 and the
    modulo divides by zero, so on the CPU only, the count is reported as 1 for this call.
    """
    if device.type != "cpu":
        yield
        return
    with mock.patch.object(torch.accelerator, "device_count", return_value=1):
        yield
