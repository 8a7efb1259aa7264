"""ComfyUI single files load into the pipeline the diffusers folder with the same weights gives.

Every layout x storage format on tiny Wan 2.1 T2V, Wan 2.2 TI2V, A14B (two expert files),
Wan 2.1 I2V and Wan 2.2 I2V A14B (two expert files, no image encoder): `sample` gives
bit-identical latents on the CPU to the diffusers folder holding the files' dequantized weights. Both sides are compared with their weights in aligned memory (the
folder's parameters cloned; the files' copied into RAM or upcast per call): a weight used in
place from a file mapping is not 64-byte aligned, and MKL rounds differently on unaligned data
(FACTS: ~3e-6), which is a property of where the bytes lie, not of the loader. Runs that use
plain same-dtype weights in place from the files are compared with that tolerance, stated below.
"""

from __future__ import annotations

import pytest
import torch

from vidmem.memory import MemoryStrategy
from vidmem.memory.device import CpuBackend
from vidmem.memory.storage import is_file_backed
from vidmem.pipelines.comfy_files import KeyLayout, LoadOptions, load_model_files, read_weight_file
from vidmem.pipelines.decode import decode
from vidmem.pipelines.loader import load_pipeline
from vidmem.pipelines.sample import sample
from vidmem.pipelines.tiny import build_tiny_tokenizer
from vidmem.pipelines.tiny_files import save_tiny_comfy_files, tiny_catalogue
from test_tiers import request_for

UNALIGNED_TOLERANCE = 1e-5  # FACTS: weights read in place from a mapping at other offsets move the last bits (~3e-6)

CASES = [
    *[("wan2.1-t2v", storage, "original") for storage in ("bf16", "fp16", "fp32", "fp8_e4m3fn", "fp8_e5m2", "fp8_scaled", "gguf_q8_0", "gguf_q4_0")],
    # Every other GGUF type vidmem reads (each case a few seconds on the CPU).
    *[("wan2.1-t2v", storage, "original") for storage in ("gguf_q6_k", "gguf_q5_k", "gguf_q5_1", "gguf_q5_0", "gguf_q4_k", "gguf_q4_1")],
    *[("wan2.1-t2v", storage, layout) for storage in ("bf16", "fp8_scaled") for layout in ("prefixed", "diffusers")],
    ("wan2.2-ti2v", "bf16", "original"), ("wan2.2-ti2v", "fp8_scaled", "prefixed"), ("wan2.2-ti2v", "gguf_q8_0", "original"),
    ("wan2.2-a14b", "fp16", "prefixed"), ("wan2.2-a14b", "fp8_scaled", "original"), ("wan2.2-a14b", "gguf_q8_0", "diffusers"),
    ("wan2.1-i2v", "fp8_scaled", "original"),
    ("wan2.2-i2v-a14b", "fp8_scaled", "original"), ("wan2.2-i2v-a14b", "gguf_q8_0", "prefixed"),
    ("wan2.2-i2v-a14b", "bf16", "diffusers"),
]
STRATEGY = MemoryStrategy(offload="block_swap", blocks_to_swap=1)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """(variant, storage, layout) -> TinyComfyFiles, written once per module."""
    cache = {}

    def get(variant, storage, layout="original", **kwargs):
        key = (variant, storage, layout, tuple(sorted(kwargs.items())))
        if key not in cache:
            folder = tmp_path_factory.mktemp(f"{variant}-{storage}-{layout}")
            cache[key] = save_tiny_comfy_files(variant, folder, storage, layout, **kwargs)
        return cache[key]

    return get


def aligned(loaded):
    """The loaded pipeline with every weight copied into fresh (aligned) memory."""
    for name, component in loaded.pipe.components.items():
        if isinstance(component, torch.nn.Module):
            for tensor in (*component.parameters(), *component.buffers()):
                tensor.data = tensor.data.clone()
    return loaded


def latents(loaded, variant):
    return sample(loaded, STRATEGY, request_for(variant), backend=CpuBackend()).latent["samples"]


def test_wan21_i2v_files_carry_the_image_cross_attention_weights(written):
    """Wan 2.1 I2V's cross-attention has its own projections for the CLIP image tokens (ComfyUI's k_img, v_img,
    norm_k_img; diffusers' add_k_proj, add_v_proj, norm_added_k), as the real 14B has: the tiny twin writes them,
    and the loaded model uses them (its latents equal the folder's: test_files_sample_the_same_latents_as_the_folder)."""
    from safetensors import safe_open

    out = written("wan2.1-i2v", "fp8_scaled", "original")
    with safe_open(str(out.files.model), "pt") as handle:
        keys = set(handle.keys())
    for name in ("k_img.weight", "v_img.weight", "norm_k_img.weight"):
        assert f"blocks.0.cross_attn.{name}" in keys, sorted(k for k in keys if "blocks.0.cross_attn" in k)
    loaded = load_model_files(out.files, LoadOptions(dtype="fp32", weights_on_disk=False), tiny_catalogue())
    assert loaded.pipe.transformer.blocks[0].attn2.add_k_proj is not None


@pytest.mark.parametrize("variant,storage,layout", CASES, ids=["-".join(c) for c in CASES])
def test_files_sample_the_same_latents_as_the_folder(written, variant, storage, layout):
    out = written(variant, storage, layout)
    reference = latents(aligned(load_pipeline(out.reference, "fp32")), variant)
    loaded = load_model_files(out.files, LoadOptions(dtype="fp32", weights_on_disk=False), tiny_catalogue())
    assert loaded.config_name == f"tiny-{variant}" and loaded.storage["transformer"] == storage
    assert torch.equal(latents(loaded, variant), reference)
    on_disk = load_model_files(out.files, LoadOptions(dtype="fp32", weights_on_disk=True), tiny_catalogue())
    difference = (latents(on_disk, variant) - reference).abs().max().item()
    in_place = storage == "fp32"  # only plain weights already in the compute dtype are used where they lie
    assert difference <= (UNALIGNED_TOLERANCE if in_place else 0.0)


def test_weights_on_disk_keeps_the_files_mapped_and_in_ram_copies_them(written):
    out = written("wan2.1-t2v", "fp8_scaled")
    mapped = load_model_files(out.files, LoadOptions(dtype="fp32", weights_on_disk=True), tiny_catalogue())
    copied = load_model_files(out.files, LoadOptions(dtype="fp32", weights_on_disk=False), tiny_catalogue())
    assert mapped.on_disk and not copied.on_disk and "disk tier" in mapped.describe()
    block = lambda loaded: loaded.pipe.transformer.blocks[0].attn1.to_q  # noqa: E731
    assert is_file_backed(block(mapped).weight_stored) and not is_file_backed(block(copied).weight_stored)
    assert mapped.storage_reports["transformer"].mapped_bytes > 0 == copied.storage_reports["transformer"].mapped_bytes


def test_copying_to_ram_copies_only_what_the_mappings_hold(written):
    """weights_on_disk=False with a weight_dtype: the weights quantized at load are already in RAM; copying them
    again would double the RAM the load's check counted (a 14B model lowered to fp8: 14 GB more)."""
    from vidmem.memory.storage import StoredTensor, quantize
    from vidmem.pipelines.weight_storage import in_ram

    out = written("wan2.1-t2v", "fp8_scaled")
    file = read_weight_file(out.files.model, "model", "transformer")
    mapped_plain = next(t for t in file.tensors.values() if isinstance(t, torch.Tensor) and is_file_backed(t))
    mapped_stored = next(t for t in file.tensors.values() if isinstance(t, StoredTensor) and is_file_backed(t.data))
    fresh_plain, fresh_stored = torch.ones(3), quantize(torch.ones(4, 32), "fp8_scaled")
    held = in_ram({"a": mapped_plain, "b": mapped_stored, "c": fresh_plain, "d": fresh_stored})
    assert held["c"] is fresh_plain and held["d"] is fresh_stored
    assert not is_file_backed(held["a"]) and torch.equal(held["a"], mapped_plain)
    assert not is_file_backed(held["b"].data) and torch.equal(held["b"].data.view(torch.uint8),
                                                               mapped_stored.data.view(torch.uint8))


def test_weight_dtype_lowers_matrices_and_never_raises_them(written):
    from vidmem.memory.storage import quantize

    out = written("wan2.1-t2v", "bf16")
    lowered = load_model_files(out.files, LoadOptions(dtype="fp32", weight_dtype="fp8_scaled"), tiny_catalogue())
    assert lowered.storage["transformer"] == lowered.storage["text_encoder"] == "fp8_scaled"
    file = read_weight_file(out.files.model, "model", "transformer")
    expected = quantize(file.tensors["blocks.0.attn1.to_q.weight"], "fp8_scaled")
    layer = lowered.pipe.transformer.blocks[0].attn1.to_q
    assert torch.equal(layer.weight_stored, expected.data) and torch.equal(layer.weight_scale, expected.scale)
    fp8 = written("wan2.1-t2v", "fp8_e4m3fn")
    kept = load_model_files(fp8.files, LoadOptions(dtype="fp32", weight_dtype="bf16"), tiny_catalogue())
    assert kept.storage["transformer"] == "fp8_e4m3fn"  # bf16 is wider than the file: kept as stored


def test_lowered_weights_live_in_ram_so_the_pipeline_is_not_on_disk(written):
    """weight_dtype makes new tensors: the planner must count them as RAM, not as page cache."""
    out = written("wan2.1-t2v", "bf16")
    lowered = load_model_files(out.files, LoadOptions(dtype="fp32", weight_dtype="fp8_scaled", weights_on_disk=True),
                               tiny_catalogue())
    assert not lowered.on_disk and not is_file_backed(lowered.pipe.transformer.blocks[0].attn1.to_q.weight_stored)
    assert "disk tier" not in lowered.describe()


def test_bf16_compute_with_an_fp32_vae_holds_the_dtypes_from_pretrained_gives(written):
    out = written("wan2.1-t2v", "bf16")
    loaded = load_model_files(out.files, LoadOptions(dtype="bf16", vae_dtype="fp32", weights_on_disk=False), tiny_catalogue())
    folder = load_pipeline(out.reference, "bf16")
    for name in ("transformer", "text_encoder"):
        assert compute_dtypes(getattr(loaded.pipe, name)) == compute_dtypes(getattr(folder.pipe, name)), name
    assert all(p.dtype == torch.float32 for p in loaded.pipe.vae.parameters())
    assert "VAE fp32" in loaded.describe()
    latent = sample(loaded, STRATEGY, request_for("wan2.1-t2v"), backend=CpuBackend()).latent
    frames = decode(loaded, latent, backend=CpuBackend()).frames  # a bf16 pipeline's latent into the fp32 VAE
    assert frames.shape[0] == 9 and frames.isfinite().all()


def compute_dtypes(module) -> dict:
    """The dtype each weight computes in (a stored layer's upcast dtype), and every other tensor's."""
    weights = {f"{n}.weight": m.weight.dtype for n, m in module.named_modules() if isinstance(getattr(m, "weight", None), torch.Tensor)}
    others = {n: t.dtype for n, t in (*module.named_parameters(), *module.named_buffers()) if not n.endswith(".weight")}
    others = {n: d for n, d in others.items() if not n.endswith((".weight_stored", ".weight_scale"))}
    return {**weights, **others}


def test_the_embedded_tokenizer_gives_the_folder_tokenizers_ids(written):
    out = written("wan2.1-t2v", "bf16")
    loaded = load_model_files(out.files, LoadOptions(dtype="fp32"), tiny_catalogue())
    prompt = "a cat dances with the monkey, 12 times!"
    assert loaded.pipe.tokenizer(prompt).input_ids == build_tiny_tokenizer()(prompt).input_ids


@pytest.mark.parametrize("layout", list(KeyLayout))
def test_layout_and_storage_are_read_from_the_tensors(written, layout, tmp_path):
    out = written("wan2.1-t2v", "fp8_scaled", layout.value)
    renamed = tmp_path / "no_hint_in_this_name.bin"  # names and extensions play no part
    renamed.write_bytes(out.files.model.read_bytes())
    file = read_weight_file(renamed, "model", "transformer")
    assert (file.kind, file.layout, file.storage) == ("transformer", layout, "fp8_scaled")
    assert file.fields["num_layers"] == 2 and file.fields["in_channels"] == 16
    vae = read_weight_file(out.files.vae, "vae", "vae")
    assert (vae.layout, vae.fields["z_dim"]) == (KeyLayout.ORIGINAL, 16)
    text = read_weight_file(out.files.text_encoder, "text_encoder", "text_encoder")
    assert text.fields["class"] == "UMT5EncoderModel" and text.tokenizer_model and text.storage == "fp8_scaled"


def comfy_quant_copy(path, target, layer_format="float8_e4m3fn", raw: bytes | None = None):
    """`path` (fp8 scaled) rewritten in ComfyUI's newer layout: `weight_scale` + a `comfy_quant` record."""
    import json

    import safetensors.torch

    tensors = safetensors.torch.load_file(str(path))
    out = {}
    for name, tensor in tensors.items():
        if name == "scaled_fp8":
            continue
        if name.endswith(".scale_weight"):
            layer = name.removesuffix(".scale_weight")
            out[f"{layer}.weight_scale"] = tensor
            record = raw if raw is not None else json.dumps({"format": layer_format}).encode()
            out[f"{layer}.comfy_quant"] = torch.frombuffer(bytearray(record), dtype=torch.uint8)
        else:
            out[name] = tensor
    safetensors.torch.save_file(out, str(target))
    return target


def test_comfyuis_newer_fp8_layout_reads_like_fp8_scaled_and_other_formats_are_named(written, tmp_path):
    from dataclasses import replace

    from vidmem.pipelines.family import ModelError

    out = written("wan2.1-t2v", "fp8_scaled")
    newer = replace(out.files, model=comfy_quant_copy(out.files.model, tmp_path / "wan_fp8mixed.safetensors"))
    options = LoadOptions(dtype="fp32", weights_on_disk=False)
    loaded = load_model_files(newer, options, tiny_catalogue())
    assert loaded.storage["transformer"] == "fp8_scaled"
    assert torch.equal(latents(loaded, "wan2.1-t2v"), latents(load_model_files(out.files, options, tiny_catalogue()), "wan2.1-t2v"))
    nvfp4 = replace(out.files, model=comfy_quant_copy(out.files.model, tmp_path / "wan_nvfp4.safetensors", "nvfp4"))
    with pytest.raises(ModelError, match="model: 'wan_nvfp4.safetensors': .* quantized as 'nvfp4'"):
        load_model_files(nvfp4, options, tiny_catalogue())


@pytest.mark.parametrize("record", [b"{bad", b"[1]", b"\xff\xfe"])
def test_a_damaged_comfy_quant_record_is_named_not_raised_raw(written, tmp_path, record):
    from dataclasses import replace

    from vidmem.pipelines.family import ModelError

    out = written("wan2.1-t2v", "fp8_scaled")
    damaged = replace(out.files, model=comfy_quant_copy(out.files.model, tmp_path / "damaged.safetensors", raw=record))
    with pytest.raises(ModelError, match="model: 'damaged.safetensors': .* the file is damaged"):
        load_model_files(damaged, LoadOptions(dtype="fp32"), tiny_catalogue())


def test_reading_and_renaming_copy_nothing(written):
    """Original -> diffusers names (diffusers' converter) moves the file's own views; a bf16 load at
    bf16 uses them in place, copying only what from_pretrained keeps in fp32."""
    out = written("wan2.1-t2v", "bf16")
    file = read_weight_file(out.files.model, "model", "transformer")
    assert all(is_file_backed(t) for t in file.tensors.values())
    loaded = load_model_files(out.files, LoadOptions(dtype="bf16", weights_on_disk=True), tiny_catalogue())
    report = loaded.storage_reports["transformer"]
    fp32_islands = sum(t.numel() * 4 for n, t in loaded.pipe.transformer.state_dict().items() if t.dtype == torch.float32)
    assert report.copied_bytes <= fp32_islands and report.mapped_bytes > report.copied_bytes


@pytest.mark.parametrize("storage,layout", [("fp8_scaled", KeyLayout.ORIGINAL), ("bf16", KeyLayout.PREFIXED), ("fp8_e4m3fn", KeyLayout.DIFFUSERS)])
def test_streamed_random_files_are_valid_comfy_files(tmp_path, storage, layout):
    """The bench writer (tensor by tensor, header from shapes) gives files safetensors and the loader read."""
    import safetensors

    from vidmem.pipelines.comfy_files import ModelFiles
    from vidmem.pipelines.comfy_files.random_files import write_random_file
    from vidmem.pipelines.tiny_files import tiny_spiece_model

    entry = {e.name: e for e in tiny_catalogue()}["tiny-wan2.2-a14b"]
    parts = {name: write_random_file(entry.components[component], tmp_path / f"{name}.safetensors", storage, layout,
                                     seed=i, spiece_model=tiny_spiece_model() if name == "text_encoder" else None)
             for i, (name, component) in enumerate((("model", "transformer"), ("model_2", "transformer_2"),
                                                    ("text_encoder", "text_encoder"), ("vae", "vae")))}
    with safetensors.safe_open(str(parts["model"]), "pt") as file:
        assert len(file.keys()) > 50
    loaded = load_model_files(ModelFiles(**parts), LoadOptions(dtype="fp32"), tiny_catalogue())
    assert loaded.config_name == "tiny-wan2.2-a14b" and loaded.storage["transformer_2"] == storage
    assert latents(loaded, "wan2.2-a14b").isfinite().all()


def test_a_file_of_holes_has_the_real_files_header_and_size(tmp_path):
    """`holes`: the same header, scales and tokenizer as the written file, the weights zeros (sparse)."""
    import safetensors

    from vidmem.pipelines.comfy_files.random_files import write_random_file
    from vidmem.pipelines.tiny_files import tiny_spiece_model

    entry = {e.name: e for e in tiny_catalogue()}["tiny-wan2.1-t2v"]
    for component, storage in (("transformer", "fp8_scaled"), ("text_encoder", "fp8_scaled")):
        spiece = tiny_spiece_model() if component == "text_encoder" else None
        full = write_random_file(entry.components[component], tmp_path / f"{component}.safetensors", storage, spiece_model=spiece)
        holes = write_random_file(entry.components[component], tmp_path / f"{component}_holes.safetensors", storage,
                                  spiece_model=spiece, holes=True)
        assert holes.stat().st_size == full.stat().st_size
        with safetensors.safe_open(str(full), "pt") as a, safetensors.safe_open(str(holes), "pt") as b:
            assert a.keys() == b.keys()
            for key in a.keys():
                kept = key.endswith("scale_weight") or key == "spiece_model"
                mine = b.get_tensor(key)
                assert torch.equal(mine, a.get_tensor(key)) if kept else not mine.float().any(), key


def test_weight_dtype_gguf_keeps_rows_it_cannot_block(written):
    """Tiny Wan's width is 24: most rows are not whole 32-weight blocks and stay as stored."""
    out = written("wan2.1-t2v", "bf16")
    loaded = load_model_files(out.files, LoadOptions(dtype="fp32", weight_dtype="gguf_q8_0"), tiny_catalogue())
    ffn = loaded.pipe.transformer.blocks[0].ffn
    assert ffn.net[2].format.name == "gguf_q8_0"  # 32 inputs: whole blocks
    assert ffn.net[0].proj.format.name == "bf16"  # 24 inputs: kept as the file holds it
    assert latents(loaded, "wan2.1-t2v").isfinite().all()


def test_tiny_files_can_carry_a_templates_real_file_names(tmp_path):
    real = {"model": "wan2.1_t2v_14B_fp8_scaled.safetensors", "text_encoder": "umt5_xxl_fp8_e4m3fn_scaled.safetensors"}
    out = save_tiny_comfy_files("wan2.1-t2v", tmp_path, "fp8_scaled", reference=False, file_names=real)
    assert out.reference is None and out.files.model == tmp_path / "diffusion_models" / real["model"]
    assert out.files.text_encoder.name == real["text_encoder"] and out.files.vae.name == "tiny_wan2.1-t2v_vae.safetensors"
    assert (tmp_path / "vidmem_configs" / "tiny-wan2.1-t2v.json").is_file()
    assert load_model_files(out.files, LoadOptions(dtype="fp32"), tiny_catalogue()).storage["transformer"] == "fp8_scaled"


@pytest.mark.parametrize("storage", ["fp8_scaled", "gguf_q8_0"])
def test_the_t5_feed_forwards_dtype_probe_upcasts_nothing(written, monkeypatch, storage):
    """UMT5's feed-forward reads wo.weight for its dtype before calling wo: with wo stored, each read would upcast
    the whole matrix. One upcast per stored linear per encode, and the same encoder output as the unwrapped forward."""
    from vidmem.memory.storage import StoredLinear, StoredTensor

    loaded = load_model_files(written("wan2.1-t2v", storage).files, LoadOptions(dtype="fp32"), tiny_catalogue())
    encoder = loaded.pipe.text_encoder
    stored = [m for m in encoder.modules() if isinstance(m, StoredLinear)]
    wrapped = [m for m in encoder.modules() if "forward" in m.__dict__ and isinstance(getattr(m, "wo", None), StoredLinear)]
    assert stored and len(wrapped) == encoder.config.num_layers
    calls, dequantize = [], StoredTensor.dequantize
    monkeypatch.setattr(StoredTensor, "dequantize", lambda self, *a, **k: (calls.append(1), dequantize(self, *a, **k))[1])
    ids = torch.randint(0, 32, (1, 12))
    with torch.no_grad():
        answered = encoder(ids).last_hidden_state
    answered_calls = len(calls)
    assert answered_calls >= len(stored)  # every stored linear upcast once for its forward (embeddings may add)
    for module in wrapped:
        del module.forward  # transformers' own forward, probing wo.weight
    with torch.no_grad():
        assert torch.equal(encoder(ids).last_hidden_state, answered)
    assert len(calls) - answered_calls == answered_calls + 2 * len(wrapped)  # two probes per layer, each an upcast


def test_the_disk_tier_reads_streamed_weights_ahead_of_their_copies(written, monkeypatch):
    """Under a streamed tier the schedule advises the kernel to read the file pages of the groups past its prefetch
    window; a call that copied everything into RAM advises nothing. The frames do not depend on it."""
    from vidmem.memory import residency

    advised = []
    read_ahead = residency.read_ahead
    monkeypatch.setattr(residency, "read_ahead", lambda hosts: advised.append(read_ahead(hosts)) or advised[-1])
    out = written("wan2.1-t2v", "fp8_scaled")
    strategy = MemoryStrategy(offload="sequential")
    mapped = load_model_files(out.files, LoadOptions(dtype="fp32", weights_on_disk=True), tiny_catalogue())
    on_disk = sample(mapped, strategy, request_for("wan2.1-t2v"), backend=CpuBackend()).latent["samples"]
    assert advised and sum(advised) > 0
    advised.clear()
    copied = load_model_files(out.files, LoadOptions(dtype="fp32", weights_on_disk=False), tiny_catalogue())
    in_ram = sample(copied, strategy, request_for("wan2.1-t2v"), backend=CpuBackend()).latent["samples"]
    assert sum(advised) == 0 and torch.allclose(on_disk, in_ram, atol=UNALIGNED_TOLERANCE, rtol=0)
