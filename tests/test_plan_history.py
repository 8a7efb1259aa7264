"""A plan does not depend on what the same process planned before it.

The planner memoises traces per model; the module order a call ran in (what the sequential tier's
residency reads) was once recorded per kind of call, from the first call of that kind: a causal VAE
decodes one latent frame in another order than 21, so a one-frame plan changed a later 81-frame
plan's decode peak. Each model here is fresh and keeps no disk cache, so only the history differs.
"""

from __future__ import annotations

import pytest

from vidmem.memory import MemoryStrategy
from vidmem.memory.plan.planner import GiB, PlanOptions, VideoShape, plan_run
from vidmem.pipelines.configs import MODELS_DIR, _from_json
from vidmem.pipelines.json_files import read_json_object

SEQUENTIAL = MemoryStrategy(offload="sequential")


def fresh(name: str):
    return _from_json(read_json_object(MODELS_DIR / f"{name}.json", name), None, disk_cache=False)


def stage_peaks(model, shape: VideoShape, strategy: MemoryStrategy) -> dict[str, tuple[int, int, int]]:
    plan = plan_run(model, shape, strategy, PlanOptions(), 6 * GiB, 12 * GiB)
    return {stage.name: (stage.device_bytes, stage.allocated_bytes, stage.host_bytes) for stage in plan.stages}


@pytest.mark.parametrize("before", [VideoShape(832, 480, 1), VideoShape(320, 192, 9)])
def test_a_plan_is_the_same_after_another_shape_was_planned(before):
    shape = VideoShape(832, 480, 81)
    alone = stage_peaks(fresh("wan2.1-t2v-1.3b"), shape, SEQUENTIAL)
    model = fresh("wan2.1-t2v-1.3b")
    stage_peaks(model, before, SEQUENTIAL)
    assert stage_peaks(model, shape, SEQUENTIAL) == alone


def test_a_plan_is_the_same_after_a_chunked_plan():
    """Activation chunks call some layers once per token slice: another module order for the denoise."""
    shape = VideoShape(832, 480, 81)
    alone = stage_peaks(fresh("wan2.1-t2v-1.3b"), shape, SEQUENTIAL)
    model = fresh("wan2.1-t2v-1.3b")
    stage_peaks(model, shape, MemoryStrategy(offload="sequential", activation_chunks=4))
    assert stage_peaks(model, shape, SEQUENTIAL) == alone
