"""Memory Strategy (VidMem): one validated MemoryStrategy from the widgets."""

from __future__ import annotations

from ..memory import MemoryStrategy, OffloadTier, StrategyError, TextEncoderPlacement, VaeTiling
from ..memory.planner_stages import VideoShape
from ..memory.strategy import TEMPORAL_SIZE_RANGE, TILE_SIZE_RANGE
from ..memory.telemetry import default_budgets
from ..pipelines.planning import choose_for, plan_strategy
from . import host

STRATEGY_TYPE = "VIDMEM_STRATEGY"
AUTO = "auto"  # node-level tier: the planner picks the fastest strategy that fits
_DEFAULT = MemoryStrategy()
_TILES = VaeTiling()


AUTO_PINNED = -1.0  # widget value meaning "automatic ceiling"


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
) -> MemoryStrategy:
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
    )


class VidMemMemoryStrategy:
    DESCRIPTION = (
        "Chooses where weights live while a video is sampled and decoded. Every choice gives the "
        "same frames; they differ in GPU memory and speed."
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
                    "auto: connect the pipeline; the planner picks the fastest tier, block count, text encoder "
                    "placement and VAE tiling that fit the budgets, and shows the predicted peaks."}),
                "blocks_to_swap": ("INT", {"default": 0, "min": 0, "max": 100, "tooltip":
                    "block_swap only: how many transformer blocks stay in RAM and stream in per step. "
                    "Wan 14B has 40 blocks, Wan 1.3B 30, CogVideoX-2b 30, CogVideoX-5b 42. 0 with other tiers."}),
                "prefetch_blocks": ("INT", {"default": _DEFAULT.prefetch_blocks, "min": 0, "max": 8, "tooltip":
                    "Streamed blocks copied ahead while the current one computes. 1 hides most of the "
                    "transfer; each extra block costs one block of VRAM. 0 copies on demand."}),
                "max_pinned_ram_gb": ("FLOAT", {"default": AUTO_PINNED, "min": AUTO_PINNED, "max": 1024.0, "step": 0.5,
                    "tooltip": "Ceiling on page-locked RAM for streamed blocks (GPU only). Pinned blocks copy "
                    "asynchronously while the GPU computes; past the ceiling they stay pageable and copy "
                    "synchronously. Pinned RAM cannot be swapped out. -1: automatic (half the free RAM, "
                    "keeping 8 GB unpinned); 0: no pinning."}),
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
                    "step": 32, "tooltip": "Tile edge in output pixels (as core VAE Decode (Tiled)). Smaller uses less VRAM."}),
                "overlap": ("INT", {"default": _TILES.overlap, "min": 0, "max": 4096, "step": 8, "tooltip":
                    "Pixels shared by neighbouring tiles and blended; at most tile_size/4."}),
                "temporal_size": ("INT", {"default": _TILES.temporal_size, "min": TEMPORAL_SIZE_RANGE[0],
                    "max": TEMPORAL_SIZE_RANGE[1], "step": 4, "tooltip": "Output frames decoded per chunk. The VAE's causal caches carry over from chunk to "
                    "chunk (CogVideoX, Wan), so chunks are exact and only bound the frames held at once."}),
                "temporal_overlap": ("INT", {"default": _TILES.temporal_overlap, "min": 0, "max": 4096, "step": 4,
                    "tooltip": "Frames shared by neighbouring chunks and blended; at most temporal_size/2. Used only "
                    "for a VAE whose caches vidmem cannot carry over; CogVideoX and Wan chunks follow each other exactly."}),
            },
            "optional": {
                "pipeline": ("VIDMEM_PIPELINE", {"tooltip": "Connect to predict this strategy's peak VRAM and RAM per "
                             "stage before running (needed for offload=auto). Nothing is loaded onto the GPU."}),
                "width": ("INT", {"default": 832, "min": 16, "max": 4096, "step": 16, "tooltip":
                    "The size you will sample, for the prediction; match the Video Sampler."}),
                "height": ("INT", {"default": 480, "min": 16, "max": 4096, "step": 16, "tooltip":
                    "The size you will sample, for the prediction; match the Video Sampler."}),
                "frames": ("INT", {"default": 81, "min": 1, "max": 1025, "step": 4, "tooltip":
                    "The frames you will sample, for the prediction; match the Video Sampler."}),
                "vram_budget_gb": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 1024.0, "step": 0.5, "tooltip":
                    "VRAM the plan may use; 0: the GPU's total memory. Lower it to leave room for other apps."}),
                "ram_budget_gb": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 4096.0, "step": 1.0, "tooltip":
                    "System RAM the plan may use, including the loaded weights; 0: this machine's RAM."}),
            },
        }

    @classmethod
    def VALIDATE_INPUTS(cls, **inputs):
        """Reject bad combinations when the prompt is queued, before anything runs."""
        widgets = {k: v for k, v in inputs.items() if k in _WIDGETS}
        if any(value is None for value in widgets.values()):
            return True  # a linked input has no value yet; build() validates at run time
        try:
            build_strategy(**_resolve_auto_widgets(widgets))
        except (StrategyError, TypeError) as error:
            return str(error)
        return True

    def build(self, pipeline=None, width=832, height=480, frames=81, vram_budget_gb=0.0, ram_budget_gb=0.0, **widgets):
        auto = widgets["offload"] == AUTO
        strategy = build_strategy(**_resolve_auto_widgets(widgets))
        if pipeline is None:
            if auto:
                raise StrategyError("offload='auto' needs the pipeline input connected, so the planner knows the model.")
            return {"ui": {"text": [strategy.describe()]}, "result": (strategy,)}
        shape = VideoShape(width, height, frames)
        vram, ram = _budgets(vram_budget_gb, ram_budget_gb)
        if auto:
            plan = choose_for(pipeline, shape, strategy, vram, ram)  # no plan, no strategy: errors stop the run
            text = "auto chose: " + plan.describe()
        else:
            try:
                plan = plan_strategy(pipeline, shape, strategy, vram, ram)
            except ValueError as error:  # the prediction is advice: the run goes on, the sampler checks again
                text = f"{strategy.describe()}\nprediction unavailable: {error}"
                return {"ui": {"text": [text]}, "result": (strategy,)}
            text = "predicted: " + plan.describe()
        return {"ui": {"text": [text], "vidmem_plan": [plan.as_dict()]}, "result": (plan.strategy,)}


_WIDGETS = set(build_strategy.__code__.co_varnames[: build_strategy.__code__.co_argcount])


def _resolve_auto_widgets(widgets: dict) -> dict:
    """For offload=auto the planner chooses the tier and blocks: build the widgets' other choices."""
    if widgets.get("offload") != AUTO:
        return widgets
    if widgets.get("blocks_to_swap"):
        raise StrategyError("blocks_to_swap must be 0 with offload='auto'; the planner chooses it.")
    return {**widgets, "offload": OffloadTier.MODEL.value}


def _budgets(vram_gb: float, ram_gb: float) -> tuple[int, int]:
    vram, ram = default_budgets(host.compute_device())
    gib = 1 << 30
    return (int(vram_gb * gib) if vram_gb else vram), (int(ram_gb * gib) if ram_gb else ram)
