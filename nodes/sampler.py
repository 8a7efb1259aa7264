"""Video Sampler (VidMem): text (or image) to a video LATENT, under a MemoryStrategy."""

from __future__ import annotations

import math
from dataclasses import replace
from functools import reduce

import torch

from ..memory.plan.parallel import ParallelError
from ..memory.plan.stages import VideoShape
from ..memory.plan.types import PlanOptions
from ..memory.telemetry import budgeted_free_bytes
from ..memory.units import GiB
from ..pipelines.loader import FAMILIES
from ..pipelines.family import ModelError, denoiser_blocks, denoisers
from ..pipelines.image_fit import RESIZE_CHOICES, fit_image
from ..pipelines.parallel import (DeviceRoom, balanced_placement, check_parallel_attention, close_pool, component_bytes,
                                  rank_strategy, resolve_ranks, sample_balanced, sample_parallel)
from ..pipelines.parallel.planning import (choose_balanced, choose_parallel, parallel_plan_line, plan_balanced,
                                          plan_explicit)
from ..pipelines.planning import choose_for, plan_strategy
from ..pipelines.prompt_cache import PromptCache
from ..pipelines.sample import RunHooks, SampleRequest, sample
from ..pipelines.sample_checks import masked_by, refuse_cache_in_parallel, refuse_windows_in_parallel, validate_request
from ..pipelines.sample_chunks import UNCHUNKED_KERNEL
from ..pipelines.schedulers import SCHEDULERS
from ..pipelines.loader import torch_dtype
from ..pipelines.speed import measured_speed, resolve_speed
from ..pipelines.step_cache import write_ratio_file
from . import host
from .cache import CACHE_TYPE, cache_input
from .checks import literal_problem, literal_problems, pipeline_input
from .decode import record_plan
from .loader import PIPELINE_TYPE
from .receipts import format_receipt, human_bytes
from .speed import SPEED_TYPE, speed_input
from .strategy import STRATEGY_TYPE, as_choice

MAX_SEED = 0xFFFFFFFFFFFFFFFF
MAX_FRAMES = 1025
SIZE_STEP = 16  # width and height: VAE 8x x patch 2 (Wan 2.1, CogVideoX); Wan 2.2 TI2V-5B's 16x VAE needs 32
NODE = "Video Sampler"
# Every family's frame rule is step*k+1; their common step is what holds before the model is known.
COMMON_FRAME_STEP = reduce(math.gcd, (spec.frame_step for spec in FAMILIES))


def size_problem(name: str, value) -> str | None:
    """width or height outside the widget's range, or off the SIZE_STEP grid every model shares."""
    problem = literal_problem(VidMemVideoSampler, name, value)
    if problem or value is None or value % SIZE_STEP == 0:
        return problem
    below = max(SIZE_STEP, value // SIZE_STEP * SIZE_STEP)
    return (f"{name}={value} must be a multiple of {SIZE_STEP} for every model vidmem runs (32 for Wan 2.2 TI2V-5B); "
            f"use {below} or {below + SIZE_STEP}.")


def frames_problem(frames) -> str | None:
    """Frames no model vidmem runs can take (the family's own rule is checked when the model is known)."""
    if frames is None:  # a linked input has no value when the prompt is queued
        return None
    if not isinstance(frames, int) or isinstance(frames, bool) or not 1 <= frames <= MAX_FRAMES:
        # VALIDATE_INPUTS names frames, so ComfyUI skips its own min/max for it: the range is ours.
        return f"frames={frames!r} must be a whole number of frames from 1 to {MAX_FRAMES}."
    if (frames - 1) % COMMON_FRAME_STEP == 0:
        return None
    below = max(1, (frames - 1) // COMMON_FRAME_STEP * COMMON_FRAME_STEP + 1)
    rules = ", ".join(f"{spec.name} {spec.frame_step}k+1" for spec in FAMILIES)
    return (f"frames={frames} is not valid for any model vidmem runs ({rules}); "
            f"use {below} or {below + COMMON_FRAME_STEP}.")


class VidMemVideoSampler:
    DESCRIPTION = (
        "Samples a video latent with the pipeline's own diffusers loop. The strategy is applied "
        "for this run only and removed afterwards, even on error or cancel. Its size is the one the "
        "Memory Strategy plans for."
    )
    CATEGORY = "vidmem"
    FUNCTION = "sample"
    RETURN_TYPES = ("LATENT",)
    RETURN_NAMES = ("latent",)
    OUTPUT_TOOLTIPS = ("Video latent [batch, channels, frames, h, w]; save it with core Save Latent to keep a run. "
                       "LTX-2's also carries the sound it made (audio_samples) for Decode Audio; Save Latent keeps "
                       "only the video.",)

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "pipeline": (PIPELINE_TYPE, {"tooltip": "From Load Video Pipeline."}),
                "strategy": (STRATEGY_TYPE, {"tooltip": "From Memory Strategy: where weights live during sampling."}),
                "prompt": ("STRING", {"multiline": True, "default": "", "tooltip": "What the video shows."}),
                "negative_prompt": ("STRING", {"multiline": True, "default": "", "tooltip":
                    "What to avoid; encoded and used only when cfg (or A14B's cfg_2) is above 1."}),
                "width": ("INT", {"default": 832, "min": 16, "max": 4096, "step": SIZE_STEP, "tooltip":
                    "Pixels; a multiple of 16 (32 for Wan 2.2 TI2V-5B and LTX-2). Wan 480p: 832x480, CogVideoX: 720x480. "
                    "The Memory Strategy plans for this size."}),
                "height": ("INT", {"default": 480, "min": 16, "max": 4096, "step": SIZE_STEP, "tooltip":
                    "Pixels; a multiple of 16 (32 for Wan 2.2 TI2V-5B and LTX-2)."}),
                "frames": ("INT", {"default": 49, "min": 1, "max": MAX_FRAMES, "step": 4, "tooltip":
                    "Wan and HunyuanVideo 1.5: 4k+1 (e.g. 81, 121); CogVideoX and LTX-2: 8k+1 (49, or 81 for CogVideoX 1.5). "
                    "The default, 49, is valid for every family."}),
                "steps": ("INT", {"default": 30, "min": 1, "max": 1000, "tooltip": "Denoising steps."}),
                "cfg": ("FLOAT", {"default": 6.0, "min": 0.0, "max": 30.0, "step": 0.1, "tooltip":
                    "Classifier-free guidance; above 1 runs the negative prompt too (twice the compute). 1 runs no "
                    "negative pass (distill LoRAs such as lightx2v: cfg 1). Wan 5.0, CogVideoX 6.0 by default."}),
                "seed": ("INT", {"default": 0, "min": 0, "max": MAX_SEED, "tooltip":
                    "Noise seed; noise is made on the CPU, so a seed gives the same video on any GPU."}),
            },
            "optional": {
                "image": ("IMAGE", {"tooltip": "First frame, for image-to-video models and Wan 2.2 TI2V-5B (which runs "
                          "text-to-video without it); leave empty for text-to-video models."}),
                "scheduler": (list(SCHEDULERS), {"default": "default", "tooltip":
                    "default: what the model ships (Wan: flow UniPC; CogVideoX: its DDIM or DPM). unipc: UniPC; "
                    "dpmpp_2m: DPM-Solver++ 2M; flow_match_euler: flow-match Euler (Wan only). CogVideoX 2b and 1.5 "
                    "(trained with snr_shift_scale 3) take only default. Set for this run only."}),
                "shift": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 100.0, "step": 0.1, "tooltip":
                    "Flow shift. 0: the model's own. Wan: 3.0 at 480p, 5.0 at 720p. HunyuanVideo 1.5: 5.0 at 480p, "
                    "9.0 at 720p (7.0 for I2V). LTX-2: 0 only (its scheduler picks the shift from the resolution). CogVideoX: 0 "
                    "only (no shift). A larger shift spends more steps at high noise (composition), a smaller one "
                    "on detail."}),
                "cfg_2": ("FLOAT", {"default": -1.0, "min": -1.0, "max": 30.0, "step": 0.1, "tooltip":
                    "Wan 2.2 A14B only: cfg of the low-noise expert (cfg is the high-noise one's). -1: same as cfg. "
                    "1 runs no negative pass for that expert (e.g. a Lightning LoRA on the low-noise expert)."}),
                "boundary_ratio": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 0.999, "step": 0.005, "tooltip":
                    "Wan 2.2 A14B only: the share of the noise schedule the high-noise expert runs (steps with "
                    "timestep >= ratio x 1000). 0: the model's own (T2V 0.875, I2V 0.9)."}),
                "cache": (CACHE_TYPE, {"tooltip": "From a Step Cache (VidMem) node: skips blocks on steps whose "
                          "output can be predicted (and, under block swap, their copies). Empty: every step runs."}),
                "speed": (SPEED_TYPE, {"tooltip": "From a Speed (VidMem) node: the attention kernel, compiled blocks "
                          "and fp8 matmul. Empty: plain SDPA, eager blocks, fp8 weights upcast."}),
                # Last: saved workflows keep their widgets' positions.
                "resize": (list(RESIZE_CHOICES), {"default": "crop", "tooltip":
                    "How the image meets the video's width x height. crop: scaled to cover the frame, the overflow "
                    "cut evenly from both sides (nothing distorted; edges past the frame's aspect ratio are lost). "
                    "pad: scaled to fit inside, the rest black bars (nothing lost; the bars are part of the video). "
                    "stretch: each side scaled on its own (nothing lost; proportions change). A batch of images "
                    "uses its first."}),
                # Step 1: the frontend rounds to the step from min, so with min 0 a step of 4 would
                # turn 81 into 80; the Sampler checks the model's grid instead.
                "window": ("INT", {"default": 0, "min": 0, "max": MAX_FRAMES, "step": 1, "tooltip":
                    "Context windows, in video frames: denoise this many frames at a time, in overlapping windows "
                    "blended into one clip, so the peak VRAM follows the window, not the whole clip. On the "
                    "model's frame grid (Wan 4k+1, e.g. 81; CogVideoX 8k+1, e.g. 49). 0: off, the whole clip at "
                    "once; a window not shorter than frames changes nothing. With a Step Cache, each window "
                    "keeps its own cache state."}),
                "window_overlap": ("INT", {"default": 0, "min": 0, "max": MAX_FRAMES, "step": 4, "tooltip":
                    "Video frames two neighbouring windows share, cross-faded linearly; a multiple of 4, smaller "
                    "than window (e.g. 16 for a window of 81). More overlap: smoother hand-overs, more passes."}),
                "last_image": ("IMAGE", {"tooltip": "Last frame, for first-last-frame: the video starts on image and "
                               "ends on this one, fitted the same way (resize). Wan 2.1 FLF2V 14B needs it; Wan 2.2 I2V "
                               "A14B takes it; other models refuse it by name. Leave empty for image-to-video."}),
            },
        }

    @classmethod
    def VALIDATE_INPUTS(cls, frames=None, width=None, height=None, cfg=None, shift=None, cfg_2=None,
                        boundary_ratio=None):
        """What the widgets alone can tell, when the prompt is queued: frames and the size against the
        rules every model shares (Wan frames=50, width=840), and the floats finite (NaN passes
        ComfyUI's min/max). Named inputs lose ComfyUI's own range check, so literal_problem repeats
        it. The model's own rules (TI2V-5B's 32 px, CogVideoX's 8k+1, its blocks) need the pipeline:
        the loader checks them from the model's config before loading (nodes/preflight.py) and
        sample() first thing."""
        return (frames_problem(frames) or size_problem("width", width) or size_problem("height", height)
                or literal_problems(cls, cfg=cfg, shift=shift, cfg_2=cfg_2, boundary_ratio=boundary_ratio) or True)

    def sample(self, pipeline, strategy, prompt, negative_prompt, width, height, frames, steps, cfg, seed, image=None,
               scheduler="default", shift=0.0, cfg_2=-1.0, boundary_ratio=0.0, cache=None, speed=None, resize="crop",
               window=0, window_overlap=0, last_image=None):
        pipeline = pipeline_input(pipeline, NODE)
        choice = as_choice(strategy, NODE)
        step_cache = cache_input(cache, pipeline, NODE)
        fitted = fit_image(image, width, height, resize) if image is not None else None  # the video's first frame
        last = fit_image(last_image, width, height, resize, "last_image") if last_image is not None else None
        # The widgets' "model's own" values (0, -1) are the engine's None.
        request = SampleRequest(prompt, negative_prompt, width, height, frames, steps, cfg, seed,
                                fitted.image if fitted else None, scheduler,
                                shift or None, None if cfg_2 == -1.0 else cfg_2, boundary_ratio or None, step_cache,
                                speed_input(speed, NODE), last.image if last else None, window=window,
                                window_overlap=window_overlap)
        device = host.compute_device()
        resolved = check_before_planning(pipeline, choice, request, device)
        if choice.strategy.chunks_auto and not resolved.takes_chunks:  # planned and run unchunked, said in the receipt
            choice = replace(choice, strategy=replace(choice.strategy, activation_chunks=1),
                             notes=(*choice.notes, UNCHUNKED_KERNEL))
        guided = cfg > 1 or cfg_2 > 1  # a negative pass runs for an expert whose scale is above 1
        shape = VideoShape(width, height, frames, cfg=guided, window=window, window_overlap=window_overlap)
        lora_hooks = any(spec.strength != 0 for spec in getattr(pipeline, "loras", ()))  # strength 0 adds no hook
        options = PlanOptions(attention=resolved.planned_attention,  # an auto fallen back to math: its score matrix
                              steps=steps,  # offload=auto weighs each tier's copies against this many steps
                              speed=measured_speed(request.speed, device, lora_hooks,
                                                   choice.strategy.parallel.context_parallel_on),
                              cache_state=step_cache.planned_state(denoisers(pipeline.pipe, pipeline.spec)))
        planned = pipeline.image_mode() if request.image is not None else pipeline  # the class the run uses
        run, plan_line = _strategy_for_run(planned, choice, shape, device, options)
        progress = host.Progress(steps, "sampling")
        try:
            cache = PromptCache(host.prompt_cache_folder())
            # What the run may still take on the device (the ladder's rung, auto chunks and the streamed
            # blocks kept beyond the plan all read it): free memory, within the user's vram_budget_gb
            # when one is set, as the plan was; None off CUDA.
            budget = budgeted_free_bytes(int(choice.vram_budget_gb * GiB))
            hooks = RunHooks(progress.step, host.check_interrupt, host.make_room, device_budget=budget,
                             prompt_cache=cache, pinned_room=host.pinned_room_bytes)
            result = _sample(pipeline, replace(run, parallel=choice.strategy.parallel), request, hooks, device)
        finally:
            progress.close()
        receipt = dict(result.receipt, plan=plan_line)
        ratios = receipt.get("cache", {}).get("mag_ratios")
        if ratios:  # a calibration run: save the ratios where the Step Cache node lists them
            path = write_ratio_file(host.mag_ratios_folder(), pipeline, steps, ratios, receipt.get("sampler", ""))
            receipt["cache"] = dict(receipt["cache"], ratios_file=path.name)
        notes = [*choice.notes, *(fitted.notes if fitted else ()), *(last.notes if last else ())]
        if notes:
            receipt["note"] = "; ".join(notes)
        if "parallel" in receipt:
            receipt["device"] = parallel_line(receipt["parallel"])
        if "placement" in receipt:
            receipt["device"] = receipt["placement"]
        text = format_receipt(f"Video Sampler: {pipeline.describe()}", receipt)
        # The Decode plans offload=auto at this shape too (the latent's size shows neither cfg nor the window).
        return {"ui": {"text": [text], "vidmem_receipt": [receipt]}, "result": (record_plan(result.latent, shape, options),)}


def check_before_planning(pipeline, choice, request, device):
    """Everything the loaded pipeline can tell about this request before any planning, encoding or
    moving: the request's rules for this model (validate_request: size, frames, image, controls),
    the Speed node's choices on this device and model (also before a context-parallel run starts its
    ranks), and blocks_to_swap against the model's blocks. Returns the Speed node's choices resolved."""
    validate_request(pipeline, request)
    if choice.strategy.parallel.balanced:
        _balanced_gpus(choice.strategy, device)  # visible, before a plan reads their memory
    if choice.strategy.parallel.context_parallel_on:
        refuse_windows_in_parallel(request)
        refuse_cache_in_parallel(request.cache)
        rank_strategy(choice.strategy)  # an activation chunk count is refused (auto runs the ranks unchunked)
    resolved = resolve_speed(request.speed, device, torch_dtype(pipeline.dtype_name),
                             denoisers(pipeline.pipe, pipeline.spec),
                             context_parallel=choice.strategy.parallel.context_parallel_on,
                             masked_by=masked_by(pipeline))  # refused here as the plan refuses it
    if choice.strategy.parallel.context_parallel_on:
        check_parallel_attention(resolved, denoisers(pipeline.pipe, pipeline.spec),
                                 choice.strategy.parallel.context_parallel.value)
    if not choice.auto:
        for name, blocks in denoiser_blocks(pipeline.pipe, pipeline.spec).items():
            choice.strategy.check_against_model(len(blocks), name)
    return resolved


def _sample(pipeline, strategy, request, hooks, device):
    """One process, or with context parallelism the pool of ranks (this process keeps progress,
    Cancel and the receipt; the ranks apply the offload tier to their own copies)."""
    parallel = strategy.parallel
    if not parallel.context_parallel_on:
        # Ranks left from an earlier context-parallel run each hold a whole copy of the pipeline, which
        # this run's plan does not count: stop them (a later context-parallel run starts new ones).
        close_pool(pipeline)
    if parallel.balanced:
        return sample_balanced(pipeline, strategy, request, _placement(pipeline, strategy, device), hooks)
    if not parallel.context_parallel_on:
        return sample(pipeline, strategy, request, hooks, device=device)
    return sample_parallel(pipeline, strategy, request, resolve_ranks(parallel, _visible_gpus(device)), hooks)


def _placement(pipeline, strategy, device):
    """Balanced placement over the listed GPUs, checked against each GPU's memory, not what is free
    now: the run asks the host for room on both GPUs (inside ComfyUI it unloads its own models), and
    after a first run the warm store holds the transformers on the first GPU, which a check of free
    memory would count against the second run."""
    rooms = [DeviceRoom(f"cuda:{g}", torch.cuda.get_device_properties(g).total_memory)
             for g in _balanced_gpus(strategy, device)]
    return balanced_placement(component_bytes(pipeline.pipe), rooms, strategy.offload.value)


def _balanced_gpus(strategy, device) -> tuple[int, ...]:
    """The GPUs balanced placement lists, each visible to this process (ModelError naming gpus otherwise)."""
    gpus = strategy.parallel.gpus
    visible = _visible_gpus(device)
    missing = [g for g in gpus if g >= visible]
    if missing:
        raise ModelError(f"gpus={','.join(map(str, gpus))}: GPU {','.join(map(str, missing))} is not visible (this "
                         f"machine shows {visible}); set gpus to auto, or list GPUs 0..{visible - 1}.")
    return gpus


def parallel_line(parallel: dict) -> str:
    """"2 ranks (gloo), ulysses degree 2; per-rank peak: ..." for the receipt's device line."""
    def peak(p: dict) -> str:
        if "peak_allocated_bytes" in p:
            return f"VRAM {human_bytes(p['peak_allocated_bytes'])}"
        return f"RSS {human_bytes(p['peak_rss_bytes'])}"

    peaks = ", ".join(f"rank {i} {peak(p)}" for i, p in enumerate(parallel["per_rank_peak_bytes"]))
    return f"{parallel['ranks']} ranks ({parallel['backend']}), {parallel['mode']} degree {parallel['degree']}; peak: {peaks}"


def _strategy_for_run(pipeline, choice, shape: VideoShape, device, options: PlanOptions = PlanOptions()):
    """The strategy to run at the Sampler's own shape and one line saying what the planner predicts.

    offload=auto chooses here (no fit, no run: PlanError says what would fit). An explicit
    strategy is planned as advice only: a prediction that cannot be made never stops the run.
    """
    label = f"{shape.width}x{shape.height}x{shape.frames}"
    if choice.strategy.parallel.balanced:
        return _balanced_strategy_for_run(pipeline, choice, shape, label, options)
    vram, ram = choice.budgets(device)
    if choice.strategy.parallel.context_parallel_on:
        return _parallel_strategy_for_run(pipeline, choice, shape, device, (vram, ram), label, options)
    if choice.auto:
        plan = choose_for(pipeline, shape, choice.strategy, vram, ram, options, device=device)
        return plan.strategy, f"auto chose at {label}: {_peaks(plan)}"
    try:
        plan = plan_strategy(pipeline, shape, choice.strategy, vram, ram, options, device=device)
    except ValueError as error:
        return choice.strategy, f"no prediction at {label}: {error}"
    return _with_planned_chunks(choice.strategy, plan.strategy), f"planned at {label}: {_peaks(plan)}"


def _with_planned_chunks(strategy, planned):
    """`strategy` (set by hand) with activation_chunks auto resolved as its plan resolved it, within the
    budgets: left to the engine, auto would choose again from the memory free at the call (a warm run's
    kept weights missing from it, the user's budget unread)."""
    return replace(strategy, activation_chunks=planned.activation_chunks) if strategy.chunks_auto else strategy


def _parallel_strategy_for_run(pipeline, choice, shape: VideoShape, device, budgets, label: str,
                               options: PlanOptions = PlanOptions()):
    """As above, with the per-GPU planner: every rank and this process hold a copy of the pipeline."""
    ranks = resolve_ranks(choice.strategy.parallel, _visible_gpus(device))
    if choice.auto:
        plan = choose_parallel(pipeline, shape, choice.strategy, ranks, *budgets, options)
        return plan.strategy, f"auto chose at {label}: {parallel_plan_line(plan)}"
    try:
        plan = plan_explicit(pipeline, shape, choice.strategy, ranks, *budgets, options)
    except ParallelError:
        raise  # a refusal the ranks would meet too (the model, the sizes, the storage), not a missing prediction
    except ValueError as error:
        return choice.strategy, f"no prediction at {label}: {error}"
    return choice.strategy, f"planned at {label}: {parallel_plan_line(plan)}"


def _balanced_strategy_for_run(pipeline, choice, shape: VideoShape, label: str, options: PlanOptions = PlanOptions()):
    """As above, with the per-GPU planner's balanced rows (the chart's): the transformers' GPU, the
    first listed, gives the VRAM budget; the prompt encoder runs whole on the second."""
    gpus = choice.strategy.parallel.gpus
    budgets = choice.budgets(torch.device("cuda", gpus[0]))
    if choice.auto:
        plan = choose_balanced(pipeline, shape, choice.strategy, len(gpus), *budgets, options)
        return plan.strategy, f"auto chose at {label}: {parallel_plan_line(plan)}"
    try:
        plan = plan_balanced(pipeline, shape, choice.strategy, len(gpus), *budgets, options)
    except ValueError as error:
        return choice.strategy, f"no prediction at {label}: {error}"
    return _with_planned_chunks(choice.strategy, plan.strategy), f"planned at {label}: {parallel_plan_line(plan)}"


def _visible_gpus(device) -> int:
    return torch.cuda.device_count() if device.type == "cuda" else 0


def _peaks(plan) -> str:
    fits = "" if plan.fits is None else ("; fits" if plan.fits else "; over budget: " + "; ".join(plan.over_budget()))
    vram, ram = plan.peak_vram_bytes / GiB, plan.peak_ram_bytes / GiB
    # on a CPU the compute's memory is part of the RAM figure: two peaks side by side would read as a sum
    peaks = (f"the CPU computes: peak RAM {ram:.2f} GiB (its compute {vram:.2f})" if plan.options.on_cpu
             else f"peak VRAM {vram:.2f} GiB, RAM {ram:.2f} GiB")
    return f"{plan.strategy.describe()}; {peaks}, time x{plan.est_slowdown:.2f} of all resident (estimated){fits}"
