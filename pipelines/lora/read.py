"""Read a LoRA file into raw layers: source module name -> {down, up, alpha, diff, diff_b}.

Safetensors only, decided by content (the storage engine's sniff refuses pickles before anything
parses them). Tensors are zero-copy views of the file's mapping, so a LoRA costs page cache, not
an anonymous copy. The key's tail says what a tensor is; its head (the module name, in whatever
naming the trainer used) is resolved against the model later (names.py).
"""

from __future__ import annotations

import json
import os
import hashlib
import math
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
    unknown_keys: tuple[str, ...]  # keys whose tail is not a LoRA tensor vidmem knows (DoRA, LoHa, LoKr...)
    peft_alphas: Mapping[str, float]  # "" -> global lora_alpha; module-name patterns -> alpha
    trained_by: Mapping[str, object] = field(default_factory=dict)  # vidmem's training record ({} for other files)

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
    return LoraFile(path, layers, tuple(unknown), peft_alphas(opened.metadata, path), trained_record(opened.metadata))


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


def peft_alphas(metadata: Mapping[str, str], path: Path) -> dict[str, float]:
    """lora_alpha from diffusers/PEFT adapter metadata: "" for the global value, plus alpha_pattern.

    Keys may carry a component prefix ("transformer.lora_alpha"). Without metadata the diffusers
    convention holds: alpha = rank, i.e. scale 1. A value that is not a finite number is refused
    here, naming the key, rather than turning every frame NaN (or failing) at the sampler.
    """
    raw = metadata.get(PEFT_METADATA_KEY)
    if not raw:
        return {}
    fix = "re-save the LoRA with a numeric lora_alpha, or remove that metadata entry (alpha = rank is then assumed)"
    try:
        config = json.loads(raw)
    except json.JSONDecodeError:
        raise LoraError(f"LoRA file {path}: its '{PEFT_METADATA_KEY}' metadata is not JSON; {fix}.") from None
    if not isinstance(config, dict):
        raise LoraError(f"LoRA file {path}: its '{PEFT_METADATA_KEY}' metadata is a JSON {type(config).__name__}, "
                        f"not an object of PEFT settings; {fix}.")
    alphas: dict[str, float] = {}
    for key, value in config.items():
        setting = key.rsplit(".", 1)[-1]
        if setting == "lora_alpha" and value is not None:
            alphas[""] = _alpha_value(value, f"'{key}'", path, fix)
        elif setting == "alpha_pattern" and isinstance(value, dict):
            alphas.update({pattern: _alpha_value(v, f"'{key}' entry '{pattern}'", path, fix) for pattern, v in value.items()})
    return alphas


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
