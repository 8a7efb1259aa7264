"""A T5 GGUF's tokenizer (llama.cpp's `tokenizer.ggml.*` metadata) as the SentencePiece model
Comfy-Org's files embed under `spiece_model`, so Load Video Model Files builds Wan's umt5 tokenizer
from a GGUF as from their safetensors. The fields are those llama.cpp's converter writes from the
model's spiece.model (a Unigram model: pieces with scores and types, its normalizer switches, the NFKC
table `precompiled_charsmap` as a UINT8 array, and the special ids).

What vidmem uses of the rebuilt proto: transformers 5's T5Tokenizer keeps its pieces, their scores and
the charsmap only (the special ids and switches are written for a faithful proto, not read there).
city96's ComfyUI-GGUF rebuilds another proto (byte_fallback on, no charsmap, no unk / bos ids): its
tokenizer is not this one. byte_fallback is set here when the piece list has BYTE pieces, as
SentencePiece trains it.

Unverified (no real file was available offline): llama.cpp's converter pads the piece list to the
model's vocab_size with `[PADn]` UNUSED pieces scored -1000. They are kept here as pieces, so every id
stays the file's; transformers drops the types, so there they are ordinary pieces that only the literal
text "[PADn]" could match, and transformers' `<extra_id_N>` ids come after them.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

from ..family import ModelError

UNIGRAM = 1  # sentencepiece TrainerSpec.ModelType
UNUSED, BYTE = 5, 6  # sentencepiece ModelProto.SentencePiece.Type
log = logging.getLogger("vidmem")


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
    for key, values in (("tokenizer.ggml.scores", scores), ("tokenizer.ggml.token_type", types)):
        if values is not None and len(values) < len(tokens):
            raise ModelError(f"{where} has a damaged tokenizer: {key} lists {len(values)} entries for its {len(tokens)} "
                             "tokens (tokenizer.ggml.tokens); download the file again.")
    model = proto.ModelProto()
    for index, token in enumerate(tokens):
        model.pieces.add(piece=token, score=float(scores[index]) if scores is not None else 0.0,
                         type=int(types[index]) if types is not None else 1)
    spec = model.trainer_spec
    spec.model_type, spec.vocab_size = UNIGRAM, len(tokens)
    spec.byte_fallback = any(piece.type == BYTE for piece in model.pieces)
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
        log.warning("vidmem: %s has no tokenizer.ggml.precompiled_charsmap (T5's NFKC table): its text is tokenized "
                    "unnormalized, so ids can differ from the model's own tokenizer for text NFKC would change "
                    "(full-width letters, ligatures, some punctuation).", where)
    return model.SerializeToString()


def tokenizer_metadata(spiece: bytes, vocab_size: int = 0) -> dict[str, Any]:
    """The `tokenizer.ggml.*` fields llama.cpp's converter writes from a T5 SentencePiece model (for
    writing test files), its pieces padded to `vocab_size` with `[PADn]` UNUSED pieces scored -1000 as
    the converter pads them; `spiece_model` reads them back."""
    from sentencepiece import sentencepiece_model_pb2 as proto

    model = proto.ModelProto()
    model.ParseFromString(spiece)
    spec, normalizer = model.trainer_spec, model.normalizer_spec
    fields = {"tokenizer.ggml.model": "t5", "tokenizer.ggml.tokens": [p.piece for p in model.pieces],
              "tokenizer.ggml.scores": [float(p.score) for p in model.pieces],
              "tokenizer.ggml.token_type": [int(p.type) for p in model.pieces],
              "tokenizer.ggml.add_space_prefix": normalizer.add_dummy_prefix,
              "tokenizer.ggml.remove_extra_whitespaces": normalizer.remove_extra_whitespaces}
    padding = range(1, vocab_size - len(model.pieces) + 1)
    fields["tokenizer.ggml.tokens"] += [f"[PAD{i}]" for i in padding]
    fields["tokenizer.ggml.scores"] += [-1000.0 for _ in padding]
    fields["tokenizer.ggml.token_type"] += [UNUSED for _ in padding]
    if normalizer.precompiled_charsmap:
        fields["tokenizer.ggml.precompiled_charsmap"] = bytes(normalizer.precompiled_charsmap)  # a UINT8 array
    for field, key in (("unk_id", "unknown"), ("bos_id", "bos"), ("eos_id", "eos"), ("pad_id", "padding")):
        if getattr(spec, field) >= 0:  # llama.cpp writes only the ids a model has
            fields[f"tokenizer.ggml.{key}_token_id"] = getattr(spec, field)
    return fields
