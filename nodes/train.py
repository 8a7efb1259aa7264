"""Prepare Training Data (VidMem) and Train LoRA (VidMem): LoRA training on the pack's memory engine.

Thin nodes over vidmem.training: the data is encoded once and cached; the LoRA trains under the
Memory Strategy and is written to models/loras, then returned already applied to the pipeline so
a Video Sampler right after it samples with it.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from ..pipelines.lora import load_lora, with_lora
from ..training import (
    DEFAULT_TARGETS, BucketSettings, OptimizerName, TrainOutputs, TrainSettings, parse_frames, parse_resolutions,
    prepare_training_data, train_lora,
)
from ..training.data import IMAGE_SUFFIXES, VIDEO_SUFFIXES
from ..training.errors import TrainingError
from ..training.objective import EXPERT_COMPONENTS
from ..training.settings import parse_targets
from ..memory.activation_offload import OffloadMode, offload_mode
from ..memory.plan.costs import CUDA_CONTEXT_BYTES
from ..pipelines.room import FALLBACK_MARGIN_BYTES
from ..training.plan import choose_training_strategy, resolve_activation_offload
from ..training.save import lora_file_name
from . import host
from .checks import literal_problems, pipeline_input
from .loader import PIPELINE_TYPE
from .model_folders import ALLOW_ANY_PATH_ENV, any_path_allowed, inside_any
from .receipts import format_receipt, human_bytes
from .strategy import STRATEGY_TYPE, as_choice, one_process_only

TRAINING_DATA_TYPE = "VIDMEM_TRAINING_DATA"
MAX_SEED = 0xFFFFFFFFFFFFFFFF
LOSS_LOG_EVERY = 10
log = logging.getLogger("vidmem")


def _run_strategy(strategy):
    """The strategy to encode with; offload=auto encodes on its base (model offload: one encoder at a time)."""
    choice = one_process_only(as_choice(strategy, "Prepare Training Data"), "Prepare Training Data")
    note = " (offload=auto: encoding runs one component at a time, model offload)" if choice.auto else ""
    return choice.strategy, note


def _train_strategy(strategy, pipeline, data, settings: TrainSettings, device):
    """(strategy, settings, plan choice): offload=auto takes the training planner's tier, and
    activation_offload=auto the plan's on or off (for the tier chosen, by the planner or by hand)."""
    choice = one_process_only(as_choice(strategy, "Train LoRA"), "Train LoRA")
    planning = choice.auto or settings.activation_offload is OffloadMode.AUTO
    if not planning:
        return choice.strategy, settings, None
    vram, ram = choice.budgets(device)
    can_pin = pipeline.backend(device).can_pin
    plan = choose_training_strategy if choice.auto else resolve_activation_offload
    chosen = plan(pipeline, data, settings, choice.strategy, vram, ram, can_pin)
    return chosen.strategy, chosen.settings(settings), chosen


class VidMemPrepareTrainingData:
    DESCRIPTION = (
        "Encodes a folder of captioned videos and images (clip.mp4 + clip.txt) into latents and prompt "
        "embeddings for Train LoRA, cached on disk: a re-run with the same files reuses the cache. The text "
        "encoder and VAE run under the Memory Strategy and are unloaded afterwards."
    )
    CATEGORY = "vidmem/training"
    FUNCTION = "prepare"
    RETURN_TYPES = (TRAINING_DATA_TYPE,)
    RETURN_NAMES = ("data",)
    OUTPUT_TOOLTIPS = ("Prepared samples (cached latents + prompt embeddings) for Train LoRA (VidMem).",)

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "pipeline": (PIPELINE_TYPE, {"tooltip": "The text-to-video pipeline the LoRA is trained for (its "
                             "text encoder and VAE encode the data; train with the same pipeline)."}),
                "strategy": (STRATEGY_TYPE, {"tooltip": "Where the text encoder and VAE live while encoding; VAE "
                             "tiling here tiles the encode (tile_size, overlap)."}),
                "folder": ("STRING", {"default": "", "tooltip": "Full path of a folder of videos (.mp4 .mov .webm "
                           ".mkv .avi .gif) and images (.png .jpg .webp), each with a caption .txt of the same name, "
                           "inside ComfyUI's input folder (e.g. ComfyUI/input/my_clips; others only where the server "
                           f"was started with {ALLOW_ANY_PATH_ENV}=1). Files added or changed there make the next "
                           "queue prepare again."}),
                "resolutions": ("STRING", {"default": "832x480, 480x832", "tooltip": "Resolution buckets as "
                                "WIDTHxHEIGHT, comma separated; each clip goes to the one nearest its aspect ratio, "
                                "scaled to cover and centre-cropped. Multiples of 16 (32 for Wan 2.2 TI2V-5B)."}),
                "frame_buckets": ("STRING", {"default": "33", "tooltip": "Frame counts, comma separated; each video "
                                  "uses its first N frames for the largest N it has. Wan: 4k+1, CogVideoX: 8k+1. "
                                  "Images always use 1 frame."}),
            },
        }

    @classmethod
    def VALIDATE_INPUTS(cls, folder=None, resolutions=None, frame_buckets=None):
        """The STRING inputs are named (ComfyUI checks nothing of a STRING): a folder outside ComfyUI's
        input folder is refused when queued, before anything reads it, and a bucket list that does not
        parse before the loader spends minutes on the model. The model's own rules for the buckets
        (multiples of 16 or 32, 4k+1 frames) are checked when the node runs, with the pipeline known."""
        return folder_problem(folder) or buckets_problem(resolutions, frame_buckets) or True

    @classmethod
    def IS_CHANGED(cls, folder=None, **_other_inputs):
        """The folder's media and captions by name, size and modification time (stat only, nothing
        read): clips or captions added, removed or edited make ComfyUI run the node again, which
        encodes only what its cache lacks. A constant for a linked, missing, empty or refused folder."""
        if not isinstance(folder, str) or not folder.strip() or folder_problem(folder):
            return ""
        root = Path(folder.strip()).expanduser()
        listing = sorted((str(path.relative_to(root)), stat.st_size, stat.st_mtime_ns)
                         for path, stat in _data_files(root))
        return hashlib.sha256(repr(listing).encode()).hexdigest() if listing else ""

    def prepare(self, pipeline, strategy, folder, resolutions, frame_buckets):
        problem = folder_problem(folder)  # also when linked: VALIDATE_INPUTS saw no value then
        if problem:
            raise TrainingError(problem)
        pipeline = pipeline_input(pipeline, "Prepare Training Data")
        run, note = _run_strategy(strategy)
        buckets = BucketSettings(parse_resolutions(resolutions), parse_frames(frame_buckets))
        device = host.compute_device()
        progress = host.Progress(1, "encoding clips")
        try:
            data = prepare_training_data(pipeline, folder, buckets, run, host.training_folder() / "data_cache",
                                         pipeline.backend(device), progress.step, host.check_interrupt,
                                         lambda weight_bytes: host.make_room(weight_bytes + FALLBACK_MARGIN_BYTES, device))
        finally:
            progress.close()
        receipt = dict(data.receipt, strategy=run.describe() + note)
        text = "\n".join([format_receipt(f"Prepare Training Data: {len(data.samples)} samples for {pipeline.describe()}",
                                          receipt), *prepare_lines(receipt)])
        return {"ui": {"text": [text], "vidmem_receipt": [receipt]}, "result": (data,)}


def folder_problem(folder) -> str | None:
    """Why Prepare Training Data may not read the typed `folder`, or None. Inside ComfyUI only its
    input folder, as Load Video Pipeline's path only its model folders (nodes/model_folders.py,
    the same switch): the captions are copied into output/vidmem_training, which ComfyUI's /view
    serves to whoever reaches the server. A link placed inside the input folder is followed; '..' is
    refused outright. Without ComfyUI the user is the operator: anything goes."""
    if not isinstance(folder, str) or not folder.strip() or not host.in_comfyui():
        return None  # linked (checked when it arrives), empty (the node says so when it runs), no host
    root = host.latents_folder()  # ComfyUI's input folder
    if any_path_allowed() or inside_any(folder, [root]):
        return None
    return (f"folder '{folder.strip()}' is outside ComfyUI's input folder ({root}); folder may name only a folder "
            f"inside it, without '..'. Put the clips and captions in a folder there (e.g. {Path(root) / 'my_clips'}) "
            f"and give its full path. To accept any folder, whoever runs the server starts ComfyUI with the "
            f"environment variable {ALLOW_ANY_PATH_ENV}=1 (only where everyone who can reach the server may read "
            "its files).")


def buckets_problem(resolutions, frame_buckets) -> str | None:
    """Why the typed bucket lists cannot be read (a typo, nothing listed), or None; a linked one is read
    when it arrives."""
    lists = ((resolutions, parse_resolutions, "resolutions is empty; give at least one, e.g. '832x480'."),
             (frame_buckets, parse_frames, "frame_buckets is empty; give at least one frame count, e.g. '33'."))
    for text, parse, empty in lists:
        problem = text_problem(parse, text)
        if problem or (isinstance(text, str) and not parse(text)):
            return problem or empty
    return None


def text_problem(parse, text) -> str | None:
    """`parse(text)`'s TrainingError (which names the input and the fix) as a refusal, or None; None for a
    linked input (no text when queued)."""
    if not isinstance(text, str):
        return None
    try:
        parse(text)
    except TrainingError as error:
        return str(error)
    return None


def _data_files(root: Path):
    """(path, stat) of every media file and caption under `root` that training/data.py's scan_folder
    reads (dot files and folders skipped), without reading any."""
    if not root.is_dir():
        return
    for path in root.rglob("*"):
        if path.suffix.lower() in (*VIDEO_SUFFIXES, *IMAGE_SUFFIXES, ".txt") and path.is_file() \
                and not any(part.startswith(".") for part in path.relative_to(root).parts):
            yield path, path.stat()


class VidMemTrainLoRA:
    DESCRIPTION = (
        "Trains a LoRA on prepared data under the Memory Strategy (block swap and sequential offload work "
        "with gradient checkpointing), writes it to models/loras and returns the pipeline with it applied. "
        "Cancel saves a checkpoint; queue again with resume on to continue."
    )
    CATEGORY = "vidmem/training"
    FUNCTION = "train"
    RETURN_TYPES = (PIPELINE_TYPE, "STRING")
    RETURN_NAMES = ("pipeline", "lora_name")
    OUTPUT_TOOLTIPS = ("The input pipeline with the trained LoRA at strength 1 (the input is unchanged).",
                       "The LoRA's file name under models/loras, for Load LoRA in later runs.")

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "pipeline": (PIPELINE_TYPE, {"tooltip": "The pipeline the data was prepared with. LoRAs on it "
                             "apply during training; the new LoRA learns on top of them."}),
                "data": (TRAINING_DATA_TYPE, {"tooltip": "From Prepare Training Data (VidMem)."}),
                "strategy": (STRATEGY_TYPE, {"tooltip": "Where the transformer lives while training. block_swap and "
                             "sequential need gradient_checkpointing on. offload=auto: the training planner picks the "
                             "fastest tier whose predicted step fits the node's VRAM and RAM budgets."}),
                "lora_name": ("STRING", {"default": "my_lora", "tooltip": "File name under models/loras "
                              "(.safetensors added). A LoRA not made by this trainer is never overwritten."}),
                "rank": ("INT", {"default": 16, "min": 1, "max": 512, "tooltip": "LoRA rank: trainable size and "
                         "capacity. 16-64 is usual; at most the smallest targeted layer's width."}),
                "alpha": ("FLOAT", {"default": 16.0, "min": 0.01, "max": 1024.0, "step": 0.5, "tooltip":
                          "The LoRA's scale is alpha / rank; alpha = rank gives 1. Folded into the saved file's "
                          "lora_B, so every loader (Load LoRA, ComfyUI's, diffusers') applies the same scale."}),
                "learning_rate": ("FLOAT", {"default": 1e-4, "min": 1e-7, "max": 1e-1, "step": 1e-5, "round": False,
                                  "tooltip": "AdamW learning rate; 1e-4 is the usual start for video LoRAs."}),
                "steps": ("INT", {"default": 500, "min": 1, "max": 1000000, "tooltip": "Optimizer steps in total "
                          "(a resumed run counts the steps already done)."}),
                "batch_size": ("INT", {"default": 1, "min": 1, "max": 64, "tooltip": "Samples per step, all from "
                               "one bucket; memory for activations grows with it."}),
                "seed": ("INT", {"default": 0, "min": 0, "max": MAX_SEED, "tooltip": "Seeds the LoRA's start, "
                         "the sample order and every step's noise: a seed gives the same LoRA on any device."}),
                "target_modules": ("STRING", {"default": ",".join(DEFAULT_TARGETS), "tooltip": "Linear layers "
                                   "inside the transformer blocks that get a LoRA, by name or dotted suffix, comma "
                                   "separated (attention: to_q,to_k,to_v,to_out.0; Wan feed-forward: ffn.net.0.proj,ffn.net.2)."}),
                "gradient_checkpointing": ("BOOLEAN", {"default": True, "tooltip": "Re-run each block's forward "
                                           "during the backward instead of keeping its activations: ~0.37 of the "
                                           "activation peak at 4 blocks (less with more), ~1.35-1.5x the step's work "
                                           "(the base is frozen, so a re-run is a large share of a step), the same LoRA."}),
                "optimizer": ([o.value for o in OptimizerName], {"default": OptimizerName.ADAMW.value, "tooltip":
                              "adamw: fp32 states (8 bytes per LoRA weight). adamw_8bit: ~2 bytes (needs "
                              "bitsandbytes). adamw_cpu_offload: states in RAM, not VRAM (slower steps)."}),
                "checkpoint_every": ("INT", {"default": 100, "min": 0, "max": 1000000, "tooltip": "Save a "
                                     "resumable checkpoint every N steps (0: only on Cancel and at the end)."}),
                "resume": ("BOOLEAN", {"default": True, "tooltip": "Continue from this lora_name's checkpoint when "
                           "it was made with the same data and settings (steps may be raised)."}),
                "expert": (list(EXPERT_COMPONENTS), {"default": "both", "tooltip": "Wan 2.2 A14B trains one "
                           "expert per run: high_noise or low_noise (load the LoRA on that expert). Others: both."}),
            },
            # optional: prompts saved before this input existed still validate. Once a BOOLEAN: VALIDATE_INPUTS
            # names it, so ComfyUI skips its own list check and a saved true/false still queues (as on/off).
            "optional": {
                "activation_offload": ([m.value for m in OffloadMode], {"default": OffloadMode.OFF.value, "tooltip":
                                       "on: keep each checkpointed block's input in pinned RAM instead of VRAM, "
                                       "copied back one block ahead of the backward on the copy stream: VRAM holds "
                                       "about one block's activations, RAM grows by every block's input, each input "
                                       "crosses PCIe twice per step; the same LoRA. Inputs past the pinned ceiling "
                                       "(max_pinned_ram_gb) stay in VRAM. auto: on only when the training plan says "
                                       "the step does not fit the budgets without it and fits with it (the receipt "
                                       "says which and why). Needs gradient_checkpointing (auto stays off without)."}),
            },
            "hidden": {"unique_id": "UNIQUE_ID"},
        }

    @classmethod
    def VALIDATE_INPUTS(cls, alpha=None, learning_rate=None, activation_offload=None, lora_name=None,
                        target_modules=None):
        """The float widgets are named so NaN is refused when queued (it passes ComfyUI's min/max);
        activation_offload so a workflow saved when it was a BOOLEAN still queues (true/false: on/off);
        the STRINGs lora_name and target_modules so a name with a folder or an empty target list is
        refused before the loader spends minutes on the model. Rules between inputs (activation_offload
        on needs gradient_checkpointing) and the Strategy's gpus are checked by the loader before it loads
        (nodes/preflight.py)."""
        return (literal_problems(cls, alpha=alpha, learning_rate=learning_rate)
                or _offload_problem(activation_offload) or text_problem(lora_file_name, lora_name)
                or text_problem(parse_targets, target_modules) or True)

    def train(self, pipeline, data, strategy, lora_name, rank, alpha, learning_rate, steps, batch_size, seed,
              target_modules, gradient_checkpointing, optimizer, checkpoint_every, resume, expert="both",
              activation_offload="off", unique_id=None):
        pipeline = pipeline_input(pipeline, "Train LoRA")
        file_name = lora_file_name(lora_name)
        settings = TrainSettings(rank, alpha, learning_rate, steps, batch_size, seed, target_modules,
                                 gradient_checkpointing, optimizer, checkpoint_every, expert,
                                 activation_offload=activation_offload)
        outputs = TrainOutputs(host.loras_folder() / file_name, host.training_folder() / "checkpoints" / file_name.removesuffix(".safetensors"))
        device = host.compute_device()
        run, settings, chosen = _train_strategy(strategy, pipeline, data, settings, device)
        bar = host.Progress(steps, "training")

        def progress(done, total, loss):
            bar.step(done, total)
            host.progress_text(f"step {done}/{total}, loss {loss:.4f}", unique_id)
            if done % LOSS_LOG_EVERY == 0 or done == total:
                log.info("vidmem: training %s step %d/%d loss %.4f", file_name, done, total, loss)

        try:
            result = train_lora(pipeline, data, run, settings, outputs, pipeline.backend(device), progress,
                                host.check_interrupt, resume,
                                make_room=lambda weight_bytes: host.make_room(training_room(weight_bytes, chosen), device))
        finally:
            bar.close()
        spec = load_lora(result.lora_path, pipeline.pipe, 1.0, "both" if expert == "both" else expert, name=file_name)
        receipt = dict(result.receipt)  # its strategy is the one the trainer ran (the plan's, not a copy of it)
        if chosen is not None:  # the record, and the receipt's plan line (format_receipt shows it)
            receipt["training_plan"] = chosen.receipt(result.receipt["stages"][0])
            receipt["plan"] = plan_line(chosen, receipt["training_plan"])
        text = "\n".join([format_receipt(f"Train LoRA: {file_name} after {result.receipt['steps']} steps", receipt),
                          *train_lines(receipt, settings)])
        return {"ui": {"text": [text], "vidmem_receipt": [receipt]}, "result": (with_lora(pipeline, spec), file_name)}


def training_room(weight_bytes: int, chosen) -> int:
    """Device bytes Train LoRA asks the host for: the training plan's peak where one was made (less the CUDA
    context, which the host's process has), else the weights and the sampler's stated margin (pipelines/room.py)."""
    if chosen is None:
        return weight_bytes + FALLBACK_MARGIN_BYTES
    return max(weight_bytes, chosen.plan.peak_vram_bytes - CUDA_CONTEXT_BYTES)


def _offload_problem(value) -> str | None:
    if value is None:  # not given: the default
        return None
    try:
        offload_mode(value)
    except ValueError as error:
        return str(error)
    return None


def prepare_lines(receipt: dict) -> list[str]:
    buckets = ", ".join(f"{label}: {count}" for label, count in receipt["buckets"].items())
    lines = [f"{receipt['clips']} clips: {receipt['reused']} reused from the cache, {receipt['encoded']} encoded; "
             f"buckets {buckets}", f"cache: {receipt['cache_folder']}"]
    if receipt["encoded"]:
        before, after = receipt["free"]["before"], receipt["free"]["after"]
        freed = ""
        if "allocated_bytes" in before:
            freed = f"; device memory {human_bytes(before['allocated_bytes'])} -> {human_bytes(after['allocated_bytes'])}"
        lines.append(f"text encoder and VAE unloaded: {human_bytes(receipt['encoder_device_bytes'])} of weights "
                     f"were on the device while encoding{freed}")
    else:
        lines.append("text encoder and VAE not loaded: every sample came from the cache")
    return lines


def plan_line(chosen, plan: dict) -> str:
    """The planner's choice and predicted peaks, with the measured peaks beside them."""
    measured = []
    if "measured_peak_vram_bytes" in plan:
        measured.append(f"VRAM {human_bytes(plan['measured_peak_vram_bytes'])}")
    if "measured_peak_rss_bytes" in plan:
        measured.append(f"RAM (process RSS) {human_bytes(plan['measured_peak_rss_bytes'])}")
    return chosen.describe() + ("; measured peak " + ", ".join(measured) if measured else "")


def train_lines(receipt: dict, settings: TrainSettings) -> list[str]:
    losses = receipt.get("losses") or []
    resumed = f" (resumed at step {receipt['start_step']})" if receipt.get("start_step") else ""
    over = [f"trained over the pipeline's {receipt['trained_over']}"] if "trained_over" in receipt else []
    offload = receipt.get("activation_offload")
    if offload:  # memory/activation_offload.py's stats
        over.append(f"activation offload: {human_bytes(offload['offloaded_bytes'])} of block inputs to host memory "
                    f"over the run in {human_bytes(offload['host_buffer_bytes'])} of buffers; "
                    f"{offload['on_demand_blocks']} blocks copied back on demand, {offload['over_cap']} inputs kept "
                    "on the device (over the pinned ceiling)")
    return over + [
        f"{receipt['component']}: LoRA rank {settings.rank} on {receipt['layers']} layers, "
        f"{human_bytes(receipt['trainable_bytes'])} trainable; {settings.optimizer.value} states "
        f"{human_bytes(receipt['optimizer_state_bytes'])}",
        f"steps {receipt['steps']}{resumed}, {receipt['seconds_per_step']:.2f} s/step; last losses "
        + ", ".join(f"{loss:.4f}" for loss in losses),
        f"LoRA written to {receipt['lora']}; checkpoint in {receipt['checkpoint']}",
    ]
