"""Load Video Pipeline's text_encoder_file / text_encoder_2_file: a folder's text encoder replaced by
Comfy-Org's single files (umt5_xxl_* for Wan, qwen_2.5_vl_7b* and byt5_small_glyphxl for HunyuanVideo 1.5,
gemma_3_12B_it* for LTX-2, t5xxl_* for CogVideoX), read by their tensors.

The tiny files are written from the folder's own text encoder under ComfyUI's names (text_encoders.py's
table reversed), so the file-loaded pipeline must encode a prompt bit for bit as the folder-loaded one
where the file stores what the folder computes with; a wrong table entry fails the round trip (and the
names are checked against the keys ComfyUI itself reads, restated here)."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from test_comfy_files import comfy_quant_copy
from test_tiers import request_for
from vidmem.memory import MemoryStrategy
from vidmem.memory.device import CpuBackend
from vidmem.memory.storage import StoredLinear, is_file_backed
from vidmem.pipelines.comfy_files import text_encoders
from vidmem.pipelines.comfy_files.write import store_tensors, write_language_model, write_text_encoder, write_vae
from vidmem.pipelines.family import ModelError
from vidmem.pipelines.loader import load_pipeline
from vidmem.pipelines.planning import plan_options
from vidmem.pipelines.sample import sample

HY15, LTX2, WAN, COG = "hunyuanvideo1.5-t2v", "ltx2-t2v", "wan2.1-t2v", "cogvideox-t2v"
GLYPH_PROMPT = 'a sign that says "hi"'  # quoted text: HunyuanVideo 1.5 runs its ByT5 encoder on it
# Keys ComfyUI's comfy/sd.py (detect_te_model) and text_encoders/llama.py read in these files, restated.
COMFY_KEYS = {
    "Qwen2_5_VLTextModel": ("model.layers.0.self_attn.k_proj.bias", "model.layers.0.self_attn.q_proj.weight",
                            "model.embed_tokens.weight", "model.norm.weight", "model.layers.1.mlp.gate_proj.weight"),
    "Gemma3ForConditionalGeneration": ("model.layers.0.post_feedforward_layernorm.weight",
                                       "model.layers.1.self_attn.q_norm.weight", "model.embed_tokens.weight",
                                       "model.norm.weight", "multi_modal_projector.mm_input_projection_weight",
                                       "multi_modal_projector.mm_soft_emb_norm.weight",
                                       "vision_model.embeddings.patch_embedding.weight", "vision_model.post_layernorm.weight",
                                       "vision_model.encoder.layers.0.self_attn.q_proj.weight"),
}
QWEN_EXTRAS = {"visual.blocks.0.attn.qkv.weight": torch.ones(6, 2), "lm_head.weight": torch.ones(3, 2)}  # never read


def encoder(loaded, component: str = "text_encoder") -> torch.nn.Module:
    return getattr(loaded.pipe, component)


def write_file(loaded, component: str, storage: str, path, with_vision: bool = True):
    """The folder's `component` as Comfy-Org ships it, stored in `storage`."""
    module = encoder(loaded, component)
    tensors = store_tensors(module, storage)
    class_name = type(module).__name__
    if class_name in text_encoders.LAYOUTS:
        if not with_vision:
            tensors = {n: t for n, t in tensors.items() if not n.startswith(text_encoders.GEMMA3.optional)}
        extras = QWEN_EXTRAS if class_name == "Qwen2_5_VLTextModel" else {}
        return write_language_model(tensors, path, class_name, extras)
    return write_text_encoder(tensors, path, None)


def hy15_transformer_file(tiny_loaded, path, storage: str = "fp32"):
    """The tiny HunyuanVideo 1.5 transformer as Comfy-Org ships it."""
    from vidmem.pipelines.comfy_files.write import write_hy15_transformer

    state = {n: t.detach() for n, t in tiny_loaded(HY15).pipe.transformer.state_dict().items()}
    return write_hy15_transformer(state, path, storage)


def embeddings(loaded, prompt: str = GLYPH_PROMPT) -> tuple[torch.Tensor, ...]:
    """The pipeline's own prompt encoding (every tensor it returns)."""
    pipe = loaded.pipe
    with torch.no_grad():  # as a pipeline call encodes (grad mode takes another attention kernel)
        if type(pipe).__name__.endswith("HunyuanVideo15Pipeline"):
            out = pipe.encode_prompt(prompt, device=torch.device("cpu"))
        else:
            out = pipe.encode_prompt(prompt, do_classifier_free_guidance=False, device=torch.device("cpu"))
    return tuple(t for t in out if isinstance(t, torch.Tensor))


def assert_equal(found, expected):
    assert len(found) == len(expected)
    for a, b in zip(found, expected):
        assert a.dtype == b.dtype and torch.equal(a, b), (a - b).abs().max()


@pytest.fixture(scope="module")
def files(tiny_loaded, tmp_path_factory):
    """(variant, component, storage[, "novision"]) -> a written file, each written once."""
    root, cache = tmp_path_factory.mktemp("text-encoders"), {}

    def get(variant: str, component: str = "text_encoder", storage: str = "fp32", with_vision: bool = True):
        key = (variant, component, storage, with_vision)
        if key not in cache:
            name = f"{variant}-{component}-{storage}{'' if with_vision else '-novision'}.safetensors"
            cache[key] = write_file(tiny_loaded(variant), component, storage, root / name, with_vision)
        return cache[key]

    return get


# --- the layout -----------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", [HY15, LTX2])
def test_the_written_names_are_comfyuis_and_read_back_to_the_model(tiny_loaded, files, variant):
    module = encoder(tiny_loaded(variant))
    path = files(variant)
    with safe_open(str(path), "pt") as file:
        names = set(file.keys())
    assert set(COMFY_KEYS[type(module).__name__]) <= names
    assert not [n for n in names if "language_model" in n or "vision_tower" in n]  # transformers 5's nesting only
    back = text_encoders.model_tensors(text_encoders.LAYOUTS[type(module).__name__], dict.fromkeys(names))
    assert set(back) == set(module.state_dict()) - {"lm_head.weight"}  # Gemma's lm_head is tied to the embedding


# ComfyUI's own configs of the real models (comfy/text_encoders/llama.py Qwen25_7BVLI_Config, Gemma3_12B_Config),
# restated: the shapes of Comfy-Org's files.
COMFY_SIZES = {
    "qwen2.5-vl-7b-text": dict(vocab_size=152064, hidden_size=3584, num_hidden_layers=28, intermediate_size=18944,
                               q_width=28 * 128, kv_width=4 * 128),
    "gemma-3-12b": dict(vocab_size=262208, hidden_size=3840, num_hidden_layers=48, intermediate_size=15360, q_width=16 * 256,
                        kv_width=8 * 256, head_dim=256),
}


@pytest.mark.parametrize("ref", list(COMFY_SIZES))
def test_real_size_files_fit_the_shipped_diffusers_configs(ref):
    """The real models built on meta from the configs vidmem ships for the diffusers folders, written in ComfyUI's
    names and read back: their fields are ComfyUI's sizes and agree with the config's, so a real file is taken."""
    from vidmem.pipelines.comfy_files.build import build_empty
    from vidmem.pipelines.comfy_files.catalogue import read_component

    component = read_component("text_encoder", {"ref": ref})
    with torch.device("meta"):
        state = dict(build_empty(component).state_dict())
    layout = text_encoders.LAYOUTS[component.class_name]
    names = text_encoders.comfy_names(layout, [n for n in state if n != "lm_head.weight"])
    file = {original: state[name] for name, original in names.items()}
    found = text_encoders.fields(text_encoders.model_tensors(layout, file), component.class_name)
    assert {k: found[k] for k in COMFY_SIZES[ref]} == COMFY_SIZES[ref]
    assert found == text_encoders.config_fields(component.class_name, component.config)


# google/gemma-3-12b-it's own config.json, restated in its shape: text_config holds only the keys that differ from
# Gemma3TextConfig's defaults (no head_dim, no vocab_size), as transformers 4.x saves configs too.
SPARSE_GEMMA = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "mm_tokens_per_image": 256,
                "text_config": {"hidden_size": 3840, "intermediate_size": 15360, "model_type": "gemma3_text",
                                "num_attention_heads": 16, "num_hidden_layers": 48, "num_key_value_heads": 8,
                                "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024},
                "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                                  "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                                  "patch_size": 14, "vision_use_head": False}}
# Qwen2.5-VL 7B's language model as a flat Qwen2_5_VLTextConfig (HunyuanVideo 1.5's text_encoder/config.json shape).
FLAT_QWEN = {"model_type": "qwen2_5_vl_text", "hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28,
             "num_hidden_layers": 28, "num_key_value_heads": 4, "vocab_size": 152064}


@pytest.mark.parametrize("class_name,config,ref", [("Gemma3ForConditionalGeneration", SPARSE_GEMMA, "gemma-3-12b"),
                                                   ("Qwen2_5_VLTextModel", FLAT_QWEN, "qwen2.5-vl-7b-text")])
def test_a_config_that_leaves_out_defaults_gives_the_models_fields(class_name, config, ref):
    """Keys a config omits take the config class's defaults (Gemma 3 12B's head_dim 256, not hidden // heads = 240)."""
    fields = text_encoders.config_fields(class_name, config)
    assert {k: fields[k] for k in COMFY_SIZES[ref]} == COMFY_SIZES[ref]


def test_the_t5_reader_takes_left_out_keys_at_their_defaults_too():
    """One rule for every text encoder config: a key left out is the config class's default, never unchecked."""
    from vidmem.pipelines.comfy_files import detect

    fields = detect.text_encoder_config_fields("UMT5EncoderModel", {"d_model": 4096, "num_layers": 24})
    assert fields["relative_attention_num_buckets"] == 32 and fields["num_heads"] == 6 and fields["vocab_size"] == 250112
    with pytest.raises(ModelError, match=r"the UMT5EncoderModel config.json does not configure its class \(.*d_model"):
        detect.text_encoder_config_fields("UMT5EncoderModel", {"d_model": "wide"})


# ComfyUI 0.8.0's comfy/text_encoders/byt5_config_small_glyph.json, restated: what byt5_small_glyphxl_fp16 holds.
COMFY_BYT5_GLYPH = dict(vocab_size=1510, d_model=1472, num_layers=12, num_heads=6, d_kv=64, d_ff=3584,
                        relative_attention_num_buckets=32)


def test_the_shipped_byt5_glyph_config_is_comfyuis():
    from vidmem.pipelines.comfy_files import detect
    from vidmem.pipelines.comfy_files.catalogue import read_component

    component = read_component("text_encoder_2", {"ref": "byt5-small-glyph"})
    fields = detect.text_encoder_config_fields(component.class_name, component.config)
    assert {k: fields[k] for k in COMFY_BYT5_GLYPH} == COMFY_BYT5_GLYPH


# --- the same encoder as the folder's -------------------------------------------------------------

@pytest.mark.reproducible_blas
@pytest.mark.parametrize("variant,component", [(HY15, "text_encoder"), (HY15, "text_encoder_2"), (LTX2, "text_encoder"),
                                               (WAN, "text_encoder"), (COG, "text_encoder")])
def test_a_file_in_the_folders_dtype_encodes_bit_for_bit_as_the_folder(tiny_loaded, tiny_folder, files, variant, component):
    path = files(variant, component)
    loaded = load_pipeline(tiny_folder(variant), "fp32", **{f"{component}_file": path})
    assert loaded.storage[component] == "fp32" and loaded.text_encoder_files == {component: str(path)}
    assert path.name in loaded.source
    matrices = [m.weight for m in encoder(loaded, component).modules() if isinstance(m, torch.nn.Linear)]
    assert matrices and all(is_file_backed(w) for w in matrices)  # used in place from the file's mapping
    assert_equal(embeddings(loaded), embeddings(tiny_loaded(variant)))


@pytest.mark.reproducible_blas
def test_a_bf16_file_encodes_as_the_folder_at_bf16(tiny_folder, files):
    folder = load_pipeline(tiny_folder(HY15), "bf16")
    loaded = load_pipeline(tiny_folder(HY15), "bf16", text_encoder_file=files(HY15, storage="bf16"))
    assert loaded.storage["text_encoder"] == "bf16"
    assert_equal(embeddings(loaded), embeddings(folder))


@pytest.mark.reproducible_blas
@pytest.mark.parametrize("variant", [HY15, LTX2])
def test_fp8_scaled_files_in_either_layout_encode_as_the_folder_lowered_to_fp8_scaled(tiny_folder, files, tmp_path, variant):
    """Comfy-Org's fp8-scaled file (scale_weight + scaled_fp8 marker) and ComfyUI's newer layout (weight_scale +
    comfy_quant records) hold the values weight_dtype=fp8_scaled quantizes the folder's encoder to."""
    scaled = files(variant, storage="fp8_scaled")
    newer = comfy_quant_copy(scaled, tmp_path / "te_fp8mixed.safetensors")
    lowered = embeddings(load_pipeline(tiny_folder(variant), "fp32", weight_dtype="fp8_scaled"))
    for path in (scaled, newer):
        loaded = load_pipeline(tiny_folder(variant), "fp32", text_encoder_file=path)
        assert loaded.storage["text_encoder"] == "fp8_scaled"
        assert dict(plan_options(loaded).storage)["text_encoder"] == "fp8_scaled"  # planned as fp8 bytes
        assert any(isinstance(m, StoredLinear) for m in encoder(loaded).modules())
        assert_equal(embeddings(loaded), lowered)


def test_a_gguf_file_is_read_through_the_storage_and_planned_in_its_format(tiny_loaded, tiny_folder, tmp_path):
    """A GGUF text encoder (the T5 names, Q8_0 matrices) stays stored; the loaded pipeline plans it as Q8_0."""
    from vidmem.pipelines.comfy_files.write import dequantized

    stored = store_tensors(encoder(tiny_loaded(WAN)), "gguf_q8_0")
    path = write_text_encoder(stored, tmp_path / "umt5-xxl-encoder-Q8_0.gguf", None)
    loaded = load_pipeline(tiny_folder(WAN), "fp32", text_encoder_file=path)
    assert loaded.storage["text_encoder"] == "gguf_q8_0"
    assert dict(plan_options(loaded).storage)["text_encoder"] == "gguf_q8_0"
    assert any(isinstance(m, StoredLinear) for m in encoder(loaded).modules())
    reference = load_pipeline(tiny_folder(WAN), "fp32")
    encoder(reference).load_state_dict(dequantized(stored), strict=False)  # the values the file holds, plain
    found, expected = embeddings(loaded), embeddings(reference)
    for a, b in zip(found, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)  # the same values, upcast per layer or held plain


def test_weight_dtype_lowers_the_file_as_it_lowers_the_folders_encoder(tiny_folder, files):
    loaded = load_pipeline(tiny_folder(HY15), "fp32", weight_dtype="fp8_scaled",
                           text_encoder_file=files(HY15, storage="bf16"), text_encoder_2_file=files(HY15, "text_encoder_2"))
    assert loaded.storage["text_encoder"] == "fp8_scaled"  # lowered
    assert loaded.storage["text_encoder_2"] == "fp32"  # never lowered, as the folder's text_encoder_2 is not


def test_the_ram_check_of_a_lowered_folder_leaves_out_the_encoders_from_files(tiny_folder, files, monkeypatch):
    """They lie in their files' mappings: counting them at dtype would refuse a load that fits."""
    from vidmem.pipelines import folder_storage

    seen = []
    monkeypatch.setattr(folder_storage, "check_against_ram", lambda needs, *args: seen.extend(label for label, _ in needs))
    load_pipeline(tiny_folder(HY15), "fp32", weight_dtype="fp8_scaled")
    assert {label.split()[0] for label in seen} == {"transformer", "text_encoder", "vae", "text_encoder_2"}  # all counted
    seen.clear()
    load_pipeline(tiny_folder(HY15), "fp32", weight_dtype="fp8_scaled",
                  text_encoder_file=files(HY15, storage="fp8_scaled"), text_encoder_2_file=files(HY15, "text_encoder_2"))
    assert {label.split()[0] for label in seen} == {"transformer", "vae"}  # a file at weight_dtype's format: in place


def ram_needs(monkeypatch, folder, **inputs) -> dict[str, int]:
    """label -> bytes of the one RAM check `load_pipeline(folder, "fp32", **inputs)` makes (the load runs)."""
    from vidmem.pipelines import folder_storage

    seen, check = {}, folder_storage.check_against_ram
    monkeypatch.setattr(folder_storage, "check_against_ram",
                        lambda needs, *args: seen.update(needs) or check(needs, *args))
    load_pipeline(folder, "fp32", **inputs)
    monkeypatch.setattr(folder_storage, "check_against_ram", check)
    return seen


def test_a_text_encoder_file_lowered_by_weight_dtype_is_counted_in_the_folders_ram_check(
        tiny_loaded, tiny_folder, files, monkeypatch):
    """The file's matrices quantized into RAM are counted at the format, from its header, with what the fill casts
    (its bf16 norms at fp32); at its own format its matrices are used in place: only the casts count."""
    from vidmem.memory.storage import FORMATS
    from vidmem.pipelines.comfy_files import detect
    from vidmem.pipelines.comfy_files.files import read_weight_file
    from vidmem.pipelines.weight_storage import lowered_names

    path = files(HY15, storage="bf16")
    needs = ram_needs(monkeypatch, tiny_folder(HY15), weight_dtype="fp8_scaled", text_encoder_file=path)
    label = f"text_encoder_file '{path.name}' lowered to fp8_scaled"
    tensors = read_weight_file(path, "text_encoder_file", detect.TEXT_ENCODER).tensors
    matrices = lowered_names(encoder(tiny_loaded(HY15)), tensors, "fp8_scaled", torch.float32)  # the folder's plain encoder
    assert matrices and len(matrices) < len(tensors)  # the matrices only: norms and biases stay mapped
    casts = load_pipeline(tiny_folder(HY15), "fp32", weight_dtype="fp8_scaled",
                          text_encoder_file=path).storage_reports["text_encoder"].copied_bytes
    assert needs[label] == FORMATS["fp8_scaled"].stored_bytes(sum(tensors[n].shape.numel() for n in matrices)) + casts
    in_place = ram_needs(monkeypatch, tiny_folder(HY15), weight_dtype="bf16", text_encoder_file=path)
    assert not [label for label in in_place if "lowered" in label]  # the matrices stay mapped: only the casts count
    assert in_place[f"text_encoder_file '{path.name}' cast to fp32"] == casts


def test_a_lowered_text_encoder_file_that_does_not_fit_is_refused_before_anything_is_built(tiny_folder, files,
                                                                                          monkeypatch, built):
    import psutil
    from types import SimpleNamespace

    path = files(HY15, storage="bf16")
    needs = ram_needs(monkeypatch, tiny_folder(HY15), weight_dtype="fp8_scaled", text_encoder_file=path)
    file_need = next(nbytes for label, nbytes in needs.items() if path.name in label)
    ram = sum(needs.values()) - file_need // 2  # the folder fits; not with the lowered file
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(total=ram))
    monkeypatch.setattr(psutil, "swap_memory", lambda: SimpleNamespace(total=0))
    built.clear()
    with pytest.raises(ModelError, match=rf"weight_dtype fp8_scaled needs .*text_encoder_file '{path.name}' lowered to "
                                         r"fp8_scaled.*or a text encoder file already stored in weight_dtype's format"):
        load_pipeline(tiny_folder(HY15), "fp32", weight_dtype="fp8_scaled", text_encoder_file=path)
    assert built == []


def test_the_folder_needs_only_the_config_of_a_replaced_encoder(tiny_folder, tiny_loaded, files, tmp_path):
    folder = shutil.copytree(tiny_folder(HY15), tmp_path / "hy15")
    for component in ("text_encoder", "text_encoder_2"):
        for weights in (folder / component).glob("*.safetensors"):
            weights.unlink()
    loaded = load_pipeline(folder, "fp32", text_encoder_file=files(HY15),
                           text_encoder_2_file=files(HY15, "text_encoder_2"))
    assert_equal(embeddings(loaded), embeddings(tiny_loaded(HY15)))
    with pytest.raises(ModelError, match="text_encoder"):  # without the file the folder's weights are missing
        load_pipeline(folder, "fp32")


@pytest.mark.reproducible_blas
@pytest.mark.parametrize("tier", ["block_swap", "sequential"])
def test_a_sample_at_a_tier_equals_the_folder_only_run(tiny_loaded, tiny_folder, files, tier):
    swapped = {"blocks_to_swap": 1, "prefetch_blocks": 0} if tier == "block_swap" else {}
    strategy = MemoryStrategy(offload=tier, **swapped)
    loaded = load_pipeline(tiny_folder(HY15), "fp32", text_encoder_file=files(HY15),
                           text_encoder_2_file=files(HY15, "text_encoder_2"))
    request = replace(request_for(HY15), prompt=GLYPH_PROMPT)
    found = sample(loaded, strategy, request, backend=CpuBackend()).latent["samples"]
    expected = sample(tiny_loaded(HY15), strategy, request, backend=CpuBackend()).latent["samples"]
    assert torch.equal(found, expected)


@pytest.mark.reproducible_blas
def test_gemma_without_its_vision_tower_runs_its_language_model_on_every_tier(tiny_loaded, tiny_folder, files):
    """A file without the vision part: the part is removed from the encoder (nothing left on meta for a
    tier to move), and LTX-2's prompt encoding, which never runs it, is the folder's."""
    loaded = load_pipeline(tiny_folder(LTX2), "fp32", text_encoder_file=files(LTX2, with_vision=False))
    gemma = encoder(loaded)
    assert gemma.model.vision_tower is None and gemma.model.multi_modal_projector is None
    assert not [n for n, t in gemma.state_dict().items() if t.is_meta]
    assert_equal(embeddings(loaded), embeddings(tiny_loaded(LTX2)))
    with_vision = encoder(load_pipeline(tiny_folder(LTX2), "fp32", text_encoder_file=files(LTX2)))
    assert with_vision.model.vision_tower is not None  # carried by the file: mapped as the folder has it
    request = request_for(LTX2)
    tiers = (MemoryStrategy(offload="none"), MemoryStrategy(offload="model"),
             MemoryStrategy(offload="block_swap", blocks_to_swap=1, prefetch_blocks=0),
             MemoryStrategy(offload="sequential"))
    for strategy in tiers:
        found = sample(loaded, strategy, request, backend=CpuBackend()).latent["samples"]
        assert torch.equal(found, sample(tiny_loaded(LTX2), strategy, request, backend=CpuBackend()).latent["samples"])


def test_a_gemma_file_without_its_vision_tower_is_planned_without_it(tiny_loaded, tiny_folder, files):
    """The loader records the parts it removed; the planner builds the encoder without them, so it counts the
    bytes the run holds (Gemma 3 12B's SigLIP tower and projector: about 0.42B parameters)."""
    from vidmem.pipelines.planning import planner_model

    without = load_pipeline(tiny_folder(LTX2), "fp32", text_encoder_file=files(LTX2, with_vision=False))
    whole = load_pipeline(tiny_folder(LTX2), "fp32", text_encoder_file=files(LTX2))
    assert without.removed == ("text_encoder.model.vision_tower", "text_encoder.model.multi_modal_projector")
    assert whole.removed == ()
    gemma = encoder(tiny_loaded(LTX2))
    parts = [gemma.get_submodule(path) for path in text_encoders.GEMMA3.optional]
    vision = sum(t.numel() * t.element_size() for part in parts for t in [*part.parameters(), *part.buffers()])
    planned = {loaded.removed: planner_model(loaded).weights("text_encoder").nbytes for loaded in (without, whole)}
    assert vision > 0 and planned[()] - planned[without.removed] == vision


# --- refusals -------------------------------------------------------------------------------------

@pytest.fixture
def built(monkeypatch):
    """Every model build_empty makes during the test (a refusal must come before any)."""
    from vidmem.pipelines.comfy_files import build

    made, original = [], build.build_empty
    monkeypatch.setattr(build, "build_empty", lambda component: made.append(component.name) or original(component))
    return made


def test_a_file_of_another_family_is_refused_with_what_it_holds_and_what_to_pick(tiny_folder, files, built):
    with pytest.raises(ModelError, match=r"text_encoder_file: '.*' is a UMT5-XXL text encoder \(Wan's\), but the "
                                         r"text_encoder of 'hunyuanvideo1.5-t2v' is a Qwen2.5-VL 7B .* pick qwen_2.5_vl_7b"):
        load_pipeline(tiny_folder(HY15), "fp32", text_encoder_file=files(WAN))
    with pytest.raises(ModelError, match=r"is a Qwen2.5-VL 7B \(HunyuanVideo 1.5's\) text encoder, .* is a Gemma 3 12B .* "
                                         r"pick gemma_3_12B_it"):
        load_pipeline(tiny_folder(LTX2), "fp32", text_encoder_file=files(HY15))
    with pytest.raises(ModelError, match=r"text_encoder_2_file: .* is a Qwen2.5-VL 7B .* pick byt5_small_glyphxl_fp16"):
        load_pipeline(tiny_folder(HY15), "fp32", text_encoder_2_file=files(HY15))
    with pytest.raises(ModelError, match=r"text_encoder_file: .* is a UMT5-XXL text encoder \(Wan's\), but the text_encoder "
                                         r"of 'cogvideox-t2v' is a T5 text encoder .*: pick t5xxl_fp16"):
        load_pipeline(tiny_folder(COG), "fp32", text_encoder_file=files(WAN))
    # The same class, another model (ByT5 for CogVideoX's T5-XXL): told field by field.
    with pytest.raises(ModelError, match=r"text_encoder_file: .* is not the text_encoder of 'cogvideox-t2v' \(vocab_size "
                                         r"\d+ \(the model has \d+\).*\); pick t5xxl_fp16"):
        load_pipeline(tiny_folder(COG), "fp32", text_encoder_file=files(HY15, "text_encoder_2"))
    assert built == []


def test_a_transformer_or_vae_in_the_text_encoder_input_is_refused_by_what_it_holds(tiny_loaded, tiny_folder, tmp_path,
                                                                                     built):
    vae = write_vae(store_tensors(tiny_loaded(WAN).pipe.vae, "fp32"), tmp_path / "wan_2.1_vae.safetensors")
    with pytest.raises(ModelError, match=r"text_encoder_file: 'wan_2.1_vae.safetensors' holds a Wan VAE, but this input "
                                         r"takes a text encoder \(a UMT5-XXL text encoder \(Wan's\)\)"):
        load_pipeline(tiny_folder(WAN), "fp32", text_encoder_file=vae)
    transformer = hy15_transformer_file(tiny_loaded, tmp_path / "hunyuanvideo1.5_480p_t2v_tiny.safetensors", "bf16")
    with pytest.raises(ModelError, match=r"text_encoder_file: 'hunyuanvideo1.5_480p_t2v_tiny.safetensors' holds a HunyuanVideo "
                                         r"1.5 transformer, but this input takes a text encoder \(a Qwen2.5-VL 7B"):
        load_pipeline(tiny_folder(HY15), "fp32", text_encoder_file=transformer)
    assert built == []


def test_a_file_of_another_size_is_refused_field_by_field(tiny_loaded, tiny_folder, tmp_path, built):
    import transformers

    qwen = encoder(tiny_loaded(HY15))
    config = qwen.config.to_dict() | {"num_hidden_layers": 3, "intermediate_size": 24, "layer_types": ["full_attention"] * 3}
    bigger = transformers.Qwen2_5_VLTextModel(type(qwen.config)(**config))
    path = write_language_model(store_tensors(bigger, "bf16"), tmp_path / "qwen_other.safetensors", "Qwen2_5_VLTextModel")
    with pytest.raises(ModelError, match=r"'qwen_other.safetensors' is not the text_encoder of 'hunyuanvideo1.5-t2v' "
                                         r"\(num_hidden_layers 3 \(the model has 2\); intermediate_size 24 \(the model has 16\)\)"):
        load_pipeline(tiny_folder(HY15), "fp32", text_encoder_file=path)
    assert built == []


def test_an_unreadable_format_is_refused_by_name_and_nothing_is_built(tiny_folder, files, tmp_path, built):
    nvfp4 = comfy_quant_copy(files(HY15, storage="fp8_scaled"), tmp_path / "qwen_nvfp4.safetensors", "nvfp4")
    with pytest.raises(ModelError, match=r"text_encoder_file: 'qwen_nvfp4.safetensors': .* quantized as 'nvfp4'"):
        load_pipeline(tiny_folder(HY15), "fp32", text_encoder_file=nvfp4)
    assert built == []


def test_a_language_model_no_family_uses_is_refused_by_name(tiny_loaded, tmp_path, tiny_folder):
    tensors = {"model.layers.0.self_attn.q_proj.weight": torch.ones(4, 4),
               "model.layers.0.self_attn.q_norm.weight": torch.ones(2), "model.embed_tokens.weight": torch.ones(8, 4)}
    from safetensors.torch import save_file

    save_file(tensors, str(tmp_path / "qwen_3_4b.safetensors"))
    with pytest.raises(ModelError, match="'qwen_3_4b.safetensors' is a Qwen 3 language-model text encoder, which no model"):
        load_pipeline(tiny_folder(HY15), "fp32", text_encoder_file=tmp_path / "qwen_3_4b.safetensors")


def test_a_second_text_encoder_file_needs_a_folder_with_one(tiny_folder, files, built):
    with pytest.raises(ModelError, match=r"text_encoder_2_file: 'wan2.1-t2v' has no second text encoder \(only "
                                         r"HunyuanVideo 1.5 has one"):
        load_pipeline(tiny_folder(WAN), "fp32", text_encoder_2_file=files(HY15, "text_encoder_2"))
    assert built == []


def test_a_refusal_comes_before_the_transformer_file_is_built(tiny_folder, tiny_loaded, files, tmp_path, built):
    transformer = hy15_transformer_file(tiny_loaded, tmp_path / "hunyuanvideo1.5_tiny.safetensors")
    with pytest.raises(ModelError, match="UMT5-XXL"):
        load_pipeline(tiny_folder(HY15), "fp32", transformer_file=transformer, text_encoder_file=files(WAN))
    assert built == []


@pytest.mark.parametrize("variant,dropped", [(HY15, "layers.1.mlp.up_proj.weight"),
                                             (WAN, "encoder.final_layer_norm.weight")])
def test_a_file_that_fits_the_config_but_lacks_a_tensor_is_refused_before_anything_is_built(
        tiny_loaded, tiny_folder, tmp_path, built, variant, dropped):
    module = encoder(tiny_loaded(variant))
    tensors = {name: t for name, t in store_tensors(module, "fp32").items() if name != dropped}
    if variant == HY15:
        path = write_language_model(tensors, tmp_path / "qwen_incomplete.safetensors", "Qwen2_5_VLTextModel")
        files = {"transformer_file": hy15_transformer_file(tiny_loaded, tmp_path / "hunyuanvideo1.5_tiny.safetensors")}
    else:
        path, files = write_text_encoder(tensors, tmp_path / "umt5_incomplete.safetensors", None), {}
    with pytest.raises(ModelError, match=rf"text_encoder_file: '{path.name}' lacks 1 of the tensors the text_encoder of "
                                         rf"'{variant}' needs \({dropped}\); the file is incomplete"):
        load_pipeline(tiny_folder(variant), "fp32", text_encoder_file=path, **files)
    assert built == []


# --- the node -------------------------------------------------------------------------------------

def test_the_node_reads_the_files_from_the_text_encoder_list(tiny_folder, files, tmp_path, monkeypatch):
    from types import SimpleNamespace

    from vidmem.nodes import host
    from vidmem.nodes.loader import VidMemLoadPipeline

    texts = tmp_path / "text_encoders"
    texts.mkdir()
    path = Path(shutil.copy(files(WAN, storage="fp8_scaled"), texts / "umt5_xxl_fp8_e4m3fn_scaled.safetensors"))
    (texts / "old.pth").write_bytes(b"x")
    listed = lambda key: sorted(p.name for p in texts.iterdir()) if key == "text_encoders" else []  # noqa: E731
    fake = SimpleNamespace(get_filename_list=listed,
                           get_folder_paths=lambda key: [str(texts)] if key == "text_encoders" else [])
    monkeypatch.setattr(host, "folder_paths", fake)
    monkeypatch.setenv("VIDMEM_ALLOW_ANY_PATH", "1")  # the folder is given by path, outside this fake's model folders
    spec = VidMemLoadPipeline.INPUT_TYPES()["optional"]
    for widget in ("text_encoder_file", "text_encoder_2_file"):
        assert spec[widget][0] == ["(from the folder)", path.name] and spec[widget][1]["tooltip"]  # never a pickle
    folder = str(tiny_folder(WAN))
    (loaded,) = VidMemLoadPipeline().load("x", "fp32", path=folder, text_encoder_file=path.name)
    assert loaded.text_encoder_files == {"text_encoder": str(path)}
    assert loaded.storage["text_encoder"] == "fp8_scaled" and "text_encoder fp8_scaled" in loaded.describe()
    (plain,) = VidMemLoadPipeline().load("x", "fp32", path=folder)
    assert "text_encoder" not in plain.storage and not plain.text_encoder_files
    with pytest.raises(ModelError, match="text_encoder_2_file 'gone.safetensors' was not found in models/text_encoders"):
        VidMemLoadPipeline().load("x", "fp32", path=folder, text_encoder_2_file="gone.safetensors")


def test_load_video_model_files_names_a_language_model_in_its_wan_inputs(files, tmp_path):
    """Comfy-Org's Qwen / Gemma files are recognised in the single-file loader's inputs too, and refused by
    what they are (a Gemma file has CLIP vision names under vision_model.: it is not taken for CLIP vision)."""
    from vidmem.pipelines.comfy_files import LoadOptions, load_model_files
    from vidmem.pipelines.tiny_files import save_tiny_comfy_files, tiny_catalogue

    wan = save_tiny_comfy_files(WAN, tmp_path, "bf16", reference=False).files
    with pytest.raises(ModelError, match=r"text_encoder: '.*' is a Qwen2.5-VL 7B \(HunyuanVideo 1.5's\) text encoder, but "
                                         r"tiny-wan2.1-t2v runs with umt5-xxl"):
        load_model_files(replace(wan, text_encoder=files(HY15)), LoadOptions(dtype="fp32"), tiny_catalogue())
    with pytest.raises(ModelError, match=r"clip_vision: '.*' holds a Gemma 3 12B \(LTX-2's\) text encoder, but this input "
                                         r"takes a CLIP vision encoder"):
        load_model_files(replace(wan, clip_vision=files(LTX2)), LoadOptions(dtype="fp32"), tiny_catalogue())
