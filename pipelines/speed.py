"""Speed: the Speed (VidMem) node's choices for one Sampler call, and applying them.

Three independent parts, each in its own module: the attention kernel (pipelines/attention.py),
compiled blocks (pipelines/compile.py) and fp8 matmul (memory/storage/fp8_matmul.py). This module
holds the choices together (`Speed`), resolves what depends on the device and the model before any
weight moves (`resolve_speed`: a kernel that cannot run here, or fp8 matmul asked of a card without
it, is refused there, naming the input and the fix), and applies them around one call
(`speed_for_call`), each undone in reverse on success, error or Cancel.

Without a Speed node every choice is what ran before vidmem had one: plain SDPA (also auto's pick, on
every device), eager blocks, fp8 weights upcast. So CPU frames stay
bit-identical to plain diffusers unless a lossy choice is asked for by name.
"""

from __future__ import annotations

import json
import logging
import platform
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Mapping, Sequence

import torch
from torch import nn

from ..memory.accounting import Attention
from ..memory.plan.costs import MeasuredSpeed
from ..memory.storage.fp8_matmul import (AUTO_REASON, FIX, NO_FP8_LAYERS, Fp8Matmul, check_fp8_matmul, fp8_matmul_for_call,
                                         fp8_matmul_support, multiplied_as_stored)
from ..memory.strategy import StrategyError, parse_enum
from .attention import (SAGE1, WHY, AttentionKernel, ResolvedAttention, attention_for_call, check_mask,
                        resolve_attention, sdpa_pick)
from .compile import CompileSettings, compiled_blocks

log = logging.getLogger("vidmem")

if TYPE_CHECKING:
    from .activation_chunks import AppliedChunks


@dataclass(frozen=True)
class Speed:
    """What a Sampler call computes with. `fp8_matmul` defaults to off here (no Speed node: exact to
    the stored weights); the Speed node's own default is auto."""

    attention: AttentionKernel = AttentionKernel.AUTO
    compile: CompileSettings = field(default_factory=CompileSettings)
    fp8_matmul: Fp8Matmul = Fp8Matmul.OFF
    chosen: bool = True  # False: no Speed node (NO_SPEED_NODE): the attention is left as the model has it

    def __post_init__(self) -> None:
        object.__setattr__(self, "attention", parse_enum(AttentionKernel, self.attention, "attention"))
        object.__setattr__(self, "fp8_matmul", parse_enum(Fp8Matmul, self.fp8_matmul, "fp8_matmul"))
        if not isinstance(self.compile, CompileSettings):
            raise StrategyError(f"compile={self.compile!r} must be a CompileSettings (on, mode, dynamic).")

    def describe(self) -> str:
        """`attention auto, compiled blocks (default, dynamic auto), fp8 matmul off`."""
        compiled = f"compiled blocks ({self.compile.describe()})" if self.compile.on else "eager blocks"
        return f"attention {self.attention.value}, {compiled}, fp8 matmul {self.fp8_matmul.value}"


NO_SPEED_NODE = Speed(chosen=False)  # what the Sampler runs without a Speed node


def planned_attention(speed: Speed) -> Attention:
    """How the planner counts the attention `speed` chooses, before it is resolved on the device (the plan of a GPU
    this process may not see): math and flex hold the whole score matrix (flex unless compiled, and the planner does
    not count on that); every other kernel is fused. A run counts the kernel resolved on its device instead
    (`ResolvedSpeed.planned_attention`: auto may fall back to SDPA's math kernel there)."""
    return Attention.MATH if speed.attention in (AttentionKernel.MATH, AttentionKernel.FLEX) else Attention.FUSED


@dataclass(frozen=True)
class ResolvedSpeed:
    """`speed` with its attention kernel resolved for this device and dtype."""

    speed: Speed
    attention: ResolvedAttention

    def check_chunks(self, chunks: int) -> None:
        """Refuse what cannot run with `chunks` activation slices (pipelines/activation_chunks.py): SageAttention
        1.x, which vidmem reaches by rerouting each attention module's forward, as the slices call diffusers'
        dispatcher directly. Compiled blocks can: they compile the slices' steps (pipelines/compile.py)."""
        if chunks > 1 and self.attention.backend == SAGE1:
            raise StrategyError(f"attention='sage' with sageattention 1.x cannot run with activation_chunks={chunks}: "
                                "the slices call diffusers' dispatcher, which needs sageattention 2.1.1 or newer; set "
                                "activation_chunks off (if the video fits), or choose attention 'auto'.")

    @property
    def planned_attention(self) -> Attention:
        """How the run's room, the OOM ladder and activation_chunks=auto count attention: from the kernel resolved
        here, so an auto that falls back to SDPA's math kernel (an sm75 card in bf16) counts the whole score matrix
        as 'math' does, which is the matrix activation chunks shrink."""
        return Attention.MATH if self.attention.materialises_scores else Attention.FUSED

    @property
    def takes_chunks(self) -> bool:
        """Whether a call may run in activation chunks (the OOM ladder offers chunk rungs only then)."""
        return self.attention.backend != SAGE1

    @property
    def untouched_attention(self) -> bool:
        """No Speed node, or auto resolved to plain SDPA: what the model runs without vidmem, so its processors
        are left as they are (SDPA choosing per call, a backend set on them or diffusers' active one)."""
        auto_sdpa = self.speed.attention is AttentionKernel.AUTO and self.attention.kernel is AttentionKernel.SDPA
        return not self.speed.chosen or auto_sdpa


def resolve_speed(speed: Speed, device: torch.device, dtype: torch.dtype,
                  denoisers: Mapping[str, nn.Module] | None = None, context_parallel: bool = False,
                  masked_by: str = "") -> ResolvedSpeed:
    """The kernel `speed.attention` means here, and fp8 matmul 'on' checked against the device and the
    model's layers (`denoisers`); StrategyError naming the input and the fix. Touches no weight.
    `masked_by`: the model, when its attention passes a mask (sample_checks.masked_by): SDPA with only mask-less
    kernels left switched on is refused here, as the plan refuses it, not at the first attention call."""
    check_compile_with(speed, context_parallel)
    check_fp8_matmul(denoisers or {}, speed.fp8_matmul, device)
    resolved = ResolvedSpeed(speed, resolve_attention(speed.attention, device, dtype, masked_by))
    if resolved.attention.fallback:
        _warn_math_kernel(resolved.attention.requested.value, resolved.attention.dtype, resolved.attention.fallback)
    return resolved


@lru_cache(maxsize=None)
def _warn_math_kernel(requested: str, dtype: str, fallback: str) -> None:
    """Once per process and case: the run's attention falls back to SDPA's math kernel (the queue check and the chart
    resolve it too, for every dtype, and must not warn for a run that will not happen)."""
    log.warning("vidmem: attention %s found no fused kernel SDPA would pick for %s on this GPU; SDPA will use its "
                "math kernel, which holds the whole score matrix (%s)", requested, dtype, fallback)


def check_compile_with(speed: Speed, context_parallel: bool) -> None:
    """StrategyError where compiled blocks cannot run with the Memory Strategy's context parallelism."""
    if context_parallel and speed.compile.on:
        # diffusers' context parallelism hooks the first block's forward, which compiled blocks would have to wrap.
        raise StrategyError("compile on the Speed node cannot run with context_parallel on the Memory Strategy yet: "
                            "diffusers' context parallelism replaces the first block's forward; set compile off, or "
                            "context_parallel off.")


@dataclass
class AppliedSpeed:
    """What one call ran with; `as_dict()` is the receipt's `speed` entry."""

    resolved: ResolvedSpeed
    attention: object
    fp8: object
    compiled: object

    def as_dict(self) -> dict:
        return {"attention": self.attention.as_dict(), "compile": self.compiled.as_dict(), "fp8_matmul": self.fp8.as_dict()}


@contextmanager
def speed_for_call(resolved: ResolvedSpeed, denoisers: Mapping[str, nn.Module],
                   blocks: Mapping[str, Sequence[nn.Module]], device: torch.device,
                   chunked: AppliedChunks | None = None) -> Iterator[AppliedSpeed]:
    """Apply `resolved` to the call's denoisers (name -> module) and their repeated blocks for the
    block of the `with`; everything is put back in reverse order when it ends, however it ends.
    `chunked`: the call's activation chunks, applied before (compiled blocks then compile their steps)."""
    if chunked is not None:
        resolved.check_chunks(chunked.chunks)
    with ExitStack() as stack:
        attention = _Untouched(resolved.attention, resolved.speed.chosen) if resolved.untouched_attention else \
            stack.enter_context(attention_for_call(denoisers, resolved.attention))
        fp8 = stack.enter_context(fp8_matmul_for_call(denoisers, resolved.speed.fp8_matmul, device))
        compiled = stack.enter_context(compiled_blocks(blocks, resolved.speed.compile, chunked))
        yield AppliedSpeed(resolved, attention, fp8, compiled)


@dataclass(frozen=True)
class _Untouched:
    """The receipt's attention entry when the processors were left as the model has them."""

    resolved: ResolvedAttention
    chosen: bool  # a Speed node chose auto (False: no Speed node)

    def as_dict(self) -> dict:
        found = {**self.resolved.as_dict(), "kernel": AttentionKernel.SDPA.value,
                 "applied": "left as the model has it: SDPA choosing its kernel per call, as without vidmem"}
        if not self.chosen:
            return {**found, "why": WHY[AttentionKernel.SDPA]}
        pick = sdpa_pick(self.resolved.device, getattr(torch, self.resolved.dtype))  # dtype: torch's own name
        return {**found, **({"sdpa_picks": pick} if pick else {})}  # auto's own why: the measurement


# --- What the plan says before the run -------------------------------------------------------------

MEASURED = Path(__file__).parent / "configs" / "speedups.json"  # bench/speed.py's figures, per device name


def speed_plan_line(speed: Speed, device: str | torch.device, dtype: torch.dtype, masked_by: str = "",
                    context_parallel: bool = False, storage: Sequence[str] | None = None) -> str:
    """The Speed node's choices as they would resolve on `device` ("cuda", "cuda:1", "cpu"), for the plan:
    the kernel auto picks (or why a choice is refused), compiled or not, fp8 matmul or why not, and
    the per-step time measured on this device where bench/speed.py has measured it. `masked_by`: the
    model, when its attention passes a mask (a mask-less kernel is refused as the Sampler refuses it);
    `context_parallel`: the Memory Strategy splits tokens across GPUs (compiled blocks are refused);
    `storage`: the formats the denoisers are stored in (none: the compute dtype; None: not known): where none is
    float8_e4m3fn 'on' is refused as the Sampler refuses it, and no fp8 figure is quoted."""
    fp8_layers = None if storage is None else any(map(multiplied_as_stored, storage))
    stored_as = tuple(storage or ())
    try:
        check_compile_with(speed, context_parallel)
        compiled = ("compiled blocks (the first run compiles, later runs of this graph reuse it)" if speed.compile.on
                    else "eager blocks")
    except StrategyError as error:
        compiled = f"refused: {error}"
    if not _visible(device):  # planning for a GPU this process cannot see
        try:
            check_mask(speed.attention, masked_by)
        except StrategyError as error:
            return f"refused: {error}; {compiled}"
        if fp8_layers is False and speed.fp8_matmul is not Fp8Matmul.OFF:  # the weights decide that here already
            return (f"attention {speed.attention.value}: resolved on the GPU when the run starts; {compiled}; "
                    f"{_fp8_plan_text(speed.fp8_matmul, device, fp8_layers, stored_as)}")
        return (f"attention {speed.attention.value}, fp8 matmul {speed.fp8_matmul.value}: resolved on the GPU when the "
                f"run starts; {compiled}")
    try:
        attention = f"attention {resolve_attention(speed.attention, device, dtype, masked_by).describe()}"
    except StrategyError as error:
        attention = f"refused: {error}"
    fp8 = _fp8_plan_text(speed.fp8_matmul, device, fp8_layers, stored_as)
    if fp8_layers is False:  # nothing multiplies in fp8: the time quotes no fp8 figure either
        speed = replace(speed, fp8_matmul=Fp8Matmul.OFF)
    measured = measured_line(speed, device, context_parallel)
    return f"{attention}; {compiled}; {fp8}" + (f". {measured}" if measured else "")


def _fp8_plan_text(choice: Fp8Matmul, device: str | torch.device, fp8_layers: bool | None = None,
                   stored_as: Sequence[str] = ()) -> str:
    """What fp8 matmul does in the run, by the Sampler's rule (memory/storage/fp8_matmul.py `_decline`): 'on'
    refused where the weights or the device cannot take it; auto upcasts, for the device's reason first (the weights'
    alone for a GPU this process cannot see)."""
    if choice is Fp8Matmul.OFF:
        return "fp8 weights upcast (fp8_matmul off)"
    layers = None
    if fp8_layers is False:
        layers = (f"the denoiser's weights are stored as {', '.join(sorted(stored_as))}, not float8_e4m3fn" if stored_as
                  else NO_FP8_LAYERS)
    if choice is Fp8Matmul.ON:
        if layers:
            return f"refused: fp8_matmul='on' cannot run here: {layers}; {FIX}"
        if _fp8_enabled(choice, device):
            return "fp8 matmul on the model's fp8 layers (their inputs rounded to fp8 too)"
        return f"refused: fp8_matmul='on' cannot run here: {fp8_matmul_support(device)}"
    device_reason = fp8_matmul_support(device) if _visible(device) else None
    return f"fp8 weights upcast: {device_reason or layers or AUTO_REASON}"


def _fp8_enabled(choice: Fp8Matmul, device: str | torch.device) -> bool:
    """Whether a run on `device` (one this process sees) multiplies fp8 layers in fp8 (fp8_matmul_for_call's rule: only 'on', also on
    the CPU; auto upcasts)."""
    if choice is not Fp8Matmul.ON:
        return False
    return fp8_matmul_support(device) is None or torch.device(device).type == "cpu"


def measured_speed(speed: Speed, device: str | torch.device, lora_hooks: bool = False,
                   context_parallel: bool = False) -> MeasuredSpeed:
    """What the plan's time estimate multiplies the denoiser's compute by for `speed`'s choices on `device` ("cuda",
    "cuda:1", "cpu"; a GPU without an index is the current one): configs/speedups.json's ratios (1.0 for a choice not
    measured there, or not made), and whether fp8 layers multiply
    in fp8. Nothing for a GPU this process cannot see (its name is unknown). `lora_hooks`: LoRAs run beside their
    layers (memory/lora.py), traced into the compiled blocks' graphs: timed with the figure measured with a LoRA
    (`compile_lora`) where there is one, else with the blocks' own. `context_parallel`: compile is refused."""
    ratios = _measured_ratios(speed, device, context_parallel)
    with_loras = ratios.pop("compiled_lora", None)
    if lora_hooks and "compiled" in ratios and with_loras is not None:
        ratios["compiled"] = with_loras
    fp8_on = _visible(device) and _fp8_enabled(speed.fp8_matmul, device)
    return MeasuredSpeed(**ratios, fp8_matmul_on=fp8_on, compiled_on=speed.compile.on and not context_parallel)


def measured_line(speed: Speed, device: str | torch.device, context_parallel: bool = False) -> str:
    """"measured on <device>: ..." from configs/speedups.json for this device, or "" where none is known; the
    figures the time uses (`_measured_ratios`: no compiled blocks where context parallelism refuses them)."""
    ratios = _measured_ratios(speed, device, context_parallel)
    if not ratios:
        return ""
    names = {"kernel": f"attention {speed.attention.value}", "compiled": "compiled blocks",
             "compiled_sequential": "compiled blocks under sequential", "compiled_lora": "compiled blocks with a LoRA",
             "fp8_matmul": "fp8 matmul with eager blocks" if speed.compile.on else "fp8 matmul",
             "compiled_fp8_matmul": "compiled blocks with fp8 matmul"}
    parts = ", ".join(f"{names[part]} x{ratio:.2f}" for part, ratio in ratios.items())
    entry = _measured()[device_name(device)]
    sources = dict.fromkeys(entry.get("sources", {}).get(_ENTRY_KEYS[part], entry["source"]) for part in ratios)
    return f"Measured on this {torch.device(device).type} (step time against eager SDPA, {', '.join(sources)}): {parts}"


# MeasuredSpeed's fields -> the speedups.json keys they are read from (a figure's own "sources" entry is keyed so too).
_ENTRY_KEYS = {"kernel": "attention", "compiled": "compile", "compiled_sequential": "compile_sequential",
               "compiled_lora": "compile_lora", "fp8_matmul": "fp8_matmul", "compiled_fp8_matmul": "compile_fp8_matmul"}


def _measured_ratios(speed: Speed, device: str | torch.device, context_parallel: bool = False) -> dict[str, float]:
    """MeasuredSpeed's ratios this device's entry measured for the choices `speed` makes: an attention kernel chosen
    by name (auto's pick is the baseline's; flex's eager figure not with compile on, which fuses it), compiled blocks
    when on (not with context parallelism, which refuses them), fp8 matmul where a run enables it, and the two
    together where measured as a pair (MeasuredSpeed.ratio says which figure a tier and storage take)."""
    entry = _measured().get(device_name(device)) if _visible(device) else None
    if entry is None:
        return {}
    compiled = speed.compile.on and not context_parallel
    kernel = speed.attention is not AttentionKernel.AUTO and not (compiled and speed.attention is AttentionKernel.FLEX)
    fp8 = _fp8_enabled(speed.fp8_matmul, device)
    made = {"kernel": kernel, "compiled": compiled, "compiled_sequential": compiled, "compiled_lora": compiled,
            "fp8_matmul": fp8, "compiled_fp8_matmul": compiled and fp8}
    ratios = {part: entry.get(_ENTRY_KEYS[part]) for part, chosen in made.items() if chosen}
    if "kernel" in ratios:
        ratios["kernel"] = (ratios["kernel"] or {}).get(speed.attention.value)
    return {part: ratio for part, ratio in ratios.items() if ratio is not None}


def _visible(device: str | torch.device) -> bool:
    """Whether this process computes on `device` itself (a plan for a GPU it cannot see knows nothing of it)."""
    return not (torch.device(device).type == "cuda" and not torch.cuda.is_available())


def device_name(device: str | torch.device) -> str:
    """The name bench/speed.py records a device's figures under: the GPU's (that of `device`'s index, as a machine may
    hold two kinds; the current one's without), or the CPU's model name; "" for another device type (no figures are
    recorded for it, and the host CPU's must not stand in)."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device.index)
    return cpu_name() if device.type == "cpu" else ""


def cpu_name() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else platform.processor()


@lru_cache(maxsize=1)
def _measured() -> dict[str, dict]:
    if not MEASURED.is_file():
        return {}
    return {entry["device"]: entry for entry in json.loads(MEASURED.read_text(encoding="utf-8"))["devices"]}
