"""Step caching: skip the transformer blocks of steps whose output can be predicted, and their copies.

The caches are diffusers' own hooks (`diffusers.hooks`: First Block Cache, MagCache, TaylorSeer), enabled on
each denoiser (`CacheMixin.enable_cache`) for one call and disabled again in `finally`. What vidmem
adds is what no runner does: under block swap a skipped block's weights are not copied either.
diffusers replaces a block's `forward` when it skips it, but the block is still called, so the
engine's forward pre-hook would copy its weights for nothing; `BlockGate` tells the engine, as the
block is called, whether it will compute (memory/offload.py `compute_gate`), and, before it prefetches
a block, whether the block's next run computes. MagCache decides in the pass's first block from its
ratios, the step index and the error accumulated so far, nothing else: `mag_decides` takes the same
decision on a copy of the hook's state, so a skipped pass is known before its first block is copied
and before the pass ahead of it prefetches for it. TaylorSeer (lite) decides by the pass count of its
cache context alone (`taylor_computes`), foreseen the same way. First Block Cache decides from how
much the first block's output changed: that block is copied on every pass (it computes), the rest
once it decided.

The count of blocks computed and skipped goes into the receipt (`CacheTally`).

Beside context windows (pipelines/context_windows.py) each window keeps its own cache state, so a
window's step is compared with the same window's step before, not with the other window that ran
just before it. diffusers keys a cache hook's state by the cache context the pipeline sets ("cond",
"uncond"); `WindowPasses`, entered around each window's pass, narrows it to that window's context
("cond:window1") and starts the gate's pass there, so MagCache's accumulated error, First Block
Cache's residuals and the look-ahead of the copies are all per window. This is what kijai's
ComfyUI-WanVideoWrapper does for TeaCache and MagCache (`WindowTracker.get_teacache`: one cache state
per window id, handed to that window's model call).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import reprlib
import stat
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from enum import Enum
from typing import Iterable, Iterator, Mapping

import torch
from torch import nn

from ..memory.plan.types import CacheState
from ..memory.strategy import StrategyError
from .context_windows import HOOK_NAME as WINDOWS_HOOK, WINDOW_PASSES_HOOK
from .hook_attributes import as_found, leave_as_found


class CacheMethod(str, Enum):
    OFF = "off"
    FIRST_BLOCK = "first_block_cache"  # skip the rest of a pass when the first block's output barely changed
    MAG = "mag_cache"  # skip whole steps while the accumulated magnitude-ratio error stays under the threshold
    TAYLOR = "taylor_seer"  # compute one step in `interval`, predict the output projection on the others


# diffusers' TaylorSeer has two modes. Its default predicts the blocks' attention modules, matched by
# names ending in "attn"; Wan's and CogVideoX's are `attn1` / `attn2`, so in diffusers 0.42.1 it hooks
# nothing on them and would run uncached. (Matched by hand, it would keep Taylor factors of every
# attention output of every block per cache context: Wan 14B at 720p, 81 frames, two attentions x 40
# blocks x 2 orders x 2 contexts of 75600 x 5120 values, hundreds of GB, and the blocks would still run
# their feed-forwards, so their weights would still be copied.) Its lite mode is what vidmem runs: on a
# predicted step every block returns zeros without computing and `proj_out`'s output is extrapolated
# from the computed steps, so a predicted pass needs no block weight at all and keeps one latent-sized
# tensor per order and context. The modules are named exactly (`taylor_on`), not by lite's patterns.
_TAYLOR_HOOK = "taylorseer_cache"


# diffusers' hook names: read the per-pass decision from a block's hook registry.
_BLOCK_HOOKS = {CacheMethod.FIRST_BLOCK: "fbc_block_hook", CacheMethod.MAG: "mag_cache_block_hook",
                CacheMethod.TAYLOR: _TAYLOR_HOOK}
_HEAD_HOOKS = {CacheMethod.FIRST_BLOCK: "fbc_leader_block_hook", CacheMethod.MAG: "mag_cache_leader_block_hook",
               CacheMethod.TAYLOR: _TAYLOR_HOOK}
DEFAULT_THRESHOLDS = {CacheMethod.FIRST_BLOCK: 0.05, CacheMethod.MAG: 0.06}  # diffusers' and the papers' defaults
TAYLOR_MAX_ORDER = 3  # higher orders difference steps `interval` apart ever more times: noise, not accuracy


@dataclass(frozen=True)
class StepCache:
    """Which cache a Sampler call uses, and how boldly it skips.

    `threshold`: 0 means the method's default (First Block Cache 0.05, MagCache 0.06); higher skips
    more at some loss of quality. `retention`: the share of steps at the start always computed.
    `max_skip_steps`: MagCache's K, the most consecutive steps skipped. `mag_ratios`: MagCache's
    per-step magnitude ratios for this model and sampler (calibrated with `calibrate`).

    TaylorSeer (`taylor_seer`, diffusers' lite mode): `warmup_steps` computed first (at least one: it
    predicts from computed steps), then one step in `interval` computed and the others predicted by
    a Taylor series of `order` over the computed steps; the last `end_steps` always computed (0: none).
    Each denoiser and cache context counts its own passes (a Wan 2.2 expert warms up on its own;
    `end_steps` bind the denoiser that runs last). diffusers' defaults: interval 5, warm-up 3, order 1.
    """

    method: CacheMethod = CacheMethod.OFF
    threshold: float = 0.0
    retention: float = 0.2
    max_skip_steps: int = 3
    mag_ratios: tuple[float, ...] | None = None  # every denoiser's, unless `expert_ratios` names it
    calibrate: bool = False
    expert_ratios: tuple[tuple[str, tuple[float, ...]], ...] = ()  # (denoiser, its own ratios), Wan 2.2 A14B's experts
    ratio_steps: int = 0  # the step count the ratios were measured at (0: unknown; they are stretched to the run's)
    ratio_source: str = ""  # where the ratios come from, for the receipt
    interval: int = 5  # TaylorSeer: one step in `interval` computed after the warm-up
    warmup_steps: int = 3  # TaylorSeer: steps computed at the start of each denoiser's passes
    end_steps: int = 0  # TaylorSeer: steps computed at the end of the run
    order: int = 1  # TaylorSeer: the Taylor series' order

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "method", CacheMethod(self.method))
        except ValueError:
            accepted = ", ".join(repr(m.value) for m in CacheMethod)
            raise StrategyError(f"cache method={self.method!r} is not one of {accepted}.") from None
        for name, low, high in (("threshold", 0.0, 1.0), ("retention", 0.0, 1.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not low <= value <= high:
                raise StrategyError(f"cache {name}={value!r} must be a number from {low} to {high}.")
        if isinstance(self.max_skip_steps, bool) or not isinstance(self.max_skip_steps, int) or self.max_skip_steps < 1:
            raise StrategyError(f"cache max_skip_steps={self.max_skip_steps!r} must be a whole number, 1 or more.")
        _check_taylor(self)
        if self.mag_ratios is not None:
            object.__setattr__(self, "mag_ratios", _checked_ratios(self.mag_ratios, "mag_ratios"))
        object.__setattr__(self, "expert_ratios", _checked_expert_ratios(self.expert_ratios))
        if self.method is CacheMethod.MAG and self.mag_ratios is None and not self.expert_ratios and not self.calibrate:
            raise StrategyError("cache method='mag_cache' needs mag_ratios for this model, or calibrate=True to measure "
                                "them in one uncached run (its receipt gives them).")

    @property
    def on(self) -> bool:
        return self.method is not CacheMethod.OFF

    @property
    def skips(self) -> bool:
        """Whether blocks may be skipped (a calibration run computes every block)."""
        return self.on and not (self.method is CacheMethod.MAG and self.calibrate)

    @property
    def effective_threshold(self) -> float:
        """The threshold a run uses: `threshold`, or the method's default when it is 0 (and no ratio
        entry supplied one). describe(), diffusers_config() and the plan all read this one value."""
        return self.threshold or DEFAULT_THRESHOLDS.get(self.method, 0.0)

    def describe(self) -> str:
        if not self.on:
            return "off"
        if self.method is CacheMethod.MAG and self.calibrate:
            return "mag_cache calibration (nothing skipped)"
        if self.method is CacheMethod.TAYLOR:
            return (f"{self.method.value} interval={self.interval} warmup_steps={self.warmup_steps} "
                    f"end_steps={self.end_steps} order={self.order}")
        threshold = self.effective_threshold
        if self.method is CacheMethod.FIRST_BLOCK:
            return f"{self.method.value} threshold={threshold:g}"
        return f"{self.method.value} threshold={threshold:g} retention={self.retention:g} max_skip_steps={self.max_skip_steps}"

    def check_steps(self, steps: int) -> None:
        """Per-expert ratios (Wan 2.2 A14B) hold only at the step count they were measured at: each
        expert's share of the steps moves with it. TaylorSeer's fixed steps must leave one to predict."""
        if self.method is CacheMethod.TAYLOR and self.warmup_steps + self.end_steps >= steps:
            raise StrategyError(f"cache taylor_seer computes warmup_steps={self.warmup_steps} and end_steps="
                                f"{self.end_steps}, which leave nothing to predict in {steps} steps: lower them "
                                "(or raise steps), or set the cache method to 'off'.")
        if self.method is CacheMethod.MAG and self.per_expert and self.ratio_steps and self.ratio_steps != steps:
            raise StrategyError(f"cache mag_ratios were measured per expert at {self.ratio_steps} steps; each expert's "
                                f"share changes with the step count: set steps to {self.ratio_steps}, or calibrate at "
                                f"{steps} steps.")

    @property
    def per_expert(self) -> bool:
        """Ratios for one of Wan 2.2 A14B's experts (counted over its own steps), not a whole run's."""
        return any(name != "transformer" for name, _ in self.expert_ratios)

    def check_expert_steps(self, steps: Mapping[str, int]) -> None:
        """Per-expert ratios cover each expert's own steps: refused by name when this run splits the
        steps otherwise (a changed shift or boundary_ratio moves the hand-over)."""
        for name, ratios in self.expert_ratios:
            if name in steps and steps[name] != len(ratios):
                raise StrategyError(f"cache mag_ratios cover {len(ratios)} steps of {name}, but with this sampler, "
                                    f"shift and boundary_ratio it runs {steps[name]}; use the shift and boundary the "
                                    "ratios were measured with (the template's), or calibrate this setup.")

    def ratios_for(self, denoiser: str) -> tuple[float, ...] | None:
        return dict(self.expert_ratios).get(denoiser, self.mag_ratios)

    def device_state(self, denoiser: str) -> CacheState:
        """What the cache keeps on the device through `denoiser`'s passes, per cache context (the
        planner's CacheState): MagCache its head block's input and the blocks' residual, First Block Cache
        the head block's output, its residual and the other blocks' residual (diffusers 0.42.1's hook
        states), TaylorSeer (lite) a float32 factor of the output per order and one. Nothing where the
        cache is off or leaves `denoiser` uncached (MagCache ratios for the other expert only)."""
        if not self.on or (self.skips and self.method is CacheMethod.MAG and self.ratios_for(denoiser) is None):
            return CacheState()
        if self.method is CacheMethod.TAYLOR:
            return CacheState(output=self.order + 1)
        return CacheState(hidden=3 if self.method is CacheMethod.FIRST_BLOCK else 2)

    def planned_state(self, denoisers: Iterable[str]) -> dict[str, CacheState]:
        """`device_state` of each of `denoisers`, as PlanOptions.cache_state takes it."""
        return {name: self.device_state(name) for name in denoisers}

    def diffusers_config(self, steps: int, denoiser: str = "transformer", final: bool = True):
        """The diffusers hook configuration for `denoiser` in a run of `steps` steps (for TaylorSeer, the
        steps `denoiser` itself runs; `final`: it runs the run's last steps, which `end_steps` binds).

        MagCache counts the steps of each denoiser it is applied to from 0. Ratios measured at this
        step count are used as measured (an expert of Wan 2.2 A14B measured its own steps, so its
        array is as long as its share); otherwise they are stretched to the run's steps, nearest
        neighbour, as MagCache's authors do."""
        hooks = diffusers_hooks()
        if self.method is CacheMethod.TAYLOR:
            # Lite mode keeps one latent-sized factor per order and context: fp32 costs nothing there and
            # keeps the differences of nearby steps from rounding away (diffusers' default is bf16).
            return hooks.TaylorSeerCacheConfig(**taylor_arithmetic(self, steps, final), max_order=self.order,
                                               taylor_factors_dtype=torch.float32, use_lite_mode=True)
        FirstBlockCacheConfig, MagCacheConfig = hooks.FirstBlockCacheConfig, hooks.MagCacheConfig
        threshold = self.effective_threshold
        if self.method is CacheMethod.FIRST_BLOCK:
            return FirstBlockCacheConfig(threshold=threshold)
        if self.calibrate:
            # One step more than the run: diffusers prints and clears what it measured after the
            # last of `num_inference_steps`; this way the ratios are still there to be read.
            return MagCacheConfig(threshold=threshold, num_inference_steps=steps + 1, calibrate=True)
        ratios = self.ratios_for(denoiser)
        length = len(ratios) if self.ratio_steps == steps else steps
        return MagCacheConfig(threshold=threshold, max_skip_steps=self.max_skip_steps, retention_ratio=self.retention,
                              num_inference_steps=length, mag_ratios=torch.tensor(ratios, dtype=torch.float32))


def diffusers_hooks():
    """diffusers' hooks module, with the caches vidmem uses; a worded refusal on a diffusers without them."""
    import diffusers.hooks as hooks

    missing = [name for name in ("FirstBlockCacheConfig", "MagCacheConfig", "apply_mag_cache", "HookRegistry",
                                 "TaylorSeerCacheConfig", "apply_taylorseer_cache")
               if not hasattr(hooks, name)]
    if missing:
        import diffusers

        raise StrategyError(f"step caching needs diffusers' First Block Cache, MagCache and TaylorSeer hooks; "
                            f"diffusers {diffusers.__version__} lacks {', '.join(missing)}: pip install -U diffusers "
                            "(0.42 has them), or set the cache method to 'off'.")
    return hooks


# First Block Cache and MagCache find where a block takes and returns its hidden states in diffusers'
# TransformerBlockRegistry, which knows only the block classes diffusers registered (0.42.1: neither
# LTX-2's nor HunyuanVideo 1.5's). HunyuanVideo 1.5's block has exactly the contract the hooks
# assume, as HunyuanVideo's (registered by diffusers) does: `forward(hidden_states,
# encoder_hidden_states, ...)` returning `(hidden_states, encoder_hidden_states)`, the blocks chained
# one into the next with nothing between them; so vidmem registers it as diffusers registers
# HunyuanVideo's. LTX-2's block is not registered: it returns video AND audio hidden states, while the
# hooks read the second output's input by the name `encoder_hidden_states` (LTX-2's text), so a
# skipped pass would hand the text back as the audio. TaylorSeer (lite) needs no block metadata.
_NEEDS_BLOCK_METADATA = (CacheMethod.FIRST_BLOCK, CacheMethod.MAG)


def _register_fitting_blocks(registry) -> None:
    """Register the block classes that fit the hooks' contract but that diffusers does not (idempotent)."""
    from diffusers.hooks._helpers import TransformerBlockMetadata

    try:
        from diffusers.models.transformers import transformer_hunyuan_video15
    except ImportError:  # a diffusers before HunyuanVideo 1.5 (the pack allows 0.35): nothing to register
        return
    block = getattr(transformer_hunyuan_video15, "HunyuanVideo15TransformerBlock", None)
    if block is not None and block not in registry._registry:
        registry.register(block, TransformerBlockMetadata(return_hidden_states_index=0, return_encoder_hidden_states_index=1))


def blocks_without_metadata(block_classes) -> list[str]:
    """The names of the classes in `block_classes` that diffusers' block registry does not know."""
    from diffusers.hooks._helpers import TransformerBlockRegistry

    TransformerBlockRegistry._register()  # diffusers fills it on first use
    _register_fitting_blocks(TransformerBlockRegistry)
    return sorted({cls.__name__ for cls in block_classes if cls not in TransformerBlockRegistry._registry})


def metadata_refusal(method: CacheMethod, block_classes) -> str | None:
    """Why `method` cannot hook blocks of `block_classes` (the fix named), or None when it can."""
    if method not in _NEEDS_BLOCK_METADATA:
        return None
    missing = blocks_without_metadata(block_classes)
    if not missing:
        return None
    return (f"first_block_cache / mag_cache need diffusers' block metadata, which "
            f"{', '.join(missing)} lacks; choose taylor_seer or off.")


def check_block_metadata(cache: StepCache, blocks: Mapping[str, nn.ModuleList]) -> None:
    """StrategyError when `cache` is a First Block Cache or MagCache that diffusers cannot hook on `blocks`."""
    problem = metadata_refusal(cache.method, {type(block) for group in blocks.values() for block in group})
    if problem:
        raise StrategyError(problem)


@lru_cache(maxsize=None)
def _layout_block_classes(pipeline_class: str) -> tuple[type, ...]:
    """The denoiser block classes of `pipeline_class`'s family, for a plan that has no model: each
    denoiser class (from the pipeline's signature) built with one layer on the meta device. Empty
    when they cannot be found this way (a run still refuses by the blocks it has)."""
    import inspect
    import typing

    import diffusers

    from .loader import FAMILIES

    spec = next((s for s in FAMILIES if pipeline_class in s.pipeline_classes), None)
    pipeline = getattr(diffusers, pipeline_class, None)
    if spec is None or pipeline is None:
        return ()
    found = []
    for name in spec.denoisers:
        parameter = inspect.signature(pipeline.__init__).parameters.get(name)
        hinted = (typing.get_args(parameter.annotation) or (parameter.annotation,)) if parameter else ()
        for cls in (c for c in hinted if isinstance(c, type) and issubclass(c, nn.Module)):
            try:
                with torch.device("meta"):
                    found.append(type(getattr(cls(num_layers=1), spec.blocks_attr)[0]))
            except (TypeError, AttributeError, IndexError):
                continue
    return tuple(found)


def layout_refusal(model_layout: str, method: CacheMethod) -> str | None:
    """`metadata_refusal` for the model of a `layout_key`, known before it is loaded."""
    if method not in _NEEDS_BLOCK_METADATA:
        return None
    return metadata_refusal(method, _layout_block_classes(model_layout.split(" ", 1)[0]))


def _check_taylor(cache: StepCache) -> None:
    """TaylorSeer's settings, checked on every cache (they keep their defaults for the other methods)."""
    for name, low, high in (("interval", 1, 1000), ("warmup_steps", 1, 1000), ("end_steps", 0, 1000),
                            ("order", 1, TAYLOR_MAX_ORDER)):
        value = getattr(cache, name)
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            why = ""
            if name == "warmup_steps":
                why = " (TaylorSeer predicts from computed steps, so at least the first computes)"
            raise StrategyError(f"cache {name}={value!r} must be a whole number from {low} to {high}{why}.")


def taylor_arithmetic(cache: StepCache, steps: int, final: bool = True) -> dict:
    """diffusers' TaylorSeerCacheConfig step settings for a denoiser that runs `steps` passes per context."""
    return {"cache_interval": cache.interval, "disable_cache_before_step": cache.warmup_steps,
            "disable_cache_after_step": steps - cache.end_steps if cache.end_steps and final else None}


def taylor_on(config, name: str, denoiser: nn.Module, blocks) -> object:
    """`config` (lite mode) with its modules named exactly: the denoiser's declared blocks return zeros
    on a predicted step, and every output projection directly under it (`proj_out`, LTX-2's
    `audio_proj_out`) is extrapolated. Lite mode's own patterns would match any top-level `*block*`
    list and only `proj_out`, so an audio branch would be decoded from zeros."""
    import re
    from dataclasses import replace as with_fields

    paths = {id(m): path for path, m in denoiser.named_modules()}
    outputs = _output_projections(denoiser)
    _check_taylor_target(name, denoiser, blocks)
    return with_fields(config, use_lite_mode=False, skip_predict_identifiers=[re.escape(paths[id(b)]) for b in blocks],
                       cache_identifiers=[re.escape(child) for child in outputs])


def _output_projections(denoiser: nn.Module) -> list[str]:
    return [child for child, _ in denoiser.named_children() if child.endswith("proj_out")]


def _check_taylor_target(name: str, denoiser: nn.Module, blocks) -> None:
    if not _output_projections(denoiser) or not blocks:
        lacks = "no proj_out" if not _output_projections(denoiser) else "no blocks"
        raise StrategyError(f"cache taylor_seer extrapolates the denoiser's output projection (proj_out) and skips "
                            f"its blocks; {name} ({type(denoiser).__name__}) has {lacks}: choose mag_cache, "
                            "first_block_cache or 'off'.")


def check_cache_fits(cache: StepCache, denoisers: Mapping[str, nn.Module], blocks: Mapping[str, nn.ModuleList],
                     steps: int, denoiser_steps: Mapping[str, int] | None = None) -> None:
    """Every refusal of `cache` for a run of `steps` on these denoisers that needs no hook placed: the
    Sampler runs it in validate_request, before ComfyUI is asked to make room; `AppliedCache.apply` runs
    it again. `denoiser_steps`: the steps each denoiser runs when they share them (Wan 2.2 A14B)."""
    if not cache.on:
        return
    check_block_metadata(cache, blocks)
    cache.check_steps(steps)
    if cache.per_expert and denoiser_steps and len(blocks) > 1:
        cache.check_expert_steps(denoiser_steps)
    for name, denoiser in denoisers.items():
        _check_denoiser(cache, name, denoiser, blocks.get(name, ()))


def _check_denoiser(cache: StepCache, name: str, denoiser: nn.Module, blocks) -> None:
    if not hasattr(denoiser, "enable_cache"):
        raise StrategyError(f"step caching needs a diffusers denoiser with cache hooks; {name} "
                            f"({type(denoiser).__name__}) has none: set the cache method to 'off'.")
    if cache.method is CacheMethod.FIRST_BLOCK and len(blocks) < 2:
        raise StrategyError(f"first_block_cache decides after the first block whether to run the rest; {name} "
                            f"has {len(blocks)} block(s): choose mag_cache or 'off'.")
    # Ratios for the other expert only are fine (Wan 2.2 I2V A14B's authors never skip the first): that one runs uncached.
    if cache.skips and cache.method is CacheMethod.MAG and cache.ratios_for(name) is None and not cache.expert_ratios:
        raise StrategyError(f"cache mag_ratios has no ratios for {name}; calibrate this model (mag_ratios "
                            "'calibrate') or choose first_block_cache.")
    if cache.method is CacheMethod.TAYLOR:
        _check_taylor_target(name, denoiser, blocks)


def taylor_computes(step: int, interval: int, warmup: int, after: int | None) -> bool:
    """Whether TaylorSeer computes (True) or predicts its `step`-th pass in a cache context: the same
    arithmetic as diffusers 0.42.1's `TaylorSeerCacheHook._measure_should_compute` (note its phase:
    the step right after the warm-up is predicted, the one after it computed)."""
    return step < warmup or (step - warmup - 1) % interval == 0 or (after is not None and step >= after)


def _checked_ratios(ratios, name: str) -> tuple[float, ...]:
    found = _listed(ratios) or ()
    if not found or any(isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r) or r <= 0 for r in found):
        raise StrategyError(f"cache {name} must be a non-empty list of positive numbers (MagCache's per-step magnitude "
                            "ratios); calibrate them with calibrate=True.")
    return tuple(float(r) for r in found)


def _listed(value) -> tuple | None:
    """`value`'s items, where it is a list-like of them (not a string); else None."""
    return tuple(value) if isinstance(value, Iterable) and not isinstance(value, (str, bytes)) else None


def _checked_expert_ratios(experts) -> tuple[tuple[str, tuple[float, ...]], ...]:
    """`expert_ratios` as ((denoiser, its ratios), ...), each pair checked; refused by name when it is not pairs."""
    pairs = _listed(experts)
    if pairs is None or any(not isinstance(p, (tuple, list)) or len(p) != 2 or not isinstance(p[0], str) for p in pairs):
        raise StrategyError(f"cache expert_ratios={reprlib.repr(experts)} must be pairs of (denoiser name, its MagCache ratios), e.g. "
                            "(('transformer', (1.0, 0.98, ...)), ('transformer_2', (...))); calibrate them with calibrate=True.")
    return tuple((name, _checked_ratios(ratios, f"mag_ratios of {name}")) for name, ratios in pairs)


@dataclass
class CacheTally:
    """Blocks each denoiser computed and skipped during one call."""

    computed: int = 0
    skipped: int = 0
    calibrated_ratios: dict = field(default_factory=dict)  # denoiser -> MagCache ratios measured (calibrate)
    per_window: dict = field(default_factory=dict)  # context window index -> [computed, skipped] (windows on)

    def add(self, computed: bool, window: int | None) -> None:
        """One block's pass: computed or skipped, in context window `window` (None: no windows)."""
        self.computed += computed
        self.skipped += not computed
        if window is not None:
            self.per_window.setdefault(window, [0, 0])[0 if computed else 1] += 1

    @property
    def computed_share(self) -> float:
        total = self.computed + self.skipped
        return self.computed / total if total else 1.0

    def merged(self, later: "CacheTally") -> "CacheTally":
        """This tally and `later`'s summed, as a new tally: an attempt resumed after an out-of-memory
        error continues the count of the steps the failed attempt finished. Calibrated ratios are the
        later tally's (a resumed attempt runs uncached and measures none; a partial set would mislead)."""
        windows = {w: [a + b for a, b in zip(self.per_window.get(w, [0, 0]), later.per_window.get(w, [0, 0]))]
                   for w in {*self.per_window, *later.per_window}}
        return CacheTally(self.computed + later.computed, self.skipped + later.skipped,
                          dict(later.calibrated_ratios), windows)

    def as_dict(self) -> dict:
        windows = sorted(self.per_window)
        return {"blocks_computed": self.computed, "blocks_skipped": self.skipped,
                "blocks_computed_share": round(self.computed_share, 4),
                **({"blocks_computed_per_window": [self.per_window[w][0] for w in windows],
                    "blocks_skipped_per_window": [self.per_window[w][1] for w in windows]} if windows else {}),
                **({"mag_ratios": self.calibrated_ratios} if self.calibrated_ratios else {})}


class BlockGate:
    """Whether a denoiser block computes when it is called now, and whether a block's next run
    computes: what the engine asks before copying a streamed block's weights, on demand or ahead.

    For the pass under way it reads diffusers' decision from its hook's state once the first block
    has decided. Before that, and for the next pass, MagCache's decision is foreseen (`mag_decides`,
    from the hook's state and ratios alone), so a skipped pass is known before its first block is
    copied, and before the previous pass prefetches for it. First Block Cache decides from the first
    block's output: its first block always computes, and the rest of a pass is known only then."""

    def __init__(self, method: CacheMethod, blocks: Mapping[str, nn.ModuleList], tally: CacheTally) -> None:
        self._method = method
        self._hook = _BLOCK_HOOKS[method]
        self._tally = tally
        self._passes = {name: _PassTrack(group[0], group[-1]) for name, group in blocks.items() if len(group)}
        self._steps: dict[str, int] = {}  # TaylorSeer: passes per cache context in a run (`expect`)
        self._blocks: dict[int, tuple[str, int]] = {}  # id(block) -> (denoiser, index)
        self._inside: dict[int, tuple[str, int]] = {}  # id(module in a block) -> its block (sequential: leaves)
        for name, group in blocks.items():
            for index, block in enumerate(group):
                self._blocks[id(block)] = (name, index)
                self._inside.update((id(m), (name, index)) for m in block.modules())

    def __call__(self, module: nn.Module) -> bool:
        """Before `module`'s forward: False only when it will not compute in this pass."""
        where = self._blocks.get(id(module))
        if where is None:
            return True  # not a block: a leaf runs only when its block computes
        name, index = where
        if self._method is CacheMethod.TAYLOR:
            return self._taylor_this_pass(name)  # every block follows the pass's step arithmetic
        if index == 0:
            return self._method is CacheMethod.FIRST_BLOCK or self._mag_this_pass(name)
        return self._decision(module)

    def expect(self, steps: Mapping[str, int]) -> None:
        """The passes per cache context each denoiser runs in this call: TaylorSeer counts on from the
        last, and the pipeline resets its count after it, so the pass after the last is a run's first."""
        self._steps = dict(steps)

    def ahead(self, module: nn.Module, next_pass: bool) -> bool:
        """Whether `module` (a block, or a module inside one) computes when it runs next: later in this
        pass, or (`next_pass`) in the denoiser's next pass. First Block Cache cannot know: its blocks
        after the first are held (False) in a pass until its first block has decided, and prefetched
        for the next pass (True: one prefetched for a pass that skips it stays on the device until a
        pass computes it; docs/step-cache.md, "Copies that are not made")."""
        where = self._inside.get(id(module))
        if where is None:
            return True  # outside the blocks: runs on every pass
        name, index = where
        track = self._passes[name]
        if self._method is CacheMethod.TAYLOR:
            return self._taylor_next_pass(name) if next_pass else self._taylor_this_pass(name)
        if not next_pass and track.phase != _PassTrack.START:
            return self._decision(track.tail)  # this pass has decided
        if self._method is not CacheMethod.MAG:
            return index == 0 or next_pass  # First Block Cache: the first block always computes
        return self._mag_next_pass(name) if next_pass else self._mag_this_pass(name)

    def begin(self, name: str, window: int | None = None) -> None:
        """A pass of denoiser `name` starts (before its first module runs); `window`: the context
        window it is (None: the whole clip). The pass's decision is foreseen here, from the state
        before the head hook takes it: modules inside the first block ask after it has (sequential
        streams their leaves), when the state already moved on."""
        if name in self._passes:
            hook = self._head_hook(name)
            context = hook.state_manager._context if hook is not None else None
            track = self._passes[name]
            track.begin(context.name if context is not None else "inference", window)
            track.foreseen = self._foresee(name, hook) if hook is not None else None

    def _foresee(self, name: str, hook) -> tuple[bool, "MagView | int"] | None:
        """(computes, what follows) for the pass `begin` starts: MagCache's view after its decision,
        TaylorSeer's step count for the pass; None for First Block Cache (it decides from the first block)."""
        context = self._passes[name].context
        if self._method is CacheMethod.MAG:
            return mag_decides(self._mag_view(name, context), hook.config)
        if self._method is CacheMethod.TAYLOR:
            step = _taylor_step(hook, context) + 1
            return self._taylor_foresee(name, hook, step), step
        return None

    def count(self, module: nn.Module) -> None:
        """After `module`'s forward, when the pass's decision is known for every block: the first
        block always computes under First Block Cache and follows MagCache's decision."""
        name, index = self._blocks[id(module)]
        track = self._passes[name]
        track.ran(module)
        if self._method is CacheMethod.TAYLOR:
            computed = _taylor_ran(module, track.context)  # the block's own hook state: what diffusers did
        else:
            computed = (index == 0 and self._method is CacheMethod.FIRST_BLOCK) or self._decision(module)
        self._tally.add(computed, track.window)

    def _decision(self, module: nn.Module) -> bool:
        registry = getattr(module, "_diffusers_hook", None)
        hook = registry.get_hook(self._hook) if registry is not None else None
        if hook is None:
            hook = registry.get_hook(_HEAD_HOOKS[self._method]) if registry is not None else None
        return hook is None or hook.state_manager.get_state().should_compute

    def _head_hook(self, name: str):
        registry = getattr(self._passes[name].head, "_diffusers_hook", None)
        return registry.get_hook(_HEAD_HOOKS[self._method]) if registry is not None else None

    def _mag_view(self, name: str, context: str) -> "MagView":
        state = self._head_hook(name).state_manager._state_cache.get(context)
        return MagView.of(state) if state is not None else MagView()

    def _mag_this_pass(self, name: str) -> bool:
        """MagCache's decision for the pass under way, before its first block takes it."""
        hook, track = self._head_hook(name), self._passes[name]
        if hook is None:
            return True  # not cached (an expert without ratios)
        if track.foreseen is not None:
            return track.foreseen[0]
        return mag_decides(self._mag_view(name, track.context), hook.config)[0]

    def _mag_next_pass(self, name: str) -> bool:
        """MagCache's decision for the denoiser's next pass, from anywhere in the pass under way."""
        hook, track = self._head_hook(name), self._passes[name]
        following = track.following()
        if hook is None or following is None:
            return True  # not cached, or the order of the cache contexts is not known yet
        config = hook.config
        view = self._mag_view(name, following)
        if following == track.context and track.phase != _PassTrack.DONE:
            # The same context runs next: finish this pass on a copy of its state first.
            if track.phase == _PassTrack.DECIDED:
                computed = self._decision(track.tail)
            else:  # as foreseen before the head hook moved the state on
                computed, view = track.foreseen or mag_decides(view, config)
            view = mag_after_pass(view, config, computed)
        return mag_decides(view, config)[0]

    def _taylor_this_pass(self, name: str) -> bool:
        """TaylorSeer's decision for the pass under way: foreseen from the step count before the first
        block has run, read from its hook state after."""
        hook, track = self._head_hook(name), self._passes[name]
        if hook is None:
            return True
        if track.phase != _PassTrack.START:
            return _taylor_ran(track.head, track.context)
        if track.foreseen is not None:
            return track.foreseen[0]
        return self._taylor_foresee(name, hook, _taylor_step(hook, track.context) + 1)

    def _taylor_next_pass(self, name: str) -> bool:
        """TaylorSeer's decision for the denoiser's next pass: the step after its context's last."""
        hook, track = self._head_hook(name), self._passes[name]
        following = track.following()
        if hook is None or following is None:
            return True  # not cached, or the order of the cache contexts is not known yet
        step = _taylor_step(hook, following) + 1
        if following == track.context and track.phase == _PassTrack.START:
            # the pass under way counts as its foreseen step (the head hook may have counted it already)
            step = (track.foreseen[1] if track.foreseen is not None else step) + 1
        return self._taylor_foresee(name, hook, step)

    def _taylor_foresee(self, name: str, hook, step: int) -> bool:
        steps = self._steps.get(name)
        if steps:
            step %= steps  # after a run's last pass the pipeline resets the count: the next run's first
        return taylor_computes(step, hook.cache_interval, hook.disable_cache_before_step, hook.disable_cache_after_step)


def _taylor_step(hook, context: str) -> int:
    """The last pass TaylorSeer counted in `context` (-1: none yet)."""
    state = hook.state_manager._state_cache.get(context)
    return state.current_step if state is not None else -1


def _taylor_ran(module: nn.Module, context: str) -> bool:
    """Whether `module`'s TaylorSeer hook computed (True) or predicted its latest pass in `context`."""
    registry = getattr(module, "_diffusers_hook", None)
    hook = registry.get_hook(_TAYLOR_HOOK) if registry is not None else None
    state = hook.state_manager._state_cache.get(context) if hook is not None else None
    return state is None or state.last_update_step == state.current_step


class _PassTrack:
    """Where one denoiser is in its pass, and the order its cache contexts run in (cond, uncond)."""

    START, DECIDED, DONE = "start", "decided", "done"  # first block not run yet; it has; the last has

    def __init__(self, head: nn.Module, tail: nn.Module) -> None:
        self.head, self.tail = head, tail
        self.context = ""
        self.window: int | None = None  # the context window of the pass (None: the whole clip)
        self.phase = self.START
        self.foreseen = None  # (computes, what follows) for the pass under way, from BlockGate.begin
        self._order: list[str] = []
        self._order_known = False

    def begin(self, context: str, window: int | None = None) -> None:
        self.window = window
        if not self._order_known:
            if context in self._order:
                self._order_known = True  # a context runs again: one full round has been seen
            else:
                self._order.append(context)
        self.context, self.phase = context, self.START

    def ran(self, block: nn.Module) -> None:
        if block is self.tail:
            self.phase = self.DONE
        elif block is self.head:
            self.phase = self.DECIDED

    def following(self) -> str | None:
        """The cache context of the next pass; None until the round of contexts is known."""
        if not self._order_known:
            return None
        return self._order[(self._order.index(self.context) + 1) % len(self._order)]


# --- MagCache's decision before it is taken (what the prefetcher looks ahead with) -----------------

@dataclass(frozen=True)
class MagView:
    """What MagCache's head hook reads to decide one cache context's pass (diffusers' MagCacheState)."""

    step_index: int = 0
    accumulated_ratio: float | torch.Tensor = 1.0  # diffusers keeps these as it computes them: tensors once
    accumulated_err: float | torch.Tensor = 0.0   # a ratio has been multiplied in (the same types here)
    accumulated_steps: int = 0
    has_residual: bool = False

    @classmethod
    def of(cls, state) -> "MagView":
        return cls(state.step_index, state.accumulated_ratio, state.accumulated_err, state.accumulated_steps,
                   state.previous_residual is not None)


def mag_decides(view: MagView, config) -> tuple[bool, MagView]:
    """Whether MagCache's head hook will compute the pass it starts from `view` under `config` (a
    `MagCacheConfig`), and the view after it decided, without touching the hook's state.

    The same arithmetic, in the same order and types, as diffusers 0.42.1's
    `MagCacheHeadHook.new_forward`, so the answer is the hook's own (tests/test_step_cache.py checks
    it on every step of every published ratio set)."""
    if config.calibrate:
        return True, view
    step = view.step_index
    scale = 1.0 if step >= len(config.mag_ratios) else config.mag_ratios[step]
    if step < int(config.retention_ratio * config.num_inference_steps + 0.5):
        return True, view
    ratio = view.accumulated_ratio * scale
    steps = view.accumulated_steps + 1
    err = view.accumulated_err + abs(1.0 - ratio)
    if view.has_residual and err <= config.threshold and steps <= config.max_skip_steps:
        return False, replace(view, accumulated_ratio=ratio, accumulated_err=err, accumulated_steps=steps)
    return True, replace(view, accumulated_ratio=1.0, accumulated_err=0.0, accumulated_steps=0)


def mag_after_pass(view: MagView, config, computed: bool) -> MagView:
    """The view the context's next pass starts from, once the pass decided in `view` has ended: the
    tail hook's step advance, and its reset after the last of `num_inference_steps`."""
    step = view.step_index + 1
    if step >= config.num_inference_steps:
        return MagView()
    return replace(view, step_index=step, has_residual=view.has_residual or computed)


class AppliedCache:
    """Step caching enabled on a call's denoisers; `remove()` disables it again (idempotent).

    `enabled=False` counts the blocks without caching them (every block computes): an attempt that
    resumes after an out-of-memory error runs uncached, and its receipt still counts what it ran."""

    def __init__(self, cache: StepCache, denoisers: Mapping[str, nn.Module], blocks: Mapping[str, nn.ModuleList],
                 enabled: bool = True) -> None:
        self.cache = cache
        self.enabled = enabled
        self.tally = CacheTally()
        self.gate = BlockGate(cache.method, blocks, self.tally) if cache.skips and enabled else None
        self._denoisers = dict(denoisers)
        self._enabled: list[nn.Module] = []
        self._counters: list = []
        self._window_passes: list[nn.Module] = []  # denoisers given per-window cache state
        self._blocks = blocks
        self._found: list[tuple[nn.Module, dict]] = []  # what diffusers' hooks add to the modules, as found

    def apply(self, steps: int, denoiser_steps: Mapping[str, int] | None = None) -> "AppliedCache":
        """Enable the cache for a call of `steps` steps; `denoiser_steps`: the steps each denoiser runs
        when they share them (Wan 2.2 A14B's experts; TaylorSeer counts each one's own)."""
        own = {name: (denoiser_steps or {}).get(name, steps) for name in self._denoisers}
        # end_steps bind the denoiser that runs the run's last steps: the last one that runs any (a Wan 2.2
        # boundary_ratio near 0 leaves the low-noise expert none).
        last = next((name for name in reversed(self._denoisers) if own[name] > 0), None)
        if self.enabled:
            check_cache_fits(self.cache, self._denoisers, self._blocks, steps, denoiser_steps)  # before any hook is placed
        self._found = [(module, as_found(module)) for denoiser in self._denoisers.values() for module in denoiser.modules()]
        try:
            for name, denoiser in self._denoisers.items() if self.enabled else ():
                if self.cache.skips and self.cache.method is CacheMethod.MAG and self.cache.ratios_for(name) is None:
                    continue  # ratios for the other expert only (check_cache_fits refused the rest)
                if self.cache.method is CacheMethod.TAYLOR:
                    config = taylor_on(self.cache.diffusers_config(own[name], name, final=name == last), name,
                                       denoiser, self._blocks.get(name, ()))
                else:
                    config = self.cache.diffusers_config(steps, name)
                denoiser.enable_cache(config)
                self._enabled.append(denoiser)
            # Counting only (calibration, or not enabled): with no diffusers hook on a block the gate counts it computed.
            gate = self.gate or BlockGate(self.cache.method, self._blocks, self.tally)
            gate.expect(own)
            for name, group in self._blocks.items():
                denoiser = self._denoisers[name]
                # The windows hook is in place first (sample.py enters `windows_for_call` before the
                # cache): a windowed denoiser's passes are its windows, each with its own state.
                if _windowed(denoiser):
                    registry = diffusers_hooks().HookRegistry.check_if_exists_or_initialize(denoiser)
                    registry.register_hook(_window_passes_class()(gate, name), WINDOW_PASSES_HOOK)
                    self._window_passes.append(denoiser)
                else:  # prepended: the pass's phase is current before the engine's own hooks ask the gate
                    self._counters.append(denoiser.register_forward_pre_hook(
                        lambda m, args, name=name: gate.begin(name), prepend=True))
                for block in group:
                    self._counters.append(block.register_forward_hook(lambda m, args, out: gate.count(m), prepend=True))
                if self.cache.method is CacheMethod.MAG and self.cache.calibrate and self.enabled:
                    # The pipeline resets the caches' state before it returns: read the ratios as they grow.
                    self._counters.append(group[-1].register_forward_hook(
                        lambda m, args, out, name=name: self._read_ratios(name, m)))
        except BaseException:
            self.remove()
            raise
        return self

    def remove(self) -> None:
        for handle in self._counters:
            handle.remove()
        self._counters.clear()
        for denoiser in self._window_passes:
            denoiser._diffusers_hook.remove_hook(WINDOW_PASSES_HOOK, recurse=False)
        self._window_passes.clear()
        for denoiser in self._enabled:
            denoiser.disable_cache()
        self._enabled.clear()
        for module, before in self._found:  # disable_cache leaves the registries and hooked forwards behind
            leave_as_found(module, before)
        self._found.clear()
        for denoiser in self._denoisers.values():  # its registry caches which modules carry registries
            registry = getattr(denoiser, "_diffusers_hook", None)
            if registry is not None:
                registry.invalidate_child_registries_cache()

    def finished(self, name: str) -> None:
        """`name` runs no more passes in this call (Wan 2.2's high-noise expert once the low-noise one takes
        over): its cache state goes now, not when the call ends, so only the running expert's is on the
        device (as the planner counts it: memory/plan/stages.py, `cache_state_bytes`)."""
        denoiser = self._denoisers.get(name)
        if denoiser in self._enabled:
            denoiser._reset_stateful_cache()

    def _read_ratios(self, name: str, tail: nn.Module) -> None:
        ratios = _calibrated_ratios(tail)
        if ratios:
            self.tally.calibrated_ratios[name] = ratios

    def __enter__(self) -> "AppliedCache":
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def _calibrated_ratios(tail: nn.Module) -> list[float]:
    """The magnitude ratios MagCache has measured so far, read from the tail block's hook: the
    conditional pass's (the unconditional pass measures its own, close to it; diffusers uses one
    array for both)."""
    registry = getattr(tail, "_diffusers_hook", None)
    hook = registry.get_hook("mag_cache_block_hook") if registry is not None else None
    if hook is None:
        return []
    states = hook.state_manager._state_cache  # diffusers keeps one state per cache context
    state = states.get("cond") or states.get(window_context("cond", 0)) or next(iter(states.values()), None)
    return [round(float(r), 5) for r in getattr(state, "calibration_ratios", [])]


# --- One cache state per context window ---------------------------------------------------------------

def window_context(context: str, index: int) -> str:
    """The cache context of window `index` of a pass in `context` ("cond" -> "cond:window0")."""
    return f"{context}:window{index}"


def _windowed(denoiser: nn.Module) -> bool:
    registry = getattr(denoiser, "_diffusers_hook", None)
    return registry is not None and registry.get_hook(WINDOWS_HOOK) is not None


def current_cache_context(module: nn.Module):
    """The cache context the pipeline set on `module`'s cache hooks (diffusers' `CacheContext`), or None."""
    from diffusers.hooks.hooks import StateManager

    registry = getattr(module, "_diffusers_hook", None)
    if registry is None:
        return None
    for child in (registry, *registry._get_child_registries()):  # as diffusers' _set_cache_context walks them
        for hook in child.hooks.values():
            for attr in vars(hook).values():
                if isinstance(attr, StateManager) and attr._context is not None:
                    return attr._context
    return None


@lru_cache(maxsize=None)
def _window_passes_class() -> type:
    from diffusers.hooks import ModelHook

    class WindowPasses(ModelHook):
        """In a denoiser's registry beside the windows hook: each window's pass runs in its own cache
        context, so diffusers keeps one cache state per window, and the gate starts a pass there."""

        def __init__(self, gate: BlockGate, name: str) -> None:
            super().__init__()
            self.gate, self.name = gate, name

        def initialize_hook(self, module: nn.Module) -> nn.Module:
            self.module = module
            return module

        @contextmanager
        def window(self, index: int) -> Iterator[None]:
            from diffusers.hooks.hooks import _set_cache_context

            outer = current_cache_context(self.module)
            if outer is not None:
                _set_cache_context(self.module, replace(outer, name=window_context(outer.name, index)))
            try:
                self.gate.begin(self.name, index)
                yield
            finally:
                if outer is not None:
                    _set_cache_context(self.module, outer)  # the pipeline's own context, for its next window

    return WindowPasses


# --- MagCache ratio files ---------------------------------------------------------------------------
# A calibration run's ratios are saved as a small JSON file the Step Cache node lists; published
# ratios ship in pipelines/configs/mag_ratios.json. A file names the model it was measured on
# (`model_key`), so one measured on another model is refused by name.

RATIO_FILE_VERSION = 1
SHIPPED_RATIOS = Path(__file__).parent / "configs" / "mag_ratios.json"


def model_key(loaded) -> str:
    """The model a ratio file belongs to: the pipeline class and each denoiser's blocks and width."""
    from .family import denoiser_blocks

    blocks = denoiser_blocks(loaded.pipe, loaded.spec)
    return layout_key(loaded.class_name, {name: (len(b), getattr(loaded.pipe, name).config) for name, b in blocks.items()})


def layout_key(pipeline_class: str, denoisers: Mapping[str, tuple[int, Mapping]]) -> str:
    """`WanPipeline transformer:30x12x128`: the class, then each denoiser's blocks x heads x head width."""
    parts = [pipeline_class]
    for name, (blocks, config) in denoisers.items():
        parts.append(f"{name}:{blocks}x{config.get('num_attention_heads')}x{config.get('attention_head_dim')}")
    return " ".join(parts)


def ratio_file_name(loaded, steps: int) -> str:
    """`<pipeline class>-<blocks>blocks-<steps>steps-<key>.json`: readable in the node's list, and one file
    per model: `<key>` is a short hash of `model_key` (each denoiser's blocks, heads and head width), which
    tells apart models of one class and block count (Wan 2.1 1.3B and Wan 2.2 TI2V-5B both have 30 blocks:
    without it one's calibration overwrote the other's). A file named the older way (no key) is still read;
    its `model` entry is checked as any file's is."""
    from .family import denoiser_blocks

    blocks = min(len(b) for b in denoiser_blocks(loaded.pipe, loaded.spec).values())
    key = hashlib.sha256(model_key(loaded).encode("utf-8")).hexdigest()[:8]
    return f"{loaded.class_name}-{blocks}blocks-{steps}steps-{key}.json"


def write_ratio_file(folder: Path, loaded, steps: int, ratios: Mapping[str, list[float]], sampler: str) -> Path:
    """Save a calibration run's ratios (whole or not at all); returns the file written."""
    from .atomic import atomic_path

    target = Path(folder) / ratio_file_name(loaded, steps)
    body = {"version": RATIO_FILE_VERSION, "model": model_key(loaded), "steps": steps, "sampler": sampler,
            "source": f"vidmem calibration run of {loaded.describe()}", "ratios": {k: list(v) for k, v in ratios.items()}}
    with atomic_path(target) as temporary:
        temporary.write_text(json.dumps(body, indent=1), encoding="utf-8")
    return target


def cache_with_ratios(cache: StepCache, loaded, ratios_name: str, folder: Path | None) -> StepCache:
    """`cache` with the MagCache ratios `ratios_name` names: "auto" (published for this model),
    "calibrate", or a ratio file in `folder`. Refused by name when they are for another model."""
    from .family import denoiser_blocks

    check_block_metadata(cache, denoiser_blocks(loaded.pipe, loaded.spec))  # before 'auto' offers another method
    if cache.method is not CacheMethod.MAG:
        return cache
    if ratios_name == "calibrate":
        return replace(cache, calibrate=True)
    found = _mag_cache_for(model_key(loaded), cache, ratios_name, folder)
    if found is None:
        raise StrategyError(f"mag_ratios 'auto': no published MagCache ratios for {loaded.class_name} "
                            f"({model_key(loaded)}); queue once with mag_ratios 'calibrate' (its ratios are saved and "
                            "listed here), or choose first_block_cache.")
    return found


def ratio_files(folder: Path | None) -> list[str]:
    """The ratio files saved in `folder` (name order)."""
    if folder is None or not Path(folder).is_dir():
        return []
    return sorted(p.name for p in Path(folder).glob("*.json") if p.is_file())


def _with_entry(cache: StepCache, entry: dict, source: str) -> StepCache:
    ratios = entry.get("ratios")
    steps = entry.get("steps")
    if not isinstance(ratios, dict) or not ratios or not all(isinstance(v, list) for v in ratios.values()) or \
            isinstance(steps, bool) or not isinstance(steps, int):
        raise StrategyError(f"mag_ratios '{source}' is not a ratio file vidmem wrote (no list of 'ratios' per denoiser "
                            "or no 'steps'); calibrate again.")
    experts = tuple((name, tuple(values)) for name, values in ratios.items())
    threshold = cache.threshold or entry.get("threshold", 0.0)  # 0: the threshold published with the ratios
    return replace(cache, mag_ratios=None, expert_ratios=experts, ratio_steps=steps, threshold=threshold,
                   ratio_source=f"{source} ({entry.get('source', '')})", calibrate=False)  # used, not measured


@lru_cache(maxsize=1)
def _shipped() -> dict:
    """model key -> published ratios (pipelines/configs/mag_ratios.json), read once."""
    if not SHIPPED_RATIOS.is_file():
        return {}
    return {entry["model"]: entry for entry in json.loads(SHIPPED_RATIOS.read_text(encoding="utf-8"))["models"]}


MAX_RATIO_FILE_BYTES = 16 << 20  # a ratio file vidmem writes is a few KiB


def read_json_file(path: Path, what: str) -> dict:
    """The JSON object in the regular file `path`. Opened without blocking and checked on the open file, so
    a FIFO or device put there (or swapped in after a check) is refused instead of blocking or never ending."""
    path = Path(path)
    try:
        descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise StrategyError(f"{what} '{path.name}' is missing from {path.parent}; pick a listed file.") from None
    except OSError as error:
        raise StrategyError(f"{what} '{path.name}' cannot be opened ({error.strerror}); pick a listed file.") from None
    with os.fdopen(descriptor, "rb") as file:
        if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
            raise StrategyError(f"{what} '{path.name}' in {path.parent} is not a regular file; pick a listed file.")
        try:
            raw = file.read(MAX_RATIO_FILE_BYTES + 1)
            if len(raw) > MAX_RATIO_FILE_BYTES:
                raise ValueError(f"over {MAX_RATIO_FILE_BYTES >> 20} MiB")
            data = json.loads(raw.decode("utf-8"))
        except (OSError, ValueError, RecursionError) as error:  # RecursionError: nesting deeper than Python's stack
            raise StrategyError(f"{what} '{path.name}' is not a readable JSON ratio file ({error}); calibrate "
                                "again.") from None
    if not isinstance(data, dict):
        raise StrategyError(f"{what} '{path.name}' is not a ratio file (a JSON object); calibrate again.")
    return data


# --- What a cache will skip, before the run (vidmem plan) -------------------------------------------

def published_cache(layout: str) -> StepCache | None:
    """MagCache with the ratios and settings published for the model of `layout` (see `layout_key`), or None."""
    entry = _shipped().get(layout)
    if entry is None:
        return None
    cache = StepCache(CacheMethod.MAG, entry.get("threshold", 0.0), entry.get("retention", 0.2),
                      entry.get("max_skip_steps", 3), calibrate=True)  # ratios come with the entry
    return _with_entry(cache, entry, "published")


def mag_schedule(cache: StepCache, steps: int, denoiser: str = "transformer") -> list[bool]:
    """Which of `steps` passes MagCache computes (True) for `denoiser` with `cache`'s ratios.

    MagCache decides from its ratios and the step count alone, never from the model's values, so
    its own hooks (diffusers') run here on a stand-in of two trivial blocks: the schedule is the one
    a real run takes, not a re-implementation of it. Per-expert ratios measured at another step
    count are refused as in a run.
    """
    if cache.method is not CacheMethod.MAG or not cache.skips:
        return [True] * steps
    cache.check_steps(steps)
    hooks = diffusers_hooks()
    stand_in = _ScheduleModel()
    hooks.apply_mag_cache(stand_in, cache.diffusers_config(steps, denoiser))
    hooks.HookRegistry.check_if_exists_or_initialize(stand_in).invalidate_child_registries_cache()  # as enable_cache does
    passes = steps if cache.ratio_steps != steps else len(cache.ratios_for(denoiser) or ())
    computed = []
    with torch.no_grad():
        for _ in range(passes):
            computed.append(stand_in(torch.zeros(1, 1)))
    return computed


def taylor_schedule(cache: StepCache, steps: int, final: bool = True) -> list[bool]:
    """Which of `steps` passes TaylorSeer computes (True) in one cache context of a denoiser that runs
    `steps` passes (`final`: it runs the run's last steps, which `end_steps` binds).

    Its decisions are step arithmetic, never the model's values: diffusers' own hook runs here on a
    stand-in (lite mode, as a run), so the schedule is the one a run takes."""
    if cache.method is not CacheMethod.TAYLOR:
        return [True] * steps
    stand_in = _TaylorStandIn()
    diffusers_hooks().apply_taylorseer_cache(stand_in, cache.diffusers_config(steps, final=final))
    with torch.no_grad():
        return [stand_in(torch.zeros(1, 1)) for _ in range(steps)]


class _ScheduleBlock(nn.Module):
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        self.ran = True
        return hidden_states + 1


class _ScheduleModel(nn.Module):
    """Two trivial blocks under diffusers' block registry, for `mag_schedule`."""

    def __init__(self) -> None:
        super().__init__()
        from diffusers.hooks._helpers import TransformerBlockMetadata, TransformerBlockRegistry

        if _ScheduleBlock not in TransformerBlockRegistry._registry:
            TransformerBlockRegistry.register(_ScheduleBlock, TransformerBlockMetadata(return_hidden_states_index=0))
        self.blocks = nn.ModuleList([_ScheduleBlock(), _ScheduleBlock()])

    def forward(self, hidden_states: torch.Tensor, context: str = "cond") -> bool:
        """One pass in cache context `context`; whether its blocks computed."""
        from diffusers.hooks.hooks import CacheContext, _set_cache_context

        tail = self.blocks[-1]
        tail.ran = False
        _set_cache_context(self, CacheContext(context))
        try:
            for block in self.blocks:
                hidden_states = block(hidden_states)
        finally:
            _set_cache_context(self, None)
        return tail.ran


class _TaylorStandIn(nn.Module):
    """One trivial block and an output projection, named as TaylorSeer's lite mode finds them."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_ScheduleBlock()])
        self.proj_out = nn.Identity()

    def forward(self, hidden_states: torch.Tensor) -> bool:
        """One pass in the "cond" cache context; whether its block computed."""
        from diffusers.hooks.hooks import CacheContext, _set_cache_context

        block = self.blocks[0]
        block.ran = False
        _set_cache_context(self, CacheContext("cond"))
        try:
            self.proj_out(block(hidden_states))
        finally:
            _set_cache_context(self, None)
        return block.ran


@dataclass(frozen=True)
class CachePlan:
    """What a step cache will skip, known before the run: the plan's words, and the share of the
    cached denoisers' passes it computes (None where that is only known after the run)."""

    text: str
    share: float | None = None


def plan_line(model_layout: str, steps: int, denoisers: list[str], cache: StepCache | None = None,
              ratios_name: str = "auto", folder: Path | None = None, windows: int = 1) -> str:
    """What `cache` would skip at `steps`, before the run (`vidmem plan --cache`, the Strategy node's plan)."""
    return cache_plan(model_layout, steps, denoisers, cache, ratios_name, folder, windows).text


def cache_plan(model_layout: str, steps: int, denoisers: list[str], cache: StepCache | None = None,
               ratios_name: str = "auto", folder: Path | None = None, windows: int = 1) -> CachePlan:
    """`plan_line`'s words and the share of passes computed.

    `cache` None: MagCache as published for this model. Otherwise the Step Cache node's settings with
    the ratios it names ("auto", "calibrate" or a file in `folder`); a threshold of 0 takes the one
    published with the ratios, as a run does. `windows`: the context windows of a step (1: none);
    each keeps its own cache state, so MagCache computes the same steps in each and the share of the
    passes is the share of the steps."""
    each = f" in each of the {windows} context windows (each with its own cache state)" if windows > 1 else ""
    refusal = layout_refusal(model_layout, CacheMethod.MAG if cache is None else cache.method)
    if refusal:
        return CachePlan(refusal)
    if cache is not None and cache.method is CacheMethod.FIRST_BLOCK:
        return CachePlan(f"{cache.describe()}: decided while sampling from how much the first block's output changes"
                         f"{each}, so what it skips is known only after the run (the Sampler's receipt counts it).")
    if cache is not None and not cache.on:
        return CachePlan("")
    if cache is not None and cache.method is CacheMethod.TAYLOR:
        return taylor_plan(cache, steps, denoisers, each)
    if cache is not None and ratios_name == "calibrate":
        return CachePlan("mag_cache calibrate: this run computes every step to measure the model's ratios and saves "
                         "them for the next runs; it skips nothing itself.")
    try:
        cache = _mag_cache_for(model_layout, cache, ratios_name, folder)
        if cache is None:
            return CachePlan("mag_cache: no published MagCache ratios for this model; a run with the Step Cache node's "
                             "mag_ratios 'calibrate' measures and saves them (docs/step-cache.md).")
        computed = {name: mag_schedule(cache, steps, name) for name in denoisers if cache.ratios_for(name) is not None}
    except StrategyError as error:
        return CachePlan(f"mag_cache: {error}")
    ran = sum(sum(s) for s in computed.values())
    total = sum(len(s) for s in computed.values())  # passes of the denoisers the cache applies to
    uncached = [name for name in denoisers if name not in computed]
    share = ran / total if total else 1.0
    parts = ", ".join(f"{name} {sum(s)} of {len(s)}" for name, s in computed.items())
    note = f"; {', '.join(uncached)} not cached (as published)" if uncached else ""
    source = "the published ratios" if ratios_name == "auto" else f"the ratios of {ratios_name}"
    # with a denoiser left uncached, how the denoise time splits between them is not known here
    return CachePlan(
        f"mag_cache with {source} (threshold {cache.effective_threshold:g}, K {cache.max_skip_steps}, retention "
        f"{cache.retention:g}): steps computed {parts}{each} ({share:.0%}){note}. The denoising time and, under block "
        f"swap, the copies fall about as the steps computed; quality: docs/step-cache.md.", None if uncached else share)


def taylor_plan(cache: StepCache, steps: int, denoisers: list[str], each: str = "") -> CachePlan:
    """TaylorSeer's steps computed at `steps`, from its step arithmetic (the same in every cache
    context and context window). With two experts each warms up on its own, so the share depends on
    where the steps are split between them, which the plan does not know: the words say so, with no share."""
    try:
        cache.check_steps(steps)
    except StrategyError as error:
        return CachePlan(f"taylor_seer: {error}")
    settings = (f"taylor_seer (interval {cache.interval}, warm-up {cache.warmup_steps}, end steps {cache.end_steps}, "
                f"order {cache.order})")
    skipped = ("on the others every block returns zeros without computing and the output projection is extrapolated, "
               "so under block swap, sequential and the disk tier those passes copy no block weight")
    if len(denoisers) > 1:
        return CachePlan(f"{settings}: each of {', '.join(denoisers)} warms up on its own steps, so the steps computed "
                         f"depend on where the sampler hands over{each}; {skipped}. The Sampler's receipt counts them; "
                         "quality: docs/step-cache.md.")
    computed = sum(taylor_schedule(cache, steps))
    share = computed / steps
    return CachePlan(f"{settings}: steps computed {computed} of {steps}{each} ({share:.0%}); {skipped}. The denoising "
                     "time and the copies fall about as the steps computed; quality: docs/step-cache.md (not measured "
                     "on real weights).", share)


def cached_time_line(plan, share: float) -> str:
    """The run's estimated time with a cache that computes `share` of the denoise passes, against the
    same plan uncached: the denoise stage's modelled seconds (compute, and the copies that fall with
    the blocks computed: 40.1% of the copies for 40.0% of the blocks on an H200) scaled by the share,
    the other stages as they are."""
    ratio = plan.seconds_with_denoise_share(share) / plan.seconds_with_denoise_share(1.0)
    return (f"Time with the cache: about x{ratio:.2f} of the same run uncached ({share:.0%} of the denoise passes "
            "computed; encoding and decoding unchanged).")


def _ratio_file(folder: Path | None, ratios_name: str) -> Path:
    """The ratio file `ratios_name` names in `folder`. Only a plain file name is taken: the name comes from a
    widget, which the plan route takes from an HTTP query, so a path (absolute, `..`, a separator, a Windows
    drive's `D:`) is refused unopened; `read_json_file` then reads only a regular file."""
    if ratios_name in ("", ".", "..") or any(separator in ratios_name for separator in "/\\:"):
        raise StrategyError(f"mag_ratios '{ratios_name}' is not a ratio file's name; pick a listed file, 'auto', or "
                            "'calibrate'.")
    return Path(folder or ".") / ratios_name


def _mag_cache_for(layout: str, cache: StepCache | None, ratios_name: str, folder: Path | None) -> StepCache | None:
    """MagCache with the ratios `ratios_name` names for the model of `layout` (`cache` None: as published):
    None when "auto" finds nothing published for it; StrategyError for a file of another model."""
    if cache is None:
        return published_cache(layout)
    if ratios_name == "auto":
        entry = _shipped().get(layout)
        return None if entry is None else _with_entry(cache, entry, "published")
    entry = read_json_file(_ratio_file(folder, ratios_name), "mag_ratios")
    if entry.get("model") != layout:
        raise StrategyError(f"mag_ratios '{ratios_name}' was measured on {entry.get('model')!r}, not this model "
                            f"({layout}); pick this model's file, 'auto', or 'calibrate'.")
    return _with_entry(cache, entry, ratios_name)
