"""Attention kernels that take no mask, on the families whose attention passes one (review: attention 'flash' on
LTX-2 and HunyuanVideo 1.5 failed with diffusers' bare "`attn_mask` is not supported for native flash attention"
after make_room). Every kernel the CPU accepts, on every family, runs or is refused before room is made; the
family declaration is held to the masks the tiny models' attention really passes."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

sys.path.insert(0, str(Path(__file__).resolve().parent))

from backends import StrictBackend  # noqa: E402
from test_tiers import request_for  # noqa: E402
from vidmem.memory import MemoryStrategy  # noqa: E402
from vidmem.pipelines.attention import MASKLESS, AttentionError, AttentionKernel, resolve_attention  # noqa: E402
from vidmem.pipelines.family import denoisers  # noqa: E402
from vidmem.pipelines.hooks import RunHooks  # noqa: E402
from vidmem.pipelines.sample import sample  # noqa: E402
from vidmem.pipelines.speed import Speed, speed_plan_line  # noqa: E402

FAMILY_VARIANTS = ("cogvideox-t2v", "wan2.1-t2v", "ltx2-t2v", "hunyuanvideo1.5-t2v")


def _cpu_accepts(kernel: AttentionKernel) -> bool:
    try:
        resolve_attention(kernel, "cpu", torch.float32)
        return True
    except AttentionError:
        return False


CPU_KERNELS = [k for k in AttentionKernel if _cpu_accepts(k)]


class _MaskSpy(TorchFunctionMode):
    """Records whether any SDPA call inside a denoiser (the dispatcher's 'native' backend ends in one) got a
    mask; the text encoders' attention is not the kernel's business."""

    def __init__(self) -> None:
        super().__init__()
        self.masked, self.inside = False, False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and self.inside:
            self.masked |= (kwargs.get("attn_mask") if "attn_mask" in kwargs else (args[3:4] or [None])[0]) is not None
        return func(*args, **kwargs)


@pytest.mark.parametrize("variant", FAMILY_VARIANTS)
def test_the_family_declares_a_mask_exactly_when_its_attention_passes_one(tiny_loaded, variant):
    loaded = tiny_loaded(variant)
    spy = _MaskSpy()
    handles = [hook for denoiser in denoisers(loaded.pipe, loaded.spec).values() for hook in (
        denoiser.register_forward_pre_hook(lambda *_: setattr(spy, "inside", True)),
        denoiser.register_forward_hook(lambda *_: setattr(spy, "inside", False), always_call=True))]
    try:
        with spy:
            sample(loaded, MemoryStrategy(offload="none"), request_for(variant, steps=2), backend=StrictBackend())
    finally:
        for handle in handles:
            handle.remove()
    assert loaded.spec.attention_masked == spy.masked


@pytest.mark.parametrize("variant", FAMILY_VARIANTS)
def test_every_kernel_the_cpu_accepts_runs_or_is_refused_before_room_is_made(tiny_loaded, variant):
    loaded = tiny_loaded(variant)
    assert {AttentionKernel.AUTO, AttentionKernel.FLASH, AttentionKernel.MATH} <= set(CPU_KERNELS)
    for kernel in CPU_KERNELS:
        rooms = []
        hooks = RunHooks(make_room=lambda nbytes, device, **_: rooms.append(nbytes))
        request = replace(request_for(variant, steps=2), speed=Speed(kernel))
        refuses = kernel in MASKLESS and loaded.spec.attention_masked
        try:
            result = sample(loaded, MemoryStrategy(offload="block_swap", blocks_to_swap=1), request, hooks,
                            backend=StrictBackend())
        except AttentionError as error:
            assert refuses, f"{variant} refused {kernel.value}: {error}"
            assert rooms == [], f"{variant} {kernel.value} was refused after make_room"
            assert f"attention={kernel.value!r} cannot run {loaded.spec.name}" in str(error)
            assert "'auto'" in str(error) and "'math'" in str(error) and "'flash'" not in str(error).split("choose")[1]
            continue
        assert not refuses, f"{variant} ran {kernel.value}"
        assert torch.isfinite(result.latent["samples"]).all()
        if kernel is AttentionKernel.AUTO:  # auto never picks a mask-less kernel
            assert result.receipt["speed"]["attention"]["kernel"] not in {k.value for k in MASKLESS}


def test_the_plan_line_refuses_a_mask_less_kernel_on_a_masked_model_as_the_sampler_does():
    masked = speed_plan_line(Speed("flash"), "cpu", torch.float32, "ltx2 (ltx2-t2v-19b)")
    assert masked.startswith("refused: attention='flash' cannot run ltx2 (ltx2-t2v-19b)"), masked
    assert speed_plan_line(Speed("flash"), "cpu", torch.float32).startswith("attention flash")
    assert speed_plan_line(Speed("auto"), "cpu", torch.float32, "ltx2 (ltx2-t2v-19b)").startswith("attention sdpa")
    if not torch.cuda.is_available():  # planning for a GPU this process cannot see: the mask is known anyway
        on_gpu = speed_plan_line(Speed("sage"), "cuda", torch.bfloat16, "hunyuanvideo1.5 (x)")
        assert on_gpu.startswith("refused: attention='sage' cannot run hunyuanvideo1.5"), on_gpu


def test_the_plan_route_refuses_flash_on_ltx2(tiny_folder):
    from vidmem.memory.units import GiB
    from vidmem.nodes.plan_route import parse_request, plan_answer
    from vidmem.pipelines.configs import load_model

    folder = tiny_folder("ltx2-t2v")
    q = dict(model="ltx", dtype="fp32", offload="none", blocks_to_swap="0", prefetch_blocks="1", max_pinned_ram_gb="-1",
             non_blocking="true", text_encoder="cpu", vae_slicing="false", vae_tiling="false", tile_size="256",
             overlap="64", temporal_size="64", temporal_overlap="8", vram_budget_gb="1", ram_budget_gb="64",
             width="64", height="64", frames="9", cfg="5", speed_attention="flash", speed_compile="false",
             speed_compile_mode="default", speed_compile_dynamic="auto", speed_fp8_matmul="off")
    answer = plan_answer(parse_request(q, ["ltx"], ["fp32"]), lambda name, dtype: load_model(str(folder), dtype),
                         (8 * GiB, 64 * GiB), device="cpu")
    assert answer["status"] == "ok", answer
    (line,) = answer["speed"]
    assert line.startswith("speed: refused: attention='flash' cannot run ltx2"), line
