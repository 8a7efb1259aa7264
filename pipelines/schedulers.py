"""Sampler controls for one call: which scheduler, its shift, A14B's second scale and boundary.

The loaded pipeline is shared (ComfyUI caches node outputs), so nothing here changes it: every
call gets a new scheduler built with `from_config` from the pipeline's own one (its betas,
prediction type and timestep spacing), set on a per-call pipeline object that shares the
components (pipelines/sample_call.py). Even the default is a fresh copy: schedulers keep state
between steps (UniPC's history), and two runs must never share it.

Names, as the issue and every other pack use them:
- `default`: the scheduler the model folder ships (Wan: flow UniPC; CogVideoX: its DDIM or DPM).
- `unipc`: diffusers' UniPCMultistepScheduler.
- `dpmpp_2m`: DPMSolverMultistepScheduler, algorithm_type "dpmsolver++", solver_order 2.
- `flow_match_euler`: FlowMatchEulerDiscreteScheduler (flow-matching models only).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from numbers import Real

from .family import ModelError

SCHEDULERS = ("default", "unipc", "dpmpp_2m", "flow_match_euler")
SHIFT_KEYS = ("flow_shift", "shift")  # UniPC/DPM-Solver name it flow_shift, FlowMatchEuler shift


@dataclass(frozen=True)
class SamplerChoice:
    """What the run uses, resolved: for the receipt and to build the call's scheduler."""

    scheduler: str  # one of SCHEDULERS
    scheduler_class: str  # the diffusers class it builds
    shift: float | None  # None: the family has no shift (not flow matching)
    shift_is_default: bool
    cfg: float
    cfg_2: float | None  # None: single-expert model
    boundary_ratio: float | None  # None: single-expert model
    recommended_shift: float | None = None  # the family's advice at this size (FamilySpec.sampler)
    # The scheduler shifts by the resolution (use_dynamic_shifting: LTX-2's mu from the token count)
    # and never reads `shift`, so the receipt names no shift value.
    dynamic_shift: bool = False

    @property
    def guided(self) -> bool:
        """A negative pass runs (and the negative prompt is encoded) only for a scale above 1."""
        return self.cfg > 1.0 or (self.cfg_2 is not None and self.cfg_2 > 1.0)

    def describe(self) -> str:
        parts = [f"scheduler={self.scheduler} ({self.scheduler_class})"]
        if self.dynamic_shift:
            parts.append("shift=resolution-dependent (the model's scheduler picks it from the frame size: "
                         "use_dynamic_shifting)")
        elif self.shift is not None:
            parts.append(f"shift={self.shift:g}" + (" (model default)" if self.shift_is_default else ""))
            if self.recommended_shift is not None and self.recommended_shift != self.shift:
                parts.append(f"(recommended at this size: shift={self.recommended_shift:g})")
        parts.append(f"cfg={self.cfg:g}")
        if self.cfg_2 is not None:
            parts.append(f"cfg_2={self.cfg_2:g} (low-noise expert)")
        if self.boundary_ratio is not None:
            parts.append(f"boundary_ratio={self.boundary_ratio:g}")
        if not self.guided:
            parts.append("no negative pass (cfg <= 1): negative prompt not encoded")
        elif self.cfg_2 is not None and min(self.cfg, self.cfg_2) <= 1.0:
            expert = "high" if self.cfg <= 1.0 else "low"
            parts.append(f"no negative pass on the {expert}-noise expert (its scale <= 1)")
        return " ".join(parts)


def two_experts(pipe) -> bool:
    return getattr(pipe, "transformer_2", None) is not None and pipe.config.get("boundary_ratio") is not None


def resolve_sampler(pipe, spec, scheduler: str, shift, cfg: float, cfg_2, boundary_ratio,
                    size: tuple[int, int] = (0, 0)) -> SamplerChoice:
    """Check every control against the model (ModelError naming the input and the fix) and resolve
    the defaults; nothing is built or moved."""
    defaults = spec.sampler
    offered = ("default", *defaults.schedulers)
    if scheduler not in offered:
        known = "" if scheduler in SCHEDULERS else " is not a scheduler vidmem knows and"
        raise ModelError(f"scheduler='{scheduler}'{known} is not offered for {spec.name}; use one of {', '.join(offered)}.")
    shipped = pipe.scheduler
    snr_shift = shipped.config.get("snr_shift_scale", 1.0)
    if scheduler in ("unipc", "dpmpp_2m") and snr_shift != 1.0:
        raise ModelError(
            f"scheduler='{scheduler}' would ignore this model's snr_shift_scale={snr_shift:g} ({type(shipped).__name__}), "
            "which it was trained with, and give noisy frames; use scheduler='default'.")
    if shift is not None and not defaults.flow_matching:
        raise ModelError(f"shift applies to flow-matching models (Wan); {spec.name} is not one. Leave shift empty (None).")
    dynamic = defaults.flow_matching and bool(shipped.config.get("use_dynamic_shifting"))
    if shift is not None and dynamic:
        raise ModelError(f"shift={shift!r} would be ignored: {spec.name}'s scheduler ({type(shipped).__name__}, "
                         "use_dynamic_shifting) picks its shift from the resolution. Set shift to 0 (the model's own).")
    if shift is not None:
        check_positive("shift", shift, "e.g. 3.0 for 480p or 5.0 for 720p")
    model_shift = next((shipped.config[k] for k in SHIFT_KEYS if k in shipped.config), None) if defaults.flow_matching else None
    if defaults.flow_matching and model_shift is None:
        raise ModelError(f"the model's scheduler {type(shipped).__name__} has no flow shift; use another model folder.")
    experts = two_experts(pipe)
    for name, value in (("cfg_2", cfg_2), ("boundary_ratio", boundary_ratio)):
        if value is not None and not experts:
            raise ModelError(f"{name} applies to two-expert models (Wan 2.2 A14B); this model has one transformer. "
                             f"Leave {name} empty (None).")
    if cfg_2 is not None:
        check_scale("cfg_2", cfg_2)
    if boundary_ratio is not None:
        check_positive("boundary_ratio", boundary_ratio, "e.g. 0.875 (Wan 2.2 T2V) or 0.9 (I2V)")
        if boundary_ratio >= 1:
            raise ModelError(f"boundary_ratio={boundary_ratio} must be between 0 and 1 (exclusive): the share of the "
                             "noise schedule the high-noise expert runs, e.g. 0.875. Leave it empty for the model's own.")
    return SamplerChoice(
        scheduler, scheduler_class(shipped, scheduler), model_shift if shift is None else float(shift), shift is None,
        float(cfg), (float(cfg if cfg_2 is None else cfg_2)) if experts else None,
        (pipe.config["boundary_ratio"] if boundary_ratio is None else float(boundary_ratio)) if experts else None,
        defaults.shift_for(*size) if defaults.flow_matching else None, dynamic)


def check_step_count(shipped, steps: int) -> None:
    """A scheduler that stretches its schedule to end at `shift_terminal` (LTX-2's) divides by the
    distance its last sigma travels, which is zero for a single step: diffusers then samples NaN."""
    terminal = shipped.config.get("shift_terminal")
    if terminal and steps < 2:
        raise ModelError(f"steps={steps} is too few for this model's scheduler ({type(shipped).__name__}), which "
                         f"stretches its schedule to end at shift_terminal={terminal:g}: one step gives NaN latents. "
                         "Use 2 steps or more.")


def scheduler_class(shipped, name: str) -> str:
    return {"default": type(shipped).__name__, "unipc": "UniPCMultistepScheduler",
            "dpmpp_2m": "DPMSolverMultistepScheduler", "flow_match_euler": "FlowMatchEulerDiscreteScheduler"}[name]


def build_scheduler(shipped, choice: SamplerChoice):
    """A new scheduler for one call, from the shipped one's config (never the shipped object)."""
    import diffusers

    cls = getattr(diffusers, choice.scheduler_class) if choice.scheduler != "default" else type(shipped)
    overrides = {}
    if choice.scheduler == "dpmpp_2m":
        overrides = dict(algorithm_type="dpmsolver++", solver_order=2)
    if choice.shift is not None:
        overrides[_shift_key(cls)] = choice.shift
    return cls.from_config(shipped.config, **overrides)


def _shift_key(cls) -> str:
    accepted = inspect.signature(cls.__init__).parameters
    return next(k for k in SHIFT_KEYS if k in accepted)


def check_scale(name: str, value: object) -> None:
    """A guidance scale: NaN would run unguided (every `> 1` test is false), inf gives NaN frames."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ModelError(f"{name}={value!r} must be a number, e.g. 5.0 (1.0 turns guidance off).")
    if not math.isfinite(value):
        raise ModelError(f"{name}={value} is not a finite number; use e.g. 5.0 (1.0 turns guidance off).")
    if value < 0:
        raise ModelError(f"{name}={value} must be 0 or more; use e.g. 5.0 (1.0 turns guidance off).")


def check_positive(name: str, value: object, example: str) -> None:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value) or value <= 0:
        raise ModelError(f"{name}={value!r} must be a finite number above 0 ({example}); leave it empty for the model's own.")
