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
    model.normalizer_spec.add_dummy_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    model.normalizer_spec.remove_extra_whitespaces = bool(metadata.get("tokenizer.ggml.remove_extra_whitespaces", True))
    return model.SerializeToString()
