"""fp8 matmul for one call: stored fp8 linear layers multiply with torch._scaled_mm instead of
upcasting their weight first.

How it works: while `fp8_matmul_for_call` is open, every StoredLinear of the given modules whose
weight is float8_e4m3fn with a per-tensor scale (or none), whose dimensions are multiples of 16 and
whose file does not ask for full-precision matmul on it (ComfyUI's `full_precision_matrix_mult`,
which ComfyUI always honours: scaled.py) quantizes its input to e4m3fn (dynamic per-tensor scale)
and hands the stored bytes, as they are, to `torch._scaled_mm` (modules.py). Nothing is copied or
converted: the layers only carry a tally for the call, removed in `finally`, so every tier
(block_swap and sequential stream the same fp8 buffers) runs it unchanged, and a layer that cannot
take part upcasts as always, counted with its reason in the receipt.

Priorities: `on` uses it where the card has fp8 tensor cores (CUDA capability 8.9: Ada, Hopper and
newer), the same rule as ComfyUI's `supports_fp8_compute`. `auto` upcasts everywhere for now: on
the GPUs measured (an H100 and an H200, eager blocks) fp8 matmul made a step slower (`AUTO_REASON`),
since rounding each input to fp8 costs more than the fp8 GEMM saves at these widths. On the CPU
`auto` stays off, so CPU frames remain bit-identical to plain diffusers; `on` is allowed there
(torch's CPU kernel emulates it, slowly) so the path can be tested without a GPU. `on` where no kernel exists (older
CUDA cards, MPS, ROCm's other fp8 types) or with no fp8 layer at all is refused before any model
work, naming the input and the fix.

Caveats: quantizing activations to 3 mantissa bits costs quality, unlike the upcast path, which is
exact to the stored weights; the receipt (`as_dict`) counts the layers that ran in fp8 and those
that fell back, and why.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from typing import Iterator, Mapping

import torch
from torch import nn

from ..strategy import StrategyError
from .formats import storage_format
from .modules import Fp8MatmulTally, StoredLinear

MIN_CAPABILITY = (8, 9)  # fp8 tensor cores: Ada (8.9), Hopper (9.0) and newer
CPU_REASON = "on the CPU auto keeps frames bit-identical to plain diffusers ('on' runs torch's slow CPU kernel)"
FIX = "set fp8_matmul to 'auto' or 'off' (both upcast the fp8 weights)"
# Why auto upcasts where fp8 tensor cores exist: bench/speed.py's fp8_matmul part, Wan 1.3B-shaped blocks, eager.
AUTO_REASON = ("auto upcasts: fp8 matmul measured slower than upcasting on Hopper GPUs (step time x1.14 at 832x480x81 on "
               "an H100, x1.25 at 480x320x17 on an H200: rounding each layer's input to fp8 costs more than the fp8 "
               "GEMM saves); set fp8_matmul to 'on' to use it anyway")


class Fp8Matmul(str, Enum):
    AUTO = "auto"  # upcast: measured slower on the GPUs that have fp8 tensor cores (AUTO_REASON)
    ON = "on"  # required: refused where it cannot run
    OFF = "off"  # always upcast (exact to the stored weights)


class Fp8MatmulError(StrategyError):
    """fp8_matmul was asked for where it cannot run; the message names the input and the fix."""


def fp8_matmul_support(device: torch.device | str, modules: Mapping[str, nn.Module] | None = None) -> str | None:
    """None when fp8 matmul can run on `device` (and, given `modules`, they hold a layer that can take
    it); otherwise the reason, in words for the receipt."""
    device = torch.device(device)
    if not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has no torch._scaled_mm"
    if device.type == "cpu":
        return CPU_REASON
    if device.type != "cuda":
        return f"{device.type} devices have no fp8 matmul kernel in torch"
    if torch.version.hip:
        return "ROCm: not verified by vidmem (MI300 multiplies float8_e4m3fnuz, not the float8_e4m3fn the files store)"
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        return f"CUDA capability {capability[0]}.{capability[1]} < 8.9 (no fp8 tensor cores; Ada, Hopper and newer have them)"
    if modules is not None and not _eligible(_stored_linears(modules)):
        return _no_layers_reason(_stored_linears(modules))
    return None


@dataclass
class Fp8MatmulReport:
    """What one call did: filled while it runs, read for the receipt with `as_dict()`."""

    choice: Fp8Matmul
    reason: str | None = None  # why it is off (auto declined, or 'off'); None when enabled
    refused: dict[str, str] = field(default_factory=dict)  # layer -> why it cannot take part at all
    tallies: dict[str, Fp8MatmulTally] = field(default_factory=dict)  # enabled layers

    @property
    def enabled(self) -> bool:
        return self.reason is None

    def as_dict(self) -> dict:
        fell_back: Counter = Counter(self.refused.values())
        examples = {reason: name for name, reason in reversed(self.refused.items())}
        for name, tally in self.tallies.items():
            for reason in tally.fallbacks:
                fell_back[reason] += 1
                examples.setdefault(reason, name)
        return {
            "choice": self.choice.value,
            "enabled": self.enabled,
            "reason": self.reason,
            "fp8_layers": sum(1 for t in self.tallies.values() if t.fp8_calls),
            "fp8_calls": sum(t.fp8_calls for t in self.tallies.values()),
            "fallback_layers": dict(fell_back),  # reason -> layers that upcast at least once for it
            "fallback_calls": sum(sum(t.fallbacks.values()) for t in self.tallies.values()),
            "fallback_examples": examples,  # reason -> one layer it applied to
        }


@contextmanager
def fp8_matmul_for_call(modules: Mapping[str, nn.Module], choice: Fp8Matmul | str, device: torch.device | str) -> Iterator[Fp8MatmulReport]:
    """Enable fp8 matmul on every eligible StoredLinear inside `modules` (name -> module, e.g.
    {"transformer": pipe.transformer}) for the block, and disable it in `finally`.

    `choice` 'on' raises Fp8MatmulError (before touching any layer) where `fp8_matmul_support(device)`
    says no, except on the CPU; 'auto' and 'off' change nothing (auto's reason in the report). Yields the
    call's Fp8MatmulReport.

        with fp8_matmul_for_call({"transformer": pipe.transformer}, "auto", device) as fp8:
            ...  # sample
        receipt["fp8_matmul"] = fp8.as_dict()
    """
    choice = _parse(choice)
    layers = _stored_linears(modules)
    report = Fp8MatmulReport(choice, reason=_decline(choice, torch.device(device), layers))
    if not report.enabled:
        yield report
        return
    before = {name: layer.__dict__.get("fp8_matmul") for name, layer in layers.items()}
    try:
        for name, layer in layers.items():
            problem = layer.fp8_matmul_problem()
            if problem:
                report.refused[name] = problem
            else:
                layer.fp8_matmul = report.tallies[name] = Fp8MatmulTally()
        yield report
    finally:
        for name, layer in layers.items():  # as found: the class default (off) unless a caller had set one
            if before[name] is None:
                layer.__dict__.pop("fp8_matmul", None)
            else:
                layer.fp8_matmul = before[name]


def check_fp8_matmul(modules: Mapping[str, nn.Module], choice: Fp8Matmul | str, device: torch.device | str) -> None:
    """Fp8MatmulError where `choice` is 'on' and cannot run on `device` for `modules`; for callers that
    refuse before any model work (the Sampler), with the same rule `fp8_matmul_for_call` applies."""
    _decline(_parse(choice), torch.device(device), _stored_linears(modules))


def _parse(choice: Fp8Matmul | str) -> Fp8Matmul:
    try:
        return Fp8Matmul(choice)
    except ValueError:
        raise Fp8MatmulError(f"fp8_matmul={choice!r} is not a choice; use one of {', '.join(c.value for c in Fp8Matmul)}.") from None


def _decline(choice: Fp8Matmul, device: torch.device, layers: dict[str, StoredLinear]) -> str | None:
    """Why this call runs without fp8 matmul (None: it runs with it); raises for 'on' that cannot run."""
    if choice is Fp8Matmul.OFF:
        return "fp8_matmul is 'off'"
    device_reason = fp8_matmul_support(device)
    layer_reason = None if _eligible(layers) else _no_layers_reason(layers)
    if choice is Fp8Matmul.AUTO:
        return device_reason or layer_reason or AUTO_REASON
    blocking = layer_reason or (None if device_reason == CPU_REASON else device_reason)
    if blocking:
        raise Fp8MatmulError(f"fp8_matmul='on' cannot run here: {blocking}; {FIX}.")
    return None


def _stored_linears(modules: Mapping[str, nn.Module]) -> dict[str, StoredLinear]:
    """Every StoredLinear inside `modules`, by qualified name, each once (shared modules too)."""
    found: dict[str, StoredLinear] = {}
    seen: set[int] = set()
    for component, module in modules.items():
        for path, layer in module.named_modules():
            if isinstance(layer, StoredLinear) and id(layer) not in seen:
                seen.add(id(layer))
                found[f"{component}.{path}" if path else component] = layer
    return found


def _eligible(layers: dict[str, StoredLinear]) -> bool:
    return any(layer.fp8_matmul_problem() is None for layer in layers.values())


def multiplied_as_stored(format_name: str) -> bool:
    """Whether weights stored as `format_name` (a StorageFormat's name) are what fp8 matmul multiplies as stored:
    float8_e4m3fn, scaled or not (`StoredLinear.fp8_matmul_problem`'s dtype rule, read from the format, for plans)."""
    return storage_format(format_name).torch_dtype == torch.float8_e4m3fn


NO_FP8_LAYERS = "the model has no stored (fp8) linear layers: load it with weight_dtype fp8_e4m3fn or an fp8 (scaled) file"


def _no_layers_reason(layers: dict[str, StoredLinear]) -> str:
    if not layers:
        return NO_FP8_LAYERS
    return (f"none of the model's {len(layers)} stored linear layers can take it "
            f"(e.g. {next(iter(layers.values())).fp8_matmul_problem()})")
