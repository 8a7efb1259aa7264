"""Ranks left from a context-parallel run stop when the pipeline next runs without it: each holds a
whole copy of the pipeline that the one-process plan does not count."""

from __future__ import annotations

from fuzz_support import strategy_widgets
from vidmem.nodes import NODE_CLASS_MAPPINGS as N
from vidmem.pipelines.parallel import Ranks
from vidmem.pipelines.parallel.run import POOL_ATTRIBUTE


class StandInPool:
    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


def test_a_one_process_run_stops_the_pipeline_s_idle_ranks(tiny_loaded):
    loaded = tiny_loaded("wan2.1-t2v")
    pool = StandInPool()
    setattr(loaded.pipe, POOL_ATTRIBUTE, (Ranks(cpu_processes=2), pool))
    try:
        (choice,) = N["VidMemMemoryStrategy"]().build(**strategy_widgets(offload="none"))["result"]
        N["VidMemVideoSampler"]().sample(loaded, choice, "a cat", "", 32, 32, 9, 2, 1.0, 0)
        assert pool.closed and getattr(loaded.pipe, POOL_ATTRIBUTE) is None
    finally:
        setattr(loaded.pipe, POOL_ATTRIBUTE, None)
