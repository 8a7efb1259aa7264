"""Compiled blocks (pipelines/compile.py): the latents of eager runs under every tier, nothing compiled
again on a second call, a new hook layout never served code compiled without its hooks, frame
counts under `dynamic`, LoRA with the step cache, compile failures run eagerly and say why, and the
blocks are left exactly as found.

Most tests compile with backend "aot_eager" (dynamo's capture and AOTAutograd's graph, run by
eager kernels: everything vidmem's guards, hooks and fallbacks depend on, and a few seconds per
compile on 2 cores); `test_inductor_compiles_and_reuses_the_block` compiles with inductor's C++
backend. Tolerances: "aot_eager" runs the same aten ops in the same order, so it matches the eager
run to 1e-6; inductor fuses and reorders float32 reductions (norms, softmax, matmul epilogues), so
its last bits differ (measured 2.5e-6 on latents of magnitude 4): 1e-4 relative and absolute. A
LoRA's hook traced into the graph computes its term out of place (matmul, then scale, then add:
three roundings where eager's `addmm_` rounds once), so runs with a LoRA match eager to 1e-5
(measured 3.8e-6). A hook the compiled code skipped (poisoned NaN weights under StrictBackend), a
LoRA it ignored or another strength it kept (differences of order 0.1) fails every bound by orders
of magnitude.
"""

from __future__ import annotations

import dataclasses
import shutil
import weakref

import pytest
import torch
import torch._dynamo

from backends import StrictBackend
from test_lora import peft_keys, random_lora, write
from test_lora_sampling import WAN_TARGETS
from test_tiers import hooks_of, request_for, storage_map
from vidmem.memory import MemoryStrategy
from vidmem.memory.strategy import StrategyError
from vidmem.pipelines.compile import CompileSettings, _backends, compiled_blocks
from vidmem.pipelines.family import denoiser_blocks
from vidmem.pipelines.lora import load_lora, with_lora
from vidmem.pipelines.sample import sample
from vidmem.pipelines.speed import Speed
from vidmem.pipelines.step_cache import StepCache

VARIANT = "wan2.1-t2v"
FAST = CompileSettings(on=True, backend="aot_eager")
TIERS = {
    "none": MemoryStrategy(offload="none"),
    "model": MemoryStrategy(offload="model"),
    "block_swap:1": MemoryStrategy(offload="block_swap", blocks_to_swap=1),
    "block_swap:2": MemoryStrategy(offload="block_swap", blocks_to_swap=2, prefetch_blocks=1),
    "sequential": MemoryStrategy(offload="sequential"),
}
CLOSE = dict(rtol=1e-6, atol=1e-6)
LORA_CLOSE = dict(rtol=1e-5, atol=1e-5)  # a LoRA's traced term rounds three times (the module docstring)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Dynamo's caches are process-wide: every test starts from none, so "first" and "second" call mean it."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def wan(tiny_loaded):
    base = tiny_loaded(VARIANT)
    run(base, TIERS["none"], CompileSettings())  # transformers adds hooks of its own on first use: snapshot after it
    return base


def run(loaded, strategy, settings, request=None):
    """Sample under `settings`; (latents, the compile report's dict, the sample receipt)."""
    request = request or request_for(VARIANT)
    with compiled_blocks(denoiser_blocks(loaded.pipe, loaded.spec), settings) as compiled:
        result = sample(loaded, strategy, request, backend=StrictBackend())
    return result.latent["samples"], compiled.as_dict(), result.receipt


def blocks_of(loaded) -> list[torch.nn.Module]:
    return [b for group in denoiser_blocks(loaded.pipe, loaded.spec).values() for b in group]


def forwards(loaded) -> list:
    """Each block's forward: "class's" (none on the instance, or the class's bound to the block,
    which diffusers' hook registry leaves behind after a step cache), or the instance's object."""
    found = []
    for block in blocks_of(loaded):
        forward = block.__dict__.get("forward")
        bound_here = getattr(forward, "__func__", None) is type(block).forward and forward.__self__ is block
        plain = forward is None or bound_here
        found.append("class's" if plain else forward)
    return found


def assert_left_as_found(loaded, storage, hooks, found) -> None:
    assert forwards(loaded) == found, "a block kept a replaced forward"
    assert storage_map(loaded.pipe) == storage
    assert hooks_of(loaded.pipe) == hooks


@pytest.mark.parametrize("settings, message", [
    (dict(mode="reduce-overhead"), "CUDA graphs"),
    (dict(mode="max-autotune"), "max-autotune-no-cudagraphs"),
    (dict(mode="fast"), "is not one of"),
    (dict(dynamic="sometimes"), "'auto', True or False"),
    (dict(backend="tensorrt-nope"), "not a torch.compile backend"),
    (dict(backend="aot_eager", mode="max-autotune-no-cudagraphs"), "inductor mode"),
    (dict(on="yes"), "True or False"),
])
def test_bad_settings_are_refused_naming_the_input_and_the_fix(settings, message):
    with pytest.raises(StrategyError, match=message):
        CompileSettings(**settings)


def test_node_strings_for_dynamic_become_booleans():
    assert CompileSettings(on=True, dynamic="true").torch_dynamic is True
    assert CompileSettings(on=True, dynamic="False").torch_dynamic is False
    assert CompileSettings(on=True).torch_dynamic is None


def test_off_installs_nothing(wan):
    found = forwards(wan)
    with compiled_blocks(denoiser_blocks(wan.pipe, wan.spec), CompileSettings()) as compiled:
        assert forwards(wan) == found
    assert compiled.as_dict() == {"on": False, "compiled": False, "describe": "off"}


@pytest.mark.parametrize("tier", list(TIERS))
def test_every_tier_matches_eager_and_a_second_call_compiles_nothing(wan, tier):
    strategy = TIERS[tier]
    storage, hooks, found = storage_map(wan.pipe), hooks_of(wan.pipe), forwards(wan)
    eager, _, _ = run(wan, strategy, CompileSettings())
    first, report, _ = run(wan, strategy, FAST)
    assert report["compiled"] and report["frames_compiled"] >= 1 and report["fallback"] is None
    assert report["compile_seconds"] > 0
    torch.testing.assert_close(first, eager, **CLOSE)
    second, report, _ = run(wan, strategy, FAST)
    assert (report["frames_compiled"], report["recompiles"]) == (0, 0), report["recompile_reasons"]
    assert report["compile_seconds"] == 0
    torch.testing.assert_close(second, eager, **CLOSE)
    assert_left_as_found(wan, storage, hooks, found)


def test_a_new_hook_layout_is_compiled_for_never_served_stale_code(wan, tmp_path):
    """Dynamo skips guards on empty hook dicts by default: code compiled under `none` (no hooks
    inside the blocks) would run under sequential without its streaming hooks (NaN weights here)
    and with a LoRA without its layers. Each must compile again, and then be reused."""
    lora = peft_keys(random_lora(wan.pipe.transformer, WAN_TARGETS, seed=1), None)
    styled = with_lora(wan, load_lora(write(tmp_path / "a.safetensors", lora), wan.pipe, 0.8))
    sequence = [(wan, "none"), (wan, "sequential"), (styled, "none"), (wan, "none"), (styled, "sequential"),
                (wan, "sequential")]
    eager = {}
    for loaded, tier in sequence:
        if (id(loaded), tier) not in eager:
            eager[id(loaded), tier] = run(loaded, TIERS[tier], CompileSettings())[0]
    compiled_before = set()
    for loaded, tier in sequence:
        latents, report, _ = run(loaded, TIERS[tier], FAST)
        torch.testing.assert_close(latents, eager[id(loaded), tier], **(LORA_CLOSE if loaded is styled else CLOSE))
        key = (id(loaded), tier)
        if key in compiled_before:
            assert report["frames_compiled"] == 0, f"{key} compiled again: {report['recompile_reasons']}"
        else:
            assert report["frames_compiled"] >= 1, f"{key} ran code compiled for other hooks"
        compiled_before.add(key)
    assert not torch.allclose(eager[id(styled), "none"], eager[id(wan), "none"]), "the LoRA must change the latents"


GRAPH_RUNS: list[int] = []


def counting_backend(graph, example_inputs):
    """A backend that runs dynamo's graphs as they are and counts how many run."""
    def run(*args):
        GRAPH_RUNS.append(1)
        return graph(*args)

    return run


def use_test_backend(function, name: str) -> None:
    if name not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(function, name=name)
    _backends.cache_clear()  # the list of backends is read once


def test_tier_none_after_sequential_runs_its_own_unbroken_graph(wan):
    """Code compiled under sequential (a graph break at every hooked leaf) also passes the guards
    of a run without hooks, and dynamo tries its newest code first: each layout has its own copy."""
    use_test_backend(counting_backend, "vidmem_counting_test")
    settings = CompileSettings(on=True, backend="vidmem_counting_test")
    graphs_run = []
    for tier in ("none", "sequential", "none"):
        GRAPH_RUNS.clear()
        run(wan, TIERS[tier], settings)
        graphs_run.append(len(GRAPH_RUNS))
    block_calls = 2 * 2 * len(blocks_of(wan))  # steps x (cond, uncond) x blocks
    assert graphs_run[0] == block_calls  # one graph per block call
    assert graphs_run[1] > 2 * block_calls  # broken at the hooked leaves
    assert graphs_run[2] == graphs_run[0]


def test_a_traced_lora_compiles_as_many_frames_as_no_lora_and_its_blocks_stay_warm(wan, tmp_path, monkeypatch):
    """The LoRA's buffers carry the same names on every block (numbered per layer) and its strengths are the same
    tensors every call: the first call compiles what a call without a LoRA does (names numbered across the model
    compiled every block again), and a later call of the same graph finds every streamed block where the last left
    it, uploading nothing (a new strength tensor per call kept every LoRA'd block from staying on the device)."""
    from test_tiers import block_count
    from vidmem.pipelines import compile as compiling
    from vidmem.pipelines.hooks import RunHooks
    from vidmem.pipelines.prompt_cache import PromptCache

    lora = peft_keys(random_lora(wan.pipe.transformer, WAN_TARGETS, seed=1), None)
    styled = with_lora(wan, load_lora(write(tmp_path / "style.safetensors", lora), wan.pipe, 0.8))
    request = request_for(VARIANT)
    frames = {}
    for name, loaded in (("no LoRA", wan), ("LoRA", styled)):
        monkeypatch.setattr(compiling, "_COMPILED", weakref.WeakKeyDictionary())
        torch._dynamo.reset()
        frames[name] = run_speed_node(loaded, TIERS["none"], FAST, request)[1]["frames_compiled"]
    assert frames["LoRA"] == frames["no LoRA"], frames
    strategy = MemoryStrategy(offload="block_swap", blocks_to_swap=block_count(styled), prefetch_blocks=0)
    hooks = RunHooks(device_budget=lambda device: 1 << 40, prompt_cache=PromptCache(tmp_path / "prompts"))
    speed_request = dataclasses.replace(request, speed=Speed("auto", FAST))
    backend = StrictBackend()  # the warm store is the backend's device's
    warm = [sample(styled, strategy, speed_request, hooks=hooks, backend=backend).receipt["warm"] for _ in range(3)]
    assert [(w["streamed_bytes"], w["uploaded_bytes"]) for w in warm[1:]] == [(0, 0), (0, 0)], warm


@pytest.mark.parametrize("route", ["speed node", "compiled_blocks"])
def test_another_lora_in_the_same_layout_uses_its_own_tensors(wan, tmp_path, route):
    """Same hooks, other LoRA (other tensors and strength): the compiled code is reused, and it computes
    this call's LoRA, not the one it was compiled with. Through the Speed node the hooks are traced (the
    strength a tensor the graph reads); around sample() without it, each is a graph break run eagerly."""
    def styled(seed, strength):
        lora = peft_keys(random_lora(wan.pipe.transformer, WAN_TARGETS, seed=seed), None)
        return with_lora(wan, load_lora(write(tmp_path / f"{seed}.safetensors", lora), wan.pipe, strength))

    first, second = styled(1, 0.8), styled(2, 0.3)
    strategy = TIERS["block_swap:2"]
    compiled = (lambda loaded: run_speed_node(loaded, strategy, FAST, request_for(VARIANT))) if route == "speed node" \
        else (lambda loaded: run(loaded, strategy, FAST))
    compiled(first)
    latents, report, _ = compiled(second)
    assert report["frames_compiled"] == 0
    torch.testing.assert_close(latents, run(second, strategy, CompileSettings())[0],
                               **(LORA_CLOSE if route == "speed node" else CLOSE))
    assert not torch.allclose(latents, run(first, strategy, CompileSettings())[0])


@pytest.mark.parametrize("tier", ["none", "block_swap:2", "sequential"])
def test_a_lora_is_traced_into_the_compiled_blocks(wan, tmp_path, tier):
    """Through the Speed node, a LoRA's hooks beside its layers do not break the block's graph where the
    weights do not stream inside it (each break made compiled blocks slower than eager ones with a LoRA),
    and the traced term is the LoRA's: the latents move with it as eagerly; a second call compiles nothing."""
    lora = peft_keys(random_lora(wan.pipe.transformer, WAN_TARGETS, seed=1), None)
    styled = with_lora(wan, load_lora(write(tmp_path / "style.safetensors", lora), wan.pipe, 0.8))
    request = request_for(VARIANT)
    eager = run(styled, TIERS[tier], CompileSettings())[0]
    for call in range(2):
        latents, report, receipt = run_speed_node(styled, TIERS[tier], FAST, request)
        torch.testing.assert_close(latents, eager, **LORA_CLOSE)
        assert report["compiled"] and report["fallback"] is None, report
        if call == 0 and tier != "sequential":  # sequential's streaming hooks break the graphs at every leaf
            assert report["graph_breaks"] == 0, report
    assert report["frames_compiled"] == 0, report["recompile_reasons"]
    # and one float32 strength, shared by the blocks' layers (proj_out, outside the blocks, keeps the eager hook)
    assert receipt["lora_bytes"] == styled.loras[0].nbytes + 4
    assert not torch.allclose(eager, run(wan, TIERS[tier], CompileSettings())[0], atol=1e-3)


@pytest.mark.parametrize("dynamic, recompiles_at_second_count", [(True, 0), ("auto", 1)])
def test_frame_counts(wan, dynamic, recompiles_at_second_count):
    """dynamic=True: any frame count after the first compiles nothing; "auto": the second distinct
    count recompiles once (with symbolic sizes), later counts compile nothing."""
    settings = CompileSettings(on=True, backend="aot_eager", dynamic=dynamic)
    strategy = TIERS["block_swap:1"]
    for index, frames in enumerate((9, 13, 17, 5)):
        request = dataclasses.replace(request_for(VARIANT), frames=frames)
        latents, report, _ = run(wan, strategy, settings, request)
        torch.testing.assert_close(latents, run(wan, strategy, CompileSettings(), request)[0], **CLOSE)
        if index == 1:
            assert report["recompiles"] == recompiles_at_second_count, report["recompile_reasons"]
        elif index > 1:
            assert report["frames_compiled"] == 0, report["recompile_reasons"]


def test_lora_and_step_cache_together(wan, tmp_path):
    lora = peft_keys(random_lora(wan.pipe.transformer, WAN_TARGETS, seed=1), None)
    styled = with_lora(wan, load_lora(write(tmp_path / "style.safetensors", lora), wan.pipe, 0.8))
    cache = StepCache("first_block_cache", threshold=0.9, retention=0.0)  # bold: skips on random weights
    request = dataclasses.replace(request_for(VARIANT, steps=4), cache=cache)
    storage, hooks, found = storage_map(wan.pipe), hooks_of(wan.pipe), forwards(wan)
    for tier in ("block_swap:2", "sequential"):
        eager, _, eager_receipt = run(styled, TIERS[tier], CompileSettings(), request)
        assert eager_receipt["cache"]["blocks_skipped"] > 0
        for _ in range(2):
            latents, report, receipt = run_speed_node(styled, TIERS[tier], FAST, request)  # the hooks traced
            torch.testing.assert_close(latents, eager, **LORA_CLOSE)
            assert receipt["cache"]["blocks_skipped"] == eager_receipt["cache"]["blocks_skipped"]
        assert report["frames_compiled"] == 0
    assert_left_as_found(wan, storage, hooks, found)


def failing_backend(graph, example_inputs):
    raise RuntimeError("no kernels for this machine")


def test_a_compile_failure_runs_eagerly_and_says_why(wan, monkeypatch):
    use_test_backend(failing_backend, "vidmem_failing_test")
    storage, hooks, found = storage_map(wan.pipe), hooks_of(wan.pipe), forwards(wan)
    eager, _, _ = run(wan, TIERS["block_swap:1"], CompileSettings())
    latents, report, _ = run(wan, TIERS["block_swap:1"], CompileSettings(on=True, backend="vidmem_failing_test"))
    assert not report["compiled"]
    assert "torch.compile failed on WanTransformerBlock" in report["fallback"]
    assert "no kernels for this machine" in report["fallback"]
    assert torch.equal(latents, eager)
    assert_left_as_found(wan, storage, hooks, found)


def test_a_failure_after_compiled_calls_says_they_ran_compiled(monkeypatch):
    """Calls that ran compiled before a failure are not reported as eager (inductor's kernels differ from
    eager's in the last bits on a GPU)."""
    import torch._dynamo.exc

    from vidmem.pipelines import compile as compile_module

    calls = []

    def compiled(block, x):
        calls.append(x)
        if len(calls) > 2:
            raise torch._dynamo.exc.TorchRuntimeError("no kernels for this shape")
        return x + 1

    monkeypatch.setattr(compile_module, "compiled_function", lambda *a, **k: compiled)
    settings = CompileSettings(on=True)
    report = compile_module.CompileReport(settings, blocks=1)
    runner = compile_module._Runner(settings, report)
    block = torch.nn.Linear(2, 2)
    outputs = [runner.run(lambda b, x: x - 1, block, torch.zeros(1)) for _ in range(4)]
    assert [float(o) for o in outputs] == [1.0, 1.0, -1.0, -1.0]  # two compiled, then eager for the rest
    assert "ran 2 compiled calls before it, the rest eagerly" in report.fallback
    assert "with the same results" not in report.fallback


def test_torch_compile_refusing_runs_eagerly_and_says_why(wan, monkeypatch):
    def refuse(*args, **kwargs):
        raise RuntimeError("this build has no compiler")

    monkeypatch.setattr(torch, "compile", refuse)
    monkeypatch.setattr("vidmem.pipelines.compile._COMPILED", weakref.WeakKeyDictionary())  # nothing made yet
    eager, _, _ = run(wan, TIERS["none"], CompileSettings())
    latents, report, _ = run(wan, TIERS["none"], FAST)
    assert "this build has no compiler" in report["fallback"]
    assert torch.equal(latents, eager)


def test_an_error_of_the_block_itself_is_raised_and_the_blocks_restored(wan):
    """Only compile failures fall back: an error while the block computes (here a leaf's hook, as a
    failed copy would) reaches the caller, and every forward is restored."""
    storage, hooks, found = storage_map(wan.pipe), hooks_of(wan.pipe), forwards(wan)
    leaf = blocks_of(wan)[1].ffn.net[2]

    @torch.compiler.disable
    def broken(module, args):
        raise ValueError("copy failed")

    handle = leaf.register_forward_pre_hook(broken)
    try:
        with pytest.raises(ValueError, match="copy failed"):
            run(wan, TIERS["none"], FAST)
    finally:
        handle.remove()
    assert_left_as_found(wan, storage, hooks, found)


def test_a_forward_replaced_before_entering_is_refused_and_nothing_installed(wan):
    first, second = blocks_of(wan)[:2]
    found, saved = first.__dict__.get("forward"), second.__dict__.get("forward")
    second.forward = lambda *args, **kwargs: None  # another wrapper, still in place
    try:
        with pytest.raises(StrategyError, match="apply compiled_blocks first"):
            with compiled_blocks(denoiser_blocks(wan.pipe, wan.spec), FAST):
                pass
        assert first.__dict__.get("forward") is found
    finally:
        if saved is None:
            del second.forward
        else:
            second.forward = saved


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="inductor's CPU backend needs a C++ compiler")
def test_inductor_compiles_and_reuses_the_block(wan):
    settings = CompileSettings(on=True)  # inductor, mode default, dynamic auto
    strategy = TIERS["block_swap:2"]
    eager, _, _ = run(wan, strategy, CompileSettings())
    for call in range(2):
        latents, report, _ = run(wan, strategy, settings)
        torch.testing.assert_close(latents, eager, rtol=1e-4, atol=1e-4)
        assert report["compiled"], report["fallback"]
    assert (report["frames_compiled"], report["recompiles"]) == (0, 0)


@pytest.mark.parametrize("fmt", ["fp8_e4m3fn", "fp8_scaled", "gguf_q8_0", "gguf_q4_k"])
def test_stored_linear_compiles_and_a_pointer_swap_does_not_recompile(fmt):
    """StoredLinear's dequantize traces into the graph (or breaks it cleanly); re-pointing its
    buffers to new storage, as the streaming tiers do between steps, compiles nothing again."""
    from vidmem.memory.storage import StoredLinear, quantize

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            generator = torch.Generator().manual_seed(0)
            weights = [torch.randn(256, 256, generator=generator) / 16 for _ in range(2)]
            self.a, self.b = (StoredLinear(quantize(w, fmt), torch.zeros(256), torch.float32) for w in weights)

        def forward(self, x):
            return self.b(torch.nn.functional.gelu(self.a(x)))

    block, x = Block(), torch.randn(4, 256)
    eager = block(x)
    with compiled_blocks({"blocks": [block]}, FAST) as compiled:
        torch.testing.assert_close(block(x), eager, **CLOSE)
    assert compiled.as_dict()["fallback"] is None
    for layer in (block.a, block.b):  # a pointer swap: same values, new storage
        layer._buffers["weight_stored"] = layer.weight_stored.clone()
    with compiled_blocks({"blocks": [block]}, FAST) as compiled:
        torch.testing.assert_close(block(x), eager, **CLOSE)
    assert compiled.as_dict()["frames_compiled"] == 0, compiled.as_dict()["recompile_reasons"]


def test_the_bench_part_gives_the_issues_keys_per_tier():
    """bench/support/speed_compile.py at 2 blocks and 2 steps, with aot_eager (untimed: no timed assertion)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench.support
    from bench.support.speed_compile import compile_rows
    from bench.support.speed_runs import SpeedConfig, build, tiers

    config = SpeedConfig(steps=2, blocks=2, runs=1)
    rows = compile_rows(build(config), config, FAST, log=lambda line: None)
    for key in ("step_time_ratio", "recompiles_second_run", "compile_seconds"):
        assert set(rows[key]) == set(tiers(config.blocks)), key
    assert set(rows["recompiles_second_run"].values()) == {0}
    assert all(seconds > 0 for seconds in rows["compile_seconds"].values())
    assert all(ratio > 0 for ratio in rows["step_time_ratio"].values())
    assert max(rows["max_abs_diff"].values()) < 1e-6 and not any(rows["fallback"].values())
    assert rows["graph_breaks"]["sequential"] > 0 and rows["graph_breaks"]["none"] == 0


@pytest.mark.parametrize("storage", ["fp32", "fp8_scaled", "gguf_q8_0"])
def test_the_disk_tier_with_stored_weights_compiles_once(storage, tmp_path):
    """Weights used in place from mapped files (fp32) or kept stored (fp8 scaled, GGUF: StoredLinear,
    dequantized inside the graph), streamed by block swap: eager's latents, and nothing compiled
    again on a second call."""
    from vidmem.pipelines.comfy_files import LoadOptions, load_model_files
    from vidmem.pipelines.tiny_files import save_tiny_comfy_files, tiny_catalogue

    files = save_tiny_comfy_files(VARIANT, tmp_path, storage, "original")
    loaded = load_model_files(files.files, LoadOptions(dtype="fp32", weights_on_disk=True), tiny_catalogue())
    assert loaded.on_disk
    strategy = TIERS["block_swap:2"]
    eager, _, _ = run(loaded, strategy, CompileSettings())
    for call in range(2):
        latents, report, _ = run(loaded, strategy, FAST)
        torch.testing.assert_close(latents, eager, **CLOSE)
    assert (report["frames_compiled"], report["fallback"]) == (0, None)


@pytest.mark.parametrize("storage", ["fp8_scaled", "gguf_q8_0"])
def test_a_lora_on_stored_weights_is_traced_too(storage, tmp_path):
    """A LoRA beside layers that dequantize inside the graph (StoredLinear, used in place from disk): traced with
    them, no graph break under block swap, eager's latents, nothing compiled again at another strength."""
    from vidmem.pipelines.comfy_files import LoadOptions, load_model_files
    from vidmem.pipelines.tiny_files import save_tiny_comfy_files, tiny_catalogue

    files = save_tiny_comfy_files(VARIANT, tmp_path, storage, "original")
    loaded = load_model_files(files.files, LoadOptions(dtype="fp32", weights_on_disk=True), tiny_catalogue())
    lora = write(tmp_path / "style.safetensors", peft_keys(random_lora(loaded.pipe.transformer, WAN_TARGETS), None))
    strategy, request = TIERS["block_swap:2"], request_for(VARIANT)
    for call, strength in enumerate((0.8, 0.3)):
        styled = with_lora(loaded, load_lora(lora, loaded.pipe, strength))
        eager = run(styled, strategy, CompileSettings())[0]
        latents, report, _ = run_speed_node(styled, strategy, FAST, request)
        torch.testing.assert_close(latents, eager, **LORA_CLOSE)
        assert report["graph_breaks"] == 0 if call == 0 else report["frames_compiled"] == 0, report


@pytest.mark.parametrize("tier", ["none", "sequential"])
def test_cogvideox_blocks_compile_too(tiny_loaded, tier):
    loaded = tiny_loaded("cogvideox-t2v")
    request = request_for("cogvideox-t2v")
    eager, _, _ = run(loaded, TIERS[tier], CompileSettings(), request)
    for call in range(2):
        latents, report, _ = run(loaded, TIERS[tier], FAST, request)
        torch.testing.assert_close(latents, eager, **CLOSE)
    assert report["frames_compiled"] == 0


@pytest.mark.parametrize("kernel", ["math", "flex"])
def test_cogvideox_with_a_kernel_set_around_its_attention_compiles_nothing_on_the_second_call(tiny_loaded, kernel):
    """CogVideoX calls SDPA itself, so its kernel is set around each attention module's forward; dynamo guards the
    compiled block on that forward by identity, and a new wrapper per call recompiled every call (review)."""
    from vidmem.pipelines.speed import Speed

    loaded = tiny_loaded("cogvideox-t2v")
    attention = [m for m in loaded.pipe.transformer.modules() if getattr(m, "processor", None) is not None]
    request = request_for("cogvideox-t2v")
    eager = sample(loaded, TIERS["none"], dataclasses.replace(request, speed=Speed(kernel)), backend=StrictBackend())
    for call in range(2):
        result = sample(loaded, TIERS["none"], dataclasses.replace(request, speed=Speed(kernel, FAST)),
                        backend=StrictBackend())
        report = result.receipt["speed"]["compile"]
        torch.testing.assert_close(result.latent["samples"], eager.latent["samples"], **CLOSE)
        assert all("forward" not in m.__dict__ for m in attention)  # the kernel's wrapper is off between calls
    assert (report["frames_compiled"], report["recompiles"]) == (0, 0), report["recompile_reasons"]
    assert result.receipt["speed"]["attention"].get("calls_rerouted") == \
        eager.receipt["speed"]["attention"].get("calls_rerouted")  # each call counts its own (flex), not the total


class TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def oom_backend(graph, example_inputs):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (autotuning)")


def test_out_of_memory_is_raised_for_the_ladder_not_taken_for_a_compile_failure():
    """While the block runs (a streamed leaf's copy failing) and while compiling (inductor's autotuning
    allocating): the OOM ladder climbs on these, so they must reach it."""
    block, x = TwoLayers(), torch.randn(2, 8)

    @torch.compiler.disable
    def copy_fails(module, args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")

    handle = block.b.register_forward_pre_hook(copy_fails)
    try:
        with pytest.raises(torch.OutOfMemoryError), compiled_blocks({"blocks": [block]}, FAST):
            block(x)
    finally:
        handle.remove()
    use_test_backend(oom_backend, "vidmem_oom_test")
    settings = CompileSettings(on=True, backend="vidmem_oom_test")
    with pytest.raises(Exception) as raised, compiled_blocks({"blocks": [block]}, settings):
        block(x)
    assert "out of memory" in str(raised.value).lower() or isinstance(raised.value.__cause__, torch.OutOfMemoryError)
    assert "forward" not in block.__dict__


@pytest.mark.parametrize("variant", ["wan2.1-t2v", "cogvideox-t2v"])
def test_sdpa_rerouted_to_sageattention_compiles_one_graph_for_every_block_without_breaks(tiny_loaded, monkeypatch,
                                                                                          variant):
    """The sage 1.x route scopes each attention module's forward (a TorchFunctionMode rerouting SDPA). Two H200
    findings (2026-11-28, 4 Wan blocks): each compiled block broke its graph at every attention (the mode handed
    Wan's `Tensor.unflatten` to torch's Python wrapper, whose `super()` dynamo cannot trace), and each block compiled
    its own graph (dynamo guarded on a per-module forward object), so a 30- or 40-block model compiled 30 to 40
    graphs instead of one (eagerly only past vidmem's recompile limit of 64); on torch 2.9 (ComfyUI's) the same
    again through the module's own forward, a bound method per module that 2.9 guards by id. Now: the frames plain SDPA compiles, no break, nothing again on the
    second call, and the compiled blocks' latents those of the eager route (the stand-in sageattn attends with another
    scale, so that a compiled block that bypassed the route would give plain SDPA's latents instead)."""
    import sys

    import torch.nn.functional as F

    from test_attention import SAGE1_RESOLVED, fake_sageattention, head_widths, run as run_attention

    loaded = tiny_loaded(variant)
    fake_sageattention(monkeypatch, widths=head_widths(loaded))
    # a sageattn with no Python side effect (the test fake's call list would be guarded on, and recompile, itself)
    # and a result of its own: softmax at a tenth of the scale
    monkeypatch.setattr(sys.modules["sageattention"], "sageattn",
                        lambda q, k, v, tensor_layout="HND", is_causal=False, sm_scale=None, smooth_k=True:
                        F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=0.1 / q.size(-1) ** 0.5))
    blocks = denoiser_blocks(loaded.pipe, loaded.spec)
    eager = run_attention(loaded, variant, SAGE1_RESOLVED)[0].latent["samples"]
    reports, latents = {}, {}
    for name, resolved in (("sdpa", None), ("sage", SAGE1_RESOLVED)):
        torch._dynamo.reset()
        for call in range(2):
            with compiled_blocks(blocks, FAST) as compiled:
                result, _ = run_attention(loaded, variant, resolved)
            reports[name, call], latents[name] = compiled.as_dict(), result.latent["samples"]
    assert sum(len(group) for group in blocks.values()) >= (2 if variant == "wan2.1-t2v" else 1)
    assert reports["sage", 0]["graph_breaks"] == 0
    assert reports["sage", 0]["frames_compiled"] == reports["sdpa", 0]["frames_compiled"], reports["sage", 0]
    assert reports["sage", 1]["frames_compiled"] == 0, reports["sage", 1]
    torch.testing.assert_close(latents["sage"], eager, **CLOSE)
    assert (latents["sage"] - latents["sdpa"]).abs().max() > 1e-3  # the route ran inside the compiled blocks


# --- compiled blocks with activation chunks (pipelines/activation_chunks.py) ---------------------------------------

def run_speed_node(loaded, strategy, settings, request):
    """Sample through the Speed node's route (chunks are applied inside sample(), before compiled blocks);
    (latents, the compile receipt, the sample receipt)."""
    from vidmem.pipelines.speed import Speed

    result = sample(loaded, strategy, dataclasses.replace(request, speed=Speed("auto", settings)),
                    backend=StrictBackend())
    return result.latent["samples"], result.receipt["speed"]["compile"], result.receipt


def compiled_steps() -> set[str]:
    """The activation-chunk steps that have a compiled twin now."""
    from vidmem.pipelines import compile as compiling

    return {getattr(function, "__name__", "") for function in compiling._COMPILED} & STEPS


STEPS = {"_wan_slice_projections", "_wan_slice_rest", "_cogvideox_attention_half", "_cogvideox_feed_forward",
         "_hunyuan_video15_slice_projections", "_hunyuan_video15_text_projections", "_hunyuan_video15_slice_rest",
         "_hunyuan_video15_text_rest"}


@pytest.mark.parametrize("tier", ["none", "block_swap:2", "sequential"])
def test_activation_chunks_compile_their_slice_steps_once_for_every_block(wan, tier, monkeypatch):
    """Chunked, a block runs the chunked forward, never its class's: the slices' steps are what compiles. One
    graph per step serves every block and every slice (the tiny Wan's two blocks, three slices), a second call
    compiles nothing, and the latents are the eager chunked run's (itself the unchunked run's bit for bit)."""
    from vidmem.pipelines import compile as compiling

    monkeypatch.setattr(compiling, "_COMPILED", weakref.WeakKeyDictionary())
    strategy = dataclasses.replace(TIERS[tier], activation_chunks=3)
    storage, hooks, found = storage_map(wan.pipe), hooks_of(wan.pipe), forwards(wan)
    request = request_for(VARIANT)
    eager, _, eager_receipt = run_speed_node(wan, strategy, CompileSettings(), request)
    plain, _, _ = run_speed_node(wan, TIERS[tier], CompileSettings(), request)
    assert torch.equal(eager, plain) and eager_receipt["activation_chunks"]["chunks"] == 3
    first, report, receipt = run_speed_node(wan, strategy, FAST, request)
    assert report["compiled"] and report["fallback"] is None and report["frames_compiled"] >= 2, report
    assert compiled_steps() == {"_wan_slice_projections", "_wan_slice_rest"}
    if tier != "sequential":  # sequential's streaming hooks break the graphs at every leaf, by design
        assert report["graph_breaks"] == 0, report
        assert report["frames_compiled"] == 2, report  # one graph per step, whatever the blocks and slices
    torch.testing.assert_close(first, eager, **CLOSE)
    assert receipt["activation_chunks"]["slices"] == [3]
    second, report, _ = run_speed_node(wan, strategy, FAST, request)
    assert (report["frames_compiled"], report["recompiles"]) == (0, 0), report["recompile_reasons"]
    torch.testing.assert_close(second, eager, **CLOSE)
    assert_left_as_found(wan, storage, hooks, found)
    assert not chunk_hooks_left(wan)


def chunk_hooks_left(loaded) -> list:
    from vidmem.pipelines.activation_chunks import CHUNK_HOOK

    registries = [getattr(block, "_diffusers_hook", None) for block in blocks_of(loaded)]
    return [r.get_hook(CHUNK_HOOK) for r in registries if r is not None and r.get_hook(CHUNK_HOOK) is not None]


def test_activation_chunks_compiled_with_a_lora_and_the_step_cache(wan, tmp_path):
    lora = peft_keys(random_lora(wan.pipe.transformer, WAN_TARGETS, seed=1), None)
    styled = with_lora(wan, load_lora(write(tmp_path / "style.safetensors", lora), wan.pipe, 0.8))
    cache = StepCache("first_block_cache", threshold=0.9, retention=0.0)  # bold: skips on random weights
    request = dataclasses.replace(request_for(VARIANT, steps=4), cache=cache)
    strategy = dataclasses.replace(TIERS["block_swap:2"], activation_chunks=2)
    eager, _, eager_receipt = run_speed_node(styled, strategy, CompileSettings(), request)
    assert eager_receipt["cache"]["blocks_skipped"] > 0
    for _ in range(2):
        latents, report, receipt = run_speed_node(styled, strategy, FAST, request)
        torch.testing.assert_close(latents, eager, **LORA_CLOSE)
        assert receipt["cache"]["blocks_skipped"] == eager_receipt["cache"]["blocks_skipped"]
        assert report["compiled"], report
    assert report["frames_compiled"] == 0


HUNYUAN_STEPS = {"_hunyuan_video15_slice_projections", "_hunyuan_video15_text_projections",
                 "_hunyuan_video15_slice_rest", "_hunyuan_video15_text_rest"}


@pytest.mark.parametrize("variant, steps, tier", [
    ("cogvideox-t2v", {"_cogvideox_attention_half", "_cogvideox_feed_forward"}, "none"),
    ("hunyuanvideo1.5-t2v", HUNYUAN_STEPS, "none"), ("hunyuanvideo1.5-t2v", HUNYUAN_STEPS, "block_swap:2"),
    ("hunyuanvideo1.5-t2v", HUNYUAN_STEPS, "sequential")])
def test_joint_attention_activation_chunks_compile_too(tiny_loaded, variant, steps, tier, monkeypatch):
    """HunyuanVideo 1.5's four steps (video slices' projections and the rest of the block, the text's) compile
    once each on every tier, with no graph break where the weights do not stream, and a second call compiles
    nothing."""
    from vidmem.pipelines import compile as compiling

    monkeypatch.setattr(compiling, "_COMPILED", weakref.WeakKeyDictionary())  # only this test's compiled steps
    loaded = tiny_loaded(variant)
    request = request_for(variant)
    strategy = dataclasses.replace(TIERS[tier], activation_chunks=2)
    eager, _, _ = run_speed_node(loaded, strategy, CompileSettings(), request)
    for call in range(2):
        latents, report, _ = run_speed_node(loaded, strategy, FAST, request)
        torch.testing.assert_close(latents, eager, **CLOSE)
        assert report["compiled"] and report["fallback"] is None, report
        if call == 0 and tier != "sequential":  # sequential's streaming hooks break the graphs at every leaf
            assert report["graph_breaks"] == 0, report
    assert report["frames_compiled"] == 0
    assert steps <= compiled_steps()


def test_inductor_compiles_and_reuses_the_chunk_steps(wan):
    """What a GPU runs: inductor's code for the slices' steps (here its C++ backend), reused by the second call."""
    strategy = dataclasses.replace(TIERS["block_swap:2"], activation_chunks=2)
    request = request_for(VARIANT)
    eager, _, _ = run_speed_node(wan, strategy, CompileSettings(), request)
    for call in range(2):
        latents, report, _ = run_speed_node(wan, strategy, CompileSettings(on=True), request)
        torch.testing.assert_close(latents, eager, rtol=1e-4, atol=1e-4)
        assert report["compiled"], report["fallback"]
    assert (report["frames_compiled"], report["recompiles"]) == (0, 0)


def test_a_compile_failure_in_a_chunk_step_runs_the_rest_eagerly_and_says_why(wan):
    use_test_backend(failing_backend, "vidmem_failing_test")
    strategy = dataclasses.replace(TIERS["none"], activation_chunks=2)
    request = request_for(VARIANT)
    eager, _, _ = run_speed_node(wan, strategy, CompileSettings(), request)
    latents, report, _ = run_speed_node(wan, strategy, CompileSettings(on=True, backend="vidmem_failing_test"), request)
    assert torch.equal(latents, eager)
    assert not report["compiled"] and "no kernels for this machine" in report["fallback"], report
