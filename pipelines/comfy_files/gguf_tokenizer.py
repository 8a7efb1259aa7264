"""A T5 GGUF's tokenizer (llama.cpp's `tokenizer.ggml.*` metadata) as the SentencePiece model
Comfy-Org's files embed under `spiece_model`, so Load Video Model Files builds Wan's umt5 tokenizer
from a GGUF as from their safetensors. The fields are those llama.cpp's converter writes from the
model's spiece.model (a Unigram model: pieces with scores and types, its normalizer switches and the
special ids); city96's loader rebuilds the same proto.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..family import ModelError

UNIGRAM = 1  # sentencepiece TrainerSpec.ModelType


def spiece_model(metadata: Mapping[str, Any], where: str) -> bytes:
    """The serialized SentencePiece model of a T5 GGUF's tokenizer metadata."""
    try:
        from sentencepiece import sentencepiece_model_pb2 as proto
    except ImportError:
        raise ModelError(f"{where} carries its tokenizer as GGUF metadata; reading it needs the sentencepiece and "
                         "protobuf packages: pip install sentencepiece protobuf.") from None
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "t5":
        raise ModelError(f"{where} has a '{kind}' tokenizer; a T5 / UMT5 GGUF has llama.cpp's 't5' (SentencePiece "
                         "Unigram) tokenizer. Use city96's umt5-xxl-encoder-*.gguf or Comfy-Org's umt5_xxl_*.safetensors.")
    tokens, scores = metadata["tokenizer.ggml.tokens"], metadata.get("tokenizer.ggml.scores")
    types = metadata.get("tokenizer.ggml.token_type")
    model = proto.ModelProto()
    for index, token in enumerate(tokens):
        model.pieces.add(piece=token, score=float(scores[index]) if scores is not None else 0.0,
                         type=int(types[index]) if types is not None else 1)
    spec = model.trainer_spec
    spec.model_type, spec.vocab_size = UNIGRAM, len(tokens)
    for field, key in (("unk_id", "unknown"), ("bos_id", "bos"), ("eos_id", "eos"), ("pad_id", "padding")):
        value = metadata.get(f"tokenizer.ggml.{key}_token_id")
        setattr(spec, field, -1 if value is None else int(value))
    normalizer = model.normalizer_spec
    normalizer.add_dummy_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    normalizer.remove_extra_whitespaces = bool(metadata.get("tokenizer.ggml.remove_extra_whitespaces", True))
    charsmap = metadata.get("tokenizer.ggml.precompiled_charsmap")
    if charsmap:  # T5's NFKC table; without one the text is taken as it is
        normalizer.name, normalizer.precompiled_charsmap = "nmt_nfkc", bytes(charsmap)
    else:
        normalizer.name = "identity"
    return model.SerializeToString()


def tokenizer_metadata(spiece: bytes) -> dict[str, Any]:
    """The `tokenizer.ggml.*` fields llama.cpp's converter writes from a T5 SentencePiece model (for
    writing test files); `spiece_model` reads them back."""
    from sentencepiece import sentencepiece_model_pb2 as proto

    model = proto.ModelProto()
    model.ParseFromString(spiece)
    spec, normalizer = model.trainer_spec, model.normalizer_spec
    fields = {"tokenizer.ggml.model": "t5", "tokenizer.ggml.tokens": [p.piece for p in model.pieces],
              "tokenizer.ggml.scores": [float(p.score) for p in model.pieces],
              "tokenizer.ggml.token_type": [int(p.type) for p in model.pieces],
              "tokenizer.ggml.add_space_prefix": normalizer.add_dummy_prefix,
              "tokenizer.ggml.remove_extra_whitespaces": normalizer.remove_extra_whitespaces}
    if normalizer.precompiled_charsmap:
        fields["tokenizer.ggml.precompiled_charsmap"] = list(normalizer.precompiled_charsmap)
    for field, key in (("unk_id", "unknown"), ("bos_id", "bos"), ("eos_id", "eos"), ("pad_id", "padding")):
        if getattr(spec, field) >= 0:  # llama.cpp writes only the ids a model has
            fields[f"tokenizer.ggml.{key}_token_id"] = getattr(spec, field)
    return fields
