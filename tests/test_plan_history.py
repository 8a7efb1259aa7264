"""A plan does not depend on what the same process planned before it.

The planner memoises traces per model; the module order a call ran in (what the sequential tier's
residency reads) was once recorded per kind of call, from the first call of that kind: a causal VAE
decodes one latent frame in another order than 21, so a one-frame plan changed a later 81-frame
plan's decode peak. Each model here is fresh and keeps no disk cache, so only the history differs.
"""

from __future__ import annotations

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


def test_a_plan_is_the_same_after_a_one_frame_plan():
    shape = VideoShape(832, 480, 81)
    alone = stage_peaks(fresh("wan2.1-t2v-1.3b"), shape, SEQUENTIAL)
    model = fresh("wan2.1-t2v-1.3b")
    stage_peaks(model, VideoShape(832, 480, 1), SEQUENTIAL)
    assert stage_peaks(model, shape, SEQUENTIAL) == alone


def test_a_plan_is_the_same_after_a_chunked_plan():
    """A chunked trace runs the unchunked one's batched matmuls first: the ledger once counted their
    aten._unsafe_view as an allocation on a first trace and not on a cached one."""
    shape = VideoShape(832, 480, 81)
    alone = stage_peaks(fresh("wan2.1-t2v-1.3b"), shape, SEQUENTIAL)
    model = fresh("wan2.1-t2v-1.3b")
    stage_peaks(model, shape, MemoryStrategy(offload="sequential", activation_chunks=4))
    assert stage_peaks(model, shape, SEQUENTIAL) == alone


def test_each_decode_piece_is_planned_with_its_own_module_order():
    """Temporal tiles give Wan's causal VAE a one-latent-frame first piece (decoded without its temporal
    convolutions) and four-frame pieces after it: each piece's phase holds the weights its own order streams."""
    from vidmem.memory.plan.stages import _numel, decode_calls, decode_stage, phase, tier_residency
    from vidmem.memory.strategy import VaeTiling

    model, shape = fresh("wan2.1-t2v-1.3b"), VideoShape(832, 480, 81)
    strategy, options = MemoryStrategy(offload="sequential", vae_tiling=VaeTiling(512, 32, 16, 4)), PlanOptions()
    calls = [call for call, _ in decode_calls(model, shape, strategy)]
    assert [call.kind for call in calls] == ["decode_context"] + ["decode_stream"] * (len(calls) - 1)
    assert {call.piece[2] for call in calls[1:]} == {1, 4}
    latent = _numel(model.latent_shape(shape)) * model.dtype_bytes("vae")
    phases = decode_stage(model, shape, strategy, options).phases
    assert len(phases) == len(calls)
    for planned, call in zip(phases, calls):
        own = phase(model, call, [*tier_residency(model, "vae", strategy, ["vae"], options, call), latent], options, "")
        assert (planned.resident, planned.peak) == (own.resident, own.peak), call.piece
