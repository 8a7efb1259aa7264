"""bench/blockswap.py, measured part: every tier's `sample()` call on this CPU, interleaved, and
vidmem's sampler against the plain diffusers pipeline on the same modules."""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass
from functools import partial

import torch

from vidmem.memory import MemoryStrategy
from vidmem.memory.device import CpuBackend

from .blockswap_modelled import transformer_config

MID_CHANGES = dict(num_layers=6, text_dim=32)  # Wan 1.3B widths, 6 blocks; 32: the tiny text encoder's width
# The same modules at negligible width: what a tier adds to a call is then its hooks' bookkeeping alone,
# small enough in absolute terms to measure through this shared machine's noise.
NARROW_CHANGES = dict(MID_CHANGES, num_attention_heads=2, attention_head_dim=12, ffn_dim=32)
CPU_RUN = dict(prompt="a cat and a dog dance", negative_prompt="", width=64, height=64, frames=5, steps=1, cfg=5.0, seed=0)
CONTROL = "none (control)"  # tier none timed a second time: the measurement's own noise floor


def build_pipeline(config: dict):
    """The tiny Wan pipeline's tokenizer, text encoder, VAE and scheduler around a transformer of `config`."""
    import diffusers

    from vidmem.pipelines.loader import LoadedPipeline, pinned_pipeline_class
    from vidmem.pipelines.tiny import build_tiny_pipeline
    from vidmem.pipelines.wan import WAN

    torch.manual_seed(0)
    transformer = diffusers.WanTransformer3DModel(**config).eval()
    components = dict(build_tiny_pipeline("wan2.1-t2v").components, transformer=transformer)
    pipe = pinned_pipeline_class("WanPipeline")(**components)
    pipe.set_progress_bar_config(disable=True)
    return LoadedPipeline(pipe, WAN, "WanPipeline", f"Wan transformer {config['num_layers']} blocks", "fp32")


def cpu_tiers(blocks: int) -> dict[str, MemoryStrategy]:
    tiers = {"none": MemoryStrategy(offload="none"), "model": MemoryStrategy(offload="model")}
    for n in sorted({1, blocks // 2, blocks}):
        for k in (0, 1, 2):
            tiers[f"block_swap:{n}:{k}"] = MemoryStrategy(offload="block_swap", blocks_to_swap=n, prefetch_blocks=k)
    tiers["sequential"] = MemoryStrategy(offload="sequential")
    return tiers


def vidmem_latent(loaded, strategy: MemoryStrategy) -> torch.Tensor:
    from vidmem.pipelines.sample import SampleRequest, sample

    return sample(loaded, strategy, SampleRequest(**CPU_RUN), backend=CpuBackend()).latent["samples"]


def diffusers_latent(loaded, plain) -> torch.Tensor:
    """The plain diffusers call, as a user would make it, in vidmem's LATENT layout."""
    run = CPU_RUN
    with torch.no_grad():
        frames = plain(
            prompt=run["prompt"], negative_prompt=run["negative_prompt"], height=run["height"], width=run["width"],
            num_frames=run["frames"], num_inference_steps=run["steps"], guidance_scale=run["cfg"],
            generator=torch.Generator("cpu").manual_seed(run["seed"]), output_type="latent",
            max_sequence_length=loaded.spec.max_sequence_length,
        ).frames
    return loaded.spec.to_comfy_latent(plain, frames, run["frames"])


@dataclass
class CpuTimes:
    seconds: dict[str, list[float]]  # wall seconds per timed run
    latents: dict[str, torch.Tensor]  # the first latent of each variant
    stable: dict[str, bool]  # the same latent in every run

    def median(self, name: str) -> float:
        return statistics.median(self.seconds[name])

    def fastest(self, name: str) -> float:
        """The least disturbed run: on a shared machine, interference only ever adds time."""
        return min(self.seconds[name])


def time_interleaved(variants: dict, runs: int) -> CpuTimes:
    """Round 0 warms up untimed; each round runs every variant once, the order rotated per round.

    After the warm-up every live object is frozen out of the garbage collector's reach, so its
    automatic passes stay short and land on no variant in particular.
    """
    names = list(variants)
    result = CpuTimes({name: [] for name in names}, {}, dict.fromkeys(names, True))
    for round_ in range(runs + 1):
        if round_ == 1:
            gc.collect()
            gc.freeze()
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            latent = variants[name]()
            elapsed = time.perf_counter() - start
            if round_:
                result.seconds[name].append(elapsed)
            result.stable[name] &= torch.equal(result.latents.setdefault(name, latent), latent)
    gc.unfreeze()
    return result


def time_cpu(changes: dict, runs: int) -> CpuTimes:
    """Every tier, tier none again as a control, and the plain diffusers call, on one pipeline
    whose transformer is Wan 2.1 1.3B's with `changes`."""
    import diffusers

    config = dict(transformer_config("wan2.1-t2v-1.3b")[1], **changes)
    print(f"  timing a Wan transformer of width {config['num_attention_heads'] * config['attention_head_dim']}, "
          f"{config['num_layers']} blocks: {runs} rounds after a warm-up", flush=True)
    loaded = build_pipeline(config)
    plain = diffusers.WanPipeline(**loaded.pipe.components)  # the same modules, no vidmem subclass
    plain.set_progress_bar_config(disable=True)
    variants = {name: partial(vidmem_latent, loaded, s) for name, s in cpu_tiers(config["num_layers"]).items()}
    variants[CONTROL] = variants["none"]
    variants["diffusers"] = partial(diffusers_latent, loaded, plain)
    return time_interleaved(variants, runs)


def evidence(times: CpuTimes) -> tuple[dict, dict]:
    """The `cpu` and `sampler_vs_diffusers` entries: wall-time medians, bit-equality with tier none."""
    reference, none = times.latents["none"], times.median("none")
    equal = lambda name: times.stable[name] and times.stable["none"] and torch.equal(times.latents[name], reference)  # noqa: E731
    tiers = [name for name in times.seconds if name not in (CONTROL, "diffusers")]
    cpu = {name: {"ratio_vs_none": times.median(name) / none, "bitwise_equal": equal(name)} for name in tiers}
    sampler = {"ratio": none / times.median("diffusers"), "bitwise_equal": equal("diffusers")}
    return cpu, sampler
