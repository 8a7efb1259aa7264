"""GGUF text encoders in llama.cpp's names (city96's umt5 / T5 files, Qwen2.5-VL and Gemma 3 GGUFs) read
through Load Video Pipeline's text_encoder_file: the tiny folder's own encoder written as llama.cpp's converter
writes it (gguf_names' table reversed, Gemma's norms stored + 1) encodes a prompt bit for bit as the folder
for F32 files, and as the same weights quantized the same way for Q8_0. The names are also checked against
gguf-py's own tensor map (llama.cpp's), so a wrong table entry fails twice."""

from __future__ import annotations

import shutil

import pytest
import torch

from test_text_encoder_file import COG, HY15, LTX2, WAN, assert_equal, embeddings, encoder
from vidmem.memory.storage import StoredLinear
from vidmem.pipelines.comfy_files import gguf_names
from vidmem.pipelines.comfy_files.detect import storage_name
from vidmem.pipelines.comfy_files.write import dequantized, store_tensors, write_llama_cpp_text_encoder
from vidmem.pipelines.family import ModelError
from vidmem.pipelines.loader import load_pipeline

ARCH = {WAN: "t5encoder", COG: "t5encoder", HY15: "qwen2vl", LTX2: "gemma3"}


def exact_norms(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's state with Gemma's norms (built as zeros) drawn at random on a 2**-10 grid, so that they
    matter and llama.cpp's 1 + weight is exact in F32 (the round trip is then bit for bit; real files round
    there, as llama.cpp's converter does)."""
    generator = torch.Generator().manual_seed(0)

    def drawn(t):
        return (torch.randn(t.shape, generator=generator) * 256).round() / 1024

    return {name: drawn(t) if name.endswith("norm.weight") else t for name, t in module.state_dict().items()}


@pytest.fixture(scope="module")
def gguf_folder(tiny_folder, tmp_path_factory):
    """variant -> the tiny folder, its Gemma's norms made exact (see exact_norms); other variants as they are."""
    def get(variant):
        if variant != LTX2:
            return tiny_folder(variant)
        folder = tmp_path_factory.getbasetemp() / "gemma-exact-norms"
        if not folder.exists():
            shutil.copytree(tiny_folder(LTX2), folder)
            loaded = load_pipeline(tiny_folder(LTX2), "fp32")
            encoder(loaded).load_state_dict(exact_norms(encoder(loaded)))
            shutil.rmtree(folder / "text_encoder")
            encoder(loaded).save_pretrained(folder / "text_encoder")
        return folder

    return get


def write(loaded, variant, storage, path):
    return write_llama_cpp_text_encoder(store_tensors(encoder(loaded), storage), path, ARCH[variant])


def gguf_tensor_names(path) -> set[str]:
    import gguf

    return {t.name for t in gguf.GGUFReader(str(path)).tensors}


@pytest.mark.parametrize("variant", [WAN, COG, HY15, LTX2])
def test_the_written_names_are_llama_cpps_own(gguf_folder, tmp_path, variant):
    """Every name written is the one gguf-py's map (llama.cpp's) gives the model's tensor."""
    import gguf

    loaded = load_pipeline(gguf_folder(variant), "fp32")
    path = write(loaded, variant, "fp32", tmp_path / "te-F32.gguf")
    arch = next(a for a in gguf.MODEL_ARCH if gguf.MODEL_ARCH_NAMES[a] == ARCH[variant])
    names = gguf.get_tensor_name_map(arch, 64)
    # transformers' names as gguf-py knows them (its map is keyed by the HF checkpoints' names: `model.` before
    # a language model's layers); what llama.cpp's files leave out (tied copies, vision parts) skipped
    hf_names = {WAN: "", COG: "", HY15: "model.", LTX2: "model."}[variant]
    skipped = ("model.vision_tower.", "model.multi_modal_projector.", "lm_head.", "encoder.embed_tokens.")
    expected = set()
    for name in encoder(loaded).state_dict():
        if name.startswith(skipped):
            continue
        stem, leaf = (hf_names + name.removeprefix("model.language_model.")).rsplit(".", 1)
        expected.add(f"{names.get_name(stem)}.{leaf}")
    assert gguf_tensor_names(path) == expected


@pytest.mark.reproducible_blas
@pytest.mark.parametrize("variant", [WAN, COG, HY15, LTX2])
def test_an_f32_gguf_encodes_bit_for_bit_as_the_folder(gguf_folder, tmp_path, variant):
    folder = load_pipeline(gguf_folder(variant), "fp32")
    path = write(folder, variant, "fp32", tmp_path / "te-F32.gguf")
    loaded = load_pipeline(gguf_folder(variant), "fp32", text_encoder_file=path)
    assert loaded.storage["text_encoder"] == "fp32"
    assert_equal(embeddings(loaded), embeddings(folder))


@pytest.mark.reproducible_blas
def test_an_f16_gguf_encodes_as_the_folder_with_its_weights_in_f16(gguf_folder, tmp_path):
    folder = load_pipeline(gguf_folder(WAN), "fp32")
    stored = store_tensors(encoder(folder), "fp16")
    path = write_llama_cpp_text_encoder(stored, tmp_path / "umt5-xxl-encoder-F16.gguf", ARCH[WAN])
    loaded = load_pipeline(gguf_folder(WAN), "fp32", text_encoder_file=path)
    assert loaded.storage["text_encoder"] == "fp16"
    reference = load_pipeline(gguf_folder(WAN), "fp32")
    encoder(reference).load_state_dict(dequantized(stored), strict=False)
    assert_equal(embeddings(loaded), embeddings(reference))


@pytest.mark.reproducible_blas
@pytest.mark.parametrize("variant", [WAN, COG])
def test_a_q8_0_gguf_encodes_as_the_same_weights_quantized_the_same_way(gguf_folder, tmp_path, variant):
    folder = load_pipeline(gguf_folder(variant), "fp32")
    stored = store_tensors(encoder(folder), "gguf_q8_0")
    path = write_llama_cpp_text_encoder(stored, tmp_path / "te-Q8_0.gguf", ARCH[variant])
    loaded = load_pipeline(gguf_folder(variant), "fp32", text_encoder_file=path)
    assert loaded.storage["text_encoder"] == storage_name(stored) == "gguf_q8_0"
    assert any(isinstance(m, StoredLinear) for m in encoder(loaded).modules())
    reference = load_pipeline(gguf_folder(variant), "fp32")
    encoder(reference).load_state_dict(dequantized(stored), strict=False)  # the values the file holds, plain
    for a, b in zip(embeddings(loaded), embeddings(reference), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)  # the same values, upcast per layer or held plain


def test_a_broken_table_entry_fails_the_round_trip(gguf_folder, tmp_path, monkeypatch):
    """A wrong entry (Gemma's two post-norms swapped in the reader only) reads the file into other places."""
    folder = load_pipeline(gguf_folder(LTX2), "fp32")
    path = write(folder, LTX2, "fp32", tmp_path / "gemma-F32.gguf")
    swapped = {"post_attention_norm": "post_feedforward_layernorm", "post_ffw_norm": "post_attention_layernorm"}
    parts = tuple((old, swapped.get(old, new)) for old, new in gguf_names.GEMMA3.parts)
    broken = gguf_names.GgufNames(**{**gguf_names.GEMMA3.__dict__, "parts": parts})
    monkeypatch.setattr(gguf_names, "LAYOUTS", (gguf_names.T5, gguf_names.QWEN2VL, broken))
    loaded = load_pipeline(gguf_folder(LTX2), "fp32", text_encoder_file=path)
    assert any(not torch.equal(a, b) for a, b in zip(embeddings(loaded), embeddings(folder)))


def test_gemmas_norms_are_new_tensors_and_the_file_mapping_is_untouched(gguf_folder, tmp_path):
    from vidmem.memory.storage import open_weights

    folder = load_pipeline(gguf_folder(LTX2), "fp32")
    path = write(folder, LTX2, "fp32", tmp_path / "gemma-F32.gguf")
    opened = open_weights(path)
    before = opened.tensors["blk.0.attn_norm.weight"].clone()
    model_norm = encoder(folder).state_dict()["model.language_model.layers.0.input_layernorm.weight"]
    assert torch.equal(before, model_norm + 1)  # as llama.cpp's converter stores it
    mapped = gguf_names.file_tensors(opened.tensors, opened.metadata, "text_encoder_file")
    assert torch.equal(mapped["model.layers.0.input_layernorm.weight"], model_norm)
    assert torch.equal(opened.tensors["blk.0.attn_norm.weight"], before)
    # renamed, not copied
    assert mapped["model.layers.0.self_attn.q_proj.weight"] is opened.tensors["blk.0.attn_q.weight"]


def test_a_full_encoder_decoder_t5_gguf_is_read_as_its_encoder(gguf_folder, tmp_path):
    """llama.cpp's `t5` files keep the decoder (`dec.*`) and lm_head (`output.weight`): dropped for the encoder."""
    from vidmem.pipelines.comfy_files.write import _write_gguf

    folder = load_pipeline(gguf_folder(WAN), "fp32")
    named = {n: t for n, t in store_tensors(encoder(folder), "fp32").items() if n != "encoder.embed_tokens.weight"}
    tensors = gguf_names.llama_cpp_tensors(gguf_names.T5, named)
    decoder = {name.replace("enc.", "dec.", 1): t for name, t in tensors.items() if name.startswith("enc.")}
    path = tmp_path / "t5-full-F32.gguf"
    _write_gguf({**tensors, **decoder, "output.weight": tensors["token_embd.weight"]}, path, "t5")
    loaded = load_pipeline(gguf_folder(WAN), "fp32", text_encoder_file=path)
    assert_equal(embeddings(loaded), embeddings(folder))


def test_another_llama_cpp_architecture_is_refused_by_name(gguf_folder, tmp_path):
    folder = load_pipeline(gguf_folder(HY15), "fp32")
    path = write(folder, HY15, "fp32", tmp_path / "te.gguf")
    from vidmem.memory.storage import open_weights

    opened = open_weights(path)
    with pytest.raises(ModelError, match=r"architecture 'llama'.*qwen2vl.*gemma3"):
        gguf_names.file_tensors(opened.tensors, {gguf_names.ARCH_KEY: "llama"}, "text_encoder_file: 'te.gguf'")


def test_the_reverse_table_refuses_a_name_it_has_no_entry_for():
    with pytest.raises(ModelError, match="no llama.cpp name"):
        gguf_names.llama_cpp_names(gguf_names.T5, ["encoder.block.0.layer.0.SelfAttention.x.weight"])


# --- Gemma's token table under a GGUF weight_dtype ------------------------------------------------

def small_gemma(empty: bool = False) -> torch.nn.Module:
    """A Gemma 3 wide enough for Q8_0 blocks (32), as LTX-2 loads it (its token table tied to lm_head)."""
    import accelerate
    import transformers

    text = transformers.Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=8)
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=8, patch_size=4)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    if empty:
        with accelerate.init_empty_weights():
            return transformers.Gemma3ForConditionalGeneration(config)
    torch.manual_seed(0)
    return transformers.Gemma3ForConditionalGeneration(config).eval()


def unique_tensors(module: torch.nn.Module):
    return {id(t): t for t in (*module.parameters(), *module.buffers())}.values()


def test_a_gemma_held_at_gguf_q8_0_keeps_its_token_table_as_loaded_and_is_planned_as_held():
    """Gemma's token table is tied to lm_head (a Linear) and scales its rows (its own forward): it cannot stay
    stored, so weight_dtype must not round it (it would be dequantized again at load, a dense copy planned at
    Q8_0 bytes). The Linear weights are lowered; the planner counts exactly what is held."""
    from vidmem.memory.plan.storage import stored_sizes
    from vidmem.memory.storage import storage_format
    from vidmem.pipelines.weight_storage import hold

    source = small_gemma()
    tensors = {name: t.detach().clone() for name, t in source.state_dict().items() if name != "lm_head.weight"}
    module = small_gemma(empty=True)
    report, held_format = hold(module, tensors, torch.float32, "gguf_q8_0", copy_to_ram=False, source="gemma")
    table = module.model.language_model.embed_tokens
    assert type(table).__name__ == "Gemma3TextScaledWordEmbedding"  # not swapped for a plain lookup
    assert table.weight is module.lm_head.weight  # still tied
    assert torch.equal(table.weight, tensors["model.language_model.embed_tokens.weight"])  # exactly as loaded
    assert report.dequantized == () and held_format == "gguf_q8_0"
    assert any(isinstance(m, StoredLinear) for m in module.model.language_model.modules())

    planned_model = small_gemma(empty=True)
    planned_model.tie_weights()  # as the planner builds it (configs.meta.build_meta, comfy_files.build.build_empty)
    sizes = stored_sizes(planned_model, storage_format("gguf_q8_0"))
    planned = sum(sizes.nbytes(id(t), t) for t in unique_tensors(planned_model))
    assert planned == sum(t.numel() * t.element_size() for t in unique_tensors(module))


def test_the_loader_and_the_planner_lower_the_same_weights():
    """One rule (memory.storage.lowered_weights): what weight_storage.lower_storage quantizes is what
    memory.plan.storage.quantizable counts; Gemma's tied, scaled token table is in neither."""
    from vidmem.memory.plan.storage import quantizable
    from vidmem.memory.storage import lowered_weights, storage_format
    from vidmem.pipelines.weight_storage import lower_storage

    source, fmt = small_gemma(), storage_format("gguf_q8_0")
    source.tie_weights()
    names = lowered_weights(source, fmt)
    assert "model.language_model.layers.0.self_attn.q_proj.weight" in names
    assert "model.language_model.embed_tokens.weight" not in names
    state = dict(source.state_dict())
    lowered = lower_storage(source, state, "gguf_q8_0", torch.bfloat16)
    assert {n for n, t in lowered.items() if t is not state[n]} == names
    assert {id(w) for _, w in quantizable(source, fmt)} == {id(source.get_parameter(n)) for n in names}


def same_spiece(found: bytes, expected: bytes) -> bool:
    """Two SentencePiece models with the same pieces (text, score, type), special ids and normalizer switches."""
    from sentencepiece import sentencepiece_model_pb2 as proto

    a, b = proto.ModelProto(), proto.ModelProto()
    a.ParseFromString(found)
    b.ParseFromString(expected)
    pieces = [[(p.piece, p.score, p.type) for p in m.pieces] for m in (a, b)]
    ids = [[getattr(m.trainer_spec, f) for f in ("unk_id", "bos_id", "eos_id", "pad_id", "model_type")] for m in (a, b)]
    switches = [(m.normalizer_spec.add_dummy_prefix, m.normalizer_spec.remove_extra_whitespaces,
                 m.normalizer_spec.precompiled_charsmap) for m in (a, b)]
    return pieces[0] == pieces[1] and ids[0] == ids[1] and switches[0] == switches[1]


def padded_spiece(spiece: bytes, vocab_size: int) -> bytes:
    """`spiece` with its pieces padded to `vocab_size` as llama.cpp's converter pads them."""
    from sentencepiece import sentencepiece_model_pb2 as proto

    model = proto.ModelProto()
    model.ParseFromString(spiece)
    for i in range(1, vocab_size - len(model.pieces) + 1):
        model.pieces.add(piece=f"[PAD{i}]", score=-1000.0, type=proto.ModelProto.SentencePiece.UNUSED)
    return model.SerializeToString()


# --- Load Video Model Files' text_encoder: city96's umt5 GGUF, its tokenizer in the metadata ----------

@pytest.mark.reproducible_blas
def test_load_video_model_files_reads_a_umt5_gguf_with_its_tokenizer_from_the_metadata(tmp_path):
    from dataclasses import replace

    from vidmem.pipelines.comfy_files import LoadOptions, load_model_files, read_weight_file
    from vidmem.pipelines.comfy_files.gguf_tokenizer import tokenizer_metadata
    from vidmem.pipelines.tiny import build_tiny_pipeline, build_tiny_tokenizer
    from vidmem.pipelines.tiny_files import save_tiny_comfy_files, tiny_catalogue, tiny_spiece_model

    out = save_tiny_comfy_files(WAN, tmp_path / "comfy", "fp32", reference=False)
    text = build_tiny_pipeline(WAN).text_encoder  # the weights the safetensors file holds (the same seed)
    vocab_size = text.config.vocab_size  # llama.cpp pads the pieces to it with [PADn] UNUSED pieces
    path = write_llama_cpp_text_encoder(store_tensors(text, "fp32"), tmp_path / "umt5-xxl-encoder-F32.gguf",
                                        "t5encoder", tokenizer_metadata(tiny_spiece_model(), vocab_size))
    options = LoadOptions(dtype="fp32")
    from_gguf = load_model_files(replace(out.files, text_encoder=path), options, tiny_catalogue())
    from_safetensors = load_model_files(out.files, options, tiny_catalogue())
    rebuilt = read_weight_file(path, "text_encoder", "text_encoder").tokenizer_model
    assert same_spiece(rebuilt, padded_spiece(tiny_spiece_model(), vocab_size))
    prompt = "a cat dances with the monkey, 12 times!"
    assert from_gguf.pipe.tokenizer(prompt).input_ids == build_tiny_tokenizer()(prompt).input_ids
    assert_equal(embeddings(from_gguf, prompt), embeddings(from_safetensors, prompt))


@pytest.mark.reproducible_blas
@pytest.mark.parametrize("arch", ["gemma3", "qwen2vl"])
def test_a_q8_0_language_model_gguf_holds_the_same_weights_quantized_the_same_way(tmp_path, arch):
    """The tiny pipelines' Gemma and Qwen are too narrow for Q8_0 blocks: a small Gemma 3 (32 wide) read through
    read_weight_file (Qwen's table: the same Gemma written as qwen2vl, its Gemma-only norms aside, read by names)
    gives every language-model tensor the values of the same weights quantized the same way, and held at
    fp32 computes the same hidden states as the model holding those values plain."""
    from vidmem.pipelines.comfy_files import read_weight_file, text_encoders
    from vidmem.pipelines.weight_storage import hold

    source = small_gemma()
    for name, tensor in exact_norms(source).items():
        if name.endswith("norm.weight"):
            source.get_parameter(name).data.copy_(tensor)
    stored = store_tensors(source, "gguf_q8_0")
    language = text_encoders.GEMMA3.language
    if arch == "qwen2vl":  # Qwen's layout: no q/k norms, no post norms (left out of the file and the check)
        gemma_only = ("q_norm", "k_norm", "post_attention_layernorm", "pre_feedforward_layernorm",
                      "post_feedforward_layernorm")
        written = {n: t for n, t in stored.items() if n.startswith(language) and not any(k in n for k in gemma_only)}
        path = write_llama_cpp_text_encoder({n[len(language):]: t for n, t in written.items()},
                                            tmp_path / "qwen-Q8_0.gguf", arch)
        from vidmem.memory.storage import open_weights

        opened = open_weights(path)
        mapped = gguf_names.file_tensors(opened.tensors, opened.metadata, "text_encoder_file")
        expected = {text_encoders.QWEN25_VL.renames[0][0] + n[len(language):]: t for n, t in written.items()}
        assert set(mapped) == set(expected)
        plain = dequantized(expected)
        assert all(torch.equal(t, plain[n]) for n, t in dequantized(mapped).items())
        return
    path = write_llama_cpp_text_encoder(stored, tmp_path / "gemma-Q8_0.gguf", arch)
    file = read_weight_file(path, "text_encoder_file", "text_encoder")
    assert file.storage == "gguf_q8_0" and file.fields["class"] == "Gemma3ForConditionalGeneration"
    assert set(file.tensors) == {n for n in stored if n.startswith(language)}
    plain = dequantized(stored)
    assert all(torch.equal(t, plain[n]) for n, t in dequantized(file.tensors).items())

    vision = {n: t for n, t in source.state_dict().items() if not n.startswith(language) and n != "lm_head.weight"}
    held = small_gemma(empty=True)
    hold(held, {**file.tensors, **vision}, torch.float32, "default", copy_to_ram=False, source=path.name)
    reference = small_gemma()
    reference.load_state_dict({**plain, "lm_head.weight": plain[language + "embed_tokens.weight"]})
    ids = torch.tensor([[2, 5, 9, 11, 3]])
    with torch.no_grad():
        found = held.model.language_model(ids).last_hidden_state
        wanted = reference.model.language_model(ids).last_hidden_state
    torch.testing.assert_close(found, wanted, rtol=0, atol=1e-5)  # the same values, upcast per layer or held plain


def test_a_t5_tokenizers_normalizer_table_comes_back_from_the_metadata(tmp_path):
    """Real T5 tokenizers carry an NFKC table (precompiled_charsmap), which llama.cpp keeps in the metadata."""
    from sentencepiece import sentencepiece_model_pb2 as proto

    from vidmem.memory.storage import open_weights
    from vidmem.pipelines.comfy_files.gguf_tokenizer import tokenizer_metadata
    from vidmem.pipelines.tiny import build_tiny_pipeline
    from vidmem.pipelines.tiny_files import tiny_spiece_model

    model = proto.ModelProto()
    model.ParseFromString(tiny_spiece_model())
    model.normalizer_spec.precompiled_charsmap = bytes(range(7, 200))
    spiece = model.SerializeToString()
    text = build_tiny_pipeline(WAN).text_encoder
    path = write_llama_cpp_text_encoder(store_tensors(text, "fp32"), tmp_path / "t5.gguf", "t5",
                                        tokenizer_metadata(spiece))
    import gguf

    field = gguf.GGUFReader(str(path)).fields["tokenizer.ggml.precompiled_charsmap"]
    assert field.types == [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT8]  # as llama.cpp's converter writes it
    opened = open_weights(path)
    rebuilt = gguf_names.file_tensors(opened.tensors, opened.metadata, "text_encoder")[gguf_names.TOKENIZER_KEY]
    assert same_spiece(rebuilt.numpy().tobytes(), spiece)


def tokenizer_proto(metadata):
    from sentencepiece import sentencepiece_model_pb2 as proto

    from vidmem.pipelines.comfy_files.gguf_tokenizer import spiece_model

    model = proto.ModelProto()
    model.ParseFromString(spiece_model(metadata, "text_encoder: 't5.gguf'"))
    return model


def test_a_t5_tokenizer_without_a_normalizer_table_is_read_with_a_warning(caplog):
    from vidmem.pipelines.comfy_files.gguf_tokenizer import tokenizer_metadata
    from vidmem.pipelines.tiny_files import tiny_spiece_model

    metadata = tokenizer_metadata(tiny_spiece_model())
    assert "tokenizer.ggml.precompiled_charsmap" not in metadata
    with caplog.at_level("WARNING", logger="vidmem"):
        model = tokenizer_proto(metadata)
    assert model.normalizer_spec.name == "identity"
    assert "'t5.gguf' has no tokenizer.ggml.precompiled_charsmap" in caplog.text


def test_byte_fallback_is_set_by_whether_the_tokenizer_has_byte_pieces():
    from vidmem.pipelines.comfy_files.gguf_tokenizer import BYTE, tokenizer_metadata
    from vidmem.pipelines.tiny_files import tiny_spiece_model

    metadata = tokenizer_metadata(tiny_spiece_model())
    assert not tokenizer_proto(metadata).trainer_spec.byte_fallback
    with_bytes = {**metadata, "tokenizer.ggml.tokens": [*metadata["tokenizer.ggml.tokens"], "<0x00>"],
                  "tokenizer.ggml.scores": [*metadata["tokenizer.ggml.scores"], 0.0],
                  "tokenizer.ggml.token_type": [*metadata["tokenizer.ggml.token_type"], BYTE]}
    assert tokenizer_proto(with_bytes).trainer_spec.byte_fallback


# --- Gemma's token table cut to the tokenizer by llama.cpp's converter ---------------------------------

def test_a_gemma_gguf_with_a_cut_token_table_loads_padded_with_zero_rows(gguf_folder, tmp_path):
    """llama.cpp's gemma3 converter cuts token_embd to the tokenizer's length (fewer rows than the config's
    vocab_size): the file is read, the missing rows are zeros, and ordinary ids embed as the full file's."""
    folder = load_pipeline(gguf_folder(LTX2), "fp32")
    stored = store_tensors(encoder(folder), "fp32")
    table_name = "model.language_model.embed_tokens.weight"
    rows = stored[table_name].shape[0]
    full = write_llama_cpp_text_encoder(stored, tmp_path / "gemma-F32.gguf", "gemma3")
    cut = write_llama_cpp_text_encoder({**stored, table_name: stored[table_name][:rows - 4]},
                                       tmp_path / "gemma-cut-F32.gguf", "gemma3")
    from_full = load_pipeline(gguf_folder(LTX2), "fp32", text_encoder_file=full)
    from_cut = load_pipeline(gguf_folder(LTX2), "fp32", text_encoder_file=cut)
    table = encoder(from_cut).get_input_embeddings().weight
    assert table.shape[0] == rows and torch.count_nonzero(table[rows - 4:]) == 0
    assert torch.equal(table[:rows - 4], encoder(from_full).get_input_embeddings().weight[:rows - 4])
    ids = torch.arange(rows - 4).reshape(1, -1)
    with torch.no_grad():
        found = encoder(from_cut).model.language_model(ids).last_hidden_state
        wanted = encoder(from_full).model.language_model(ids).last_hidden_state
    assert torch.equal(found, wanted)


def test_a_gemma_gguf_with_more_token_rows_than_the_config_is_refused(gguf_folder, tmp_path):
    folder = load_pipeline(gguf_folder(LTX2), "fp32")
    stored = store_tensors(encoder(folder), "fp32")
    table_name = "model.language_model.embed_tokens.weight"
    table = stored[table_name]
    longer = write_llama_cpp_text_encoder({**stored, table_name: torch.cat([table, table[:4]])},
                                          tmp_path / "gemma-long-F32.gguf", "gemma3")
    with pytest.raises(ModelError, match="vocab_size"):
        load_pipeline(gguf_folder(LTX2), "fp32", text_encoder_file=longer)


def test_a_quantized_cut_token_table_is_dequantized_in_chunks_into_the_padded_table(gguf_folder, tmp_path, monkeypatch):
    """The padded table is written once, a row chunk at a time (dequantize_into), with the one-pass values. The
    tiny Gemma's rows (16 wide) take no GGUF block: its table is given as fp8 scaled, through the same path."""
    import json
    from dataclasses import replace

    from vidmem.memory.storage import quantize
    from vidmem.pipelines.comfy_files import detect, text_encoder_file
    from vidmem.pipelines.comfy_files.files import read_weight_file

    folder = load_pipeline(gguf_folder(LTX2), "fp32")
    stored = store_tensors(encoder(folder), "fp32")
    table_name = "model.language_model.embed_tokens.weight"
    rows = stored[table_name].shape[0]
    path = write_llama_cpp_text_encoder({**stored, table_name: stored[table_name][:rows - 4]},
                                        tmp_path / "gemma-cut-F32.gguf", "gemma3")
    file = read_weight_file(path, "text_encoder_file", detect.TEXT_ENCODER)
    table = quantize(file.tensors[table_name].clone(), "fp8_scaled")
    file = replace(file, tensors={**file.tensors, table_name: table})
    into, chunked = [], text_encoder_file.dequantize_into
    monkeypatch.setattr(text_encoder_file, "dequantize_into", lambda t, out: into.append(out.shape) or chunked(t, out))
    config = json.loads((gguf_folder(LTX2) / "text_encoder" / "config.json").read_text())
    padded = text_encoder_file._token_table_padded(file, type(encoder(folder)).__name__, config,
                                                   torch.bfloat16)[table_name]
    assert into == [torch.Size([rows - 4, table.shape[1]])]
    assert padded.dtype == torch.bfloat16 and torch.equal(padded[:rows - 4], table.dequantize(torch.bfloat16))
    assert padded.shape[0] == rows and torch.count_nonzero(padded[rows - 4:]) == 0
