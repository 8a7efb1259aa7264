"""make_room asks the host for the stage's weights plus the planner's predicted activations (and,
inside ComfyUI, the VRAM ComfyUI keeps in reserve, as its own loader does)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from test_tiers import request_for
from vidmem.memory import MemoryStrategy
from vidmem.memory.device import CpuBackend
from vidmem.memory.plan.costs import CUDA_CONTEXT_BYTES
from vidmem.memory.plan.stages import decode_stage, denoise_stage, text_encode_stage
from vidmem.memory.plan.types import PlanOptions, VideoShape
from vidmem.nodes import host
from vidmem.pipelines import planning, room
from vidmem.pipelines.decode import decode
from vidmem.pipelines.hooks import RunHooks
from vidmem.pipelines.sample import sample

CUDA = torch.device("cuda", 0)
MiB = 1 << 20


@pytest.fixture
def comfy(monkeypatch):
    """A stand-in for comfy.model_management that records free_memory calls."""
    calls = []
    fake = SimpleNamespace(free_memory=lambda required, device: calls.append((required, device)),
                           extra_reserved_memory=lambda: 400 * MiB)
    monkeypatch.setattr(host, "model_management", fake)
    return calls


def test_make_room_adds_comfyuis_reserved_vram_as_its_own_loader_does(comfy):
    host.make_room(5 << 30, CUDA)
    assert comfy == [((5 << 30) + 400 * MiB, CUDA)]


def test_make_room_leaves_the_host_alone_on_the_cpu(comfy):
    host.make_room(5 << 30, torch.device("cpu"))
    assert comfy == []


def predicted_activations(stages) -> int:
    return max(p.device_bytes - CUDA_CONTEXT_BYTES - p.weights_bytes for s in stages for p in s.phases)


@pytest.fixture
def predicting(monkeypatch):
    """Predict as for a GPU although the tiny run stays on the CPU (the planner works on meta)."""
    monkeypatch.setattr(room, "wants_prediction", lambda device: True)


@pytest.mark.parametrize("variant", ["wan2.1-t2v", "cogvideox-t2v", "wan2.1-i2v"])
def test_sampling_asks_for_weights_plus_the_planners_activations(tiny_loaded, predicting, variant):
    loaded = tiny_loaded(variant)
    strategy, request = MemoryStrategy(offload="model"), request_for(variant)
    asked = []
    result = sample(loaded, strategy, request, hooks=RunHooks(make_room=lambda n, d, **_: asked.append(n)), backend=CpuBackend())

    model = planning.planner_model(loaded)
    options = planning.plan_options(loaded, PlanOptions(steps=request.steps))
    shape = VideoShape(request.width, request.height, request.frames, cfg=True)
    stages = [denoise_stage(model, shape, strategy, options), text_encode_stage(model, shape, strategy, options)]
    activations = predicted_activations(stages)
    weights = result.receipt["device_weight_bytes"]
    assert activations > 0
    assert asked == [weights + activations]  # the old request was `weights` alone
    assert result.receipt["room"] == {"weight_bytes": weights, "activation_bytes": activations, "predicted": True}


def test_decoding_asks_for_weights_plus_the_planners_activations_and_the_latent(tiny_loaded, predicting):
    loaded = tiny_loaded("wan2.1-t2v")
    latent = sample(loaded, MemoryStrategy(), request_for("wan2.1-t2v"), backend=CpuBackend()).latent
    asked = []
    result = decode(loaded, latent, MemoryStrategy(offload="none"), backend=CpuBackend(),
                    hooks=RunHooks(make_room=lambda n, d, **_: asked.append(n)))

    model = planning.planner_model(loaded)
    batch, _, frames, height, width = latent["samples"].shape
    s = model.geometry.spatial_factor
    shape = VideoShape(width * s, height * s, model.geometry.frames(frames), batch=batch)
    z = latent["samples"].numel() * model.dtype_bytes("vae")
    activations = predicted_activations([decode_stage(model, shape, MemoryStrategy(offload="none"), planning.plan_options(loaded))]) + z
    weights = sum(t.numel() * t.element_size() for t in [*loaded.pipe.vae.parameters(), *loaded.pipe.vae.buffers()])
    assert asked == [weights + activations] and result.receipt["room"]["predicted"]


def test_a_failed_prediction_asks_for_weights_plus_the_stated_margin_and_says_so(tiny_loaded, predicting, monkeypatch, caplog):
    loaded = tiny_loaded("wan2.1-t2v")

    def unknown(loaded):
        raise ValueError("no config for this pipeline")

    monkeypatch.setattr(planning, "planner_model", unknown)
    asked = []
    with caplog.at_level(logging.INFO, logger="vidmem"):
        result = sample(loaded, MemoryStrategy(offload="model"), request_for("wan2.1-t2v"),
                        hooks=RunHooks(make_room=lambda n, d, **_: asked.append(n)), backend=CpuBackend())
    assert asked == [result.receipt["device_weight_bytes"] + room.FALLBACK_MARGIN_BYTES]
    assert result.receipt["room"]["predicted"] is False
    assert "no activation prediction" in caplog.text and "margin" in caplog.text and "no config" in caplog.text


def test_on_the_cpu_nothing_is_predicted_and_only_the_weights_are_asked(tiny_loaded, monkeypatch):
    monkeypatch.setattr(planning, "planner_model", lambda loaded: pytest.fail("the CPU needs no prediction"))
    asked = []
    result = sample(tiny_loaded("wan2.1-t2v"), MemoryStrategy(offload="model"), request_for("wan2.1-t2v"),
                    hooks=RunHooks(make_room=lambda n, d, **_: asked.append(n)), backend=CpuBackend())
    assert asked == [result.receipt["device_weight_bytes"]]
