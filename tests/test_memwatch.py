"""bench/support/memwatch.py and the LoRA bench's RSS figure: the measurements the bench tables rest on.

The LoRA bench once read 0.0 MiB for a 58.5 MiB LoRA: Load LoRA had started reading every value
(its NaN check) before the measured call, so the file's pages were resident before the peak was
reset. These tests fail when a measurement misses what happens inside the call.
"""

from __future__ import annotations

import json
import mmap
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]  # bench.support; the LoRA bench as `lora`

from bench.support import memwatch  # noqa: E402

MIB = 1 << 20
pytestmark = pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux /proc peak reset only")


def touch_mapped(path: Path) -> int:
    """Map `path` and read one byte per page; the mapping is gone on return."""
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as view:
        return sum(view[i] for i in range(0, len(view), mmap.PAGESIZE))


def test_peak_growth_counts_pages_touched_inside_the_call(tmp_path):
    path = tmp_path / "file.bin"
    path.write_bytes(os.urandom(16 * MIB))
    growth = memwatch.peak_growth(lambda: touch_mapped(path))
    assert 0.9 * 16 * MIB <= growth <= 1.5 * 16 * MIB


def test_peak_growth_is_the_peak_not_what_is_left(tmp_path):
    def allocate_and_free():
        # Fresh anonymous pages, unmapped before the call returns. Not a torch tensor: malloc may
        # hand a tensor pages an earlier test freed into its heap, already resident, so RSS would
        # not grow at all (it read 0 in a full CI run).
        with mmap.mmap(-1, 32 * MIB) as block:
            for offset in range(0, len(block), mmap.PAGESIZE):
                block[offset] = 1
            return block[-mmap.PAGESIZE]

    assert memwatch.peak_growth(allocate_and_free) >= 0.9 * 32 * MIB


def test_peak_growth_misses_what_was_resident_before_the_call(tmp_path):
    """Why the LoRA bench must load inside the measured call: pages already in RSS do not grow it."""
    path = tmp_path / "file.bin"
    path.write_bytes(os.urandom(16 * MIB))
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as view:
        touch = lambda: sum(view[i] for i in range(0, len(view), mmap.PAGESIZE))  # noqa: E731
        touch()
        assert memwatch.peak_growth(touch) < 2 * MIB


def test_rss_in_child_runs_the_script_with_the_exact_rss_allocator(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(
        "import json, os, sys\n"
        "args = sys.argv[1:]\n"
        "out = args[args.index('--rss-only') + 1]\n"
        "keys = ('MALLOC_MMAP_THRESHOLD_', 'MALLOC_TRIM_THRESHOLD_')\n"
        "json.dump({'argv': args, 'env': {k: os.environ.get(k) for k in keys}}, open(out, 'w'))\n"
    )
    found = memwatch.rss_in_child(str(script), SimpleNamespace(blocks=3, threads=2))
    assert found["env"] == {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
    assert found["argv"][found["argv"].index("--blocks") + 1] == "3"
    assert found["argv"][found["argv"].index("--threads") + 1] == "2"


def test_the_lora_bench_counts_the_lora_file(tiny_loaded, tmp_path):
    """bench/lora.py's extra_rss on the tiny Wan transformer with a wide-rank LoRA (a few MiB):
    the LoRA's pages are read once, so the growth is about the file (it read ~0 when the load
    happened before the measured call)."""
    import lora as lora_bench

    model = tiny_loaded("wan2.1-t2v").pipe.transformer
    blocks = len(model.blocks)
    path = lora_bench.write_lora(model, blocks, tmp_path / "wide.safetensors", rank=4096)
    size = path.stat().st_size
    assert size > 4 * MIB
    inputs = lora_bench.inputs

    def tiny_inputs():
        config = model.config
        return dict(hidden_states=torch.randn(1, config.in_channels, 1, 4, 4), timestep=torch.tensor([500]),
                    encoder_hidden_states=torch.randn(1, 4, config.text_dim), return_dict=False)

    lora_bench.inputs = tiny_inputs
    try:
        growth = lora_bench.extra_rss(model, lora_bench.TIERS["none"], path)
    finally:
        lora_bench.inputs = inputs
    assert growth >= 0.8 * size, json.dumps({"growth": growth, "file": size})
