"""Several GPUs for one pipeline: Wan context parallelism (diffusers' own) over a pool of ranks."""

from .checks import TokenGrid, check_context_parallel, sequence_problem
from .job import ParallelSampleJob
from .run import Ranks, close_pool, resolve_ranks, sample_parallel
from .source import PipelineSource

__all__ = ["ParallelSampleJob", "PipelineSource", "Ranks", "TokenGrid", "check_context_parallel", "close_pool",
           "resolve_ranks", "sample_parallel", "sequence_problem"]
