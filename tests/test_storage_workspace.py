"""The upcast workspace the planner counts (`upcast_workspace_bytes`) is what the engine allocates:
every format's dequantize is run under torch's memory profiler and its peak compared."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import vidmem.memory.storage.stored as stored_module
from vidmem.memory.storage import FORMATS, quantize, upcast_workspace_bytes

LOW = [name for name, fmt in FORMATS.items() if fmt.quantized] + ["bf16"]


def peak_allocated(fn) -> int:
    """Peak of the bytes allocated while `fn` runs and its result lives (CPU allocator events, in order)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
        del result
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns())
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("name", LOW)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("chunked", [False, True])
def test_declared_workspace_is_what_dequantize_allocates(name, dtype, chunked, monkeypatch):
    if chunked:  # 16 rows of 1024 per chunk: the whole result plus one chunk's temporaries
        monkeypatch.setattr(stored_module, "DEQUANT_CHUNK", 1 << 14)
    stored = quantize(torch.randn(256, 1024), FORMATS[name])
    measured = peak_allocated(lambda: stored.dequantize(dtype))
    assert measured == upcast_workspace_bytes(FORMATS[name], stored.shape, dtype), (name, dtype, chunked)
