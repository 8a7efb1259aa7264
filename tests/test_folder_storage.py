"""Load Video Pipeline's weight_dtype: a diffusers folder (CogVideoX too) held below 16 bits.

The stored pipeline samples exactly the latents of the same folder loaded as diffusers does with
each stored weight replaced by its dequantized values, under every tier; a folder already in the
chosen format is used in place from its files (the disk tier); the planner counts what it holds.
"""

from __future__ import annotations

import pickle

import pytest
import torch

from backends import StrictBackend
from test_tiers import request_for, strategies
from vidmem.memory.device import CpuBackend
from vidmem.memory.storage import StoredEmbedding, StoredLinear, is_file_backed
from vidmem.nodes.loader import VidMemLoadPipeline
from vidmem.pipelines.family import ModelError
from vidmem.pipelines.loader import load_pipeline
from vidmem.pipelines.planning import plan_options, plan_strategy
from vidmem.pipelines.sample import sample
from vidmem.memory import MemoryStrategy
from vidmem.memory.plan.stages import VideoShape
from vidmem.pipelines.weight_storage import LOWERED

CASES = [("wan2.1-t2v", "fp8_scaled"), ("wan2.1-t2v", "gguf_q8_0"), ("cogvideox-t2v", "fp8_e4m3fn"),
         ("cogvideox-t2v", "gguf_q8_0")]


def dequantized_twin(folder, stored):
    """The folder loaded as diffusers does, each stored weight replaced by its dequantized values."""
    twin = load_pipeline(folder, "fp32")
    for name in LOWERED:
        ours, theirs = getattr(stored.pipe, name, None), getattr(twin.pipe, name, None)
        if ours is None:
            continue
        layers = dict(theirs.named_modules())
        for path, layer in ours.named_modules():
            if isinstance(layer, (StoredLinear, StoredEmbedding)):
                layers[path].weight.data = layer.stored.dequantize(torch.float32)
    return twin


def latents(loaded, strategy, variant, backend=None):
    return sample(loaded, strategy, request_for(variant), backend=backend or CpuBackend()).latent["samples"]


@pytest.mark.parametrize("variant,weight_dtype", CASES, ids=["-".join(c) for c in CASES])
def test_a_stored_folder_samples_like_its_dequantized_twin_under_every_tier(tiny_folder, variant, weight_dtype):
    folder = tiny_folder(variant)
    stored = load_pipeline(folder, "fp32", weight_dtype=weight_dtype)
    assert stored.storage == {"transformer": weight_dtype, "text_encoder": weight_dtype} and not stored.on_disk
    assert any(isinstance(m, StoredLinear) for m in stored.pipe.text_encoder.modules())
    assert stored.pipe.vae.dtype == torch.float32 and not any(
        isinstance(m, StoredLinear) for m in stored.pipe.vae.modules())  # the VAE is untouched
    twin = dequantized_twin(folder, stored)
    expected = latents(twin, MemoryStrategy(offload="none"), variant)
    original = latents(load_pipeline(folder, "fp32"), MemoryStrategy(offload="none"), variant)
    assert torch.isfinite(expected).all() and not torch.equal(expected, original)  # storage changed the weights
    for label, strategy in strategies(stored).items():
        for backend in (CpuBackend(), StrictBackend(pinning=True)):
            got = latents(stored, strategy, variant, backend)
            assert torch.equal(got, expected), f"{variant} {weight_dtype} {label} {type(backend).__name__}"


def test_fp8_keeps_the_token_embedding_wide_and_gguf_lowers_it(tiny_folder):
    """One declaration (StorageFormat.lowers): Comfy-Org's fp8 files keep the table 16-bit, GGUF's quantize it."""
    fp8 = load_pipeline(tiny_folder("wan2.1-t2v"), "fp32", weight_dtype="fp8_scaled").pipe.text_encoder
    gguf = load_pipeline(tiny_folder("wan2.1-t2v"), "fp32", weight_dtype="gguf_q8_0").pipe.text_encoder
    assert isinstance(fp8.shared, torch.nn.Embedding) and fp8.shared.weight.dtype == torch.float32
    assert isinstance(gguf.shared, StoredEmbedding) and gguf.shared.format.name == "gguf_q8_0"


def test_a_folder_already_in_the_chosen_format_is_used_in_place(tiny_folder):
    folder = tiny_folder("wan2.1-t2v")
    mapped = load_pipeline(folder, "fp32", weight_dtype="fp32")
    assert mapped.on_disk and "disk tier" in mapped.describe()
    assert is_file_backed(mapped.pipe.transformer.blocks[0].attn1.to_q.weight)
    assert not is_file_backed(mapped.pipe.vae.decoder.conv_in.weight)  # the VAE loads as before
    reference = load_pipeline(folder, "fp32")
    strategy = MemoryStrategy(offload="block_swap", blocks_to_swap=1)
    difference = (latents(mapped, strategy, "wan2.1-t2v") - latents(reference, strategy, "wan2.1-t2v")).abs().max()
    assert difference <= 1e-5  # the same weights; only the mapping's alignment may move the last bits (FACTS)


def test_a_bf16_folder_with_fp32_kept_layers_is_used_in_place_at_its_own_format(tiny_folder, tmp_path):
    """diffusers saves a bf16 Wan with its `_keep_in_fp32_modules` (the time embedder, norms) in fp32. weight_dtype
    bf16 on that folder is its own format: nothing is lowered (the fp32 layers are not rounded to bf16, which the
    default never does), so the disk tier holds, as the plan says."""
    import diffusers

    folder = tmp_path / "wan-bf16"
    diffusers.WanPipeline.from_pretrained(tiny_folder("wan2.1-t2v"), torch_dtype=torch.bfloat16).save_pretrained(folder)
    kept = "condition_embedder.time_embedder.linear_1.weight"
    from safetensors import safe_open

    with safe_open(str(folder / "transformer" / "diffusion_pytorch_model.safetensors"), "pt") as handle:
        assert handle.get_slice(kept).get_dtype() == "F32"  # the premise: the file keeps it wide
    loaded = load_pipeline(folder, "bf16", weight_dtype="bf16")
    default = load_pipeline(folder, "bf16")
    layer = loaded.pipe.transformer.condition_embedder.time_embedder.linear_1
    assert not isinstance(layer, StoredLinear) and layer.weight.dtype == torch.float32
    assert torch.equal(layer.weight, default.pipe.transformer.condition_embedder.time_embedder.linear_1.weight)
    assert loaded.on_disk
    lowered = load_pipeline(folder, "bf16", weight_dtype="fp8_scaled")  # lowering keeps them wide too
    assert lowered.pipe.transformer.condition_embedder.time_embedder.linear_1.weight.dtype == torch.float32
    assert load_pipeline(folder, "fp32", weight_dtype="bf16").on_disk  # at any compute dtype, as diffusers keeps them


def test_two_experts_are_both_stored(tiny_folder):
    loaded = load_pipeline(tiny_folder("wan2.2-a14b"), "fp32", weight_dtype="fp8_scaled")
    assert loaded.storage["transformer_2"] == "fp8_scaled"
    assert isinstance(loaded.pipe.transformer_2.blocks[0].attn1.to_q, StoredLinear)


def test_the_planner_and_auto_use_the_folders_chosen_storage(tiny_folder):
    stored = load_pipeline(tiny_folder("cogvideox-t2v"), "fp32", weight_dtype="fp8_scaled")
    default = load_pipeline(tiny_folder("cogvideox-t2v"), "fp32")
    assert dict(plan_options(stored).storage) == {"text_encoder": "fp8_scaled", "transformer": "fp8_scaled"}
    shape, strategy = VideoShape(32, 32, 9), MemoryStrategy(offload="model")
    lean, wide = plan_strategy(stored, shape, strategy, None, None), plan_strategy(default, shape, strategy, None, None)
    assert lean.peak_ram_bytes < wide.peak_ram_bytes and "fp8_scaled" in lean.describe_storage()


def test_the_node_takes_weight_dtype_after_its_older_inputs(tiny_folder, monkeypatch):
    spec = VidMemLoadPipeline.INPUT_TYPES()
    # appended (then vae_dtype, vae_file, the text encoder files): saved workflows' widget values keep their places
    assert list(spec["optional"]) == ["path", "transformer_file", "weight_dtype", "vae_dtype", "vae_file", "text_encoder_file",
                                      "text_encoder_2_file"]
    choices, options = spec["optional"]["weight_dtype"]
    assert options["default"] == "default" and {"fp8_scaled", "gguf_q8_0", "fp8_e4m3fn"} <= set(choices)
    (loaded,) = VidMemLoadPipeline().load("x", "fp32", path=str(tiny_folder("cogvideox-t2v")), weight_dtype="fp8_scaled")
    assert loaded.storage["transformer"] == "fp8_scaled" and "text_encoder fp8_scaled" in loaded.describe()  # receipts
    (plain,) = VidMemLoadPipeline().load("x", "fp32", path=str(tiny_folder("cogvideox-t2v")))
    assert not plain.storage  # old workflows: loaded as before


def test_bad_weight_dtype_and_a_pickled_shard_are_named(tiny_folder, tmp_path):
    with pytest.raises(ModelError, match="weight_dtype='fp4'"):
        load_pipeline(tiny_folder("wan2.1-t2v"), "fp32", weight_dtype="fp4")
    import shutil

    copy = tmp_path / "wan"
    shutil.copytree(tiny_folder("wan2.1-t2v"), copy)
    weights = copy / "transformer" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(ModelError, match="diffusion_pytorch_model.safetensors is a PyTorch pickle"):
        load_pipeline(copy, "fp32", weight_dtype="fp8_scaled")


def test_vae_dtype_loads_the_folders_vae_at_that_precision_and_is_planned_so(tiny_folder):
    """Load Video Pipeline's vae_dtype is Load Video Model Files' widget: an fp32 VAE holds the
    files' own values (not values rounded to bf16 first), and the planner counts the fp32 VAE."""
    from vidmem.memory.device import CpuBackend
    from vidmem.nodes.load_files import VidMemLoadModelFiles
    from vidmem.pipelines.decode import decode
    from vidmem.pipelines.planning import planner_model

    files_spec = VidMemLoadModelFiles.INPUT_TYPES()["required"]["vae_dtype"]
    assert VidMemLoadPipeline.INPUT_TYPES()["optional"]["vae_dtype"] is files_spec  # one widget for both loaders
    folder = tiny_folder("wan2.1-t2v")
    (loaded,) = VidMemLoadPipeline().load("x", "bf16", path=str(folder), vae_dtype="fp32")
    reference = load_pipeline(folder, "fp32").pipe.vae.state_dict()
    assert {p.dtype for p in loaded.pipe.vae.parameters()} == {torch.float32}
    assert all(torch.equal(t, reference[k]) for k, t in loaded.pipe.vae.state_dict().items())  # the files' values
    plain = load_pipeline(folder, "bf16").pipe.transformer
    assert [p.dtype for p in loaded.pipe.transformer.parameters()] == [p.dtype for p in plain.parameters()]
    assert loaded.vae_dtype_name == "fp32" and "(bf16, VAE fp32)" in loaded.describe()
    (same,) = VidMemLoadPipeline().load("x", "bf16", path=str(folder), vae_dtype="same as dtype")
    assert {p.dtype for p in same.pipe.vae.parameters()} == {torch.bfloat16} and same.vae_dtype_name == ""
    assert planner_model(loaded).vae_dtype_name == "fp32" and planner_model(same).vae_dtype_name == ""
    shape = VideoShape(32, 32, 9)
    wide, narrow = (plan_strategy(p, shape, MemoryStrategy(), None, None) for p in (loaded, same))
    decode_bytes = lambda plan: next(s.device_bytes for s in plan.stages if s.name == "decode")  # noqa: E731
    assert decode_bytes(wide) > decode_bytes(narrow)
    latent = sample(loaded, MemoryStrategy(), request_for("wan2.1-t2v"), backend=CpuBackend()).latent
    frames = decode(loaded, latent, backend=CpuBackend()).frames  # a bf16 pipeline's latent into the fp32 VAE
    assert frames.shape[0] == 9 and frames.isfinite().all()


def test_the_plan_route_plans_the_folders_vae_dtype(tiny_folder, monkeypatch):
    from vidmem.nodes import host
    from vidmem.nodes.plan_route import PlanRequestError, parse_request, plan_answer
    from vidmem.pipelines.configs import load_model
    from vidmem.pipelines.loader import DTYPES

    folder = tiny_folder("wan2.1-t2v")
    monkeypatch.setattr(host, "resolve_model_folder", lambda name, given: folder)
    seen = []

    def plannable(name, dtype, vae_dtype=""):
        seen.append(vae_dtype)
        return load_model(str(folder), dtype, vae_dtype or None)

    query = {"model": "wan", "dtype": "bf16", "width": "32", "height": "32", "frames": "9"}
    plans = {v: plan_answer(parse_request({**query, "vae_dtype": v}, ["wan"], list(DTYPES)), plannable, (2**33, 2**35))
             for v in ("same as dtype", "fp32")}
    assert seen == ["", "fp32"] and all(p["status"] == "ok" for p in plans.values())
    decode_bytes = lambda plan: plan["rows"][0]["stages"][-1]["vram_bytes"]  # noqa: E731
    assert decode_bytes(plans["fp32"]) > decode_bytes(plans["same as dtype"])
    with pytest.raises(PlanRequestError, match="vae_dtype='fp64' must be 'same as dtype' or one of") as error:
        parse_request({**query, "vae_dtype": "fp64"}, ["wan"], list(DTYPES))
    assert error.value.name == "vae_dtype"


def test_t5s_wo_at_fp16_is_still_lowered_its_computation_stays_float32():
    """transformers keeps T5's `wo` in float32 at fp16 for the activations' range; its stored weight may still be
    lowered (the layer upcasts to float32), as the planner counts it: a umt5-xxl's `wo` is 1 GB of fp8."""
    import transformers

    from vidmem.pipelines.comfy_files.build import kept_in_fp32

    config = transformers.T5Config(vocab_size=32, d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8)
    with torch.device("meta"):
        encoder = transformers.T5EncoderModel(config)
    assert kept_in_fp32(encoder, torch.float16) == () and kept_in_fp32(encoder, torch.bfloat16) == ()
