"""bench/speed.py, fp8 matmul part (issue 24, part 3): the same sampler with the transformer's
linear layers stored in fp8 (scaled, as Comfy-Org's files), once multiplying in fp8
(`torch._scaled_mm`, fp8_matmul 'on') and once upcasting each weight first (fp8_matmul 'off', the
path every tier took before), under every tier of speed_runs.tiers.

Per tier: psnr_db of the fp8 latent against the upcast latent (the quality cost of quantizing
activations to e4m3fn; the weights are the same stored bytes in both) and, for the timed tiers,
time_ratio = median fp8 wall time / median upcast wall time, rounds interleaved. Top level: the
worst tier's psnr_db and the first timed tier's time_ratio, whether the fp8 latents are bitwise
equal across tiers, and the fp8 receipt of tier none (layers in fp8, fallbacks). `layers`: each
distinct linear shape of the transformer timed alone (forward only) at the call's token count.

Caveats: torch's CPU kernel for _scaled_mm is an emulation, so a CPU time_ratio says nothing about
a GPU; random weights and activations are not a real model's (real activations have outliers,
which a per-tensor scale handles worse), so psnr_db here bounds nothing for real frames.
"""

from __future__ import annotations

import copy
import statistics
import time
from functools import partial

import torch
from accelerate import init_empty_weights

from vidmem.memory import MemoryStrategy
from vidmem.memory.storage import FORMATS, StoredLinear, assign_weights, quantize
from vidmem.memory.storage.fp8_matmul import fp8_matmul_for_call
from vidmem.pipelines.loader import LoadedPipeline
from vidmem.pipelines.step_cache import StepCache

from .blockswap_cpu import time_interleaved
from .speed_runs import SpeedConfig, call, psnr_db, tiers

FORMAT = "fp8_scaled"
CHOICES = {"upcast": "off", "fp8": "on"}


def fp8_rows(loaded: LoadedPipeline, config: SpeedConfig, fmt: str = FORMAT, log=print) -> dict:
    """{"time_ratio", "psnr_db", ...}: fp8 matmul against the upcast path on `loaded` with its
    transformer stored in `fmt`, per tier of `config` (module docstring)."""
    stored = with_stored_transformer(loaded, fmt)
    strategies = tiers(config.blocks)
    latents: dict[str, dict[str, torch.Tensor]] = {}
    receipts = {}
    for tier, strategy in strategies.items():
        latents[tier] = {}
        latents[tier]["upcast"], _ = _sample(stored, config, strategy, CHOICES["upcast"])
        latents[tier]["fp8"], receipts[tier] = _sample(stored, config, strategy, CHOICES["fp8"])
    per_tier = {tier: {"psnr_db": _rounded(psnr_db(found["upcast"], found["fp8"]))} for tier, found in latents.items()}
    for tier, row in per_tier.items():
        log(f"  fp8 matmul {tier:<14} psnr {row['psnr_db']} dB against the upcast path")
    for tier, ratio in _time_ratios(stored, config, strategies).items():
        per_tier[tier]["time_ratio"] = ratio
    first_fp8 = latents["none"]["fp8"]
    psnrs = [row["psnr_db"] for row in per_tier.values() if row["psnr_db"] is not None]
    return {
        "format": fmt,
        "time_ratio": next((row["time_ratio"] for row in per_tier.values() if "time_ratio" in row), None),
        "psnr_db": min(psnrs) if psnrs else None,
        "tiers_bitwise_equal": all(torch.equal(found["fp8"], first_fp8) for found in latents.values()),
        "tiers": per_tier,
        "receipt": receipts["none"],
        "layers": layer_times(stored.pipe.transformer, _tokens(stored, config), config),
    }


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def with_stored_transformer(loaded: LoadedPipeline, fmt: str) -> LoadedPipeline:
    """`loaded` with its transformer rebuilt holding its linear weights stored in `fmt` (the
    layers FORMATS[fmt] declares it lowers, as a loader would); every other component shared."""
    pipe = loaded.pipe
    transformer = stored_copy(pipe.transformer, fmt, pipe.transformer.dtype)
    new = type(pipe)(**{**pipe.components, "transformer": transformer})
    new.set_progress_bar_config(disable=True)
    return LoadedPipeline(new, loaded.spec, loaded.class_name, f"{loaded.source}, transformer {fmt}", loaded.dtype_name,
                          storage={"transformer": fmt})


def stored_copy(module: torch.nn.Module, fmt: str, compute_dtype: torch.dtype) -> torch.nn.Module:
    """A new `module` of the same class and config whose lowered weights are `fmt` StoredTensors
    (quantized from `module`'s), built empty and filled by the storage engine's assign_weights."""
    lowers = {f"{name}.weight" for name, layer in module.named_modules() if FORMATS[fmt].lowers(layer)}
    tensors = {name: quantize(t, fmt) if name in lowers else t for name, t in module.state_dict().items()}
    with init_empty_weights():  # parameters on meta, computed buffers (rotary tables) real
        empty = type(module).from_config(module.config)
    keep = getattr(module, "_keep_in_fp32_modules", None) or ()
    assign_weights(empty, tensors, compute_dtype, keep_fp32=keep, source=f"{type(module).__name__} in {fmt}")
    return empty.eval()


def _sample(stored: LoadedPipeline, config: SpeedConfig, strategy: MemoryStrategy, choice: str):
    with fp8_matmul_for_call({"transformer": stored.pipe.transformer}, choice, config.device) as fp8:
        latent = call(stored, config, strategy, StepCache()).latent
    return latent, fp8.as_dict()


def _time_ratios(stored: LoadedPipeline, config: SpeedConfig, strategies: dict) -> dict[str, float]:
    variants = {}
    for tier in config.time_tiers:
        for label, choice in CHOICES.items():
            variants[f"{label}@{tier}"] = partial(lambda s, c: _sample(stored, config, s, c)[0], strategies[tier], choice)
    if not variants:
        return {}
    times = time_interleaved(variants, config.runs)
    return {tier: round(times.median(f"fp8@{tier}") / times.median(f"upcast@{tier}"), 3) for tier in config.time_tiers}


def _tokens(stored: LoadedPipeline, config: SpeedConfig) -> int:
    """Tokens one transformer pass multiplies: latent frames x latent pixels / patch area."""
    pipe = stored.pipe
    frames = (config.frames - 1) // pipe.vae_scale_factor_temporal + 1
    scale = pipe.vae_scale_factor_spatial
    pt, ph, pw = pipe.transformer.config.patch_size
    return frames // pt * (config.height // scale // ph) * (config.width // scale // pw)


def layer_times(transformer: torch.nn.Module, tokens: int, config: SpeedConfig, runs: int = 5) -> dict[str, dict]:
    """Each distinct (in, out) StoredLinear shape of `transformer`'s blocks, forward alone on `tokens` rows
    of random input: median seconds upcast and fp8, and their ratio. Only the repeated blocks' layers: the
    others (Wan's condition embedder) run on one row, some kept in float32, and would say nothing at `tokens`."""
    shapes = {}
    for name, layer in transformer.named_modules():
        if isinstance(layer, StoredLinear) and name.startswith("blocks."):
            shapes.setdefault(f"{layer.in_features}->{layer.out_features}", (name, layer))
    found = {}
    for shape, (name, layer) in shapes.items():
        layer = copy.deepcopy(layer).to(config.device)  # resident, as under tier none: no copy timed
        x = torch.randn(tokens, layer.in_features, device=config.device, dtype=layer.compute_dtype)
        seconds = {label: _median_seconds(layer, x, choice, config, runs) for label, choice in CHOICES.items()}
        found[shape] = {"example": name, "tokens": tokens, **{f"{k}_s": round(v, 6) for k, v in seconds.items()},
                        "time_ratio": round(seconds["fp8"] / seconds["upcast"], 3)}
    return found


def _median_seconds(layer: StoredLinear, x: torch.Tensor, choice: str, config: SpeedConfig, runs: int) -> float:
    cuda = x.device.type == "cuda"
    seconds = []
    with torch.no_grad(), fp8_matmul_for_call({"layer": layer}, choice, config.device):
        for round_ in range(runs + 1):  # round 0 warms up
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            layer(x)
            if cuda:
                torch.cuda.synchronize()
            if round_:
                seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)
