"""The Speed (VidMem) node and its glue (nodes/speed.py, pipelines/speed.py): the choices reach the
Sampler's call, are refused before anything moves when they cannot run, say in the receipt what ran,
and every tier gives tier none's latent with them. Each part's own behaviour is tested in
test_attention.py, test_compile.py and test_fp8_matmul.py."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from backends import StrictBackend
from test_tiers import request_for
from vidmem.memory import MemoryStrategy
from vidmem.memory.strategy import StrategyError
from vidmem.nodes.sampler import VidMemVideoSampler
from vidmem.nodes.speed import VidMemSpeed, speed_input
from vidmem.pipelines.compile import CompileSettings
from vidmem.pipelines.sample import sample
from vidmem.pipelines.speed import NO_SPEED_NODE, Speed

STEPS = 3
EAGER_COMPILE = CompileSettings(True, backend="eager")  # dynamo's tracing and guards, no code generation: fast


def run(loaded, variant, strategy, speed):
    request = replace(request_for(variant, steps=STEPS), speed=speed)
    return sample(loaded, strategy, request, backend=StrictBackend())


def test_the_node_builds_a_speed_and_the_sampler_takes_it():
    speed = VidMemSpeed().build("math", True, "max-autotune-no-cudagraphs", "false", "off")["result"][0]
    assert speed == Speed("math", CompileSettings(True, "max-autotune-no-cudagraphs", False), "off")
    assert speed_input(None, "Video Sampler") == NO_SPEED_NODE and speed_input(speed, "Video Sampler") is speed
    with pytest.raises(StrategyError, match=r"speed \(Video Sampler\) got .*Speed \(VidMem\)"):
        speed_input(MemoryStrategy(), "Video Sampler")
    assert "speed" in VidMemVideoSampler.INPUT_TYPES()["optional"]


def test_a_bad_choice_is_refused_by_name():
    with pytest.raises(StrategyError, match="attention='fastest' is not one of"):
        Speed("fastest")
    with pytest.raises(StrategyError, match="fp8_matmul='yes' is not one of"):
        Speed(fp8_matmul="yes")
    with pytest.raises(StrategyError, match="compile="):
        Speed(compile=True)


def test_a_kernel_no_dtype_could_run_here_is_refused_when_queued():
    """This machine has no GPU (CI): sage and cuDNN are refused at queue time with the fix; auto passes."""
    if torch.cuda.is_available():
        pytest.skip("checks the refusals of a machine without CUDA")
    assert VidMemSpeed.VALIDATE_INPUTS("auto") is True and VidMemSpeed.VALIDATE_INPUTS("sdpa") is True
    for kernel in ("sage", "cudnn"):
        problem = VidMemSpeed.VALIDATE_INPUTS(kernel)
        assert isinstance(problem, str) and f"attention='{kernel}'" in problem and "choose 'auto'" in problem


@pytest.mark.parametrize("variant", ["wan2.1-t2v", "cogvideox-t2v"])
def test_without_a_speed_node_the_run_is_unchanged_and_the_receipt_names_the_kernel(tiny_loaded, variant):
    loaded = tiny_loaded(variant)
    plain = run(loaded, variant, MemoryStrategy(offload="none"), NO_SPEED_NODE)
    auto = run(loaded, variant, MemoryStrategy(offload="none"), Speed("auto", fp8_matmul="auto"))
    assert torch.equal(plain.latent["samples"], auto.latent["samples"])  # auto on the CPU: plain SDPA, no fp8
    receipt = plain.receipt["speed"]
    assert receipt["attention"]["kernel"] == "sdpa" and receipt["attention"]["requested"] == "auto"
    assert receipt["compile"]["compiled"] is False
    assert receipt["fp8_matmul"]["enabled"] is False


@pytest.mark.parametrize("variant", ["wan2.1-t2v", "wan2.2-a14b"])
def test_every_tier_gives_tier_nones_latent_with_a_kernel_and_compiled_blocks(tiny_loaded, variant):
    loaded = tiny_loaded(variant)
    speed = Speed("math", EAGER_COMPILE)
    blocks = len(loaded.pipe.transformer.blocks)
    tiers = {"none": MemoryStrategy(offload="none"), "model": MemoryStrategy(offload="model"),
             "block_swap": MemoryStrategy(offload="block_swap", blocks_to_swap=blocks),
             "sequential": MemoryStrategy(offload="sequential")}
    results = {name: run(loaded, variant, strategy, speed) for name, strategy in tiers.items()}
    reference = results["none"].latent["samples"]
    for name, result in results.items():
        assert torch.equal(result.latent["samples"], reference), name
        assert result.receipt["speed"]["attention"]["kernel"] == "math", name
        assert result.receipt["speed"]["compile"]["compiled"] is True, (name, result.receipt["speed"]["compile"])
    plain = run(loaded, variant, MemoryStrategy(offload="none"), Speed())
    assert torch.allclose(plain.latent["samples"], reference, atol=1e-4)  # math against SDPA's CPU flash kernel


def test_fp8_matmul_on_without_fp8_layers_is_refused_before_anything_moves(tiny_loaded):
    loaded = tiny_loaded("wan2.1-t2v")
    devices = {p.device for p in loaded.pipe.transformer.parameters()}
    forwards = [block.__dict__.get("forward") for block in loaded.pipe.transformer.blocks]
    with pytest.raises(StrategyError, match="fp8_matmul='on' cannot run here"):
        run(loaded, "wan2.1-t2v", MemoryStrategy(offload="none"), Speed("math", EAGER_COMPILE, fp8_matmul="on"))
    assert {p.device for p in loaded.pipe.transformer.parameters()} == devices
    assert [block.__dict__.get("forward") for block in loaded.pipe.transformer.blocks] == forwards  # nothing compiled


def test_the_plan_counts_the_score_matrix_of_a_kernel_that_holds_it(tiny_loaded):
    from vidmem.memory.plan.types import PlanOptions, VideoShape
    from vidmem.pipelines.planning import plan_strategy
    from vidmem.pipelines.speed import planned_attention

    loaded = tiny_loaded("wan2.1-t2v")
    shape = VideoShape(256, 256, 17, cfg=True)

    def peak(speed: Speed) -> int:
        options = PlanOptions(attention=planned_attention(speed))
        plan = plan_strategy(loaded, shape, MemoryStrategy(offload="none"), None, None, options, device="cpu")
        return plan.stage("denoise").device_bytes

    fused = peak(Speed())
    assert peak(Speed("math")) > fused and peak(Speed("flex")) > fused
    assert peak(Speed("flash")) == fused == peak(Speed("sage"))


@pytest.mark.parametrize("method", ["mag_cache", "taylor_seer"])
def test_compiled_blocks_with_the_step_cache_skip_what_the_eager_run_skips(tiny_loaded, method):
    """The speed is applied before the step cache wraps the blocks, so both hold for the whole call."""
    from vidmem.pipelines.step_cache import StepCache

    loaded = tiny_loaded("wan2.1-t2v")
    cache = (StepCache("mag_cache", mag_ratios=(1.0,) * STEPS, threshold=0.5, retention=0.0, max_skip_steps=3)
             if method == "mag_cache" else StepCache("taylor_seer", interval=2, warmup_steps=1))
    strategy = MemoryStrategy(offload="block_swap", blocks_to_swap=len(loaded.pipe.transformer.blocks))

    def cached(speed):
        request = replace(request_for("wan2.1-t2v", steps=STEPS), cache=cache, speed=speed)
        return sample(loaded, strategy, request, backend=StrictBackend())

    eager, compiled = cached(Speed()), cached(Speed(compile=EAGER_COMPILE))
    assert compiled.receipt["cache"]["blocks_skipped"] == eager.receipt["cache"]["blocks_skipped"] > 0
    assert torch.equal(compiled.latent["samples"], eager.latent["samples"])
    assert compiled.receipt["speed"]["compile"]["compiled"] is True


def test_the_plan_quotes_a_speed_up_measured_on_this_device_and_nothing_where_none_was(monkeypatch):
    from vidmem.pipelines import speed as speed_module

    measured = {"device": "Test CPU", "source": "bench/results/x.json", "attention": {"flash": 0.8},
                "compile": 0.7, "fp8_matmul": 1.3}
    monkeypatch.setattr(speed_module, "cpu_name", lambda: "Test CPU")
    monkeypatch.setattr(speed_module, "_measured", lambda: {"Test CPU": measured})
    line = speed_module.measured_line(Speed("flash", CompileSettings(True)), "cpu")
    assert "attention flash x0.80" in line and "compiled blocks x0.70" in line and "bench/results/x.json" in line
    assert "fp8" not in line  # fp8 matmul off: nothing to quote
    assert speed_module.measured_line(Speed(), "cpu") == ""
    monkeypatch.setattr(speed_module, "cpu_name", lambda: "Another CPU")
    assert speed_module.measured_line(Speed("flash", CompileSettings(True)), "cpu") == ""


def test_the_shipped_measurements_name_their_source():
    import json

    from vidmem.pipelines.speed import MEASURED

    for entry in json.loads(MEASURED.read_text())["devices"]:
        assert entry["device"] and (MEASURED.parents[2] / entry["source"]).is_file(), entry
        for part, source in entry.get("sources", {}).items():  # a figure measured in another run names its own
            assert part in entry and (MEASURED.parents[2] / source).is_file(), (entry["device"], part)


def test_activation_chunks_run_compiled_with_the_kernel(tiny_loaded):
    """Chunked blocks compile their slices' steps (dynamo's capture with the eager backend: the same ops), with
    the chosen kernel: the latents of the plain run, and the receipt says compiled."""
    loaded = tiny_loaded("wan2.1-t2v")
    chunked = MemoryStrategy(offload="none", activation_chunks=2)
    plain = run(loaded, "wan2.1-t2v", MemoryStrategy(offload="none"), Speed("math"))
    both = run(loaded, "wan2.1-t2v", chunked, Speed("math", EAGER_COMPILE))
    assert torch.equal(both.latent["samples"], plain.latent["samples"])  # chunks are exact, with the chosen kernel
    compiled = both.receipt["speed"]["compile"]
    assert compiled["compiled"] and compiled["fallback"] is None and compiled["frames_compiled"] >= 1, compiled
    assert both.receipt["speed"]["attention"]["kernel"] == "math"
    assert both.receipt["activation_chunks"]["chunks"] == 2


def test_without_a_speed_node_attention_is_left_as_the_model_has_it_even_on_a_gpu(tiny_loaded, monkeypatch):
    """auto on a CUDA card resolves to SDPA choosing per call, as without a node: the processors stay as they are;
    a node naming a kernel (efficient) applies it for the call only."""
    from vidmem.pipelines import attention
    from vidmem.pipelines.speed import resolve_speed, speed_for_call

    monkeypatch.setattr(attention, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(attention, "_kernel_refusal", lambda *args: "")  # its probe needs the GPU faked here
    loaded = tiny_loaded("wan2.1-t2v")
    denoisers = {"transformer": loaded.pipe.transformer}
    blocks = {"transformer": list(loaded.pipe.transformer.blocks)}
    processors = [m.processor for m in loaded.pipe.transformer.modules() if hasattr(m, "processor")]
    before = [getattr(p, "_attention_backend", None) for p in processors]
    cuda = torch.device("cuda")
    for speed, chosen in ((NO_SPEED_NODE, "sdpa"), (Speed("auto", CompileSettings(), "off"), "sdpa"),
                          (Speed("efficient", CompileSettings(), "off"), "efficient")):
        resolved = resolve_speed(speed, cuda, torch.bfloat16)
        assert resolved.attention.kernel.value == chosen
        with speed_for_call(resolved, denoisers, blocks, torch.device("cpu")) as applied:
            during = [getattr(p, "_attention_backend", None) for p in processors]
            receipt = applied.as_dict()["attention"]
        assert (during != before) is (chosen == "efficient"), (speed, during)
        assert receipt["kernel"] == chosen
        assert ("measured" in receipt["why"]) is (speed.chosen and speed.attention.value == "auto"), receipt  # auto's why
        assert [getattr(p, "_attention_backend", None) for p in processors] == before


def test_compiled_blocks_with_context_parallelism_are_refused_naming_both_inputs(tiny_loaded):
    from vidmem.pipelines.speed import resolve_speed

    with pytest.raises(StrategyError, match="compile on the Speed node cannot run with context_parallel"):
        resolve_speed(Speed(compile=EAGER_COMPILE), torch.device("cpu"), torch.float32, context_parallel=True)
    assert resolve_speed(Speed("math"), torch.device("cpu"), torch.float32, context_parallel=True)


def test_the_run_plans_its_room_with_the_score_matrix_of_math(tiny_loaded):
    from vidmem.memory.accounting import Attention
    from vidmem.memory.plan.types import VideoShape
    from vidmem.pipelines.room import sample_room

    loaded = tiny_loaded("wan2.1-t2v")
    shape, strategy = VideoShape(256, 256, 17, cfg=True), MemoryStrategy(offload="none")
    fused = sample_room(loaded, strategy, shape, 2, False, 0, torch.device("cuda"))
    unfused = sample_room(loaded, strategy, shape, 2, False, 0, torch.device("cuda"), Attention.MATH)
    assert unfused.total_bytes > fused.total_bytes, (fused, unfused)


def test_an_unknown_kernel_is_refused_when_queued():
    assert "attention='fastest' is not one of" in VidMemSpeed.VALIDATE_INPUTS("fastest")


def test_the_plans_speed_line_says_what_the_run_would_do_with_fp8():
    from vidmem.pipelines.speed import speed_plan_line

    assert "fp8 weights upcast: on the CPU auto keeps frames bit-identical" in speed_plan_line(Speed(fp8_matmul="auto"), "cpu", torch.float32)
    assert "fp8 matmul on the model's fp8 layers" in speed_plan_line(Speed(fp8_matmul="on"), "cpu", torch.float32)


def test_the_plans_speed_line_for_a_gpu_this_process_cannot_see_says_so_instead_of_failing(monkeypatch):
    from vidmem.pipelines.speed import speed_plan_line

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    line = speed_plan_line(Speed("auto", CompileSettings(True), "auto"), "cuda", torch.bfloat16)
    assert "resolved on the GPU when the run starts" in line and "compiled blocks" in line
