"""Free VRAM's receipt counts the weights vidmem kept on the device, whether or not it also asks
ComfyUI to unload its models (ComfyUI's unload_all_models empties vidmem's stores first: they are
among its loaded models)."""

from __future__ import annotations

import pytest
import torch

from comfy_fake import FakeComfy
from cuda_fake import FakeCuda
from test_tiers import request_for
from vidmem.memory import MemoryStrategy
from vidmem.memory.device import CudaBackend
from vidmem.nodes import host
from vidmem.nodes.free import VidMemFreeVRAM
from vidmem.pipelines.hooks import RunHooks
from vidmem.pipelines.loader import load_pipeline
from vidmem.pipelines.sample import sample

VARIANT = "wan2.1-t2v"


@pytest.mark.parametrize("unload_comfy_models", [False, True])
def test_the_receipt_counts_the_kept_weights_it_released(tiny_folder, unload_comfy_models, monkeypatch):
    comfy = FakeComfy.install(monkeypatch)
    monkeypatch.setattr(host, "model_management", comfy.mm)
    loaded = load_pipeline(tiny_folder(VARIANT), "fp32")
    FakeCuda().install(monkeypatch)
    backend = CudaBackend(torch.device("cpu"))
    room = lambda n, d, warm=None, weight_bytes=0: host.make_room(n, comfy.device, warm=warm, weight_bytes=weight_bytes)  # noqa: E731
    sample(loaded, MemoryStrategy(offload="none"), request_for(VARIANT), hooks=RunHooks(make_room=room), backend=backend)
    held = loaded.warm_store("sample", backend).held_bytes
    assert held > 0
    out = VidMemFreeVRAM().free("x", unload_comfy_models=unload_comfy_models)
    report = out["ui"]["vidmem_receipt"][0]
    assert report["warm_released_bytes"] == held and report["comfy_models_unloaded"] is unload_comfy_models
    assert "weights vidmem kept on the device between runs" in out["ui"]["text"][0]
    assert loaded.warm_store("sample", backend).held_bytes == 0
