"""The planner's predicted peaks against torch's own counters, on the very call it traces.

Each case runs `workloads.denoise_step` (the step the planner traces on meta, as the pipeline runs
it: Wan's two guidance passes, CogVideoX's batch of two) for real on random-weight transformers
at their published sizes, and compares the transformer phase's predicted peak allocated and
reserved bytes (the caching allocator modelled as `Allocator.NATIVE`, no CUDA context, which
torch's counters do not see) with `max_memory_allocated` / `max_memory_reserved`. Goal: within 10%.
"""

from __future__ import annotations

import pytest
import torch

from vidmem.memory import MemoryStrategy
from vidmem.memory.device import backend_for
from vidmem.memory.offload import StageComponents, apply_strategy
from vidmem.memory.plan.planner import Allocator, PlanOptions, VideoShape, plan_run

TOLERANCE = 0.10
# Under a streamed tier the reserved peak depends on when the copy stream's frees land (record_stream):
# on one H200 the same case (Wan 1.3B, sequential) reserved 2.29 GiB inside the suite and 2.54 GiB run
# alone, against 2.57 planned. The plan must cover the worse of the two: it may fall short of the
# measured reserved by TOLERANCE at most, and exceed it by STREAMED_RESERVED_SLACK.
STREAMED_RESERVED_SLACK = 0.15
CASES = {
    "wan2.1-t2v-1.3b": VideoShape(832, 480, 81),
    "cogvideox-2b": VideoShape(720, 480, 49),
}
TIERS = {
    "none": MemoryStrategy(offload="none"),
    "block_swap_half": None,  # half the model's blocks, filled in per model
    "sequential": MemoryStrategy(offload="sequential"),
}


@pytest.fixture(scope="module")
def built(cuda):
    from gpu import build_transformer, meta_model

    cache = {}

    def get(name):
        if name not in cache:
            model = meta_model(name, {})
            cache[name] = (model, build_transformer(model, cuda, seed=0).to("cpu"))
            torch.cuda.empty_cache()
        return cache[name]

    return get


def measured_peaks(model, module, shape, strategy, device, pool) -> tuple[int, int]:
    from vidmem.pipelines.configs.workloads import denoise_step

    stage = StageComponents({"transformer": module}, {"transformer": getattr(module, model.spec.blocks_attr)})
    step = denoise_step(model, "transformer", shape, module, device)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    with torch.no_grad(), apply_strategy(stage, strategy, backend_for(device), host_pool=pool):
        step()
        step()  # the second pass: prefetch running, the learned order known
        torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)


@pytest.mark.parametrize("tier", list(TIERS))
@pytest.mark.parametrize("name", list(CASES))
def test_predicted_peak_within_ten_percent(name, tier, built, cuda, pool):
    model, module = built(name)
    shape = CASES[name]
    blocks = model.components["transformer"].config["num_layers"]
    strategy = TIERS[tier] or MemoryStrategy(offload="block_swap", blocks_to_swap=blocks // 2)
    phase = plan_run(model, shape, strategy, PlanOptions(allocator=Allocator.NATIVE, steps=1)).stage("denoise").peak_phase
    allocated, reserved = measured_peaks(model, module, shape, strategy, cuda, pool)
    report = (f"{name} {tier}: allocated planned {phase.peak.allocated / 2**30:.2f} measured {allocated / 2**30:.2f} GiB; "
              f"reserved planned {phase.peak.reserved / 2**30:.2f} measured {reserved / 2**30:.2f} GiB")
    print(report)
    assert abs(phase.peak.allocated - allocated) <= TOLERANCE * allocated, report
    over = STREAMED_RESERVED_SLACK if strategy.streams_blocks else TOLERANCE
    assert -TOLERANCE * reserved <= phase.peak.reserved - reserved <= over * reserved, report
