"""Read a LoRA file into raw layers: source module name -> {down, up, alpha, diff, diff_b}.

Safetensors only, decided by content (the storage engine's sniff refuses pickles before anything
parses them). Tensors are zero-copy views of the file's mapping, so a LoRA costs page cache, not
an anonymous copy. The key's tail says what a tensor is; its head (the module name, in whatever
naming the trainer used) is resolved against the model later (names.py). A DoRA is refused here:
applying its A/B without the magnitude would be neither the DoRA nor the base model.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import torch

from ...memory.lora import LoraError
from ...memory.storage import StorageError, open_safetensors, sniff

# Key tails, longest first: (tail, kind). PEFT state dicts saved raw keep the adapter name
# ("default"); PEFT's lora_B.bias belongs to the low-rank term (scaled by alpha/rank, as PEFT's
# `lora_B(lora_A(x)) * scaling`), unlike kohya/lightx2v's diff_b (scaled by strength alone).
KEY_TAILS = (
    (".lora_A.default.weight", "down"), (".lora_B.default.weight", "up"),
    (".lora_A.weight", "down"), (".lora_B.weight", "up"), (".lora_B.bias", "up_bias"),
    (".lora_down.weight", "down"), (".lora_up.weight", "up"),
    (".alpha", "alpha"), (".diff_b", "diff_b"), (".diff", "diff"),
)
PEFT_METADATA_KEY = "lora_adapter_metadata"  # diffusers' save_lora_weights writes lora_alpha and r here
TRAINED_BY_KEY = "vidmem_training"  # what vidmem's trainer records (training/save.py): component, expert, ...
IDENTITY_SAMPLE_BYTES = 1 << 20  # of the tensor data, hashed from each end beside the header
# DoRA's per-layer magnitude: PEFT saves `<layer>.lora_magnitude_vector` (diffusers keeps the name),
# kohya/LyCORIS `<layer>.dora_scale` (the name ComfyUI's loader reads).
DORA_KEY = re.compile(r"(^|\.)(lora_magnitude_vector|dora_scale)(\.|$)")


@dataclass(frozen=True)
class RawLayer:
    """The tensors a LoRA file holds for one module, under the file's own module name."""

    source: str
    tensors: Mapping[str, torch.Tensor]  # kind -> tensor (kind from KEY_TAILS)
    keys: tuple[str, ...]  # the file's keys, for messages


@dataclass(frozen=True)
class LoraFile:
    path: Path
    layers: Mapping[str, RawLayer]  # source module name -> tensors
    unknown_keys: tuple[str, ...]  # keys whose tail is not a LoRA tensor vidmem knows (LoHa, LoKr...)
    peft_alphas: Mapping[str, float]  # "" -> global lora_alpha; module-name patterns -> alpha
    trained_by: Mapping[str, object] = field(default_factory=dict)  # vidmem's training record ({} for other files)
    rslora: bool = False  # PEFT's use_rslora: the low-rank term is scaled by alpha / sqrt(rank), not alpha / rank

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers.values() for t in layer.tensors.values())


def read_lora_file(path: str | os.PathLike, header_only: bool = False) -> LoraFile:
    """Open `path` (safetensors, checked by content) and group its tensors by module.

    `header_only`: the tensors are on the meta device, from the header alone (shapes and dtypes:
    what a plan counts); no tensor byte is read, so alpha values and finiteness are not known."""
    path = Path(path)
    try:
        kind = sniff(path)
        if kind != "safetensors":
            raise LoraError(f"LoRA file {path} is a {kind.upper()} file; LoRAs are read from .safetensors files only. Use the .safetensors release of this LoRA.")
        opened = open_safetensors(path, header_only)
    except StorageError as error:
        raise LoraError(f"LoRA file {path} cannot be used: {error}") from None
    config = peft_config(opened.metadata, path)
    _refuse_dora(path, config, opened.tensors)
    grouped: dict[str, dict[str, torch.Tensor]] = {}
    keys: dict[str, list[str]] = {}
    unknown = []
    for key, tensor in opened.tensors.items():
        split = split_key(key)
        if split is None:
            unknown.append(key)
            continue
        source, kind = split
        if kind in grouped.setdefault(source, {}):
            raise LoraError(f"LoRA file {path} holds two '{kind}' tensors for '{source}' (e.g. both lora_A and lora_down); the file is malformed.")
        grouped[source][kind] = tensor
        keys.setdefault(source, []).append(key)
    layers = {s: RawLayer(s, grouped[s], tuple(keys[s])) for s in grouped}
    return LoraFile(path, layers, tuple(unknown), peft_alphas(config, path), trained_record(opened.metadata),
                    rslora=peft_flag(config, "use_rslora"))


def file_identity(path: str | os.PathLike) -> dict:
    """{"size", "sha256"}: the size and a hash of the header (names, shapes, metadata) and of the first
    and last MiB of the tensor data, cheap for a LoRA of any size. Two files with the same
    identity are the same LoRA in practice; a re-trained or re-saved one differs."""
    path = Path(path)
    size = path.stat().st_size
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        head = handle.read(8)
        header_bytes = int.from_bytes(head, "little") if len(head) == 8 else 0
        digest.update(head + handle.read(min(header_bytes, size)))
        digest.update(handle.read(IDENTITY_SAMPLE_BYTES))
        handle.seek(max(handle.tell(), size - IDENTITY_SAMPLE_BYTES))
        digest.update(handle.read(IDENTITY_SAMPLE_BYTES))
    return {"size": size, "sha256": digest.hexdigest()}


def trained_record(metadata: Mapping[str, str]) -> dict:
    """vidmem's training record from the metadata; {} when absent or unreadable (it only informs checks)."""
    try:
        record = json.loads(metadata.get(TRAINED_BY_KEY) or "{}")
    except json.JSONDecodeError:
        return {}
    return record if isinstance(record, dict) else {}


def split_key(key: str) -> tuple[str, str] | None:
    """("module name as in the file", kind), or None when the tail is not a known LoRA tensor."""
    for tail, kind in KEY_TAILS:
        if key.endswith(tail):
            return key[: -len(tail)], kind
    return None


METADATA_FIX = "re-save the LoRA with a numeric lora_alpha, or remove that metadata entry (alpha = rank is then assumed)"


def peft_config(metadata: Mapping[str, str], path: Path) -> dict:
    """The PEFT settings diffusers' save_lora_weights writes (r, lora_alpha, alpha_pattern, use_rslora,
    use_dora, ...; keys may carry a component prefix, "transformer.lora_alpha"); {} without them.
    Metadata that is not a JSON object is refused here, naming the file."""
    raw = metadata.get(PEFT_METADATA_KEY)
    if not raw:
        return {}
    try:
        config = json.loads(raw)
    except json.JSONDecodeError:
        raise LoraError(f"LoRA file {path}: its '{PEFT_METADATA_KEY}' metadata is not JSON; {METADATA_FIX}.") from None
    if not isinstance(config, dict):
        raise LoraError(f"LoRA file {path}: its '{PEFT_METADATA_KEY}' metadata is a JSON {type(config).__name__}, "
                        f"not an object of PEFT settings; {METADATA_FIX}.")
    return config


def peft_flag(config: Mapping[str, object], setting: str) -> bool:
    """Whether a boolean PEFT setting (`use_rslora`, `use_dora`) is on, with or without a component prefix;
    truthy as LoraConfig takes it (diffusers builds `LoraConfig(**metadata)`), so both read it alike."""
    return any(key.rsplit(".", 1)[-1] == setting and bool(value) for key, value in config.items())


def peft_alphas(config: Mapping[str, object], path: Path) -> dict[str, float]:
    """lora_alpha from PEFT settings (peft_config): "" for the global value, plus alpha_pattern.

    Without it the diffusers convention holds: alpha = rank, i.e. scale 1. A value that is not a
    finite number is refused here, naming the key, rather than turning every frame NaN (or
    failing) at the sampler. The rank is each layer's own (its tensors' shape): PEFT's r and
    rank_pattern must equal it, or PEFT could not load the file either.
    """
    alphas: dict[str, float] = {}
    for key, value in config.items():
        setting = key.rsplit(".", 1)[-1]
        if setting == "lora_alpha" and value is not None:
            alphas[""] = _alpha_value(value, f"'{key}'", path, METADATA_FIX)
        elif setting == "alpha_pattern" and isinstance(value, dict):
            alphas.update({pattern: _alpha_value(v, f"'{key}' entry '{pattern}'", path, METADATA_FIX) for pattern, v in value.items()})
    return alphas


def _refuse_dora(path: Path, config: Mapping[str, object], tensors: Mapping[str, torch.Tensor]) -> None:
    """A DoRA rescales each layer's whole weight by its magnitude vector; its A/B alone would give
    neither the DoRA's result nor the base model's, so the file is refused, not half applied."""
    magnitude = next((key for key in tensors if DORA_KEY.search(key)), None)
    if magnitude is None and not peft_flag(config, "use_dora"):
        return
    evidence = f"key '{magnitude}'" if magnitude else f"'use_dora' in its '{PEFT_METADATA_KEY}' metadata"
    raise LoraError(
        f"LoRA file {path} is a DoRA ({evidence}); vidmem does not apply DoRA (weight-decomposed LoRA), and its "
        "lora_A/lora_B without the magnitude would give a wrong result. Use a plain-LoRA release of it, or merge it "
        "into the base model (PEFT's merge_and_unload), or apply it with ComfyUI's core LoraLoaderModelOnly on a "
        "native MODEL (ComfyUI reads DoRA's `dora_scale` keys)."
    )


def _alpha_value(value: object, where: str, path: Path, fix: str) -> float:
    # bool is an int to Python, and json reads NaN and Infinity: neither is an alpha; a number written
    # as a string ("2") is read as the number, as float() always read it
    number = math.nan
    if isinstance(value, (int, float, str)) and not isinstance(value, bool):
        try:
            number = float(value)
        except ValueError:
            pass
    if not math.isfinite(number):
        raise LoraError(f"LoRA file {path}: metadata {where} in '{PEFT_METADATA_KEY}' is {value!r}, not a finite "
                        f"number; {fix}.")
    return number
