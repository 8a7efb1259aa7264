"""Spawned ranks running one job in lockstep (pure torch; no diffusers, no ComfyUI)."""

from .kept import RankStore, RankStores, ReleaseJob
from .pool import PoolConfig, RankError, WorkerPool, free_port
from .rank import RankContext, RankSetup, RunCancelled, leave_group, run_in_process_group

__all__ = ["PoolConfig", "RankContext", "RankError", "RankSetup", "RankStore", "RankStores", "ReleaseJob",
           "RunCancelled", "WorkerPool", "free_port", "leave_group", "run_in_process_group"]
