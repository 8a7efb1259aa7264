"""Every check of a sampling request that needs no weights moved, so bad input leaves nothing applied."""

from __future__ import annotations

from numbers import Integral
from pathlib import Path

import torch

from .attention import check_mask
from .family import ModelError, denoiser_blocks, denoisers, first_denoiser, positions_error, spatial_multiple
from .sample_call import call_pipeline, expert_steps
from .schedulers import SamplerChoice, build_scheduler, check_scale, check_step_count, resolve_sampler
from .step_cache import StepCache, check_block_metadata, check_cache_fits

MAX_SEED = 0xFFFFFFFFFFFFFFFF  # torch.Generator.manual_seed takes 64 bits


def validate_request(loaded, request) -> SamplerChoice:
    """ModelError naming the input and the fix; else the resolved sampler controls."""
    spec, pipe = loaded.spec, loaded.pipe
    _check_whole("frames", request.frames)
    problem = spec.frames_error(request.frames)
    if problem:
        raise ModelError(problem)
    multiple = spatial_multiple(pipe)
    for name, value in (("width", request.width), ("height", request.height)):
        _check_whole(name, value)
        if value < multiple or value % multiple:
            fix = max(multiple, value // multiple * multiple)
            raise ModelError(f"{name}={value} must be a multiple of {multiple} for {spec.name}; use {fix} or {fix + multiple}.")
    problem = positions_error(spec, first_denoiser(pipe).config, pipe.vae_scale_factor_spatial,
                              pipe.vae_scale_factor_temporal, _model_label(loaded), request.width, request.height,
                              request.frames)
    if problem:
        raise ModelError(problem)
    _check_whole("steps", request.steps)
    if request.steps < 1:
        raise ModelError(f"steps={request.steps} must be at least 1.")
    check_step_count(pipe.scheduler, request.steps)
    _check_whole("seed", request.seed)
    if not 0 <= request.seed <= MAX_SEED:
        raise ModelError(f"seed={request.seed} must be between 0 and {MAX_SEED}.")
    check_cfg(request.cfg)
    for name in ("prompt", "negative_prompt"):
        if not isinstance(getattr(request, name), str):
            raise ModelError(f"{name} must be text, not {type(getattr(request, name)).__name__}.")
    if loaded.needs_image and request.image is None:
        raise ModelError(f"{loaded.class_name} is image-to-video: connect an IMAGE to the sampler's image input.")
    if not loaded.accepts_image and request.image is not None:
        raise ModelError(f"{loaded.class_name} is text-to-video: disconnect the image input or load an I2V model.")
    if request.image is not None:
        check_image(request.image)
    _check_last_image(loaded, request)
    if not isinstance(request.cache, StepCache):
        raise ModelError(f"cache must be a step cache (the Step Cache node's output), not {type(request.cache).__name__}.")
    check_block_metadata(request.cache, denoiser_blocks(pipe, spec))
    check_windows(loaded, request)
    check_mask(request.speed.attention, masked_by(loaded))  # the device's own checks follow in resolve_speed
    choice = resolve_sampler(pipe, spec, request.scheduler, request.shift, request.cfg, request.cfg_2,
                             request.boundary_ratio, (request.width, request.height))
    check_cache_fits(request.cache, denoisers(pipe, spec), denoiser_blocks(pipe, spec), request.steps,
                     expert_split(pipe, spec, choice, request.steps) if request.cache.on else None)
    return choice


def expert_split(pipe, spec, choice: SamplerChoice, steps: int) -> dict[str, int] | None:
    """The steps each denoiser runs when they share the run (Wan 2.2 A14B's experts), as the call will split
    them (sample_call.expert_steps on the call this choice builds); None for one denoiser."""
    if len(denoisers(pipe, spec)) < 2:
        return None
    return expert_steps(call_pipeline(pipe, build_scheduler(pipe.scheduler, choice), choice.boundary_ratio), steps)


def masked_by(loaded) -> str:
    """The model, for attention.check_mask, when its attention passes a mask; "" when it passes none."""
    return f"{loaded.spec.name} ({_model_label(loaded)})" if loaded.spec.attention_masked else ""


def _check_whole(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise ModelError(f"{name}={value!r} must be a whole number.")


def check_cfg(cfg: object) -> None:
    """NaN would run unguided (every `cfg > 1` test is false) and inf gives NaN frames: refuse both."""
    check_scale("cfg", cfg)


def _model_label(loaded) -> str:
    return loaded.config_name or Path(loaded.folder).name or loaded.class_name


def _check_last_image(loaded, request) -> None:
    """First-last-frame: a model trained on both ends (the family says which: FamilySpec.last_frame_error)
    takes a last image, with a first one; one trained on both ends needs both. A model that takes none
    is named first, so the user is not sent to connect an image only to be told to remove both."""
    given = request.last_image is not None
    if given and not loaded.accepts_image:
        raise ModelError(f"last_image: {_model_label(loaded)} is text-to-video: disconnect last_image (and image), "
                         "or load a first-last-frame model (Wan 2.1 FLF2V 14B, Wan 2.2 I2V A14B).")
    if not given and request.image is None:
        return
    problem = loaded.spec.last_frame_error(loaded.image_mode().pipe, given)
    if problem:
        fix = "disconnect last_image" if given else "connect last_image"
        raise ModelError(f"last_image: {_model_label(loaded)} cannot run this way ({problem}); {fix} or load another model.")
    if request.image is None:
        raise ModelError("last_image needs image too: first-last-frame starts from image and ends on last_image; "
                         "connect the first frame to image.")
    if given:
        check_image(request.last_image, "last_image")


def check_image(image: object, name: str = "image") -> None:
    """A ComfyUI IMAGE: a float tensor [batch, height, width, 3 or 4], finite, with pixels in it."""
    if not isinstance(image, torch.Tensor):
        raise ModelError(f"{name} is a {type(image).__name__}, not an IMAGE; connect a Load Image node's IMAGE.")
    if image.ndim != 4 or image.shape[-1] not in (3, 4) or image.numel() == 0:
        fix = ("a mask or one-channel picture: convert it with core Convert Mask to Image first" if image.ndim == 3
               or (image.ndim == 4 and image.shape[-1] in (1, 2)) else "connect a Load Image node's IMAGE")
        raise ModelError(f"{name} has shape {tuple(image.shape)}; expected a ComfyUI IMAGE [batch, height, width, 3]: "
                         f"{fix}.")
    if not image.is_floating_point():
        raise ModelError(f"{name} has dtype {image.dtype}; expected float pixels in 0..1 as ComfyUI's IMAGE.")
    if not torch.isfinite(image[:1]).all():  # only the first frame is used
        raise ModelError(f"{name} contains NaN or infinite pixels; it would give NaN frames. Check the node that made it.")


def refuse_windows_in_parallel(request) -> None:
    """Context windows under context parallelism (not supported yet); a window covering the clip is a no-op."""
    if 0 < request.window < request.frames:
        raise ModelError(f"window={request.window}: context windows do not run with context parallelism yet; set "
                         "window to 0, or parallel to off.")


def refuse_cache_in_parallel(cache: StepCache) -> None:
    """First Block Cache and MagCache under context parallelism: their hooks on the first block sit outside
    diffusers' split of the tokens between the ranks, so they keep the whole video's first-block input while the
    last block returns one rank's share, and the first step fails (checked on two CPU ranks). TaylorSeer (lite)
    extrapolates the gathered output and decides from the step count alone, the same on every rank: it runs."""
    from .step_cache import CacheMethod

    if cache.method in (CacheMethod.FIRST_BLOCK, CacheMethod.MAG):
        raise ModelError(f"cache {cache.method.value} does not run with context parallelism: its hooks sit outside the "
                         "split of the tokens between the ranks (the first block's input is the whole video's, the last "
                         "block's output one rank's share); choose taylor_seer (decided from the step count, the same "
                         "on every rank), or context_parallel off.")


def check_windows(loaded, request) -> None:
    """`window` / `window_overlap` on the model's frame grid (a step cache runs beside them: one cache
    state per window, pipelines/step_cache.py)."""
    from .context_windows import ContextWindows, window_problem

    pipe, windows = loaded.pipe, ContextWindows(request.window, request.window_overlap)
    problem = window_problem(loaded.spec.name, first_denoiser(pipe).config, windows, request.frames, loaded.spec.frames_error,
                             pipe.vae_scale_factor_temporal)
    if problem:
        raise ModelError(problem)
