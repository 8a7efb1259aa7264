"""Attention kernel choice: which kernel a Sampler call's denoisers attend with, resolved before any
model work and applied for one call only.

How it works. `resolve_attention(choice, device, dtype)` turns the user's choice into one concrete
kernel, checking what this device, dtype and installation can run without importing anything heavy
(`importlib.util.find_spec`, package metadata, torch's SDPA flags, the GPU's compute capability); a
kernel that cannot run is refused there with `AttentionError` naming the input and the fix, so a run
never stops halfway on an ImportError. `attention_for_call(denoisers, resolved)` then applies it to
the denoisers' attention modules and restores exactly what was there before, on success or error:

- Wan (and every model whose processors go through diffusers' dispatcher, `dispatch_attention_fn`):
  the processors' `_attention_backend` is set to the dispatcher's backend (`native`, `_native_flash`,
  `flex`, `sage`, ...). diffusers' own `set_attention_backend` is not used: it also changes the
  dispatcher's process-wide active backend and `reset_attention_backend` does not put that back.
- CogVideoX (`CogVideoXAttnProcessor2_0` calls `F.scaled_dot_product_attention` itself): each
  attention module's forward runs under `sdpa_kernel(<backend>)` for the SDPA backends, or reroutes
  its SDPA call through the dispatcher (flex, sage) with a `TorchFunctionMode` scoped to that
  forward. The wrapper is one object per module, reused by every call (`_ScopedForward`: compiled
  blocks guard on it, so a new one per call recompiled them). Processors that do neither are refused
  by name.

SageAttention 1.x (PyPI's `sageattention` 1.0.6, pure Triton) is not accepted by diffusers' `sage`
backend, which needs 2.1.1 or newer (`_REQUIRED_SAGE_VERSION`, no binary wheel on PyPI). The
dispatcher's registry is keyed by its closed `AttentionBackendName` enum, so a backend of our own
could only be registered by overwriting one of diffusers' entries for the whole process; instead
vidmem's `sage1` route keeps the processors on `native` and reroutes, inside each attention
module's forward only, the SDPA call to `sageattention.sageattn`. Under torch.compile every dispatcher
backend and every rerouted call trace without a graph break, one graph for all of a model's blocks
(tests/test_compile.py; the H200 found both a break per attention and a graph per block on Wan's
route, fixed in `_RerouteSdpa` and `_ScopedForward.entry`).

auto's rule. auto never picks a lossy kernel (sage quantizes Q and K to INT8) nor flex (unfused,
materialising the score matrix, unless the model is compiled). Everywhere it is plain SDPA, exactly
what runs without vidmem: off CUDA that keeps CPU frames bit-identical to plain diffusers; on CUDA,
SDPA's own pick (cuDNN on Hopper with torch 2.11) was measured faster than any kernel forced through
the dispatcher (`MEASURED_AUTO`), and it follows torch's flags (`torch.backends.cuda.enable_*_sdp`),
refusing before the run where they leave SDPA no kernel at all (`_sdpa_switched_off`).
The Sampler's receipt names the kernel SDPA picks (`sdpa_pick`); where SDPA would fall back to its
math kernel (an old GPU in bf16, the fused kernels disabled), for auto as for 'sdpa' chosen by name,
the ones passed over are named in `fallback` and logged, and the plan counts the score matrix.
"""

from __future__ import annotations

import re

import contextlib
import importlib
import importlib.metadata
import importlib.util
import logging
import types
from dataclasses import dataclass, field
from enum import Enum
from functools import lru_cache
from typing import Callable, Iterator, Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

from ..memory.strategy import StrategyError
from ..memory.units import DTYPES

log = logging.getLogger("vidmem")


class AttentionError(StrategyError):
    """An attention kernel cannot run here; the message names the input and what to choose instead."""


class AttentionKernel(str, Enum):
    AUTO = "auto"  # torch's SDPA choosing (measured fastest; module docstring); the receipt names its kernel
    SDPA = "sdpa"  # torch's scaled_dot_product_attention choosing its backend per call: what runs without vidmem
    FLASH = "flash"  # SDPA's FlashAttention-2 backend: CUDA sm80+, fp16/bf16 (on the CPU, torch's CPU flash kernel)
    EFFICIENT = "efficient"  # SDPA's memory-efficient backend: CUDA sm50+, fp32/fp16 (bf16 on sm80+)
    CUDNN = "cudnn"  # SDPA's cuDNN backend: CUDA sm80+, fp16/bf16
    MATH = "math"  # SDPA's reference math backend: any device and dtype, exact, slowest, materialises the scores
    FLEX = "flex"  # torch's flex_attention (diffusers' 'flex'): unfused, materialising the scores, unless compiled
    SAGE = "sage"  # SageAttention (pip sageattention): INT8 Q.K, lossy; CUDA sm80+, fp16/bf16; needs Triton


# diffusers' dispatcher backend per kernel (AttentionBackendName values); sage's depends on the version.
_DISPATCHER = {AttentionKernel.SDPA: "native", AttentionKernel.FLASH: "_native_flash",
               AttentionKernel.EFFICIENT: "_native_efficient", AttentionKernel.CUDNN: "_native_cudnn",
               AttentionKernel.MATH: "_native_math", AttentionKernel.FLEX: "flex"}
_SDPA_BACKENDS = {AttentionKernel.FLASH: SDPBackend.FLASH_ATTENTION, AttentionKernel.EFFICIENT: SDPBackend.EFFICIENT_ATTENTION,
                  AttentionKernel.CUDNN: SDPBackend.CUDNN_ATTENTION, AttentionKernel.MATH: SDPBackend.MATH}
SAGE1 = "vidmem_sage1"  # vidmem's route for sageattention 1.x (not a dispatcher backend; module docstring)
SAGE1_HEAD_WIDTHS = (64, 96, 128)  # sageattention 1.0.6's `sageattn` asserts these mid-call: asked before the run
SAGE_DISPATCHER_VERSION = "2.1.1"  # diffusers' _REQUIRED_SAGE_VERSION (0.42.1)
SAGE_FIX = ("pip install sageattention==1.0.6 (pure Triton, vidmem's own route), or build sageattention 2.1.1+ from "
            "source (diffusers' 'sage' backend)")
_HALF = (torch.float16, torch.bfloat16)
# Processors that call torch's SDPA themselves (not through the dispatcher): their kernel is set around the call.
SDPA_PROCESSORS = frozenset({"CogVideoXAttnProcessor2_0", "FusedCogVideoXAttnProcessor2_0", "AttnProcessor2_0"})


@dataclass(frozen=True)
class ResolvedAttention:
    """One concrete kernel for a call. `backend`: the dispatcher's backend name, or `SAGE1`."""

    kernel: AttentionKernel
    requested: AttentionKernel
    backend: str
    device: str
    dtype: str
    why: str
    fallback: str = ""  # the fused kernels auto or sdpa passed over, and why, where SDPA is left its math kernel

    def __post_init__(self) -> None:
        object.__setattr__(self, "kernel", _parse_kernel(self.kernel))
        object.__setattr__(self, "requested", _parse_kernel(self.requested))
        if self.kernel is AttentionKernel.AUTO:
            raise AttentionError("attention: a resolved kernel is a concrete one, never 'auto'; build it with "
                                 "resolve_attention(choice, device, dtype).")

    @property
    def sdpa_backend(self) -> SDPBackend | None:
        """The SDPA backend forced around a direct SDPA call (None: torch chooses, or not an SDPA kernel)."""
        return _SDPA_BACKENDS.get(self.kernel)

    @property
    def materialises_scores(self) -> bool:
        """Whether attention holds the whole score matrix (the planner counts fused kernels as output only): math,
        flex, and an auto or sdpa that found no fused kernel SDPA would pick here (`fallback`: an sm75 card in bf16, the
        fused kernels switched off), where SDPA runs its math kernel."""
        math_fallback = self.kernel is AttentionKernel.SDPA and bool(self.fallback)
        return self.kernel in (AttentionKernel.MATH, AttentionKernel.FLEX) or math_fallback

    @property
    def lossy(self) -> bool:
        return self.kernel is AttentionKernel.SAGE

    def describe(self) -> str:
        """One line for the plan and logs: `sdpa (auto)`, `flash`."""
        return self.kernel.value + (f" ({self.requested.value})" if self.requested is not self.kernel else "")

    def as_dict(self) -> dict:
        found = {"kernel": self.kernel.value, "requested": self.requested.value, "backend": self.backend,
                 "device": self.device, "dtype": self.dtype, "why": self.why}
        return {**found, "fallback": self.fallback} if self.fallback else found


def resolve_attention(choice: AttentionKernel | str, device: torch.device | str,
                      dtype: torch.dtype | str, masked_by: str = "") -> ResolvedAttention:
    """The kernel `choice` means on `device` for a model computing in `dtype` (a torch dtype or a name
    of memory.units.DTYPES, e.g. `loaded.dtype_name`: not the parameters' dtype, which is the storage's
    under fp8 or GGUF); raises AttentionError (input named, fix given) when it cannot run there.
    `masked_by`: the model, when its attention passes a mask (`FamilySpec.attention_masked`), which the
    mask-less kernels refuse (`check_mask`). Imports nothing heavy and touches no model."""
    kernel = _parse_kernel(choice)
    check_mask(kernel, masked_by)
    device = torch.device(device)
    dtype = DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype.itemsize < 2:
        raise AttentionError(f"attention dtype={dtype!r} must be the model's compute dtype: one of "
                             f"{', '.join(DTYPES)} or its torch dtype.")
    if kernel is AttentionKernel.AUTO:
        return _auto(device, dtype, masked_by)
    problem = (_sdpa_switched_off(device, dtype, masked_by) if kernel is AttentionKernel.SDPA
               else unavailable(kernel, device, dtype))
    if problem:
        raise AttentionError(f"attention={kernel.value!r} cannot run here: {problem}")
    if kernel is AttentionKernel.SDPA and device.type == "cuda":
        # SDPA chosen by name runs exactly what auto runs: where no fused kernel is left it is the math kernel, which
        # the plan, the room and the ladder must count (the sm80+ refusals below send users here from flash/cuDNN).
        fallen = _math_fallback(kernel, device, dtype, masked_by)
        if fallen is not None:
            return fallen
    why = CPU_FLASH if kernel is AttentionKernel.FLASH and device.type == "cpu" else WHY[kernel]
    return _resolved(kernel, kernel, device, dtype, why)


# Kernels that take no attention mask: diffusers' dispatcher raises "`attn_mask` is not supported" for
# `_native_flash` and every `sage` backend, and torch's CPU flash kernel takes none either; vidmem's
# sage 1.x route refuses a mask the same way. On a model whose attention passes one (LTX-2's and
# HunyuanVideo 1.5's text padding) they would fail at the first attention call, after the weights moved.
MASKLESS = (AttentionKernel.FLASH, AttentionKernel.SAGE)


def check_mask(kernel: AttentionKernel | str, masked_by: str) -> None:
    """AttentionError naming the kernels that work when `kernel` takes no mask and the model `masked_by`
    names passes one ("" : the model passes none). auto never picks a mask-less kernel (it is SDPA)."""
    kernel = _parse_kernel(kernel)
    if masked_by and kernel in MASKLESS:
        usable = ", ".join(repr(k.value) for k in AttentionKernel if k not in MASKLESS)
        raise AttentionError(f"attention={kernel.value!r} cannot run {masked_by}: its attention passes a mask (the "
                             f"text's padding), which {kernel.value} does not take; choose one of {usable}.")


WHY = {
    AttentionKernel.SDPA: "torch's scaled_dot_product_attention, torch choosing its backend per call (as without vidmem)",
    AttentionKernel.FLASH: "SDPA's FlashAttention-2 backend: exact, fused, fp16/bf16",
    AttentionKernel.EFFICIENT: "SDPA's memory-efficient backend: exact, fused, any float dtype",
    AttentionKernel.CUDNN: "SDPA's cuDNN backend: exact, fused, fp16/bf16",
    AttentionKernel.MATH: "SDPA's reference math backend: exact, slowest, holds the whole score matrix",
    AttentionKernel.FLEX: "torch flex_attention: exact; unfused (holds the whole score matrix) unless the model is compiled",
    AttentionKernel.SAGE: "SageAttention: Q and K quantized to INT8 (lossy, usually close), fused Triton/CUDA kernels",
}

CPU_FLASH = "torch's CPU flash-attention kernel: exact, the one SDPA itself picks on the CPU for unmasked attention"


def unavailable(kernel: AttentionKernel, device: torch.device, dtype: torch.dtype) -> str:
    """Why `kernel` cannot run on `device` in `dtype`, with the fix; "" when it can."""
    if kernel is AttentionKernel.SDPA:
        return _sdpa_switched_off(device, dtype)
    if kernel is AttentionKernel.MATH:
        return ""  # its scope switches the math kernel on for the call, whatever torch's flags say
    if kernel is AttentionKernel.FLEX:
        return _flex_problem(device)
    if device.type != "cuda":
        if kernel is AttentionKernel.FLASH and device.type == "cpu":
            return ""  # torch's CPU flash kernel: what SDPA itself picks on the CPU for these dtypes
        return (f"it needs a CUDA GPU and this run is on {device.type}; choose 'auto', 'sdpa' or 'math'"
                + (" ('flash' also runs on the CPU)" if device.type == "cpu" else "") + ".")
    if kernel is AttentionKernel.SAGE:
        return _sage_problem(device, dtype)
    return _sdpa_backend_problem(kernel, device, dtype)


def _sdpa_switched_off(device: torch.device, dtype: torch.dtype, masked_by: str = "") -> str:
    """Why plain SDPA has no kernel left under torch's `enable_*_sdp` flags ("" when it has one): with the math
    kernel and every fused kernel usable here switched off, it fails at the first attention call ("No viable
    backend"), after the weights moved. `masked_by`: the model passes a mask, which CUDA's FlashAttention does not
    take (torch's CPU flash kernel does)."""
    if torch.backends.cuda.math_sdp_enabled():
        return ""
    fused = (AttentionKernel.FLASH,) if device.type == "cpu" else tuple(_FLAG) if device.type == "cuda" else ()
    if masked_by and device.type == "cuda":
        fused = tuple(kernel for kernel in fused if kernel not in MASKLESS)
    if any(_flag_on(kernel) and not unavailable(kernel, device, dtype) for kernel in fused):
        return ""
    return ("torch's SDPA has no kernel left: its math kernel is switched off "
            "(torch.backends.cuda.enable_math_sdp(False)) and so is every fused kernel that runs here; switch one "
            "back on, or choose 'math', which switches it on for the call.")


def _sdpa_backend_problem(kernel: AttentionKernel, device: torch.device, dtype: torch.dtype) -> str:
    major, minor = _capability(device)
    sm = f"sm{major}{minor}"
    if kernel is AttentionKernel.EFFICIENT:
        if major < 5 or (dtype is torch.bfloat16 and major < 8):
            return f"torch's memory-efficient kernel needs sm50+ (sm80+ for bf16); this GPU is {sm}: choose 'sdpa'."
        return ""
    name = {AttentionKernel.FLASH: "FlashAttention", AttentionKernel.CUDNN: "cuDNN attention"}[kernel]
    if dtype not in _HALF:
        return (f"torch's {name} runs fp16/bf16 and the model computes in {_dtype_name(dtype)}: load it in bf16, or "
                "choose 'efficient'.")
    if major < 8:
        # 'efficient' is offered only where it runs: it too is refused in bf16 below sm80.
        efficient_runs = not _sdpa_backend_problem(AttentionKernel.EFFICIENT, device, dtype)
        usable = "'efficient' or 'sdpa'" if efficient_runs else "'sdpa'"
        return f"torch's {name} needs an sm80+ GPU (Ampere or newer); this one is {sm}: choose {usable}."
    if kernel is AttentionKernel.FLASH and not torch.backends.cuda.is_flash_attention_available():
        return "this torch build has no FlashAttention kernels: choose 'efficient', 'cudnn' or 'sdpa'."
    if kernel is AttentionKernel.CUDNN and not torch.backends.cudnn.is_available():
        return "this torch build has no cuDNN: choose 'flash' or 'sdpa'."
    return ""


def _flex_problem(device: torch.device) -> str:
    if not _has_module("torch.nn.attention.flex_attention"):
        return (f"flex_attention needs torch 2.5 or newer (this is {torch.__version__}): pip install -U torch, or "
                "choose 'sdpa'.")
    if device.type == "cuda" and not _has_module("triton"):
        return "flex_attention on CUDA needs Triton: pip install triton, or choose 'sdpa'."
    if device.type not in ("cuda", "cpu"):
        return f"flex_attention runs on CUDA or the CPU, not {device.type}: choose 'sdpa'."
    return ""


def _sage_problem(device: torch.device, dtype: torch.dtype) -> str:
    version = _installed_version("sageattention")
    if version is None:
        return f"sageattention is not installed: {SAGE_FIX}; or choose 'auto'."
    if dtype not in _HALF:
        return (f"SageAttention runs fp16/bf16 and the model computes in {_dtype_name(dtype)}: load it in bf16, or "
                "choose 'auto'.")
    major, minor = _capability(device)
    if major < 8:
        return f"SageAttention needs an sm80+ GPU (Ampere or newer); this one is sm{major}{minor}: choose 'auto'."
    if _sage_backend(version) == SAGE1 and not _has_module("triton"):
        return f"sageattention {version} is made of Triton kernels and Triton is not installed: pip install triton."
    return ""


# Why auto leaves SDPA to choose on CUDA: one attention call at Wan 2.1 1.3B's real size (832x480x81, 32,760
# tokens, 12 heads of 128, bf16) on an H100 with torch 2.11, each kernel as the dispatcher runs it.
MEASURED_AUTO = ("on an H100 at 32,760 tokens SDPA's own pick (cuDNN there) took 11.3 ms a call, FlashAttention-2 "
                 "forced 18.4 ms, memory-efficient forced 36.6 ms (bench/results/speed-attention-call-gpu-h100-2026-11-27.json)")


def _auto(device: torch.device, dtype: torch.dtype, masked_by: str = "") -> ResolvedAttention:
    switched_off = _sdpa_switched_off(device, dtype, masked_by)
    if switched_off:
        raise AttentionError(f"attention='auto' found nothing to run: {switched_off}")
    if device.type != "cuda":
        why = (f"auto on {device.type}: torch's SDPA as it is, so frames stay identical to plain diffusers "
               "(the CPU has no faster exact kernel than the one SDPA picks)")
        return _resolved(AttentionKernel.SDPA, AttentionKernel.AUTO, device, dtype, why)
    fallen = _math_fallback(AttentionKernel.AUTO, device, dtype, masked_by)
    if fallen is not None:
        return fallen
    major, minor = _capability(device)
    why = (f"auto on CUDA sm{major}{minor}, {_dtype_name(dtype)}: torch's SDPA choosing its fused kernel per call, "
           f"the fastest exact choice measured: {MEASURED_AUTO}")
    return _resolved(AttentionKernel.SDPA, AttentionKernel.AUTO, device, dtype, why)


def _math_fallback(requested: AttentionKernel, device: torch.device, dtype: torch.dtype,
                   masked_by: str = "") -> ResolvedAttention | None:
    """SDPA resolved for `requested` (auto, or sdpa by name) on a CUDA GPU where no fused kernel is left that SDPA
    would pick (an sm75 card in bf16, the fused kernels switched off, or for a masked model only FlashAttention, which
    takes no mask): it runs its math kernel, recorded in `fallback` (what was passed over, and why) so the plan counts
    the score matrix. None where a fused kernel is left. Logged by the run (pipelines/speed.py `resolve_speed`), not
    here: the queue check and the chart resolve every dtype and plan without running anything."""
    passed, fused = _fused_sdpa_kernels(device, dtype, masked_by)
    if fused:
        return None
    fallback = _fallback(passed)
    major, minor = _capability(device)
    why = (f"{requested.value} on CUDA sm{major}{minor}: no fused kernel SDPA would pick, so SDPA will use its math "
           "kernel (it holds the whole score matrix)")
    return _resolved(AttentionKernel.SDPA, requested, device, dtype, why, fallback)


def _fused_sdpa_kernels(device: torch.device, dtype: torch.dtype,
                        masked_by: str = "") -> tuple[list[str], list[AttentionKernel]]:
    """(the fused kernels passed over here, each with why; the fused kernels SDPA would pick on this CUDA GPU for a
    model whose attention passes a mask when `masked_by` names it: FlashAttention takes none)."""
    major, _ = _capability(device)
    passed, fused = [], []
    for kernel in _FLAG:
        problem = unavailable(kernel, device, dtype) or (
            "" if _flag_on(kernel) else f"disabled with torch.backends.cuda.enable_{_FLAG[kernel]}_sdp(False).") or (
            f"takes no attention mask, which {masked_by}'s attention passes." if masked_by and kernel in MASKLESS
            else "")
        if problem:
            passed.append(f"{kernel.value}: {problem}")
        elif kernel is not AttentionKernel.CUDNN or major in _CUDNN_FIRST:
            fused.append(kernel)  # elsewhere torch ranks cuDNN after its math kernel: SDPA would never pick it
    return passed, fused


# torch ranks cuDNN attention first on these GPU generations (Hopper, Blackwell datacenter:
# `check_prefer_cudnn_attention`), after its math kernel on the others.
_CUDNN_FIRST = (9, 10)


@lru_cache(maxsize=None)
def sdpa_pick(device: str, dtype: torch.dtype) -> str:
    """The backend torch's SDPA picks on this GPU for 128-wide heads ("" where it cannot say), for receipts.

    Allocates a small probe on the device: called when a run writes its receipt, never when a choice is
    resolved (queue-time checks and plans must not create a CUDA context)."""
    names = {SDPBackend.FLASH_ATTENTION: "FlashAttention-2", SDPBackend.EFFICIENT_ATTENTION: "memory-efficient",
             SDPBackend.CUDNN_ATTENTION: "cuDNN", SDPBackend.MATH: "math"}
    if torch.device(device).type != "cuda":
        return ""
    try:
        probe = torch.empty(1, 12, 256, 128, device=device, dtype=dtype)
        return names.get(SDPBackend(torch._fused_sdp_choice(probe, probe, probe)), "")
    except Exception:  # a private torch function: the receipt does without the name rather than fail a run
        return ""


_FLAG = {AttentionKernel.FLASH: "flash", AttentionKernel.EFFICIENT: "mem_efficient", AttentionKernel.CUDNN: "cudnn"}


def _flag_on(kernel: AttentionKernel) -> bool:
    """torch's `enable_<name>_sdp` switch for `kernel`, read when asked (tests and users switch it at run time)."""
    return getattr(torch.backends.cuda, f"{_FLAG[kernel]}_sdp_enabled")()


def _fallback(passed: list[str]) -> str:
    """What auto or sdpa passed over, each with why, without the reasons' own advice ("choose 'sdpa'": the choice
    being resolved)."""
    return "; ".join(f"passed over {re.sub(r':? choose [^.]*[.]$', '.', p)}" for p in passed)


def _resolved(kernel: AttentionKernel, requested: AttentionKernel, device: torch.device, dtype: torch.dtype, why: str,
              fallback: str = "") -> ResolvedAttention:
    if kernel is AttentionKernel.SAGE:
        backend = _sage_backend(_installed_version("sageattention"))
    else:
        backend = _DISPATCHER[kernel]
    return ResolvedAttention(kernel, requested, backend, str(device), _dtype_name(dtype), why, fallback)


def _sage_backend(version: str) -> str:
    """diffusers' 'sage' for 2.1.1 and newer, vidmem's own route for 1.x."""
    from packaging.version import Version  # a dependency of diffusers, so always present with it

    return "sage" if Version(version) >= Version(SAGE_DISPATCHER_VERSION) else SAGE1


def _parse_kernel(choice: AttentionKernel | str) -> AttentionKernel:
    try:
        return AttentionKernel(choice)
    except ValueError:
        accepted = ", ".join(repr(k.value) for k in AttentionKernel)
        raise AttentionError(f"attention={choice!r} is not one of {accepted}; 'auto' picks for the device.") from None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# Probes: no import of the packages probed. Tests replace these to fake a GPU or an installation.
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package missing, or a module without a spec
        return False


# --- Applying a kernel to a call's denoisers ------------------------------------------------------------


@dataclass
class AppliedAttention:
    """What `attention_for_call` changed, to put back; `as_dict()` is the receipt's entry."""

    resolved: ResolvedAttention
    routes: dict[str, str] = field(default_factory=dict)  # denoiser -> how the kernel reached its attention
    _backends: list[tuple[object, object]] = field(default_factory=list)  # (processor, its own _attention_backend)
    _scoped: list[tuple[nn.Module, _ScopedForward, object]] = field(default_factory=list)  # (module, ours, forward found)
    _counter: _CallCount | None = None
    _counted_before: int = 0  # the counter's calls when this call began (the counter outlives calls)

    def as_dict(self) -> dict:
        found = {**self.resolved.as_dict(), "applied": dict(self.routes)}
        if self._counter is not None:
            found["calls_rerouted"] = self._counter.calls - self._counted_before
        return found

    def remove(self) -> None:
        """Put back every processor's backend and every attention module's forward (idempotent)."""
        while self._scoped:
            module, scoped, found = self._scoped.pop()
            if isinstance(found, _InPlace):  # ours was already in the module's chain: it stays, as it was before
                scoped.scope, scoped.in_chain = found.scope, found.in_chain
                continue
            current = module.__dict__.get("forward", _ABSENT)
            if current is not scoped.entry:  # replaced during the call and not put back: theirs to undo
                log.warning("vidmem: %s.forward was replaced during the call and not restored; left as found.",
                            type(module).__name__)
                # Only a wrapper that still calls ours keeps it in the chain; a forward that does not (the class's,
                # put back by someone else) gets ours installed over it again by the next call.
                scoped.release(in_chain=_calls_scoped(current, scoped))
                continue
            if found is _ABSENT:
                del module.forward  # back to the class's forward, as before
            else:
                module.forward = found
            scoped.release()
        while self._backends:
            processor, backend = self._backends.pop()
            processor._attention_backend = backend


@contextlib.contextmanager
def attention_for_call(denoisers: Mapping[str, nn.Module], resolved: ResolvedAttention) -> Iterator[AppliedAttention]:
    """Apply `resolved` to the attention of `denoisers` (name -> module) for one call; on leaving, on
    success or error, every processor and forward is as it was. Refuses, before changing anything it
    does not put back, an attention processor the kernel cannot reach."""
    applied = AppliedAttention(resolved)
    try:
        attend = _rerouted_attention(resolved)
        _check_dispatcher(resolved)
        for name, denoiser in denoisers.items():
            applied.routes[name] = _apply(applied, name, denoiser, attend)
        yield applied
    finally:
        applied.remove()


def _apply(applied: AppliedAttention, name: str, denoiser: nn.Module, attend: Callable | None) -> str:
    """Set the kernel on every attention module of `denoiser`; how, for the receipt."""
    resolved = applied.resolved
    modules = [m for m in denoiser.modules() if getattr(m, "processor", None) is not None]
    if not modules:
        raise AttentionError(f"attention={resolved.requested.value!r}: {name} ({type(denoiser).__name__}) has no "
                             "diffusers attention modules to set a kernel on; choose 'auto'.")
    _check_head_widths(resolved, name, modules)
    dispatched = [m for m in modules if hasattr(m.processor, "_attention_backend")]
    direct = [m for m in modules if m not in dispatched]
    if resolved.kernel is not AttentionKernel.SDPA:  # plain SDPA leaves direct processors as they are
        _check_direct(resolved, name, direct)
    if any(getattr(m.processor, "_parallel_config", None) is not None for m in dispatched) and \
            _keeps_parallel_backend(resolved, name):
        return f"auto: kept the backend context parallelism set on {len(dispatched)} attention modules"
    backend = "native" if resolved.backend == SAGE1 else resolved.backend
    for module in dispatched:
        applied._backends.append((module.processor, module.processor._attention_backend))
        module.processor._attention_backend = _backend_name(backend)
    scoped = direct + (dispatched if resolved.backend == SAGE1 else [])
    scope = _scope_factory(resolved, attend, applied) if scoped else None
    for module in scoped if scope is not None else ():
        _scope_forward(applied, module, scope)
    return _route(resolved, backend, dispatched, direct, scope is not None)


def _check_head_widths(resolved: ResolvedAttention, name: str, modules: list[nn.Module]) -> None:
    """Refuse, before the run, an SDPA kernel forced on heads it will not take. torch checks each call and,
    with one kernel forced, raises "No available kernel" mid-run (an H200's cuDNN refused a tiny LTX-2's
    4-wide sound heads: it wants multiples of 8). The kernel itself is asked, on a probe of each width."""
    widths = sorted({width for width in map(_head_width, modules) if width})
    if resolved.backend == SAGE1:
        refused = [width for width in widths if width not in SAGE1_HEAD_WIDTHS]
        if refused:
            raise AttentionError(f"attention={resolved.requested.value!r}: SageAttention 1.x runs attention heads "
                                 f"{', '.join(map(str, SAGE1_HEAD_WIDTHS))} wide and {name}'s are "
                                 f"{', '.join(map(str, refused))} wide; choose 'auto'.")
        return
    backend = resolved.sdpa_backend
    if backend is None or backend is SDPBackend.MATH:
        return
    for width in widths:
        problem = _kernel_refusal(backend, width, getattr(torch, resolved.dtype), resolved.device)
        if problem:
            raise AttentionError(f"attention={resolved.requested.value!r}: torch's {backend.name} kernel does not run "
                                 f"{name}'s attention heads, {width} wide, in {resolved.dtype} on {resolved.device} "
                                 f"({problem}); choose 'auto' (SDPA picks a kernel per call) or 'sdpa'.")


def _head_width(module: nn.Module) -> int | None:
    """The width of one attention head of a diffusers attention module (None where it does not say)."""
    heads, width = getattr(module, "heads", None), getattr(getattr(module, "to_q", None), "out_features", None)
    return width // heads if isinstance(heads, int) and isinstance(width, int) and heads > 0 and not width % heads \
        else None


@lru_cache(maxsize=None)
def _kernel_refusal(backend: SDPBackend, width: int, dtype: torch.dtype, device: str) -> str:
    """Why SDPA's `backend` will not run heads `width` wide in `dtype` on `device` ("" when it does): torch's
    own reasons, which it gives as warnings before raising."""
    import warnings

    probe = torch.zeros(1, 1, 8, width, dtype=dtype, device=device)
    with warnings.catch_warnings(record=True) as caught, sdpa_kernel(backend):
        warnings.simplefilter("always")
        try:
            F.scaled_dot_product_attention(probe, probe, probe)
        except RuntimeError as error:
            reasons = [str(w.message).split(" (Triggered internally")[0] for w in caught]
            reasons = [r for r in reasons if r and not r.endswith("because:")]
            return "; ".join(reasons) or str(error).splitlines()[0]
    return ""


def _route(resolved: ResolvedAttention, backend: str, dispatched: list, direct: list, scoped: bool) -> str:
    """How the kernel reached a denoiser's attention, for the receipt."""
    parts = []
    if dispatched:
        parts.append(f"diffusers dispatcher backend '{backend}' on {len(dispatched)} attention modules")
    if direct:
        how = ("as they are" if not scoped else f"under sdpa_kernel({resolved.sdpa_backend.name})"
               if resolved.sdpa_backend else "their SDPA call rerouted")
        parts.append(f"{len(direct)} {type(direct[0].processor).__name__} modules {how}")
    if resolved.backend == SAGE1 and dispatched:
        parts.append("SDPA inside them rerouted to sageattention 1.x")
    return "; ".join(parts)


def _check_direct(resolved: ResolvedAttention, name: str, direct: list[nn.Module]) -> None:
    for module in direct:
        processor = type(module.processor).__name__
        if processor not in SDPA_PROCESSORS:
            raise AttentionError(f"attention={resolved.requested.value!r}: {name}'s attention processor {processor} "
                                 "neither goes through diffusers' dispatcher nor calls torch's SDPA, so no kernel can "
                                 "be set on it; choose 'sdpa' (leaves its attention as it is).")


def _keeps_parallel_backend(resolved: ResolvedAttention, name: str, also_refused: tuple[str, ...] = ()) -> bool:
    """Under context parallelism (diffusers' `enable_parallelism`), whether auto keeps the backend it set.

    A backend without a context-parallel version would attend within each rank's share of the tokens
    only, giving wrong frames without an error: refused, as `set_attention_backend` does. `also_refused`:
    backends the caller refuses for its split mode (ring's), left out of the kernels the message offers."""
    if resolved.requested is AttentionKernel.AUTO:
        return True
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    if resolved.backend not in _AttentionBackendRegistry._supports_context_parallel:
        parallel = _AttentionBackendRegistry._supports_context_parallel
        usable = sorted(k.value for k, b in _DISPATCHER.items() if b in parallel and b not in also_refused)
        raise AttentionError(f"attention={resolved.requested.value!r}: {name} is split across GPUs (context_parallel) "
                             f"and the dispatcher's '{resolved.backend}' has no context-parallel version; choose 'auto' "
                             f"(keeps the split's own) or one of {', '.join(map(repr, usable))}.")
    return False


def _scope_factory(resolved: ResolvedAttention, attend: Callable | None, applied: AppliedAttention):
    """What runs around a direct-SDPA attention forward: None when nothing needs to (plain SDPA). The same
    object for the same kernel in every call (`_sdpa_scope`, `_reroute_scope`): compiled blocks guard on it."""
    if resolved.sdpa_backend is not None:
        return _sdpa_scope(resolved.sdpa_backend)
    if attend is None:
        return None
    scope, applied._counter = _reroute_scope(attend, resolved.device)
    applied._counted_before = applied._counter.calls
    return scope


@lru_cache(maxsize=None)
def _sdpa_scope(backend: SDPBackend) -> Callable:
    return lambda: sdpa_kernel(backend)


@lru_cache(maxsize=None)
def _reroute_scope(attend: Callable, device: str) -> tuple[Callable, _CallCount]:
    counter = _CallCount(device)  # counts every call's reroutes; each call reports its own difference
    return (lambda: _RerouteSdpa(attend, counter)), counter


_ABSENT = object()
_SCOPED_ATTR = "_vidmem_scoped_forward"


@dataclass(frozen=True)
class _InPlace:
    """The scoped forward was found in the module's chain, not installed by this call: the scope and
    in_chain it had, put back when the call ends (an outer call on the same module keeps its kernel)."""

    scope: Callable | None
    in_chain: bool


class _ScopedForward:
    """An attention module's forward run inside a call's scope (`sdpa_kernel(...)`, or the SDPA reroute).

    Made once per module and kept on it (`_SCOPED_ATTR`), so every call installs the very same object.
    Why: dynamo guards a compiled block on its attention module's `forward` by identity, and drops the
    compiled code when that object is freed ("...forward got deallocated"). diffusers' hook registry
    builds a new forward at each registration, so a hook per call recompiled every compiled call after
    the first (CogVideoX with any kernel but plain SDPA). Between calls the module runs its own forward:
    only this inert object stays on it, holding no scope."""

    def __init__(self, module: nn.Module) -> None:
        # What goes on `module.forward`: one function shared by every module, bound to this one. Dynamo guards
        # a compiled block on its attention's forward; an object per module (this one) failed that guard on
        # every other block, so each block compiled its own copy: 30 to 40 full block compiles for a real model
        # instead of one (eager only past vidmem's recompile limit of 64, compile.py). A bound method is guarded
        # by its function.
        self.entry = types.MethodType(_run_scoped, module)
        # What the scope runs: None for the module's own forward, run as its class's function (`function`, one
        # object for every block) with the module passed in: torch 2.9 guards a per-module bound method (the
        # module's own forward) by its id, so every block compiled its own copy again; else a forward found on
        # the module when the call began (someone's wrapper).
        self.function = type(module).forward
        self.inner: Callable | None = None
        self.scope: Callable | None = None
        self.in_chain = False  # left in the module's forward chain (under a wrapper someone put over it)

    def __call__(self, *args, **kwargs):
        """Called by a wrapper put over ours (`in_chain`), not through `entry`."""
        return self.run(self.entry.__self__, *args, **kwargs)

    def run(self, module: nn.Module, *args, **kwargs):
        if self.scope is None:  # released, yet still called: a wrapper put over ours was left in place
            return self._forward(module, args, kwargs)
        with self.scope():
            return self._forward(module, args, kwargs)

    def _forward(self, module: nn.Module, args: tuple, kwargs: dict):
        if self.inner is None:
            return self.function(module, *args, **kwargs)
        return self.inner(*args, **kwargs)

    def release(self, in_chain: bool = False) -> None:
        """Out of the call's scope. `in_chain`: something still calls this object (a wrapper left over
        it), so it keeps calling what it wrapped; else it lets go of that."""
        self.scope, self.in_chain = None, in_chain
        if not in_chain:
            self.inner = None


def _run_scoped(module: nn.Module, *args, **kwargs):
    """`module.forward` while scoped (`_ScopedForward.entry`): its `_ScopedForward`, run."""
    return getattr(module, _SCOPED_ATTR).run(module, *args, **kwargs)


def _scope_forward(applied: AppliedAttention, module: nn.Module, scope: Callable) -> None:
    """Run `module`'s forward (its own, or the one found on it) inside `scope` until `applied` is removed."""
    scoped = module.__dict__.get(_SCOPED_ATTR)
    if scoped is None:
        scoped = _ScopedForward(module)
        module.__dict__[_SCOPED_ATTR] = scoped  # not a Module or Parameter: no state_dict entry, no .to()
    found = module.__dict__.get("forward", _ABSENT)
    if found is scoped.entry or (scoped.in_chain and _calls_scoped(found, scoped)):
        # Ours is still called from the module's forward (an outer call's, or a wrapper left over it calls
        # it): scope it where it is. Installing it again would make it wrap the wrapper that calls it: no end.
        applied._scoped.append((module, scoped, _InPlace(scoped.scope, scoped.in_chain)))
        scoped.scope = scope
        return
    scoped.inner, scoped.scope = (None if found is _ABSENT else found), scope
    module.forward = scoped.entry
    applied._scoped.append((module, scoped, found))


def _calls_scoped(forward: object, scoped: _ScopedForward, depth: int = 8) -> bool:
    """Whether `forward` reaches ours: it is ours, or wraps it as wrappers say so (`__wrapped__`, a bound
    method's `__self__`, a partial's `func`, a closure's cells), `depth` links deep at most. A module itself
    is not followed (the class's forward bound to the module holds ours only as the module's attribute)."""
    seen: set[int] = set()
    todo = [(forward, 0)]
    while todo:
        found, level = todo.pop()
        if found is scoped or found is scoped.entry or getattr(found, "__func__", None) is _run_scoped:
            return True
        if id(found) in seen or level >= depth or found is None or isinstance(found, nn.Module):
            continue
        seen.add(id(found))
        cells = getattr(found, "__closure__", None) or ()
        links = [getattr(found, name, None) for name in ("__wrapped__", "__self__", "func")]
        todo.extend((link, level + 1) for link in [*links, *(_cell_contents(cell) for cell in cells)])
    return False


def _cell_contents(cell) -> object:
    try:
        return cell.cell_contents
    except ValueError:  # a cell not filled yet
        return None


def _check_dispatcher(resolved: ResolvedAttention) -> None:
    """diffusers' own requirement check for its backend, worded as a refusal (never mid-run)."""
    if resolved.backend == SAGE1:
        return
    from diffusers.models.attention_dispatch import _check_attention_backend_requirements

    try:
        _check_attention_backend_requirements(_backend_name(resolved.backend))
    except RuntimeError as error:
        raise AttentionError(f"attention={resolved.requested.value!r}: {error} Or choose 'auto'.") from None


def _backend_name(name: str):
    from diffusers.models.attention_dispatch import AttentionBackendName

    return AttentionBackendName(name)


def _rerouted_attention(resolved: ResolvedAttention) -> Callable | None:
    """For kernels outside SDPA: a function with SDPA's signature (heads before sequence) that runs it, the
    same object in every call (compiled blocks guard on it)."""
    if resolved.backend == SAGE1:
        return _sage1_attention(_import_sageattn())
    if resolved.kernel in (AttentionKernel.FLEX, AttentionKernel.SAGE):
        return _dispatched_attention(_backend_name(resolved.backend))
    return None


def _import_sageattn() -> Callable:
    try:
        return importlib.import_module("sageattention").sageattn
    except (ImportError, AttributeError) as error:
        raise AttentionError(f"attention='sage': sageattention did not import ({error}): {SAGE_FIX}.") from None


@lru_cache(maxsize=None)
def _sage1_attention(sageattn: Callable) -> Callable:
    def attend(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if attn_mask is not None or dropout_p or enable_gqa:
            raise AttentionError("attention='sage': this model's attention passes a mask, dropout or grouped heads, "
                                 "which SageAttention 1.x does not take; choose 'auto'.")
        # sageattn smooths K by subtracting its mean over the sequence *in place* (`k -= km`): the caller's key,
        # which the model owns and may read again (a key reused across calls). The same smoothing, out of place.
        key = key - key.mean(dim=2, keepdim=True)
        return sageattn(query, key, value, tensor_layout="HND", is_causal=is_causal, sm_scale=scale, smooth_k=False)

    return attend


@lru_cache(maxsize=None)
def _dispatched_attention(backend) -> Callable:
    from diffusers.models import attention_dispatch

    def attend(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        # SDPA takes (batch, heads, sequence, dim); the dispatcher (batch, sequence, heads, dim).
        out = attention_dispatch.dispatch_attention_fn(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                                       attn_mask, dropout_p, is_causal, scale, enable_gqa, backend=backend)
        return out.transpose(1, 2)

    return attend


class _CallCount:
    """SDPA calls rerouted, counted in a tensor: compiled blocks guard a Python int by its value (each new
    count recompiled), a tensor only by its shape and dtype, and the graph adds to it in place."""

    def __init__(self, device: str) -> None:
        self._tensor = torch.zeros((), dtype=torch.int64, device=device)  # on the attention's device: one graph

    def add(self) -> None:
        self._tensor.add_(1)

    @property
    def calls(self) -> int:
        return int(self._tensor)


class _RerouteSdpa(TorchFunctionMode):
    """Inside one attention forward: torch's SDPA call goes to `attend` instead (counted)."""

    def __init__(self, attend: Callable, counter: _CallCount) -> None:
        super().__init__()
        self._attend, self._counter = attend, counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            self._counter.add()
            return self._attend(*args, **kwargs)
        if func is torch.Tensor.unflatten and not _named_shape(args[2] if len(args) > 2 else kwargs.get("sizes")):
            # Tensor.unflatten is torch's Python wrapper over the C op, and dynamo cannot trace its
            # `super().unflatten()` when the mode hands it on: one graph break per call in every compiled
            # Wan block (its processor unflattens the heads). The C op, as the wrapper calls it for plain sizes.
            return torch.unflatten(*args, **kwargs)
        return func(*args, **kwargs)


def _named_shape(sizes) -> bool:
    """Tensor.unflatten's named form ((name, size) pairs), which only its Python wrapper takes."""
    return isinstance(sizes, dict) or (isinstance(sizes, (tuple, list)) and bool(sizes) and isinstance(sizes[0], (tuple, list)))
