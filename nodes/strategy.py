"""Memory Strategy (VidMem): one validated strategy from the widgets, planned at the Sampler's shape.

The node has no size of its own: the shape is the Sampler's. Before a run the web extension
asks GET /vidmem/plan (nodes/plan_route.py) with the Sampler's size and draws the plan on this
node; at run time the Sampler plans again with its own shape (and, for offload=auto, chooses
there). Older workflows that still carry width/height/frames on this node load and queue:
ComfyUI drops API inputs the node no longer declares, and the web extension maps old UI
widget values to their new positions.
"""

from __future__ import annotations

import math

from dataclasses import dataclass, replace

from ..memory import MemoryStrategy, OffloadTier, StrategyError, TextEncoderPlacement, VaeTiling
from ..memory.context_parallel import cpu_modes, device_refusal
from ..memory.strategy import (CHUNKS_AUTO, MAX_ACTIVATION_CHUNKS, TEMPORAL_SIZE_RANGE, TILE_SIZE_RANGE,
                               ContextParallel, Parallelism)
from ..memory.telemetry import default_budgets
from ..memory.units import GiB
from .checks import connected, literal_problems

STRATEGY_TYPE = "VIDMEM_STRATEGY"
AUTO = "auto"  # node-level tier: the planner picks the fastest strategy that fits
AUTO_PINNED = -1.0  # widget value meaning "automatic ceiling"
TILE_STEP = 32  # VaeTiling: tiles align with the latent grid of every VAE vidmem runs
_DEFAULT = MemoryStrategy()
_TILES = VaeTiling()


@dataclass(frozen=True)
class StrategyChoice:
    """What the Strategy node hands the Sampler and Decode.

    `strategy` is the user's strategy, or for offload=auto the base whose prefetch, pinning and
    slicing the planner keeps while it chooses the rest at the Sampler's shape. Budgets of 0
    mean the host's defaults (the GPU's total memory, this machine's RAM), read at run time.
    """

    strategy: MemoryStrategy
    auto: bool = False
    vram_budget_gb: float = 0.0
    ram_budget_gb: float = 0.0
    notes: tuple[str, ...] = ()  # widget values the chosen tier ignores (strategy_notes), for the receipts

    def __post_init__(self) -> None:
        # ComfyUI's min/max checks let NaN through (every comparison with NaN is false).
        for name in BUDGETS:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
                raise StrategyError(f"{name}={value!r} must be a finite number of GiB, 0 or more (0: this machine's own).")

    def budgets(self, device) -> tuple[int, int]:
        vram, ram = default_budgets(device)
        return (int(self.vram_budget_gb * GiB) if self.vram_budget_gb else vram,
                int(self.ram_budget_gb * GiB) if self.ram_budget_gb else ram)

    def describe(self) -> str:
        if self.auto:
            parallel = self.strategy.parallel.describe()
            text = ("offload=auto: the Sampler's planner chooses the tier, blocks, text encoder and VAE tiling"
                    + (", and the activation chunks" if self.strategy.chunks_auto else "")
                    + (f"; {parallel}" if parallel else ""))
        else:
            text = self.strategy.describe()
        return "\n".join((text, *(f"note: {note}" for note in self.notes)))


def build_strategy(
    offload: str,
    blocks_to_swap: int,
    prefetch_blocks: int,
    max_pinned_ram_gb: float,
    non_blocking: bool,
    text_encoder: str,
    vae_slicing: bool,
    vae_tiling: bool,
    tile_size: int,
    overlap: int,
    temporal_size: int,
    temporal_overlap: int,
    *,
    activation_chunks: str = "off",  # keyword only: not one of WIDGETS, whose order saved workflows keep
) -> MemoryStrategy:
    """The MemoryStrategy the widgets describe (offload=auto builds the base the planner starts from).

    A blocks_to_swap the tier does not use is ignored (strategy_notes says so), not refused:
    switching a template's tier must not fail the run over a value left from the other tier."""
    if strategy_notes(offload, blocks_to_swap):
        blocks_to_swap = 0
    if offload == AUTO:
        offload = OffloadTier.MODEL.value
    tiling = VaeTiling(tile_size, overlap, temporal_size, temporal_overlap) if vae_tiling else None
    return MemoryStrategy(
        offload=offload,
        blocks_to_swap=blocks_to_swap,
        prefetch_blocks=prefetch_blocks,
        max_pinned_ram_gb=None if max_pinned_ram_gb == AUTO_PINNED else max_pinned_ram_gb,
        non_blocking=non_blocking,
        text_encoder=text_encoder,
        vae_slicing=vae_slicing,
        vae_tiling=tiling,
        activation_chunks=activation_chunks,
    )


def strategy_notes(offload: str, blocks_to_swap) -> tuple[str, ...]:
    """What the widgets set that the chosen tier ignores, as notes for the receipts (empty: nothing)."""
    if offload == OffloadTier.BLOCK_SWAP.value or isinstance(blocks_to_swap, bool) or blocks_to_swap in (0, None):
        return ()
    if not isinstance(blocks_to_swap, int) or blocks_to_swap < 0:
        return ()  # not a value to ignore: MemoryStrategy refuses it by name
    if offload == AUTO:
        return (f"blocks_to_swap={blocks_to_swap} ignored: offload=auto chooses the blocks itself.",)
    return (f"blocks_to_swap={blocks_to_swap} ignored: it applies only to offload=block_swap (offload is {offload}).",)


WIDGETS = tuple(build_strategy.__code__.co_varnames[: build_strategy.__code__.co_argcount])
BUDGETS = ("vram_budget_gb", "ram_budget_gb")
LEGACY_SHAPE_INPUTS = ("width", "height", "frames")  # on this node before the Sampler's shape was used
# Added after the budgets, so the positional widgets_values of older workflows keep their meaning.
# Two widgets, not three: the web extension recognises workflows saved before the shape moved to
# the Sampler by their 17 values (web/js/vidmem_format.js), and 14 + 3 would be mistaken for them.
PARALLEL_WIDGETS = ("gpus", "context_parallel")
# The last optional input, after gpus and context_parallel, so older workflows' positional values keep
# their meaning. Its 17 values equal the count of workflows saved before the shape moved to the Sampler:
# the web extension tells them apart by the value where those had frames (a number) and these have gpus.
CHUNK_CHOICES = (CHUNKS_AUTO, "off", *(str(2 ** n) for n in range(1, MAX_ACTIVATION_CHUNKS.bit_length())))
CPU_RANKS = "cpu:"


def parse_parallel(gpus: str, context_parallel: str) -> Parallelism:
    """The `gpus` text ("auto", "0,1", "cpu:2") and the context_parallel choice as a Parallelism."""
    text = str(gpus).strip().lower().replace(" ", "")
    mode = context_parallel  # Parallelism names a value that is not one of the choices
    if text in ("", AUTO):
        return Parallelism(None, mode)
    if text.startswith(CPU_RANKS):
        count = text[len(CPU_RANKS):]
        if not count.isdigit() or int(count) < 2 or mode == ContextParallel.OFF:
            raise StrategyError(f"gpus={gpus!r}: 'cpu:N' runs N CPU processes (N 2 or more, for testing; slow) "
                                f"and needs context_parallel {' or '.join(cpu_modes())}; e.g. cpu:2.")
        refusal = device_refusal(mode, "cpu")
        if refusal:
            raise StrategyError(f"gpus={gpus!r}: {refusal}")
        return Parallelism(None, mode, int(count), cpu=True)  # CPU processes even where GPUs are visible
    parts = text.split(",")
    if not all(part.isdigit() for part in parts):
        raise StrategyError(f"gpus={gpus!r} must be auto, GPU indices separated by commas (e.g. 0,1), or cpu:N.")
    listed = tuple(int(part) for part in parts)
    if len(set(listed)) != len(listed):
        raise StrategyError(f"gpus={gpus!r} lists a GPU twice; list each GPU once (e.g. 0,1).")
    if len(listed) == 1 and mode == ContextParallel.OFF:
        # One process runs on ComfyUI's own device; a single listed GPU would be silently ignored.
        raise StrategyError(f"gpus={gpus!r} lists one GPU: vidmem runs on ComfyUI's GPU (choose it with ComfyUI's "
                            "--cuda-device). Set gpus to auto, or list two or more GPUs to place components on them.")
    return Parallelism(listed, mode)


def one_process_only(choice, node: str):
    """`choice` for a node that runs in ComfyUI's process on its device (Train LoRA, Prepare Training
    Data); StrategyError when the strategy asks for GPUs or context parallelism, which only the
    Video Sampler runs: silently training on one device would not be what was asked."""
    parallel = choice.strategy.parallel
    if parallel != Parallelism():
        raise StrategyError(f"{node} runs on ComfyUI's device only; the Memory Strategy asks for {parallel.describe()} "
                            "(gpus, context_parallel), which only the Video Sampler runs. Give this node a Memory "
                            "Strategy with gpus=auto and context_parallel=off.")
    return choice


def tile_size_problem(tile_size) -> str | None:
    """The one rule on tile_size that ComfyUI's min/max cannot express (and its range, since
    naming it in VALIDATE_INPUTS turns ComfyUI's own check off for it). None for a linked input
    (no value when queued): MemoryStrategy checks the value when it arrives."""
    if tile_size is None:
        return None
    low, high = TILE_SIZE_RANGE
    if not isinstance(tile_size, int) or isinstance(tile_size, bool) or not low <= tile_size <= high:
        return f"tile_size={tile_size!r} must be a whole number of pixels from {low} to {high}."
    if tile_size % TILE_STEP:
        below = max(low, tile_size // TILE_STEP * TILE_STEP)
        return f"tile_size={tile_size} must be a multiple of {TILE_STEP}; use {below} or {below + TILE_STEP}."
    return None


def pinned_ram_problem(value) -> str | None:
    """max_pinned_ram_gb between the automatic -1 and 0 means nothing (after literal_problem's checks)."""
    if value is not None and AUTO_PINNED < value < 0:
        return f"max_pinned_ram_gb={value} must be -1 (automatic), 0 (no pinning) or more."
    return None


class VidMemMemoryStrategy:
    DESCRIPTION = (
        "Chooses where weights live while a video is sampled and decoded. Every choice gives the "
        "same frames; they differ in GPU memory and speed. Before you queue, the node shows the "
        "predicted peak VRAM and RAM per stage for every tier at the connected Sampler's size."
    )
    CATEGORY = "vidmem"
    FUNCTION = "build"
    RETURN_TYPES = (STRATEGY_TYPE,)
    RETURN_NAMES = ("strategy",)
    OUTPUT_TOOLTIPS = ("Connect to Video Sampler and Video VAE Decode.",)

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "offload": ([t.value for t in OffloadTier] + [AUTO], {"default": _DEFAULT.offload.value, "tooltip":
                    "none: everything on the GPU (fastest, most VRAM). model: one component at a time "
                    "(text encoder, then transformer). block_swap: as model, but the last blocks_to_swap "
                    "transformer blocks stream in each step. sequential: every layer streams (least VRAM, slowest). "
                    "auto: the Sampler's planner picks the fastest tier, block count, text encoder placement "
                    "and VAE tiling that fit the budgets at its size."}),
                "blocks_to_swap": ("INT", {"default": 0, "min": 0, "max": 100, "tooltip":
                    "block_swap only: how many transformer blocks stay in RAM and stream in per step, at most the "
                    "model's own count: Wan 14B has 40 blocks, Wan 1.3B 30, CogVideoX-2b 30, CogVideoX-5b 42. "
                    "Ignored (greyed out, with a note in the receipts) under every other tier, so switching the "
                    "tier never needs it reset."}),
                "prefetch_blocks": ("INT", {"default": _DEFAULT.prefetch_blocks, "min": 0, "max": 8, "tooltip":
                    "Streamed blocks copied ahead while the current one computes. 1 hides most of the "
                    "transfer; each extra block costs one block of VRAM. 0 copies on demand."}),
                "max_pinned_ram_gb": ("FLOAT", {"default": AUTO_PINNED, "min": AUTO_PINNED, "max": 1024.0, "step": 0.5,
                    "tooltip": "Ceiling on page-locked RAM for streamed blocks (GPU only). Pinned blocks copy "
                    "straight and asynchronously while the GPU computes; past the ceiling they are staged "
                    "through a small pinned ring (one more CPU copy per step). Pinned RAM cannot be swapped "
                    "out. -1: automatic (half the free RAM, keeping 8 GB unpinned); 0: no pinning. A value "
                    "lower than what earlier runs pinned unpins the excess at the next run of a Video Sampler or "
                    "Train LoRA node with a streaming tier (block_swap, sequential); a Decode's value only caps "
                    "what the Decode pins itself and never unpins the Sampler's blocks."}),
                "non_blocking": ("BOOLEAN", {"default": _DEFAULT.non_blocking, "tooltip":
                    "Copy streamed blocks asynchronously so copies overlap compute. Turn off only to "
                    "debug a driver problem: every copy then stalls the GPU."}),
                "text_encoder": ([p.value for p in TextEncoderPlacement], {"default": _DEFAULT.text_encoder.value,
                    "tooltip": "device: on the GPU with the tier's rules. offload_after_encoding: on the GPU "
                    "only to encode the prompt. cpu: encode in RAM (slow for T5-XXL, no VRAM)."}),
                "vae_slicing": ("BOOLEAN", {"default": False, "tooltip":
                    "Decode one video of the batch at a time. Saves memory only for batches over 1."}),
                "vae_tiling": ("BOOLEAN", {"default": False, "tooltip":
                    "Decode in overlapping, blended tiles and in frame chunks: bounded VRAM for any size, a little slower."}),
                "tile_size": ("INT", {"default": _TILES.tile_size, "min": TILE_SIZE_RANGE[0], "max": TILE_SIZE_RANGE[1],
                    "step": TILE_STEP, "tooltip": "Tile edge in output pixels (as core VAE Decode (Tiled)), a multiple "
                    "of 32. Smaller uses less VRAM. Left at the defaults (256/32), a family whose VAE needs larger tiles "
                    "decodes at its own (LTX-2: 512/64 px); a tile set below that is honoured, with a warning."}),
                "overlap": ("INT", {"default": _TILES.overlap, "min": 0, "max": 4096, "step": 8, "tooltip":
                    "Pixels shared by neighbouring tiles and blended; a multiple of 8, at most tile_size/4."}),
                "temporal_size": ("INT", {"default": _TILES.temporal_size, "min": TEMPORAL_SIZE_RANGE[0],
                    "max": TEMPORAL_SIZE_RANGE[1], "step": 4, "tooltip": "Output frames decoded per chunk, a multiple "
                    "of 4. The VAE's causal caches carry over from chunk to chunk (CogVideoX, Wan, HunyuanVideo 1.5), "
                    "so chunks are exact and only bound the frames held at once; LTX-2's are blended "
                    "(temporal_overlap; a temporal_size covering the video decodes it exactly)."}),
                "temporal_overlap": ("INT", {"default": _TILES.temporal_overlap, "min": 0, "max": 4096, "step": 4,
                    "tooltip": "Frames shared by neighbouring chunks and blended; at most temporal_size/2. Used only "
                    "for a VAE whose caches vidmem cannot carry over (LTX-2); CogVideoX, Wan and HunyuanVideo 1.5 chunks "
                    "follow each other exactly."}),
            },
            "optional": {
                "pipeline": ("VIDMEM_PIPELINE", {"tooltip": "Not needed: the plan reads the model from the "
                             "Sampler's pipeline. Kept so workflows that connect it still load."}),
                "vram_budget_gb": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 1024.0, "step": 0.5, "tooltip":
                    "VRAM the plan may use; 0: the GPU's total memory. Lower it to leave room for other apps. "
                    "On a CPU device (ComfyUI run on the CPU) the compute holds RAM: ram_budget_gb covers it and this is "
                    "not used."}),
                "ram_budget_gb": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 4096.0, "step": 1.0, "tooltip":
                    "System RAM the plan may use, including the loaded weights; 0: this machine's RAM."}),
                "gpus": ("STRING", {"default": AUTO, "tooltip":
                    "Which GPUs to use, as CUDA numbers them. auto: ComfyUI's GPU (context_parallel off) or every "
                    "visible GPU (context_parallel on). 0,1: these GPUs; with context_parallel off, whole components "
                    "go to different GPUs (the transformers and VAE on the first listed, the text encoder on the "
                    "second) under the offload tier; with it on, one rank per GPU. cpu:2: two CPU processes, "
                    "even where GPUs are visible (for testing; slow)."}),
                "context_parallel": ([m.value for m in ContextParallel], {"default": ContextParallel.OFF.value,
                    "tooltip": "Split each video's tokens between the GPUs (Wan only, diffusers' context "
                    "parallelism); every GPU holds the whole model and applies the offload tier above to its own "
                    "copy. ulysses: exchanges attention heads (the heads and tokens must divide by the GPU count). "
                    "ring: passes keys and values round the GPUs (needs flash/cuDNN attention). off: one process. "
                    "For now only a diffusers folder from Load Video Pipeline at its own dtype (no weight_dtype, "
                    "no single or fp8/GGUF files): each GPU's process reopens the folder with its weights in RAM, "
                    "so RAM holds one copy per GPU plus ComfyUI's."}),
                "activation_chunks": (list(CHUNK_CHOICES), {"default": CHUNKS_AUTO, "tooltip":
                    "Token slices each transformer block computes in (Wan, CogVideoX, HunyuanVideo 1.5): the same video, "
                    "a lower denoise peak. The feed-forward, norms and residuals run one slice at a time; attention keeps "
                    "every key and value (CogVideoX slices its feed-forward only). auto: the planner picks the "
                    "fewest slices that fit the VRAM budget (none when the run "
                    "fits whole; a model that cannot chunk runs whole, with a note). off: as diffusers runs it. "
                    "2-64: always that many (an error for a model that cannot chunk). Under sequential each "
                    "per-token layer is copied once per slice. With the Speed node's compile on, the slices run "
                    "compiled."}),
            },
        }

    @classmethod
    def VALIDATE_INPUTS(cls, tile_size=None, max_pinned_ram_gb=AUTO_PINNED, vram_budget_gb=0.0, ram_budget_gb=0.0):
        """Only what ComfyUI cannot check itself is named (it attaches a failure here to every input
        named, and keeps its own min/max/combo checks for the others): tile_size's multiple, and
        the float widgets, which NaN passes ComfyUI's min/max unnoticed (nodes/checks.py). Rules
        between inputs (overlap against tile_size, the gpus list) are shown on the node by the live
        plan before queueing, refused by the loader's check before it loads the model
        (nodes/preflight.py runs this build() on the literal widgets) and by build() itself; a
        blocks_to_swap the tier does not use is ignored with a note (strategy_notes). Every parameter
        has a default: ComfyUI calls this even when a required input is missing from the prompt, and
        its own "required input missing" must be what the user reads, not a TypeError from here."""
        return (tile_size_problem(tile_size) or literal_problems(cls, max_pinned_ram_gb=max_pinned_ram_gb,
                vram_budget_gb=vram_budget_gb, ram_budget_gb=ram_budget_gb) or pinned_ram_problem(max_pinned_ram_gb)
                or True)

    def build(self, pipeline=None, vram_budget_gb=0.0, ram_budget_gb=0.0, gpus=AUTO,
              context_parallel=ContextParallel.OFF.value, activation_chunks=CHUNKS_AUTO, **widgets):
        for name in LEGACY_SHAPE_INPUTS:  # direct callers of older versions; ComfyUI drops them itself
            widgets.pop(name, None)
        strategy = replace(build_strategy(**widgets, activation_chunks=activation_chunks),
                           parallel=parse_parallel(gpus, context_parallel))
        notes = strategy_notes(widgets["offload"], widgets["blocks_to_swap"])
        choice = StrategyChoice(strategy, widgets["offload"] == AUTO, vram_budget_gb, ram_budget_gb, notes)
        return {"ui": {"text": [choice.describe()]}, "result": (choice,)}


def as_choice(strategy, node: str = "this node", optional: bool = False) -> StrategyChoice | None:
    """A node's strategy input (a StrategyChoice, or a bare MemoryStrategy from code) as a choice;
    None only where the input is `optional`. Anything else is refused naming what was connected."""
    if isinstance(strategy, StrategyChoice) or (strategy is None and optional):
        return strategy
    if isinstance(strategy, MemoryStrategy):
        return StrategyChoice(strategy)
    raise StrategyError(f"strategy ({node}) got {connected(strategy)}, not a Memory Strategy; connect the strategy "
                        "output of a Memory Strategy (VidMem) node.")
