"""Sample: encode the prompt, run the family's own diffusers denoise loop under a strategy.

The denoise loop is diffusers' (`output_type="latent"`, prompt embeddings passed in), so the
latents match the plain pipeline exactly; what vidmem adds is where every weight lives while
it runs. Noise comes from a CPU generator, so a seed gives the same video on any device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import Callable

import torch

from ..memory import (
    MemoryStrategy,
    OffloadTier,
    StageComponents,
    TextEncoderPlacement,
    apply_strategy,
    resolve_compute_device,
)
from ..memory.blockswap import Observer
from ..memory.offload import device_weight_bytes
from ..memory.device import Backend
from ..memory.telemetry import StageMeter
from .family import ModelError, denoiser_blocks, spatial_multiple
from .hooks import RunHooks, interrupt_checks, outer_blocks
from .prompts import call_embeds, encode_missing, look_up, prompt_receipt, prompt_texts
from .loader import LoadedPipeline


@dataclass(frozen=True)
class SampleRequest:
    prompt: str
    negative_prompt: str = ""
    width: int = 480
    height: int = 320
    frames: int = 49
    steps: int = 30
    cfg: float = 6.0
    seed: int = 0
    image: torch.Tensor | None = None  # ComfyUI IMAGE [1, H, W, C] in 0..1, for image-to-video


@dataclass
class SampleResult:
    latent: dict
    receipt: dict = field(default_factory=dict)


def validate_request(loaded: LoadedPipeline, request: SampleRequest) -> None:
    """Every check that needs no weights moved, so bad input leaves nothing applied."""
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
    _check_whole("steps", request.steps)
    if request.steps < 1:
        raise ModelError(f"steps={request.steps} must be at least 1.")
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


MAX_SEED = 0xFFFFFFFFFFFFFFFF  # torch.Generator.manual_seed takes 64 bits


def _check_whole(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise ModelError(f"{name}={value!r} must be a whole number.")


def check_cfg(cfg: object) -> None:
    """NaN would run unguided (every `cfg > 1` test is false) and inf gives NaN frames: refuse both."""
    if isinstance(cfg, bool) or not isinstance(cfg, Real):
        raise ModelError(f"cfg={cfg!r} must be a number, e.g. 5.0 (1.0 turns guidance off).")
    if not math.isfinite(cfg):
        raise ModelError(f"cfg={cfg} is not a finite number; use e.g. 5.0 (1.0 turns guidance off).")
    if cfg < 0:
        raise ModelError(f"cfg={cfg} must be 0 or more; use e.g. 5.0 (1.0 turns guidance off).")


def check_image(image: object) -> None:
    """A ComfyUI IMAGE: a float tensor [batch, height, width, 3 or 4], finite, with pixels in it."""
    if not isinstance(image, torch.Tensor):
        raise ModelError(f"image is a {type(image).__name__}, not an IMAGE; connect a Load Image node's IMAGE.")
    if image.ndim != 4 or image.shape[-1] not in (3, 4) or image.numel() == 0:
        raise ModelError(f"image has shape {tuple(image.shape)}; expected a ComfyUI IMAGE [batch, height, width, 3].")
    if not image.is_floating_point():
        raise ModelError(f"image has dtype {image.dtype}; expected float pixels in 0..1 as ComfyUI's IMAGE.")
    if not torch.isfinite(image[:1]).all():  # only the first frame is used
        raise ModelError("image contains NaN or infinite pixels; it would give NaN frames. Check the node that made it.")


def sample_stage(loaded: LoadedPipeline, strategy: MemoryStrategy, encode_text: bool = True) -> StageComponents:
    """The components the strategy is applied to; without `encode_text` (every prompt embedding
    came from the cache) the prompt encoder is left out, so it is neither run nor onloaded."""
    pipe, spec = loaded.pipe, loaded.spec
    # The text_encoder input places the prompt encoder only; an image encoder follows the tier.
    on_cpu = {"text_encoder"} if strategy.text_encoder is TextEncoderPlacement.CPU or not encode_text else set()
    names = [name for name in spec.encoders if name not in on_cpu] + list(spec.denoisers)
    if loaded.needs_image:
        names.append("vae")  # image-to-video encodes the image with the VAE before the loop
    modules = {n: getattr(pipe, n) for n in names if getattr(pipe, n, None) is not None}
    return StageComponents(modules, denoiser_blocks(pipe, spec))


def interruptible_blocks(loaded: LoadedPipeline) -> list[torch.nn.Module]:
    """Where Cancel is checked: before every denoiser block and every encoder block (and, for
    image-to-video, every VAE block: Wan I2V encodes a whole video of conditioning frames)."""
    pipe, spec = loaded.pipe, loaded.spec
    blocks = [block for blocks in denoiser_blocks(pipe, spec).values() for block in blocks]
    encoders = list(spec.encoders) + (["vae"] if loaded.needs_image else [])
    for name in encoders:
        if getattr(pipe, name, None) is not None:
            blocks += outer_blocks(getattr(pipe, name))
    return blocks


def sample(
    loaded: LoadedPipeline,
    strategy: MemoryStrategy,
    request: SampleRequest,
    hooks: RunHooks = RunHooks(),
    backend: Backend | None = None,
    observer: Observer | None = None,
    device: torch.device | None = None,
) -> SampleResult:
    """Sample one video latent on `device` (default: CUDA when present), or on a given `backend`.

    Cancel (`hooks.check_interrupt` raising) is checked before every transformer block and
    text-encoder block, so it stops the run within one block; everything is restored as after
    any other error. Prompt embeddings come from `hooks.prompt_cache` when it has them.
    """
    validate_request(loaded, request)
    if request.image is not None:
        loaded = loaded.image_mode()
    backend = backend or loaded.backend(device or resolve_compute_device())
    device = backend.device
    pipe, spec = loaded.pipe, loaded.spec
    receipt = {"strategy": strategy.describe(), "device": str(device), "stages": []}
    hooks.check_interrupt()
    texts = prompt_texts(pipe, spec.max_sequence_length, request.prompt, request.negative_prompt, request.cfg > 1.0)
    prompts = look_up(pipe, texts, hooks.prompt_cache)
    hits = len(prompts.embeds)
    stage = sample_stage(loaded, strategy, encode_text=not prompts.complete)
    weight_bytes = device_weight_bytes(stage, strategy)
    receipt["device_weight_bytes"] = weight_bytes
    hooks.make_room(weight_bytes, device)
    # Per-block CUDA events are cheap for tens of blocks, not for every leaf of `sequential`.
    telemetry = strategy.offload is OffloadTier.BLOCK_SWAP
    with interrupt_checks(interruptible_blocks(loaded), hooks.check_interrupt), \
            apply_strategy(stage, strategy, backend, observer, loaded.host_pool, telemetry) as handle:
        pipe.vidmem_execution_device = device
        try:
            with StageMeter("text_encode", device) as meter:
                on_cpu = strategy.text_encoder is TextEncoderPlacement.CPU
                encode_missing(pipe, prompts, torch.device("cpu") if on_cpu else device)
                if strategy.text_encoder is TextEncoderPlacement.OFFLOAD_AFTER_ENCODING:
                    # Only the prompt encoder is done now; an image encoder runs inside the loop's setup.
                    handle.evict("text_encoder")
            receipt["stages"].append(meter.as_dict())
            receipt["text_encode"] = prompt_receipt(prompts, hits)
            embeds = call_embeds(prompts, device)
            with StageMeter("denoise", device) as meter:
                raw = pipe(**_call_kwargs(loaded, request, embeds, hooks, expert_hand_off(pipe, handle))).frames
            receipt["stages"].append(meter.as_dict())
            if telemetry:
                receipt["swap"] = swap_receipt(handle.swap_summary(), meter.seconds, loaded.host_pool)
        finally:
            del pipe.vidmem_execution_device
    samples = spec.to_comfy_latent(pipe, raw, request.frames).to("cpu")
    latent = {"samples": samples, "vidmem": {"family": spec.name, "class_name": loaded.class_name, "frames": request.frames}}
    return SampleResult(latent, receipt)


def swap_receipt(summary: dict, denoise_seconds: float, pool) -> dict:
    """Totals of what streaming cost; `swap_cost` is the share of denoise time spent waiting for copies."""
    totals = summary["totals"]
    cost = totals["wait_s"] / denoise_seconds if denoise_seconds > 0 else 0.0
    return {**totals, "swap_cost": cost, "groups": len(summary["blocks"]), "host_pool": pool.stats()}


def expert_hand_off(pipe, handle) -> Callable[[int], None]:
    """Wan 2.2 A14B: after the last high-noise step, hand the swap pool to the low-noise expert."""
    boundary_ratio = pipe.config.get("boundary_ratio")
    if boundary_ratio is None or getattr(pipe, "transformer_2", None) is None:
        return lambda step: None
    boundary = boundary_ratio * pipe.scheduler.config.num_train_timesteps

    def after_step(step: int) -> None:
        timesteps = pipe.scheduler.timesteps
        if step + 1 < len(timesteps) and timesteps[step] >= boundary > timesteps[step + 1]:
            handle.hand_off("transformer", "transformer_2")

    return after_step


def _call_kwargs(loaded: LoadedPipeline, request: SampleRequest, embeds: dict, hooks: RunHooks,
                 after_step: Callable[[int], None]) -> dict:
    def on_step_end(pipe, step: int, timestep, tensors: dict) -> dict:
        after_step(step)
        hooks.on_step(step + 1, request.steps)
        hooks.check_interrupt()  # raising here stops the loop; the strategy is removed in `finally`
        return {}

    kwargs = dict(
        embeds,
        height=request.height,
        width=request.width,
        num_frames=request.frames,
        num_inference_steps=request.steps,
        guidance_scale=request.cfg,
        generator=torch.Generator("cpu").manual_seed(request.seed),
        output_type="latent",
        callback_on_step_end=on_step_end,
    )
    if loaded.needs_image:
        kwargs["image"] = comfy_image_to_pil(request.image)
    return kwargs


def comfy_image_to_pil(image: torch.Tensor):
    """ComfyUI IMAGE [B, H, W, C] in 0..1 -> the first frame as a PIL image."""
    from PIL import Image

    if image.ndim != 4 or image.shape[-1] not in (3, 4):
        raise ModelError(f"image has shape {tuple(image.shape)}; expected a ComfyUI IMAGE [batch, height, width, 3].")
    pixels = (image[0, ..., :3].clamp(0, 1) * 255).round().to(torch.uint8).cpu().numpy()
    return Image.fromarray(pixels)
