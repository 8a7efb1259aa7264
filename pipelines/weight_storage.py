"""How a loader holds weights: as the files store them, or lowered to a narrower storage format.

One place for both loaders, Load Video Model Files (ComfyUI's single files) and Load Video
Pipeline (diffusers folders): `weight_dtype` lowers the transformer(s) and the text encoder
(`LOWERED`; never the VAE or the image encoder, small and sensitive), and within them the tensors
the format itself declares (`StorageFormat.lowers`, which the planner reads too: linear weights,
token embeddings only for formats that store them narrow). It never raises precision: a tensor
stored at or below the target's bytes per weight stays as the file holds it.

Lowered weights are new memory (quantized at load, anonymous RAM). Every other tensor is given
to the model where the file's mapping holds it (the disk tier: page cache, read as needed), or
copied into RAM first when the loader is told to (`copy_to_ram`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping

import torch

from ..memory.storage import (FORMATS, StorageReport, StoredTensor, is_file_backed, lowered_weights, quantize,
                              storage_format)
from .family import ModelError

DEFAULT_WEIGHTS = "default"  # as the files store them
WEIGHT_DTYPES = (DEFAULT_WEIGHTS, *FORMATS)  # the loaders' weight_dtype choices
LOWERED = ("transformer", "transformer_2", "text_encoder")  # components whose weights weight_dtype lowers


def check_weight_dtype(value: str) -> None:
    if value not in WEIGHT_DTYPES:
        raise ModelError(f"weight_dtype='{value}' is not a storage format; use {DEFAULT_WEIGHTS} or one of "
                         f"{', '.join(FORMATS)}.")


def held_format(stored: str, weight_dtype: str) -> str:
    """The format a component stored as `stored` is held in: `weight_dtype` when it is narrower."""
    if weight_dtype == DEFAULT_WEIGHTS or stored not in FORMATS:
        return stored
    narrower = storage_format(weight_dtype).bytes_per_weight < storage_format(stored).bytes_per_weight
    return weight_dtype if narrower else stored


def lower_storage(module: torch.nn.Module, tensors: Mapping[str, Any], target: str, dtype: torch.dtype) -> dict[str, Any]:
    """The tensors the format `target` lowers in `module` (`lowered_weights`: the format's declaration, of
    the weights the model can hold stored, as the planner counts them) quantized to it when stored wider;
    every other tensor as given (same objects), so a tied or custom token table (Gemma's) is never rounded
    for nothing (a weight the model cannot hold stored would be dequantized again at load). `quantize` goes
    a row chunk at a time, a stored source (an fp8 or GGUF file lowered further) dequantized chunk by chunk
    too: the transient is one chunk's. Not so for a stored source whose rows cannot be taken apart (a GGUF
    tensor flattened before quantizing, or a per-row scale on a tensor of more than 2 dimensions:
    `memory.storage.quantize`'s `_stored_matrix`): it is dequantized in one pass, a float32 copy of the
    whole tensor for the moment it is quantized."""
    fmt = storage_format(target)
    lowered = dict(tensors)
    for name in lowered_names(module, tensors, target, dtype):
        lowered[name] = quantize(tensors[name], fmt)
    return lowered


def lowered_names(module: torch.nn.Module, tensors: Mapping[str, Any], target: str, dtype: torch.dtype) -> list[str]:
    """The names in `tensors` that `lower_storage` quantizes to `target`: the format's weights of `module`
    (`lowered_weights`) stored wider than it, less those the model keeps in float32 computing in `dtype` (a bf16
    folder's fp32 time embedder stays as its files hold it). `module` may be built on meta: only its structure is
    read, so a RAM check can count them from a file's header before anything is built."""
    from .comfy_files.build import kept_in_fp32  # imports the loader, which imports this module lazily

    fmt = storage_format(target)
    names = lowered_weights(module, fmt, kept_in_fp32(module, dtype))
    wider = (name for name, tensor in tensors.items() if _bytes_per_weight(tensor) > fmt.bytes_per_weight)
    return [name for name in wider if name in names]


def _bytes_per_weight(tensor) -> float:
    if isinstance(tensor, StoredTensor):
        return tensor.format.bytes_per_weight
    return tensor.element_size()


def in_ram(tensors: Mapping[str, Any]) -> dict[str, Any]:
    """Every tensor copied out of its file mapping into process memory; those already there (quantized at load)
    as they are: a second copy would be RAM the load's check never counted (a 14B model's lowered weights)."""
    def copy(t):
        if isinstance(t, StoredTensor):
            if not is_file_backed(t.data):
                return t
            # replace(): every other field (the file's full-precision request, say) comes along
            return replace(t, data=t.data.clone(), scale=None if t.scale is None else t.scale.clone())
        return t.clone() if is_file_backed(t) else t

    return {name: copy(t) for name, t in tensors.items()}


def hold(module: torch.nn.Module, tensors: Mapping[str, Any], dtype: torch.dtype, weight_dtype: str,
         copy_to_ram: bool, source: str) -> tuple[StorageReport, str]:
    """`module` (built empty) given `tensors`: lowered to `weight_dtype` (DEFAULT_WEIGHTS: as they
    are), copied into RAM or left in their mappings, computing in `dtype`. Returns the report and
    the format its matrices are held in (what receipts show and the planner budgets: the truth,
    so a GGUF choice no row of the model can take leaves the files' format)."""
    from .comfy_files.build import fill  # imports the loader, which imports this module lazily
    from .comfy_files.detect import storage_name

    if weight_dtype != DEFAULT_WEIGHTS:
        tensors = lower_storage(module, tensors, weight_dtype, dtype)
    if copy_to_ram:
        tensors = in_ram(tensors)
    return fill(module, tensors, dtype, source), storage_name(tensors)


def matrices_mapped(module: torch.nn.Module) -> bool:
    """Whether every linear / embedding weight of `module` still lies in a file mapping (the disk
    tier holds only then: weights re-stored at load live in RAM)."""
    for layer in module.modules():
        stored = getattr(layer, "weight_stored", None)
        matrix = stored if stored is not None else getattr(layer, "weight", None)
        if isinstance(layer, (torch.nn.Linear, torch.nn.Embedding)) or stored is not None:
            if not is_file_backed(matrix):
                return False
    return True


def lowered_ram_bytes(weight_dtype: str, elements: int) -> int:
    """RAM a component of `elements` weights takes once lowered to `weight_dtype` (all of it counted
    at the format: an upper bound, as only what the format holds is lowered)."""
    return FORMATS[weight_dtype].stored_bytes(elements)
