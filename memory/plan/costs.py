"""Fixed costs the meta device cannot see, and the time model behind `est_slowdown`.

Every figure is a named constant with where it comes from. The time model is deliberately
simple: a stage's compute time is its matmul/convolution FLOPs (counted on the meta run) at a
sustained device throughput, and weights that stream in per step cost PCIe time, hidden behind
compute on the side stream except for the share measured to stay exposed (more without a
prefetch, more for leaves than for blocks), plus a fixed cost per streamed group. Only the ratio
between strategies is reported, so the throughput constants cancel to first order.

Weights on disk (the disk tier: memory-mapped files) pass through the page cache. The page cache
is reclaimable, so it never decides whether a plan fits; it decides how fast it runs: what the
RAM budget leaves after the anonymous bytes caches the files, and streamed bytes beyond that are
read from the disk again every pass, at `NVME_BYTES_PER_S` unless told otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..units import GiB, MiB

# CUDA context of a PyTorch process, outside every torch.cuda statistic. NVIDIA's forum and
# PyTorch's (ptrblck, "High gpu memory overhead") report ~300-800 MB depending on GPU, driver and
# CUDA version; lazy module loading (default on Linux since CUDA 12.2) keeps it near the low end.
CUDA_CONTEXT_BYTES = 512 * MiB

# cuBLAS workspace PyTorch allocates per handle and stream through its caching allocator:
# aten/src/ATen/cuda/CublasHandlePool.cpp `parseChosenWorkspaceSize`: 4096 KiB * 8 = 32 MiB on
# sm90/sm100/sm120, 4096 KiB * 2 + 16 KiB * 8 = 8.125 MiB before. One compute stream: the larger.
CUBLAS_WORKSPACE_BYTES = 32 * MiB

# Host RSS of the process before any weight: 0.36 GiB measured here (torch 2.13 CPU build +
# diffusers 0.42.1 + transformers 5.23 imported, Linux; 0.41 GiB with the Wan and UMT5 model classes
# imported too). A CUDA build maps cuBLAS/cuDNN/CUDA runtime libraries even when it computes on the
# CPU: 0.82 GiB for the same imports with torch 2.9.1+cu128 (ComfyUI's, and pip's default wheel on
# Linux), GPU never initialised; host-side context state adds about 0.5 GiB once the GPU is.
HOST_RUNTIME_BYTES = 3 * GiB // 2
HOST_RUNTIME_BYTES_CPU = GiB // 2
HOST_RUNTIME_BYTES_CPU_CUDA_BUILD = GiB


def host_runtime_bytes(on_cpu: bool) -> int:
    """The process's RSS before any weight: without the GPU's context when it computes on the CPU, and without
    the CUDA libraries too where this torch is a CPU build."""
    if not on_cpu:
        return HOST_RUNTIME_BYTES
    return HOST_RUNTIME_BYTES_CPU_CUDA_BUILD if torch.backends.cuda.is_built() else HOST_RUNTIME_BYTES_CPU


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

# Sequential read rate of the disk that memory-mapped weights (the disk tier) come from: 3 GB/s is a
# mid-range NVMe SSD on PCIe 3.0 x4 (Samsung 970 EVO Plus data sheet: 3,500 MB/s sequential read;
# PCIe 4.0 drives are rated 5-7 GB/s, SATA SSDs ~0.55 GB/s, hard disks ~0.2 GB/s). Change it with
# `vidmem plan --disk-gbps` or `PlanOptions(disk_bytes_per_s=...)`.
NVME_BYTES_PER_S = 3e9

# Per streamed group and pass: one event record/wait and a few kernel launches (~10 us each).
# Measured on an H200 (docs/gpu.md): Wan 14B sequential, 1,056 leaf copies per step, +32 ms.
STREAM_GROUP_OVERHEAD_S = 30e-6

# Share of streamed copy time that stays exposed although the schedule copies on a side stream,
# measured with torch.profiler on an H200 (docs/gpu.md; 1 - "copies hidden"), rounded up:
# - blocks with a prefetch: 0.6-0.8% on Wan 14B, 3.8% on Wan 1.3B (short blocks) -> 4%;
# - blocks without one: the host still runs a block ahead of the GPU, so block i's copy queues
#   while block i-1 computes and mostly hides: 3.0% on Wan 14B, 7.1% on Wan 1.3B -> 8%;
# - leaves (sequential): 4.5% (Wan 14B bf16), 7.4% (fp8), 10.9% (Wan 1.3B) -> 11%.
EXPOSED_COPY_SHARE_BLOCKS = 0.04
EXPOSED_COPY_SHARE_NO_PREFETCH = 0.08
EXPOSED_COPY_SHARE_LEAVES = 0.11


# The smallest difference in estimated time that the plan reports between two rows. On an H200 the
# model landed within 0.9% of every measured ratio (docs/gpu.md); consumer cards, with 4-15 times less
# PCIe bandwidth, are modelled, not measured. Rows closer than this are "the same time": the plan
# shows no time column then, only that streaming costs next to nothing here.
TIME_RESOLUTION = 0.05


def exposed_copy_share(leaves: bool, prefetch: int) -> float:
    """The measured share of copy time a streamed tier leaves exposed (see the constants)."""
    if leaves:
        return EXPOSED_COPY_SHARE_LEAVES
    return EXPOSED_COPY_SHARE_BLOCKS if prefetch else EXPOSED_COPY_SHARE_NO_PREFETCH

# Time a denoiser block spends beyond its FLOPs when it runs in activation-chunk token slices, as a share of
# its compute: each slice runs the block's small kernels again (a Wan block's ~90 per slice, launched and
# drained as often as the whole block's) and writes its queries, keys, values and output into the
# whole-size tensors. Measured on an H200 (bench/results/activations-gpu-h200-2026-11-28.json; docs/gpu.md),
# one real-size Wan 14B block, eager bf16, at 480p (32,760 tokens), the costlier of the two sizes run (720p:
# +1.8% to +6.3%): +3.1%, +5.3%, +6.5%, +9.1% at 2, 4, 8 and 16 slices, to the nearest percent; 32 and 64
# slices (the most MemoryStrategy takes) extrapolated, +3 points a doubling. HunyuanVideo 1.5 slices its whole block
# as Wan does; CogVideoX slices its feed-forward only, fewer kernels a slice: for it these are an upper bound. A slower card spends longer in each kernel, so the fixed cost per slice
# is a smaller share there: for a consumer card these are an upper bound. On a CPU nothing is launched, and a
# chunked block measured no slower (docs/activation-chunks.md): no share.
CHUNK_COMPUTE_SHARE = {1: 0.0, 2: 0.03, 4: 0.05, 8: 0.07, 16: 0.09, 32: 0.12, 64: 0.15}


def chunk_compute_share(chunks: int) -> float:
    """CHUNK_COMPUTE_SHARE for `chunks` slices: the listed count's, or the next listed one above it."""
    listed = sorted(CHUNK_COMPUTE_SHARE)
    return CHUNK_COMPUTE_SHARE[next((count for count in listed if count >= chunks), listed[-1])]


# Upcasting stored weights (fp8, GGUF) to the compute dtype, once per layer call (every pass, under
# every tier). On a GPU these elementwise kernels are memory-bound: scaled fp8 reads 1 B, writes and
# reads two float32 temporaries and writes 2 B per weight (~23 B of traffic; the temporaries are
# memory.storage.stored.UPCAST_TEMPORARY_BYTES_PER_WEIGHT), at ~800 GB/s sustained (RTX 4090:
# 1008 GB/s peak): ~35e9 weights/s. GGUF's formulas move about as much.
DEVICE_DEQUANT_WEIGHTS_PER_S = 35e9
# A plain fp8 weight only widens to the compute dtype: 1 byte read and 2 written, not ~23. Measured on
# an H200 (docs/gpu.md): Wan 14B in plain fp8 ran 0.5% faster than bf16, where charging it like a
# scaled upcast predicted +12%.
WIDEN_TRAFFIC_SHARE = 3 / 23

# On a CPU, torch's fp8 and GGUF upcasts are not vectorised like its matmuls: measured here on one
# core (torch 2.13, a 4096x4096 weight to bf16, best of 3): fp8_e4m3fn 0.06, fp8_scaled 0.04,
# gguf_q8_0 0.07, gguf_q4_k 0.04 G weights/s; x8 for the 8 cores HOST_FLOPS_PER_S assumes. This is
# why fp8 ran slower than bf16 in bench/beyond_ram.py on this machine.
HOST_DEQUANT_WEIGHTS_PER_S = 0.4e9


@dataclass(frozen=True)
class MeasuredSpeed:
    """The denoiser's step time with the Speed node's choices against eager blocks, SDPA's own kernel and
    fp8 weights upcast, as bench/speed.py measured it on this device (pipelines/configs/speedups.json);
    1.0 where nothing was measured. The plan multiplies the denoiser's compute (its upcasts included: the
    ratios were measured with them) by the ratios that apply to the run, and moves its copies as before.

    Why compiled blocks have two ratios: under `sequential` each streamed leaf's hook breaks the compiled
    graph (21 breaks per Wan block; the H200 measured x1.10, slower than eager), so whole blocks compile
    only on the other tiers. Why fp8 matmul has its own: it multiplies only layers stored in float8_e4m3fn,
    and those layers then upcast nowhere (`fp8_matmul_on`), so a chunked block's slices add no upcasts to them.
    Why the two together have a third (`compiled_fp8_matmul`): inside a compiled graph fp8 matmul is faster
    than eager (the H200: x0.81 for the pair against x0.83 compiled alone and x1.25 fp8 eager), so the
    eager fp8 figure never multiplies compiled blocks; where the pair was not measured compiled blocks'
    own figure stands for it (`compiled_on`: compiled blocks were chosen)."""

    kernel: float = 1.0  # the chosen attention kernel's (every tier)
    compiled: float = 1.0  # compiled blocks' where whole blocks compile (every tier but sequential)
    compiled_sequential: float = 1.0  # compiled blocks' under sequential (a graph break per streamed leaf)
    fp8_matmul: float = 1.0  # fp8 matmul's with eager blocks (a denoiser stored in float8_e4m3fn)
    fp8_matmul_on: bool = False  # the run multiplies float8_e4m3fn layers in fp8 (measured here or not)
    compiled_fp8_matmul: float | None = None  # compiled blocks with fp8 matmul, measured as a pair (None: not)
    compiled_on: bool = False  # compiled blocks were chosen (and not refused)

    def __post_init__(self) -> None:
        for name in ("kernel", "compiled", "compiled_sequential", "fp8_matmul", "compiled_fp8_matmul"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"MeasuredSpeed.{name}={value} must be a positive time ratio.")

    def ratio(self, sequential: bool, fp8_weights: bool) -> float:
        """The step-time ratio for a denoiser on a tier (`sequential` or not) and storage (`fp8_weights`)."""
        if sequential:  # a graph break per streamed leaf: the layers multiply as they do eagerly
            return self.kernel * self.compiled_sequential * (self.fp8_matmul if fp8_weights else 1.0)
        if fp8_weights and self.compiled_on:
            pair = self.compiled_fp8_matmul if self.fp8_matmul_on and self.compiled_fp8_matmul else self.compiled
            return self.kernel * pair
        return self.kernel * self.compiled * (self.fp8_matmul if fp8_weights else 1.0)


@dataclass(frozen=True)
class DeviceRates:
    """How fast the compute device computes, receives weights and upcasts stored ones."""

    flops_per_s: float = DEVICE_FLOPS_PER_S
    copy_bytes_per_s: float | None = PCIE_BYTES_PER_S  # None: weights are used where they lie (a CPU device)
    dequant_weights_per_s: float = DEVICE_DEQUANT_WEIGHTS_PER_S
    widen_share: float = WIDEN_TRAFFIC_SHARE  # what a widening upcast costs against a full one (memory-bound: its traffic)


GPU_RATES = DeviceRates()
CPU_RATES = DeviceRates(HOST_FLOPS_PER_S, None, HOST_DEQUANT_WEIGHTS_PER_S, widen_share=1.0)  # measured alike here


@dataclass(frozen=True)
class Traffic:
    """Weights copied to the device during one stage: per step (streamed) and once (onloads)."""

    per_pass_bytes: int = 0  # streamed every forward pass of the denoiser
    per_pass_groups: int = 0  # streamed groups per pass (sequential: every module; block swap: N)
    once_bytes: int = 0  # onloaded once for the stage
    overlapped: bool = True  # copies on a side stream while compute runs (False: page faults, in line)
    exposed_share: float = 0.0  # of the copy time, what shows even when overlapped (exposed_copy_share)
    # Distinct bytes among `per_pass_bytes` (None: all of them). Sequential offload with activation chunks
    # copies a layer once per token slice, but the page cache keeps its pages after the first slice: the
    # disk reads each streamed byte at most once per pass, while PCIe carries every copy.
    distinct_per_pass_bytes: int | None = None

    @property
    def streamed_bytes(self) -> int:
        """The distinct weight bytes streamed per pass: what the disk tier may have to read."""
        return self.per_pass_bytes if self.distinct_per_pass_bytes is None else self.distinct_per_pass_bytes


@dataclass(frozen=True)
class DiskRead:
    """Weights memory-mapped from files: how fast the disk reads, how much the page cache keeps."""

    bytes_per_s: float = NVME_BYTES_PER_S
    cache_bytes: int | None = None  # page cache left for the files (RAM budget less anonymous bytes); None: all
    cold: bool = False  # the files a run reads exceed `cache_bytes`: each run reads its weights from the disk

    def reread_bytes(self, traffic: Traffic) -> tuple[int, int]:
        """(bytes read from the disk every pass, bytes read once per stage), run over run.

        Streamed bytes are read every pass, so they are the hottest pages and the cache keeps them
        first; what does not fit is read again each pass, once per distinct byte (Traffic.streamed_bytes).
        This is the bound for a cache that keeps a stable subset (Linux's active list / multi-gen LRU
        protect pages used twice); a strict LRU over a cyclic scan larger than itself would re-read all of it. When a run's files fit the
        cache (not `cold`), nothing is read from the disk after the first run, as with weights in RAM.
        """
        if self.cache_bytes is None:
            return 0, 0
        streamed = traffic.streamed_bytes
        per_pass = max(0, streamed - self.cache_bytes)
        if self.cold:  # other stages evicted this one's weights: the first pass reads them all
            return per_pass, traffic.once_bytes + streamed - per_pass
        left = max(0, self.cache_bytes - streamed)
        return per_pass, max(0, traffic.once_bytes - left)


@dataclass(frozen=True)
class Work:
    """One component's compute within a stage and the weights it moves."""

    flops: float
    passes: int = 1
    traffic: Traffic = Traffic()
    on_host: bool = False  # computed on the CPU (text_encoder=cpu): weights are used where they are
    host_weight_bytes: int = 0  # on the CPU: the weights one call reads (from the page cache on disk)
    dequant_weights: int = 0  # stored weights upcast per pass (storage below the compute dtype)
    dequant_widens: bool = False  # those upcasts only widen (plain fp8): a fraction of the traffic on a GPU
    rates: DeviceRates = GPU_RATES  # the compute device's (on_host work runs at CPU_RATES)
    compute_share: float = 0.0  # time beyond the FLOPs', as a share of their compute (chunk_compute_share)
    time_ratio: float = 1.0  # the measured step time of the run's Speed choices (MeasuredSpeed.ratio)

    def seconds(self, disk: DiskRead | None = None) -> float:
        if self.on_host:  # page faults on memory-mapped weights are synchronous: reads add to compute
            seconds = self.flops / HOST_FLOPS_PER_S + self.passes * self.dequant_weights / HOST_DEQUANT_WEIGHTS_PER_S
            if disk is not None:
                seconds += disk.reread_bytes(Traffic(once_bytes=self.host_weight_bytes))[1] / disk.bytes_per_s
            return seconds
        return stage_seconds(self.flops, self.passes, self.traffic, disk, self.rates, self.upcast_weights,
                             self.compute_share, self.time_ratio)

    @property
    def upcast_weights(self) -> float:
        """Stored weights upcast per pass, counted as full upcasts (a widening one costs less on a GPU)."""
        return self.dequant_weights * (self.rates.widen_share if self.dequant_widens else 1.0)


def stage_seconds(compute_flops: float, passes: int, traffic: Traffic, disk: DiskRead | None = None,
                  rates: DeviceRates = GPU_RATES, dequant_weights: int = 0, compute_share: float = 0.0,
                  time_ratio: float = 1.0) -> float:
    """Estimated wall time of `passes` forward passes totalling `compute_flops`.

    With `disk`, streamed weights the page cache cannot keep are read from the disk every pass;
    reading, copying and computing overlap when the schedule prefetches (staging buffers). Stored
    weights are upcast on the compute stream each pass: added to compute, never hidden. `compute_share`:
    time beyond the FLOPs' (activation chunks' slices), as a share of their compute. `time_ratio`: the
    measured step time of faster kernels or compiled blocks, on the compute and its upcasts (MeasuredSpeed).
    """
    compute = compute_flops / rates.flops_per_s * (1 + compute_share)
    per_pass_compute = (compute / max(passes, 1) + dequant_weights / rates.dequant_weights_per_s) * time_ratio
    copy_rate = rates.copy_bytes_per_s
    per_pass_copy = traffic.per_pass_bytes / copy_rate if copy_rate else 0.0
    reread_pass, reread_once = disk.reread_bytes(traffic) if disk is not None else (0, 0)
    per_pass_read = reread_pass / disk.bytes_per_s if disk is not None else 0.0
    if traffic.overlapped:
        per_pass = max(per_pass_compute, per_pass_copy, per_pass_read) + traffic.exposed_share * per_pass_copy
    else:
        per_pass = per_pass_compute + per_pass_copy + per_pass_read
    per_pass += traffic.per_pass_groups * STREAM_GROUP_OVERHEAD_S
    once = traffic.once_bytes / copy_rate if copy_rate else 0.0
    if reread_once:
        once = max(once, reread_once / disk.bytes_per_s)  # staged: the disk and the copy overlap
    return passes * per_pass + once
