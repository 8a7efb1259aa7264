"""`vidmem plan`'s "Cold and warm" line: what the recommended row's first run uploads, and how fast.

The figure is the weights the denoise stage puts on the GPU, not the upcast workspace a stored
layer computes with (made on the GPU, never uploaded); weights memory-mapped from disk reach the
GPU from a cold page cache, at the disk's rate (--disk-gbps), not PCIe's.
"""

from __future__ import annotations

import re

from vidmem.cli import main
from vidmem.cli.plan import uploaded_weight_bytes
from vidmem.memory.plan.candidates import plan_run
from vidmem.memory.plan.stages import VideoShape, component_weights, sample_stage_components
from vidmem.memory.plan.types import PlanOptions
from vidmem.memory.strategy import MemoryStrategy
from vidmem.memory.units import GiB
from vidmem.pipelines.configs import load_model

MODEL = "wan2.1-t2v-1.3b"


def _warm_line(argv: list[str], capsys) -> str:
    main(["plan", "--model", MODEL, *argv])
    return next(line for line in capsys.readouterr().out.splitlines() if line.startswith("Cold and warm:"))


def test_the_first_upload_counts_stored_weights_without_the_upcast_workspace():
    """Tier none with fp8-scaled weights: the denoise stage uploads every stage component's stored
    tensors once; the workspace (two float32 temporaries of the layer computing) is no upload."""
    model = load_model(MODEL, "bf16")
    options = PlanOptions(storage=model.layout.stored_as("fp8_scaled"), device="cuda")
    strategy = MemoryStrategy(offload="none", text_encoder="cpu")
    plan = plan_run(model, VideoShape(832, 480, 81), strategy, options)
    stored = sum(component_weights(model, name, options).nbytes for name in sample_stage_components(model, strategy))
    workspace = component_weights(model, "transformer", options).transient_bytes
    assert workspace > 0  # the premise: a stored layer computes with one
    assert uploaded_weight_bytes(model, plan) == stored


def test_weights_on_disk_reach_the_gpu_at_the_disks_rate(capsys):
    line = _warm_line(["--vram", "24", "--ram", "64", "--disk", "--disk-gbps", "0.5"], capsys)
    found = re.search(r"uploads (\d+\.\d) GiB of weights before it denoises \(about (\d+\.\d) s at ([\d.]+) GB/s", line)
    assert found, line
    gib, seconds, rate = map(float, found.groups())
    assert rate == 0.5 and "--disk-gbps" in line
    assert abs(seconds - gib * GiB / 0.5e9) <= 0.1 + gib * GiB / 0.5e9 * 0.05  # rounding of the GiB shown
    in_ram = _warm_line(["--vram", "24", "--ram", "64"], capsys)
    assert "over PCIe" in in_ram and "--disk-gbps" not in in_ram


def test_a_small_upload_never_reads_as_nothing(capsys):
    """Wan 1.3B on 8 GiB: `sequential` keeps about 0.1 GiB on the GPU, a few ms over PCIe, which read "about 0.0 s"."""
    line = _warm_line(["--vram", "8", "--ram", "32"], capsys)
    assert re.search(r"uploads [\d.]+ (GiB|MiB) of weights before it denoises \(under 0\.1 s at ([\d.]+) GB/s", line), line
    assert "0.0 s" not in line and "0.0 GiB" not in line
