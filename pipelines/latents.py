"""Latents on disk in core ComfyUI's `.latent` format, so core Load Latent reads them back."""

from __future__ import annotations

from pathlib import Path

import safetensors.torch
import torch

LATENT_SUFFIX = ".latent"


def next_latent_path(folder: Path, stem: str) -> Path:
    """`<folder>/<stem>_00001_.latent`, numbered past the files already there (as core SaveLatent)."""
    folder.mkdir(parents=True, exist_ok=True)
    taken = [p.name for p in folder.glob(f"{stem}_*_{LATENT_SUFFIX}")]
    numbers = [int(name[len(stem) + 1 : len(stem) + 6]) for name in taken if name[len(stem) + 1 : len(stem) + 6].isdigit()]
    return folder / f"{stem}_{max(numbers, default=0) + 1:05}_{LATENT_SUFFIX}"


def write_latent(latent: dict, path: Path) -> Path:
    """Write `latent["samples"]`; the version marker tells Load Latent not to rescale it."""
    tensors = {"latent_tensor": latent["samples"].contiguous().cpu(), "latent_format_version_0": torch.tensor([])}
    safetensors.torch.save_file(tensors, str(path))
    return path


def read_latent(path: Path) -> dict:
    """What core Load Latent returns for a file written by write_latent."""
    tensors = safetensors.torch.load_file(str(path))
    return {"samples": tensors["latent_tensor"].float()}
