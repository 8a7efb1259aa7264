"""Shared fixtures: tiny random pipelines saved as real diffusers folders, loaded through vidmem."""

from __future__ import annotations

import os

# Before torch multiplies anything: MKL reads MKL_CBWR once, at its first call. In its default mode
# a product's last bits can depend on where its operands lie; vidmem keeps its own copies where
# their originals lie, but weights used in place from a file lie at that file's offsets, so tests
# comparing those with weights loaded elsewhere (marked `reproducible_blas`) hold only in a
# reproducible mode. A caller's choice is kept: tests/test_blas_modes.py runs the claims that must
# hold in any mode with MKL_CBWR empty (MKL's default) and COMPATIBLE. See docs/bit-identity.md.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
# The planner's disk cache stays off, so tests measure what they say and never write to the user's
# cache folder; tests/test_plan_cache.py turns it on in a temporary folder.
os.environ.setdefault("VIDMEM_PLAN_CACHE", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)  # results compared bit for bit must not depend on thread scheduling

from vidmem.pipelines.loader import load_pipeline  # noqa: E402
from vidmem.pipelines.tiny import save_tiny_pipeline  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "reproducible_blas: bit identity that holds only in a reproducible BLAS mode (MKL_CBWR set above), "
        "e.g. weights used in place at a file's offsets against the same weights at other addresses")


@pytest.fixture(autouse=True)
def cold_shared_pipelines():
    """Pipelines shared between tests keep device copies between calls (warm runs, memory/warm.py);
    drop them after each test, so every test starts cold, as the shared fixtures promise."""
    yield
    from vidmem.memory.cleanup import _DroppedPinned
    from vidmem.memory.warm import release_everywhere

    release_everywhere()
    _DroppedPinned.pending = False  # process-wide: a pipeline one test dropped must not empty the next test's cache


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
