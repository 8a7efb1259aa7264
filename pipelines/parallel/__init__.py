"""Several GPUs for one pipeline: Wan context parallelism (diffusers' own) over a pool of ranks."""

from .balanced import DeviceRoom, Placement, balanced_placement, component_bytes, sample_balanced
from .checks import TokenGrid, check_context_parallel, check_parallel_attention, rank_strategy, sequence_problem
from .job import ParallelSampleJob
from .ranks import Ranks, resolve_ranks
from .run import close_pool, sample_parallel
from .source import PipelineSource

__all__ = ["DeviceRoom", "ParallelSampleJob", "Placement", "balanced_placement", "component_bytes", "sample_balanced",
            "PipelineSource", "Ranks", "TokenGrid", "check_context_parallel", "check_parallel_attention", "close_pool",
           "rank_strategy", "resolve_ranks", "sample_parallel", "sequence_problem"]
