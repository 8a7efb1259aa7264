"""Sample: encode the prompt, run the family's own diffusers denoise loop under a strategy.

The denoise loop is diffusers' (`output_type="latent"`, prompt embeddings passed in), so the
latents match the plain pipeline exactly; what vidmem adds is where every weight lives while
it runs. Noise comes from a CPU generator, so a seed gives the same video on any device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
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
from .hooks import RunHooks
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
    problem = spec.frames_error(request.frames)
    if problem:
        raise ModelError(problem)
    multiple = spatial_multiple(pipe)
    for name, value in (("width", request.width), ("height", request.height)):
        if value < multiple or value % multiple:
            fix = max(multiple, value // multiple * multiple)
            raise ModelError(f"{name}={value} must be a multiple of {multiple} for {spec.name}; use {fix} or {fix + multiple}.")
    if request.steps < 1:
        raise ModelError(f"steps={request.steps} must be at least 1.")
    if loaded.needs_image and request.image is None:
        raise ModelError(f"{loaded.class_name} is image-to-video: connect an IMAGE to the sampler's image input.")
    if not loaded.accepts_image and request.image is not None:
        raise ModelError(f"{loaded.class_name} is text-to-video: disconnect the image input or load an I2V model.")


def sample_stage(loaded: LoadedPipeline, strategy: MemoryStrategy) -> StageComponents:
    pipe, spec = loaded.pipe, loaded.spec
    # The text_encoder input places the prompt encoder only; an image encoder follows the tier.
    on_cpu = {"text_encoder"} if strategy.text_encoder is TextEncoderPlacement.CPU else set()
    names = [name for name in spec.encoders if name not in on_cpu] + list(spec.denoisers)
    if loaded.needs_image:
        names.append("vae")  # image-to-video encodes the image with the VAE before the loop
    modules = {n: getattr(pipe, n) for n in names if getattr(pipe, n, None) is not None}
    return StageComponents(modules, denoiser_blocks(pipe, spec))


def sample(
    loaded: LoadedPipeline,
    strategy: MemoryStrategy,
    request: SampleRequest,
    hooks: RunHooks = RunHooks(),
    backend: Backend | None = None,
    observer: Observer | None = None,
    device: torch.device | None = None,
) -> SampleResult:
    """Sample one video latent on `device` (default: CUDA when present), or on a given `backend`."""
    validate_request(loaded, request)
    if request.image is not None:
        loaded = loaded.image_mode()
    backend = backend or loaded.backend(device or resolve_compute_device())
    device = backend.device
    pipe, spec = loaded.pipe, loaded.spec
    receipt = {"strategy": strategy.describe(), "device": str(device), "stages": []}
    hooks.check_interrupt()
    stage = sample_stage(loaded, strategy)
    weight_bytes = device_weight_bytes(stage, strategy)
    receipt["device_weight_bytes"] = weight_bytes
    hooks.make_room(weight_bytes, device)
    # Per-block CUDA events are cheap for tens of blocks, not for every leaf of `sequential`.
    telemetry = strategy.offload is OffloadTier.BLOCK_SWAP
    with apply_strategy(stage, strategy, backend, observer, loaded.host_pool, telemetry) as handle:
        pipe.vidmem_execution_device = device
        try:
            with StageMeter("text_encode", device) as meter:
                embeds = _encode(pipe, spec, request, strategy, device)
                if strategy.text_encoder is TextEncoderPlacement.OFFLOAD_AFTER_ENCODING:
                    # Only the prompt encoder is done now; an image encoder runs inside the loop's setup.
                    handle.evict("text_encoder")
            receipt["stages"].append(meter.as_dict())
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


@torch.no_grad()  # as the pipeline's own __call__: no autograd graph, same kernels
def _encode(pipe, spec, request: SampleRequest, strategy: MemoryStrategy, device: torch.device) -> dict:
    encode_device = torch.device("cpu") if strategy.text_encoder is TextEncoderPlacement.CPU else device
    positive, negative = pipe.encode_prompt(
        prompt=request.prompt,
        negative_prompt=request.negative_prompt,
        do_classifier_free_guidance=request.cfg > 1.0,
        num_videos_per_prompt=1,
        max_sequence_length=spec.max_sequence_length,
        device=encode_device,
    )
    move = lambda t: None if t is None else t.to(device)  # noqa: E731 - embeddings follow compute
    return {"prompt_embeds": move(positive), "negative_prompt_embeds": move(negative)}


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
