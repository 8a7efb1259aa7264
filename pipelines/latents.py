"""Latents on disk in core ComfyUI's `.latent` format, so core Load Latent reads them back."""

from __future__ import annotations

from pathlib import Path

import safetensors.torch
import torch

from .atomic import atomic_path
from .family import ModelError

LATENT_SUFFIX = ".latent"


def check_latent(latent, input_name: str = "latent") -> torch.Tensor:
    """The video latent tensor of a core LATENT dict; ModelError naming the input otherwise.

    Called before anything is written, so a bad input leaves no file or folder behind.
    """
    if not isinstance(latent, dict):
        raise ModelError(f"{input_name} must be a LATENT (a dict with 'samples'), got {type(latent).__name__}; "
                         "connect Video Sampler's latent or core Load Latent.")
    samples = latent.get("samples")
    if not isinstance(samples, torch.Tensor):
        found = "no 'samples'" if samples is None else f"'samples' of type {type(samples).__name__}, not a tensor"
        raise ModelError(f"{input_name} has {found} (keys: {sorted(map(str, latent))}); "
                         "connect Video Sampler's latent or core Load Latent.")
    if samples.dim() != 5:
        raise ModelError(f"{input_name}['samples'] has shape {tuple(samples.shape)}; a video latent is "
                         "[batch, channels, frames, height, width]. Image latents need core VAE Decode.")
    return samples


def next_latent_path(folder: Path, stem: str) -> Path:
    """`<folder>/<stem>_00001_.latent`, numbered past the files already there (as core SaveLatent).

    Creates nothing: the caller writes the file (and its folder) only once the latent is checked.
    """
    taken = [p.name for p in folder.glob(f"{stem}_*_{LATENT_SUFFIX}")] if folder.is_dir() else []
    numbers = [int(name[len(stem) + 1 : len(stem) + 6]) for name in taken if name[len(stem) + 1 : len(stem) + 6].isdigit()]
    return folder / f"{stem}_{max(numbers, default=0) + 1:05}_{LATENT_SUFFIX}"


def write_latent(latent: dict, path: Path) -> Path:
    """Write `latent["samples"]`; the version marker tells Load Latent not to rescale it."""
    samples = check_latent(latent)
    tensors = {"latent_tensor": samples.contiguous().cpu(), "latent_format_version_0": torch.tensor([])}
    with atomic_path(path) as temporary:  # Load Latent lists the folder: never a half-written file
        safetensors.torch.save_file(tensors, str(temporary))
    return path


def read_latent(path: Path) -> dict:
    """What core Load Latent returns for a file written by write_latent."""
    tensors = safetensors.torch.load_file(str(path))
    return {"samples": tensors["latent_tensor"].float()}
