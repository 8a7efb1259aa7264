"""Step Cache (VidMem): skip the denoiser's blocks on steps whose output can be predicted.

The node only describes the cache; the Video Sampler applies it for one call (pipelines/step_cache.py)
and, under block swap, does not copy the weights of the blocks it skips.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..memory.strategy import StrategyError
from ..pipelines.step_cache import CacheMethod, StepCache, cache_with_ratios, ratio_files
from . import host
from .checks import connected, literal_problem

CACHE_TYPE = "VIDMEM_STEP_CACHE"
AUTO, CALIBRATE = "auto", "calibrate"


@dataclass(frozen=True)
class CacheChoice:
    """The node's output: the cache, and which MagCache ratios to use (resolved against the pipeline)."""

    cache: StepCache
    ratios: str = AUTO

    def for_pipeline(self, pipeline) -> StepCache:
        return cache_with_ratios(self.cache, pipeline, self.ratios, host.mag_ratios_folder())


class VidMemStepCache:
    DESCRIPTION = (
        "Skips the transformer's blocks on steps whose result can be predicted: MagCache from the model's "
        "published magnitude ratios (about 2x on Wan 2.1 at a small loss, per its paper), First Block Cache "
        "from how much the first block's output changed, or TaylorSeer, which computes one step in `interval` "
        "and extrapolates the others. Under block swap the skipped blocks are not copied either. Connect it to "
        "the Video Sampler's cache input."
    )
    CATEGORY = "vidmem"
    FUNCTION = "build"
    RETURN_TYPES = (CACHE_TYPE,)
    RETURN_NAMES = ("cache",)
    OUTPUT_TOOLTIPS = ("The step cache for the Video Sampler's cache input; it applies to that call only.",)

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "method": ([m.value for m in CacheMethod], {"default": CacheMethod.MAG.value, "tooltip":
                    "mag_cache: skips whole steps while the error its ratios predict stays under the threshold. "
                    "first_block_cache: runs the first block each pass and skips the rest when its output changed "
                    "less than the threshold; needs no ratios. taylor_seer: after the warm-up computes one step in "
                    "`interval` and predicts the others' output by a Taylor series over the computed steps (no block "
                    "runs or is copied then); needs no ratios, decided ahead from the step count, the same on every "
                    "GPU: the only one that runs with context parallelism. off: every block of every step. "
                    "mag_cache and first_block_cache need diffusers' block metadata, which LTX-2's blocks "
                    "lack: there choose taylor_seer or off."}),
                "threshold": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 1.0, "step": 0.01, "tooltip":
                    "0: mag_cache takes the threshold published with the model's ratios (mag_ratios auto; e.g. 0.12 "
                    "for Wan 2.1 1.3B) or 0.06 where none was published (a calibrated file); first_block_cache "
                    "0.05. retention and max_skip_steps stay this node's values either way. Higher skips more and "
                    "loses more detail; MagCache's paper reports about 2x on Wan 2.1 at 0.06 with a small loss."}),
                "retention": ("FLOAT", {"default": 0.2, "min": 0.0, "max": 1.0, "step": 0.05, "tooltip":
                    "MagCache: the share of steps at the start that always run (they set the composition)."}),
                "max_skip_steps": ("INT", {"default": 3, "min": 1, "max": 50, "tooltip":
                    "MagCache: the most steps skipped in a row before one runs again (K in its paper)."}),
                "mag_ratios": ([AUTO, CALIBRATE, *ratio_files(host.mag_ratios_folder())], {"default": AUTO, "tooltip":
                    "MagCache's per-step magnitude ratios for this model: auto uses the published ones where "
                    "they exist; calibrate runs every block once and saves this model's ratios as a file listed "
                    "here (named by model, blocks, steps and a short key of the model's layout). A file measured on another "
                    "model is refused."}),
            },
            "optional": {  # optional, so graphs saved before TaylorSeer existed still load and queue
                "interval": ("INT", {"default": 5, "min": 1, "max": 1000, "tooltip":
                    "TaylorSeer: after the warm-up, one step in `interval` is computed and the others predicted. "
                    "5 (diffusers' default) computes 13 of 50 steps, about a quarter of the denoising work; 3 "
                    "computes 19 and stayed much closer to the uncached video on vidmem's trained test model "
                    "(docs/step-cache.md). Larger is faster and drifts further; 1 computes every step."}),
                "warmup_steps": ("INT", {"default": 3, "min": 1, "max": 1000, "tooltip":
                    "TaylorSeer: steps always computed at the start (at least 1: it predicts from computed "
                    "steps). They set the video's layout; more is slower and closer to the uncached video. "
                    "Each Wan 2.2 expert warms up on its own steps."}),
                "end_steps": ("INT", {"default": 0, "min": 0, "max": 1000, "tooltip":
                    "TaylorSeer: steps always computed at the end of the run, where fine detail settles; 0: "
                    "none. Each costs one full step."}),
                "order": ("INT", {"default": 1, "min": 1, "max": 3, "tooltip":
                    "TaylorSeer: the Taylor series' order. 1 extrapolates along the last two computed steps; 2 "
                    "and 3 follow curvature but amplify noise between steps `interval` apart. Costs no time."}),
            },
        }

    @classmethod
    def VALIDATE_INPUTS(cls, threshold=None, retention=None):
        """Named so NaN is refused when queued (it passes ComfyUI's min/max); ranges checked here."""
        return literal_problem(cls, "threshold", threshold) or literal_problem(cls, "retention", retention) or True

    def build(self, method, threshold, retention, max_skip_steps, mag_ratios=AUTO, interval=5, warmup_steps=3,
              end_steps=0, order=1):
        needs_ratios = method == CacheMethod.MAG.value and mag_ratios != CALIBRATE
        # The ratios are resolved against the pipeline at the Sampler; a placeholder passes the check here.
        cache = StepCache(method, threshold, retention, max_skip_steps, (1.0,) if needs_ratios else None,
                          calibrate=method == CacheMethod.MAG.value and mag_ratios == CALIBRATE, interval=interval,
                          warmup_steps=warmup_steps, end_steps=end_steps, order=order)
        choice = CacheChoice(cache, mag_ratios)
        return {"ui": {"text": [node_text(cache, mag_ratios if needs_ratios else None)]}, "result": (choice,)}


def node_text(cache: StepCache, ratios: str | None) -> str:
    """What the node shows. MagCache's threshold 0 is resolved with the ratios at the Sampler (the published
    one with 'auto'), so it is not named as 0.06 here; the Sampler's receipt gives the value it ran with."""
    if ratios is None:
        return f"Step Cache: {cache.describe()}"
    if cache.threshold:
        return f"Step Cache: {cache.describe()}, ratios {ratios}"
    return (f"Step Cache: {cache.method.value} threshold=the one published with the ratios (0.06 where none is) "
            f"retention={cache.retention:g} max_skip_steps={cache.max_skip_steps}, ratios {ratios}")


def cache_input(value, pipeline, node: str) -> StepCache:
    """The Sampler's optional cache input as a StepCache for `pipeline`; refused naming what was connected."""
    if value is None:
        return StepCache()
    if isinstance(value, CacheChoice):
        return value.for_pipeline(pipeline)
    if isinstance(value, StepCache):
        return value
    raise StrategyError(f"cache ({node}) got {connected(value)}, not a step cache; connect the cache output of a "
                        "Step Cache (VidMem) node, or leave it empty.")
