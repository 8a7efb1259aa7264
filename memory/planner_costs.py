"""Fixed costs the meta device cannot see, and the time model behind `est_slowdown`.

Every figure is a named constant with where it comes from. The time model is deliberately
simple: a stage's compute time is its matmul/convolution FLOPs (counted on the meta run) at a
sustained device throughput, and weights that stream in per step cost PCIe time, hidden behind
compute when the schedule prefetches (side stream) and added to it when it does not. Only the
ratio between strategies is reported, so the throughput constants cancel to first order.
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1 << 30
MiB = 1 << 20

# CUDA context of a PyTorch process, outside every torch.cuda statistic. NVIDIA's forum and
# PyTorch's (ptrblck, "High gpu memory overhead") report ~300-800 MB depending on GPU, driver and
# CUDA version; lazy module loading (default on Linux since CUDA 12.2) keeps it near the low end.
CUDA_CONTEXT_BYTES = 512 * MiB

# cuBLAS workspace PyTorch allocates per handle and stream through its caching allocator:
# aten/src/ATen/cuda/CublasHandlePool.cpp `parseChosenWorkspaceSize`: 4096 KiB * 8 = 32 MiB on
# sm90/sm100/sm120, 4096 KiB * 2 + 16 KiB * 8 = 8.125 MiB before. One compute stream: the larger.
CUBLAS_WORKSPACE_BYTES = 32 * MiB

# Host RSS of the process before any weight: 0.36 GiB measured here (torch 2.13 CPU build +
# diffusers 0.42.1 + transformers 5.23 imported, Linux); a CUDA build maps cuBLAS/cuDNN/CUDA
# runtime libraries and host-side context state, about 1 GiB more once the GPU is initialised.
HOST_RUNTIME_BYTES = 3 * GiB // 2


# Sustained dense bf16/fp16 throughput of a consumer GPU on these models (RTX 4090: 165 TFLOP/s
# tensor-core peak with fp32 accumulation at ~half that; ~60% sustained in practice).
DEVICE_FLOPS_PER_S = 80e12

# Sustained dense matmul throughput of a desktop CPU when the text encoder runs there
# (text_encoder="cpu"): AVX2/AVX-512 fp32 GEMM reaches ~0.3-1 TFLOP/s on 8-16 cores; bf16 without
# hardware support is several times slower (FACTS.md: 4-5x on this machine).
HOST_FLOPS_PER_S = 0.3e12

# Host-to-device copy bandwidth, PCIe 4.0 x16: ~25 GB/s peak from pinned memory (the engine pins
# streamed weights under max_pinned_ram_gb); past the pinned ceiling copies are pageable, ~half.
PCIE_BYTES_PER_S = 22e9

# Per streamed group and pass: one event record/wait and a few kernel launches (~10 us each).
STREAM_GROUP_OVERHEAD_S = 30e-6


@dataclass(frozen=True)
class Traffic:
    """Weights copied to the device during one stage: per step (streamed) and once (onloads)."""

    per_pass_bytes: int = 0  # streamed every forward pass of the denoiser
    per_pass_groups: int = 0  # streamed groups per pass (sequential: every module; block swap: N)
    once_bytes: int = 0  # onloaded once for the stage
    overlapped: bool = True  # a prefetch schedule copies on a side stream while compute runs


def stage_seconds(compute_flops: float, passes: int, traffic: Traffic) -> float:
    """Estimated wall time of `passes` forward passes totalling `compute_flops`."""
    compute = compute_flops / DEVICE_FLOPS_PER_S
    per_pass_compute = compute / max(passes, 1)
    per_pass_copy = traffic.per_pass_bytes / PCIE_BYTES_PER_S
    if traffic.overlapped:
        per_pass = max(per_pass_compute, per_pass_copy)
    else:
        per_pass = per_pass_compute + per_pass_copy
    per_pass += traffic.per_pass_groups * STREAM_GROUP_OVERHEAD_S
    return passes * per_pass + traffic.once_bytes / PCIE_BYTES_PER_S
