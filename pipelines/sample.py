"""Sample: encode the prompt, run the family's own diffusers denoise loop under a strategy.

The denoise loop is diffusers' (`output_type="latent"`, prompt embeddings passed in), so the
latents match the plain pipeline exactly; what vidmem adds is where every weight lives while
it runs. Noise comes from a CPU generator, so a seed gives the same video on any device.

Per call, in this order (each undone in reverse, on success, error or Cancel alike): the
pipeline's LoRAs are applied beside their layers, then the strategy (so LoRA tensors stream with
their layers and count in the device bytes), on a per-call pipeline object carrying the call's
scheduler (pipelines/sample_call.py). An out-of-memory error while the weights are placed or while
denoising climbs the ladder of pipelines/sample_ladder.py and resumes from the last finished step;
one while the prompt encoder runs stops with a message naming `text_encoder=cpu`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Callable

import torch

from ..memory import (
    MemoryStrategy,
    OffloadTier,
    StageComponents,
    TextEncoderPlacement,
    apply_strategy,
    free_memory,
    resolve_compute_device,
)
from ..memory.blockswap import Observer
from ..memory.cleanup import is_out_of_memory
from ..memory.offload import device_weight_bytes, stage_tensors
from ..memory.plan.types import VideoShape
from ..memory.device import Backend
from ..memory.lora import apply_loras
from ..memory.telemetry import StageMeter
from ..memory.warm import call_on
from .family import ModelError, denoiser_blocks, denoisers
from .hooks import RunHooks, interrupt_checks, outer_blocks
from .loader import LoadedPipeline, torch_dtype
from .ltx2_audio import with_audio
from .stages import stage_modules
from .lora import describe_loras, lora_patches
from .room import keep_bytes, sample_room
from .prompts import PromptEmbeddings, call_embeds, encode_missing, look_up, prompt_receipt, prompt_texts
from .sample_call import ResumePoint, StepRecord, call_pipeline, expert_steps
from .sample_checks import MAX_SEED, check_cfg, check_image, masked_by, validate_request  # noqa: F401 (public here too)
from .sample_chunks import can_chunk, chunk_budget, chunks_for_call
from .sample_ladder import (Rung, SamplingOutOfMemory, next_rung, no_climb_message, out_of_memory_message,
                            planner_fits, text_encoder_message, when_out_of_memory)
from .schedulers import SamplerChoice, build_scheduler
from .speed import NO_SPEED_NODE, ResolvedSpeed, Speed, resolve_speed, speed_for_call
from .step_cache import AppliedCache, CacheMethod, CacheTally, StepCache
from .context_windows import windows_for_call

log = logging.getLogger("vidmem")


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
    scheduler: str = "default"  # pipelines/schedulers.py SCHEDULERS; "default": what the model ships
    shift: float | None = None  # flow-matching models (Wan) only; None: the model's own
    cfg_2: float | None = None  # Wan 2.2 A14B's low-noise expert; None: same as cfg
    boundary_ratio: float | None = None  # Wan 2.2 A14B; None: the model's own (0 < ratio < 1)
    cache: StepCache = StepCache()  # step caching (pipelines/step_cache.py); off by default
    speed: Speed = NO_SPEED_NODE  # attention kernel, compiled blocks, fp8 matmul (pipelines/speed.py)
    # First-last-frame (FamilySpec.last_frame_error says which models): the video's last frame, as `image`
    last_image: torch.Tensor | None = None
    window: int = 0  # context windows in video frames (pipelines/context_windows.py); 0: the whole clip at once
    window_overlap: int = 0  # video frames neighbouring windows share and blend


@dataclass
class SampleResult:
    latent: dict
    receipt: dict = field(default_factory=dict)


def sample_stage(loaded: LoadedPipeline, strategy: MemoryStrategy, encode_text: bool = True) -> StageComponents:
    """The components the strategy is applied to; without `encode_text` (every prompt embedding
    came from the cache) the prompt encoder is left out, so it is neither run nor onloaded."""
    pipe, spec = loaded.pipe, loaded.spec
    modules = stage_modules(pipe, spec, strategy.text_encoder, loaded.needs_image, encode_text)  # the planner reads the same
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


@contextmanager
def encode_caches_dropped(loaded: LoadedPipeline) -> Iterator[None]:
    """Image-to-video's VAE encode (Wan's) keeps each causal conv's last frames on the device and clears them only
    when the encode finishes: after a Cancel or an error inside it they would stay (a GiB and more at 720p), hung
    on the module where no placement, Free VRAM or plan sees them, until the next encode. Cleared on the way out."""
    try:
        yield
    finally:
        clear = getattr(loaded.pipe.vae, "clear_cache", None) if loaded.needs_image else None
        if clear is not None:
            clear()


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
    any other error. Prompt embeddings come from `hooks.prompt_cache` when it has them. An
    out-of-memory error while the weights are placed or while denoising frees memory, escalates the
    strategy and resumes from the last finished step (`receipt["oom_ladder"]`); under the last rung,
    or while the prompt encoder runs, it raises SamplingOutOfMemory saying what to change.
    """
    choice = validate_request(loaded, request)
    if request.image is not None:
        loaded = loaded.image_mode()
    backend = backend or loaded.backend(device or resolve_compute_device())
    device = backend.device
    pipe, spec = loaded.pipe, loaded.spec
    # Refused here, before anything moves, when a choice cannot run on this device or model.
    speed = resolve_speed(request.speed, device, torch_dtype(loaded.dtype_name), denoisers(loaded.pipe, loaded.spec),
                          masked_by=masked_by(loaded))
    receipt = {"strategy": strategy.describe(), "device": str(device), "stages": [], "sampler": choice.describe(),
               "lora": describe_loras(loaded.loras)}
    hooks.check_interrupt()
    texts = prompt_texts(pipe, spec.max_sequence_length, request.prompt, request.negative_prompt, choice.guided)
    prompts = look_up(pipe, texts, hooks.prompt_cache)
    run = _Run(loaded, request, choice, hooks, backend, observer, prompts, len(prompts.embeds), receipt, speed)
    requested, rungs, resume = strategy, run.rungs, None
    while True:
        record = run.attempt(strategy, resume)
        if record.raw is not None:
            break
        resume = record.last
        del record  # the failed attempt's tensors go before the cleanup
        strategy = run.escalate(strategy, resume.steps_done if resume else 0, restarts=resume is None)
    receipt["strategy"] = strategy.describe()
    if rungs:
        receipt["requested_strategy"] = requested.describe()
        receipt["oom_ladder"] = [r.as_dict() for r in rungs]
    samples = spec.to_comfy_latent(pipe, record.raw, request.frames).to("cpu")
    latent = {"samples": samples, "vidmem": {"family": spec.name, "class_name": loaded.class_name, "frames": request.frames,
                                             "vae_scaling_factor": pipe.vae.config.get("scaling_factor")}}
    if record.audio is not None:  # LTX-2's sound, for Decode Audio; a video-only graph just carries it
        latent = with_audio(latent, pipe, record.audio)
    return SampleResult(latent, receipt)


class Phase(str, Enum):
    """Where an attempt is, which decides what an out-of-memory error there leads to."""

    SETUP = "setup"  # nothing placed yet (LoRAs, chunks, windows, the host's room): raised as it is
    PLACING = "placing weights"  # apply_strategy (offload=none puts every weight on the device): the ladder climbs
    TEXT = "text encoding"  # the prompt encoder: a SamplingOutOfMemory naming text_encoder=cpu, no climb
    IMAGE = "encoding the start image"  # image-to-video, up to the first denoiser pass: offload rungs only
    DENOISING = "denoising"  # from the first denoiser pass: the ladder climbs and resumes

    @property
    def before_the_steps(self) -> str:
        """The sample_ladder.BEFORE_THE_STEPS key of a phase before any step ran, else ''."""
        return {Phase.PLACING: "placing", Phase.IMAGE: "image"}.get(self, "")


def block_count(loaded: LoadedPipeline) -> int:
    return min(len(blocks) for blocks in denoiser_blocks(loaded.pipe, loaded.spec).values())


@dataclass
class _Run:
    """What one sample() call carries across its attempts (one per rung of the OOM ladder)."""

    loaded: LoadedPipeline
    request: SampleRequest
    choice: SamplerChoice
    hooks: RunHooks
    backend: Backend
    observer: Observer | None
    prompts: PromptEmbeddings
    hits: int
    receipt: dict
    speed: ResolvedSpeed
    rungs: list[Rung] = field(default_factory=list)  # the OOM ladder climbed so far
    chunks_ran: int = 1  # the activation chunks of the last attempt (auto resolved): chunk rungs start above it
    phase: Phase = Phase.SETUP  # where the current (or the failed) attempt is
    # The step cache's count of blocks over the steps earlier (failed) attempts finished, and the current
    # attempt's count at its last finished step: a resumed attempt re-runs from there, so their sum is true.
    cache_before: CacheTally = field(default_factory=CacheTally)
    cache_finished: CacheTally = field(default_factory=CacheTally)

    def attempt(self, strategy: MemoryStrategy, resume: ResumePoint | None) -> StepRecord:
        """One attempt: `record.raw` holds the raw latents, or is None after an out-of-memory
        error while placing the weights or denoising under a strategy with a rung above it (any
        other error is raised; one while the prompt encoder runs as a SamplingOutOfMemory)."""
        pipe = self.loaded.pipe
        call = call_pipeline(pipe, build_scheduler(pipe.scheduler, self.choice), self.choice.boundary_ratio, resume)
        generator = torch.Generator("cpu")
        if resume is None:
            generator.manual_seed(self.request.seed)
        else:
            generator.set_state(resume.generator_state)
        record = StepRecord(call, generator, resume)
        try:
            record.raw = self._run(call, strategy, record, cached=resume is None)
        except BaseException as error:
            if self.phase is Phase.SETUP or not is_out_of_memory(error):
                raise
            if self.phase is Phase.TEXT:  # everything is already restored: the strategy's `with` has exited
                raise SamplingOutOfMemory(text_encoder_message(strategy, error)) from error
            step = (record.last.steps_done if record.last else 0) + 1
            when = when_out_of_memory(step, self.request.steps, self.phase.before_the_steps)
            if not self.hooks.climb_on_oom:
                raise SamplingOutOfMemory(no_climb_message(strategy, when, error)) from error
            if next_rung(strategy, block_count(self.loaded), None, self.chunkable, self.chunks_ran) is None:
                raise SamplingOutOfMemory(out_of_memory_message(strategy, when, self.rungs, error, self._ladder_hint(),
                                                                image=self.phase is Phase.IMAGE)) from error
            record.call = None
        return record

    @property
    def chunkable(self) -> bool:
        """Whether the ladder may offer activation-chunk rungs: blocks that chunk, a kernel that allows it,
        and an error from the denoiser's passes (chunks do nothing for the start image's encoding)."""
        return self.phase is not Phase.IMAGE and self.speed.takes_chunks and can_chunk(self.loaded)

    def _ladder_hint(self) -> str:
        if self.speed.takes_chunks or not can_chunk(self.loaded):
            return ""
        return "choose attention 'auto' on the Speed node (sageattention 1.x forbids activation chunks, a further rung); "

    def escalate(self, strategy: MemoryStrategy, steps_done: int, restarts: bool = False) -> MemoryStrategy:
        """After an out-of-memory error under `strategy`: free, pick the next rung, log it. An error
        before the attempt's first step (placing the weights, encoding the start image) is at step 0.
        `restarts`: no step finished, so the next attempt starts over, with the step cache (whose state
        the rung must then leave room for); one that resumes runs uncached."""
        request, device = self.request, self.backend.device
        freed = free_memory(device)
        shape = VideoShape(request.width, request.height, request.frames, cfg=self.choice.guided, window=request.window,
                           window_overlap=request.window_overlap)
        state = request.cache.planned_state(denoiser_blocks(self.loaded.pipe, self.loaded.spec)) if restarts else {}
        fits = planner_fits(self.loaded, shape, request.steps, self.hooks.device_budget(device),
                            self.speed.planned_attention, state)
        rung, how = next_rung(strategy, block_count(self.loaded), fits, self.chunkable, self.chunks_ran)
        before = self.phase.before_the_steps
        at_step = 0 if before else steps_done + 1
        self.rungs.append(Rung(strategy.describe(), at_step, steps_done, rung.describe(), how, freed.as_dict()))
        log.warning("vidmem: out of memory %s under %s; resuming after step %d under %s (%s)",
                    when_out_of_memory(at_step, request.steps, before), strategy.describe(), steps_done,
                    rung.describe(), how)
        return rung

    def _run(self, call, strategy: MemoryStrategy, record: StepRecord, cached: bool = True) -> torch.Tensor:
        """One attempt. `cached`: the request's step cache applies (a resumed attempt runs uncached:
        the cache's state would start from step 0 halfway through the run)."""
        loaded, hooks, prompts, receipt = self.loaded, self.hooks, self.prompts, self.receipt
        device = self.backend.device
        self.phase = Phase.SETUP
        earlier_passes = receipt.get("windows", {}).get("passes", 0)  # a failed attempt's, summed into this one's
        self.cache_before, self.cache_finished = self.cache_before.merged(self.cache_finished), CacheTally()
        for key in ATTEMPT_KEYS:  # a failed attempt's figures must not pass for this one's
            receipt.pop(key, None)
        stage = sample_stage(loaded, strategy, encode_text=not prompts.complete)
        # Per-block CUDA events are cheap for tens of blocks, not for every leaf of `sequential`.
        telemetry = strategy.offload is OffloadTier.BLOCK_SWAP
        warm = loaded.warm_store("sample", self.backend)  # weights the last call left on the device
        # Chunks and compiled blocks wrap the blocks' own forward, before the step cache wraps it.
        blocks = denoiser_blocks(loaded.pipe, loaded.spec)
        # a LoRA's hooks on the layers of compiled blocks are traced into their graphs (memory/lora.py)
        compiled_modules = [b for group in blocks.values() for b in group] if self.speed.speed.compile.on else ()
        cache_state = self.request.cache.planned_state(blocks) if cached else {}  # on the device beside the activations
        with interrupt_checks(interruptible_blocks(loaded), hooks.check_interrupt), encode_caches_dropped(loaded), \
                apply_loras(lora_patches(loaded.pipe, loaded.loras), traced_in=compiled_modules) as lora_handle, \
                chunks_for_call(loaded, strategy, self.request, self.choice.guided,  # before the step cache wraps blocks
                                chunk_budget(hooks.device_budget(device), warm), cache_state,
                                self.speed.takes_chunks, self.speed.planned_attention) as chunks, \
                speed_for_call(self.speed, denoisers(loaded.pipe, loaded.spec), blocks, device, chunks) as speed, \
                windows_for_call(loaded, self.request, record.last.steps_done if record.last else 0,
                                 earlier_passes) as windows:
            self.chunks_ran = chunks.chunks
            if windows:
                receipt["windows"] = windows
            if chunks.chunks > 1 or chunks.note:
                receipt["activation_chunks"] = chunks.as_dict()
            weight_bytes = device_weight_bytes(stage, strategy)  # inside the LoRA block: counts LoRA buffers
            receipt["device_weight_bytes"], receipt["lora_bytes"] = weight_bytes, lora_handle.nbytes
            request = self.request
            shape = VideoShape(request.width, request.height, request.frames, cfg=self.choice.guided,
                               window=request.window, window_overlap=request.window_overlap)
            planned = replace(strategy, activation_chunks=chunks.chunks)  # auto resolved: the room of the slices run
            room = sample_room(loaded, planned, shape, request.steps, not prompts.complete, weight_bytes, device,
                               self.speed.planned_attention, cache_state)
            receipt["room"] = room.as_dict()
            if warm is not None:  # copies this stage will not take must not sit on the device, counted as loaded
                warm.retain(stage_tensors(stage), take_over=strategy.offload is OffloadTier.NONE,  # keeps the VAE to the end
                            device=device)
            hooks.make_room(room.total_bytes, device, warm=warm, weight_bytes=weight_bytes)  # weights + activations
            loaded.host_pool.host_room_bytes = hooks.pinned_room()  # the host's pool changes between runs
            # Free memory the call does not need keeps streamed blocks on the device (not after an
            # out-of-memory error: the ladder's rungs then stream as planned).
            held = warm.held_bytes if warm else 0  # what this call can take back
            keep = keep_bytes(hooks.device_budget(device), room, held) \
                if strategy.streams_blocks and not self.rungs else 0
            self.phase = Phase.PLACING
            # The cache's hooks go on inside the `with`: a failure entering what comes before them leaves none on the model.
            with call_on(warm, self.backend), self._step_cache(cached, call) as cache, \
                    apply_strategy(stage, strategy, self.backend, self.observer, loaded.host_pool, telemetry, warm, keep,
                                   cache.gate) as handle:
                call.vidmem_execution_device = device
                if "text_encode" not in receipt:  # the first attempt to get here (a cache hit encodes nothing)
                    self.phase = Phase.TEXT
                    self._encode(call, strategy, handle)
                embeds = call_embeds(prompts, device)
                hand_off = expert_hand_off(call, handle, cache)

                def after_step(step: int) -> None:
                    hand_off(step)
                    self.cache_finished = CacheTally().merged(cache.tally)  # what a resumed attempt will not re-run

                with StageMeter("denoise", device) as meter, self._denoising_from_the_first_pass():
                    output = call(**_call_kwargs(loaded, self.request, self.choice, embeds, hooks, record, after_step))
                raw, record.audio = output.frames, getattr(output, "audio", None)
                receipt["stages"].append(meter.as_dict())
                if telemetry:
                    receipt["swap"] = swap_receipt(handle.swap_summary(), meter.seconds, loaded.host_pool)
                if strategy.streams_blocks:
                    receipt["residency"] = residency_receipt(handle.keep, climbed=bool(self.rungs))
                streamed = handle.stream_counts()
            if self.request.cache.on:
                receipt["cache"] = cache_receipt(self.request.cache, self.cache_before.merged(cache.tally), streamed, cached)
            receipt["speed"] = speed.as_dict()
            if chunks.chunks > 1:
                receipt["activation_chunks"] = chunks.as_dict()  # again, now with the slices the blocks ran
            if warm is not None:
                receipt["warm"] = warm.as_dict()
        return raw

    @contextmanager
    def _denoising_from_the_first_pass(self) -> Iterator[None]:
        """Image-to-video encodes its start image inside the pipeline call, before the first denoiser
        pass: the phase is IMAGE until a denoiser runs (a pre-hook on each), DENOISING from then on."""
        if not self.loaded.needs_image:
            self.phase = Phase.DENOISING
            yield
            return
        self.phase = Phase.IMAGE

        def first_pass(module, args):
            self.phase = Phase.DENOISING
        handles = [module.register_forward_pre_hook(first_pass)
                   for module in denoisers(self.loaded.pipe, self.loaded.spec).values()]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _step_cache(self, cached: bool, call) -> AppliedCache:
        """The request's step cache on the call's denoisers (inert when off; counting every block computed,
        caching none, when not `cached`)."""
        pipe, spec = self.loaded.pipe, self.loaded.spec
        blocks = denoiser_blocks(pipe, spec)
        cache = self.request.cache
        if cache.on and cached and cache.per_expert and len(blocks) > 1:
            cache.check_expert_steps(expert_steps(call, self.request.steps))
        applied = AppliedCache(cache, denoisers(pipe, spec), blocks, enabled=cached)
        split = expert_steps(call, self.request.steps) if cache.method is CacheMethod.TAYLOR and len(blocks) > 1 else None
        return applied.apply(self.request.steps, split) if cache.on else applied

    def _encode(self, call, strategy: MemoryStrategy, handle) -> None:
        device = self.backend.device
        with StageMeter("text_encode", device) as meter:
            on_cpu = strategy.text_encoder is TextEncoderPlacement.CPU
            encode_missing(call, self.prompts, torch.device("cpu") if on_cpu else device)
            if strategy.text_encoder is TextEncoderPlacement.OFFLOAD_AFTER_ENCODING:
                # Only the prompt encoder is done now; an image encoder runs inside the loop's setup.
                handle.evict("text_encoder")
                release_cached_segments(device)
        self.receipt["stages"].append(meter.as_dict())
        self.receipt["text_encode"] = prompt_receipt(self.prompts, self.hits)


def release_cached_segments(device: torch.device) -> None:
    """Return the allocator's unused cache to the driver between the prompt encode and the denoise.

    The planner replays each phase from an empty allocator: the denoise's plan assumes none of the
    encoder's freed segments are left. Kept, they would be split by the denoise's tensors and never
    released whole (nothing else empties the cache mid-run: the ladder only after an out-of-memory
    error), so the run would reserve more than its plan. Only on CUDA: a `--cpu` host never gets a
    CUDA context."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


# What each attempt writes afresh: after an out-of-memory climb, the final attempt's figures only.
ATTEMPT_KEYS = ("windows", "activation_chunks", "device_weight_bytes", "lora_bytes", "room", "swap", "residency",
                "cache", "speed", "warm")


def cache_receipt(cache: StepCache, tally: CacheTally, streamed: dict, cached: bool) -> dict:
    """What the step cache skipped: blocks computed over the whole call (`tally`: every attempt's, each
    up to its last finished step, the last attempt's in full), and streamed copies made and saved (the
    last attempt's)."""
    found = {"method": cache.describe(), **tally.as_dict(), "streamed_copies": streamed["copies"],
             "streamed_copies_skipped": streamed["skipped"]}
    if cache.ratio_source:
        found["ratios"] = cache.ratio_source
    if not cached:
        found["note"] = ("this attempt resumed after an out-of-memory error and ran uncached (every block computed); "
                         "the block counts include the steps the failed attempt finished, the streamed copies are "
                         "this attempt's")
    return found


def residency_receipt(keep, climbed: bool = False) -> dict:
    """What free memory let streamed blocks keep on the device, and why (`climbed`: the out-of-memory
    ladder climbed a rung in this call, so nothing was kept whatever the free memory)."""
    if climbed:
        why = "the out-of-memory ladder climbed a rung: every streamed block was evicted after use, as the rung plans"
    elif not keep.limit_bytes:
        why = "no free memory beyond the call's own need was known: every streamed block was evicted after use"
    elif keep.kept_groups:
        why = f"free memory kept {keep.kept_groups} streamed groups on the device (after their first use, or since the last call)"
    else:
        why = "the free memory beyond the call's own need was smaller than one streamed group"
    return {**keep.as_dict(), "why": why}


def swap_receipt(summary: dict, denoise_seconds: float, pool) -> dict:
    """Totals of what streaming cost; `swap_cost` is the share of denoise time spent waiting for copies."""
    totals = summary["totals"]
    cost = totals["wait_s"] / denoise_seconds if denoise_seconds > 0 else 0.0
    return {**totals, "swap_cost": cost, "groups": len(summary["blocks"]), "host_pool": pool.stats()}


def expert_hand_off(pipe, handle, cache: AppliedCache) -> Callable[[int], None]:
    """Wan 2.2 A14B: after the last high-noise step, hand the swap pool to the low-noise expert and let
    the high-noise expert's step cache state go."""
    boundary_ratio = pipe.config.get("boundary_ratio")
    if boundary_ratio is None or getattr(pipe, "transformer_2", None) is None:
        return lambda step: None
    boundary = boundary_ratio * pipe.scheduler.config.num_train_timesteps

    def after_step(step: int) -> None:
        timesteps = pipe.scheduler.timesteps
        if step + 1 < len(timesteps) and timesteps[step] >= boundary > timesteps[step + 1]:
            handle.hand_off("transformer", "transformer_2")
            cache.finished("transformer")

    return after_step


def _call_kwargs(loaded: LoadedPipeline, request: SampleRequest, choice: SamplerChoice, embeds: dict, hooks: RunHooks,
                 record: StepRecord, after_step: Callable[[int], None]) -> dict:
    def on_step_end(pipe, step: int, timestep, tensors: dict) -> dict:
        record.step_done(step, tensors["latents"])  # the point an out-of-memory error resumes from
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
        guidance_scale=choice.cfg,
        generator=record.generator,
        output_type="latent",
        callback_on_step_end=on_step_end,
    )
    if choice.cfg_2 is not None:
        kwargs["guidance_scale_2"] = choice.cfg_2
    if loaded.needs_image:
        kwargs["image"] = comfy_image_to_pil(request.image)
    if request.last_image is not None:
        kwargs["last_image"] = comfy_image_to_pil(request.last_image)
    return kwargs


def comfy_image_to_pil(image: torch.Tensor):
    """ComfyUI IMAGE [B, H, W, C] in 0..1 -> the first frame as a PIL image."""
    from PIL import Image

    if image.ndim != 4 or image.shape[-1] not in (3, 4):
        raise ModelError(f"image has shape {tuple(image.shape)}; expected a ComfyUI IMAGE [batch, height, width, 3].")
    pixels = (image[0, ..., :3].clamp(0, 1) * 255).round().to(torch.uint8).cpu().numpy()
    return Image.fromarray(pixels)
