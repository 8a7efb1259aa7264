"""GGUF text encoders in llama.cpp's names, read under the names vidmem's readers take.

The GGUF text encoders users have were converted by llama.cpp's convert_hf_to_gguf.py (or city96's
tools, which use its names): `token_embd`, `[enc.]blk.N.attn_q`, `ffn_gate`, `output_norm`, ... with
the architecture under the metadata key `general.architecture`. Checked against gguf-py's own
tensor map (gguf.get_tensor_name_map) and city96/ComfyUI-GGUF loader.py (T5_SD_MAP, LLAMA_SD_MAP):

- `t5` / `t5encoder` (city96's umt5-xxl-encoder-*.gguf for Wan, t5-v1_1-xxl-encoder-*.gguf) map to
  transformers' T5 names (detect.py reads them); an ungated T5 (v1.0) has `ffn_up` alone, its `wi`.
- `qwen2vl` (Qwen2.5-VL 7B, HunyuanVideo 1.5) and `gemma3` (Gemma 3 12B, LTX-2) map to ComfyUI's
  names, which text_encoders.py maps on. The two differ in one place: llama.cpp's `ffn_norm` is the
  norm before the MLP, Qwen's `post_attention_layernorm` but Gemma's `pre_feedforward_layernorm`
  (Gemma's `post_attention_layernorm` is llama.cpp's `post_attention_norm`).
- The converter stores every Gemma RMSNorm weight as 1 + weight (llama.cpp multiplies by the stored
  weight; transformers and ComfyUI by 1 + weight): undone here into a new small tensor per norm.
  transformers' own GGUF reader (modeling_gguf_pytorch_utils.Gemma2TensorProcessor) does the same.
- The converter permutes q/k rows only for the `llama` architecture (LlamaModel.modify_tensors; city96
  and transformers undo it for `llama` only): neither qwen2vl nor gemma3 is permuted, and `llama` is
  refused below (no model vidmem runs uses it).

The vision towers live in separate mmproj GGUFs, so a GGUF holds the language model alone (Gemma's
vision tower is optional in text_encoders.GEMMA3). A T5 GGUF carries its tokenizer as
`tokenizer.ggml.*` metadata, rebuilt here as the SentencePiece model Comfy-Org's files embed.

Each architecture's table is data (`GgufNames`); `llama_cpp_names` (writing test files) is its
reverse, checked against `file_tensors` on every call, so a wrong entry fails there.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Iterable, Mapping

import torch

from ...memory.storage import StoredTensor
from ..family import ModelError

ARCH_KEY = "general.architecture"
TOKENIZER_KEY = "spiece_model"  # Comfy-Org's text encoder files embed the SentencePiece model here (files.py reads it)
_BLOCK = re.compile(r"(\d+)\.(.+)")


@dataclass(frozen=True)
class GgufNames:
    """How one llama.cpp architecture's tensor names become the names vidmem's readers take."""

    archs: tuple[str, ...]  # `general.architecture` values
    shown: str  # for messages
    block: tuple[str, str]  # (llama.cpp block prefix, file block prefix), the index follows each
    parts: tuple[tuple[str, str], ...]  # a block's tensors: llama.cpp stem -> file stem
    top: tuple[tuple[str, str], ...]  # the tensors outside the blocks, by stem
    norms_plus_one: bool = False  # every `*norm` weight stored as 1 + weight (Gemma)
    unread: tuple[str, ...] = ()  # name prefixes of tensors the encoder has no place for: left out, never read


T5 = GgufNames(
    ("t5", "t5encoder"), "T5 / UMT5", ("enc.blk.", "encoder.block."),
    parts=(("attn_q", "layer.0.SelfAttention.q"), ("attn_k", "layer.0.SelfAttention.k"),
           ("attn_v", "layer.0.SelfAttention.v"), ("attn_o", "layer.0.SelfAttention.o"),
           ("attn_rel_b", "layer.0.SelfAttention.relative_attention_bias"), ("attn_norm", "layer.0.layer_norm"),
           ("ffn_gate", "layer.1.DenseReluDense.wi_0"), ("ffn_up", "layer.1.DenseReluDense.wi_1"),
           ("ffn_down", "layer.1.DenseReluDense.wo"), ("ffn_norm", "layer.1.layer_norm")),
    top=(("token_embd", "shared"), ("enc.output_norm", "encoder.final_layer_norm")),
    # a full encoder-decoder `t5` GGUF also holds the decoder (`dec.blk.N.*`, `dec.output_norm`) and its
    # lm_head (`output`): the text encoder is the encoder alone
    unread=("dec.", "output.weight"))
# T5 v1.0's feed-forward is not gated: its one input matrix is llama.cpp's ffn_up.
T5_UNGATED = replace(T5, parts=tuple((old, "layer.1.DenseReluDense.wi" if old == "ffn_up" else new)
                                     for old, new in T5.parts if old != "ffn_gate"))
_LANGUAGE_PARTS = (("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"), ("attn_v", "self_attn.v_proj"),
                   ("attn_output", "self_attn.o_proj"), ("attn_norm", "input_layernorm"),
                   ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"), ("ffn_down", "mlp.down_proj"))
_LANGUAGE_TOP = (("token_embd", "model.embed_tokens"), ("output_norm", "model.norm"), ("output", "lm_head"))
QWEN2VL = GgufNames(("qwen2vl",), "Qwen2.5-VL", ("blk.", "model.layers."),
                    parts=(*_LANGUAGE_PARTS, ("ffn_norm", "post_attention_layernorm")), top=_LANGUAGE_TOP)
GEMMA3 = GgufNames(("gemma3",), "Gemma 3", ("blk.", "model.layers."),
                   parts=(*_LANGUAGE_PARTS, ("attn_q_norm", "self_attn.q_norm"), ("attn_k_norm", "self_attn.k_norm"),
                          ("post_attention_norm", "post_attention_layernorm"),
                          ("ffn_norm", "pre_feedforward_layernorm"), ("post_ffw_norm", "post_feedforward_layernorm")),
                   top=_LANGUAGE_TOP, norms_plus_one=True)
LAYOUTS = (T5, QWEN2VL, GEMMA3)
READ = ("t5 / t5encoder (city96's umt5-xxl-encoder-*.gguf, t5-v1_1-xxl-encoder-*.gguf), qwen2vl (Qwen2.5-VL 7B) "
        "and gemma3 (Gemma 3 12B)")


def is_llama_cpp(names: Iterable[str]) -> bool:
    """Whether a GGUF's tensor names are llama.cpp's (a token table and numbered `blk.` blocks)."""
    names = set(names)
    return "token_embd.weight" in names and any(n.startswith(("blk.", "enc.blk.")) for n in names)


def layout_of(names: Iterable[str], metadata: Mapping[str, Any], where: str) -> GgufNames:
    """The table for a llama.cpp-named file: T5 by its encoder blocks, the others by `general.architecture`
    (or, when a file lacks it, by the names only its architecture has); another architecture refused by name."""
    names = set(names)
    if "enc.blk.0.attn_q.weight" in names:
        return T5 if "enc.blk.0.ffn_gate.weight" in names else T5_UNGATED
    arch = metadata.get(ARCH_KEY)
    if arch is None:
        by_names = (("gemma3", "blk.0.post_ffw_norm.weight"), ("qwen2vl", "blk.0.attn_q.bias"))
        arch = next((found for found, marker in by_names if marker in names), None)
    found = next((layout for layout in LAYOUTS if arch in layout.archs), None)
    if found is None:
        raise ModelError(
            f"{where} is a llama.cpp GGUF of architecture '{arch or 'unnamed'}', which no model vidmem runs uses as "
            f"its text encoder. vidmem reads llama.cpp-named GGUF text encoders of {READ}; or use Comfy-Org's "
            "safetensors text encoders (umt5_xxl_*, qwen_2.5_vl_7b*, gemma_3_12B_it*)."
        )
    return found


def file_tensors(tensors: Mapping[str, Any], metadata: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A llama.cpp-named GGUF's tensors under the names its reader takes (renamed, never copied; Gemma's
    norms new tensors), a T5's tokenizer rebuilt from the metadata under `spiece_model`, a full T5's decoder
    left out (`GgufNames.unread`). A name no table entry covers is kept as it is, so the model's own check
    names it as unexpected."""
    layout = layout_of(tensors, metadata, where)
    out = {}
    for name, tensor in tensors.items():
        if name.startswith(layout.unread):
            continue
        stem, _, leaf = name.rpartition(".")
        old = _llama_cpp_stem(layout, stem)
        new = _renamed(layout, stem)
        out[f"{new}.{leaf}" if new else name] = _norm_undone(tensor) if _plus_one(layout, old) else tensor
    if layout in (T5, T5_UNGATED) and "tokenizer.ggml.tokens" in metadata:
        from .gguf_tokenizer import spiece_model

        out[TOKENIZER_KEY] = torch.frombuffer(bytearray(spiece_model(metadata, where)), dtype=torch.uint8)
    return out


def _renamed(layout: GgufNames, stem: str) -> str | None:
    top = dict(layout.top)
    if stem in top:
        return top[stem]
    old_prefix, new_prefix = layout.block
    if not stem.startswith(old_prefix):
        return None
    match = _BLOCK.fullmatch(stem[len(old_prefix):])
    part = dict(layout.parts).get(match.group(2)) if match else None
    return None if part is None else f"{new_prefix}{match.group(1)}.{part}"


def _llama_cpp_stem(layout: GgufNames, stem: str) -> str:
    """The table's key of a llama.cpp stem: the part name inside a block, else the stem."""
    match = _BLOCK.fullmatch(stem[len(layout.block[0]):]) if stem.startswith(layout.block[0]) else None
    return match.group(2) if match else stem


def _plus_one(layout: GgufNames, old: str) -> bool:
    return layout.norms_plus_one and old.endswith("norm")


def _norm_undone(tensor) -> torch.Tensor:
    """weight = stored - 1, computed in float32 (norms are stored F32 by the converter) and kept there."""
    wide = tensor.dequantize(torch.float32) if isinstance(tensor, StoredTensor) else tensor.to(torch.float32)
    return wide - 1


# --- the reverse, for writing test files ----------------------------------------------------------

def llama_cpp_names(layout: GgufNames, file_names: Iterable[str]) -> dict[str, str]:
    """file name -> llama.cpp's name (for writing files), checked against `file_tensors`' renaming."""
    top = {new: old for old, new in layout.top}
    parts = {new: old for old, new in layout.parts}
    old_prefix, new_prefix = layout.block
    mapping = {}
    for name in file_names:
        stem, leaf = name.rsplit(".", 1)
        if stem in top:
            mapping[name] = f"{top[stem]}.{leaf}"
            continue
        index, _, part = stem[len(new_prefix):].partition(".")
        if not stem.startswith(new_prefix) or part not in parts:
            raise ModelError(f"'{name}' has no llama.cpp name in vidmem's {layout.shown} table; update its table in "
                             "gguf_names.py.")
        mapping[name] = f"{old_prefix}{index}.{parts[part]}.{leaf}"
    wrong = [name for name, old in mapping.items() if _renamed(layout, old.rsplit(".", 1)[0]) != name.rsplit(".", 1)[0]]
    if wrong:
        raise ModelError(f"vidmem's {layout.shown} llama.cpp name table disagrees with itself for {wrong[:3]}; "
                         "update its table in gguf_names.py.")
    return mapping


def llama_cpp_tensors(layout: GgufNames, tensors: Mapping[str, Any]) -> dict[str, Any]:
    """`tensors` (file names) as llama.cpp's converter writes them: renamed, Gemma's norms stored as 1 + weight."""
    names = llama_cpp_names(layout, tensors)
    out = {}
    for name, tensor in tensors.items():
        old = names[name]
        plus_one = _plus_one(layout, _llama_cpp_stem(layout, old.rsplit(".", 1)[0]))
        out[old] = tensor.to(torch.float32) + 1 if plus_one else tensor
    return out
