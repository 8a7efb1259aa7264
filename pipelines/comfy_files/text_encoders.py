"""Comfy-Org's language-model text encoder files, read by their tensors: Qwen2.5-VL 7B (HunyuanVideo 1.5)
and Gemma 3 12B (LTX-2).

ComfyUI's own models (comfy/text_encoders/llama.py `Qwen25_7BVLI`, `Gemma3_12B`) name the language model
`model.embed_tokens`, `model.layers.N.*` and `model.norm`, with transformers' own names inside a layer
(`self_attn.q_proj`, `mlp.gate_proj`, `input_layernorm`; Gemma's `q_norm` / `k_norm` and its four norms
too, stored as transformers stores them: ComfyUI's RMSNorm(add=True) computes with 1 + weight, as
transformers' Gemma does). Beside it lies the vision part: Qwen's tower under `visual.`, Gemma's SigLIP
tower under `vision_model.` (ComfyUI's CLIP vision names, which are transformers' SigLIP names) and its
projector under `multi_modal_projector.`; a file may carry `lm_head.weight`, Gemma's the SentencePiece
model (`spiece_model`, which the folder's tokenizer makes unneeded).

The classes diffusers loads name them otherwise: `Qwen2_5_VLTextModel` is the language model alone,
unprefixed; transformers 5's `Gemma3ForConditionalGeneration` nests it under `model.language_model.` and
the vision part under `model.vision_tower.` / `model.multi_modal_projector.`. The renames are prefixes,
written once below as data per class (`LAYOUTS`); `comfy_names` (writing files for tests) is their
reverse, checked against `model_tensors` on every call, so a wrong entry fails there.

Tensors a text model has no place for (Qwen's vision tower and lm_head) are left unread: they stay in
the file's mapping and are never copied.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..family import ModelError
from . import detect
from .keys import count_blocks

# ComfyUI's detection keys (comfy/sd.py detect_te_model): every one of these language models has the
# first; Gemma 2 / 3 the second; Gemma 3 (and Qwen 3) the third; Qwen 2.5 alone q/k/v biases.
MARKER = "model.layers.0.self_attn.q_proj.weight"
GEMMA_MARKER = "model.layers.0.post_feedforward_layernorm.weight"
QK_NORM_MARKER = "model.layers.0.self_attn.q_norm.weight"
QWEN25_MARKER = "model.layers.0.self_attn.k_proj.bias"


@dataclass(frozen=True)
class LanguageModelLayout:
    """How one transformers class names a ComfyUI language-model file's tensors."""

    class_name: str  # the transformers class diffusers loads as the folder's text_encoder
    shown: str  # for messages: "a <shown> text encoder"
    renames: tuple[tuple[str, str], ...]  # (file prefix, model prefix), the first matching file prefix wins
    unread: tuple[str, ...]  # file prefixes the model has no place for: never read
    language: str  # the model prefix of the language model (its fields are read there)
    optional: tuple[str, ...] = ()  # model submodules a file may lack (see text_encoder_file.fit_optional)


QWEN25_VL = LanguageModelLayout("Qwen2_5_VLTextModel", "Qwen2.5-VL 7B (HunyuanVideo 1.5's)", renames=(("model.", ""),),
                                unread=("visual.", "lm_head."), language="")
GEMMA3 = LanguageModelLayout(
    "Gemma3ForConditionalGeneration", "Gemma 3 12B (LTX-2's)",
    renames=(("model.", "model.language_model."), ("multi_modal_projector.", "model.multi_modal_projector."),
             ("vision_model.", "model.vision_tower."), ("lm_head.", "lm_head.")),
    unread=(), language="model.language_model.", optional=("model.vision_tower", "model.multi_modal_projector"))
LAYOUTS = {layout.class_name: layout for layout in (QWEN25_VL, GEMMA3)}
# What a text encoder file of each class is, for messages (the T5 ones are read by detect.text_encoder_fields).
HELD = {"UMT5EncoderModel": "a UMT5-XXL text encoder (Wan's)",
        "T5EncoderModel": "a T5 text encoder (CogVideoX's T5-XXL, or HunyuanVideo 1.5's ByT5 glyph encoder)",
        **{name: f"a {layout.shown} text encoder" for name, layout in LAYOUTS.items()}}


def is_language_model(names: Iterable[str]) -> bool:
    """Whether the names are a ComfyUI language-model text encoder's (any of them, read or not)."""
    return MARKER in set(names)


def layout_of(names: Iterable[str], file_name: str, role: str) -> LanguageModelLayout:
    """The layout of a language-model file (see `is_language_model`); a language model no family uses is refused by name."""
    names = set(names)
    if GEMMA_MARKER in names and QK_NORM_MARKER in names:
        return GEMMA3
    if QWEN25_MARKER in names and QK_NORM_MARKER not in names:
        return QWEN25_VL
    held = "Gemma 2" if GEMMA_MARKER in names else "Qwen 3" if QK_NORM_MARKER in names else "Llama / Mistral"
    raise ModelError(
        f"{role}: '{file_name}' is a {held} language-model text encoder, which no model vidmem runs uses. "
        "HunyuanVideo 1.5 takes Qwen2.5-VL 7B (qwen_2.5_vl_7b_fp8_scaled.safetensors or qwen_2.5_vl_7b.safetensors), "
        "LTX-2 Gemma 3 12B (gemma_3_12B_it*.safetensors), Wan umt5_xxl_*.safetensors."
    )


def model_tensors(layout: LanguageModelLayout, tensors: Mapping[str, Any]) -> dict[str, Any]:
    """The file's tensors under the model's names (renamed, never copied); the unread ones left out.
    A name no rule covers is kept as it is, so the model's own check names it as unexpected."""
    return {_renamed(layout, name): tensor for name, tensor in tensors.items() if not name.startswith(layout.unread)}


def _renamed(layout: LanguageModelLayout, name: str) -> str:
    for old, new in layout.renames:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def comfy_names(layout: LanguageModelLayout, model_names: Iterable[str]) -> dict[str, str]:
    """model name -> the name ComfyUI's file gives it (for writing files), checked against `model_tensors`."""
    by_length = sorted(layout.renames, key=lambda rule: -len(rule[1]))
    mapping = {}
    for name in model_names:
        old, new = next(rule for rule in by_length if name.startswith(rule[1]))
        mapping[name] = old + name[len(new):]
    back = model_tensors(layout, {original: name for name, original in mapping.items()})
    wrong = [name for name, original in back.items() if name != original]
    if wrong or len(back) != len(mapping):
        raise ModelError(f"vidmem's {layout.class_name} name table disagrees with itself for {wrong[:3]}; "
                         "update text_encoders.LAYOUTS.")
    return mapping


def class_of(model_names: Iterable[str]) -> str | None:
    """The language-model class whose names these are (`model_tensors`' output), or None."""
    names = set(model_names)
    return next((layout.class_name for layout in LAYOUTS.values() if layout.language + "embed_tokens.weight" in names
                 and layout.language + "layers.0.self_attn.q_proj.weight" in names), None)


def fields(t: Mapping[str, Any], class_name: str) -> dict[str, Any]:
    """The config fields the tensors (model names) of a language model of `class_name` (`class_of`) fix;
    `config_fields` reads the same from a config."""
    layout = LAYOUTS[class_name]
    layer = layout.language + "layers.0."
    embed = t[layout.language + "embed_tokens.weight"].shape
    found = {
        "class": layout.class_name, "vocab_size": embed[0], "hidden_size": embed[1],
        "num_hidden_layers": count_blocks(t, re.escape(layout.language) + r"layers\.(\d+)\."),
        "intermediate_size": t[layer + "mlp.gate_proj.weight"].shape[0],
        "q_width": t[layer + "self_attn.q_proj.weight"].shape[0], "kv_width": t[layer + "self_attn.k_proj.weight"].shape[0],
    }
    norm = t.get(layer + "self_attn.q_norm.weight")
    if norm is not None:
        found["head_dim"] = norm.shape[0]
    return found


def config_fields(class_name: str, config: Mapping[str, Any]) -> dict[str, Any]:
    """The `fields` of a text encoder config of `class_name` (Gemma 3's under its text_config), keys left out
    at their defaults as the T5 reader takes them (detect.text_config)."""
    text = detect.text_config(class_name, config)
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    wanted = {"class": class_name, **{k: getattr(text, k) for k in ("vocab_size", "hidden_size", "num_hidden_layers",
                                                                     "intermediate_size")},
              "q_width": heads * head_dim, "kv_width": kv_heads * head_dim}
    if class_name == GEMMA3.class_name:
        wanted["head_dim"] = head_dim
    return wanted
