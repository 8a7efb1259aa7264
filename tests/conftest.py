"""Shared fixtures: tiny random pipelines saved as real diffusers folders, loaded through vidmem."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)  # results compared bit for bit must not depend on thread scheduling

from vidmem.pipelines.loader import load_pipeline  # noqa: E402
from vidmem.pipelines.tiny import save_tiny_pipeline  # noqa: E402


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory):
    """variant -> a saved diffusers folder, built once per session."""
    root = tmp_path_factory.mktemp("tiny-models")
    cache: dict[str, object] = {}

    def get(variant: str):
        if variant not in cache:
            cache[variant] = save_tiny_pipeline(variant, root / variant)
        return cache[variant]

    return get


@pytest.fixture(scope="session")
def tiny_loaded(tiny_folder):
    """variant -> a LoadedPipeline (fp32), loaded once per session and shared: tests must leave it as found."""
    cache: dict[str, object] = {}

    def get(variant: str):
        if variant not in cache:
            cache[variant] = load_pipeline(tiny_folder(variant), "fp32")
        return cache[variant]

    return get
