"""The planner on a CPU device, and the cost of upcasting stored weights.

On a CPU nothing is copied to a device: memory-mapped weights (the disk tier) are computed where
they lie, so they are page cache, not device bytes; what a stored layer's upcast allocates is.
Upcasting stored weights costs time every pass (named rates in memory/plan/costs.py).
Expected figures are counted here from the modules, not from the planner's functions.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vidmem.memory import MemoryStrategy
from vidmem.memory.plan.costs import DEVICE_DEQUANT_WEIGHTS_PER_S, HOST_DEQUANT_WEIGHTS_PER_S, PCIE_BYTES_PER_S
from vidmem.memory.plan.planner import PlanOptions, VideoShape, plan_run
from vidmem.memory.plan.types import Allocator
from vidmem.memory.storage import FORMATS, upcast_workspace_bytes
from vidmem.pipelines.configs import load_model

SHAPE = VideoShape(832, 480, 81)
MODEL_TIER = MemoryStrategy(offload="model")


@pytest.fixture(scope="module")
def wan():
    return load_model("wan2.1-t2v-1.3b")


def fp8(wan, **changes) -> PlanOptions:
    return PlanOptions(storage=wan.layout.stored_as("fp8_scaled"), steps=4, **changes)


def linear_weights(module: nn.Module) -> list[torch.Tensor]:
    return list({id(m.weight): m.weight for m in module.modules() if isinstance(m, nn.Linear)}.values())


def test_mapped_weights_on_a_cpu_are_not_device_bytes_but_the_upcast_is(wan):
    on_gpu = plan_run(wan, SHAPE, MODEL_TIER, fp8(wan, on_disk=True))
    on_cpu = plan_run(wan, SHAPE, MODEL_TIER, fp8(wan, on_disk=True, device="cpu"))
    workspace = max(upcast_workspace_bytes(FORMATS["fp8_scaled"], w.shape, w.dtype) for w in linear_weights(wan.module("transformer")))
    cpu_phase, gpu_phase = on_cpu.stage("denoise").phases[0], on_gpu.stage("denoise").phases[0]
    assert cpu_phase.weights_bytes == workspace  # only the layer being upcast
    assert gpu_phase.weights_bytes == wan.weights("transformer", "fp8_scaled").nbytes + workspace
    assert on_cpu.peak_vram_bytes < on_gpu.peak_vram_bytes
    assert cpu_phase.device_bytes == cpu_phase.peak.allocated  # no CUDA context, no cuBLAS workspace, no cache
    in_ram = plan_run(wan, SHAPE, MODEL_TIER, fp8(wan, device="cpu"))  # copied into RAM: the RAM it computes from
    assert in_ram.stage("denoise").phases[0].weights_bytes == gpu_phase.weights_bytes


def test_scaled_fp8_upcast_is_two_float32_temporaries_per_weight(wan):
    weights = wan.weights("transformer", "fp8_scaled")
    largest = max(linear_weights(wan.module("transformer")), key=lambda w: w.numel())
    assert largest.numel() <= 1 << 24  # 1.3B: one pass, no row chunks
    assert weights.transient_bytes == largest.numel() * 8


@pytest.mark.parametrize("device,rate", [("cuda", DEVICE_DEQUANT_WEIGHTS_PER_S), ("cpu", HOST_DEQUANT_WEIGHTS_PER_S)])
def test_the_time_estimate_counts_upcasting_every_pass(wan, device, rate):
    stored = plan_run(wan, SHAPE, MODEL_TIER, fp8(wan, device=device))
    plain = plan_run(wan, SHAPE, MODEL_TIER, PlanOptions(steps=4, device=device))
    transformer_linear = sum(w.numel() for w in linear_weights(wan.module("transformer")))
    passes = 4 * 2  # steps x (conditional + unconditional)
    extra = stored.stage("denoise").seconds() - plain.stage("denoise").seconds()
    # tier model onloads the transformer once per stage on a GPU, fewer bytes when stored narrow; a CPU copies nothing
    saved = wan.weights("transformer").nbytes - wan.weights("transformer", "fp8_scaled").nbytes
    copies_saved = 0.0 if device == "cpu" else saved / PCIE_BYTES_PER_S
    assert extra == pytest.approx(passes * transformer_linear / rate - copies_saved, rel=1e-6)
    assert stored.est_slowdown >= plain.est_slowdown  # on a CPU the compute itself dwarfs it at this size


def test_a_cpu_device_stages_nothing_and_copies_nothing(wan):
    swap = MemoryStrategy(offload="block_swap", blocks_to_swap=10, prefetch_blocks=1)
    on_cpu = plan_run(wan, SHAPE, swap, fp8(wan, on_disk=True, device="cpu"))
    on_gpu = plan_run(wan, SHAPE, swap, fp8(wan, on_disk=True))
    assert on_cpu.stage("denoise").host_bytes < on_gpu.stage("denoise").host_bytes  # no pinned staging slots
    plain_cpu = plan_run(wan, SHAPE, swap, PlanOptions(steps=4, device="cpu"))
    assert plain_cpu.est_slowdown == 1.0  # in RAM on a CPU: streaming moves nothing, costs nothing


def test_a_loaded_pipeline_is_planned_for_the_device_it_runs_on(monkeypatch):
    from vidmem.pipelines.loader import LoadedPipeline, family_for
    from vidmem.pipelines.planning import plan_options, plan_strategy

    loaded = LoadedPipeline(None, family_for("WanPipeline"), "WanPipeline", "files", "bf16", folder="wan2.1-t2v-1.3b",
                            storage={"transformer": "fp8_scaled"}, on_disk=True)
    assert plan_options(loaded, device="cpu").weights_in_place
    assert not plan_options(loaded, device=torch.device("cuda", 0)).weights_in_place
    shape, native = VideoShape(320, 192, 9), PlanOptions(allocator=Allocator.NATIVE)  # no allocator probe on a faked CUDA
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # no device given: resolved at run time
    assert plan_strategy(loaded, shape, MODEL_TIER, None, None, native).options.device == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert plan_strategy(loaded, shape, MODEL_TIER, None, None, native).options.device == "cuda"
