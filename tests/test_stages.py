"""The planner's resident weights equal what the engine held, per variant x text-encoder placement x tier.

The engine runs the tiny pipelines under a backend that gives every onloaded tensor a fresh
storage and remembers it, so at any moment "on the device" is exactly the tensors pointing at a
storage the backend handed out. Each component's peak (sampled whenever a group is onloaded and
whenever one of the component's modules starts) is compared with the planner's phase for the
same component, planned from the same tiny folder's configs (`configs.load_model`).
"""

from __future__ import annotations

import pytest
import torch

from backends import StrictBackend
from vidmem.memory import MemoryStrategy
from vidmem.memory.plan.planner import PlanOptions, VideoShape
from vidmem.memory.plan.stages import denoise_stage, text_encode_stage
from vidmem.memory.strategy import TextEncoderPlacement
from vidmem.pipelines.configs import load_model
from vidmem.pipelines.family import denoiser_blocks
from vidmem.pipelines.sample import sample, sample_stage
from vidmem.pipelines.stages import stage_components
from vidmem.pipelines.tiny import TINY_VARIANTS, tiny_spec
from test_tiers import request_for

PLACEMENTS = [p.value for p in TextEncoderPlacement]
TIERS = {  # blocks_to_swap: "all" swaps every block of the tiny model
    "none": dict(offload="none"),
    "model": dict(offload="model"),
    "block_swap:1:0": dict(offload="block_swap", blocks_to_swap=1, prefetch_blocks=0),
    "block_swap:all:1": dict(offload="block_swap", blocks_to_swap="all", prefetch_blocks=1),
    "sequential:1": dict(offload="sequential", prefetch_blocks=1),
}
# Image conditioning (and LTX-2's text connectors) is one call: the engine learns its order during
# it and never prefetches, while the planner replays two passes (prefetch in steady state). There
# it is an upper bound.
UPPER_BOUND_ONLY = {("sequential:1", "image_encoder"), ("sequential:1", "vae"), ("sequential:1", "connectors")}


class DeviceLedger(StrictBackend):
    """StrictBackend that remembers every storage it handed out as a device copy."""

    def __init__(self) -> None:
        super().__init__()
        self.handed_out: list[torch.Tensor] = []  # kept alive, so a pointer is never reused
        self.pointers: set[int] = set()

    def copy_group(self, hosts, non_blocking, side_stream, timed):
        copies, token = super().copy_group(hosts, non_blocking, side_stream, timed)
        self.handed_out += copies
        self.pointers.update(c.untyped_storage().data_ptr() for c in copies)
        return copies, token


class ResidencyProbe:
    """Per component: the most weight bytes on the device while that component computes."""

    def __init__(self, pipe, backend: DeviceLedger) -> None:
        self.pipe, self.backend = pipe, backend
        self.modules = {n: c for n, c in pipe.components.items() if isinstance(c, torch.nn.Module)}
        self.depth: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.on_device: set[str] = set()  # components that computed with their own weights on the device
        self.handles = []
        for name, module in self.modules.items():
            for entry in (module, *module.children()):  # a VAE computes through encode/decode, not forward
                self.handles.append(entry.register_forward_pre_hook(lambda m, a, n=name: self._enter(n)))
                self.handles.append(entry.register_forward_hook(lambda m, a, o, n=name: self._leave(n)))
        # Sampled as every module starts: by then its component's own hooks have placed the weights
        # (the hooks above run before the strategy's, which are registered later).
        self.handles.append(torch.nn.modules.module.register_module_forward_pre_hook(lambda m, a: self.measure()))

    def observer(self, kind: str, group) -> None:
        if kind in ("onload", "prefetch"):
            self.measure()

    def measure(self) -> None:
        resident = self._resident_bytes()
        for name, depth in self.depth.items():
            if depth:
                self.peak[name] = max(self.peak.get(name, 0), sum(resident.values()))
                if resident.get(name):
                    self.on_device.add(name)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def _enter(self, name: str) -> None:
        self.depth[name] = self.depth.get(name, 0) + 1

    def _leave(self, name: str) -> None:
        self.depth[name] -= 1

    def _resident_bytes(self) -> dict[str, int]:
        seen, per_component = set(), {}
        for name, module in self.modules.items():
            for tensor in [*module.parameters(), *module.buffers()]:
                pointer = tensor.untyped_storage().data_ptr()
                if pointer in self.backend.pointers and pointer not in seen:
                    seen.add(pointer)
                    per_component[name] = per_component.get(name, 0) + tensor.untyped_storage().nbytes()
        return per_component


def engine_residency(loaded, variant: str, strategy: MemoryStrategy) -> ResidencyProbe:
    backend = DeviceLedger()
    probe = ResidencyProbe(loaded.pipe, backend)
    try:
        sample(loaded, strategy, request_for(variant), backend=backend, observer=probe.observer)
    finally:
        probe.remove()
    return probe


def planner_residency(folder, variant: str, strategy: MemoryStrategy) -> dict[str, int]:
    """Component -> weight bytes of its device phase (text encode and denoise stages)."""
    spec = tiny_spec(variant)
    model = load_model(str(folder), dtype="fp32")
    shape, options = VideoShape(spec.width, spec.height, spec.frames), PlanOptions(steps=2)
    phases = [*text_encode_stage(model, shape, strategy, options).phases, *denoise_stage(model, shape, strategy, options).phases]
    return {phase.label.removesuffix(" (image)"): phase.weights_bytes for phase in phases}


@pytest.mark.parametrize("variant", TINY_VARIANTS)
def test_planner_resident_weights_equal_what_the_engine_held(variant, tiny_loaded, tiny_folder):
    loaded = tiny_loaded(variant)
    loaded = loaded.image_mode() if tiny_spec(variant).needs_image else loaded
    blocks = min(len(b) for b in denoiser_blocks(loaded.pipe, loaded.spec).values())
    failures = []
    for placement in PLACEMENTS:
        for tier, settings in TIERS.items():
            settings = {k: blocks if v == "all" else v for k, v in settings.items()}
            strategy = MemoryStrategy(text_encoder=placement, **settings)
            probe = engine_residency(loaded, variant, strategy)
            engine = {name: probe.peak[name] for name in probe.on_device}
            planned = planner_residency(tiny_folder(variant), variant, strategy)
            bounded = {n for n in engine if (tier, n) in UPPER_BOUND_ONLY and n in planned and engine[n] <= planned[n]}
            if {n: b for n, b in engine.items() if n not in bounded} != {n: b for n, b in planned.items() if n not in bounded}:
                failures.append(f"{placement}/{tier}: engine {engine} != planner {planned}")
    assert not failures, f"{variant}:\n" + "\n".join(failures)


@pytest.mark.parametrize("variant", TINY_VARIANTS)
def test_the_planner_counts_the_components_the_sampler_places(variant, tiny_loaded, tiny_folder):
    """One declaration: the sampler's stage and the planner model's stage name the same components."""
    loaded = tiny_loaded(variant)
    loaded = loaded.image_mode() if tiny_spec(variant).needs_image else loaded
    model = load_model(str(tiny_folder(variant)), dtype="fp32")
    for placement in TextEncoderPlacement:
        for encode_text in (True, False):
            strategy = MemoryStrategy(text_encoder=placement)
            engine = tuple(sample_stage(loaded, strategy, encode_text).modules)
            assert engine == model.stage_components(placement, encode_text), (placement, encode_text)


def test_an_image_encoder_follows_the_tier_when_the_prompt_encoder_is_on_the_cpu(tiny_loaded):
    """A past drift: Wan 2.1 I2V's CLIP encoder runs on the device with text_encoder=cpu."""
    loaded = tiny_loaded("wan2.1-i2v")
    present = [n for n, c in loaded.pipe.components.items() if isinstance(c, torch.nn.Module)]
    names = stage_components(loaded.spec, present, TextEncoderPlacement.CPU, image=True)
    assert "image_encoder" in names and "text_encoder" not in names
    assert stage_components(loaded.spec, present, TextEncoderPlacement.DEVICE, image=True, encode_text=False) == names
