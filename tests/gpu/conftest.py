"""The GPU suite: runs only where CUDA is available, skips with the reason everywhere else.

Real layer dimensions, random weights built on the GPU (bench/gpu.py's builders: no files, no
hub). `bash bench/gpu_check.sh` runs it with the bench on a GPU machine in one short lease.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))  # bench/gpu.py: builders, trace_overlap
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # bench.support: the block-swap bench's builders
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the CPU suite's helpers

NO_CUDA = "needs a CUDA GPU (torch.cuda.is_available() is false here); run bash bench/gpu_check.sh on a GPU machine"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    here = Path(__file__).resolve().parent
    for item in items:
        if here in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.skip(reason=NO_CUDA))


@pytest.fixture(scope="session")
def cuda():
    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture(scope="session")
def pool():
    from vidmem.memory.hostpool import HostPool

    return HostPool()


@pytest.fixture(scope="session")
def wan13b(cuda):
    """(planner model, bf16 transformer on the CPU) of Wan 2.1 1.3B, random weights, 30 blocks."""
    from gpu import build_transformer, meta_model

    model = meta_model("wan2.1-t2v-1.3b", {})
    module = build_transformer(model, cuda, seed=0).to("cpu")
    torch.cuda.empty_cache()
    return model, module

