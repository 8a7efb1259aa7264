"""What a weight file holds, read from its tensors' names and shapes (never its file name).

Each reader turns a file's tensors (already under diffusers' / transformers' names) into the
config fields its shapes fix, so they can be compared with a model config field by field. Fields
the shapes cannot fix (a transformer's head count, a VAE's latent statistics) come from the
matched config.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from math import prod
from typing import Any

from ...memory.storage import StorageError, StoredTensor, storage_format
from ...memory.storage.stored import stored_format_of
from ..family import ModelError
from .keys import count_blocks

TRANSFORMER, VAE, TEXT_ENCODER, CLIP_VISION = "transformer", "vae", "text_encoder", "clip_vision"
KIND_NAMES = {TRANSFORMER: "a Wan transformer", VAE: "a Wan VAE", TEXT_ENCODER: "a T5 / UMT5 text encoder",
              CLIP_VISION: "a CLIP vision encoder"}

# A name each kind always has, as stored in files (original Wan VAE names and diffusers' both).
TEXT_MARKER = "encoder.block.0.layer.0.SelfAttention.q.weight"
CLIP_MARKER = "encoder.layers.0.self_attn.q_proj.weight"  # after an optional "vision_model." (HF v4 names)
CLIP_PARTS = ("embeddings.", "pre_layrnorm.", "encoder.", "post_layernorm.")  # CLIPVisionModel without its projection head
VAE_MARKERS = ("decoder.middle.0.residual.0.gamma", "decoder.mid_block.resnets.0.norm1.gamma")
# diffusers' AutoencoderKLCogVideoX: its decoder's spatial norms (SpatialNorm3D) are CogVideoX's alone.
COGVIDEOX_VAE_MARKER = "decoder.mid_block.resnets.0.norm1.conv_y.conv.weight"


def storage_name(tensors: Mapping[str, Any]) -> str:
    """The storage format of the file's weight matrices: its most common quantized format when
    any is quantized (the matrices kept wide are exceptions, as in city96's GGUF files), else the
    most common plain dtype (biases and norms aside)."""
    counts = Counter(_format_of(name, t) for name, t in tensors.items() if name.endswith(".weight") and len(t.shape) >= 2)
    quantized = Counter({name: n for name, n in counts.items() if storage_format(name).quantized})
    ranked = (quantized or counts).most_common(1)
    return ranked[0][0] if ranked else "fp32"


def _format_of(name: str, tensor) -> str:
    """The tensor's StorageFormat name; StorageError naming it when it is none."""
    if isinstance(tensor, StoredTensor):
        return tensor.format.name
    if not tensor.is_floating_point():  # int8 without a scale, GGUF's I8: stored_format_of would name only the dtype
        raise StorageError(f"the weight matrix '{name}' is stored as {tensor.dtype} with no scale, an integer quantization "
                           "vidmem does not read; use an fp8 (scaled), bf16/fp16 or GGUF file of the model.")
    return stored_format_of(tensor.dtype).name


def find_prefix(names, marker: str) -> str | None:
    """The prefix before `marker` in `names` ('' when unprefixed), or None when it is absent."""
    hits = [name[: -len(marker)] for name in names if name.endswith(marker)]
    return min(hits, key=len) if hits else None


def transformer_fields(t: Mapping[str, Any]) -> dict[str, Any]:
    """WanTransformer3DModel config fields fixed by the tensors (diffusers names)."""
    patch = t["patch_embedding.weight"].shape
    image = t.get("condition_embedder.image_embedder.ff.net.0.proj.weight")
    added = t.get("blocks.0.attn2.add_k_proj.weight")
    pos = t.get("condition_embedder.image_embedder.pos_embed")
    return {
        "inner_dim": patch[0], "in_channels": patch[1], "patch_size": list(patch[2:]),
        "out_channels": t["proj_out.weight"].shape[0] // prod(patch[2:]),
        "ffn_dim": t["blocks.0.ffn.net.0.proj.weight"].shape[0],
        "num_layers": count_blocks(t, r"blocks\.(\d+)\."),
        "text_dim": t["condition_embedder.text_embedder.linear_1.weight"].shape[1],
        "freq_dim": t["condition_embedder.time_embedder.linear_1.weight"].shape[1],
        "image_dim": None if image is None else image.shape[1],
        "added_kv_proj_dim": None if added is None else added.shape[1],
        "pos_embed_seq_len": None if pos is None else pos.shape[1],
    }


def transformer_config_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """The same fields from a WanTransformer3DModel config (its constructor defaults filled in),
    or from an LTX-2 or HunyuanVideo 1.5 transformer's config (the fields `ltx2.transformer_fields` /
    `hy15.transformer_fields` read from their files)."""
    from . import hy15, ltx2

    if ltx2.is_transformer_config(config):
        return ltx2.transformer_config_fields(config)
    if hy15.is_transformer_config(config):
        return hy15.transformer_config_fields(config)
    return {
        "inner_dim": config["num_attention_heads"] * config["attention_head_dim"],
        "in_channels": config["in_channels"], "patch_size": list(config["patch_size"]),
        "out_channels": config.get("out_channels") or config["in_channels"], "ffn_dim": config["ffn_dim"],
        "num_layers": config["num_layers"], "text_dim": config["text_dim"], "freq_dim": config.get("freq_dim", 256),
        "image_dim": config.get("image_dim"), "added_kv_proj_dim": config.get("added_kv_proj_dim"),
        "pos_embed_seq_len": config.get("pos_embed_seq_len"),
    }


def transformer_family(fields: Mapping[str, Any]) -> str:
    """The model family whose transformer has these fields (this module's or ltx2's / hy15's readers)."""
    if "audio_inner_dim" in fields:
        return "LTX-2"
    return "HunyuanVideo 1.5" if "text_embed_2_dim" in fields else "Wan"


def a_family_transformer(fields: Mapping[str, Any]) -> str:
    """'a Wan transformer', 'an LTX-2 transformer', ...: for messages."""
    family = transformer_family(fields)
    return f"{'an' if family.startswith('LTX') else 'a'} {family} transformer"


def vae_fields(t: Mapping[str, Any], original: bool) -> dict[str, Any]:
    """AutoencoderKLWan fields fixed by the tensors: 2.1 has z_dim 16, 2.2 (residual stages) 48."""
    if original:
        encoder_in, decoder_in, nested = "encoder.conv1.weight", "decoder.conv1.weight", "encoder.downsamples.0.downsamples."
    else:
        encoder_in, decoder_in, nested = "encoder.conv_in.weight", "decoder.conv_in.weight", "encoder.down_blocks.0.resnets."
    return {
        "z_dim": t[decoder_in].shape[1],
        "base_dim": t[encoder_in].shape[0],
        "in_channels": t[encoder_in].shape[1],
        "is_residual": any(name.startswith(nested) for name in t),
    }


def vae_config_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    return {"z_dim": config.get("z_dim", 16), "base_dim": config.get("base_dim", 96),
            "in_channels": config.get("in_channels", 3), "is_residual": bool(config.get("is_residual", False))}


def text_encoder_fields(t: Mapping[str, Any]) -> dict[str, Any]:
    """T5 / UMT5 encoder fields (transformers names). UMT5 has a position bias in every layer."""
    block = "encoder.block.{}.layer.0.SelfAttention."
    layers = count_blocks(t, r"encoder\.block\.(\d+)\.")
    bias = t[block.format(0) + "relative_attention_bias.weight"]
    embed = _either(t, "shared.weight", "encoder.embed_tokens.weight")
    wi = _either(t, "encoder.block.0.layer.1.DenseReluDense.wi_0.weight", "encoder.block.0.layer.1.DenseReluDense.wi.weight")
    umt5 = layers < 2 or block.format(1) + "relative_attention_bias.weight" in t
    return {
        "class": "UMT5EncoderModel" if umt5 else "T5EncoderModel",
        "vocab_size": embed.shape[0], "d_model": embed.shape[1], "num_layers": layers,
        "num_heads": bias.shape[1], "d_kv": t[block.format(0) + "q.weight"].shape[0] // bias.shape[1],
        "d_ff": wi.shape[0], "relative_attention_num_buckets": bias.shape[0],
    }


def _either(t: Mapping[str, Any], name: str, other: str):
    """The tensor under `name` or `other`; KeyError naming the first (a missing tensor, as `t[name]` gives)."""
    found = t.get(name, t.get(other))
    if found is None:
        raise KeyError(name)
    return found


def text_config(class_name: str, config: Mapping[str, Any]):
    """The text part of a transformers text encoder's config (Gemma 3's text_config; the config itself for
    the others), every key the file leaves out at the config class's default: the model is built the same
    way (build.build_empty), and configs saved by transformers or their authors omit the defaults."""
    import transformers
    from huggingface_hub.errors import StrictDataclassError  # transformers 5 validates config fields with it

    try:
        return getattr(transformers, class_name).config_class(**config).get_text_config()
    except (TypeError, ValueError, StrictDataclassError) as error:  # a key of the wrong type or value
        raise ModelError(f"the {class_name} config.json does not configure its class ({error}); re-download the "
                         "model's configs.") from None


def text_encoder_config_fields(class_name: str, config: Mapping[str, Any]) -> dict[str, Any]:
    """The fields `text_encoder_fields` reads, from a T5 / UMT5 config (see `text_config`)."""
    text = text_config(class_name, config)
    fields = ("vocab_size", "d_model", "num_layers", "num_heads", "d_kv", "d_ff", "relative_attention_num_buckets")
    return {"class": class_name, **{k: getattr(text, k) for k in fields}}


def clip_vision_fields(t: Mapping[str, Any]) -> dict[str, Any]:
    patch = t["embeddings.patch_embedding.weight"].shape
    positions = t["embeddings.position_embedding.weight"].shape[0]
    return {
        "hidden_size": patch[0], "patch_size": patch[-1],
        "image_size": round((positions - 1) ** 0.5) * patch[-1],
        "intermediate_size": t["encoder.layers.0.mlp.fc1.weight"].shape[0],
        "num_hidden_layers": count_blocks(t, r"encoder\.layers\.(\d+)\."),
    }


def clip_vision_config_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    return {k: config[k] for k in ("hidden_size", "patch_size", "image_size", "intermediate_size", "num_hidden_layers")}


def differences(found: Mapping[str, Any], wanted: Mapping[str, Any]) -> list[str]:
    """'field: file X, model Y' for every field the file and the config disagree on."""
    return [f"{key} {found.get(key)} (the model has {value})" for key, value in wanted.items() if found.get(key) != value]
