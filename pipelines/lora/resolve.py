"""A LoRA file's raw layers -> canonical layers on one model: module path, down, up, alpha, deltas.

Canonical form (`ResolvedLayer`): the diffusers module path (`blocks.3.attn1.to_q`), down
[rank, in], up [out, rank], alpha (None: alpha = rank, the diffusers/PEFT convention), whether
the rank enters the scale as sqrt(rank) (PEFT's use_rslora), and optional
full weight / bias deltas (`diff`, `diff_b`, as lightx2v's distill LoRAs carry). Every key of the
file ends up either applied or in `skipped` with its reason; nothing is dropped silently.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import torch
from torch import nn

from ...memory.lora import LoraError, LoraPatch, check_fits
from .names import ModelNames
from .read import LoraFile, RawLayer

APPLIED_KINDS = ("down", "up", "up_bias", "diff", "diff_b")
FORMATS_READ = (
    "diffusers/PEFT (`transformer.blocks.0.attn1.to_q.lora_A.weight`), ComfyUI/kohya (`lora_unet_blocks_0_self_attn_q"
    ".lora_down.weight` + `.alpha`, `diffusion_model.blocks.0.self_attn.q.lora_down.weight`), original Wan / "
    "lightx2v / musubi names (`blocks.0.self_attn.q`, `.diff`, `.diff_b`), LTX-2's own (`diffusion_model.adaln_single.linear`), "
    "HunyuanVideo 1.5's own (`double_blocks.0.img_attn_q`)"
)


@dataclass(frozen=True)
class ResolvedLayer:
    module: str  # path inside the denoiser, diffusers naming
    tensors: Mapping[str, torch.Tensor]  # down [r, in], up [out, r], up_bias [out], diff [out, in], diff_b [out]
    alpha: float | None
    rslora: bool = False  # PEFT's use_rslora: scale alpha / sqrt(rank)

    @property
    def rank(self) -> int | None:
        down = self.tensors.get("down")
        return None if down is None else down.shape[0]

    def lowrank_scale(self, strength: float) -> float:
        """strength x alpha / rank (kohya and PEFT), alpha / sqrt(rank) under rsLoRA (PEFT's `scaling`);
        alpha = rank when the file gives none (scale 1 for a plain LoRA)."""
        if self.alpha is None and not self.rslora:
            return strength  # exactly, not strength x rank / rank rounded
        alpha = self.rank if self.alpha is None else self.alpha
        return strength * alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    def patches(self, module: nn.Module, strength: float, name: str) -> list[LoraPatch]:
        """Engine patches: the low-rank term scaled by alpha/rank, the deltas by strength alone."""
        t = self.tensors
        found = []
        if "down" in t:
            found.append(LoraPatch(module, self.lowrank_scale(strength), down=t["down"], up=t["up"],
                                   diff_b=t.get("up_bias"), name=name))
        if "diff" in t or "diff_b" in t:
            found.append(LoraPatch(module, strength, diff=t.get("diff"), diff_b=t.get("diff_b"), name=name))
        return found


def resolve_layers(lora: LoraFile, model: nn.Module) -> tuple[tuple[ResolvedLayer, ...], str, tuple[str, ...]]:
    """(applied layers, the naming the file uses, skipped keys with reasons) for `model`."""
    names = ModelNames(model)
    targets, naming = names.resolve(lora.layers)
    skipped = [f"{key}: not a LoRA tensor vidmem reads (LoHa and LoKr are not supported)" for key in lora.unknown_keys]
    layers, owner = [], {}
    for source, raw in lora.layers.items():
        target = targets.get(source)
        if target is None:
            skipped += [f"{key}: no layer '{source}' in this {type(model).__name__} ({naming} naming)" for key in raw.keys]
            continue
        parts = (target,) if isinstance(target, str) else target  # several: a fused layer of the original
        for part in parts:
            if part in owner:
                raise LoraError(f"LoRA file {lora.path}: '{owner[part]}' and '{source}' both target {part}; the file mixes two LoRAs. Split it or re-save it.")
            owner[part] = source
        modules = [names.modules.get(part) for part in parts]
        if not all(_is_linear(module) for module in modules):
            shown = " + ".join(parts)  # a fused layer's parts, or the one target
            skipped += [f"{key}: {shown} is not a linear layer{_delta_note(raw)}; vidmem applies LoRAs to linear layers only" for key in raw.keys]
            continue
        pieces = [raw] if len(parts) == 1 else _split_rows(lora, raw, parts, modules)
        layers += [_canonical(lora, piece, part, module) for piece, part, module in zip(pieces, parts, modules)]
    if not layers:
        raise LoraError(
            f"LoRA file {lora.path}: none of its {sum(len(r.keys) for r in lora.layers.values()) + len(lora.unknown_keys)} keys "
            f"apply to this {type(model).__name__} (e.g. {'; '.join(skipped[:3]) or ', '.join(_examples(lora))}). It is a LoRA for another "
            f"model family, or in a format vidmem does not read; formats read: {FORMATS_READ}."
        )
    return tuple(layers), naming, tuple(skipped)


def _canonical(lora: LoraFile, raw: RawLayer, target: str, module: nn.Module) -> ResolvedLayer:
    t = {kind: raw.tensors[kind] for kind in APPLIED_KINDS if kind in raw.tensors}
    if ("down" in t) != ("up" in t):
        missing = "up (lora_B/lora_up)" if "down" in t else "down (lora_A/lora_down)"
        raise LoraError(f"LoRA file {lora.path}: layer '{raw.source}' has no {missing} matrix; the file is incomplete. Download it again.")
    if not t:
        raise LoraError(f"LoRA file {lora.path}: layer '{raw.source}' has an alpha but no matrices; the file is incomplete.")
    # a matrix that is not 2-D is check_fits' to refuse (with both shapes); here only an empty rank
    if "down" in t and t["down"].dim() == t["up"].dim() == 2 and 0 in (t["down"].shape[0], t["up"].shape[-1]):
        raise LoraError(f"LoRA file {lora.path}: layer '{raw.source}' has rank 0 (down {list(t['down'].shape)}, up "
                        f"{list(t['up'].shape)}): it changes nothing and its alpha / rank is undefined. The file is "
                        "damaged or was saved empty; use another file.")
    try:
        check_fits(module, target, t.get("down"), t.get("up"), t.get("diff"), t.get("diff_b"))
        if "up_bias" in t:
            check_fits(module, target, None, None, None, t["up_bias"])
    except LoraError as error:
        raise LoraError(f"LoRA file {lora.path}: {error}") from None
    return ResolvedLayer(target, t, _alpha(lora, raw, target), lora.rslora)


def _split_rows(lora: LoraFile, raw: RawLayer, parts: tuple[str, ...], modules: list[nn.Module]) -> list[RawLayer]:
    """A fused layer's LoRA as one per diffusers layer: the output rows (up, its bias, the deltas) split
    in the order of `parts`, the input side (down, alpha) the same for each. Views, never copies;
    each part gets its own tensor objects, since the engine attaches them to each layer as buffers."""
    sizes = [module.out_features for module in modules]
    split = {}
    for kind, tensor in raw.tensors.items():
        if kind in ("up", "up_bias", "diff", "diff_b"):
            if tensor.shape[0] != sum(sizes):
                raise LoraError(
                    f"LoRA file {lora.path}: layer '{raw.source}' has {tensor.shape[0]} output rows ({kind}); it is "
                    f"{' + '.join(parts)} fused, {sum(sizes)} rows in this model. The LoRA is for another model size."
                )
            split[kind] = torch.split(tensor, sizes)
        else:
            split[kind] = [tensor.view_as(tensor) for _ in parts]
    return [RawLayer(raw.source, {kind: pieces[i] for kind, pieces in split.items()}, raw.keys) for i in range(len(parts))]


def _alpha(lora: LoraFile, raw: RawLayer, target: str) -> float | None:
    if "alpha" in raw.tensors:
        return _alpha_tensor(lora, raw)
    for pattern, alpha in lora.peft_alphas.items():  # PEFT alpha_pattern: a module-name suffix
        if pattern and (target == pattern or target.endswith("." + pattern)):
            return alpha
    return lora.peft_alphas.get("")


def _alpha_tensor(lora: LoraFile, raw: RawLayer) -> float | None:
    """The one finite number an `.alpha` tensor must hold; anything else is named here, at load, not
    at the sampler (where a NaN scale would read as a bad strength). None from a header-only file."""
    tensor = raw.tensors["alpha"]
    key = next((k for k in raw.keys if k.endswith(".alpha")), f"{raw.source}.alpha")
    if tensor.numel() != 1:
        raise LoraError(f"LoRA file {lora.path}: '{key}' holds {tensor.numel()} values (shape {list(tensor.shape)}); an "
                        "alpha is one number. The file is malformed; re-save it with a scalar alpha or use another file.")
    if tensor.is_meta:  # a header-only file (read_lora_file): planned for its bytes, its scale never applied
        return None
    value = float(tensor.float().reshape(-1)[0])
    if not math.isfinite(value):
        raise LoraError(f"LoRA file {lora.path}: '{key}' is {value}, not a finite number; the file is damaged or was "
                        "saved from a diverged training run. Use another file.")
    return value


def _is_linear(module: nn.Module | None) -> bool:
    return module is not None and hasattr(module, "in_features") and hasattr(module, "out_features")


def _delta_note(raw: RawLayer) -> str:
    """For deltas on norms/modulation (lightx2v ships many, mostly zeros): say whether they are zero."""
    deltas = [raw.tensors[k] for k in ("diff", "diff_b") if k in raw.tensors]
    if not deltas or any(d.is_meta for d in deltas):  # a header-only file: the values are not read
        return ""
    largest = max(float(d.float().abs().max()) if d.numel() else 0.0 for d in deltas)
    return " (its delta is all zeros)" if largest == 0 else f" (its delta reaches {largest:.3g}, so the result will differ from tools that apply it)"


def _examples(lora: LoraFile) -> list[str]:
    keys = [k for raw in lora.layers.values() for k in raw.keys] + list(lora.unknown_keys)
    return keys[:3] + ([f"... {len(keys) - 3} more"] if len(keys) > 3 else [])
