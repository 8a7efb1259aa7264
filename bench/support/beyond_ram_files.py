"""The model files bench/beyond_ram.py runs: Comfy-Org's names and formats, random weights, real sizes.

A ComfyUI models/ tree (diffusion_models, text_encoders, vae) holding one Wan transformer per
variant (bf16, or fp8 scaled with per-tensor `scale_weight`), umt5-xxl in fp8 scaled with its
SentencePiece tokenizer embedded under `spiece_model`, and the Wan 2.1 VAE in bf16, written by
`pipelines.comfy_files.random_files.write_random_file` tensor by tensor (one 16 M-value chunk in
memory whatever the file size).

The tokenizer is the tiny test vocabulary (`tiny_spiece_model`, 305 ids with T5's 100 extra
ids): a real SentencePiece model, as Comfy-Org embeds, but small. The embedding table keeps
umt5-xxl's real shape (256384 x 4096, what the loader checks against the shipped config): the
tiny tokenizer's ids index its first 305 rows, so the text encoder runs at its real size and
only the vocabulary a prompt can reach is smaller. A random-weight bench has no use for the rest.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from vidmem.memory.storage import storage_format
from vidmem.pipelines.comfy_files import ModelEntry, shipped_catalogue
from vidmem.pipelines.comfy_files.build import build_empty
from vidmem.pipelines.comfy_files.catalogue import entry_from_json
from vidmem.pipelines.comfy_files.random_files import write_random_file
from vidmem.pipelines.tiny_files import CONFIGS_FOLDER, tiny_model_config, tiny_spiece_model

FOLDERS = {"model": "diffusion_models", "text_encoder": "text_encoders", "vae": "vae"}
COMPONENTS = {"model": "transformer", "text_encoder": "text_encoder", "vae": "vae"}
TINY_PREFIX = "tiny-"  # `--model tiny-wan2.1-t2v`: the same bench on a tiny model, in seconds


@dataclass(frozen=True)
class ModelFile:
    role: str  # loader input: model / text_encoder / vae
    name: str  # file name, as Comfy-Org ships it
    storage: str  # StorageFormat name of the Linear weights (everything else bf16)

    def path(self, root: Path) -> Path:
        return root / FOLDERS[self.role] / self.name


@dataclass(frozen=True)
class Variant:
    key: str  # the JSON's run name
    model: ModelFile
    weights_on_disk: bool = True


TEXT_ENCODER = ModelFile("text_encoder", "umt5_xxl_fp8_e4m3fn_scaled.safetensors", "fp8_scaled")
VAE = ModelFile("vae", "wan_2.1_vae.safetensors", "bf16")
SHARED = (TEXT_ENCODER, VAE)  # the same in both variants: written once, kept until both ran
VARIANTS = {
    "bf16_disk": Variant("bf16_disk", ModelFile("model", "wan2.1_t2v_14B_bf16.safetensors", "bf16")),
    "fp8": Variant("fp8", ModelFile("model", "wan2.1_t2v_14B_fp8_scaled.safetensors", "fp8_scaled")),
}


def model_entry(name: str, root: Path) -> ModelEntry:
    """The shipped config `name`; a `tiny-<variant>` config is also written to root/vidmem_configs,
    where the loader node looks for configs beyond the shipped ones."""
    if name.startswith(TINY_PREFIX):
        config = tiny_model_config(name.removeprefix(TINY_PREFIX))
        path = root / CONFIGS_FOLDER / f"{name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(config, indent=2))
        return entry_from_json(config)
    entries = {entry.name: entry for entry in shipped_catalogue()}
    if name not in entries:
        raise SystemExit(f"--model {name}: not a shipped config; use one of {', '.join(entries)} or tiny-wan2.1-t2v.")
    return entries[name]


def expected_bytes(entry: ModelEntry, file: ModelFile) -> int:
    """The file's size from the component's shapes, by write_random_file's rules (header aside):
    Linear weights in the file's format (+ a float32 scale each when scaled), the rest bf16."""
    fmt = storage_format(file.storage)
    with torch.device("meta"):
        module = build_empty(entry.components[COMPONENTS[file.role]])
    linear = {f"{n}.weight" for n, m in module.named_modules() if isinstance(m, torch.nn.Linear)}
    seen, total = set(), 0
    for name, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        stored = fmt.quantized and name in linear
        itemsize = fmt.torch_dtype.itemsize if (stored or not fmt.quantized) else 2
        total += tensor.numel() * itemsize + (4 if stored and fmt.scaled else 0)
    return total + (len(tiny_spiece_model()) if file.role == "text_encoder" else 0)


def is_complete(path: Path) -> bool:
    """A safetensors file whose header's last tensor ends exactly at the end of the file."""
    try:
        with open(path, "rb") as handle:
            length = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(length))
    except (OSError, ValueError):
        return False
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    return path.stat().st_size == 8 + length + end


def write(entry: ModelEntry, file: ModelFile, root: Path) -> Path:
    """Write `file` under `root` with random weights, flush it and drop it from the page cache, so
    a run starts with its weights on disk as after a download (only this file's pages are dropped)."""
    spiece = tiny_spiece_model() if file.role == "text_encoder" else None
    path = write_random_file(entry.components[COMPONENTS[file.role]], file.path(root), file.storage, spiece_model=spiece)
    drop_from_page_cache(path)
    return path


def drop_from_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def check_free_space(folder: Path, needed: int, what: str) -> None:
    """SystemExit naming the bytes needed and free when the disk holding `folder` cannot take them."""
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    margin = 2 * 2**30  # headers, the other helpers' files growing meanwhile
    if free < needed + margin:
        raise SystemExit(
            f"beyond_ram needs {(needed + margin) / 1e9:.1f} GB free under {folder} for {what} "
            f"({needed / 1e9:.1f} GB of files + 2 GiB margin); {free / 1e9:.1f} GB are free. Free some space, "
            "pass --work DIR on a larger disk, or run one variant at a time (--only)."
        )
