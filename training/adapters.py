"""Trainable LoRA layers beside a frozen denoiser: `out += scale * up(down(x))`, as memory.lora applies them.

Why the trainable tensors are NOT buffers on the target layers (memory.lora puts inference LoRAs
there, so they stream with their block): a MemoryStrategy moves every tensor a module holds by
re-pointing it at a device copy or a pinned host copy. For a trained weight that would mean the
optimizer updates one tensor while the forward reads another (a stale pinned copy), and gradients
landing on whichever copy was current. So the LoRA parameters live in their own `nn.ModuleDict`,
outside the denoiser, on the compute device for the whole run (they are small: rank 32 on every
attention projection of Wan 14B is ~0.3 GB in fp32), and each hook closes over its layer.

The term is computed in the LoRA's own dtype (float32) and rounded once to the layer's output
dtype, as PEFT does, so gradients reach fp32 weights without a bf16 round trip.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .errors import TrainingError


class LoraLayer(nn.Module):
    """down [rank, in] and up [out, rank], float32; up starts at zero so step 0 is the base model."""

    def __init__(self, in_features: int, out_features: int, rank: int, alpha: float, generator: torch.Generator) -> None:
        super().__init__()
        down = torch.empty(rank, in_features, dtype=torch.float32)
        # PEFT's default: kaiming-uniform down (a=sqrt(5), nn.Linear's own init), zero up.
        bound = 1.0 / math.sqrt(in_features)
        down.uniform_(-bound, bound, generator=generator)
        self.down = nn.Parameter(down)
        self.up = nn.Parameter(torch.zeros(out_features, rank, dtype=torch.float32))
        self.scale = alpha / rank

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(x.to(self.down.dtype), self.down), self.up) * self.scale


@dataclass(frozen=True)
class LoraTargets:
    """Which linear layers of one denoiser get a LoRA: module paths, in model order."""

    component: str  # "transformer" or "transformer_2"
    paths: tuple[str, ...]


def find_targets(model: nn.Module, component: str, suffixes: tuple[str, ...], blocks_attr: str) -> LoraTargets:
    """Linear-like layers inside the transformer blocks whose path ends with one of `suffixes`.

    Matching is PEFT's `target_modules` rule (the name, or a dotted suffix of it), restricted to
    the blocks: the same names outside them (an embedder's `linear_1`) are not what users mean.
    """
    if not suffixes:
        raise TrainingError("target_modules is empty; give layer names such as 'to_q,to_k,to_v,to_out.0'.")
    found = []
    linear_names = set()
    for path, module in model.named_modules():
        if not path.startswith(blocks_attr + ".") or not _is_linear(module):
            continue
        linear_names.add(".".join(path.split(".")[2:]))
        if any(path == s or path.endswith("." + s) for s in suffixes):
            found.append(path)
    if not found:
        known = ", ".join(sorted(linear_names)[:12])
        raise TrainingError(f"target_modules={','.join(suffixes)} matches no linear layer in the {component}'s blocks; "
                            f"its block layers are: {known}.")
    return LoraTargets(component, tuple(found))


def build_layers(model: nn.Module, targets: LoraTargets, rank: int, alpha: float, seed: int) -> nn.ModuleDict:
    """One LoraLayer per target (keys are module paths with '.' as '/'), seeded, on the CPU."""
    check_rank(model, targets, rank)
    generator = torch.Generator("cpu").manual_seed(seed)
    layers = nn.ModuleDict()
    for path in targets.paths:
        module = model.get_submodule(path)
        layers[key_of(path)] = LoraLayer(module.in_features, module.out_features, rank, alpha, generator)
    return layers


def check_rank(model: nn.Module, targets: LoraTargets, rank: int) -> None:
    for path in targets.paths:
        module = model.get_submodule(path)
        largest = min(module.in_features, module.out_features)
        if rank > largest:
            raise TrainingError(f"rank={rank} is larger than layer {path} allows ([out, in] = "
                                f"[{module.out_features}, {module.in_features}]); use rank <= {largest}.")


def key_of(path: str) -> str:
    return path.replace(".", "/")  # ModuleDict keys may not contain dots


def path_of(key: str) -> str:
    return key.replace("/", ".")


class AttachedLora:
    """Forward hooks adding each layer's term to its target's output; `remove()` takes them off."""

    def __init__(self, model: nn.Module, layers: nn.ModuleDict) -> None:
        self._hooks = []
        try:
            for key, layer in layers.items():
                target = model.get_submodule(path_of(key))
                self._hooks.append(target.register_forward_hook(_beside_hook(layer)))
        except BaseException:
            self.remove()
            raise

    def __enter__(self) -> "AttachedLora":
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()


def _beside_hook(layer: LoraLayer):
    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return output + layer.delta(args[0]).to(output.dtype)

    return hook


def _is_linear(module: nn.Module) -> bool:
    return hasattr(module, "in_features") and hasattr(module, "out_features") and not isinstance(module, nn.ModuleList)


def trainable_bytes(layers: nn.ModuleDict) -> int:
    return sum(p.numel() * p.element_size() for p in layers.parameters())
