"""Attention kernel choice (pipelines/attention.py): resolution per device and dtype (a GPU faked by
its compute capability), refusals that name the input and the fix, restoration after errors, and on
the CPU the tiny Wan and CogVideoX pipelines sampled under each kernel that runs here: the exact
ones that are SDPA's own choice give the default latents bit for bit, and each choice is seen to
take effect (the dispatcher's backend, the SDPA backend forced, or the SDPA call rerouted)."""

from __future__ import annotations

import importlib.machinery
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from test_tiers import request_for
from vidmem.memory import MemoryStrategy
from vidmem.memory.strategy import StrategyError
from vidmem.pipelines import attention
from vidmem.pipelines.attention import (SAGE1, AttentionError, AttentionKernel, ResolvedAttention, attention_for_call,
                                        resolve_attention)
from vidmem.pipelines.family import denoiser_blocks
from vidmem.pipelines.sample import RunHooks, sample

CPU = torch.device("cpu")
CUDA = torch.device("cuda", 0)
FAMILIES = ["wan2.1-t2v", "cogvideox-t2v"]


@pytest.fixture
def gpu(monkeypatch):
    """A CUDA GPU of a chosen compute capability, with torch's flash kernels built in."""

    def make(capability=(9, 0)):
        monkeypatch.setattr(attention, "_capability", lambda device: capability)
        monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
        monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)

    return make


def installed(monkeypatch, sage: str | None = None, triton: bool = True) -> None:
    monkeypatch.setattr(attention, "_installed_version", lambda name: sage if name == "sageattention" else None)
    real = attention._has_module
    monkeypatch.setattr(attention, "_has_module", lambda name: triton if name == "triton" else real(name))


# --- resolution -----------------------------------------------------------------------------------------


def test_auto_on_the_cpu_is_plain_sdpa_for_every_dtype():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        resolved = resolve_attention("auto", "cpu", dtype)
        assert resolved.kernel is AttentionKernel.SDPA and resolved.backend == "native"
        assert resolved.requested is AttentionKernel.AUTO and not resolved.fallback
        assert "identical to plain diffusers" in resolved.why


@pytest.mark.parametrize("kernel", ["sdpa", "flash", "math", "flex"])
def test_kernels_that_run_on_the_cpu_resolve_to_themselves(kernel):
    resolved = resolve_attention(kernel, CPU, torch.float32)
    assert resolved.kernel.value == kernel and resolved.requested.value == kernel
    assert resolved.as_dict()["kernel"] == kernel and resolved.why


@pytest.mark.parametrize("kernel", ["efficient", "cudnn", "sage"])
def test_cuda_only_kernels_are_refused_on_the_cpu_with_the_alternatives(kernel):
    with pytest.raises(AttentionError, match=rf"attention='{kernel}' cannot run here: it needs a CUDA GPU .* "
                                             r"choose 'auto', 'sdpa' or 'math'"):
        resolve_attention(kernel, CPU, torch.float32)


def test_an_unknown_kernel_or_dtype_is_refused_by_name():
    with pytest.raises(AttentionError, match=r"attention='fast' is not one of 'auto', 'sdpa', 'flash'"):
        resolve_attention("fast", CPU, torch.float32)
    for dtype in (torch.int8, torch.float8_e4m3fn, "fp8"):  # fp8 is a storage format, never a compute dtype
        with pytest.raises(AttentionError, match="attention dtype=.* must be the model's compute dtype: one of bf16"):
            resolve_attention("auto", CPU, dtype)
    assert resolve_attention("auto", CPU, "bf16").dtype == "bfloat16"  # loaded.dtype_name
    assert issubclass(AttentionError, StrategyError)  # the nodes report it as any other bad strategy input


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_auto_on_a_gpu_leaves_sdpa_to_choose_and_cites_the_measurement(gpu, dtype):
    """SDPA's own pick beat every kernel forced through the dispatcher on an H100 at Wan's real size
    (bench/results/speed-attention-call-gpu-h100-2026-11-27.json)."""
    gpu((9, 0))
    resolved = resolve_attention("auto", CUDA, dtype)
    assert (resolved.kernel, resolved.backend, resolved.fallback) == (AttentionKernel.SDPA, "native", "")
    assert "sm90" in resolved.why and "11.3 ms" in resolved.why and resolved.sdpa_backend is None


def resolved_by_the_run(kernel: str, dtype=torch.bfloat16) -> ResolvedAttention:
    """The attention a run resolves (pipelines/speed.py resolve_speed), which warns once per case when SDPA falls
    back to its math kernel; the once-cache cleared, so each call here may warn."""
    from vidmem.pipelines.speed import Speed, _warn_math_kernel, resolve_speed

    _warn_math_kernel.cache_clear()
    return resolve_speed(Speed(kernel), CUDA, dtype).attention


def test_auto_with_fused_kernels_disabled_in_torch_says_so(gpu, monkeypatch, caplog):
    """With flash and memory-efficient switched off, SDPA still picks cuDNN on Hopper (torch ranks it first there)
    but its math kernel on an Ampere card (cuDNN ranks last there): auto warns then, and when cuDNN is off too."""
    gpu((9, 0))
    for flag in ("flash_sdp_enabled", "mem_efficient_sdp_enabled"):
        monkeypatch.setattr(torch.backends.cuda, flag, lambda: False)
    with caplog.at_level("WARNING", logger="vidmem"):
        resolved = resolved_by_the_run("auto")
    assert resolved.kernel is AttentionKernel.SDPA and "no fused kernel" not in caplog.text
    gpu((8, 0))
    with caplog.at_level("WARNING", logger="vidmem"):
        resolved = resolved_by_the_run("auto")
    assert "math kernel" in resolved.why and "no fused kernel" in caplog.text
    caplog.clear()
    gpu((9, 0))
    monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: False)
    with caplog.at_level("WARNING", logger="vidmem"):
        resolved = resolved_by_the_run("auto")
    assert "enable_flash_sdp(False)" in resolved.fallback and "enable_cudnn_sdp(False)" in resolved.fallback
    assert "no fused kernel" in caplog.text


@pytest.mark.parametrize("device", [CPU, CUDA])
def test_sdpa_with_every_kernel_switched_off_is_refused_before_the_run(gpu, monkeypatch, device):
    """With torch's math kernel and its fused kernels switched off, plain SDPA fails at the first attention call
    ("No viable backend"), after the weights moved: auto and 'sdpa' refuse at resolve time; 'math' runs (its scope
    switches the math kernel on). One usable fused kernel left on is enough."""
    gpu((9, 0))
    monkeypatch.setattr(torch.backends.cuda, "math_sdp_enabled", lambda: False)
    for choice in ("auto", "sdpa"):
        assert resolve_attention(choice, device, torch.bfloat16).kernel is AttentionKernel.SDPA
    for flag in ("flash_sdp_enabled", "mem_efficient_sdp_enabled", "cudnn_sdp_enabled"):
        monkeypatch.setattr(torch.backends.cuda, flag, lambda: False)
    for choice in ("auto", "sdpa"):
        with pytest.raises(AttentionError, match=r"no kernel left: its math kernel is switched off .*enable_math_sdp"
                                                 r"\(False\).* choose 'math'"):
            resolve_attention(choice, device, torch.bfloat16)
    assert resolve_attention("math", device, torch.bfloat16).kernel is AttentionKernel.MATH
    monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: True)  # ignored by the CPU's SDPA
    if device.type == "cuda":
        assert resolve_attention("auto", device, torch.bfloat16).kernel is AttentionKernel.SDPA
    else:
        with pytest.raises(AttentionError, match="no kernel left"):
            resolve_attention("sdpa", device, torch.bfloat16)


def test_a_masked_model_on_a_gpu_with_only_flash_left_is_refused_too(gpu, monkeypatch):
    """CUDA's FlashAttention takes no mask: with math off and flash the only kernel on, LTX-2's masked attention
    would find nothing at its first call."""
    gpu((9, 0))
    monkeypatch.setattr(torch.backends.cuda, "math_sdp_enabled", lambda: False)
    for flag in ("mem_efficient_sdp_enabled", "cudnn_sdp_enabled"):
        monkeypatch.setattr(torch.backends.cuda, flag, lambda: False)
    assert resolve_attention("auto", CUDA, torch.bfloat16).kernel is AttentionKernel.SDPA  # unmasked: flash runs
    for choice in ("auto", "sdpa"):
        with pytest.raises(AttentionError, match="no kernel left"):
            resolve_attention(choice, CUDA, torch.bfloat16, masked_by="LTX-2")
    assert resolve_attention("sdpa", CPU, torch.bfloat16, masked_by="LTX-2").kernel is AttentionKernel.SDPA


def test_the_math_kernel_switched_off_in_torch_really_leaves_sdpa_nothing_on_the_cpu():
    """The fact the refusal above rests on, checked against this torch."""
    query = torch.randn(1, 2, 8, 16)
    previous = torch.backends.cuda.math_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled()
    try:
        torch.backends.cuda.enable_math_sdp(False)
        torch.nn.functional.scaled_dot_product_attention(query, query, query)  # the CPU's flash kernel still runs
        torch.backends.cuda.enable_flash_sdp(False)
        with pytest.raises(RuntimeError):
            torch.nn.functional.scaled_dot_product_attention(query, query, query)
    finally:
        torch.backends.cuda.enable_math_sdp(previous[0])
        torch.backends.cuda.enable_flash_sdp(previous[1])


def test_auto_on_an_old_gpu_in_bf16_falls_back_to_plain_sdpa_with_a_log(gpu, caplog):
    gpu((7, 5))
    with caplog.at_level("WARNING", logger="vidmem"):
        resolved = resolved_by_the_run("auto")
    assert resolved.kernel is AttentionKernel.SDPA
    assert "flash: torch's FlashAttention needs an sm80+ GPU" in resolved.fallback
    assert "efficient: torch's memory-efficient kernel needs sm50+ (sm80+ for bf16)" in resolved.fallback
    assert "no fused kernel" in caplog.text


def test_explicit_kernels_on_a_gpu_are_checked_against_capability_and_dtype(gpu):
    gpu((7, 0))
    with pytest.raises(AttentionError, match=r"attention='cudnn' cannot run here: torch's cuDNN attention needs an "
                                             r"sm80\+ GPU .* this one is sm70: choose 'efficient' or 'sdpa'"):
        resolve_attention("cudnn", CUDA, torch.float16)
    assert resolve_attention("efficient", CUDA, torch.float16).backend == "_native_efficient"
    gpu((9, 0))
    with pytest.raises(AttentionError, match=r"attention='flash' .* model computes in float32: load it in bf16, "
                                             r"or choose 'efficient'"):
        resolve_attention("flash", CUDA, torch.float32)
    assert resolve_attention("cudnn", CUDA, torch.bfloat16).backend == "_native_cudnn"


def test_sage_not_installed_is_refused_with_the_pip_line(gpu, monkeypatch):
    gpu((9, 0))
    installed(monkeypatch, sage=None)
    with pytest.raises(AttentionError, match=r"sageattention is not installed: pip install sageattention==1\.0\.6"):
        resolve_attention("sage", CUDA, torch.bfloat16)


@pytest.mark.parametrize("version, backend", [("1.0.6", SAGE1), ("2.1.1", "sage"), ("2.2.0", "sage")])
def test_sage_goes_to_diffusers_from_2_1_1_and_to_vidmems_route_before(gpu, monkeypatch, version, backend):
    gpu((9, 0))
    installed(monkeypatch, sage=version)
    resolved = resolve_attention("sage", CUDA, torch.bfloat16)
    assert (resolved.kernel, resolved.backend, resolved.lossy) == (AttentionKernel.SAGE, backend, True)
    assert resolve_attention("auto", CUDA, torch.bfloat16).kernel is AttentionKernel.SDPA  # auto never picks sage


def test_sage_refusals_name_what_is_missing(gpu, monkeypatch):
    gpu((9, 0))
    installed(monkeypatch, sage="1.0.6", triton=False)
    with pytest.raises(AttentionError, match=r"sageattention 1\.0\.6 is made of Triton kernels .* pip install triton"):
        resolve_attention("sage", CUDA, torch.bfloat16)
    installed(monkeypatch, sage="1.0.6")
    with pytest.raises(AttentionError, match="SageAttention runs fp16/bf16 and the model computes in float32"):
        resolve_attention("sage", CUDA, torch.float32)
    gpu((7, 5))
    with pytest.raises(AttentionError, match="SageAttention needs an sm80\\+ GPU .* sm75"):
        resolve_attention("sage", CUDA, torch.float16)


def test_flex_on_cuda_needs_triton(gpu, monkeypatch):
    gpu((9, 0))
    installed(monkeypatch, triton=False)
    with pytest.raises(AttentionError, match="flex_attention on CUDA needs Triton: pip install triton"):
        resolve_attention("flex", CUDA, torch.bfloat16)


def test_the_planner_is_told_which_kernels_hold_the_score_matrix():
    assert resolve_attention("math", CPU, torch.float32).materialises_scores
    assert resolve_attention("flex", CPU, torch.float32).materialises_scores
    assert not resolve_attention("flash", CPU, torch.float32).materialises_scores


# --- applying, on the tiny pipelines -------------------------------------------------------------------


def denoisers(loaded) -> dict:
    return {name: getattr(loaded.pipe, name) for name in denoiser_blocks(loaded.pipe, loaded.spec)}


def attention_modules(loaded) -> list:
    return [m for d in denoisers(loaded).values() for m in d.modules() if getattr(m, "processor", None) is not None]


def state(loaded) -> list:
    """What applying a kernel may change: each attention module's forward, hook registry and backend."""
    return [(m.__dict__.get("forward"), hasattr(m, "_diffusers_hook"), getattr(m.processor, "_attention_backend", "-"))
            for m in attention_modules(loaded)]


def run(loaded, variant, resolved=None, strategy=None, hooks=RunHooks()):
    strategy = strategy or MemoryStrategy(offload="none")
    if resolved is None:
        return sample(loaded, strategy, request_for(variant), hooks), None
    with attention_for_call(denoisers(loaded), resolved) as applied:
        result = sample(loaded, strategy, request_for(variant), hooks)
    return result, applied.as_dict()


@pytest.mark.parametrize("variant", FAMILIES)
@pytest.mark.parametrize("kernel", ["auto", "sdpa", "flash"])
def test_sdpas_own_kernels_give_the_default_latents_bit_for_bit(tiny_loaded, variant, kernel):
    loaded = tiny_loaded(variant)
    before = state(loaded)
    default, _ = run(loaded, variant)
    chosen, receipt = run(loaded, variant, resolve_attention(kernel, CPU, torch.float32))
    assert torch.equal(chosen.latent["samples"], default.latent["samples"])
    assert receipt["kernel"] == ("sdpa" if kernel == "auto" else kernel) and receipt["applied"]["transformer"]
    assert state(loaded) == before


@pytest.mark.parametrize("variant", FAMILIES)
def test_math_and_flex_run_and_stay_within_rounding_of_the_default(tiny_loaded, variant):
    loaded = tiny_loaded(variant)
    default = run(loaded, variant)[0].latent["samples"]
    for kernel in ("math", "flex"):
        latent = run(loaded, variant, resolve_attention(kernel, CPU, torch.float32))[0].latent["samples"]
        assert torch.allclose(latent, default, atol=1e-4, rtol=1e-4), kernel


def spy_dispatcher(monkeypatch) -> list:
    """The backends Wan's processors hand diffusers' dispatcher, call by call."""
    from diffusers.models.transformers import transformer_wan

    seen, real = [], transformer_wan.dispatch_attention_fn

    def spy(*args, backend=None, **kwargs):
        seen.append(getattr(backend, "value", backend))
        return real(*args, backend=backend, **kwargs)

    monkeypatch.setattr(transformer_wan, "dispatch_attention_fn", spy)
    return seen


@pytest.mark.parametrize("kernel, backend", [("math", "_native_math"), ("flex", "flex"), ("flash", "_native_flash"),
                                             ("sdpa", "native")])
def test_wan_hands_the_kernel_to_diffusers_dispatcher(tiny_loaded, monkeypatch, kernel, backend):
    seen = spy_dispatcher(monkeypatch)
    loaded = tiny_loaded("wan2.1-t2v")
    run(loaded, "wan2.1-t2v", resolve_attention(kernel, CPU, torch.float32))
    assert seen and set(seen) == {backend}
    seen.clear()
    run(loaded, "wan2.1-t2v")
    assert set(seen) == {None}  # afterwards: the processors' own (unset) backend again


def test_cogvideox_runs_its_sdpa_call_under_the_forced_backend(tiny_loaded, monkeypatch):
    forced, real = [], attention.sdpa_kernel
    monkeypatch.setattr(attention, "sdpa_kernel", lambda backend: forced.append(backend) or real(backend))
    loaded = tiny_loaded("cogvideox-t2v")
    _, receipt = run(loaded, "cogvideox-t2v", resolve_attention("math", CPU, torch.float32))
    assert forced and set(forced) == {torch.nn.attention.SDPBackend.MATH}
    assert "under sdpa_kernel(MATH)" in receipt["applied"]["transformer"]


def test_cogvideox_flex_goes_through_the_dispatcher(tiny_loaded, monkeypatch):
    from diffusers.models import attention_dispatch

    seen, real = [], attention_dispatch.dispatch_attention_fn
    monkeypatch.setattr(attention_dispatch, "dispatch_attention_fn",
                        lambda *a, backend=None, **k: seen.append(backend.value) or real(*a, backend=backend, **k))
    loaded = tiny_loaded("cogvideox-t2v")
    _, receipt = run(loaded, "cogvideox-t2v", resolve_attention("flex", CPU, torch.float32))
    assert set(seen) == {"flex"} and receipt["calls_rerouted"] == len(seen)


def fake_sageattention(monkeypatch, widths: tuple[int, ...] | None = None) -> list:
    """sageattention 1.0.6 as a module, as its `sageattn` behaves on a GPU: it asserts the head width (64, 96 or
    128), smooths K *in place* unless `smooth_k=False`, and (here) computes plain SDPA, recording its layout.
    `widths`: the head widths it takes (the tiny models' heads are narrower than any real model's)."""
    calls = []
    if widths is not None:
        monkeypatch.setattr(attention, "SAGE1_HEAD_WIDTHS", widths)

    def sageattn(q, k, v, tensor_layout="HND", is_causal=False, sm_scale=None, smooth_k=True):
        assert q.size(-1) in attention.SAGE1_HEAD_WIDTHS, "headdim should be in [64, 96, 128]."
        if smooth_k:
            k -= k.mean(dim=1 if tensor_layout == "NHD" else 2, keepdim=True)
        calls.append(tensor_layout)
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=sm_scale)

    module = types.ModuleType("sageattention")
    module.__spec__ = importlib.machinery.ModuleSpec("sageattention", None)
    module.sageattn = sageattn
    monkeypatch.setitem(sys.modules, "sageattention", module)
    return calls


SAGE1_RESOLVED = ResolvedAttention(AttentionKernel.SAGE, AttentionKernel.SAGE, SAGE1, "cpu", "float32", "test")


def head_widths(loaded) -> tuple[int, ...]:
    return tuple(sorted({attention._head_width(m) for m in attention_modules(loaded)} - {None}))


@pytest.mark.parametrize("variant", FAMILIES)
def test_sageattention_1_reaches_both_families_through_vidmems_route(tiny_loaded, monkeypatch, variant):
    """On the CPU the fake computes plain SDPA on the smoothed keys, so the latents are the default's within
    rounding (subtracting a key mean shifts each query's scores by one constant: softmax is unchanged in exact
    arithmetic): every attention call went to `sageattn`, in SDPA's layout, and nothing else changed."""
    loaded = tiny_loaded(variant)
    calls = fake_sageattention(monkeypatch, widths=head_widths(loaded))
    before = state(loaded)
    default = run(loaded, variant)[0].latent["samples"]
    result, receipt = run(loaded, variant, SAGE1_RESOLVED)
    assert calls and set(calls) == {"HND"} and receipt["calls_rerouted"] == len(calls)
    torch.testing.assert_close(result.latent["samples"], default, rtol=1e-4, atol=1e-5)
    assert state(loaded) == before


def test_sageattention_1_leaves_the_callers_key_as_it_was():
    """sageattn 1.0.6 subtracts K's mean from K in place, a tensor the model owns and may read again: vidmem's
    route smooths a copy and tells sageattn not to (the same arithmetic, the same result)."""
    calls = []

    def sageattn(q, k, v, tensor_layout="HND", is_causal=False, sm_scale=None, smooth_k=True):
        if smooth_k:
            k -= k.mean(dim=2, keepdim=True)
        calls.append(k.clone())
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=sm_scale)

    q, k, v = (torch.randn(1, 2, 16, 64, generator=torch.Generator().manual_seed(i)) for i in range(3))
    kept = k.clone()
    out = attention._sage1_attention(sageattn)(q, k, v)
    assert torch.equal(k, kept)
    torch.testing.assert_close(calls[0], kept - kept.mean(dim=2, keepdim=True), rtol=0, atol=0)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, kept, v), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("variant", FAMILIES)
def test_sageattention_1_on_head_widths_it_does_not_take_is_refused_before_anything_changes(tiny_loaded, monkeypatch,
                                                                                            variant):
    """sageattn 1.0.6 asserts heads 64, 96 or 128 wide inside the call: mid-run. The route asks first."""
    fake_sageattention(monkeypatch)
    loaded = tiny_loaded(variant)
    widths = head_widths(loaded)
    assert not set(widths) & {64, 96, 128}
    before = state(loaded)
    with pytest.raises(AttentionError, match=rf"SageAttention 1\.x runs attention heads 64, 96, 128 wide and "
                                             rf"transformer's are {', '.join(map(str, widths))} wide; choose 'auto'"):
        run(loaded, variant, SAGE1_RESOLVED)
    assert state(loaded) == before


def test_a_missing_sageattention_is_refused_before_anything_changes(tiny_loaded, monkeypatch):
    monkeypatch.setitem(sys.modules, "sageattention", None)  # import fails
    loaded = tiny_loaded("wan2.1-t2v")
    before = state(loaded)
    resolved = ResolvedAttention(AttentionKernel.SAGE, AttentionKernel.SAGE, SAGE1, "cpu", "float32", "test")
    with pytest.raises(AttentionError, match=r"sageattention did not import .* pip install sageattention==1\.0\.6"):
        with attention_for_call(denoisers(loaded), resolved):
            pass
    assert state(loaded) == before


@pytest.mark.parametrize("variant", FAMILIES)
def test_a_kernel_that_refuses_the_models_head_width_is_refused_before_anything_changes(tiny_loaded, monkeypatch,
                                                                                      variant):
    """An H200's cuDNN refused a tiny LTX-2's 4-wide heads mid-run ("No available kernel"): now the kernel is
    asked on a probe of each head width first. Here the probe's answer is faked (the CPU's flash takes any)."""
    loaded = tiny_loaded(variant)
    widths = {attention._head_width(m) for m in attention_modules(loaded)}
    asked = []

    def refusal(backend, width, dtype, device):
        asked.append((backend, width))
        return "head_dim should be a multiple of 8" if width == max(widths) else ""

    monkeypatch.setattr(attention, "_kernel_refusal", refusal)
    before = state(loaded)
    with pytest.raises(AttentionError, match=rf"FLASH_ATTENTION kernel does not run transformer's attention heads, "
                                             rf"{max(widths)} wide, in float32 on cpu \(head_dim should be a multiple "
                                             r"of 8\); choose 'auto'"):
        run(loaded, variant, resolve_attention("flash", CPU, torch.float32))
    assert state(loaded) == before
    assert {width for _, width in asked} == widths and None not in widths
    asked.clear()
    for kernel in ("auto", "sdpa", "math", "flex"):  # SDPA chooses per call, or no fused SDPA kernel is forced
        run(loaded, variant, resolve_attention(kernel, CPU, torch.float32))
    assert asked == []


def test_the_head_width_probe_asks_torch_itself():
    from torch.nn.attention import SDPBackend

    assert attention._kernel_refusal(SDPBackend.FLASH_ATTENTION, 12, torch.float32, "cpu") == ""
    assert "No viable backend" in attention._kernel_refusal(SDPBackend.CUDNN_ATTENTION, 4, torch.bfloat16, "cpu")


@pytest.mark.parametrize("variant", FAMILIES)
@pytest.mark.parametrize("kernel", ["flash", "flex"])
def test_everything_is_put_back_after_an_error_mid_run(tiny_loaded, variant, kernel):
    loaded = tiny_loaded(variant)
    before = state(loaded)

    def cancel(step, steps):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(loaded, variant, resolve_attention(kernel, CPU, torch.float32), hooks=RunHooks(on_step=cancel))
    assert state(loaded) == before
    assert not any(hasattr(m, "_diffusers_hook") for m in attention_modules(loaded))


class _Unknown:
    def __call__(self, attn, hidden_states, **kwargs):
        return hidden_states


def test_a_processor_no_kernel_can_reach_is_refused_and_the_others_put_back(tiny_loaded):
    wan, cog = tiny_loaded("wan2.1-t2v"), tiny_loaded("cogvideox-t2v")
    stranger = next(m for m in cog.pipe.transformer.modules() if getattr(m, "processor", None) is not None)
    original = stranger.processor
    before = state(wan)
    stranger.processor = _Unknown()
    try:
        with pytest.raises(AttentionError, match=r"odd's attention processor _Unknown neither goes through diffusers' "
                                                 r"dispatcher nor calls torch's SDPA.* choose 'sdpa'"):
            with attention_for_call({"transformer": wan.pipe.transformer, "odd": cog.pipe.transformer},
                                    resolve_attention("math", CPU, torch.float32)):
                pass
    finally:
        stranger.processor = original
    assert state(wan) == before


@pytest.mark.parametrize("variant", FAMILIES)
def test_a_kernel_composes_with_streaming_tiers(tiny_loaded, variant):
    loaded = tiny_loaded(variant)
    sequential = MemoryStrategy(offload="sequential")
    default = run(loaded, variant, strategy=sequential)[0].latent["samples"]
    flash = run(loaded, variant, resolve_attention("flash", CPU, torch.float32), strategy=sequential)[0]
    assert torch.equal(flash.latent["samples"], default)


def test_under_context_parallelism_auto_keeps_the_splits_backend_and_others_need_a_parallel_version(tiny_loaded):
    """A backend without a context-parallel version would attend within each rank's tokens only."""
    loaded = tiny_loaded("wan2.1-t2v")
    processors = [m.processor for m in attention_modules(loaded)]
    before = state(loaded)
    for processor in processors:
        processor._parallel_config = object()  # what diffusers' enable_parallelism leaves on them
    try:
        with attention_for_call(denoisers(loaded), resolve_attention("auto", CPU, torch.float32)) as applied:
            assert "kept the backend context parallelism set" in applied.as_dict()["applied"]["transformer"]
            assert state(loaded) == before
        with pytest.raises(AttentionError, match=r"attention='math': transformer is split across GPUs \(context_parallel\)"
                                                 r" and the dispatcher's '_native_math' has no context-parallel version; "
                                                 r"choose 'auto' .* 'flash'"):
            with attention_for_call(denoisers(loaded), resolve_attention("math", CPU, torch.float32)):
                pass
        with attention_for_call(denoisers(loaded), resolve_attention("flash", CPU, torch.float32)):
            assert {p._attention_backend.value for p in processors} == {"_native_flash"}
    finally:
        for processor in processors:
            del processor._parallel_config
    assert state(loaded) == before


def test_both_experts_of_wan_2_2_a14b_get_the_kernel(tiny_loaded, monkeypatch):
    seen = spy_dispatcher(monkeypatch)
    loaded = tiny_loaded("wan2.2-a14b")
    default, _ = run(loaded, "wan2.2-a14b")
    seen.clear()
    chosen, receipt = run(loaded, "wan2.2-a14b", resolve_attention("flash", CPU, torch.float32))
    assert set(receipt["applied"]) == {"transformer", "transformer_2"} and set(seen) == {"_native_flash"}
    assert torch.equal(chosen.latent["samples"], default.latent["samples"])


def test_plain_sdpa_leaves_a_processor_it_cannot_reach_as_it_is(tiny_loaded):
    cog = tiny_loaded("cogvideox-t2v")
    stranger = next(m for m in cog.pipe.transformer.modules() if getattr(m, "processor", None) is not None)
    original = stranger.processor
    stranger.processor = _Unknown()
    try:
        with attention_for_call(denoisers(cog), resolve_attention("sdpa", CPU, torch.float32)) as applied:
            assert "modules as they are" in applied.as_dict()["applied"]["transformer"]
    finally:
        stranger.processor = original


def test_a_resolved_kernel_is_never_auto():
    with pytest.raises(AttentionError, match="never 'auto'; build it with resolve_attention"):
        ResolvedAttention("auto", "auto", "native", "cpu", "float32", "")
    assert ResolvedAttention("math", "auto", "_native_math", "cpu", "float32", "").describe() == "math (auto)"


@pytest.mark.parametrize("kernel", ["flash", "flex"])
def test_a_kernel_composes_with_the_step_cache(tiny_loaded, kernel):
    """Both put diffusers hooks on the denoiser (the cache on its blocks, the kernel on attention modules)."""
    from dataclasses import replace

    from vidmem.pipelines.step_cache import StepCache

    loaded = tiny_loaded("wan2.1-t2v")
    request = replace(request_for("wan2.1-t2v", steps=6), cache=StepCache("first_block_cache", threshold=0.9, retention=0.0))
    strategy = MemoryStrategy(offload="none")
    cached = sample(loaded, strategy, request)
    with attention_for_call(denoisers(loaded), resolve_attention(kernel, CPU, torch.float32)):
        both = sample(loaded, strategy, request)
    assert both.receipt["cache"]["blocks_skipped"] > 0
    assert both.receipt["cache"]["blocks_computed"] == cached.receipt["cache"]["blocks_computed"]
    assert torch.allclose(both.latent["samples"], cached.latent["samples"], atol=1e-4, rtol=1e-4)
    assert not loaded.pipe.transformer.is_cache_enabled and not any(
        hasattr(m, "_diffusers_hook") and m._diffusers_hook.hooks for m in attention_modules(loaded))


def test_a_wrapper_left_over_the_scoped_forward_is_kept_and_later_calls_still_run(caplog):
    """A third party wraps the attention forward during a call and never unwraps: it is left as found
    (with a warning), and the next calls scope ours where it is under that wrapper (installing ours
    again would wrap the wrapper that calls it: a RecursionError on the second call)."""
    from contextlib import contextmanager
    from torch import nn

    from vidmem.pipelines import attention

    class Attn(nn.Module):
        def forward(self, x):
            return x + 1

    entered = []

    @contextmanager
    def scope():
        entered.append(1)
        yield

    module = Attn()

    def one_call(wrap=False):
        applied = attention.AppliedAttention.__new__(attention.AppliedAttention)
        applied._scoped, applied._backends, applied._counter = [], [], None
        attention._scope_forward(applied, module, scope)
        if wrap:
            inner = module.forward
            module.forward = lambda *a, **k: inner(*a, **k)
        try:
            return module(torch.zeros(1))
        finally:
            applied.remove()

    with caplog.at_level("WARNING", logger="vidmem"):
        assert one_call(wrap=True).item() == 1.0
    assert "left as found" in caplog.text
    assert module(torch.zeros(1)).item() == 1.0 and len(entered) == 1  # between calls: no scope
    for calls in (2, 3):
        assert one_call().item() == 1.0 and len(entered) == calls  # the scope still reaches the forward
    assert module(torch.zeros(1)).item() == 1.0 and len(entered) == 3


def _scoping_call(module, scope):
    """One call's scoping of `module`'s forward, as attention_for_call does it for a direct-SDPA module."""
    applied = attention.AppliedAttention.__new__(attention.AppliedAttention)
    applied._scoped, applied._backends, applied._counter = [], [], None
    attention._scope_forward(applied, module, scope)
    return applied


def _counting_scope(entered: list, name: str):
    from contextlib import contextmanager

    @contextmanager
    def scope():
        entered.append(name)
        yield

    return scope


class _PlusOne(torch.nn.Module):
    def forward(self, x):
        return x + 1


def test_a_forward_replaced_by_one_that_does_not_call_ours_gets_the_kernel_again_next_call(caplog):
    """Something puts the class's forward back on the module during a call (not a wrapper of ours): it is left as
    found, with a warning, and ours is installed over it again by the next call. Before, ours was taken to be still
    in the chain, and every later call scoped an object nobody called: no kernel, silently."""
    module, entered = _PlusOne(), []
    scope = _counting_scope(entered, "call")
    applied = _scoping_call(module, scope)
    module.forward = type(module).forward.__get__(module)  # e.g. a hook registry torn down mid-call
    with caplog.at_level("WARNING", logger="vidmem"):
        applied.remove()
    assert "left as found" in caplog.text
    found = module.__dict__["forward"]
    for calls in (1, 2):
        applied = _scoping_call(module, scope)
        try:
            assert module(torch.zeros(1)).item() == 1.0 and entered == ["call"] * calls  # the kernel's scope ran
        finally:
            applied.remove()
        assert module.__dict__["forward"] is found  # put back as found
    assert module(torch.zeros(1)).item() == 1.0 and entered == ["call"] * 2  # between calls: no scope


def test_a_nested_call_on_the_same_module_leaves_the_outer_calls_kernel_on():
    module, entered = _PlusOne(), []
    outer = _scoping_call(module, _counting_scope(entered, "outer"))
    try:
        module(torch.zeros(1))
        inner = _scoping_call(module, _counting_scope(entered, "inner"))
        try:
            module(torch.zeros(1))
        finally:
            inner.remove()
        module(torch.zeros(1))
    finally:
        outer.remove()
    assert entered == ["outer", "inner", "outer"]
    assert "forward" not in module.__dict__ and module(torch.zeros(1)).item() == 1.0 and len(entered) == 3
