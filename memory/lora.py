"""apply_loras: low-rank updates that run beside their layers for one call, then leave no trace.

Why beside the layer: a LoRA adds `scale * up @ down` to a weight. Fusing it would copy or rewrite
every targeted weight, which is impossible to undo cheaply for fp8 or GGUF storage and doubles
the bytes moved for streamed tiers. Instead each targeted layer gets a forward hook adding
`scale * up(down(x))` to its output, computed in the dtype of the layer's input (its compute
dtype), whatever the layer stores its own weight in. Any module with `in_features`,
`out_features` and a `forward(x)` qualifies (nn.Linear, the storage engine's StoredLinear).

Where the LoRA tensors live: as non-persistent buffers on the target module itself, for the
call. Offloading groups are built from each module's own parameters and buffers, so the LoRA
tensors stream with their layer under every tier (a swapped block, a sequential leaf).

Ordering rule: apply LoRAs first, then the MemoryStrategy, and remove in reverse (nested `with`):

    with apply_loras(patches), apply_strategy(stage, strategy, backend) as handle:
        ...

That way the strategy's residency groups include the LoRA buffers, and its post-forward
eviction hook (registered later) runs after the LoRA hook has read them.

Compiled blocks (pipelines/compile.py): the hooks on layers inside the modules given as `traced_in`
are traced into the blocks' graphs, the strength read from a 0-dim buffer (`_traced_hook`); the
others run eagerly (`_eager_hook`: inside a compiled block, a graph break).

LoRAs are a property of the call, not of the module: two pipelines sharing modules each apply
their own set for their own call. Strength 0 registers nothing, so it gives the base exactly.

The fused alternative (`apply_loras(patches, fuse=True)`, plain floating-point weights only):
each targeted weight is re-pointed to a new tensor `W + sum of scale * up @ down` (every patch on
it summed in float32, then rounded once to the weight's dtype, so chained LoRAs on a bf16 weight
are not rounded per LoRA) and pointed back at the untouched original on removal, so the undo is
exact. It saves the per-step cost of the side computation at the price of one extra
copy of every targeted weight in host RAM for the call; quantized storage (fp8, GGUF) is refused
because fusing would need a dequantized copy anyway.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

BUFFER_PREFIX = "_vidmem_lora"


class LoraError(ValueError):
    """A LoRA file or a LoRA request vidmem cannot use; the message names the input and the fix.
    `widget`: the Load LoRA input it is about ("expert", "strength"); "" for the file itself."""

    def __init__(self, message: str, *, widget: str = ""):
        super().__init__(message)
        self.widget = widget


@dataclass(frozen=True)
class LoraPatch:
    """One low-rank (and/or full-delta) update to one linear-like module.

    output += scale * (up(down(x)) + diff(x)) + scale * diff_b. `down` is [rank, in], `up` is
    [out, rank], `diff` a full weight delta [out, in], `diff_b` a bias delta [out].
    """

    module: nn.Module
    scale: float
    down: torch.Tensor | None = None
    up: torch.Tensor | None = None
    diff: torch.Tensor | None = None
    diff_b: torch.Tensor | None = None
    name: str = "layer"  # for messages: the module's path

    def __post_init__(self) -> None:
        if not math.isfinite(self.scale):
            raise LoraError(f"LoRA on {self.name}: scale {self.scale} is not finite; use a finite strength.")
        if (self.down is None) != (self.up is None):
            raise LoraError(f"LoRA on {self.name}: a down matrix needs its up matrix and vice versa; the file is incomplete.")
        if self.down is None and self.diff is None and self.diff_b is None:
            raise LoraError(f"LoRA on {self.name}: no down/up, diff or diff_b tensor; nothing to apply.")
        check_fits(self.module, self.name, self.down, self.up, self.diff, self.diff_b)

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        named = {"down": self.down, "up": self.up, "diff": self.diff, "diff_b": self.diff_b}
        return {kind: t for kind, t in named.items() if t is not None}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def check_fits(module: nn.Module, name: str, down, up, diff, diff_b) -> None:
    """LoraError unless the tensors fit `module` (a linear-like layer), naming both shapes."""
    if not (hasattr(module, "in_features") and hasattr(module, "out_features")):
        raise LoraError(f"LoRA on {name}: {type(module).__name__} is not a linear layer; vidmem applies LoRAs to linear layers only.")
    out_f, in_f = module.out_features, module.in_features
    model = f"the model's layer is [out, in] = [{out_f}, {in_f}]"
    hint = "this LoRA was made for another model family or size; pick a LoRA for this model"
    if down is not None:
        ok = down.dim() == 2 and up.dim() == 2 and down.shape[1] == in_f and up.shape[0] == out_f and up.shape[1] == down.shape[0]
        if not ok:
            raise LoraError(f"LoRA on {name}: down {list(down.shape)} / up {list(up.shape)} do not fit: {model}; {hint}.")
    if diff is not None and tuple(diff.shape) != (out_f, in_f):
        raise LoraError(f"LoRA on {name}: weight delta {list(diff.shape)} does not fit: {model}; {hint}.")
    if diff_b is not None and tuple(diff_b.shape) != (out_f,):
        raise LoraError(f"LoRA on {name}: bias delta {list(diff_b.shape)} does not fit: {model}; {hint}.")


class LoraHandle:
    """The LoRAs applied for one call; `remove()` takes every hook and buffer off again."""

    def __init__(self) -> None:
        self._hooks: list = []
        self._buffers: list[tuple[nn.Module, str]] = []
        self._originals: list[tuple[nn.Parameter, torch.Tensor]] = []  # fused parameters' own tensors
        self._on_layer: dict[int, int] = {}  # id(layer) -> patches attached to it so far
        self.applied: list[LoraPatch] = []

    def __enter__(self) -> "LoraHandle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"LoraHandle({len(self.applied)} patches, {self.nbytes} bytes)"

    @property
    def nbytes(self) -> int:
        """Extra bytes for the call: LoRA tensors beside the layers (with their strengths when traced), or the
        fused weight copies."""
        if self._originals:  # fused: the copies made, not the (already folded) LoRA tensors
            return sum(p.data.numel() * p.data.element_size() for p, _ in self._originals)
        strengths = {id(t): t for t in (m._buffers[name] for m, name in self._buffers if name.endswith("_scale"))}
        return sum(p.nbytes for p in self.applied) + sum(t.nbytes for t in strengths.values())  # each strength once

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        for module, name in self._buffers:
            module._buffers.pop(name, None)
        self._buffers.clear()
        for parameter, original in reversed(self._originals):
            parameter.data = original
        self._originals.clear()
        self._on_layer.clear()
        self.applied.clear()

    def _attach(self, patch: LoraPatch, traced: bool) -> None:
        module = patch.module
        # Numbered per layer (its first patch 0, a chained LoRA's 1), not across the model: every block then holds
        # the same buffer names, and code compiled for one block serves them all (dynamo guards the names).
        position = self._on_layer.get(id(module), 0)
        self._on_layer[id(module)] = position + 1
        prefix = f"{BUFFER_PREFIX}{position}_"
        taken = next((name for name in module._buffers if name.startswith(prefix)), None)
        if taken is not None:
            raise LoraError(f"LoRA on {patch.name}: the layer already carries LoRA buffer '{taken}'; remove the other LoraHandle first.")
        names = {}
        for kind, tensor in patch.tensors.items():
            names[kind] = name = prefix + kind
            module.register_buffer(name, tensor, persistent=False)
            self._buffers.append((module, name))
        if traced:  # the strength as a tensor too, for the hook traced into a compiled block (_traced_hook)
            names["scale"] = name = prefix + "scale"
            module.register_buffer(name, _strength(patch.scale, tensor.device), persistent=False)
            self._buffers.append((module, name))
            hook = module.register_forward_hook(_traced_hook(names, patch.scale, patch.name))
        else:
            hook = module.register_forward_hook(_eager_hook(names, patch.scale), with_kwargs=True)
        self._hooks.append(hook)
        self.applied.append(patch)


def apply_loras(patches: list[LoraPatch] | tuple[LoraPatch, ...], fuse: bool = False,
                traced_in: Collection[nn.Module] = ()) -> LoraHandle:
    """Attach `patches` to their modules for one call; nothing is left applied if this raises.

    `fuse=True` fuses them into plain floating-point weights instead (see the module docstring).
    `traced_in`: the modules the call compiles (its blocks): the hooks of patches on layers inside them are
    traced into their graphs (`_traced_hook`; each such layer also carries its strength in a 0-dim buffer).
    Elsewhere, and without it, a hook runs eagerly (inside a compiled block: a graph break at that layer).

    Patches with scale 0 are skipped entirely (no buffer, no hook), so strength 0 is the base
    model bit for bit. Several patches may target one module (chained LoRAs); each adds its own
    term, in order.

    Example:
        with apply_loras([LoraPatch(block.attn1.to_q, 1.0, down, up, name="blocks.0.attn1.to_q")]):
            out = transformer(**inputs)
    """
    handle = LoraHandle()
    deltas: dict[int, tuple[nn.Parameter, torch.Tensor]] = {}  # fuse: id(parameter) -> (parameter, float32 sum)
    compiled = {id(layer) for module in traced_in for layer in module.modules()}
    try:
        for patch in patches:
            if patch.scale != 0.0:
                _fuse(handle, patch, deltas) if fuse else handle._attach(patch, id(patch.module) in compiled)
        for parameter, delta in deltas.values():  # after every check passed: nothing half-fused
            _replace(handle, parameter, delta)
    except BaseException:
        handle.remove()
        raise
    return handle


FUSABLE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _fuse(handle: LoraHandle, patch: LoraPatch, deltas: dict) -> None:
    """Add the patch's float32 weight (and bias, for diff_b) deltas to `deltas`, per parameter; the
    caller re-points each parameter once, to its original plus the sum, rounded once."""
    module = patch.module
    weight, bias = module._parameters.get("weight"), module._parameters.get("bias")
    if weight is None or weight.dtype not in FUSABLE_DTYPES:
        raise LoraError(f"LoRA on {patch.name}: fuse=True needs a plain floating-point weight, but {type(module).__name__} "
                        "stores it quantized; apply this LoRA beside the layer (fuse=False).")
    if patch.diff_b is not None and bias is None:
        raise LoraError(f"LoRA on {patch.name}: a bias delta cannot be fused into a layer without a bias; use fuse=False.")
    delta = _delta_of(deltas, weight)
    if patch.down is not None:
        delta += (patch.up.to(delta) @ patch.down.to(delta)) * patch.scale
    if patch.diff is not None:
        delta += patch.diff.to(delta) * patch.scale
    if patch.diff_b is not None:
        _delta_of(deltas, bias).add_(patch.diff_b.to(bias.device, torch.float32) * patch.scale)
    handle.applied.append(patch)


def _delta_of(deltas: dict, parameter: nn.Parameter) -> torch.Tensor:
    """The float32 delta summed so far for `parameter` (zeros at first)."""
    if id(parameter) not in deltas:
        deltas[id(parameter)] = (parameter, torch.zeros(parameter.shape, dtype=torch.float32, device=parameter.device))
    return deltas[id(parameter)][1]


def _replace(handle: LoraHandle, parameter: nn.Parameter, delta: torch.Tensor) -> None:
    """parameter.data <- a new tensor (data + delta, rounded once), the original kept for the exact undo."""
    handle._originals.append((parameter, parameter.data))
    parameter.data = (parameter.data.to(torch.float32) + delta).to(parameter.dtype)


# (strength, device) -> its 0-dim float32 tensor, made once (see _strength)
_STRENGTHS: dict[tuple[float, torch.device], torch.Tensor] = {}


def _strength(value: float, device: torch.device) -> torch.Tensor:
    """The strength as one 0-dim tensor, the same object on every layer and in every call: the host pool and the
    warm store know a tensor by its identity, so a new one per call would take a new pinned home each time (the
    pool would grow run over run) and keep every LoRA'd block from staying on the GPU between runs. Shared by
    several blocks, the engine keeps it resident. A few bytes per distinct strength, kept for the process."""
    key = (float(value), torch.device(device))
    if key not in _STRENGTHS:
        _STRENGTHS[key] = torch.tensor(value, dtype=torch.float32, device=device)
    return _STRENGTHS[key]


def _eager_hook(names: dict[str, str], scale: float):
    """A forward hook adding the patch's term to the layer's output, hidden from dynamo.

    The tensors are looked up on the module at call time, never captured: an offloading tier
    re-points buffers to their device copies while the layer runs. Each term is one `addmm_` into
    the output (matmul, scale and add in one BLAS call, no output-sized temporary); with autograd
    recording, the same ops run out of place. Inside a compiled block it is a graph break, and
    nothing of it is guarded (another strength compiles nothing).
    """

    @torch.compiler.disable
    def hook(module: nn.Module, args: tuple, kwargs: dict, output: torch.Tensor) -> torch.Tensor:
        layer_input = args[0] if args else next(iter(kwargs.values()))  # `layer(input=x)` works too
        return _eager_terms(module._buffers, names, scale, layer_input, output)

    return hook


def _traced_hook(names: dict[str, str], scale: float, layer: str):
    """The same hook for a layer inside `apply_loras(..., traced_in=...)`: traced into a compiled block's graph rather
    than breaking it at every patched layer (a graph break per layer made compiled blocks slower than
    eager ones with a LoRA); eagerly, `_eager_hook`'s arithmetic.

    Traced, it reads the strength from the layer's 0-dim `scale` buffer, not the float: dynamo
    specializes on a float's value (another strength compiles the blocks again, once at least) and
    bakes a captured tensor into the graph (another strength would run with the first one's); the layer's buffers,
    re-pointed by a tier, are graph inputs, as its weights are. It takes no keyword arguments:
    torch 2.9 guards a keyword hook by its handle's id, new at every call and on every block, so
    each would compile again. Its qualname names its terms: compiled blocks keep one copy of their
    code per hook layout (pipelines/compile.py, `hook_layout`), so a LoRA with other terms (a weight
    or bias delta) never runs code traced for these.
    """

    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        if not args:
            raise LoraError(f"LoRA on {layer}: the layer was called with its input by keyword, which a LoRA traced "
                            "into compiled blocks cannot see; set the Speed node's compile off for this model.")
        if torch.compiler.is_compiling():
            return _traced_terms(module._buffers, names, args[0], output)
        return _eager_terms(module._buffers, names, scale, args[0], output)

    hook.__qualname__ = f"{hook.__qualname__}[{','.join(names)}]"
    return hook


def _eager_terms(buffers: dict, names: dict[str, str], scale: float, layer_input: torch.Tensor,
                 output: torch.Tensor) -> torch.Tensor:
    in_place = output.is_contiguous() and not (torch.is_grad_enabled() and output.requires_grad)
    rows = output.view(-1, output.shape[-1]) if in_place else output.reshape(-1, output.shape[-1])
    x = layer_input.reshape(-1, layer_input.shape[-1]).to(rows.dtype)
    terms = []
    if "down" in names:
        terms.append((F.linear(x, buffers[names["down"]].to(rows.dtype)), buffers[names["up"]]))
    if "diff" in names:
        terms.append((x, buffers[names["diff"]]))
    for left, weight in terms:
        weight = weight.to(rows.dtype).t()
        rows = rows.addmm_(left, weight, alpha=scale) if in_place else torch.addmm(rows, left, weight, alpha=scale)
    if "diff_b" in names:
        bias = buffers[names["diff_b"]].to(rows.dtype)
        rows = rows.add_(bias, alpha=scale) if in_place else rows.add(bias, alpha=scale)
    return output if in_place else rows.view(output.shape)


def _traced_terms(buffers: dict, names: dict[str, str], layer_input: torch.Tensor,
                  output: torch.Tensor) -> torch.Tensor:
    """The same terms out of place, for the compiler to fuse into the layer's output."""
    x = layer_input.to(output.dtype)
    terms = []
    if "down" in names:
        terms.append(F.linear(F.linear(x, buffers[names["down"]].to(x.dtype)), buffers[names["up"]].to(x.dtype)))
    if "diff" in names:
        terms.append(F.linear(x, buffers[names["diff"]].to(x.dtype)))
    if "diff_b" in names:
        terms.append(buffers[names["diff_b"]].to(x.dtype))
    return output + sum(terms[1:], terms[0]) * buffers[names["scale"]]
