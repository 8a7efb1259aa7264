"""bench/speed.py, measured part: every step cache under every tier through `sample()`, the copies
each streamed tier made (and which of them were wasted), and the interleaved wall times."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from functools import partial

import torch

from vidmem.memory import MemoryStrategy
from vidmem.pipelines.sample import SampleRequest, sample
from vidmem.pipelines.step_cache import SHIPPED_RATIOS, StepCache

from .blockswap_cpu import CpuTimes, build_pipeline, time_interleaved
from .blockswap_modelled import transformer_config

MODEL = "wan2.1-t2v-1.3b"
# The transformers whose widths a CUDA run may take (`--model`): Wan 2.1 T2V's two, the shapes issue 24's goal
# names. Their shipped configs (pipelines/configs/models) are the one declaration of those widths.
WIDTH_MODELS = ("wan2.1-t2v-1.3b", "wan2.1-t2v-14b")
PUBLISHED = "Wan 2.1 T2V 1.3B"  # the label of its entry in pipelines/configs/mag_ratios.json
UNCACHED = "off"
CONTROL = "off (control)"  # the uncached call timed a second time: the noise floor of a time ratio


@dataclass(frozen=True)
class SpeedConfig:
    """One bench run: the transformer (`model`'s, `blocks` deep; `heads` x `head_dim` wide unless `real_widths`),
    the call, and what is timed."""

    steps: int = 50
    blocks: int = 30
    heads: int = 2
    head_dim: int = 32
    ffn: int = 256
    width: int = 64
    height: int = 64
    frames: int = 5
    cfg: float = 5.0  # > 1: two transformer passes per step (cond and uncond), as the real sampler runs
    device: str = "cpu"
    runs: int = 5  # timed interleaved rounds, after one untimed warm-up round
    time_tiers: tuple[str, ...] = ("none",)
    fbc_bold: float = 0.1  # First Block Cache's bolder threshold (diffusers' default is 0.05)
    real_widths: bool = False  # the model's own widths (the 1.3B's 12 x 128, ffn 8960): `--device cuda`
    model: str = MODEL  # one of WIDTH_MODELS: whose config (and, with real_widths, widths) the blocks have
    prompt: str = "a cat and a dog dance"
    seed: int = 0

    def transformer(self) -> dict:
        widths = {} if self.real_widths else dict(num_attention_heads=self.heads, attention_head_dim=self.head_dim,
                                                  ffn_dim=self.ffn)
        # text_dim 32: the tiny text encoder's width
        return dict(transformer_config(self.model)[1], num_layers=self.blocks, text_dim=32, **widths)

    def request(self, cache: StepCache) -> SampleRequest:
        return SampleRequest(self.prompt, "", self.width, self.height, self.frames, self.steps, self.cfg,
                             seed=self.seed, cache=cache)

    def describe(self) -> dict:
        config = self.transformer()
        width = config["num_attention_heads"] * config["attention_head_dim"]
        return {"model": self.model, "steps": self.steps, "blocks": self.blocks, "width": width,
                "ffn": config["ffn_dim"], "video": f"{self.width}x{self.height}x{self.frames}", "cfg": self.cfg, "device": self.device,
                "runs": self.runs, "time_tiers": list(self.time_tiers), "passes_per_step": 2 if self.cfg > 1 else 1}


def published_entry() -> dict:
    entries = json.loads(SHIPPED_RATIOS.read_text(encoding="utf-8"))["models"]
    return next(e for e in entries if e["label"] == PUBLISHED)


def methods(config: SpeedConfig) -> dict[str, StepCache]:
    """The uncached run, MagCache with the published Wan 2.1 1.3B ratios at their published
    threshold, K and retention, First Block Cache at its default and a bolder threshold, and
    TaylorSeer at diffusers' defaults (its steps computed are step arithmetic: the real ones).

    The ratios are given directly (`expert_ratios`): the random model's layout key differs from the
    1.3B's, so 'auto' would not find them. At another step count they are stretched (nearest
    neighbour, as MagCache's authors do; `ratio_steps=0`), so MagCache then skips differently."""
    entry = published_entry()
    ratios = tuple((name, tuple(values)) for name, values in entry["ratios"].items())
    mag = StepCache("mag_cache", threshold=entry["threshold"], retention=entry["retention"],
                    max_skip_steps=entry["max_skip_steps"], expert_ratios=ratios,
                    ratio_steps=entry["steps"] if entry["steps"] == config.steps else 0,
                    ratio_source=f"published ({entry['source']})")
    return {UNCACHED: StepCache(), "mag_cache": mag, "first_block_cache": StepCache("first_block_cache"),
            "first_block_cache_bold": StepCache("first_block_cache", threshold=config.fbc_bold),
            "taylor_seer": StepCache("taylor_seer")}  # diffusers' defaults: interval 5, warm-up 3, order 1


def tiers(blocks: int) -> dict[str, MemoryStrategy]:
    """none, block_swap of half the blocks and of all of them, sequential (prefetch 1, the default)."""
    found = {"none": MemoryStrategy(offload="none")}
    for n in sorted({max(1, blocks // 2), blocks}):
        found[f"block_swap_{n}"] = MemoryStrategy(offload="block_swap", blocks_to_swap=n)
    found["sequential"] = MemoryStrategy(offload="sequential")
    return found


def build(config: SpeedConfig):
    """The tiny Wan pipeline around a random Wan 2.1 1.3B-shaped transformer (bf16 on CUDA)."""
    loaded = build_pipeline(config.transformer())
    if config.device != "cpu":
        _to_bf16(loaded.pipe.transformer)
        loaded = type(loaded)(loaded.pipe, loaded.spec, loaded.class_name, loaded.source, "bf16")
    return loaded


def _to_bf16(transformer: torch.nn.Module) -> None:
    """bf16, except what the class keeps in fp32 (as `from_pretrained(torch_dtype=bfloat16)` loads it)."""
    keep = set(getattr(transformer, "_keep_in_fp32_modules", None) or ())
    for name, tensor in [*transformer.named_parameters(), *transformer.named_buffers()]:
        if tensor.is_floating_point() and not keep & set(name.split(".")):
            tensor.data = tensor.data.to(torch.bfloat16)


# --- copies, and which were wasted ------------------------------------------------------------------


class CopyAudit:
    """Counts the streamed copies of one call (the engine's observer) and which were wasted: a
    copy is used once a leaf module inside its group computes, wasted if the group is evicted (or
    the call ends) first. Forward hooks on every leaf give "computes": a block a step cache skips
    is called, but its leaves are not.

    Wasted copies by where they land: `head_block` (a denoiser's first block, or a leaf of it: the
    block that decides is copied, then MagCache skips it), `other` (under sequential, the leaf
    prefetched into a block its pass then skips, and a component's wrap-around prefetch after its
    last use), `at_end` (prefetched for a pass after the call's last)."""

    def __init__(self, pipe) -> None:
        self.copies = 0
        self.wasted = {"head_block": 0, "other": 0, "at_end": 0}
        self._pending: dict[str, bool] = {}
        self._heads: set[str] = set()
        self._hooks = []
        for component, module in pipe.components.items():
            if not isinstance(module, torch.nn.Module):
                continue
            if hasattr(module, "blocks"):
                self._heads.add(f"{component}.blocks.0")
            for name, leaf in module.named_modules():
                if next(leaf.children(), None) is None:
                    parts = f"{component}.{name}".split(".")
                    prefixes = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
                    self._hooks.append(leaf.register_forward_hook(partial(self._used, prefixes)))

    def observe(self, kind: str, group) -> None:
        if not group.streamed:
            return
        if kind in ("onload", "prefetch"):
            self.copies += 1
            self._pending[group.name] = True
        elif kind == "evict" and self._pending.pop(group.name, False):
            head = any(group.name == h or group.name.startswith(h + ".") for h in self._heads)
            self.wasted["head_block" if head else "other"] += 1

    def _used(self, prefixes: list[str], module, args, out) -> None:
        for prefix in prefixes:
            if self._pending.get(prefix):
                self._pending[prefix] = False

    def finish(self) -> dict:
        """Remove the hooks; copies never used before the call ended count as wasted `at_end`."""
        for hook in self._hooks:
            hook.remove()
        self.wasted["at_end"] = sum(self._pending.values())
        return {"copies": self.copies, "wasted": dict(self.wasted), "wasted_total": sum(self.wasted.values())}


@dataclass
class Call:
    latent: torch.Tensor
    receipt: dict
    seconds: float
    audit: dict = field(default_factory=dict)


def call(loaded, config: SpeedConfig, strategy: MemoryStrategy, cache: StepCache, audit: bool = False) -> Call:
    """One `sample()` call on the real path for the device (CudaBackend on CUDA). Each call starts
    cold: device copies a previous call left (warm runs) would change what this one copies."""
    loaded.release_warm()
    auditor = CopyAudit(loaded.pipe) if audit else None
    start = time.perf_counter()
    try:
        result = sample(loaded, strategy, config.request(cache), device=torch.device(config.device),
                        observer=auditor.observe if auditor else None)
    finally:
        found = auditor.finish() if auditor else {}
    return Call(result.latent["samples"], result.receipt, time.perf_counter() - start, found)


def count_pass(loaded, config: SpeedConfig, log=print) -> dict[str, dict[str, Call]]:
    """method -> tier -> its call, with the copies audited: the counts, latents and receipts."""
    calls: dict[str, dict[str, Call]] = {}
    for method, cache in methods(config).items():
        calls[method] = {}
        for tier, strategy in tiers(config.blocks).items():
            calls[method][tier] = done = call(loaded, config, strategy, cache, audit=True)
            log(f"  {method:<24} {tier:<14} {done.seconds:7.2f} s  copies {done.audit['copies']}")
    return calls


def time_pass(loaded, config: SpeedConfig) -> CpuTimes:
    """Every method under each timed tier (the uncached call twice), rounds interleaved."""
    strategies = tiers(config.blocks)
    variants = {}
    for tier in config.time_tiers:
        for method, cache in methods(config).items():
            variants[f"{method}@{tier}"] = partial(_latent, loaded, config, strategies[tier], cache)
        variants[f"{CONTROL}@{tier}"] = variants[f"{UNCACHED}@{tier}"]
    return time_interleaved(variants, config.runs)


def _latent(loaded, config: SpeedConfig, strategy: MemoryStrategy, cache: StepCache) -> torch.Tensor:
    return call(loaded, config, strategy, cache).latent


def psnr_db(reference: torch.Tensor, other: torch.Tensor) -> float | None:
    """PSNR over the reference's value range; None when the two are equal (infinite)."""
    reference, other = reference.double(), other.double()
    mse = torch.mean((reference - other) ** 2).item()
    if mse == 0:
        return None
    peak = (reference.max() - reference.min()).item()
    return 10 * math.log10(peak * peak / mse)
