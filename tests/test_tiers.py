"""Every tier gives the plain diffusers latents bit for bit, and puts weights where it says."""

from __future__ import annotations

import pytest
import torch

from backends import Recorder, StrictBackend
from vidmem.memory import MemoryStrategy
from vidmem.memory.device import CpuBackend
from vidmem.pipelines.family import denoiser_blocks
from vidmem.pipelines.sample import RunHooks, SampleRequest, sample
from vidmem.pipelines.tiny import TINY_VARIANTS, tiny_call_kwargs, tiny_spec

STEPS = 2


def request_for(variant: str, steps: int = STEPS) -> SampleRequest:
    spec = tiny_spec(variant)
    image = torch.full((1, spec.height, spec.width, 3), 128 / 255) if spec.needs_image else None
    last_image = torch.full((1, spec.height, spec.width, 3), 200 / 255) if spec.last_image else None
    return SampleRequest("a cat", "", spec.width, spec.height, spec.frames, steps, 5.0, 0, image, last_image=last_image)


def block_count(loaded) -> int:
    return min(len(b) for b in denoiser_blocks(loaded.pipe, loaded.spec).values())


def strategies(loaded) -> dict[str, MemoryStrategy]:
    n = block_count(loaded)
    tiers = {
        "none": MemoryStrategy(offload="none"),
        "model": MemoryStrategy(offload="model"),
        "model/te-cpu": MemoryStrategy(offload="model", text_encoder="cpu"),
        "model/te-device": MemoryStrategy(offload="model", text_encoder="device"),
        "sequential": MemoryStrategy(offload="sequential"),
        "sequential/p0": MemoryStrategy(offload="sequential", prefetch_blocks=0),
    }
    for swap in sorted({1, max(1, n // 2), n}):
        for prefetch in (0, 1, 2):
            tiers[f"block_swap:{swap}:{prefetch}"] = MemoryStrategy(
                offload="block_swap", blocks_to_swap=swap, prefetch_blocks=prefetch
            )
    return tiers


def storage_map(pipe) -> dict[str, tuple[int, torch.device]]:
    """Where every parameter and buffer of every component points, by qualified name."""
    found = {}
    for name, component in pipe.components.items():
        if isinstance(component, torch.nn.Module):
            for key, tensor in list(component.named_parameters()) + list(component.named_buffers()):
                found[f"{name}.{key}"] = (tensor.data_ptr(), tensor.device)
    return found


def hooks_of(pipe) -> dict[str, int]:
    """Forward hooks per module (transformers installs some of its own, so compare, don't zero)."""
    return {
        f"{name}.{path}": len(m._forward_pre_hooks) + len(m._forward_hooks)
        for name, c in pipe.components.items()
        if isinstance(c, torch.nn.Module)
        for path, m in c.named_modules()
    }


@pytest.mark.parametrize("variant", TINY_VARIANTS)
def test_every_tier_matches_plain_diffusers_bit_for_bit(variant, tiny_loaded):
    loaded = tiny_loaded(variant)
    reference = loaded.spec.to_comfy_latent(
        loaded.pipe, loaded.pipe(**tiny_call_kwargs(variant, steps=STEPS)).frames, tiny_spec(variant).frames
    )
    before, hooks_before = storage_map(loaded.pipe), hooks_of(loaded.pipe)
    for label, strategy in strategies(loaded).items():
        latent = sample(loaded, strategy, request_for(variant), backend=CpuBackend()).latent
        assert torch.equal(latent["samples"], reference), f"{variant} {label} differs from diffusers"
        assert latent["vidmem"]["family"] == loaded.spec.name
    assert storage_map(loaded.pipe) == before
    assert hooks_of(loaded.pipe) == hooks_before


@pytest.mark.parametrize("variant", TINY_VARIANTS)
def test_weights_are_only_used_where_the_schedule_placed_them(variant, tiny_loaded):
    """Evicted weights are poisoned under StrictBackend: touching one ruins the latents."""
    loaded = tiny_loaded(variant)
    loaded.pipe(**tiny_call_kwargs(variant, steps=1))  # transformers adds its own hooks on first use
    before, hooks_before = storage_map(loaded.pipe), hooks_of(loaded.pipe)
    results = {}
    for label, strategy in strategies(loaded).items():
        recorder = Recorder()
        backend = StrictBackend()
        results[label] = sample(loaded, strategy, request_for(variant), backend=backend, observer=recorder)
        assert storage_map(loaded.pipe) == before, f"{label} left a tensor off its original storage"
        assert hooks_of(loaded.pipe) == hooks_before
        if strategy.streams_blocks:
            assert recorder.peak_streamed <= strategy.prefetch_blocks + 1, label
            assert backend.copies > 0
    first = results["none"].latent["samples"]
    for label, result in results.items():
        assert torch.equal(result.latent["samples"], first), f"{variant} {label} differs from tier none"


def test_model_tier_keeps_one_component_on_the_device(tiny_loaded):
    loaded = tiny_loaded("wan2.2-a14b")
    recorder = Recorder()
    sample(loaded, MemoryStrategy(offload="model", text_encoder="device"), request_for("wan2.2-a14b", steps=4),
           backend=StrictBackend(), observer=recorder)
    onloads = [name for kind, name in recorder.events if kind == "onload"]
    assert onloads == ["text_encoder", "transformer", "transformer_2"]
    events = recorder.events
    assert events.index(("evict", "text_encoder")) < events.index(("onload", "transformer"))
    assert events.index(("evict", "transformer")) < events.index(("onload", "transformer_2"))


def test_block_swap_streams_only_the_last_blocks(tiny_loaded):
    loaded = tiny_loaded("wan2.1-t2v")
    recorder = Recorder()
    sample(loaded, MemoryStrategy(offload="block_swap", blocks_to_swap=1, prefetch_blocks=0),
           request_for("wan2.1-t2v"), backend=StrictBackend(), observer=recorder)
    streamed = {name for kind, name in recorder.events if "." in name}
    last = len(loaded.pipe.transformer.blocks) - 1
    assert streamed == {f"transformer.blocks.{last}"}
    # one onload per forward: 2 steps x (cond + uncond) passes
    assert [kind for kind, name in recorder.events if name == f"transformer.blocks.{last}"].count("onload") == STEPS * 2


class Interrupted(Exception):
    pass


@pytest.mark.parametrize("offload,blocks", [("none", 0), ("model", 0), ("block_swap", 1), ("sequential", 0)])
def test_interrupt_mid_run_leaves_nothing_applied(offload, blocks, tiny_loaded):
    loaded = tiny_loaded("wan2.1-t2v")
    before, hooks_before = storage_map(loaded.pipe), hooks_of(loaded.pipe)
    steps_seen = []

    def interrupt_after_first_step() -> None:
        if steps_seen:
            raise Interrupted()

    hooks = RunHooks(on_step=lambda done, total: steps_seen.append(done), check_interrupt=interrupt_after_first_step)
    with pytest.raises(Interrupted):
        sample(loaded, MemoryStrategy(offload=offload, blocks_to_swap=blocks), request_for("wan2.1-t2v", steps=3),
               hooks=hooks, backend=StrictBackend())
    assert steps_seen == [1]
    assert storage_map(loaded.pipe) == before
    assert hooks_of(loaded.pipe) == hooks_before
    assert not hasattr(loaded.pipe, "vidmem_execution_device")


def test_execution_device_comes_from_the_strategy_not_the_weights(tiny_loaded):
    pipe = tiny_loaded("wan2.1-t2v").pipe
    assert pipe._execution_device == torch.device("cpu")
    pipe.vidmem_execution_device = torch.device("cuda", 0)
    try:
        assert pipe._execution_device == torch.device("cuda", 0)
    finally:
        del pipe.vidmem_execution_device
    assert pipe._execution_device == torch.device("cpu")


def test_ti2v_folder_runs_image_to_video_when_given_an_image(tiny_loaded):
    """Wan 2.2 TI2V-5B: one WanPipeline folder; with an image vidmem runs diffusers' I2V class over it."""
    import dataclasses

    from diffusers import WanImageToVideoPipeline
    from PIL import Image

    loaded = tiny_loaded("wan2.2-ti2v")
    spec = tiny_spec("wan2.2-ti2v")
    image = torch.rand(1, spec.height, spec.width, 3)
    request = dataclasses.replace(request_for("wan2.2-ti2v"), image=image)
    reference_pipe = WanImageToVideoPipeline(**loaded.pipe.components, expand_timesteps=True)
    reference_pipe.set_progress_bar_config(disable=True)
    pixels = (image[0].clamp(0, 1) * 255).round().to(torch.uint8).numpy()
    kwargs = dict(tiny_call_kwargs("wan2.2-ti2v", steps=STEPS), image=Image.fromarray(pixels))
    with torch.no_grad():
        reference = reference_pipe(**kwargs).frames
    for strategy in (MemoryStrategy(offload="none"), MemoryStrategy(offload="block_swap", blocks_to_swap=1)):
        result = sample(loaded, strategy, request, backend=CpuBackend())
        assert torch.equal(result.latent["samples"], reference)
        assert result.latent["vidmem"]["class_name"] == "WanImageToVideoPipeline"
    assert loaded.image_mode() is loaded.image_mode()  # built once, sharing the components
    assert loaded.image_mode().pipe.transformer is loaded.pipe.transformer


def test_text_encoder_on_cpu_leaves_the_image_encoder_to_the_tier(tiny_loaded):
    from vidmem.pipelines.sample import sample_stage

    loaded = tiny_loaded("wan2.1-i2v")
    stage = sample_stage(loaded, MemoryStrategy(offload="model", text_encoder="cpu"))
    assert "text_encoder" not in stage.modules and "image_encoder" in stage.modules and "vae" in stage.modules
