"""Context windows on a denoiser: each forward of the whole clip runs as overlapping windows.

Why here and not in the loop: diffusers' denoising loop stays diffusers' (the scheduler, guidance,
image conditioning, the step callbacks); only the transformer's forward changes. For the length of
one call, each denoiser gets a hook in its own diffusers `HookRegistry` (named `vidmem_context_windows`,
removed in `finally`) whose forward slices the latent's time axis into the windows of
memory/windows.py, runs the transformer on each and blends the outputs by their weights into a
tensor of the shape the pipeline expects. The tiers' hooks sit on the denoiser's `__call__` and on
its blocks, so they stream the weights once per window pass exactly as for a whole-clip pass.

What is sliced with the frames, per family (everything else passes through untouched):
- Wan: `hidden_states` [B, C, F, H, W] on axis 2; I2V's condition channels (mask + encoded
  frames) are concatenated on the channel axis of the same tensor, so they are sliced with it.
  Wan 2.2 TI2V-5B's per-token timesteps (`expand_timesteps`: [B, F * h * w]) are sliced with
  their tokens. Rotary positions come from the window's own shape: each window is placed at 0.
- CogVideoX: `hidden_states` [B, F, C, H, W] on axis 1 (I2V's image latents are concatenated on
  axis 2); the rotary embedding the pipeline computed for the whole clip is cut to the window's
  first frames, so again each window is placed at 0, as the model was trained.
Windows of latent frames whose output no other window shares are the transformer's output on that
window, bit for bit (weight 1).

A step cache beside windows (pipelines/step_cache.py) keeps one cache state per window: a hook named
`WINDOW_PASSES_HOOK` in the denoiser's registry, when there is one, is entered around each window's
pass (its `window(index)`), and gives that window its own cache context.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, ContextManager, Iterator, Mapping

import torch
from torch import nn

from ..memory.windows import WindowSchedule, latent_count
from .family import ModelError
from .hook_attributes import as_found, leave_as_found

HOOK_NAME = "vidmem_context_windows"
WINDOW_PASSES_HOOK = "vidmem_window_passes"  # entered around each window's pass when present (the step cache's)
TIME_AXIS = {"wan": 2, "cogvideox": 1, "hunyuanvideo1.5": 2}  # where the latent frames are in the denoiser's hidden_states


@dataclass(frozen=True)
class ContextWindows:
    """`window` and `overlap` in video frames (0: off), as the Sampler takes them."""

    window: int = 0
    overlap: int = 0

    @property
    def on(self) -> bool:
        return self.window > 0

    def count(self, frames: int, temporal_factor: int) -> int:
        """Windows a step runs at `frames` (1: off, or one window covering the clip)."""
        return self.schedule(frames, temporal_factor).count if self.on else 1

    def schedule(self, frames: int, temporal_factor: int) -> WindowSchedule:
        """The latent windows of a clip of `frames` video frames."""
        return WindowSchedule(latent_count(frames, temporal_factor), latent_count(self.window, temporal_factor),
                              self.overlap // temporal_factor)


def window_problem(family: str, denoiser_config, windows: ContextWindows, frames: int, frames_error,
                   temporal_factor: int) -> str | None:
    """Why `windows` cannot run on this model at `frames` (None: they can, or they are off)."""
    for name, value in (("window", windows.window), ("window_overlap", windows.overlap)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            return f"{name}={value!r} must be a whole number of video frames, 0 (off) or more."
    if not windows.on and not windows.overlap:
        return None
    if not windows.on:
        return f"window_overlap={windows.overlap} needs a window: set window (e.g. 81) or window_overlap to 0."
    if family not in TIME_AXIS:
        return (f"window={windows.window}: context windows are not supported for {family} yet (Wan, CogVideoX and "
                "HunyuanVideo 1.5 are); set window to 0.")
    if (denoiser_config.get("patch_size_t") or 1) > 1:
        return (f"window={windows.window}: CogVideoX 1.5 pads its latent to whole temporal patches, which windows "
                "do not split yet; set window to 0.")
    problem = frames_error(windows.window)
    if problem:
        return problem.replace('frames=', 'window=', 1)
    # CogVideoX-5b I2V learned its position table at one clip length (sample_frames, diffusers' default 49): for any
    # other diffusers silently computes an untrained table, and every window pass would run on it.
    learned = denoiser_config.get("sample_frames", 49) if denoiser_config.get("use_learned_positional_embeddings") else None
    if learned and windows.window < frames and windows.window != learned:
        return (f"window={windows.window}: this model learned its positions for {learned}-frame clips; a window of "
                f"another length runs on positions it was not trained on. Use window={learned}.")
    if windows.overlap >= windows.window:
        return (f"window_overlap={windows.overlap} must be smaller than window={windows.window}; "
                f"use e.g. {_rounded(windows.window // 5, temporal_factor)} (a fifth of the window).")
    if windows.overlap % temporal_factor:
        fix = _rounded(windows.overlap, temporal_factor)
        return (f"window_overlap={windows.overlap} must be a multiple of {temporal_factor} video frames (one latent "
                f"frame each); use {fix} or {fix + temporal_factor}.")
    return None


def _rounded(frames: int, factor: int) -> int:
    return frames // factor * factor


def window_note(windows: ContextWindows, frames: int) -> str | None:
    """Why a valid window changes nothing (it covers the whole clip), for the receipt."""
    if windows.on and windows.window >= frames:
        return f"window={windows.window} covers all {frames} frames: sampled as one clip, no windows."
    return None


@contextmanager
def context_windows(denoisers: Mapping[str, nn.Module], family: str, schedule: WindowSchedule) -> Iterator[dict]:
    """Run each denoiser's forward as `schedule`'s windows for the length of the `with`.

    Yields the receipt entry (the latent spans and how many window passes ran). On exit, success or
    error, each denoiser's forward and hook registry are as before.

        with context_windows(denoisers(pipe, spec), spec.name, schedule) as receipt:
            pipe(...)
    """
    from diffusers.hooks import HookRegistry

    receipt = {"latent_frames": schedule.frames, "window": schedule.window, "overlap": schedule.overlap,
               "windows": schedule.describe(), "passes": 0}
    hooked: list[tuple[nn.Module, dict]] = []
    try:
        for module in denoisers.values():
            hooked.append((module, as_found(module)))
            HookRegistry.check_if_exists_or_initialize(module).register_hook(
                _hook_class()(schedule, TIME_AXIS[family], receipt), HOOK_NAME)
        yield receipt
    finally:
        for module, before in reversed(hooked):
            registry = getattr(module, "_diffusers_hook", None)
            if registry is not None and registry.get_hook(HOOK_NAME) is not None:
                registry.remove_hook(HOOK_NAME, recurse=False)
            leave_as_found(module, before)  # back to the class's forward, as before


@lru_cache(maxsize=None)
def _hook_class() -> type:
    from diffusers.hooks import ModelHook

    class WindowsHook(ModelHook):
        """new_forward: the whole clip's forward as blended window forwards."""

        def __init__(self, schedule: WindowSchedule, axis: int, receipt: dict) -> None:
            super().__init__()
            self.schedule, self.axis, self.receipt = schedule, axis, receipt

        def new_forward(self, module: nn.Module, *args, **kwargs):
            forward = self.fn_ref.original_forward
            bound = inspect.signature(forward).bind(*args, **kwargs)
            call = dict(bound.arguments)
            call.update(call.pop("kwargs", {}))
            return_dict = call.pop("return_dict", True)
            listener = module._diffusers_hook.get_hook(WINDOW_PASSES_HOOK)
            around = listener.window if listener is not None else None
            output = blended_forward(forward, call, self.schedule, self.axis, around)
            self.receipt["passes"] += self.schedule.count
            if return_dict:
                from diffusers.models.modeling_outputs import Transformer2DModelOutput

                return Transformer2DModelOutput(sample=output)
            return (output,)

    return WindowsHook


def blended_forward(forward, call: dict, schedule: WindowSchedule, axis: int,
                    around: Callable[[int], ContextManager] | None = None) -> torch.Tensor:
    """`forward(**call)` over the whole clip, computed window by window and blended; `around(index)`,
    when given, is entered around window `index`'s forward (a step cache's per-window state)."""
    hidden = call["hidden_states"]
    frames = hidden.shape[axis]
    if frames != schedule.frames:
        raise ModelError(f"context windows were planned for {schedule.frames} latent frames but the denoiser got "
                         f"{frames}; this is a bug, please report it with the model and frame count.")
    total = weights_sum = None
    for index, (start, stop) in enumerate(schedule.spans):
        with around(index) if around is not None else nullcontext():
            out = forward(**window_call(call, axis, start, stop, frames), return_dict=False)[0]
        weight = torch.tensor(schedule.weights(index), dtype=torch.float32, device=out.device)
        weight = weight.view([-1 if dim == axis else 1 for dim in range(out.ndim)])
        if total is None:
            shape = list(out.shape)
            shape[axis] = frames
            total = torch.zeros(shape, dtype=torch.float32, device=out.device)
            weights_sum = torch.zeros([frames if dim == axis else 1 for dim in range(out.ndim)], dtype=torch.float32,
                                      device=out.device)
        total.narrow(axis, start, stop - start).add_(out.float() * weight)
        weights_sum.narrow(axis, start, stop - start).add_(weight)
        out_dtype = out.dtype  # what the plain forward returns (the pipelines cast the input to it today)
        del out
    return (total / weights_sum).to(out_dtype)


def window_call(call: dict, axis: int, start: int, stop: int, frames: int) -> dict:
    """The forward's arguments for latent frames start..stop of `frames`."""
    window = dict(call)
    window["hidden_states"] = call["hidden_states"].narrow(axis, start, stop - start)
    timestep = call.get("timestep")
    if isinstance(timestep, torch.Tensor) and timestep.ndim == 2:  # Wan 2.2 TI2V: one timestep per token
        if timestep.shape[1] % frames:
            raise ModelError(f"context windows cannot split {timestep.shape[1]} per-token timesteps over {frames} "
                             "latent frames; set window to 0.")
        window["timestep"] = timestep.unflatten(1, (frames, -1))[:, start:stop].flatten(1)
    rotary = call.get("image_rotary_emb")
    if rotary is not None:  # CogVideoX: rows are frame-major; the window's own positions are the first rows
        rows = rotary[0].shape[0] // frames * (stop - start)
        window["image_rotary_emb"] = tuple(part[:rows] for part in rotary)
    return window


@contextmanager
def windows_for_call(loaded, request, resumed_from: int = 0, earlier_passes: int = 0) -> Iterator[dict]:
    """The request's windows on the loaded pipeline's denoisers for one sampling call; yields the
    receipt entry ({} when off, a note when the window covers the clip).

    `resumed_from`, `earlier_passes`: this attempt resumes after that many finished steps, from an
    attempt (or several) that ran out of memory after `earlier_passes` window passes; the receipt's
    `passes` counts every pass that ran, theirs too. The rung runs again the step the error cut
    short, so its passes that had finished count twice: as many as an uninterrupted run's only
    when the error came at a step's first pass."""
    from .family import denoisers

    windows = ContextWindows(request.window, request.window_overlap)
    note = window_note(windows, request.frames)
    if not windows.on or note:
        yield {"note": note, "summary": note} if note else {}
        return
    pipe, spec = loaded.pipe, loaded.spec
    schedule = windows.schedule(request.frames, pipe.vae_scale_factor_temporal)
    with context_windows(denoisers(pipe, spec), spec.name, schedule) as receipt:
        receipt["passes"] = earlier_passes
        yield receipt
    resumed = (f" ran ({receipt['passes'] - earlier_passes} of them after resuming from step {resumed_from} under "
               f"the out-of-memory ladder's rung, which runs again the step the error cut short)") if resumed_from else ""
    receipt["summary"] = (f"context windows: {schedule.count} windows of {windows.window} frames, {windows.overlap} "
                          f"shared (latent frames {', '.join(schedule.describe())}); {receipt['passes']} denoiser "
                          f"passes{resumed}")
