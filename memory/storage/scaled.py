"""fold_scaled_fp8: Comfy-Org's fp8 files read as StoredTensors.

Two layouts exist. The "scaled_fp8" one (Wan, umt5 files of 2025): `<layer>.weight` in fp8, a
float32 `<layer>.scale_weight`, a `scaled_fp8` marker tensor, sometimes `<layer>.scale_input`.
The newer quantization layout (ComfyUI's QUANTIZATION.md): `<layer>.weight_scale`,
`<layer>.input_scale`, the per-layer format in `<layer>.comfy_quant` (JSON bytes) or in the
`_quantization_metadata` header entry. Only fp8 with a per-tensor scale is read; the other
formats of that layout (int8 blockwise, NVFP4 with `weight_scale_2`, AWQ `pre_quant_scale`)
are refused by name rather than loaded wrong.

A file can ask that some layers never multiply in fp8 (ComfyUI's `full_precision_matrix_mult`,
comfy/utils.py `convert_old_quants` and comfy/ops.py): a per-layer record saying so, or, in the
older layout, a `scaled_fp8` marker of two elements (for every scaled layer under its prefix).
ComfyUI then always upcasts those layers; their StoredTensors carry `full_precision_matmul`, and
vidmem's fp8 matmul leaves them upcast too (modules.py `fp8_matmul_problem`).
"""

from __future__ import annotations

import json
from typing import Mapping

import torch

from .errors import StorageError
from .formats import FORMATS
from .stored import FP8_DTYPES, StoredTensor, stored_format_of

SCALE_SUFFIXES = ("scale_weight", "weight_scale")
MARKER = "scaled_fp8"  # a marker tensor (its dtype names the fp8 type; 2 elements: full-precision matmul), not a weight
DROPPED_SUFFIXES = ("scale_input", "input_scale")  # activation scales for fp8 matmul; upcasting ignores them
CONFIG_SUFFIX = "comfy_quant"  # per-layer JSON: {"format": ..., "full_precision_matrix_mult": true?}
HEADER_KEY = "_quantization_metadata"  # the same records in the safetensors header: {"layers": {layer: record}}
FULL_PRECISION = "full_precision_matrix_mult"
READ_FORMATS = ("float8_e4m3fn", "float8_e5m2")
UNSUPPORTED_SUFFIXES = {"weight_scale_2": "NVFP4 (double-scaled fp4)", "pre_quant_scale": "AWQ-style smoothing"}
FIX = "use an fp8 / fp8-scaled, bf16/fp16 or GGUF file of the model instead"


def fold_scaled_fp8(tensors: Mapping[str, torch.Tensor | StoredTensor],
                    metadata: Mapping[str, str] | None = None) -> dict[str, torch.Tensor | StoredTensor]:
    """`<layer>.weight` + its scale -> one StoredTensor("fp8_scaled"); unscaled fp8 weights ->
    fp8 StoredTensors; markers (prefixed ones too), activation scales and per-layer configs dropped;
    every other tensor returned as is (same objects, no copy). StorageError for formats vidmem cannot
    read. `metadata`: the safetensors header's, for its `_quantization_metadata` records. The fp8
    weights the file asks to multiply in full precision carry `full_precision_matmul`."""
    refuse_unreadable(tensors)
    scales = {_weight_of(name): (name, t) for name, t in tensors.items() if _leaf(name) in SCALE_SUFFIXES}
    orphans = [name for weight, (name, _) in scales.items() if weight not in tensors]
    if orphans:
        raise StorageError(f"scale tensors without a weight: {', '.join(orphans[:10])}; the file is damaged or in a layout vidmem does not know.")
    full = _full_precision_weights(tensors, scales, metadata)
    out: dict[str, torch.Tensor | StoredTensor] = {}
    for name, tensor in tensors.items():
        leaf = _leaf(name)
        if leaf in (MARKER, CONFIG_SUFFIX) or leaf in DROPPED_SUFFIXES or leaf in SCALE_SUFFIXES:
            continue
        out[name] = _folded(name, tensor, scales.get(name), name in full)
    return out


def _full_precision_weights(tensors: Mapping, scales: Mapping[str, tuple], metadata: Mapping[str, str] | None) -> set[str]:
    """The weights the file asks never to multiply in fp8, read as ComfyUI reads them: a layer whose
    record (`<layer>.comfy_quant`, or the header's, which ComfyUI prefers) says `full_precision_matrix_mult`;
    without header records, every scaled layer under a `scaled_fp8` marker of two elements."""
    records = {_weight_of(name): _config(name, t) for name, t in tensors.items() if _leaf(name) == CONFIG_SUFFIX}
    header = _header_records(metadata)
    records.update({f"{layer}.weight": record for layer, record in (header or {}).items()})
    full = {weight for weight, record in records.items() if isinstance(record, dict) and record.get(FULL_PRECISION)}
    if header is None:
        markers = [name[: -len(MARKER)] for name, t in tensors.items() if _leaf(name) == MARKER and t.numel() == 2]
        full.update(weight for weight in scales for prefix in markers if weight.startswith(prefix))
    return full


def merged_header_records(metadatas: list[Mapping[str, str]]) -> dict[str, str]:
    """The header records of a sharded checkpoint's files as one header (`fold_scaled_fp8`'s `metadata`):
    the scales fold across shards, so their records must be read together too."""
    found = [layers for layers in map(_header_records, metadatas) if layers is not None]
    if not found:
        return {}
    return {HEADER_KEY: json.dumps({"layers": {layer: record for layers in found for layer, record in layers.items()}})}


def _header_records(metadata: Mapping[str, str] | None) -> dict | None:
    """The header's per-layer records ({layer: record}), or None when it has none."""
    raw = (metadata or {}).get(HEADER_KEY)
    if raw is None:
        return None
    try:
        layers = json.loads(raw).get("layers", {})
    except (ValueError, AttributeError):
        layers = None
    if not isinstance(layers, dict):
        raise StorageError(f"the header's '{HEADER_KEY}' should hold JSON quantization records but does not; "
                           "the file is damaged; download it again.")
    return layers


def _folded(name: str, tensor, scale_entry, full_precision: bool) -> torch.Tensor | StoredTensor:
    if isinstance(tensor, StoredTensor):  # GGUF tensors: already stored
        return tensor
    if scale_entry is None:
        if tensor.dtype not in FP8_DTYPES:
            return tensor
        return StoredTensor(tensor, stored_format_of(tensor.dtype), tensor.shape, full_precision_matmul=full_precision)
    scale = scale_entry[1].to(torch.float32)
    if tensor.dtype in FP8_DTYPES:
        try:
            return StoredTensor(tensor, FORMATS["fp8_scaled"], tensor.shape, scale, full_precision)
        except StorageError as error:  # e.g. a scale that is neither per tensor, per row nor per column
            raise StorageError(f"'{name}' and its scale '{scale_entry[0]}' do not fit together ({error}); {FIX}.") from None
    if tensor.is_floating_point() and scale.numel() == 1:  # a scale on a wider weight: apply it once, as Comfy does
        return (tensor.to(torch.float32) * scale).to(tensor.dtype)
    raise StorageError(f"'{name}' is {tensor.dtype} with a scale of shape {list(scale.shape)} (an integer or block-scaled quantization vidmem does not read); {FIX}.")


def refuse_unreadable(tensors: Mapping) -> None:
    """StorageError naming the first layer quantized in a way vidmem cannot read (or a damaged config)."""
    for name, tensor in tensors.items():
        leaf = _leaf(name)
        if leaf in UNSUPPORTED_SUFFIXES:
            raise StorageError(f"'{name}' belongs to {UNSUPPORTED_SUFFIXES[leaf]} quantization, which vidmem does not read; {FIX}.")
        if leaf == CONFIG_SUFFIX:
            fmt = _config(name, tensor).get("format")
            if fmt not in READ_FORMATS:
                raise StorageError(f"'{name}' says the layer is quantized as {fmt!r}; vidmem reads {', '.join(READ_FORMATS)} with a per-tensor scale; {FIX}.")


def _config(name: str, tensor: torch.Tensor) -> dict:
    """A `<layer>.comfy_quant` record: JSON bytes of an object."""
    try:
        config = json.loads(bytes(tensor.reshape(-1).to(torch.uint8).tolist()).decode("utf-8"))
    except ValueError:
        config = None
    if not isinstance(config, dict):
        raise StorageError(f"'{name}' should hold a JSON quantization config but does not; the file is damaged; download it again.")
    return config


def _leaf(name: str) -> str:
    return name.rpartition(".")[2]


def _weight_of(scale_name: str) -> str:
    prefix = scale_name.rpartition(".")[0]
    return f"{prefix}.weight" if prefix else "weight"
