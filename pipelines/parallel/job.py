"""ParallelSampleJob: one Sampler run as every rank executes it.

Each rank holds its own copy of the pipeline (opened from the files by `PipelineSource`, kept
in the rank's state from run to run), with diffusers' context parallelism enabled on its
denoisers, and runs vidmem's ordinary `sample()`: the same strategy tiers, the same loop, the
same noise (made on the CPU from the seed, so every rank starts from identical latents). The
CP hooks split the tokens after patch embedding and gather them before the output projection,
so every rank ends with the whole latent; rank 0's is returned, with what every rank's warm store
keeps on its GPU until the next run (`per_rank_kept_bytes`, for the coordinator's stand-ins).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch.distributed as dist

from ...memory.cleanup import free_memory
from ...memory.parallel import RankContext
from ...memory.strategy import MemoryStrategy, Parallelism
from ...memory.warm import kept_everywhere
from ..hooks import RunHooks
from ..sample import SampleRequest, SampleResult, sample
from .checks import check_context_parallel
from .context import enable_context_parallel
from .source import PipelineSource


@dataclass(frozen=True)
class ParallelSampleJob:
    source: PipelineSource
    strategy: MemoryStrategy  # with its `parallel` field: the ranks apply the rest to their own copy
    request: SampleRequest

    def run(self, context: RankContext) -> SampleResult | None:
        loaded = self._pipeline(context)
        self._check(loaded, context)  # this request on a reused copy
        per_rank = replace(self.strategy, parallel=Parallelism())  # within a rank, an ordinary one-device run
        # No prompt cache in ranks: a hit on one rank and a miss on another would run different
        # modules, and every rank must run the same ones in the same order.
        hooks = RunHooks(on_step=context.progress, check_interrupt=context.check_stop, climb_on_oom=False)
        try:
            result = sample(loaded, per_rank, self.request, hooks, device=context.device)
        finally:
            # An idle rank holds no allocator cache: rank 0 shares its GPU with the coordinator's
            # decode, which the per-GPU plan gives everything but the rank's context and NCCL buffers.
            free_memory(context.device)
        peaks, kept = [None] * context.world_size, [0] * context.world_size
        dist.all_gather_object(peaks, rank_peak(result.receipt))
        # what each rank's warm store keeps on its GPU until the next run: the coordinator's
        # stand-ins report it to the host (memory/parallel/kept.py). 0 while free_memory above
        # drops the rank's stores (it releases every live store since warm runs).
        dist.all_gather_object(kept, kept_everywhere())
        if context.rank != 0:
            return None
        parallel = self.strategy.parallel
        result.receipt.update(strategy=self.strategy.describe(), parallel={
            "ranks": context.world_size, "mode": parallel.context_parallel.value, "degree": context.world_size,
            "backend": dist.get_backend(), "per_rank_peak_bytes": peaks,
            "per_rank_kept_bytes": kept})
        return result

    def _pipeline(self, context: RankContext):
        """The rank's pipeline for this source and mode, opened and split on the first run, then reused.

        Keyed on the context-parallel mode too: diffusers' parallelism (and its attention backend)
        is set once per copy, so a switch from ulysses to ring needs a fresh copy.
        """
        key = (self.source, self.strategy.parallel.context_parallel)
        if context.state.get("pipeline_key") != key:
            context.state.clear()  # a different pipeline or mode: let the old copy go first
            loaded = self.source.load()
            self._check(loaded, context)  # before diffusers splits it: its own errors name no input (CogVideoX's cp_plan)
            enable_context_parallel(loaded.pipe, loaded.spec.denoisers, self.strategy.parallel.context_parallel,
                                    context.world_size, context.device)
            context.state.update(pipeline_key=key, loaded=loaded)
        return context.state["loaded"]


    def _check(self, loaded, context: RankContext) -> None:
        """Checked by the coordinator already; again here for torchrun, which has none."""
        request = self.request
        run_loaded = loaded.image_mode() if request.image is not None else loaded
        check_context_parallel(run_loaded, request.width, request.height, request.frames, self.strategy.parallel,
                               context.world_size, context.device.type)


def rank_peak(receipt: dict) -> dict:
    """This rank's peak over the run's stages: device bytes on CUDA, resident set on the CPU."""
    stages = receipt.get("stages", [])
    peak = {"peak_rss_bytes": max((s.get("peak_rss_bytes", 0) for s in stages), default=0)}
    device = [s["peak_allocated_bytes"] for s in stages if "peak_allocated_bytes" in s]
    if device:
        peak["peak_allocated_bytes"] = max(device)
    return peak
