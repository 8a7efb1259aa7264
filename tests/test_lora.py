"""LoRA formats: a tiny LoRA written in each format gives diffusers' own load_lora_weights + fuse_lora
output on the same tiny model (within a stated tolerance), and formats that encode the same LoRA
give the same output bit for bit.

Tolerance: beside the layer computes W x + s B (A x); fusing computes (W + s B A) x. Both are exact
in real arithmetic, so they differ only by fp32 rounding of the two orders of summation: measured
at 2.4e-7 of the output's magnitude on the tiny Wan (1.8e-7 against diffusers' unfused PEFT layers,
which also run beside the layer but round the scale differently), asserted at 1e-5 relative.
"""

from __future__ import annotations

import json
import warnings

import pytest
import safetensors.torch
import torch

from vidmem.memory.lora import apply_loras
from vidmem.pipelines.lora import load_lora, lora_patches
from vidmem.pipelines.tiny import build_tiny_pipeline

try:
    import peft  # noqa: F401  (diffusers' load_lora_weights, the reference, needs it)
except ImportError:
    peft = None
# the pack itself never needs peft; only the comparisons with diffusers' own LoRA loading do
needs_peft = pytest.mark.skipif(peft is None, reason="diffusers' load_lora_weights needs peft (pip install peft)")

RANK = 4
RELATIVE_TOLERANCE = 1e-5

# diffusers module name -> original Wan name (test data, written independently of the converter
# the loader uses, so a wrong mapping there fails here)
WAN_ORIGINAL = [
    ("attn1.to_out.0", "self_attn.o"), ("attn2.to_out.0", "cross_attn.o"),
    ("attn1.to_", "self_attn."), ("attn2.to_", "cross_attn."),
    ("attn2.add_k_proj", "cross_attn.k_img"), ("attn2.add_v_proj", "cross_attn.v_img"),
    ("ffn.net.0.proj", "ffn.0"), ("ffn.net.2", "ffn.2"), ("proj_out", "head.head"),
]
WAN_LAYERS = [f"blocks.{i}.{m}" for i in range(2) for m in (
    "attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "attn2.to_k", "attn2.to_v",
    "attn2.to_out.0", "ffn.net.0.proj", "ffn.net.2")]
COG_LAYERS = [f"transformer_blocks.0.{m}" for m in ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "ff.net.0.proj", "ff.net.2")]


def wan_original(name: str) -> str:
    for old, new in WAN_ORIGINAL:
        name = name.replace(old, new)
    return name


def random_lora(model, layers, rank=RANK, seed=1, alpha=None):
    """layer -> (down [r, in], up [out, r]); up is random too (trainers start it at zero)."""
    gen = torch.Generator().manual_seed(seed)
    found = {}
    for name in layers:
        m = model.get_submodule(name)
        found[name] = (torch.randn(rank, m.in_features, generator=gen) * 0.2, torch.randn(m.out_features, rank, generator=gen) * 0.2)
    return found


def write(path, tensors, metadata=None):
    safetensors.torch.save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
    return path


# Each writer: (lora, alpha) -> state dict in one trainer's format. alpha None: no alpha stored.
def peft_keys(lora, alpha):
    return {f"transformer.{n}.lora_{ab}.weight": t for n, (a, b) in lora.items() for ab, t in (("A", a), ("B", b))}


def kohya_keys(prefix, flatten, down="lora_down", up="lora_up", naming=wan_original):
    def writer(lora, alpha):
        out = {}
        for n, (a, b) in lora.items():
            name = naming(n)
            name = prefix + (name.replace(".", "_") if flatten else name)
            out[f"{name}.{down}.weight"], out[f"{name}.{up}.weight"] = a, b
            if alpha is not None:
                out[f"{name}.alpha"] = torch.tensor(float(alpha))
        return out
    return writer


WAN_FORMATS = {
    "diffusers-peft": peft_keys,
    "comfyui-diffusion_model-lora_down-alpha": kohya_keys("diffusion_model.", False),
    "comfyui-diffusion_model-lora_A": kohya_keys("diffusion_model.", False, "lora_A", "lora_B"),
    "musubi-lora_unet": kohya_keys("lora_unet_", True),
}
# formats diffusers does not read, checked bit for bit against an equivalent one it does read
WAN_EQUIVALENTS = {
    "original-no-prefix": (kohya_keys("", False), "comfyui-diffusion_model-lora_down-alpha"),
    "model.diffusion_model-prefix": (kohya_keys("model.diffusion_model.", False), "comfyui-diffusion_model-lora_down-alpha"),
    "kohya-flattened-diffusers-names": (kohya_keys("lora_transformer_", True, naming=lambda n: n), "comfyui-diffusion_model-lora_down-alpha"),
}
ALPHA_OF = {"diffusers-peft": None, "comfyui-diffusion_model-lora_A": None}


def wan_inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return dict(hidden_states=torch.randn(1, 16, 3, 4, 4, generator=gen), timestep=torch.tensor([700]),
                encoder_hidden_states=torch.randn(1, 8, 32, generator=gen), return_dict=False)


def cog_inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return dict(hidden_states=torch.randn(1, 3, 4, 4, 4, generator=gen), timestep=torch.tensor([700]),
                encoder_hidden_states=torch.randn(1, 226, 32, generator=gen), return_dict=False)


@pytest.fixture(scope="module")
def wan():
    return build_tiny_pipeline("wan2.1-t2v")


@pytest.fixture(scope="module")
def cog():
    return build_tiny_pipeline("cogvideox-t2v")


def run(pipe, inputs, loras=()):
    with torch.no_grad(), apply_loras(lora_patches(pipe, list(loras))):
        return pipe.transformer(**inputs)[0]


def diffusers_fused(variant, path, strength):
    reference = build_tiny_pipeline(variant)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference.load_lora_weights(str(path))
        reference.fuse_lora(lora_scale=strength)
    return reference


def assert_close(ours, theirs, label):
    scale = theirs.abs().max()
    error = (ours - theirs).abs().max()
    assert error <= RELATIVE_TOLERANCE * scale, f"{label}: max error {error:.3g} vs output scale {scale:.3g}"


@needs_peft
@pytest.mark.parametrize("fmt", list(WAN_FORMATS))
@pytest.mark.parametrize("strength", [1.0, -0.7])
def test_wan_format_matches_diffusers_fused(fmt, strength, wan, tmp_path):
    alpha = ALPHA_OF.get(fmt, 2.0)  # alpha/rank = 0.5 where the format stores an alpha
    lora = random_lora(wan.transformer, WAN_LAYERS)
    path = write(tmp_path / f"{fmt}.safetensors", WAN_FORMATS[fmt](lora, alpha))
    spec = load_lora(path, wan, strength)
    assert len(spec.layers["transformer"]) == len(WAN_LAYERS) and not spec.skipped
    base = run(wan, wan_inputs())
    ours = run(wan, wan_inputs(), [spec])
    theirs = diffusers_fused("wan2.1-t2v", path, strength).transformer(**wan_inputs())[0]
    assert (ours - base).abs().max() > 100 * RELATIVE_TOLERANCE * base.abs().max(), "the LoRA changed nothing"
    assert_close(ours, theirs.detach(), fmt)


@pytest.mark.parametrize("fmt", list(WAN_EQUIVALENTS))
def test_wan_formats_diffusers_cannot_read_equal_their_twin_bit_for_bit(fmt, wan, tmp_path):
    writer, twin = WAN_EQUIVALENTS[fmt]
    lora = random_lora(wan.transformer, WAN_LAYERS)
    ours = load_lora(write(tmp_path / "a.safetensors", writer(lora, 2.0)), wan, 0.8)
    reference = load_lora(write(tmp_path / "b.safetensors", WAN_FORMATS[twin](lora, 2.0)), wan, 0.8)
    assert torch.equal(run(wan, wan_inputs(), [ours]), run(wan, wan_inputs(), [reference]))


@needs_peft
def test_peft_metadata_alpha_is_honoured(wan, tmp_path):
    lora = random_lora(wan.transformer, WAN_LAYERS)
    config = {"r": RANK, "lora_alpha": 2 * RANK, "target_modules": WAN_LAYERS}  # what diffusers' save_lora_weights writes
    meta = {"lora_adapter_metadata": json.dumps({f"transformer.{k}": v for k, v in config.items()})}
    path = write(tmp_path / "meta.safetensors", peft_keys(lora, None), meta)
    spec = load_lora(path, wan, 1.0)
    assert {layer.alpha for layer in spec.layers["transformer"]} == {2.0 * RANK}
    theirs = diffusers_fused("wan2.1-t2v", path, 1.0).transformer(**wan_inputs())[0]
    assert_close(run(wan, wan_inputs(), [spec]), theirs.detach(), "peft metadata alpha")


def peft_metadata(**config):
    """`lora_adapter_metadata` as diffusers' save_lora_weights writes it (settings under `transformer.`)."""
    return {"lora_adapter_metadata": json.dumps({f"transformer.{k}": v for k, v in config.items()})}


@needs_peft
def test_rslora_metadata_gives_peft_scaling_and_output(wan, tmp_path):
    """use_rslora: PEFT (and so diffusers, which builds LoraConfig(**metadata)) scales by alpha / sqrt(r);
    here with a rank_pattern and an alpha_pattern layer beside the global r and lora_alpha."""
    low = WAN_LAYERS[-1]
    lora = random_lora(wan.transformer, WAN_LAYERS[:-1])
    lora.update(random_lora(wan.transformer, [low], rank=2, seed=3))
    meta = peft_metadata(r=RANK, lora_alpha=RANK, target_modules=WAN_LAYERS, use_rslora=True,
                         rank_pattern={low: 2}, alpha_pattern={low: 8})
    path = write(tmp_path / "rslora.safetensors", peft_keys(lora, None), meta)
    spec = load_lora(path, wan, 0.7)
    reference = build_tiny_pipeline("wan2.1-t2v")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference.load_lora_weights(str(path), adapter_name="rs")
    for layer in spec.layers["transformer"]:
        assert layer.lowrank_scale(1.0) == pytest.approx(reference.transformer.get_submodule(layer.module).scaling["rs"])
    assert {layer.lowrank_scale(1.0) for layer in spec.layers["transformer"]} == {2.0, 8 / 2 ** 0.5}
    reference.fuse_lora(lora_scale=0.7)
    assert_close(run(wan, wan_inputs(), [spec]), reference.transformer(**wan_inputs())[0].detach(), "rslora")


def test_rslora_equals_plain_lora_with_the_same_scale_bit_for_bit(wan, tmp_path):
    """Runs without peft: rank 4, alpha 4 under rsLoRA is scale 4 / sqrt(4) = 2, which a plain LoRA gets from
    alpha 8 (alpha / rank); without use_rslora the same file is scale 1 (the metadata flag is what changes it)."""
    lora = random_lora(wan.transformer, WAN_LAYERS)
    rslora = load_lora(write(tmp_path / "rs.safetensors", peft_keys(lora, None),
                             peft_metadata(r=RANK, lora_alpha=RANK, use_rslora=True)), wan, 0.8)
    plain = load_lora(write(tmp_path / "plain.safetensors", peft_keys(lora, None),
                            peft_metadata(r=RANK, lora_alpha=2 * RANK, use_rslora=False)), wan, 0.8)
    assert {layer.lowrank_scale(1.0) for layer in rslora.layers["transformer"]} == {2.0}
    assert torch.equal(run(wan, wan_inputs(), [rslora]), run(wan, wan_inputs(), [plain]))


@needs_peft
def test_lightx2v_style_deltas_match_diffusers(wan, tmp_path):
    """lightx2v distill LoRAs: lora_down/up + alpha, bias deltas (diff_b), a full head delta, zero norm deltas."""
    lora = random_lora(wan.transformer, WAN_LAYERS)
    keys = kohya_keys("diffusion_model.", False)(lora, 2.0)
    gen = torch.Generator().manual_seed(5)
    for name in WAN_LAYERS:
        keys[f"diffusion_model.{wan_original(name)}.diff_b"] = torch.randn(wan.transformer.get_submodule(name).out_features, generator=gen) * 0.1
    head = wan.transformer.proj_out
    keys["diffusion_model.head.head.diff"] = torch.randn(head.out_features, head.in_features, generator=gen) * 0.05
    keys["diffusion_model.head.head.diff_b"] = torch.randn(head.out_features, generator=gen) * 0.05
    keys["diffusion_model.blocks.0.norm3.diff"] = torch.zeros(24)
    path = write(tmp_path / "lightx2v.safetensors", keys)
    with pytest.warns(UserWarning, match=r"norm3.diff: blocks.0.norm2 is not a linear layer \(its delta is all zeros\)"):
        spec = load_lora(path, wan, 1.0)
    theirs = diffusers_fused("wan2.1-t2v", path, 1.0).transformer(**wan_inputs())[0]
    assert_close(run(wan, wan_inputs(), [spec]), theirs.detach(), "lightx2v")


@needs_peft
@pytest.mark.parametrize("strength", [1.0, 0.5])
def test_cogvideox_factory_lora_matches_diffusers_fused(strength, cog, tmp_path):
    lora = random_lora(cog.transformer, COG_LAYERS)
    path = write(tmp_path / "cogvideox_factory.safetensors", peft_keys(lora, None))
    spec = load_lora(path, cog, strength)
    assert spec.naming == "diffusers"
    theirs = diffusers_fused("cogvideox-t2v", path, strength).transformer(**cog_inputs())[0]
    ours = run(cog, cog_inputs(), [spec])
    assert not torch.equal(ours, run(cog, cog_inputs()))
    assert_close(ours, theirs.detach(), "cogvideox-factory")


def test_cogvideox_kohya_flattened_equals_factory_bit_for_bit(cog, tmp_path):
    lora = random_lora(cog.transformer, COG_LAYERS)
    factory = load_lora(write(tmp_path / "a.safetensors", peft_keys(lora, None)), cog, 1.0)
    kohya = load_lora(write(tmp_path / "b.safetensors", kohya_keys("lora_unet_", True, naming=lambda n: n)(lora, None)), cog, 1.0)
    assert kohya.naming == "diffusers (flattened)"
    assert torch.equal(run(cog, cog_inputs(), [factory]), run(cog, cog_inputs(), [kohya]))


def test_chained_loras_add_up(wan, tmp_path):
    """Two LoRAs on the same layers equal one LoRA holding both terms (rank concatenated)."""
    first, second = random_lora(wan.transformer, WAN_LAYERS, seed=1), random_lora(wan.transformer, WAN_LAYERS, seed=2)
    both = {n: (torch.cat([first[n][0], second[n][0]]), torch.cat([first[n][1], second[n][1]], dim=1)) for n in WAN_LAYERS}
    a = load_lora(write(tmp_path / "a.safetensors", peft_keys(first, None)), wan, 1.0)
    b = load_lora(write(tmp_path / "b.safetensors", peft_keys(second, None)), wan, 1.0)
    joined = load_lora(write(tmp_path / "ab.safetensors", peft_keys(both, None)), wan, 1.0)
    assert_close(run(wan, wan_inputs(), [a, b]), run(wan, wan_inputs(), [joined]), "chained")


def fused_by_hand(pipe, path, strength):
    """diffusers' own key conversion (WanPipeline / CogVideoXPipeline.lora_state_dict, no peft
    needed), fused by hand into a copy of the transformer: W += strength * B @ A, b += strength * b_B."""
    import copy

    model = copy.deepcopy(pipe.transformer)
    converted = type(pipe).lora_state_dict(str(path))
    with torch.no_grad():
        for key, down in converted.items():
            if key.endswith(".lora_A.weight"):
                layer = model.get_submodule(key.removeprefix("transformer.").removesuffix(".lora_A.weight"))
                up = converted[key.replace(".lora_A.", ".lora_B.")]
                layer.weight += strength * (up.float() @ down.float())
                bias = converted.get(key.replace(".lora_A.weight", ".lora_B.bias"))
                if bias is not None:
                    layer.bias += strength * bias
    return model


@pytest.mark.parametrize("fmt", list(WAN_FORMATS))
def test_wan_format_matches_diffusers_conversion_fused_by_hand(fmt, wan, tmp_path):
    """Runs without peft (CI): the same check as above with the fusion done here."""
    lora = random_lora(wan.transformer, WAN_LAYERS)
    path = write(tmp_path / f"{fmt}.safetensors", WAN_FORMATS[fmt](lora, ALPHA_OF.get(fmt, 2.0)))
    ours = run(wan, wan_inputs(), [load_lora(path, wan, 0.8)])
    with torch.no_grad():
        theirs = fused_by_hand(wan, path, 0.8)(**wan_inputs())[0]
    assert not torch.equal(ours, run(wan, wan_inputs()))
    assert_close(ours, theirs, fmt)


def test_cogvideox_factory_matches_diffusers_conversion_fused_by_hand(cog, tmp_path):
    path = write(tmp_path / "factory.safetensors", peft_keys(random_lora(cog.transformer, COG_LAYERS), None))
    ours = run(cog, cog_inputs(), [load_lora(path, cog, 1.0)])
    with torch.no_grad():
        theirs = fused_by_hand(cog, path, 1.0)(**cog_inputs())[0]
    assert_close(ours, theirs, "cogvideox-factory")


def test_engine_terms_on_a_plain_linear():
    """Each term on its own, against the formula: low-rank, full delta, bias delta; and the autograd
    path (out of place) equals the inference path (in place)."""
    from vidmem.memory.lora import LoraPatch

    torch.manual_seed(0)
    layer, x = torch.nn.Linear(6, 5), torch.randn(3, 6)
    down, up, diff, bias = torch.randn(2, 6), torch.randn(5, 2), torch.randn(5, 6), torch.randn(5)
    cases = {
        "lowrank": (LoraPatch(layer, 0.5, down=down, up=up), layer(x) + 0.5 * ((x @ down.T) @ up.T)),
        "diff": (LoraPatch(layer, -1.5, diff=diff), layer(x) - 1.5 * (x @ diff.T)),
        "diff_b": (LoraPatch(layer, 2.0, diff_b=bias), layer(x) + 2.0 * bias),
    }
    for label, (patch, expected) in cases.items():
        with apply_loras([patch]):
            with torch.no_grad():
                inference = layer(x)
            graded = layer(x.clone().requires_grad_())
        assert torch.allclose(inference, expected.detach(), atol=1e-6), label
        assert torch.equal(inference, graded.detach()) and graded.requires_grad, label


def test_a_layer_called_with_its_input_by_keyword_gets_its_lora_term():
    from vidmem.memory.lora import LoraPatch, apply_loras

    layer = torch.nn.Linear(8, 4)
    down, up = torch.randn(2, 8), torch.randn(4, 2)
    x = torch.randn(3, 8)
    with apply_loras([LoraPatch(layer, 0.5, down=down, up=up)]):
        assert torch.allclose(layer(input=x), layer(x)) and not torch.allclose(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))


def test_traced_hooks_compute_the_eager_terms_and_name_their_buffers_per_layer():
    """apply_loras(traced_in=...), run eagerly: the same output bit for bit (the same arithmetic); the buffers are
    numbered per layer, so every block holds the same names (dynamo guards them: names numbered across the model
    compiled every block again), with a 0-dim strength that is one tensor per value, the same in every call (a new
    one each call took a new pinned home and kept blocks from staying warm); the hook's qualname names its terms
    (compiled blocks keep one copy of their code per hook layout); a layer called by keyword is refused by name, not
    computed without its term; a layer outside `traced_in` keeps the eager hook."""
    from vidmem.memory.lora import LoraError, LoraPatch

    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 4) for _ in range(2)]
    outside = torch.nn.Linear(8, 4)
    x = torch.randn(3, 8)

    def patches(delta=False):
        return [LoraPatch(layer, 0.5, down=torch.randn(2, 8), up=torch.randn(4, 2),
                          diff=torch.randn(4, 8) if delta else None, name=f"blocks.{i}.to_q")
                for i, layer in enumerate([*layers, outside])] + [
            LoraPatch(layers[0], 0.25, down=torch.randn(2, 8), up=torch.randn(4, 2), name="blocks.0.to_q")]  # chained

    strengths = []
    for delta in (False, True):
        torch.manual_seed(1)
        chosen = patches(delta)
        with apply_loras(chosen):
            eager = [layer(x) for layer in [*layers, outside]]
        with apply_loras(chosen, traced_in=layers) as handle:
            assert all(torch.equal(a, layer(x)) for a, layer in zip(eager, [*layers, outside]))
            names = [sorted(layer._buffers) for layer in layers]
            assert set(names[1]) < set(names[0]) and "_vidmem_lora0_scale" in names[1] and "_vidmem_lora1_scale" in names[0]
            assert layers[0]._buffers["_vidmem_lora1_scale"].item() == 0.25
            assert layers[0]._buffers["_vidmem_lora0_scale"] is layers[1]._buffers["_vidmem_lora0_scale"]
            strengths.append(layers[1]._buffers["_vidmem_lora0_scale"])
            qualnames = {hook.__qualname__ for hook in layers[1]._forward_hooks.values()}
            assert qualnames == {"_traced_hook.<locals>.hook[down,up,scale]" if not delta
                                 else "_traced_hook.<locals>.hook[down,up,diff,scale]"}
            assert {hook.__qualname__ for hook in outside._forward_hooks.values()} == {"_eager_hook.<locals>.hook"}
            assert not any(name.endswith("scale") for name in outside._buffers)
            assert handle.nbytes == sum(p.nbytes for p in chosen) + 2 * 4  # strengths 0.5 and 0.25, one tensor each
            assert torch.equal(outside(input=x), eager[2])  # the eager hook takes a keyword input
            with pytest.raises(LoraError, match="blocks.0.to_q.*by keyword.*compile off"):
                layers[0](input=x)
        assert not layers[0]._buffers and not layers[0]._forward_hooks
    assert strengths[0] is strengths[1]


def test_every_kind_of_term_traced_into_a_graph_equals_the_eager_one():
    """Low-rank with a bias (PEFT's lora_B bias), a full weight delta and a bias delta, traced by dynamo without a
    graph break: the eager hook's result, to float32 rounding (the traced term rounds three times)."""
    import torch._dynamo

    from vidmem.memory.lora import LoraPatch

    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    patches = [LoraPatch(block[0], 0.5, down=torch.randn(2, 8), up=torch.randn(8, 2), diff_b=torch.randn(8), name="0"),
               LoraPatch(block[1], 0.7, diff=torch.randn(4, 8), diff_b=torch.randn(4), name="1")]
    x = torch.randn(3, 8)
    with torch.no_grad(), apply_loras(patches):
        eager = block(x)
    torch._dynamo.reset()
    with torch.no_grad(), apply_loras(patches, traced_in=[block]):
        explained = torch._dynamo.explain(lambda x: block(x))(x)
        traced = torch.compile(lambda x: block(x), backend="aot_eager")(x)
    torch._dynamo.reset()
    assert explained.graph_break_count == 0, explained.break_reasons
    torch.testing.assert_close(traced, eager, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(eager, block(x), atol=1e-3)  # the terms are there


def test_a_second_lora_handle_on_a_layer_is_refused_whatever_its_terms():
    from vidmem.memory.lora import LoraError, LoraPatch

    layer = torch.nn.Linear(8, 4)
    with apply_loras([LoraPatch(layer, 0.8, down=torch.randn(2, 8), up=torch.randn(4, 2), name="a")], traced_in=[layer]):
        with pytest.raises(LoraError, match="already carries LoRA buffer '_vidmem_lora0_"):
            apply_loras([LoraPatch(layer, 0.3, diff=torch.randn(4, 8), name="a")], traced_in=[layer])
        assert layer._buffers["_vidmem_lora0_scale"].item() == pytest.approx(0.8)


def test_a_peft_lora_b_bias_is_scaled_like_its_low_rank_term(wan, tmp_path):
    """PEFT computes `lora_B(lora_A(x)) * alpha / r`: lora_B's bias is inside the scaled term."""
    layer_name = WAN_LAYERS[0]
    layer = wan.transformer.get_submodule(layer_name)
    down, up = random_lora(wan.transformer, [layer_name])[layer_name]
    bias = torch.randn(layer.out_features)
    config = {"r": RANK, "lora_alpha": 4 * RANK, "target_modules": [layer_name]}
    meta = {"lora_adapter_metadata": json.dumps({f"transformer.{k}": v for k, v in config.items()})}
    tensors = {f"transformer.{layer_name}.lora_A.weight": down, f"transformer.{layer_name}.lora_B.weight": up,
               f"transformer.{layer_name}.lora_B.bias": bias}
    spec = load_lora(write(tmp_path / "bias.safetensors", tensors, meta), wan, 0.5)
    x = torch.randn(3, layer.in_features)
    with torch.no_grad(), apply_loras(lora_patches(wan, [spec])):
        ours = layer(x)
    expected = torch.nn.functional.linear(x, layer.weight, layer.bias) + 0.5 * 4 * (x @ down.t() @ up.t() + bias)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)
