"""The pipeline object one call runs: the loaded pipeline's components, this call's scheduler.

Why a per-call object: the loaded pipeline is shared and cached by ComfyUI, so a call must not
change its scheduler, its boundary or any flag. `call_pipeline` builds a new pipeline of the same
class over the same components (nothing is copied or moved; building it takes about a
millisecond), and the call's own settings live on it and die with it, whatever happens.

The per-call class adds four things to diffusers' loop, each through a hook diffusers already
reads (so the loop itself is diffusers', unchanged):
- guidance per expert: `do_classifier_free_guidance` asks the scale of the expert about to run,
  so a scale of 1 skips the negative pass for that expert (diffusers asks `guidance_scale` only);
- resuming after an out-of-memory error: `interrupt` is true for the steps already done, so the
  loop skips them with diffusers' own `continue`, and its indices (`timesteps[i - 1]`, the
  callback's step) stay those of the whole run; `prepare_latents` hands back the latents of the
  last finished step and the conditioning the first attempt prepared (no random draws repeated),
  `prepare_audio_latents` LTX-2's audio latents of that step, and `vidmem_once` what a family's
  adapter made once outside `prepare_latents` (HunyuanVideo 1.5's SigLIP embeddings and image
  latents), so no image goes through the VAE twice (Wan 2.1's CLIP embedding, made in its call,
  is made again: the same values); the scheduler comes back with its state after that step.
- a record of each finished step (`StepRecord`), taken in the step-end callback;
- Wan image-to-video's conditioning video made in the VAE's dtype: `prepare_latents` gets the image
  (and last image) already cast, so its empty frames and their concatenation never exist in float32
  (the same values; the planner traces it so: configs/workloads.py, `wan_condition_video`).
"""

from __future__ import annotations

import copy
import functools
import inspect
from dataclasses import dataclass, field
from functools import lru_cache

import torch

OVERRIDES = ("set_timesteps", "step")  # instance attributes set here, never part of a saved state
# diffusers classes whose prepare_latents concatenates the image with empty frames into a whole-clip
# video for the VAE (pipeline_wan_i2v.py); vidmem hands them the image in the VAE's dtype
CONDITION_VIDEO_PIPELINES = ("WanImageToVideoPipeline",)


@dataclass(frozen=True)
class ResumePoint:
    """Everything the denoising loop carries from one step to the next, after `steps_done` steps."""

    steps_done: int
    latents: torch.Tensor
    scheduler_class: type
    scheduler_state: dict  # a deep copy of the scheduler's attributes (its step index, history)
    generator_state: torch.Tensor  # the CPU generator after that step (CogVideoX's DPM draws noise per step)
    carry: torch.Tensor | None  # CogVideoXDPMScheduler's previous x0 prediction, a loop variable in diffusers
    prepared: object  # what prepare_latents returned: latents, or (latents, conditioning...)
    # LTX-2's audio latents after that step: its one transformer denoises audio beside the video and
    # the audio tokens reach the video through cross-attention, so they resume with it (None: no audio)
    audio_latents: torch.Tensor | None = None
    kept: dict = field(default_factory=dict)  # what `vidmem_once` computed in the first attempt, by name


class _CallOverrides:
    _vidmem_skip_steps = 0
    _vidmem_resume: ResumePoint | None = None
    _vidmem_prepared = None
    _vidmem_kept: dict | None = None  # by name, what vidmem_once computed (call_pipeline: each call its own)

    def vidmem_once(self, name: str, compute):
        """`compute()`, run in the first attempt only: a resumed attempt gets the first attempt's value.
        For conditioning a family's adapter makes outside `prepare_latents` (image encodes, no randomness)."""
        if self._vidmem_kept is None:
            self._vidmem_kept = {}
        if name not in self._vidmem_kept:
            self._vidmem_kept[name] = compute()
        return self._vidmem_kept[name]

    @property
    def do_classifier_free_guidance(self) -> bool:
        """Guidance for the expert about to run (Wan 2.2 A14B: `guidance_scale_2` below the boundary).

        Before the loop (prompt encoding) it is true if any expert guides, so the negative
        embeddings are passed through; single-expert pipelines behave as diffusers' own.
        """
        first, second = self._guidance_scale, getattr(self, "_guidance_scale_2", None)
        boundary = self.config.get("boundary_ratio")
        if boundary is None or second is None:
            return first > 1.0
        timestep = getattr(self, "_current_timestep", None)
        if timestep is None:
            return max(first, second) > 1.0
        high_noise = timestep >= boundary * self.scheduler.config.num_train_timesteps
        return (first if high_noise else second) > 1.0

    @property
    def interrupt(self) -> bool:
        """diffusers reads this once at the top of every step and `continue`s when true."""
        if self._vidmem_skip_steps > 0:
            self._vidmem_skip_steps -= 1
            return True
        return self._interrupt

    def prepare_latents(self, *args, **kwargs):
        resume = self._vidmem_resume
        if resume is None:
            if self._builds_condition_video():
                args, kwargs = self._images_in_vae_dtype(args, kwargs)
            self._vidmem_prepared = super().prepare_latents(*args, **kwargs)
            return self._vidmem_prepared
        if isinstance(resume.prepared, tuple):
            return (resume.latents, *resume.prepared[1:])
        return resume.latents

    def _builds_condition_video(self) -> bool:
        """Whether `prepare_latents` pads the image to a whole clip of frames before the VAE encodes it:
        Wan 2.1 I2V, FLF2V and Wan 2.2 I2V A14B. Wan 2.2 TI2V-5B (`expand_timesteps`) encodes the image alone."""
        is_wan_i2v = any(cls.__name__ in CONDITION_VIDEO_PIPELINES for cls in type(self).__mro__)
        return is_wan_i2v and not self.config.get("expand_timesteps", False)

    def _images_in_vae_dtype(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """`image` and `last_image` cast to the VAE's dtype, so `prepare_latents` makes its empty frames and
        their concatenation in that dtype: diffusers' __call__ hands them over in float32 and casts the
        whole-clip video only after the concatenation, which held two float32 clips at once (8 bytes per
        value, 21 GiB at 1280x720x1025) where two in the VAE's bf16 take 4. The same values either way: a cast
        works element by element, and the concatenation moves elements without changing them."""
        bound = inspect.signature(super().prepare_latents).bind(*args, **kwargs)
        for name in ("image", "last_image"):
            value = bound.arguments.get(name)
            if isinstance(value, torch.Tensor):
                bound.arguments[name] = value.to(self.vae.dtype)
        return bound.args, bound.kwargs

    def prepare_audio_latents(self, *args, **kwargs):
        """LTX-2: the audio latents of the last finished step when resuming (no fresh noise drawn)."""
        resume = self._vidmem_resume
        if resume is None or resume.audio_latents is None:
            return super().prepare_audio_latents(*args, **kwargs)
        return resume.audio_latents


@lru_cache(maxsize=None)
def call_class(base: type) -> type:
    return type(f"{base.__name__}Call", (_CallOverrides, base), {"__module__": base.__module__})


def call_pipeline(pipe, scheduler, boundary_ratio: float | None, resume: ResumePoint | None = None):
    """A pipeline of `pipe`'s class over `pipe`'s components, with `scheduler` (a new object: see
    pipelines/schedulers.py) or, when resuming, the scheduler as it was after `resume.steps_done`."""
    config = {k: pipe.config[k] for k in ("boundary_ratio", "expand_timesteps") if k in pipe.config}
    if boundary_ratio is not None:
        config["boundary_ratio"] = boundary_ratio
    if resume is not None:
        scheduler = _restored_scheduler(resume)
    call = call_class(type(pipe))(**dict(pipe.components, scheduler=scheduler), **config)
    call.set_progress_bar_config(disable=True)
    call._vidmem_resume = resume
    call._vidmem_skip_steps = resume.steps_done if resume is not None else 0
    call._vidmem_kept = dict(resume.kept) if resume is not None else {}
    return call


def _restored_scheduler(resume: ResumePoint):
    """The scheduler after `resume.steps_done` steps; the pipeline's `set_timesteps` would reset it."""
    scheduler = object.__new__(resume.scheduler_class)
    scheduler.__dict__.update(copy.deepcopy(resume.scheduler_state))
    scheduler.set_timesteps = _keep_timesteps
    return scheduler


def _keep_timesteps(*args, sigmas=None, timesteps=None, **kwargs) -> None:
    """The restored scheduler's `set_timesteps`: the schedule after the finished steps stands. It
    names `sigmas` and `timesteps` because pipelines that pass them (HunyuanVideo 1.5's
    retrieve_timesteps) first check that the scheduler's signature accepts them."""


class StepRecord:
    """The resume point after the last finished step of one attempt (None before the first)."""

    def __init__(self, call, generator: torch.Generator, previous: ResumePoint | None = None) -> None:
        self.call = call
        self.generator = generator
        self.last = previous
        self.raw: torch.Tensor | None = None  # the pipeline's latents when the attempt finished
        self.audio: torch.Tensor | None = None  # its audio latents, for a family that makes sound (LTX-2)
        self._carry = previous.carry if previous is not None else None
        self._track_carry(call.scheduler)

    def step_done(self, step: int, latents: torch.Tensor) -> None:
        """From the step-end callback: `step` (0-based, of the whole run) has finished."""
        scheduler = self.call.scheduler
        state = copy.deepcopy({k: v for k, v in scheduler.__dict__.items() if k not in OVERRIDES})
        self.last = ResumePoint(step + 1, latents, type(scheduler), state, self.generator.get_state(), self._carry,
                                self.call._vidmem_prepared if self.last is None else self.last.prepared,
                                getattr(self.call, "_vidmem_step_audio", None), dict(self.call._vidmem_kept or {}))

    def _track_carry(self, scheduler) -> None:
        """CogVideoXDPMScheduler takes the previous step's x0 prediction as an argument that
        diffusers keeps in a loop variable; record it, and hand it back to a resumed loop's first step."""
        step = scheduler.step
        parameters = inspect.signature(step).parameters
        if "old_pred_original_sample" not in parameters:
            return
        position = list(parameters).index("old_pred_original_sample")

        @functools.wraps(step)
        def tracked(*args, **kwargs):
            args = list(args)
            if len(args) > position and args[position] is None and self._carry is not None:
                args[position] = self._carry
            output = step(*args, **kwargs)
            self._carry = output[1]
            return output

        scheduler.step = tracked


def expert_steps(call, steps: int) -> dict[str, int]:
    """Steps each Wan 2.2 A14B expert runs in this call: the high-noise one while the timestep is at
    or above the boundary (as the pipeline decides), the low-noise one after."""
    scheduler = copy.deepcopy(call.scheduler)
    scheduler.set_timesteps(steps)
    boundary = call.config["boundary_ratio"] * scheduler.config.num_train_timesteps
    high = int((scheduler.timesteps >= boundary).sum())
    return {"transformer": high, "transformer_2": steps - high}
