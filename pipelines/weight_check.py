"""Refuse a config that cannot be loaded from the config alone, before anything is allocated.

A config.json with a typo in a size (ffn_dim 2**40) would otherwise reach the allocator as a
100 TB request, or fail deep inside diffusers with a raw error. Each component is built on the
`meta` device (no memory: `configs.meta.build_meta`, as the planner does), its parameters counted,
and the count compared with what can hold them:
- weights loaded into RAM: their bytes at the load dtype against the machine's RAM and swap
  (`psutil`), the sum of all components, since every one of them stays in RAM;
- weights read from files (every file-backed load, and the disk tier that maps them in place):
  the parameter count against the elements the files really hold, so a config that does not
  describe its files is refused naming both.

    implied = implied_weights(ComponentConfig("transformer", "diffusers", "WanTransformer3DModel", config), torch.bfloat16)
    check_against_files(implied, stored_elements, "transformer/*.safetensors")
    check_against_ram([ram_need(implied), ...], "model folder '…'", "Re-download its config.json files.")
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from math import prod
from typing import Any, Mapping, Sequence

import torch

from .configs.meta import ComponentConfig, build_meta
from .family import ModelError

# A config may describe a few more parameters than its files hold (ties a class makes after
# loading, weights a class initialises itself); an absurd config describes thousands of times more.
FILE_SLACK = 2.0
BLOCK_COUNT_KEYS = ("num_layers", "num_hidden_layers")  # Wan, CogVideoX, T5 / UMT5; CLIP vision


@dataclass(frozen=True)
class ImpliedWeights:
    """What a component's config implies: its parameters, their bytes at the load dtype, its largest."""

    component: str
    source: str  # the config it was read from (a file path or a model config's name)
    numel: int
    nbytes: int
    largest: str  # "name [d0, d1]": the tensor a wrong size usually shows in
    buffer_bytes: int = 0  # tables the class computes (rotary frequencies ...): in RAM, never in files

    def describe(self) -> str:
        """Its label in a RAM refusal, which gives each part's bytes (`check_against_ram`)."""
        return f"{self.component} ({self.source}): {self.numel:,} weights, largest {self.largest}"


def implied_weights(config: ComponentConfig, dtype: torch.dtype) -> ImpliedWeights:
    """The component built on meta (nothing allocated) and its parameters counted; ModelError
    naming the config when the class refuses it.

    Classes with identical blocks are built with one and with two blocks and the difference
    extrapolated to the config's count (as the planner does): an absurd block count is refused
    in milliseconds instead of building millions of blocks, even on meta.
    """
    source = config.source or f"the {config.name} config"
    try:
        one, two = _count(build_meta(config, dtype, 1)), _count(build_meta(config, dtype, 2))
        blocks = _block_count(config.config)
        if blocks is None or two.numel == one.numel:  # no blocks capped: the whole component is small to build
            counted = _count(build_meta(config, dtype))
        else:
            extra = blocks - 1
            counted = replace(two, numel=one.numel + extra * (two.numel - one.numel),
                              nbytes=one.nbytes + extra * (two.nbytes - one.nbytes),
                              buffer_bytes=one.buffer_bytes + extra * (two.buffer_bytes - one.buffer_bytes))
    except (TypeError, ValueError, RuntimeError, AttributeError, KeyError, IndexError, AssertionError, ArithmeticError) as error:
        raise ModelError(f"{config.name}: {source} does not describe a {config.class_name} ({error}); "
                         "re-download the model's config.json.") from None
    return replace(counted, component=config.name, source=source)


def _block_count(config: dict) -> int | None:
    """The config's block count (the keys configs.meta.build_meta caps), or None."""
    value = next((config[key] for key in BLOCK_COUNT_KEYS if key in config), None)
    return value if isinstance(value, int) and value >= 1 else None


def _count(module: torch.nn.Module) -> ImpliedWeights:
    tie = getattr(module, "tie_weights", None)
    if callable(tie):
        tie()  # transformers ties embeddings after building: count a shared matrix once
    params = dict(module.named_parameters())  # named_parameters counts a tied matrix once
    name, largest = max(params.items(), key=lambda item: item[1].numel(), default=("(none)", torch.empty(0)))
    return ImpliedWeights(
        "", "", numel=sum(p.numel() for p in params.values()), nbytes=sum(p.numel() * p.element_size() for p in params.values()),
        largest=f"{name} {list(largest.shape)}", buffer_bytes=sum(b.numel() * b.element_size() for b in module.buffers()),
    )


def check_against_files(implied: ImpliedWeights, stored_numel: int, files: str) -> None:
    """ModelError when the config describes far more weights than `files` hold (FILE_SLACK)."""
    if implied.numel > FILE_SLACK * stored_numel:
        raise ModelError(
            f"{implied.component}: {implied.source} describes {implied.numel:,} weights ({implied.nbytes:,} bytes, "
            f"{_size(implied.nbytes)}; largest {implied.largest}) but {files} hold only {stored_numel:,}; the config does not belong to these weights. "
            "Re-download the config (or the whole model) so both come from the same release."
        )


def check_against_ram(needs: Sequence[tuple[str, int]], what: str, fix: str) -> None:
    """ModelError when the bytes `needs` lists ((what holds them, bytes), all held at once in
    RAM) exceed the machine's RAM and swap: such a load can never finish. The message lists every
    part with its bytes, largest first, so the user sees what to shrink."""
    import psutil

    total = sum(nbytes for _label, nbytes in needs)
    ram, swap = psutil.virtual_memory().total, psutil.swap_memory().total
    if total > ram + swap:
        parts = "; ".join(f"{_size(nbytes)} for {label}" for label, nbytes in sorted(needs, key=lambda need: -need[1]))
        raise ModelError(
            f"{what} needs {_size(total)} of RAM for its weights but this machine has {_size(ram)} of RAM and "
            f"{_size(swap)} of swap ({parts}). {fix}"
        )


def built_on_meta(config: ComponentConfig, dtype: torch.dtype) -> torch.nn.Module:
    """The whole component on meta (after `check_against_files` has refused an absurd size), tied as
    the loaders tie it: only its structure is read (which layers hold which weights)."""
    module = build_meta(config, dtype)
    tie = getattr(module, "tie_weights", None)
    if callable(tie):
        tie()
    return module


def ram_beyond_mappings(module: torch.nn.Module, tensors: Mapping[str, Any], dtype: torch.dtype,
                        weight_dtype: str) -> int:
    """The RAM `weight_storage.hold(module, tensors, dtype, weight_dtype, copy_to_ram=False)` takes beyond the
    files' mappings, counted from the tensors' headers and `module` built on meta (nothing allocated).

    Why: a file used in place costs page cache, not RAM, while what the load makes anew must fit before it
    starts. So, by the loaders' own rules: the weights weight_dtype lowers (`lowered_names`) at the format's
    bytes, and what the fill copies of the rest (`memory.storage.bytes_copied`: the casts and dequantized
    copies of tensors no layer holds stored; a stored weight a layer upcasts per call stays mapped)."""
    from ..memory.storage import bytes_copied
    from .comfy_files.build import keep_fp32
    from .weight_storage import DEFAULT_WEIGHTS, lowered_names, lowered_ram_bytes

    lowered = set(lowered_names(module, tensors, weight_dtype, dtype)) if weight_dtype != DEFAULT_WEIGHTS else set()
    rest = {name: tensor for name, tensor in tensors.items() if name not in lowered}
    copied = bytes_copied(module, rest, dtype, keep_fp32(module, dtype))
    if not lowered:
        return copied
    return copied + lowered_ram_bytes(weight_dtype, sum(prod(tensors[name].shape) for name in lowered))


def ram_need(implied: ImpliedWeights) -> tuple[str, int]:
    return implied.describe(), implied.nbytes + implied.buffer_bytes


def stored_elements(shapes) -> int:
    """The elements of tensors given by their shapes (a file's header, a StoredTensor's logical shape)."""
    return sum(prod(shape) for shape in shapes)


def _size(nbytes: int) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:,} bytes"
