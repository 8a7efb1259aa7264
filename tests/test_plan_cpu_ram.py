"""A run on a CPU device computes in the RAM its process lives in: one budget for both.

The phases' "device" bytes of a CPU plan are RAM, so a stage needs its anonymous bytes plus what its
compute holds beyond the weights those already count (CpuBackend hands the compute the host tensors
themselves). The VRAM budget does not apply. Figures are compared across plans of the same run, not
against stored numbers.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from vidmem.memory import MemoryStrategy
from vidmem.memory.plan import candidates
from vidmem.memory.plan.candidates import candidate_plans, fewest_chunks, plan_run
from vidmem.memory.plan.costs import (HOST_RUNTIME_BYTES, HOST_RUNTIME_BYTES_CPU, HOST_RUNTIME_BYTES_CPU_CUDA_BUILD,
                                      host_runtime_bytes)
from vidmem.memory.plan.planner import PlanOptions, VideoShape, choose_strategy
from vidmem.memory.plan.stages import host_base
from vidmem.memory.units import GiB
from vidmem.pipelines.configs import load_model

SHAPE = VideoShape(832, 480, 81)
CPU_DISK = PlanOptions(steps=4, device="cpu", on_disk=True)


@pytest.fixture(scope="module")
def wan():
    return load_model("wan2.1-t2v-1.3b")


def sum_of_parts(stage) -> int:
    """Anonymous RAM plus the compute's worst phase: what a CPU stage holds when its weights are page cache."""
    return stage.host_bytes + max((p.device_bytes for p in stage.phases), default=0)


@pytest.mark.parametrize("vram_gib,ram_gib", [(4.5, 4.5), (64, 4.0)])
def test_a_cpu_plan_that_fits_holds_its_compute_and_its_process_in_the_ram(wan, vram_gib, ram_gib):
    # the review's case: `none +disk` said "yes" needing 4.0 GiB of compute and 2.8 GiB of process RAM in 4.5
    ram = int(ram_gib * GiB)
    plans = candidate_plans(wan, SHAPE, int(vram_gib * GiB), ram, options=CPU_DISK)
    assert any(p.fits for p in plans)
    for plan in plans:
        assert plan.fits == all(sum_of_parts(s) <= ram for s in plan.stages)
        for stage in plan.stages:  # memory-mapped weights are page cache: none is in host_bytes twice
            assert stage.ram_bytes == sum_of_parts(stage)


def test_a_cpu_plan_over_its_ram_says_so_whatever_the_vram_budget(wan):
    untiled = plan_run(wan, SHAPE, MemoryStrategy(), CPU_DISK, 64 * GiB, 5 * GiB)
    decode = untiled.stage("decode")
    assert decode.host_bytes <= 5 * GiB and decode.peak_phase.device_bytes <= 5 * GiB < sum_of_parts(decode)
    assert untiled.fits is False
    assert [line for line in untiled.over_budget() if line.startswith("decode: RAM ")]
    assert not [line for line in untiled.over_budget() if "VRAM" in line]  # a CPU has no VRAM to be over


def test_weights_in_ram_are_counted_once_on_a_cpu(wan):
    # The same weights in anonymous RAM or memory-mapped: the compute reads them where they are, so what it
    # holds beyond them is the same either way (activations), and the RAM needed differs by host_bytes only.
    strategy = MemoryStrategy(offload="model")
    in_ram = plan_run(wan, SHAPE, strategy, PlanOptions(steps=4, device="cpu")).stage("denoise")
    mapped = plan_run(wan, SHAPE, strategy, CPU_DISK).stage("denoise")
    assert in_ram.peak_phase.in_host_bytes == wan.weights("transformer").nbytes
    # the allocator model rounds each resident tensor up (by at most a few hundred bytes: 0.1% of the weights)
    extra, activations = in_ram.ram_bytes - in_ram.host_bytes, mapped.ram_bytes - mapped.host_bytes
    assert activations > 0 and 0 <= extra - activations <= wan.weights("transformer").nbytes // 1000
    assert in_ram.ram_bytes < sum_of_parts(in_ram)  # adding the two columns would count the weights twice


def test_a_gpu_stage_keeps_its_ram_and_vram_apart(wan):
    stage = plan_run(wan, SHAPE, MemoryStrategy(offload="model"), PlanOptions(steps=4)).stage("denoise")
    assert stage.ram_bytes == stage.host_bytes and not stage.on_cpu


def test_the_sampler_choice_on_a_cpu_fits_the_machine(wan):
    # what pipelines/planning.choose_for asks (telemetry.default_budgets gives a CPU its RAM as both budgets)
    ram = int(3.5 * GiB)
    plan = choose_strategy(wan, SHAPE, ram, ram, MemoryStrategy(activation_chunks="auto"), CPU_DISK)
    assert all(stage.ram_bytes <= ram for stage in plan.stages)
    assert plan.fits


def test_a_cpu_process_runtime_leaves_out_the_gpu_context_and_on_a_cpu_build_the_cuda_libraries(wan, monkeypatch):
    """Measured in a fresh process with this torch (a CPU build in CI; ComfyUI's is a CUDA build, which maps
    the CUDA libraries on import even when it computes on the CPU)."""
    code = ("import psutil, torch, diffusers, transformers\n"
            "from diffusers import WanTransformer3DModel, AutoencoderKLWan\n"
            "from transformers import UMT5EncoderModel\n"
            "print(psutil.Process().memory_info().rss)")
    measured = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert measured <= host_runtime_bytes(on_cpu=True) < HOST_RUNTIME_BYTES
    weights = sum(wan.weights(n).nbytes for n in wan.layout.all)
    assert host_base(wan, PlanOptions(device="cpu"))[0] == host_runtime_bytes(on_cpu=True) + weights
    assert host_base(wan, PlanOptions())[0] == HOST_RUNTIME_BYTES + weights
    for cuda_build, runtime in ((False, HOST_RUNTIME_BYTES_CPU), (True, HOST_RUNTIME_BYTES_CPU_CUDA_BUILD)):
        monkeypatch.setattr(torch.backends.cuda, "is_built", lambda built=cuda_build: built)
        assert host_runtime_bytes(on_cpu=True) == runtime < HOST_RUNTIME_BYTES


class _Stage:
    """A denoise stage over every budget the test passes: its unlimited reservation, what it needs under one."""

    def __init__(self, unlimited: int, under_budget: int) -> None:
        self.device_bytes, self._under = unlimited, under_budget

    def fits(self, budget) -> bool:
        return False

    def footprint(self, budget) -> int:
        return self._under


def test_when_no_chunk_count_fits_the_one_closest_under_the_budget_is_taken(wan, monkeypatch):
    # Two denoisers (Wan 2.2): one phase can fit near the limit while the other does not; the count to show
    # is the one that needs the least under the budget, not the one with the lowest unlimited reservation.
    stages = {1: _Stage(10, 10), 2: _Stage(8, 6), 4: _Stage(7, 7), 8: _Stage(7, 7), 16: _Stage(7, 7), 32: _Stage(6, 7)}
    monkeypatch.setattr(candidates, "denoise_stage", lambda m, s, strategy, o: stages[strategy.activation_chunks])
    chosen = fewest_chunks(wan, SHAPE, MemoryStrategy(offload="sequential"), PlanOptions(), 5)
    assert chosen.activation_chunks == 2


def test_a_tiny_budget_is_printed_with_its_digits(wan):
    plan = plan_run(wan, VideoShape(320, 192, 9), MemoryStrategy(), PlanOptions(steps=4), 8 * GiB, GiB // 1000)
    assert any("> 0.001 GiB" in line for line in plan.over_budget())
    assert not any("0.0 GiB" in line for line in plan.over_budget())


def test_a_cpu_stage_over_its_ram_is_said_once_with_digits_that_differ(wan):
    """One RAM test on a CPU (compute and process share it): a stage over it read "RAM 1.6 > 1.0 GiB, RAM 1.6 >
    1.0 GiB", and a need just above the budget "RAM 1.0 > 1.0 GiB"."""
    plan = plan_run(wan, SHAPE, MemoryStrategy(offload="sequential", activation_chunks=16), CPU_DISK, GiB, GiB)
    lines = plan.over_budget()
    assert lines and not plan.fits
    for line in lines:
        over = line.split(": ", 1)[1]
        assert over.count("RAM") == 1 and "VRAM" not in over, line
        need, budget = over.removeprefix("RAM ").removesuffix(" GiB").split(" > ")
        assert need != budget, line


def test_the_chart_is_told_the_cpu_computes_and_gets_each_stages_ram_with_its_compute():
    """ComfyUI --cpu: the route plans the CPU; its answer says so ("device"), and each stage's RAM is the one that
    fits (StagePlan.ram_bytes, compute included), so the chart sets it against the RAM budget. A 4 GB VRAM budget
    read "your settings: fit; peak 10.7 of 4.0 GiB VRAM" beside red bars."""
    from vidmem.nodes.plan_route import parse_request, plan_answer
    from test_plan_route_windows import query

    request = parse_request(query("wan2.1-t2v-1.3b", 832, 480, 81, vram_budget_gb="4", ram_budget_gb="64"),
                            ["wan2.1-t2v-1.3b"], ["bf16"])
    answer = plan_answer(request, lambda name, dtype: load_model(name, dtype), (4 * GiB, 64 * GiB), device="cpu")
    mine = answer["rows"][answer["chosen"]]
    assert answer["device"] == "cpu" and mine["peak_vram_bytes"] > 4 * GiB and mine["fits"]
    assert max(stage["ram_bytes"] for stage in mine["stages"]) == mine["peak_ram_bytes"]
    assert all(stage["ram_bytes"] >= stage["vram_bytes"] for stage in mine["stages"])  # the compute is in RAM
    gpu = plan_answer(request, lambda name, dtype: load_model(name, dtype), (4 * GiB, 64 * GiB), device="cuda")
    assert gpu["device"] == "cuda" and not gpu["rows"][gpu["chosen"]]["fits"]


def test_a_cpu_plans_lines_give_one_ram_peak_with_its_compute_in_it(wan):
    """Its RAM counts the compute: "peak VRAM 10.68 GiB, RAM 19.24 GiB" read as a sum, and "nothing fits ... in 1.5
    GiB VRAM / 1.5 GiB RAM" put the RAM budget in the VRAM's place."""
    from vidmem.memory.plan.advice import nothing_fits_message
    from vidmem.nodes.sampler import _peaks

    plan = plan_run(wan, SHAPE, MemoryStrategy(offload="model"), CPU_DISK, 4 * GiB, 64 * GiB)
    line = _peaks(plan)
    assert "the CPU computes: peak RAM" in line and "VRAM" not in line
    assert f"{plan.peak_ram_bytes / GiB:.2f} GiB (its compute {plan.peak_vram_bytes / GiB:.2f})" in line
    plans = candidate_plans(wan, SHAPE, 4 * GiB, GiB, options=CPU_DISK)
    message = nothing_fits_message(wan, SHAPE, plans, MemoryStrategy(), CPU_DISK)
    assert "in 1.0 GiB RAM (the CPU computes)" in message.splitlines()[0] and "VRAM" not in message.splitlines()[0]
    gpu = plan_run(wan, SHAPE, MemoryStrategy(offload="model"), PlanOptions(steps=4), 8 * GiB, 64 * GiB)
    assert "; peak VRAM " in _peaks(gpu)
