"""Ulysses degree 2 on two CPU processes (gloo, loopback) against one process: the parity figures.

Used by bench/parallel.py and by the tests' figures. Each variant is a tiny random Wan pipeline
saved as a real diffusers folder; the ranks open it from disk like any other model, run the
ordinary sampler under each tier and return rank 0's latent, compared with the same run in
this process. Both sides load the folder the same way (loaded weights round differently from
freshly built ones), with one thread per process.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VARIANTS = {"wan_t2v": "wan2.1-t2v", "wan_i2v": "wan2.1-i2v", "wan_a14b": "wan2.2-a14b"}
TIERS = {"none": dict(offload="none"), "block_swap": dict(offload="block_swap", blocks_to_swap=1),
         "model": dict(offload="model"), "sequential": dict(offload="sequential")}


def ulysses2_parity(variants=("wan_t2v",), tiers=("none", "block_swap")) -> dict:
    """{"max_abs_diff": max over the runs, "seconds": wall time of the first degree-2 run (starting
    the ranks and loading the pipeline in them included), "runs": {"<variant>/<tier>": {...}}}."""
    from vidmem.memory.strategy import MemoryStrategy, Parallelism
    from vidmem.pipelines.loader import load_pipeline
    from vidmem.pipelines.parallel import Ranks, close_pool, sample_parallel
    from vidmem.pipelines.sample import sample
    from vidmem.pipelines.tiny import save_tiny_pipeline

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks get one thread each too (Ranks.pool_config shares this count)
    runs, first = {}, None
    try:
        with tempfile.TemporaryDirectory(prefix="vidmem-parallel-") as root:
            for variant in variants:
                tiny = VARIANTS.get(variant, variant)
                loaded = load_pipeline(save_tiny_pipeline(tiny, Path(root) / tiny), "fp32")
                try:
                    for tier in tiers:
                        runs[f"{variant}/{tier}"] = _compare(loaded, tiny, TIERS[tier], sample, sample_parallel,
                                                             MemoryStrategy, Parallelism, Ranks)
                        first = first if first is not None else runs[f"{variant}/{tier}"]["seconds"]
                finally:
                    close_pool(loaded)
    finally:
        torch.set_num_threads(threads)
    return {"max_abs_diff": max(r["max_abs_diff"] for r in runs.values()), "seconds": first, "runs": runs}


def _compare(loaded, tiny, tier, sample, sample_parallel, MemoryStrategy, Parallelism, Ranks) -> dict:
    from vidmem.pipelines.sample import SampleRequest
    from vidmem.pipelines.tiny import tiny_spec

    spec = tiny_spec(tiny)
    image = torch.full((1, spec.height, spec.width, 3), 0.5) if spec.needs_image else None
    request = SampleRequest("a cat", "", spec.width, spec.height, spec.frames, steps=2, cfg=5.0, seed=0, image=image)
    start = time.perf_counter()
    single = sample(loaded, MemoryStrategy(**tier), request, device=torch.device("cpu")).latent["samples"]
    single_s = time.perf_counter() - start
    strategy = MemoryStrategy(**tier, parallel=Parallelism(context_parallel="ulysses", degree=2))
    start = time.perf_counter()
    result = sample_parallel(loaded, strategy, request, Ranks(cpu_processes=2))
    seconds = time.perf_counter() - start
    split = result.latent["samples"]
    return {"max_abs_diff": (split - single).abs().max().item(), "seconds": seconds, "single_process_seconds": single_s,
            "shape": list(split.shape), "per_rank_peak_bytes": result.receipt["parallel"]["per_rank_peak_bytes"]}


if __name__ == "__main__":
    import json

    print(json.dumps(ulysses2_parity(tuple(VARIANTS), ("none", "block_swap")), indent=1))
