"""bench/activations.py's block part in one process (`--device`): the CPU dry run end to end on a narrow
block, and its CUDA path on the recording CUDA fake, so the script a GPU lease runs (bench/gpu_check.sh)
is checked in CI. What is checked: the JSON's rows, the planner's prediction per chunk count, the
outputs against unchunked, that the allocator's peak is reset before every measured call and read
above where the call started, that times come from CUDA events, and the goals' verdicts from the
figures (never the figures themselves: those are the lease's). `--profile`: each count's time by kind
(the CPU clock here, real CUDA kernel names classified), outside the timed calls, compiled too."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import activations  # noqa: E402  (puts the repository root on the path, for bench.support)
from bench.support import activation_block, activation_profile  # noqa: E402
from bench.support.activation_block import TINY, CudaMeter, measure  # noqa: E402
from cuda_fake import FakeCuda  # noqa: E402

TOKENS = (64, 96)
RUNS = 2


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("activations") / "dry.json"
    activations.main(["--device", "cpu", "--tiny", "--tokens", ",".join(map(str, TOKENS)), "--runs", str(RUNS),
                      "--json", str(path)])
    return json.loads(path.read_text())


def test_the_dry_run_writes_every_chunk_count_at_every_token_count(dry_run):
    found = dry_run["block_cpu"]
    assert found["chunks"] == list(activations.BLOCK_CHUNKS) and found["config"]["dim"] == TINY.dim
    assert set(found["tokens"]) == {str(t) for t in TOKENS}
    for tokens, part in found["tokens"].items():
        rows = part["rows"]
        assert set(rows) == {str(c) for c in activations.BLOCK_CHUNKS}, tokens
        for chunks, row in rows.items():
            assert len(row["times"]) == RUNS and row["seconds"] > 0 and row["time_ratio"] > 0, (tokens, chunks)
            assert row["measured_peak_bytes"] is None and row["peak_error"] is None  # no allocator statistics on the CPU
            assert row["bitwise_equal"] and row["close"] and row["max_abs_diff"] == 0, (tokens, chunks)  # bit identity on the CPU
        # the plan is the engine's chunking traced: more slices, a lower predicted peak
        assert rows["8"]["predicted_peak_bytes"] < rows["2"]["predicted_peak_bytes"] < rows["1"]["predicted_peak_bytes"]
    assert found["goals"]["peak_within_10pct_of_plan"] is None  # judged on CUDA only
    assert found["goals"]["chunking_costs_at_most_5pct_at_480p"] is None


def test_the_cuda_path_resets_the_peak_before_each_measured_call_and_times_with_events(monkeypatch):
    """The CUDA meter on the recording fake (the block computes on the CPU): the measured peak is
    max_memory_allocated minus memory_allocated at the call's start, read after a reset; times are
    CUDA-event intervals (the fake's are 1 ms each); the goals follow from the figures."""
    fake = FakeCuda().install(monkeypatch)
    above = 120_000  # what the fake allocator says each measured call peaked at, above its start
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: fake.device_bytes["allocated"] + above)
    monkeypatch.setattr(activation_block, "COST_GOAL_TOKENS", TOKENS[0])  # the 480p goal, judged at a tiny count
    saved = []
    found = measure(TINY, TOKENS, (4, 2), torch.device("cpu"), "float32", CudaMeter(), runs=RUNS, log=lambda line: None,
                    save=lambda so_far: saved.append(json.loads(json.dumps(so_far))))
    assert found["chunks"] == [1, 2, 4] and found["meter"] == "cuda"  # unchunked first: the reference
    done = [list(s["tokens"]) for s in saved if not any(part.get("partial") for part in s["tokens"].values())]
    assert done == [[str(TOKENS[0])], [str(t) for t in TOKENS]]  # saved whole after each token count
    counts = len(found["chunks"]) * len(TOKENS)
    resets = [i for i, call in enumerate(fake.log) if call == ("reset_peak_memory_stats",)]
    assert len(resets) == counts
    assert all(fake.log[i + 1] == ("memory_allocated",) and fake.log[i - 1] == ("device_sync",) for i in resets)
    assert len(fake.calls("elapsed_time")) == counts * RUNS
    verdicts = []
    for tokens, part in found["tokens"].items():
        for row in part["rows"].values():
            assert row["measured_peak_bytes"] == above and row["seconds"] == pytest.approx(0.001)
            error = above / row["predicted_peak_bytes"] - 1
            assert row["peak_error"] == pytest.approx(error, abs=1e-4)
            assert row["peak_within_10pct"] == (abs(error) <= 0.10)
            verdicts.append(row["peak_within_10pct"])
            applies = tokens == str(TOKENS[0]) and row["chunks"] > 1
            assert row["cost_within_5pct"] == (True if applies else None), (tokens, row["chunks"])
    assert found["goals"]["peak_within_10pct_of_plan"] == all(verdicts)
    assert found["goals"]["chunking_costs_at_most_5pct_at_480p"] is True


def test_bad_options_are_refused_by_name():
    with pytest.raises(SystemExit):
        activations.parse(["--device", "cpu", "--chunks", "2,0"])
    with pytest.raises(SystemExit):
        activations.parse(["--tiny"])  # the dry run's narrow block needs --device
    with pytest.raises(SystemExit):
        activations.parse(["--compile"])  # the CPU RSS part runs eagerly
    args = activations.parse(["--device", "cpu"])
    assert args.tokens == (32760, 75600) and args.dtype == "float32" and args.json.name == "activations-cpu.json"


def test_out_of_memory_at_one_token_count_is_recorded_and_the_next_count_runs():
    class FirstCallRunsOutOfMemory(activation_block.CpuMeter):
        calls = 0

        def peak(self, call):
            self.calls += 1
            if self.calls == 1:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.41 GiB\nmore")
            return super().peak(call)

    found = measure(TINY, TOKENS, (2,), torch.device("cpu"), "float32", FirstCallRunsOutOfMemory(), runs=1,
                    log=lambda line: None)
    assert found["tokens"][str(TOKENS[0])]["error"] == "OutOfMemoryError: CUDA out of memory. Tried to allocate 1.41 GiB"
    assert set(found["tokens"][str(TOKENS[1])]["rows"]) == {"1", "2"}


def test_each_peak_and_each_timed_round_is_saved_as_it_is_measured():
    """A lease's time limit can cut a token count short (a real block compiles for a while): what was measured
    is written by then, marked partial until the count is done."""
    snapshots = []
    measure(TINY, (64,), (2, 4), torch.device("cpu"), "float32", activation_block.CpuMeter(), runs=2,
            log=lambda line: None, save=lambda found: snapshots.append(json.loads(json.dumps(found["tokens"]["64"]))))
    rows = [(sorted(s["rows"]), len(s["rows"]["1"].get("times", [])), s.get("partial", False)) for s in snapshots]
    assert rows == [(["1"], 0, True), (["1", "2"], 0, True), (["1", "2", "4"], 0, True), (["1", "2", "4"], 1, True),
                    (["1", "2", "4"], 2, True), (["1", "2", "4"], 2, False)], rows


def test_compiled_counts_compile_the_block_unchunked_and_its_slice_steps_chunked():
    """`--compile` (aot_eager here for speed; the bench uses inductor): the unchunked count compiles the block's
    forward, a chunked count the slices' steps, each once; outputs stay close to the unchunked reference."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from vidmem.pipelines.compile import CompileSettings

    torch._dynamo.reset()
    counters.clear()
    found = measure(TINY, (64,), (1, 2), torch.device("cpu"), "float32", activation_block.CpuMeter(), runs=1,
                    log=lambda line: None, compiled=CompileSettings(on=True, backend="aot_eager", dynamic=False))
    rows = found["tokens"]["64"]["rows"]
    assert found["compile"] == "default, dynamic false, backend aot_eager" and rows["2"]["close"], found
    assert counters["frames"]["total"] == 3  # WanTransformerBlock.forward, then the two slice steps
    torch._dynamo.reset()


def test_a_compiled_peak_below_the_plan_passes_and_one_far_above_fails():
    """The plan traces the eager forward; compiled code fuses its float32 temporaries, so a compiled peak well under
    the plan is not a planner error. Eager, the goal stays two-sided."""
    def judged(measured, compiled):
        row = {"chunks": 2, "measured_peak_bytes": measured, "predicted_peak_bytes": 100, "times": [1.0]}
        activation_block._finish(row, 1.0, judged=True, cost_applies=False, compiled=compiled)
        return row["peak_within_10pct"]

    assert judged(60, compiled=True) and not judged(60, compiled=False)
    assert judged(105, compiled=True) and not judged(120, compiled=True)


# --- --profile: where a count's time goes ------------------------------------------------------------

@pytest.fixture(scope="module")
def profiled_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("activations") / "profiled.json"
    activations.main(["--device", "cpu", "--tiny", "--tokens", ",".join(map(str, TOKENS)), "--runs", str(RUNS),
                      "--profile", "--json", str(path)])
    return json.loads(path.read_text())


def test_the_profiled_dry_run_breaks_every_count_down_by_kind(profiled_run):
    for tokens, part in profiled_run["block_cpu"]["tokens"].items():
        rows = part["rows"]
        for chunks, row in rows.items():
            found = row["profile"]
            assert found["clock"] == "cpu" and set(found["device_ms_by_kind"]) == set(activation_profile.KINDS)
            by_kind = found["device_ms_by_kind"]
            assert by_kind["gemm"] > 0 and by_kind["attention"] > 0, (tokens, chunks, by_kind)
            assert found["kernels"] > 0 and found["wall_ms"] > 0 and found["top"], (tokens, chunks)
            assert found["busy_ms"] == pytest.approx(sum(by_kind.values()), abs=0.01)
            assert all(len(top["name"]) <= 80 and top["calls"] > 0 for top in found["top"])
            assert len(row["times"]) == RUNS  # the profiled call is not one of the timed ones
        # slicing runs the block's ops once per slice: more launches, the thing the profile is there to show
        assert rows["8"]["profile"]["kernels"] > rows["2"]["profile"]["kernels"] > rows["1"]["profile"]["kernels"]


def test_the_profile_table_prints_each_kind_against_unchunked(profiled_run):
    rows = profiled_run["block_cpu"]["tokens"][str(TOKENS[0])]["rows"]
    lines = activation_profile.cost_table(TOKENS[0], rows)
    assert "cpu clock" in lines[0] and len(lines) == 1 + len(rows)
    base, eight = rows["1"]["profile"]["device_ms_by_kind"], rows["8"]["profile"]["device_ms_by_kind"]
    assert f"gemm {eight['gemm'] - base['gemm']:+.2f} ms" in lines[-1]
    made_up = {"1": {"chunks": 1, "seconds": 0.1, "profile": _profile(gemm=10, attention=5, copy=1, elementwise=2)},
               "2": {"chunks": 2, "seconds": 0.11,
                     "profile": _profile(gemm=11.2, attention=5.8, copy=1.9, elementwise=2)}}
    lines = activation_profile.cost_table(32760, made_up)
    assert lines[2].endswith("gemm +1.20 ms, attention +0.80 ms, copy +0.90 ms, elementwise +0.00 ms")
    assert "110.00 ms timed" in lines[2] and "+" not in lines[1]  # unchunked is the reference, no difference
    assert "suspect" not in lines[2]
    made_up["2"]["profile"]["busy_ms"] = 35.0  # above its 30 ms wall: impossible on one stream
    assert "busy above wall: suspect kernel timestamps" in activation_profile.cost_table(32760, made_up)[2]


def _profile(**by_kind) -> dict:
    return {"clock": "cuda", "device_ms_by_kind": by_kind, "kernels": 10, "wall_ms": 30.0,
            "busy_ms": sum(by_kind.values()), "top": []}


@pytest.mark.parametrize("name, kind", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_segment_k_off_kernel__"
     "5x_cublas", "gemm"),
    ("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NTN", "gemm"),
    ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_64x3_tn", "gemm"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16, true, false>",
     "gemm"),
    ("triton_tem_fused_addmm_0", "gemm"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t, "
     "Flash_kernel_traits<128, 128, 64, 4, cutlass::bfloat16_t> >, false, false, false, false, true, true, false>",
     "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1_kernel0_0", "attention"),
    ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t, "
     "cutlass::arch::Sm80, true, 64, 128, 128, true, true>::Params)", "attention"),
    ("void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::direct_copy_kernel_"
     "cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda(c10::BFloat16)#1}>", "copy"),
    ("Memcpy DtoD (Device -> Device)", "copy"),
    ("Memset (Device)", "copy"),
    ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous namespace)::OpaqueType<2u>, "
     "unsigned int, 3, 128, 1>", "copy"),
    ("void at::native::index_elementwise_kernel<128, 4, at::native::gpu_index_kernel<...> >", "copy"),
    ("triton_poi_fused_add_mul_0", "elementwise"),
    ("triton_poi_fused__to_copy_add_mul_native_layer_norm_1", "elementwise"),
    # inductor names a pointwise kernel after the ops it feeds: the rotary and casts before SDPA are not attention
    ("triton_poi_fused__scaled_dot_product_flash_attention__to_copy_mul_transpose_0", "elementwise"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl(at::TensorIteratorBase&, "
     "at::native::GeluType)::{lambda()#2}::operator()() const", "elementwise"),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float>(int, float, float const*, "
     "float const*, float const*, float*, float*, float*)", "elementwise"),
])
def test_real_cuda_kernel_names_are_classified_by_kind(name, kind):
    assert activation_profile.kind_of(name) == kind


def test_the_cuda_clock_sums_device_kernels_and_not_the_annotations_around_them():
    """What a CUDA profile holds (no GPU here: events as torch.profiler lists them): kernels, copies and memsets on
    the device count; the device-side range of an annotation spans kernels already counted, and host ops run on
    the CPU's clock, so neither does."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def event(name, device_type, micros, annotation=False):
        return SimpleNamespace(name=name, device_type=device_type, device_time_total=micros,
                               is_user_annotation=annotation)

    events = [event("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NTN", DeviceType.CUDA, 1500),
              event("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NTN", DeviceType.CUDA, 500),
              event("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128>>", DeviceType.CUDA, 3000),
              event("Memcpy DtoD (Device -> Device)", DeviceType.CUDA, 250),
              event("triton_poi_fused_add_mul_0", DeviceType.CUDA, 750),
              event("wan block", DeviceType.CUDA, 9000, annotation=True),
              event("aten::mm", DeviceType.CPU, 4000)]
    found = activation_profile.summary(activation_profile._device_kernels(events), activation_profile.KERNEL_KINDS,
                                       "cuda", wall_ms=8.0)
    assert found["device_ms_by_kind"] == {"gemm": 2.0, "attention": 3.0, "copy": 0.25, "elementwise": 0.75}
    assert found["kernels"] == 5 and found["busy_ms"] == 6.0 and found["wall_ms"] == 8.0
    assert found["top"][0] == {"name": "pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128>>", "calls": 1,
                               "ms": 3.0}
    assert found["top"][1] == {"name": "nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NTN", "calls": 2, "ms": 2.0}


@pytest.mark.parametrize("name, kind", [
    ("aten::addmm", "gemm"), ("aten::mm", "gemm"), ("aten::bmm", "gemm"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
    ("aten::_scaled_dot_product_cudnn_attention", "attention"),
    ("aten::copy_", "copy"), ("aten::cat", "copy"), ("aten::index_put_", "copy"), ("aten::slice_scatter", "copy"),
    ("aten::mul", "elementwise"), ("aten::native_layer_norm", "elementwise"), ("aten::gelu", "elementwise"),
])
def test_aten_ops_are_classified_by_kind_on_the_cpu_clock(name, kind):
    assert activation_profile.kind_of(name, activation_profile.OP_KINDS) == kind


def test_profile_needs_device(capsys):
    with pytest.raises(SystemExit):
        activations.parse(["--profile"])
    assert "--profile needs --device" in capsys.readouterr().err
    assert activations.parse(["--device", "cpu", "--profile"]).profile


def test_the_profiled_calls_come_after_every_timed_call_and_peak(monkeypatch):
    """One more call per count, once every token count's timed calls are done (a profiler session can slow the
    launches after it): the meter times and peaks exactly as without --profile."""
    calls = []

    class RecordingMeter(activation_block.CpuMeter):
        def peak(self, call):
            calls.append("peak")
            return super().peak(call)

        def seconds(self, call):
            calls.append("timed")
            return super().seconds(call)

    def profiled(call, device):
        calls.append("profiled")
        return activation_profile.profile_call(call, device)

    monkeypatch.setattr(activation_block, "profile_call", profiled)
    found = measure(TINY, TOKENS, (2, 4), torch.device("cpu"), "float32", RecordingMeter(), runs=RUNS,
                    log=lambda line: None, profile=True)
    counts = len(found["chunks"]) * len(TOKENS)
    assert calls.count("peak") == counts and calls.count("timed") == counts * RUNS
    assert calls[-counts:] == ["profiled"] * counts and calls.count("profiled") == counts
    assert all(row["profile"]["kernels"] > 0 for part in found["tokens"].values() for row in part["rows"].values())


def test_compiled_counts_are_profiled_running_their_compiled_graphs(monkeypatch):
    """--compile --profile: the profiled call runs the graphs the warm-up compiled (a backend that counts the graphs
    it runs: one for the unchunked forward, two steps x two slices chunked), and compiles none of its own."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from vidmem.pipelines.compile import CompileSettings, _backends

    graphs_run = []

    def counting_backend(graph, example_inputs):
        def run(*args):
            graphs_run.append(1)
            return graph(*args)

        return run

    if "vidmem_profile_counting" not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(counting_backend, name="vidmem_profile_counting")
    _backends.cache_clear()  # the list of backends is read once
    profiled = []

    def counted(call, device):
        before = len(graphs_run)
        found = activation_profile.profile_call(call, device)
        profiled.append(len(graphs_run) - before)
        return found

    monkeypatch.setattr(activation_block, "profile_call", counted)
    torch._dynamo.reset()
    counters.clear()
    found = measure(TINY, (64,), (1, 2), torch.device("cpu"), "float32", activation_block.CpuMeter(), runs=1,
                    log=lambda line: None, profile=True,
                    compiled=CompileSettings(on=True, backend="vidmem_profile_counting", dynamic=False))
    assert profiled == [1, 4]
    assert counters["frames"]["total"] == 3  # as unprofiled: the block's forward, then the two slice steps
    for row in found["tokens"]["64"]["rows"].values():
        assert row["profile"]["device_ms_by_kind"]["gemm"] > 0 and row["profile"]["device_ms_by_kind"]["attention"] > 0
    torch._dynamo.reset()


def test_a_compile_that_falls_back_to_eager_stops_the_part_with_its_reason():
    """A failed compile must not be timed as a compiled block (and tried again on every later call): the
    warm-up's fallback stops the bench, naming the failure, before any row is recorded."""
    import torch._dynamo

    from vidmem.pipelines.compile import CompileSettings, _backends

    attempts = []

    def broken(graph, example_inputs):
        attempts.append(1)
        raise RuntimeError("simulated inductor failure")

    if "vidmem_broken" not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(broken, name="vidmem_broken")
    _backends.cache_clear()  # the list of backends is read once
    torch._dynamo.reset()
    saved = []
    with pytest.raises(activation_block.CompileFellBack, match="simulated inductor failure"):
        measure(TINY, (64,), (1, 2), torch.device("cpu"), "float32", activation_block.CpuMeter(), runs=2,
                log=lambda line: None, compiled=CompileSettings(on=True, backend="vidmem_broken", dynamic=False),
                save=saved.append)
    assert len(attempts) == 1 and not saved
    torch._dynamo.reset()
