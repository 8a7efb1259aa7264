"""bench/cache_quality.py, measured part: every step cache on the trained model, per class prompt,
against the uncached run of the same model, seed and prompt, pass by pass."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from vidmem.pipelines.step_cache import StepCache

from .speed_runs import UNCACHED, SpeedConfig, call, methods, psnr_db, tiers

PUBLISHED_SETTINGS = (0.12, 4)  # MagCache's published Wan 2.1 threshold and K
BOLD = (0.24, 6)  # twice the threshold, and K 6: on a model whose ratios stay near 1, K binds before the threshold
FBC_BOLD = (0.1, 0.2)  # First Block Cache beyond diffusers' default 0.05
TAYLOR_GENTLE = {"interval_3": dict(interval=3), "interval_3_order_2": dict(interval=3, order=2)}  # beside the defaults


def calibrated_ratios(loaded, config: SpeedConfig) -> tuple[float, ...]:
    """This model's MagCache ratios, measured by vidmem's own calibration run (every block computed)
    on `config`'s prompt and seed; the receipt gives them, as the Sampler saves them."""
    done = call(loaded, config, tiers(config.blocks)["none"], StepCache("mag_cache", calibrate=True))
    return tuple(done.receipt["cache"]["mag_ratios"]["transformer"])


def quality_methods(config: SpeedConfig, ratios: tuple[float, ...], calibrated_on: str) -> dict[str, StepCache]:
    """Uncached; MagCache with the published Wan 2.1 1.3B ratios (speed.py's settings) and bolder;
    MagCache with the calibrated ratios at vidmem's defaults (threshold 0.06, K 3), the published
    settings and bolder; First Block Cache at diffusers' default and bolder; TaylorSeer at diffusers'
    defaults (interval 5) and gentler (interval 3, at order 1 and 2)."""
    shipped = methods(config)
    published = shipped["mag_cache"]
    calibrated = StepCache("mag_cache", expert_ratios=(("transformer", ratios),), ratio_steps=config.steps,
                           ratio_source=f"calibrated on the trained model ({calibrated_on})")
    bold = dict(threshold=BOLD[0], max_skip_steps=BOLD[1])
    found = {UNCACHED: shipped[UNCACHED], "mag_cache_published": published,
             "mag_cache_published_bold": replace(published, **bold), "mag_cache_calibrated": calibrated,
             "mag_cache_calibrated_published_settings": replace(calibrated, threshold=PUBLISHED_SETTINGS[0],
                                                                max_skip_steps=PUBLISHED_SETTINGS[1]),
             "mag_cache_calibrated_bold": replace(calibrated, **bold)}
    found["first_block_cache"] = shipped["first_block_cache"]
    for threshold in FBC_BOLD:
        found[f"first_block_cache_{threshold:g}"] = StepCache("first_block_cache", threshold=threshold)
    found["taylor_seer"] = StepCache("taylor_seer")  # diffusers' defaults: interval 5, warm-up 3, order 1
    for name, settings in TAYLOR_GENTLE.items():
        found[f"taylor_seer_{name}"] = StepCache("taylor_seer", **settings)
    return found


class PassRecorder:
    """Each denoiser pass's output, and whether its last block computed: a block a step cache skips
    is called, but its leaves are not, so a forward hook on one of the last block's leaves tells."""

    def __init__(self, transformer: torch.nn.Module) -> None:
        leaf = next(m for m in transformer.blocks[-1].modules() if isinstance(m, torch.nn.Linear))
        self.outputs: list[torch.Tensor] = []
        self.computed: list[bool] = []
        self._hooks = [transformer.register_forward_pre_hook(self._begin), leaf.register_forward_hook(self._ran),
                       transformer.register_forward_hook(self._end)]

    def _begin(self, module, args) -> None:
        self.computed.append(False)

    def _ran(self, module, args, out) -> None:
        self.computed[-1] = True

    def _end(self, module, args, out) -> None:
        self.outputs.append((out[0] if isinstance(out, tuple) else out.sample).detach().float().clone())

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()


@dataclass
class Recorded:
    latent: torch.Tensor
    blocks_computed: int
    outputs: list[torch.Tensor]
    computed: list[bool]


def run(loaded, config: SpeedConfig, cache: StepCache) -> Recorded:
    """One `sample()` call at tier none, every pass recorded."""
    recorder = PassRecorder(loaded.pipe.transformer)
    try:
        done = call(loaded, config, tiers(config.blocks)["none"], cache)
    finally:
        recorder.remove()
    total = len(recorder.computed) * config.blocks
    return Recorded(done.latent, done.receipt.get("cache", {}).get("blocks_computed", total), recorder.outputs,
               recorder.computed)


def compared(cached: Recorded, uncached: Recorded, config: SpeedConfig) -> dict:
    """One method on one prompt against the uncached run: blocks ratio, PSNR of the final latent, and
    where the run first skipped and first differed (the passes before the first skip must match)."""
    skipped = [i for i, c in enumerate(cached.computed) if not c]
    differs = [i for i, (a, b) in enumerate(zip(cached.outputs, uncached.outputs)) if not torch.equal(a, b)]
    first_skip, first_diff = (skipped or [None])[0], (differs or [None])[0]
    total = len(uncached.computed) * config.blocks
    return {"blocks_ratio": cached.blocks_computed / total, "psnr_db": psnr_db(uncached.latent, cached.latent),
            "bitwise_equal_to_uncached": torch.equal(uncached.latent, cached.latent),
            "passes": len(cached.computed), "passes_skipped": len(skipped), "first_skipped_pass": first_skip,
            "first_differing_pass": first_diff,
            "same_until_first_skip": first_diff is None or (first_skip is not None and first_diff >= first_skip)}
