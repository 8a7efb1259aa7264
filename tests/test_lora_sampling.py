"""LoRAs wired into sampling: applied for the call before the strategy and removed after it.

A pipeline value carrying a LoRA samples other latents than its base, the same bits under every
tier and prefetch depth (StrictBackend poisons evicted tensors, LoRA buffers included), strength 0
gives the base exactly, nothing stays on any module afterwards, and the base value sampled right
after (sharing every module) gives the base latents.
"""

from __future__ import annotations

import pytest
import torch

from backends import StrictBackend
from test_lora import peft_keys, random_lora, write
from test_tiers import hooks_of, request_for, storage_map
from vidmem.memory import MemoryStrategy
from vidmem.memory.lora import BUFFER_PREFIX
from vidmem.pipelines.lora import load_lora, with_lora
from vidmem.pipelines.sample import sample

TIERS = {
    "none": MemoryStrategy(offload="none"),
    "model": MemoryStrategy(offload="model"),
    **{f"block_swap:{n}:p{p}": MemoryStrategy(offload="block_swap", blocks_to_swap=n, prefetch_blocks=p) for n in (1, 2) for p in (0, 1, 2)},
    **{f"sequential:p{p}": MemoryStrategy(offload="sequential", prefetch_blocks=p) for p in (0, 1, 2)},
}
WAN_TARGETS = [f"blocks.{i}.{m}" for i in range(2) for m in ("attn1.to_q", "attn1.to_v", "attn2.to_k", "ffn.net.0.proj")] + ["proj_out"]


def lora_buffers(pipe) -> list[str]:
    return [f"{name}.{key}" for name, c in pipe.components.items() if isinstance(c, torch.nn.Module)
            for key, _ in c.named_buffers() if BUFFER_PREFIX in key]


def lora_file(tmp_path, model, name="style.safetensors", seed=1):
    return write(tmp_path / name, peft_keys(random_lora(model, WAN_TARGETS, seed=seed), None))


def latents(loaded, strategy=TIERS["model"], variant="wan2.1-t2v", **changes):
    import dataclasses

    result = sample(loaded, strategy, dataclasses.replace(request_for(variant), **changes), backend=StrictBackend())
    return result.latent["samples"], result.receipt


@pytest.fixture(scope="module")
def wan(tiny_loaded):
    base = tiny_loaded("wan2.1-t2v")
    latents(base)  # transformers adds hooks of its own on first use: snapshot after it
    return base


def test_lora_changes_the_latents_and_is_bit_identical_across_tiers(wan, tmp_path):
    spec = load_lora(lora_file(tmp_path, wan.pipe.transformer), wan.pipe, 0.8)
    styled = with_lora(wan, spec)
    before, hooks_before = storage_map(wan.pipe), hooks_of(wan.pipe)
    base, _ = latents(wan)
    reference, receipt = latents(styled, TIERS["none"])
    assert not torch.equal(reference, base)
    assert receipt["lora"].startswith("LoRA: style.safetensors x0.8") and receipt["lora_bytes"] == spec.nbytes > 0
    for label, strategy in TIERS.items():
        out, _ = latents(styled, strategy)
        assert torch.equal(out, reference), f"{label} differs"
        assert lora_buffers(wan.pipe) == [], f"{label} left LoRA buffers"
        assert storage_map(wan.pipe) == before and hooks_of(wan.pipe) == hooks_before, label
    after, _ = latents(wan, TIERS["block_swap:1:p1"])  # the base value, sharing every module
    assert torch.equal(after, base)


def test_strength_zero_is_the_base_exactly(wan, tmp_path):
    zero = with_lora(wan, load_lora(lora_file(tmp_path, wan.pipe.transformer), wan.pipe, 0.0))
    for strategy in (TIERS["model"], TIERS["sequential:p1"]):
        out, receipt = latents(zero, strategy)
        assert torch.equal(out, latents(wan, strategy)[0]) and receipt["lora_bytes"] == 0


def test_lora_bytes_count_in_the_device_weight_bytes(wan, tmp_path):
    spec = load_lora(lora_file(tmp_path, wan.pipe.transformer), wan.pipe, 1.0)
    _, plain = latents(wan, TIERS["none"])
    _, styled = latents(with_lora(wan, spec), TIERS["none"])
    assert styled["device_weight_bytes"] - plain["device_weight_bytes"] == spec.nbytes
    assert plain["lora"] == "no LoRA"


def test_a_failing_run_leaves_no_lora_applied(wan, tmp_path):
    spec = load_lora(lora_file(tmp_path, wan.pipe.transformer), wan.pipe, 1.0)
    before, hooks_before = storage_map(wan.pipe), hooks_of(wan.pipe)

    class Stop(Exception):
        pass

    def stop():
        raise Stop()

    from vidmem.pipelines.hooks import RunHooks

    with pytest.raises(Stop):
        sample(with_lora(wan, spec), TIERS["block_swap:1:p1"], request_for("wan2.1-t2v"),
               hooks=RunHooks(on_step=lambda done, total: stop()), backend=StrictBackend())
    assert lora_buffers(wan.pipe) == []
    assert storage_map(wan.pipe) == before and hooks_of(wan.pipe) == hooks_before


def test_two_expert_loras_per_expert(tiny_loaded, tmp_path):
    """Wan 2.2 A14B: a LoRA on each expert changes only its expert's steps; one file on both
    experts equals the same file loaded once per expert, bit for bit, under every tier."""
    a14b = tiny_loaded("wan2.2-a14b")
    path = lora_file(tmp_path, a14b.pipe.transformer, "moe.safetensors")
    on = {expert: with_lora(a14b, load_lora(path, a14b.pipe, 1.0, expert)) for expert in ("high_noise", "low_noise", "both")}
    split = with_lora(on["high_noise"], load_lora(path, a14b.pipe, 1.0, "low_noise"))
    base, _ = latents(a14b, variant="wan2.2-a14b")
    outs = {expert: latents(value, variant="wan2.2-a14b")[0] for expert, value in on.items()}
    assert len({out.flatten()[:64].numpy().tobytes() for out in [base, *outs.values()]}) == 4
    for label in ("none", "block_swap:2:p2", "sequential:p0"):
        assert torch.equal(latents(split, TIERS[label], "wan2.2-a14b")[0], outs["both"]), label
    assert lora_buffers(a14b.pipe) == []
    assert torch.equal(latents(a14b, variant="wan2.2-a14b")[0], base)


def test_a_comfyui_lora_on_the_image_cross_attention_of_wan21_i2v_applies(tiny_loaded, tmp_path):
    """Wan 2.1 I2V LoRAs train the image tokens' projections too (cross_attn.k_img / v_img in Wan's and ComfyUI's
    names, attn2.add_k_proj / add_v_proj in diffusers'): their terms land on those layers and change the video."""
    loaded = tiny_loaded("wan2.1-i2v")
    lora = random_lora(loaded.pipe.transformer, ["blocks.0.attn2.add_k_proj", "blocks.1.attn2.add_v_proj"])
    names = {"blocks.0.attn2.add_k_proj": "blocks.0.cross_attn.k_img", "blocks.1.attn2.add_v_proj": "blocks.1.cross_attn.v_img"}
    tensors = {f"diffusion_model.{names[n]}.lora_{ab}.weight": t for n, (a, b) in lora.items() for ab, t in (("down", a), ("up", b))}
    spec = load_lora(write(tmp_path / "i2v.safetensors", tensors), loaded.pipe, 1.0)
    assert {layer.module for layer in spec.layers["transformer"]} == set(names) and not spec.skipped
    base, _ = latents(loaded, variant="wan2.1-i2v")
    changed, _ = latents(with_lora(loaded, spec), variant="wan2.1-i2v")
    assert not torch.equal(base, changed)
