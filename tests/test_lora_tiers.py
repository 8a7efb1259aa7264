"""LoRAs under every tier and storage: bit-identical across tiers and prefetch depths (the strict
backend poisons evicted tensors, so a LoRA tensor used while evicted ruins the output), strength 0
is the base exactly, removal restores every tensor bit for bit, and pipelines sharing modules never
see each other's LoRAs."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from backends import StrictBackend
from test_lora import WAN_LAYERS, needs_peft, peft_keys, random_lora, wan_inputs, write
from vidmem.memory import MemoryStrategy
from vidmem.memory.device import CpuBackend
from vidmem.memory.lora import BUFFER_PREFIX, LoraPatch, apply_loras
from vidmem.memory.offload import StageComponents, apply_strategy
from vidmem.memory.storage import StoredLinear, quantize, storage_format
from vidmem.pipelines.lora import load_lora, lora_patches
from vidmem.pipelines.tiny import build_tiny_pipeline, tiny_call_kwargs

TIERS = {
    "none": MemoryStrategy(offload="none"),
    "model": MemoryStrategy(offload="model"),
    **{f"block_swap:{n}:p{p}": MemoryStrategy(offload="block_swap", blocks_to_swap=n, prefetch_blocks=p) for n in (1, 2) for p in (0, 1, 2)},
    **{f"sequential:p{p}": MemoryStrategy(offload="sequential", prefetch_blocks=p) for p in (0, 1, 2)},
}
ALL_LINEARS = WAN_LAYERS + ["proj_out", "condition_embedder.time_proj", "condition_embedder.text_embedder.linear_1"]


@pytest.fixture(scope="module")
def wan():
    return build_tiny_pipeline("wan2.1-t2v")


@pytest.fixture(scope="module")
def spec(wan, tmp_path_factory):
    path = tmp_path_factory.mktemp("lora") / "wan.safetensors"
    return load_lora(write(path, peft_keys(random_lora(wan.transformer, ALL_LINEARS), None)), wan, 0.9)


def snapshot(model):
    """Every parameter and buffer: where it points and what it holds; and the hook counts."""
    tensors = {name: (t.data_ptr(), t.clone()) for name, t in [*model.named_parameters(), *model.named_buffers()]}
    hooks = {name: (len(m._forward_hooks), len(m._forward_pre_hooks)) for name, m in model.named_modules()}
    return tensors, hooks


def assert_restored(model, before):
    tensors, hooks = snapshot(model)
    assert tensors.keys() == before[0].keys(), "a buffer was left behind or lost"
    for name, (ptr, value) in before[0].items():
        assert tensors[name][0] == ptr and torch.equal(tensors[name][1], value), f"{name} changed"
    assert hooks == before[1]


def run_tier(model, patches, strategy, backend, inputs):
    """The ordering rule: LoRAs first, then the strategy; removed in reverse."""
    stage = StageComponents({"transformer": model}, {"transformer": model.blocks})
    with torch.no_grad(), apply_loras(patches), apply_strategy(stage, strategy, backend):
        return model(**inputs)[0]


def test_bit_identical_across_tiers_and_prefetch_depths(wan, spec):
    model, patches = wan.transformer, lora_patches(wan, [spec])
    before = snapshot(model)
    reference = run_tier(model, patches, TIERS["none"], CpuBackend(), wan_inputs())
    with torch.no_grad():
        base = model(**wan_inputs())[0]
    assert not torch.equal(reference, base)
    for label, strategy in TIERS.items():
        out = run_tier(model, patches, strategy, StrictBackend(), wan_inputs())
        assert torch.equal(out, reference), f"{label} differs"
        assert_restored(model, before)


def test_lora_buffers_stream_with_their_layer(wan, spec):
    """Under sequential, each LoRA buffer is in its own leaf's group, not in the resident core."""
    model, patches = wan.transformer, lora_patches(wan, [spec])
    stage = StageComponents({"transformer": model}, {"transformer": model.blocks})
    with apply_loras(patches), apply_strategy(stage, TIERS["sequential:p1"], StrictBackend()) as handle:
        streamed = [g for g in handle.groups if g.name != "transformer"]
        lora_groups = {g.name for g in streamed for owners in g._tensors for slot in owners if slot.name.startswith(BUFFER_PREFIX)}
        core = next(g for g in handle.groups if g.name == "transformer")
        assert not any(slot.name.startswith(BUFFER_PREFIX) for owners in core._tensors for slot in owners)
    assert lora_groups == {f"transformer.{layer.module}" for layer in spec.layers["transformer"]}


def test_strength_zero_is_the_base_exactly_and_attaches_nothing(wan, spec, tmp_path):
    zero = load_lora(spec.path, wan, 0.0)
    assert lora_patches(wan, [zero]) == []
    model = wan.transformer
    with torch.no_grad():
        base = model(**wan_inputs())[0]
    patch = LoraPatch(model.proj_out, 0.0, torch.ones(2, 24), torch.ones(64, 2), name="proj_out")
    with apply_loras([patch]) as handle:
        assert handle.applied == [] and not any(n.startswith(BUFFER_PREFIX) for n, _ in model.named_buffers())
        assert torch.equal(run_tier(model, lora_patches(wan, [zero]), TIERS["sequential:p1"], StrictBackend(), wan_inputs()), base)


def test_removal_restores_every_tensor_even_when_the_call_raises(wan, spec):
    model = wan.transformer
    before = snapshot(model)
    with pytest.raises(RuntimeError, match="boom"):
        with apply_loras(lora_patches(wan, [spec])) as handle:
            assert handle.nbytes == spec.nbytes > 0
            raise RuntimeError("boom")
    assert_restored(model, before)


def test_a_failed_apply_leaves_nothing(wan, spec):
    model = wan.transformer
    before = snapshot(model)
    good = lora_patches(wan, [spec])
    with apply_loras(good[:1]):  # a second handle on the same layer is refused, and rolls back
        inner_before = snapshot(model)
        with pytest.raises(ValueError, match="already carries LoRA buffer"):
            apply_loras(good)
        assert_restored(model, inner_before)
    assert_restored(model, before)


def test_pipelines_sharing_modules_do_not_see_each_others_loras(wan, spec):
    """Pipeline A (with the LoRA) and B (without) share one transformer; calls interleave."""
    model = wan.transformer
    with torch.no_grad():
        base = model(**wan_inputs())[0]
    runs = []
    for loras in ((spec,), (), (spec,), ()):
        runs.append(run_tier(model, lora_patches(wan, list(loras)), TIERS["block_swap:1:p1"], StrictBackend(), wan_inputs()))
    assert torch.equal(runs[1], base) and torch.equal(runs[3], base)
    assert torch.equal(runs[0], runs[2]) and not torch.equal(runs[0], base)


@pytest.mark.parametrize("fmt", ["fp8_e4m3fn", "fp8_scaled", "gguf_q8_0"])
def test_stored_weights_take_loras_beside_the_layer(fmt, wan, spec):
    """fp8 / scaled fp8 / GGUF StoredLinear layers: bit-identical across tiers, equal to a plain model
    holding the dequantized weights, and the stored bytes are never touched."""
    stored, plain = copy.deepcopy(wan.transformer), copy.deepcopy(wan.transformer)
    block = storage_format(fmt).block_size or 1  # GGUF needs rows of whole 32-value blocks
    quantized = [n for n in ALL_LINEARS if wan.transformer.get_submodule(n).in_features % block == 0]
    assert len(quantized) >= 3
    for name in quantized:
        parent, leaf = name.rsplit(".", 1) if "." in name else ("", name)
        linear = stored.get_submodule(name)
        weight = quantize(linear.weight.data, fmt)
        setattr(stored.get_submodule(parent) if parent else stored, leaf, StoredLinear(weight, linear.bias.data.clone(), torch.float32))
        plain.get_submodule(name).weight.data = weight.dequantize(torch.float32)
    holder = type("Pipe", (), {"transformer": stored})()
    twin = type("Pipe", (), {"transformer": plain})()
    before = snapshot(stored)
    reference = run_tier(stored, lora_patches(holder, [spec]), TIERS["none"], CpuBackend(), wan_inputs())
    for label, strategy in TIERS.items():
        assert torch.equal(run_tier(stored, lora_patches(holder, [spec]), strategy, StrictBackend(), wan_inputs()), reference), f"{fmt} {label}"
    assert_restored(stored, before)
    plain_out = run_tier(plain, lora_patches(twin, [spec]), TIERS["none"], CpuBackend(), wan_inputs())
    assert torch.allclose(reference, plain_out, rtol=0, atol=1e-5 * plain_out.abs().max())


@needs_peft
def test_a_whole_denoising_run_matches_diffusers_fused(wan, spec):
    """Frames (latents) of a 2-step run: ours beside the layers vs diffusers' fused LoRA."""
    with torch.no_grad(), apply_loras(lora_patches(wan, [spec])):
        ours = wan(**tiny_call_kwargs("wan2.1-t2v")).frames
    reference = build_tiny_pipeline("wan2.1-t2v")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference.load_lora_weights(spec.path)
        reference.fuse_lora(lora_scale=spec.strength)
    theirs = reference(**tiny_call_kwargs("wan2.1-t2v")).frames
    base = wan(**tiny_call_kwargs("wan2.1-t2v")).frames
    assert (ours - base).abs().max() > 1e-3
    assert torch.allclose(ours, theirs, rtol=0, atol=1e-5 * theirs.abs().max())


def test_two_expert_model_applies_to_the_chosen_expert(tmp_path):
    pipe = build_tiny_pipeline("wan2.2-a14b")
    path = write(tmp_path / "expert.safetensors", peft_keys(random_lora(pipe.transformer, WAN_LAYERS), None))
    for expert, components in (("high_noise", {"transformer"}), ("low_noise", {"transformer_2"}), ("both", {"transformer", "transformer_2"})):
        spec = load_lora(path, pipe, 1.0, expert)
        assert set(spec.layers) == components
        owners = {id(getattr(pipe, c)) for c in components}
        targets = {p.name.split(".")[0] for p in lora_patches(pipe, [spec])}
        assert targets == components and len(owners) == len(components)


def test_fused_alternative_is_exactly_undone_and_tier_independent(wan, spec):
    model, patches = wan.transformer, lora_patches(wan, [spec])
    before = snapshot(model)
    beside = run_tier(model, patches, TIERS["none"], CpuBackend(), wan_inputs())
    stage = StageComponents({"transformer": model}, {"transformer": model.blocks})
    outputs = {}
    for label, strategy in TIERS.items():
        with torch.no_grad(), apply_loras(patches, fuse=True) as handle, apply_strategy(stage, strategy, StrictBackend()):
            outputs[label] = model(**wan_inputs())[0]
            assert not any(n.startswith(BUFFER_PREFIX) for n, _ in model.named_buffers())
            assert handle.nbytes == sum(model.get_submodule(l.module).weight.numel() * 4 for l in spec.layers["transformer"])
        assert_restored(model, before)
    assert all(torch.equal(out, outputs["none"]) for out in outputs.values())
    assert torch.allclose(outputs["none"], beside, rtol=0, atol=1e-5 * beside.abs().max())


@needs_peft
def test_fused_alternative_equals_diffusers_fuse_lora_bit_for_bit(wan, spec):
    reference = build_tiny_pipeline("wan2.1-t2v")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference.load_lora_weights(spec.path)
        reference.fuse_lora(lora_scale=spec.strength)
    with torch.no_grad(), apply_loras(lora_patches(wan, [spec]), fuse=True):
        ours = wan.transformer(**wan_inputs())[0]
        theirs = reference.transformer(**wan_inputs())[0]
    assert torch.equal(ours, theirs)


def test_fused_alternative_refuses_quantized_storage(wan, spec):
    layer = wan.transformer.get_submodule("blocks.0.ffn.net.2")
    stored = StoredLinear(quantize(layer.weight.data, "fp8_e4m3fn"), layer.bias.data.clone(), torch.float32)
    patch = LoraPatch(stored, 1.0, torch.ones(2, 32), torch.ones(24, 2), name="blocks.0.ffn.net.2")
    with pytest.raises(ValueError, match="fuse=True needs a plain floating-point weight.*fuse=False"):
        apply_loras([patch], fuse=True)
    assert not stored._buffers.keys() & {f"{BUFFER_PREFIX}0_down"}


def test_fused_chained_loras_round_once_and_undo_exactly():
    """Two LoRAs on one bf16 weight (and bias): the float32 sum, rounded once, as the docstring says."""
    gen = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(64, 64).to(torch.bfloat16)
    weight, bias = layer.weight.data, layer.bias.data
    terms = [(torch.randn(4, 64, generator=gen) * 0.05, torch.randn(64, 4, generator=gen) * 0.05,
              torch.randn(64, generator=gen) * 0.05) for _ in range(2)]
    patches = [LoraPatch(layer, 0.8, down, up, diff_b=b, name="l") for down, up, b in terms]
    with apply_loras(patches, fuse=True):
        fused_weight, fused_bias = layer.weight.data.clone(), layer.bias.data.clone()
    once = (weight.float() + sum(0.8 * (up @ down) for down, up, _ in terms)).to(torch.bfloat16)
    assert torch.equal(fused_weight, once)
    assert torch.equal(fused_bias, (bias.float() + sum(0.8 * b for _, _, b in terms)).to(torch.bfloat16))
    assert layer.weight.data_ptr() == weight.data_ptr() and layer.bias.data_ptr() == bias.data_ptr()  # the originals back


def test_a_refused_fuse_leaves_no_weight_fused():
    layer, plain = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8, bias=False)
    weight, before = layer.weight.data, layer.weight.data.clone()
    patches = [LoraPatch(layer, 1.0, torch.ones(2, 8), torch.ones(8, 2), name="a"),
               LoraPatch(plain, 1.0, diff_b=torch.ones(8), name="b")]
    with pytest.raises(ValueError, match="without a bias"):
        apply_loras(patches, fuse=True)
    assert layer.weight.data_ptr() == weight.data_ptr() and torch.equal(layer.weight.data, before)


def test_disk_tier_weights_mapped_from_their_file_take_loras(wan, spec, tmp_path):
    """Weights left memory-mapped in their safetensors file (the disk tier): the LoRA runs beside
    them under every tier, bit-identical, and the mapped weights are never written or copied."""
    from accelerate import init_empty_weights
    from diffusers import WanTransformer3DModel
    from safetensors.torch import save_file

    from vidmem.memory.storage import assign_weights, is_file_backed, open_safetensors

    path = tmp_path / "transformer.safetensors"
    save_file({k: v.contiguous() for k, v in wan.transformer.state_dict().items()}, str(path))
    with init_empty_weights():
        mapped = WanTransformer3DModel(**wan.transformer.config).eval()
    assign_weights(mapped, dict(open_safetensors(path).tensors), torch.float32, source=str(path))
    assert is_file_backed(mapped.blocks[0].attn1.to_q.weight)
    holder = type("Pipe", (), {"transformer": mapped})()
    before = snapshot(mapped)
    reference = run_tier(mapped, lora_patches(holder, [spec]), TIERS["none"], CpuBackend(), wan_inputs())
    for label, strategy in TIERS.items():
        assert torch.equal(run_tier(mapped, lora_patches(holder, [spec]), strategy, StrictBackend(), wan_inputs()), reference), label
    assert_restored(mapped, before)
    assert is_file_backed(mapped.blocks[0].attn1.to_q.weight)
    plain = run_tier(wan.transformer, lora_patches(wan, [spec]), TIERS["none"], CpuBackend(), wan_inputs())
    assert torch.allclose(reference, plain, rtol=0, atol=1e-5 * plain.abs().max())  # unaligned mapped weights round differently


def test_file_backed_lora_tensors_stay_out_of_pinned_memory(wan, spec):
    """A pinning backend gives streamed tensors pinned homes for good; the LoRA's tensors are views of
    its file, so the host pool leaves them there instead of copying them again every call."""
    from vidmem.memory.hostpool import HostPool

    model = copy.deepcopy(wan.transformer)
    holder = type("Pipe", (), {"transformer": model})()
    stage = StageComponents({"transformer": model}, {"transformer": model.blocks})
    stats = []
    for loras in ((), (spec,), (spec,)):
        pool = HostPool()
        with torch.no_grad(), apply_loras(lora_patches(holder, list(loras))), apply_strategy(
            stage, TIERS["sequential:p1"], StrictBackend(pinning=True), host_pool=pool
        ):
            model(**wan_inputs())
        stats.append(pool.stats())
    lora_tensors = 2 * len(spec.layers["transformer"])
    assert stats[1]["allocations"] == stats[2]["allocations"] == stats[0]["allocations"]
    assert stats[1]["file_backed"] == stats[0]["file_backed"] + lora_tensors


@pytest.mark.parametrize("tier", ["sequential:p1", "block_swap:1:p1"])
def test_traced_loras_take_no_new_pinned_home_run_over_run(wan, spec, tier):
    """Traced into compiled blocks, each patched layer also carries its strength as a tensor: one per value, the same
    object every call, so the host pool adopts it once (a new one per call took a new pinned home every call, for
    every layer, and kept LoRA'd blocks from staying warm)."""
    from vidmem.memory.hostpool import HostPool

    model = copy.deepcopy(wan.transformer)
    holder = type("Pipe", (), {"transformer": model})()
    stage = StageComponents({"transformer": model}, {"transformer": model.blocks})
    pool, allocations = HostPool(), []
    for _ in range(3):
        with torch.no_grad(), apply_loras(lora_patches(holder, [spec]), traced_in=list(model.blocks)), apply_strategy(
            stage, TIERS[tier], StrictBackend(pinning=True), host_pool=pool
        ):
            model(**wan_inputs())
        allocations.append(pool.stats()["allocations"])
    assert allocations[0] == allocations[1] == allocations[2], allocations
