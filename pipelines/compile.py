"""Compiled blocks: regional torch.compile of a denoiser's repeated blocks, for one call, under every tier.

How it works. A video transformer is 30-40 copies of one block class; compiling that class's
`forward` once gives every block the compiled code (diffusers' `compile_repeated_blocks` does the
same), at the compile cost of one block. For one call, `compiled_blocks` points each block's
`forward` at a runner that calls the compiled function, and points it back in `finally`, so
between calls the modules are exactly as loaded.

Where the boundary is, and why. The engine's hooks live in `nn.Module._call_impl`, around
`forward`: block swap's copy and eviction hooks, the step cache's gate, Cancel's check all run on
the block itself, so compiling `forward` (not the module call) keeps them out of the graph; weights
re-pointed between steps are graph *inputs* (torch 2.5+ always inlines nn.Modules and lifts their
parameters and buffers), and dynamo guards their shape, dtype and device, not their address: a
pointer swap does not recompile. Sequential's per-leaf streaming hooks *inside* a block are
`torch.compiler.disable`d in memory/: each is a graph break, the hook runs eagerly between two
graphs. A LoRA's hooks beside its layers are traced into the graph when applied with `traced_in`
(memory/lora.py; the Sampler passes the blocks when its Speed node compiles).

The caveats that shape the cache. (1) By default dynamo does not guard on *empty* module hook
dicts (`torch._dynamo.config.skip_nnmodule_hook_guards`): code compiled while a block's leaves had
no hooks would be reused after sequential or a LoRA added some, and silently skip them (measured:
NaN latents under sequential with a poisoning backend). Our calls compile with that guard on.
(2) Dynamo keeps compiled code per code object and tries the newest entry first, and code
compiled with hooks inside (graph breaks at every hooked leaf) also passes the guards of a run
without them: after one sequential run, tier none would run the broken-up code for good. So each
hook layout (which submodules carry which hooks, by name: tier, LoRA) compiles its own copy of the
block's `forward` code, and the same layout in a later call reuses it, calling that call's own
hook objects (a graph break re-reads them at run time; a traced LoRA hook reads its tensors, its
strength included, from the layer's buffers, graph inputs).

Costs. The first call compiles (seconds on a GPU machine for a real block; the receipt says how
long); a second call of the same graph compiles nothing. `dynamic` decides what a new frame count
costs: "auto" compiles the first shape static and recompiles once, with symbolic sizes, at the
second; True starts symbolic (no recompile per frame count; dynamo's duck sizing is turned off
for our calls so that two sizes equal by chance are not assumed equal forever); False compiles
once per shape. CUDA graphs ("reduce-overhead", "max-autotune") are refused: they replay recorded
weight addresses, and every tier re-points weights (per step when streaming, per call otherwise).

A compile failure (dynamo or the backend raising) switches the rest of the call to eager and says
why in the receipt; an error of the block itself, out-of-memory included, is raised as always.
"""

from __future__ import annotations

import functools
import logging
import time
import types
import weakref
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Mapping, Sequence

import torch
from torch import nn

from ..memory.cleanup import is_out_of_memory
from ..memory.storage.modules import ready_fp8_tallies
from ..memory.strategy import StrategyError

if TYPE_CHECKING:
    from .activation_chunks import AppliedChunks

log = logging.getLogger("vidmem")

MODES = ("default", "max-autotune-no-cudagraphs")
REFUSED_MODES = ("reduce-overhead", "max-autotune")  # both record CUDA graphs
DYNAMIC_CHOICES = ("auto", "true", "false")  # as a node combo offers them; CompileSettings takes booleans too
# Per code object, for our calls: frames every layout reaches (attention processors) collect entries.
RECOMPILE_LIMIT = 64

TOOLTIPS = {
    "compile": "Compile the transformer's repeated blocks with torch.compile (regional, as diffusers' "
               "compile_repeated_blocks). The first run pays the compile time, later runs of the same graph reuse it; "
               "works under every offload tier, with LoRAs and the step cache. A compile failure runs eagerly and "
               "says why in the receipt.",
    "compile_mode": "'default': fast to compile. 'max-autotune-no-cudagraphs': tries kernel variants, compiles much "
                    "longer, can run a little faster. CUDA-graph modes are not offered: vidmem moves weights between "
                    "steps and runs, and CUDA graphs replay fixed weight addresses.",
    "compile_dynamic": "What a new frame count or size costs. 'auto': the second distinct shape recompiles once, "
                       "later shapes reuse it. 'true': compiled for any shape from the start (no recompile per frame "
                       "count; the first compile is slower). 'false': one compile per shape (fastest kernels for a "
                       "fixed size; after 64 shapes the blocks run eagerly).",
}


@dataclass(frozen=True)
class CompileSettings:
    """Whether and how a Sampler call compiles its denoiser blocks.

    `mode`: one of MODES (inductor's modes without CUDA graphs). `dynamic`: "auto", True or False
    (the strings "true"/"false" are accepted, for node inputs); see the module docstring.
    `backend`: a torch.compile backend name ("inductor"; tests and diagnosis use "aot_eager" or
    "eager"); modes other than "default" are inductor's own.
    """

    on: bool = False
    mode: str = "default"
    dynamic: str | bool = "auto"
    backend: str = "inductor"

    def __post_init__(self) -> None:
        if not isinstance(self.on, bool):
            raise StrategyError(f"compile on={self.on!r} must be True or False.")
        if self.mode in REFUSED_MODES:
            raise StrategyError(f"compile mode={self.mode!r} records CUDA graphs, which replay fixed weight addresses; "
                                "vidmem re-points weights between steps and runs: use 'default' or "
                                "'max-autotune-no-cudagraphs'.")
        if self.mode not in MODES:
            raise StrategyError(f"compile mode={self.mode!r} is not one of {', '.join(map(repr, MODES))}.")
        object.__setattr__(self, "dynamic", _dynamic_value(self.dynamic))
        if self.backend != "inductor" and (not isinstance(self.backend, str) or self.backend not in _backends()):
            raise StrategyError(f"compile backend={self.backend!r} is not a torch.compile backend here; use 'inductor' "
                                f"(or one of {', '.join(sorted(_backends()))}).")
        if self.mode != "default" and self.backend != "inductor":
            raise StrategyError(f"compile mode={self.mode!r} is an inductor mode; with backend={self.backend!r} "
                                "use mode='default'.")

    @property
    def torch_dynamic(self) -> bool | None:
        """torch.compile's `dynamic=`: None lets dynamo decide (static first, symbolic on a change)."""
        return None if self.dynamic == "auto" else self.dynamic

    def describe(self) -> str:
        if not self.on:
            return "off"
        backend = "" if self.backend == "inductor" else f", backend {self.backend}"
        return f"{self.mode}, dynamic {str(self.dynamic).lower()}{backend}"


def _dynamic_value(value) -> str | bool:
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if value is True or value is False or value == "auto":
        return value
    raise StrategyError(f"compile dynamic={value!r} must be 'auto', True or False.")


@functools.lru_cache(maxsize=1)
def _backends() -> frozenset[str]:
    import torch._dynamo  # only for a backend other than the default: imports a lot

    return frozenset(torch._dynamo.list_backends(exclude_tags=()))


# Function compiled (a block class's `forward`, or an activation-chunk step) -> {(settings, hook layout): its
# compiled twin}. Held here rather than on the modules (left untouched between calls) because dynamo's own
# cache is per code object, process-wide anyway; keyed weakly, so an unloaded model's classes take their
# entries with them.
_COMPILED: "weakref.WeakKeyDictionary[Callable, dict]" = weakref.WeakKeyDictionary()


def compiled_function(function: Callable, settings: CompileSettings, layout: tuple = ()) -> Callable:
    """The compiled `function` (its first argument a block) for these settings and hook layout (made once,
    reused by every later call with the same ones)."""
    per_function = _COMPILED.setdefault(function, {})
    key = (settings, layout)
    if key not in per_function:
        mode = None if settings.mode == "default" else settings.mode
        per_function[key] = torch.compile(_own_code(function), backend=settings.backend, mode=mode,
                                          dynamic=settings.torch_dynamic)
    return per_function[key]


def _own_code(function: Callable) -> Callable:
    """`function` over its own copy of its code object, so dynamo keeps a separate cache for it."""
    copy = types.FunctionType(function.__code__.replace(), function.__globals__, function.__name__,
                              function.__defaults__, function.__closure__)
    copy.__kwdefaults__, copy.__qualname__ = function.__kwdefaults__, function.__qualname__
    return copy


def hook_layout(block: nn.Module) -> tuple:
    """Which submodules of `block` carry which forward hooks, by the hooks' names."""
    return tuple((name, _names(m._forward_pre_hooks), _names(m._forward_hooks))
                 for name, m in block.named_modules() if name and (m._forward_pre_hooks or m._forward_hooks))


def _names(hooks: Mapping) -> tuple[str, ...]:
    return tuple(getattr(h, "__qualname__", type(h).__qualname__) for h in hooks.values())


class CompileReport:
    """What compiling did during one call, for the receipt (`as_dict()`)."""

    def __init__(self, settings: CompileSettings, blocks: int) -> None:
        self.settings = settings
        self.blocks = blocks
        self.compile_seconds = 0.0
        self.compiled_runs = 0  # block or step calls that ran compiled (before a fallback, if one came)
        self.fallback: str | None = None
        self._start = _dynamo_totals() if settings.on else None  # off: dynamo is not even imported
        self._end: dict | None = None

    def finish(self) -> None:
        if self.settings.on:
            self._end = _dynamo_totals()

    def fall_back(self, block_class: type, error: BaseException) -> None:
        # Why say how far it got: calls that ran compiled before the failure computed with inductor's kernels,
        # which on a GPU differ from eager in the last bits.
        ran = ("this call ran the blocks eagerly, with the same results" if not self.compiled_runs else
               f"this call ran {self.compiled_runs} compiled calls before it, the rest eagerly")
        self.fallback = (f"torch.compile failed on {block_class.__name__} ({_why(error)}); {ran}. Set compile off to "
                         "skip the attempt; mode 'default' with dynamic 'auto' compiles the most models.")
        log.warning("vidmem: %s", self.fallback)

    def as_dict(self) -> dict:
        found = {"on": self.settings.on, "compiled": self.settings.on and self.fallback is None,
                 "describe": self.settings.describe()}
        if not self.settings.on:
            return found
        end = self._end or _dynamo_totals()
        reasons = _new_reasons(self._start, end)
        found.update(mode=self.settings.mode, dynamic=self.settings.dynamic, backend=self.settings.backend,
                     blocks=self.blocks, compile_seconds=round(self.compile_seconds, 3),
                     frames_compiled=max(0, end["frames"] - self._start["frames"]),
                     recompiles=len(reasons), recompile_reasons=[_first_line(r) for r in reasons[:3]],
                     graph_breaks=max(0, end["graph_breaks"] - self._start["graph_breaks"]), fallback=self.fallback)
        return found


def _dynamo_totals() -> dict:
    """Dynamo's running totals: frames compiled, graph breaks traced, and its last compilations
    (each with the reason when it was a recompilation)."""
    from torch._dynamo.utils import counters, get_compilation_metrics

    return {"frames": counters["frames"]["total"], "graph_breaks": sum(counters["graph_break"].values()),
            "metrics": get_compilation_metrics()}  # the last 64 compilations


def _new_reasons(start: dict, end: dict) -> list[str]:
    """Reasons of the recompilations between two totals (dynamo keeps the last 64 compilations)."""
    return [m.recompile_reason for m in end["metrics"]
            if m.recompile_reason and not any(m is seen for seen in start["metrics"])]


def _why(error: BaseException) -> str:
    """The error and, when it wraps one (BackendCompilerFailed does), the error underneath."""
    root = error
    while root.__cause__ is not None and root.__cause__ is not root:
        root = root.__cause__
    inner = getattr(error, "inner_exception", None)
    root = inner if root is error and isinstance(inner, BaseException) else root
    found = f"{type(error).__name__}: {_first_line(error)}"
    return found if root is error else f"{type(error).__name__} <- {type(root).__name__}: {_first_line(root)}"


def _first_line(value) -> str:
    text = str(value).strip()
    return text.splitlines()[0][:300] if text else ""


class _Runner:
    """Calls a block's compiled forward, or its own after a compile failure (for the rest of the call)."""

    def __init__(self, settings: CompileSettings, report: CompileReport) -> None:
        self.settings = settings
        self.report = report
        self._readied: set[int] = set()  # blocks whose fp8 counters are on their device (once per call)

    def __call__(self, block: nn.Module, *args, **kwargs):
        return self.run(type(block).forward, block, *args, **kwargs)

    def run(self, function: Callable, block: nn.Module, *args, **kwargs):
        """`function(block, ...)` compiled: the block's forward, or a step of its activation chunks."""
        if self.report.fallback is not None:
            return function(block, *args, **kwargs)
        try:
            compiled = compiled_function(function, self.settings, hook_layout(block))
        except Exception as error:  # torch.compile itself refused (a backend that cannot load here)
            return self._eager_after(function, block, error, args, kwargs)
        self._ready_fp8(block, args, kwargs)
        frames, started = _frames(), time.perf_counter()
        try:
            with self._config():
                output = compiled(block, *args, **kwargs)
        except Exception as error:
            if not _is_compile_failure(error):
                raise
            return self._eager_after(function, block, error, args, kwargs)
        if _frames() != frames:
            self.report.compile_seconds += time.perf_counter() - started
        self.report.compiled_runs += 1
        return output

    def _ready_fp8(self, block: nn.Module, args: tuple, kwargs: dict) -> None:
        """fp8 matmul's counters made on the block's device before its graph first runs: made inside it,
        they would compile a second graph at the next pass (memory/storage/modules.py, Fp8MatmulTally)."""
        if id(block) in self._readied:
            return
        self._readied.add(id(block))
        device = next((a.device for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if device is not None:
            ready_fp8_tallies(block, device)

    def _eager_after(self, function: Callable, block: nn.Module, error: BaseException, args: tuple, kwargs: dict):
        self.report.fall_back(type(block), error)
        return function(block, *args, **kwargs)

    def _config(self) -> ExitStack:
        """Dynamo settings for our calls only: guards on empty hook dicts (see the module docstring),
        room for more cache entries on the frames layouts share, and no duck sizing with dynamic=True (two sizes
        equal by chance would be assumed equal, and the next frame count would recompile)."""
        import torch._dynamo
        import torch.fx.experimental._config as fx_config

        stack = ExitStack()
        limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        stack.enter_context(torch._dynamo.config.patch(recompile_limit=limit, skip_nnmodule_hook_guards=False))
        if self.settings.dynamic is True:
            stack.enter_context(fx_config.patch(use_duck_shape=False))
        return stack


def _frames() -> int:
    from torch._dynamo.utils import counters

    return counters["frames"]["total"]


def _is_compile_failure(error: BaseException) -> bool:
    """Dynamo's and the backends' errors (BackendCompilerFailed, InductorError, Unsupported...), not
    the block's own: an out-of-memory error is the OOM ladder's, whatever wraps it."""
    import torch._dynamo.exc

    return isinstance(error, torch._dynamo.exc.TorchDynamoException) and not is_out_of_memory(error) and \
        not is_out_of_memory(error.__cause__ or error)


_ABSENT = object()


def _plain_forward(block: nn.Module) -> bool:
    """No instance-level forward, or one that is just the class's bound to the block (what
    diffusers' hook registry leaves behind after its hooks are removed)."""
    found = block.__dict__.get("forward", _ABSENT)
    bound_here = getattr(found, "__func__", None) is type(block).forward and getattr(found, "__self__", None) is block
    return found is _ABSENT or bound_here


@contextmanager
def compiled_blocks(blocks: Mapping[str, Sequence[nn.Module]], settings: CompileSettings,
                    chunked: AppliedChunks | None = None) -> Iterator[CompileReport]:
    """Compile the repeated blocks' `forward` for one call; yields a CompileReport (`.as_dict()`).

    Enter it before step caching is applied (diffusers' caches wrap a block's `forward` and put
    back what they found) and around the strategy and the LoRAs; on exit every block's `forward`
    is its class's again, on success or error. With `settings.on` False it does nothing.
    `chunked`: the call's activation chunks, when the blocks run in slices (pipelines/activation_chunks.py).
    Their forward is then the chunked one, which never calls the class's: its slice steps are compiled
    instead (each a function of the block and tensors, one graph for every block and slice).

    Example:
        with compiled_blocks(denoiser_blocks(pipe, spec), CompileSettings(on=True)) as compiled:
            latents = pipe(...)
        receipt["compile"] = compiled.as_dict()
    """
    targets = list({id(b): b for group in blocks.values() for b in group}.values())
    report = CompileReport(settings, len(targets))
    if not settings.on:
        yield report
        return
    if chunked is not None and chunked.chunks > 1:
        try:
            with chunked.steps_run_by(_Runner(settings, report).run):
                yield report
        finally:
            report.finish()
        return
    taken = [b for b in targets if not _plain_forward(b)]
    if taken:
        raise StrategyError(f"compile: {type(taken[0]).__name__}'s forward is already replaced on this instance (a "
                            "diffusers hook such as a step cache, or another wrapper); apply compiled_blocks first, "
                            "then the step cache.")
    runner = _Runner(settings, report)
    installed: list[tuple[nn.Module, object, Callable]] = []  # (block, its forward as found, ours)
    try:
        for block in targets:
            found = block.__dict__.get("forward", _ABSENT)
            forward = functools.update_wrapper(functools.partial(runner, block), type(block).forward.__get__(block))
            block.forward = forward
            installed.append((block, found, forward))
        yield report
    finally:
        for block, found, forward in installed:
            if block.__dict__.get("forward") is not forward:  # someone wrapped ours and did not unwrap
                log.warning("vidmem: %s.forward was replaced during the call and not restored; left as found.",
                            type(block).__name__)
            elif found is _ABSENT:
                del block.forward
            else:
                block.forward = found
        report.finish()
