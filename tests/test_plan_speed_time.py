"""The plan's time follows the Speed node's choices where bench/speed.py measured them on this device
(pipelines/configs/speedups.json, `MeasuredSpeed`): the denoiser's compute and its upcasts scale by the
measured ratios; its copies do not; compiled blocks do not count under `sequential` (a graph break per
streamed leaf); fp8 matmul counts only for a denoiser stored in float8_e4m3fn. The Memory Strategy's
chart (GET /vidmem/plan) and the Sampler's plan both read them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vidmem.memory import MemoryStrategy
from vidmem.memory.accounting import Attention
from vidmem.memory.plan.candidates import plan_run
from vidmem.memory.plan.costs import MeasuredSpeed
from vidmem.memory.plan.planner import Allocator, PlanOptions, VideoShape
from vidmem.pipelines.compile import CompileSettings
from vidmem.pipelines.configs import load_model
from vidmem.pipelines.speed import Speed

SHAPE = VideoShape(832, 480, 81)
GPU = PlanOptions(allocator=Allocator.NATIVE, steps=4)
FP8 = {"transformer": "fp8_scaled"}


@pytest.fixture(scope="module")
def wan():
    return load_model("wan2.1-t2v-1.3b")


def _denoise(plan):
    return next(w for w in plan.stage("denoise").work if w.passes > 1)


def _plan(model, offload, speed=MeasuredSpeed(), storage=(), **strategy):
    return plan_run(model, SHAPE, MemoryStrategy(offload=offload, **strategy), PlanOptions(
        allocator=Allocator.NATIVE, steps=4, storage=storage, speed=speed), None, None)


def test_nothing_measured_changes_nothing(wan):
    plain = _plan(wan, "none")
    assert _denoise(plain).time_ratio == 1.0
    assert plain.seconds_with_denoise_share(1.0) == _plan(wan, "none", MeasuredSpeed()).seconds_with_denoise_share(1.0)


def test_compiled_blocks_shorten_the_denoisers_compute_and_its_upcasts(wan):
    eager = _denoise(_plan(wan, "none", storage=FP8))
    compiled = _denoise(_plan(wan, "none", MeasuredSpeed(compiled=0.6), storage=FP8))
    assert eager.dequant_weights > 0  # the upcasts are in the measured ratio: they scale with the compute
    assert compiled.seconds() == pytest.approx(eager.seconds() * 0.6, rel=1e-9)


def test_the_other_stages_do_not_follow_the_denoisers_speed(wan):
    eager, compiled = _plan(wan, "none"), _plan(wan, "none", MeasuredSpeed(compiled=0.5, kernel=0.5))
    for stage in ("text_encode", "decode"):
        assert [w.seconds() for w in eager.stage(stage).work] == [w.seconds() for w in compiled.stage(stage).work]


def test_the_resident_baseline_follows_it_so_a_tiers_slowdown_stays_against_the_runs_best(wan):
    """A resident run with compiled blocks is no slower than its own best: x1.00, as eager. Sequential loses the
    compile (its leaves break the graph), so it is slower against that best than eager sequential is against its."""
    speed = MeasuredSpeed(compiled=0.6)
    assert _plan(wan, "none", speed).est_slowdown == _plan(wan, "none").est_slowdown == 1.0
    eager, compiled = _plan(wan, "sequential"), _plan(wan, "sequential", speed)
    assert _denoise(compiled).time_ratio == 1.0
    assert compiled.baseline_seconds < eager.baseline_seconds
    assert compiled.est_slowdown > eager.est_slowdown


def test_a_faster_compute_leaves_block_swaps_copies_as_they_were(wan):
    """Block swap's copies overlap the compute: shortening the compute shortens the step only down to the copies."""
    swapped = dict(blocks_to_swap=30)
    eager = _denoise(_plan(wan, "block_swap", **swapped))
    fast = _denoise(_plan(wan, "block_swap", MeasuredSpeed(compiled=0.01), **swapped))
    assert fast.traffic == eager.traffic and fast.traffic.per_pass_bytes > 0
    assert eager.seconds() * 0.01 < fast.seconds() < eager.seconds()


@pytest.mark.parametrize("storage, counted", [({"transformer": "fp8_scaled"}, True),
                                              ({"transformer": "fp8_e4m3fn"}, True),
                                              ({"transformer": "fp8_e5m2"}, False),
                                              ({"transformer": "gguf_q8_0"}, False),
                                              ((), False)])
def test_fp8_matmul_counts_for_a_denoiser_stored_in_e4m3fn_only(wan, storage, counted):
    assert _denoise(_plan(wan, "none", MeasuredSpeed(fp8_matmul=1.2), storage)).time_ratio == (1.2 if counted else 1.0)


def test_with_fp8_matmul_a_chunked_blocks_slices_add_no_upcasts(wan):
    """A layer multiplied in fp8 never upcasts, so slicing a block does not multiply its upcasts (they stay
    counted once, as in the measured ratio's baseline); with fp8 matmul off each slice upcasts again."""
    chunked = dict(activation_chunks=16)
    plain = _denoise(_plan(wan, "none", storage=FP8))
    upcast = _denoise(_plan(wan, "none", storage=FP8, **chunked))
    fp8 = _denoise(_plan(wan, "none", MeasuredSpeed(fp8_matmul_on=True), FP8, **chunked))
    assert upcast.dequant_weights > 10 * plain.dequant_weights
    assert fp8.dequant_weights == plain.dequant_weights
    gguf = _denoise(_plan(wan, "none", MeasuredSpeed(fp8_matmul_on=True), {"transformer": "gguf_q8_0"}, **chunked))
    assert gguf.dequant_weights > 10 * plain.dequant_weights  # GGUF layers upcast per slice whatever fp8 matmul says


def test_the_ratios_multiply():
    speed = MeasuredSpeed(kernel=0.9, compiled=0.5, compiled_sequential=1.1, fp8_matmul=1.2)
    assert speed.ratio(False, True) == pytest.approx(0.54)
    assert speed.ratio(True, True) == pytest.approx(0.9 * 1.1 * 1.2)  # sequential: its own compiled figure
    assert speed.ratio(False, False) == pytest.approx(0.45)


def test_compiled_blocks_with_fp8_matmul_take_the_pairs_figure_never_the_eager_fp8_one():
    """Inside compiled graphs fp8 matmul is faster than eager (the H200: x0.81 for the pair, x0.83 compiled alone,
    x1.25 fp8 eager): the pair's measured figure where there is one, else compiled blocks' own; sequential (a graph
    break per leaf) multiplies as eagerly; weights not stored in fp8 take compiled blocks' figure."""
    pair = MeasuredSpeed(kernel=0.9, compiled=0.83, compiled_sequential=1.1, fp8_matmul=1.25, fp8_matmul_on=True,
                         compiled_fp8_matmul=0.81, compiled_on=True)
    assert pair.ratio(False, True) == pytest.approx(0.9 * 0.81)
    assert pair.ratio(False, False) == pytest.approx(0.9 * 0.83)
    assert pair.ratio(True, True) == pytest.approx(0.9 * 1.1 * 1.25)
    unmeasured = MeasuredSpeed(compiled=0.83, fp8_matmul=1.25, fp8_matmul_on=True, compiled_on=True)
    assert unmeasured.ratio(False, True) == pytest.approx(0.83)
    upcast = MeasuredSpeed(compiled=0.83, compiled_fp8_matmul=0.81, compiled_on=True)  # fp8 matmul off: weights upcast
    assert upcast.ratio(False, True) == pytest.approx(0.83)


def test_sequential_is_timed_with_compiles_sequential_figure(wan):
    speed = MeasuredSpeed(compiled=0.6, compiled_sequential=1.1)
    assert _denoise(_plan(wan, "sequential", speed)).time_ratio == 1.1
    assert _denoise(_plan(wan, "block_swap", speed, blocks_to_swap=10)).time_ratio == 0.6


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan")])
def test_a_ratio_that_is_not_a_positive_time_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="MeasuredSpeed.compiled"):
        MeasuredSpeed(compiled=bad)


# --- configs/speedups.json to MeasuredSpeed -------------------------------------------------------------------

MEASURED = {"device": "Test CPU", "source": "bench/results/x.json", "attention": {"flash": 0.8, "math": 2.0, "flex": 4.0},
            "compile": 0.7, "compile_sequential": 1.1, "fp8_matmul": 1.3,
            "sources": {"compile": "bench/results/y.json"}}


@pytest.fixture
def speed_module(monkeypatch):
    from vidmem.pipelines import speed

    monkeypatch.setattr(speed, "cpu_name", lambda: "Test CPU")
    monkeypatch.setattr(speed, "_measured", lambda: {"Test CPU": MEASURED})
    return speed


def test_the_measured_ratios_of_the_choices_made(speed_module):
    measured = speed_module.measured_speed(Speed("flash", CompileSettings(True), "on"), "cpu")
    assert measured == MeasuredSpeed(kernel=0.8, compiled=0.7, compiled_sequential=1.1, fp8_matmul=1.3,
                                     fp8_matmul_on=True, compiled_on=True)  # 'on': also on a CPU
    assert speed_module.measured_speed(Speed("math"), "cpu") == MeasuredSpeed(kernel=2.0)


def test_fp8_matmul_on_is_known_where_no_ratio_was_measured(speed_module, monkeypatch):
    monkeypatch.setattr(speed_module, "_measured", lambda: {})
    assert speed_module.measured_speed(Speed(fp8_matmul="on"), "cpu") == MeasuredSpeed(fp8_matmul_on=True)


def test_choices_not_made_or_not_measured_are_not_counted(speed_module):
    assert speed_module.measured_speed(Speed(), "cpu") == MeasuredSpeed()  # auto's kernel is the baseline's
    assert speed_module.measured_speed(Speed("cudnn"), "cpu") == MeasuredSpeed()  # not measured here
    assert speed_module.measured_speed(Speed(fp8_matmul="auto"), "cpu") == MeasuredSpeed()  # auto upcasts
    assert speed_module.measured_speed(Speed(chosen=False), "cpu") == MeasuredSpeed()  # no Speed node


def test_lora_hooks_are_timed_with_the_figure_measured_with_a_lora_or_the_blocks_own(speed_module, monkeypatch):
    """A LoRA's hooks are traced into the compiled graphs (memory/lora.py): no graph break to charge as
    sequential's leaves are; a device's `compile_lora` figure where it was measured."""
    compiled = Speed(compile=CompileSettings(True))
    assert speed_module.measured_speed(compiled, "cpu", lora_hooks=True) == MeasuredSpeed(
        compiled=0.7, compiled_sequential=1.1, compiled_on=True)
    monkeypatch.setattr(speed_module, "_measured", lambda: {"Test CPU": {**MEASURED, "compile_lora": 0.75}})
    assert speed_module.measured_speed(compiled, "cpu", lora_hooks=True) == MeasuredSpeed(
        compiled=0.75, compiled_sequential=1.1, compiled_on=True)
    assert speed_module.measured_speed(compiled, "cpu") == MeasuredSpeed(compiled=0.7, compiled_sequential=1.1,
                                                                         compiled_on=True)
    assert "compiled blocks with a LoRA x0.75" in speed_module.measured_line(compiled, "cpu")


def test_context_parallel_refuses_compile_so_it_is_not_credited_and_the_line_says_so(speed_module):
    compiled = Speed("flash", CompileSettings(True))
    assert speed_module.measured_speed(compiled, "cpu", context_parallel=True) == MeasuredSpeed(kernel=0.8)
    line = speed_module.speed_plan_line(compiled, "cpu", speed_module.torch.float32, context_parallel=True)
    assert "refused: compile on the Speed node cannot run with context_parallel" in line
    assert "attention flash x0.80" in line and "compiled blocks x" not in line  # it quotes only what the time uses


def test_flex_is_not_timed_with_its_eager_figure_when_compiled(speed_module):
    assert speed_module.measured_speed(Speed("flex"), "cpu") == MeasuredSpeed(kernel=4.0)
    flex_compiled = speed_module.measured_speed(Speed("flex", CompileSettings(True)), "cpu")
    assert flex_compiled == MeasuredSpeed(compiled=0.7, compiled_sequential=1.1, compiled_on=True)


def test_another_device_or_a_gpu_this_process_cannot_see_counts_nothing(speed_module, monkeypatch):
    compiled = Speed(compile=CompileSettings(True))
    monkeypatch.setattr(speed_module.torch.cuda, "is_available", lambda: False)
    nothing = MeasuredSpeed(compiled_on=True)  # chosen, with no figure
    assert speed_module.measured_speed(compiled, "cuda") == nothing
    assert speed_module.measured_speed(compiled, "mps") == nothing  # the host CPU's figures do not stand in
    monkeypatch.setattr(speed_module, "cpu_name", lambda: "Another CPU")
    assert speed_module.measured_speed(compiled, "cpu") == nothing


def test_a_gpu_is_timed_with_the_figures_of_the_one_it_runs_on(speed_module, monkeypatch):
    # A machine with two kinds of GPU: the Sampler computes on ComfyUI's device ("cuda:1"), not the current one.
    monkeypatch.setattr(speed_module.torch.cuda, "is_available", lambda: True)
    names = {None: "Small GPU", 0: "Small GPU", 1: "Test CPU"}  # the test figures stand for the second card's
    monkeypatch.setattr(speed_module.torch.cuda, "get_device_name", lambda index=None: names[index])
    compiled = Speed(compile=CompileSettings(True))
    assert speed_module.measured_speed(compiled, "cuda:1").compiled == 0.7
    assert speed_module.measured_speed(compiled, speed_module.torch.device("cuda", 1)).compiled == 0.7
    assert speed_module.measured_speed(compiled, "cuda:0") == MeasuredSpeed(compiled_on=True)
    assert speed_module.measured_speed(compiled, "cuda") == MeasuredSpeed(compiled_on=True)  # no index: the current GPU's


def test_fp8_matmul_is_judged_on_the_gpu_the_run_uses(speed_module, monkeypatch):
    """A machine with an Ampere card as the current GPU and a Hopper one as ComfyUI's device ("cuda:1"): fp8 matmul
    'on' runs there, and the plan times it so; on the Ampere card it is refused."""
    torch = speed_module.torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: {1: "Test CPU"}.get(index, "Small GPU"))
    capabilities = {None: (8, 0), 0: (8, 0), 1: (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability",
                        lambda device=None: capabilities[None if device is None else torch.device(device).index])
    on = Speed(fp8_matmul="on")
    assert speed_module.measured_speed(on, "cuda:1") == MeasuredSpeed(fp8_matmul=1.3, fp8_matmul_on=True)
    assert not speed_module.measured_speed(on, "cuda").fp8_matmul_on
    assert "fp8 matmul on the model's fp8 layers" in speed_module.speed_plan_line(on, "cuda:1", torch.bfloat16,
                                                                                  storage=("fp8_scaled",))
    assert "capability 8.0 < 8.9" in speed_module.speed_plan_line(on, "cuda:0", torch.bfloat16, storage=("fp8_scaled",))


def test_the_speed_line_for_a_gpu_this_process_cannot_see_names_the_weights_reason(speed_module, monkeypatch):
    """`vidmem plan` on a machine without CUDA plans for a GPU (its default --device): with weights no fp8 matmul can
    take, auto and 'on' say so from the storage alone, and nothing asks torch about a GPU it cannot see."""
    monkeypatch.setattr(speed_module.torch.cuda, "is_available", lambda: False)
    bf16 = speed_module.torch.bfloat16
    auto = speed_module.speed_plan_line(Speed(fp8_matmul="auto"), "cuda", bf16, storage=("gguf_q4_k",))
    assert "fp8 weights upcast: the denoiser's weights are stored as gguf_q4_k, not float8_e4m3fn" in auto
    on = speed_module.speed_plan_line(Speed(fp8_matmul="on"), "cuda", bf16, storage=("gguf_q4_k",))
    assert "refused: fp8_matmul='on' cannot run here: the denoiser's weights are stored as gguf_q4_k" in on


def test_the_plan_line_quotes_what_the_time_uses(speed_module):
    speed = Speed("flash", CompileSettings(True), "on")
    line = speed_module.measured_line(speed, "cpu")
    assert "attention flash x0.80" in line and "compiled blocks x0.70" in line
    assert "fp8 matmul with eager blocks x1.30" in line  # what sequential times with: its graphs break per leaf
    assert "compiled blocks under sequential x1.10" in line
    assert "bench/results/x.json, bench/results/y.json" in line  # each figure's own run


def test_the_chart_times_its_rows_with_the_speed_nodes_measured_choices(speed_module, monkeypatch):
    """GET /vidmem/plan with a Speed node: the rows' slowdowns are against the run's best with its compiled blocks,
    so `sequential` (timed with its own compiled figure: its leaves break the graph) shows what it loses; without a
    measurement the rows are as before."""
    from test_web_route import _wan_13b_speed_plan

    compiled = dict(attention="auto", compile="true", compile_mode="default", compile_dynamic="auto",
                    fp8_matmul="off")

    def sequential(**speed):
        return _wan_13b_speed_plan(offload="sequential", **speed)["rows"][-1]

    eager, fast = sequential(), sequential(**compiled)
    assert eager["label"] == fast["label"] == "your settings"
    # sequential's compiled figure against the resident best's
    assert fast["est_slowdown"] == pytest.approx(
        eager["est_slowdown"] * MEASURED["compile_sequential"] / MEASURED["compile"], abs=0.02)
    monkeypatch.setattr(speed_module, "_measured", lambda: {})  # another machine: nothing measured
    assert sequential(**compiled)["est_slowdown"] == eager["est_slowdown"]


class _Planned(Exception):
    """Stops the Sampler node once its plan's options are seen: nothing runs."""


def test_the_samplers_auto_choice_is_timed_with_the_measured_speed(speed_module, tiny_loaded, monkeypatch):
    from vidmem.nodes import sampler as sampler_node
    from vidmem.nodes.strategy import VidMemMemoryStrategy

    seen = []

    def choose_for(pipeline, shape, strategy, vram, ram, options, device=None):
        seen.append(options.speed)
        raise _Planned

    monkeypatch.setattr(sampler_node, "choose_for", choose_for)
    monkeypatch.setattr(sampler_node.host, "compute_device", lambda: speed_module.torch.device("cpu"))
    (choice,) = VidMemMemoryStrategy().build(offload="auto", blocks_to_swap=0, prefetch_blocks=1, max_pinned_ram_gb=-1.0,
                                             non_blocking=True, text_encoder="offload_after_encoding", vae_slicing=False,
                                             vae_tiling=False, tile_size=256, overlap=64, temporal_size=64,
                                             temporal_overlap=8)["result"]
    for speed in (None, Speed(compile=CompileSettings(True))):
        with pytest.raises(_Planned):
            sampler_node.VidMemVideoSampler().sample(tiny_loaded("wan2.1-t2v"), choice, "a cat", "", 32, 32, 9, 1, 1.0,
                                                     0, speed=speed)
    assert seen == [MeasuredSpeed(), MeasuredSpeed(compiled=MEASURED["compile"],
                                                 compiled_sequential=MEASURED["compile_sequential"], compiled_on=True)]


def test_the_sampler_times_with_the_figures_of_comfyuis_gpu(speed_module, tiny_loaded, monkeypatch):
    """ComfyUI may compute on the second GPU of a machine with two kinds: the Sampler's plan reads that one's figures."""
    import importlib

    from vidmem.nodes import sampler as sampler_node
    from vidmem.nodes.strategy import VidMemMemoryStrategy

    seen, steps = [], []

    def choose_for(pipeline, shape, strategy, vram, ram, options, device=None):
        seen.append(options.speed)
        steps.append(options.steps)
        raise _Planned

    torch, loaded = speed_module.torch, tiny_loaded("wan2.1-t2v")
    importlib.import_module("diffusers.models.autoencoders.autoencoder_kl_wan")  # imported with CUDA as it is: it probes it

    monkeypatch.setattr(sampler_node, "choose_for", choose_for)
    # no CUDA here: nothing is asked (a kernel that takes activation chunks, as SDPA does)
    monkeypatch.setattr(sampler_node, "check_before_planning",
                        lambda *args: SimpleNamespace(takes_chunks=True, planned_attention=Attention.FUSED))
    monkeypatch.setattr("vidmem.nodes.strategy.default_budgets", lambda device: (8 << 30, 32 << 30))
    monkeypatch.setattr(sampler_node.host, "compute_device", lambda: torch.device("cuda", 1))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: {1: "Test CPU"}.get(index, "Small GPU"))
    (choice,) = VidMemMemoryStrategy().build(offload="auto", blocks_to_swap=0, prefetch_blocks=1, max_pinned_ram_gb=-1.0,
                                             non_blocking=True, text_encoder="offload_after_encoding", vae_slicing=False,
                                             vae_tiling=False, tile_size=256, overlap=64, temporal_size=64,
                                             temporal_overlap=8)["result"]
    with pytest.raises(_Planned):
        sampler_node.VidMemVideoSampler().sample(loaded, choice, "a cat", "", 32, 32, 9, 4, 1.0, 0,
                                                 speed=Speed(compile=CompileSettings(True)))
    assert seen[0].compiled == MEASURED["compile"]
    assert steps == [4]  # timed at the Sampler's own steps, as `vidmem plan --steps` and the chart time it


def test_vidmem_plan_times_its_rows_with_compile_and_says_what_it_resolves_to(speed_module, capsys):
    """`vidmem plan --compile`: the rows as the chart times them on this machine's device (here the CPU, with the
    test's measurement), and the chart's speed line; without the flag, no speed line and the plain times."""
    import json

    from vidmem.cli import main

    plan = ["plan", "--model", "wan2.1-t2v-1.3b", "--size", "832x480", "--frames", "81", "--vram", "8", "--ram", "64",
            "--device", "cpu", "--steps", "4", "--json"]

    def rows(*flags):
        assert main(plan + list(flags)) == 0
        found = json.loads(capsys.readouterr().out)
        return found, {(row["tier"], row["blocks_to_swap"], row["on_disk"]): row for row in found["strategies"]}

    (eager, eager_rows), (fast, fast_rows) = rows(), rows("--compile")
    assert "speed" not in eager and "compiled blocks x0.70" in fast["speed"]
    sequential, resident = ("sequential", 0, False), ("none", 0, False)
    # sequential does not compile whole blocks: slower against the compiled best than eager is against its own
    assert fast_rows[sequential]["est_slowdown"] > eager_rows[sequential]["est_slowdown"]
    assert fast_rows[resident]["est_slowdown"] == eager_rows[resident]["est_slowdown"]


def test_the_samplers_context_parallel_plan_gets_its_options(tiny_loaded, monkeypatch):
    """Over several ranks the Sampler plans with the same attention and speed options as on one GPU."""
    from vidmem.memory.plan.stages import VideoShape as Shape
    from vidmem.memory.strategy import MemoryStrategy as Strategy, Parallelism
    from vidmem.nodes import sampler as sampler_node
    from vidmem.nodes.strategy import StrategyChoice

    seen = []

    def choose_parallel(pipeline, shape, strategy, ranks, vram, ram, options):
        seen.append(options)
        raise _Planned

    monkeypatch.setattr(sampler_node, "choose_parallel", choose_parallel)
    choice = StrategyChoice(Strategy(parallel=Parallelism(context_parallel="ulysses", degree=2, cpu=True)), auto=True)
    options = PlanOptions(speed=MeasuredSpeed(kernel=0.9))
    with pytest.raises(_Planned):
        sampler_node._strategy_for_run(tiny_loaded("wan2.1-t2v"), choice, Shape(32, 32, 9), torch.device("cpu"),
                                       options)
    assert seen == [options]


def test_the_chart_times_a_lorad_run_with_the_figure_measured_with_a_lora(speed_module, monkeypatch):
    """Load LoRA nodes put hooks beside their layers, traced into the compiled graphs: the chart credits a device's
    figure measured with a LoRA (the blocks' own where none was), and not at all with context parallelism
    (refused)."""
    from dataclasses import replace

    from test_web_route import query
    from vidmem.nodes import plan_route
    from vidmem.nodes.plan_loras import LoraRequest

    request = plan_route.parse_request(query(model="wan", dtype="bf16", speed_attention="auto", speed_compile="true",
                                             speed_compile_mode="default", speed_compile_dynamic="auto",
                                             speed_fp8_matmul="off"), ["wan"], ["bf16"])
    lora = LoraRequest("style.safetensors", 1.0, "both", 1, 1)
    monkeypatch.setattr(speed_module, "_measured", lambda: {"Test CPU": {**MEASURED, "compile_lora": 0.75}})
    assert plan_route._measured_speed(request, "cpu").compiled == 0.7
    assert plan_route._measured_speed(replace(request, loras=(lora,)), "cpu").compiled == 0.75
    assert plan_route._measured_speed(replace(request, loras=(replace(lora, strength=0.0),)), "cpu").compiled == 0.7
    assert plan_route._measured_speed(replace(request, context_parallel="ulysses"), "cpu").compiled == 1.0


def test_the_pair_is_read_from_the_devices_entry_and_quoted_as_a_pair(speed_module, monkeypatch):
    monkeypatch.setattr(speed_module, "_measured", lambda: {"Test CPU": {**MEASURED, "compile_fp8_matmul": 0.65}})
    both = Speed(compile=CompileSettings(True), fp8_matmul="on")
    assert speed_module.measured_speed(both, "cpu") == MeasuredSpeed(
        compiled=0.7, compiled_sequential=1.1, fp8_matmul=1.3, fp8_matmul_on=True, compiled_fp8_matmul=0.65,
        compiled_on=True)
    line = speed_module.measured_line(both, "cpu")
    assert "compiled blocks with fp8 matmul x0.65" in line and "fp8 matmul with eager blocks x1.30" in line


def test_the_speed_line_refuses_fp8_matmul_on_weights_not_stored_in_fp8_and_quotes_no_fp8_figure(speed_module):
    """As the Sampler refuses 'on' (memory/storage/fp8_matmul.py): the plan knows the storage the loader holds."""
    on = Speed(compile=CompileSettings(True), fp8_matmul="on")
    refused = speed_module.speed_plan_line(on, "cpu", speed_module.torch.float32, storage=())
    assert "refused: fp8_matmul='on' cannot run here: the model has no stored (fp8) linear layers" in refused
    assert "fp8 matmul x" not in refused and "with fp8 matmul" not in refused and "compiled blocks x0.70" in refused
    stored = speed_module.speed_plan_line(on, "cpu", speed_module.torch.float32, storage=("fp8_scaled",))
    assert "fp8 matmul on the model's fp8 layers" in stored and "fp8 matmul with eager blocks x1.30" in stored
    auto = speed_module.speed_plan_line(Speed(fp8_matmul="auto"), "cpu", speed_module.torch.float32, storage=())
    assert "fp8 weights upcast: on the CPU auto keeps frames bit-identical" in auto  # auto: the device's reason first, as the Sampler's receipt
    gguf = speed_module.speed_plan_line(on, "cpu", speed_module.torch.float32, storage=("gguf_q4_k",))
    assert "cannot run here: the denoiser's weights are stored as gguf_q4_k, not float8_e4m3fn" in gguf


def test_vidmem_plan_credits_no_compiled_blocks_where_context_parallelism_refuses_them(monkeypatch):
    from vidmem.cli import plan as cli_plan
    from vidmem.pipelines import speed as speed_module

    seen = []
    real = speed_module.measured_speed
    monkeypatch.setattr(speed_module, "measured_speed",
                        lambda *a, **k: seen.append(k.get("context_parallel")) or real(*a, **k))
    args = ["plan", "--model", "wan2.1-t2v-1.3b", "--size", "832x480", "--frames", "81", "--vram", "24", "--ram", "64",
            "--compile", "--json"]
    for extra, split in (([], False), (["--gpus", "2", "--cp", "ulysses"], True), (["--gpus", "2", "--cp", "balanced"], False)):
        seen.clear()
        cli_plan.main([*args, *extra])
        assert seen == [split], extra
