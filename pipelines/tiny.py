"""Tiny random CogVideoX and Wan pipelines, built in code with no files and no hub.

Why: tests and examples need real diffusers pipelines (real classes, real ``model_index.json``,
real safetensors folders) that build in a second and run in well under a second on a CPU, with no
download. The model configs are diffusers' own fast-test configs (``tests/pipelines/cogvideo`` and
``tests/pipelines/wan``). Departures, each to look more like the real checkpoints: a tokenizer built
from an in-code vocabulary (not ``hf-internal-testing/tiny-random-t5``) with an encoder sized to it,
UMT5 for Wan, CLIPVisionModel for Wan 2.1 I2V, the real CogVideoX schedulers, CogVideoX's default
226 text tokens, and CogVideoX sample sizes matched to the default run shape.

Each variant is *declared* once in ``TINY_SPECS``; the builders never branch on names.

Example::

    pipe = build_tiny_pipeline("wan2.1-t2v")
    latents = pipe(**tiny_call_kwargs("wan2.1-t2v")).frames
"""

from __future__ import annotations

import json
import string
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType, SimpleNamespace
from typing import Any, Mapping

import diffusers
import torch
import transformers
from PIL import Image

# --- configs (facts copied from diffusers' fast tests) -------------------------------------------

# tiny-random-t5's sizes, with fewer layers: d_model must equal the transformers' text dim (32).
_TEXT_ENCODER = dict(d_model=32, d_kv=8, d_ff=37, num_heads=4, num_layers=2, relative_attention_num_buckets=8)

_COG_VAE = dict(
    in_channels=3, out_channels=3, block_out_channels=(8, 8, 8, 8), latent_channels=4,
    down_block_types=("CogVideoXDownBlock3D",) * 4, up_block_types=("CogVideoXUpBlock3D",) * 4,
    layers_per_block=1, norm_num_groups=2, temporal_compression_ratio=4,
)
# sample_* are latent sizes of the default run (32 px / 8, 9 frames); I2V's learned positional
# embeddings only accept exactly this size. 226 is CogVideoX's default max_sequence_length.
_COG_DIT = dict(
    time_embed_dim=2, text_embed_dim=32, num_layers=1, sample_width=4, sample_height=4,
    sample_frames=9, patch_size=2, temporal_compression_ratio=4, max_text_seq_length=226,
)
# The real CogVideoX-2b scheduler settings (5b-I2V: snr_shift_scale=1.0, DPM), so both scheduler
# branches of the CogVideoX denoising loop are exercised.
_COG_SCHEDULER = dict(
    clip_sample=False, prediction_type="v_prediction", rescale_betas_zero_snr=True, timestep_spacing="trailing",
)

_WAN_VAE_21 = dict(
    base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
)
_WAN_VAE_22 = dict(
    _WAN_VAE_21, z_dim=48, in_channels=12, out_channels=12, is_residual=True, patch_size=2,
    latents_mean=[0.0] * 48, latents_std=[1.0] * 48, scale_factor_spatial=16, scale_factor_temporal=4,
)
_WAN_DIT = dict(
    patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16, out_channels=16,
    text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
)
# Wan 2.1 I2V's and FLF2V's cross-attention attends to the CLIP image tokens through projections of their own
# (add_k_proj, add_v_proj, norm_added_k: ComfyUI's k_img, v_img, norm_k_img), as wide as the attention: the real
# 14B's config has added_kv_proj_dim 5120 = 40 x 128. Without it the image tokens would pass for more text.
_WAN_INNER = _WAN_DIT["num_attention_heads"] * _WAN_DIT["attention_head_dim"]
_WAN_SCHEDULER = dict(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
_CLIP_VISION = dict(
    hidden_size=4, projection_dim=4, num_hidden_layers=2, num_attention_heads=2, image_size=32,
    intermediate_size=16, patch_size=1,
)

# HunyuanVideo 1.5: diffusers' fast-test sizes (tests/pipelines/hunyuan_video1_5), with the real
# VAE geometry (16x spatial, 4x temporal: five blocks) so the frame rule and size grid are the real
# ones, and two transformer blocks so block swap has a first and a last block.
_HY15_LATENT = 4
_HY15_DIT = dict(
    in_channels=2 * _HY15_LATENT + 1, out_channels=_HY15_LATENT, num_attention_heads=2, attention_head_dim=8,
    num_layers=2, num_refiner_layers=1, mlp_ratio=2.0, patch_size=1, patch_size_t=1, text_embed_dim=16,
    text_embed_2_dim=32, image_embed_dim=12, rope_axes_dim=(2, 2, 4), target_size=64, task_type="t2v",
)
_HY15_VAE = dict(
    latent_channels=_HY15_LATENT, block_out_channels=(8, 8, 8, 8, 8), layers_per_block=1,
    spatial_compression_ratio=16, temporal_compression_ratio=4,
)
_HY15_QWEN = dict(
    hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
    rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"}, rope_theta=1000000.0,
)
_HY15_BYT5 = dict(_TEXT_ENCODER, d_model=32)  # text_embed_2_dim
# hidden_size is the transformer's image_embed_dim; 32 px in patches of 8: 16 image tokens.
_HY15_SIGLIP = dict(hidden_size=12, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2, image_size=32,
                    patch_size=8)
# The chat template Qwen2.5-VL ships, reduced to what HunyuanVideo15Pipeline uses (system + user +
# generation prompt).
_QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# LTX-2: diffusers' fast-test sizes (tests/pipelines/ltx2/testing_utils.py), with the real VAE
# geometry (32x spatial, 8x temporal: four scaling blocks over 4 px patches, and the ratios stated
# as the real config states them, because the class derives 64x / 16x from the same blocks) and a
# Gemma 3 built in code (the fast tests download hf-internal-testing/tiny-gemma3).
_LTX2_TEXT = 16  # Gemma's hidden size = the connectors' width = the transformer's caption_channels
_LTX2_GEMMA_LAYERS = 2
_LTX2_DIT = dict(
    in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
    audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=2, audio_attention_head_dim=4,
    audio_cross_attention_dim=8, num_layers=2, caption_channels=_LTX2_TEXT, rope_double_precision=False,
    rope_type="split",
)
_LTX2_VAE = dict(
    in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16, 32, 64),
    decoder_block_out_channels=(8, 16, 32), layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1),
    spatial_compression_ratio=32, temporal_compression_ratio=8, decoder_causal=False,  # as LTX-2.0's VAE
    scaling_factor=0.75,  # the real one's is 1.0; another value shows where it is (not) applied
)
_LTX2_CONNECTORS = dict(
    caption_channels=_LTX2_TEXT, text_proj_in_factor=_LTX2_GEMMA_LAYERS + 1, video_connector_num_attention_heads=2,
    video_connector_attention_head_dim=8, video_connector_num_layers=1, video_connector_num_learnable_registers=None,
    audio_connector_num_attention_heads=2, audio_connector_attention_head_dim=8, audio_connector_num_layers=1,
    audio_connector_num_learnable_registers=None, connector_rope_base_seq_len=32, rope_double_precision=False,
    rope_type="split",
)
# 8 mel bins / 4 x 2 latent channels = the transformer's 4 audio input channels.
_LTX2_AUDIO_VAE = dict(
    base_channels=4, output_channels=2, ch_mult=(1,), num_res_blocks=1, attn_resolutions=None, in_channels=2,
    resolution=32, latent_channels=2, norm_type="pixel", causality_axis="height", dropout=0.0,
    mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160, is_causal=True, mel_bins=8,
)
_LTX2_VOCODER = dict(
    in_channels=2 * 8, hidden_channels=32, out_channels=2, upsample_kernel_sizes=[4, 4], upsample_factors=[2, 2],
    resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]], leaky_relu_negative_slope=0.1, output_sampling_rate=16000,
)

# What LTX2Call sets by default, for plain diffusers (pipelines/ltx2.py); the tiny connectors are LTX-2.0's.
# The real LTX-2's scheduler settings (the shipped model config): its FlowMatchEuler shifts by the
# resolution (use_dynamic_shifting, mu from the token count), so the tiny one refuses `shift` as the
# real one does and samples the same kind of schedule.
_LTX2_SCHEDULER = json.loads((Path(__file__).parent / "configs" / "models" / "ltx2-t2v-19b.json")
                             .read_text(encoding="utf-8"))["scheduler"]["config"]
_LTX2_CALL = dict(stg_scale=0.0, audio_stg_scale=0.0, spatio_temporal_guidance_blocks=None, modality_scale=1.0,
                  audio_modality_scale=1.0, audio_guidance_scale=None, use_cross_timestep=False)


@dataclass(frozen=True)
class TinySpec:
    """One tiny variant: which diffusers classes to build, their configs, and a run shape it accepts."""

    pipeline: str
    transformer: str
    transformer_config: Mapping[str, Any]
    vae: str
    vae_config: Mapping[str, Any]
    scheduler: str
    scheduler_config: Mapping[str, Any]
    text_encoder: str
    width: int = 32
    height: int = 32
    frames: int = 9
    needs_image: bool = False
    last_image: bool = False  # first-last-frame: the call takes a last image too
    two_experts: bool = False
    image_encoder: bool = False
    pipeline_config: Mapping[str, Any] = field(default_factory=dict)
    text_stack: str = "t5"  # which prompt components the pipeline takes: a key of _TEXT_STACKS
    guider: bool = False  # cfg lives in a `guider` component (its config), not in a guidance_scale argument
    siglip: bool = False  # a SigLIP image encoder and its `feature_extractor` (HunyuanVideo 1.5 I2V)
    audio: bool = False  # an audio VAE and a vocoder (LTX-2)
    # call arguments plain diffusers needs to run as vidmem's call adapter does (LTX-2's guidance passes)
    call_config: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        """Freeze the config mappings too, so no caller can change a variant for everyone."""
        for name in ("transformer_config", "vae_config", "scheduler_config", "pipeline_config", "call_config"):
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))


_COG = dict(transformer="CogVideoXTransformer3DModel", vae="AutoencoderKLCogVideoX", vae_config=_COG_VAE,
            text_encoder="T5EncoderModel")
_WAN = dict(transformer="WanTransformer3DModel", vae="AutoencoderKLWan", vae_config=_WAN_VAE_21,
            scheduler="UniPCMultistepScheduler", scheduler_config=_WAN_SCHEDULER, text_encoder="UMT5EncoderModel")

TINY_SPECS: dict[str, TinySpec] = {
    "cogvideox-t2v": TinySpec(
        **_COG, pipeline="CogVideoXPipeline", scheduler="CogVideoXDDIMScheduler", scheduler_config=_COG_SCHEDULER,
        transformer_config=dict(_COG_DIT, num_attention_heads=4, attention_head_dim=8, in_channels=4, out_channels=4),
    ),
    # CogVideoX 1.5: temporal patches of 2, so 9 frames (3 latent frames) get one padding frame.
    "cogvideox1.5-t2v": TinySpec(
        **_COG, pipeline="CogVideoXPipeline", scheduler="CogVideoXDPMScheduler", scheduler_config=_COG_SCHEDULER,
        transformer_config=dict(_COG_DIT, num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
                                use_rotary_positional_embeddings=True, patch_bias=False, patch_size_t=2),
    ),
    "cogvideox-i2v": TinySpec(
        **_COG, pipeline="CogVideoXImageToVideoPipeline", scheduler="CogVideoXDPMScheduler",
        scheduler_config=dict(_COG_SCHEDULER, snr_shift_scale=1.0), needs_image=True,
        transformer_config=dict(_COG_DIT, num_attention_heads=2, attention_head_dim=16, in_channels=8,
                                out_channels=4, use_rotary_positional_embeddings=True,
                                use_learned_positional_embeddings=True),
    ),
    "wan2.1-t2v": TinySpec(**_WAN, pipeline="WanPipeline", transformer_config=_WAN_DIT),
    "wan2.1-i2v": TinySpec(
        **_WAN, pipeline="WanImageToVideoPipeline", needs_image=True, image_encoder=True,
        transformer_config=dict(_WAN_DIT, in_channels=36, image_dim=4, added_kv_proj_dim=_WAN_INNER),
    ),
    # Wan 2.1 FLF2V 14B: Wan 2.1 I2V with a positional embedding over the CLIP tokens of two images
    # (32x32 px in patches of 1 and a class token: 1,025 per image).
    "wan2.1-flf2v": TinySpec(
        **_WAN, pipeline="WanImageToVideoPipeline", needs_image=True, image_encoder=True, last_image=True,
        transformer_config=dict(_WAN_DIT, in_channels=36, image_dim=4, added_kv_proj_dim=_WAN_INNER,
                                pos_embed_seq_len=2 * (32 * 32 + 1)),
    ),
    "wan2.2-a14b": TinySpec(
        **_WAN, pipeline="WanPipeline", transformer_config=_WAN_DIT, two_experts=True,
        pipeline_config=dict(boundary_ratio=0.875),
    ),
    # Wan 2.2 I2V A14B: two experts with the 36 input channels of Wan 2.1 I2V (noise, mask, image
    # latents) and no CLIP image encoder (no image_dim); boundary as the T2V A14B's tiny twin.
    "wan2.2-i2v-a14b": TinySpec(
        **_WAN, pipeline="WanImageToVideoPipeline", needs_image=True, two_experts=True,
        transformer_config=dict(_WAN_DIT, in_channels=36), pipeline_config=dict(boundary_ratio=0.875),
    ),
    # TI2V-5B is saved as a WanPipeline (as on the hub); WanImageToVideoPipeline.from_pretrained of
    # the same folder gives its image-to-video mode. 64 px: its VAE compresses 16x, patch 2.
    "wan2.2-ti2v": TinySpec(
        **dict(_WAN, vae_config=_WAN_VAE_22), pipeline="WanPipeline", width=64, height=64,
        transformer_config=dict(_WAN_DIT, in_channels=48, out_channels=48),
        pipeline_config=dict(expand_timesteps=True),
    ),
    # HunyuanVideo 1.5 T2V: Qwen2.5-VL's text model and a ByT5 glyph encoder, a CFG guider component.
    # 64 px: its VAE compresses 16x and the transformer's patch is 1.
    "hunyuanvideo1.5-t2v": TinySpec(
        pipeline="HunyuanVideo15Pipeline", transformer="HunyuanVideo15Transformer3DModel", transformer_config=_HY15_DIT,
        vae="AutoencoderKLHunyuanVideo15", vae_config=_HY15_VAE, scheduler="FlowMatchEulerDiscreteScheduler",
        scheduler_config=dict(shift=5.0), text_encoder="Qwen2_5_VLTextModel", width=64, height=64,
        text_stack="hunyuan15", guider=True,
    ),
    # Its image-to-video checkpoint: the image's VAE latent and mask as the extra input channels,
    # SigLIP's tokens beside the text's.
    "hunyuanvideo1.5-i2v": TinySpec(
        pipeline="HunyuanVideo15ImageToVideoPipeline", transformer="HunyuanVideo15Transformer3DModel",
        transformer_config=dict(_HY15_DIT, task_type="i2v"), vae="AutoencoderKLHunyuanVideo15", vae_config=_HY15_VAE,
        scheduler="FlowMatchEulerDiscreteScheduler", scheduler_config=dict(shift=5.0), text_encoder="Qwen2_5_VLTextModel",
        width=64, height=64, needs_image=True, text_stack="hunyuan15", guider=True, siglip=True,
    ),
    # LTX-2 T2V: Gemma 3 and the text connectors, one audio-video transformer, the audio VAE and vocoder.
    # 64 px: the VAE compresses 32x (patch 1); 9 frames are 2 latent frames.
    "ltx2-t2v": TinySpec(
        pipeline="LTX2Pipeline", transformer="LTX2VideoTransformer3DModel", transformer_config=_LTX2_DIT,
        vae="AutoencoderKLLTX2Video", vae_config=_LTX2_VAE, scheduler="FlowMatchEulerDiscreteScheduler",
        scheduler_config=_LTX2_SCHEDULER, text_encoder="Gemma3ForConditionalGeneration", width=64, height=64,
        text_stack="gemma3", audio=True, call_config=_LTX2_CALL,
    ),
}
TINY_VARIANTS: tuple[str, ...] = tuple(TINY_SPECS)


def tiny_spec(variant: str) -> TinySpec:
    """The declaration of `variant`, or a ValueError listing the known names."""
    if variant not in TINY_SPECS:
        raise ValueError(f"Unknown tiny variant {variant!r}; expected one of {', '.join(TINY_VARIANTS)}.")
    return TINY_SPECS[variant]


# --- components ----------------------------------------------------------------------------------

def build_tiny_tokenizer() -> transformers.PreTrainedTokenizerBase:
    """A T5 Unigram tokenizer from an in-code vocabulary (no spiece.model, no hub).

    Ids follow T5 (pad 0, eos 1, unk 2) and 100 ``<extra_id_N>`` tokens are appended, so it
    saves as tokenizer.json and reloads with AutoTokenizer. Whole words score higher than single
    characters, so "▁cat" is one token; anything outside the vocabulary becomes ``<unk>``.
    """
    chars = string.ascii_letters + string.digits + string.punctuation
    words = "a the cat dog in on of and with is dance monkey video".split()
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    vocab += [("▁" + w, -1.0) for w in words] + [("▁" + c, -3.0) for c in chars] + [(c, -4.0) for c in chars]
    return transformers.T5Tokenizer(vocab=vocab, extra_ids=100, model_max_length=512)


def _seeded(seed: int, cls_name: str, module, *args, **kwargs):
    """Build ``module.cls_name(*args, **kwargs)`` right after seeding, so each component's random
    weights depend only on (seed, config), not on what was built before it."""
    torch.manual_seed(seed)
    return getattr(module, cls_name)(*args, **kwargs)


def _text_encoder(spec: TinySpec, vocab_size: int, seed: int) -> torch.nn.Module:
    config_cls = getattr(transformers, spec.text_encoder.replace("EncoderModel", "Config"))
    return _seeded(seed, spec.text_encoder, transformers, config_cls(vocab_size=vocab_size, **_TEXT_ENCODER))


def _image_components(spec: TinySpec, seed: int) -> dict[str, Any]:
    """Wan 2.1 I2V's CLIP vision encoder (hidden_states[-2] feeds the transformer's image_dim).

    CLIPVisionModel, as in the real Wan 2.1 I2V repos (the pipeline warns on the test's
    ...WithProjection). The PIL image processor when transformers has it: the default class
    needs torchvision and otherwise falls back to it with a warning.
    """
    if spec.siglip:
        return _siglip_components(seed)
    if not spec.image_encoder:
        return {}
    processor_cls = getattr(transformers, "CLIPImageProcessorPil", None) or transformers.CLIPImageProcessor
    return {
        "image_encoder": _seeded(seed, "CLIPVisionModel", transformers, transformers.CLIPVisionConfig(**_CLIP_VISION)),
        "image_processor": processor_cls(crop_size=32, size=32),
    }


def _siglip_components(seed: int) -> dict[str, Any]:
    """HunyuanVideo 1.5 I2V's SigLIP vision tower (last_hidden_state feeds image_embed_dim), with
    the PIL processor when transformers has it (the default one needs torchvision)."""
    processor_cls = getattr(transformers, "SiglipImageProcessorPil", None) or transformers.SiglipImageProcessor
    return {
        "image_encoder": _seeded(seed, "SiglipVisionModel", transformers, transformers.SiglipVisionConfig(**_HY15_SIGLIP)),
        "feature_extractor": processor_cls(size={"height": 32, "width": 32}),
    }


def build_tiny_qwen_tokenizer() -> transformers.PreTrainedTokenizerBase:
    """A byte-level Qwen2 tokenizer with no merges (one token per byte) and Qwen's chat markers.

    HunyuanVideo 1.5 formats every prompt with `apply_chat_template`, so the template is set; it
    saves as tokenizer.json + chat_template.jinja and reloads with AutoTokenizer, offline.
    """
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {char: i for i, char in enumerate(bytes_to_unicode().values())}
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        vocab[special] = len(vocab)
    tokenizer = transformers.Qwen2Tokenizer(vocab=vocab, merges=[])
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = _QWEN_CHAT_TEMPLATE
    return tokenizer


def _t5_text(spec: TinySpec, seed: int) -> dict[str, Any]:
    tokenizer = build_tiny_tokenizer()
    return {"tokenizer": tokenizer, "text_encoder": _text_encoder(spec, len(tokenizer), seed)}


def _hunyuan15_text(spec: TinySpec, seed: int) -> dict[str, Any]:
    """Qwen2.5-VL's text model (prompt), ByT5 (quoted glyph text) and the guider holding cfg."""
    from diffusers.guiders import ClassifierFreeGuidance

    tokenizer, tokenizer_2 = build_tiny_qwen_tokenizer(), transformers.ByT5Tokenizer()
    ids = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])  # Qwen's bos and eos, in this vocabulary
    qwen = transformers.Qwen2_5_VLTextConfig(vocab_size=len(tokenizer), bos_token_id=ids[0], eos_token_id=ids[1], **_HY15_QWEN)
    return {
        "tokenizer": tokenizer,
        "text_encoder": _seeded(seed, "Qwen2_5_VLTextModel", transformers, qwen),
        "tokenizer_2": tokenizer_2,
        "text_encoder_2": _seeded(seed, "T5EncoderModel", transformers,
                                  transformers.T5Config(vocab_size=len(tokenizer_2), **_HY15_BYT5)),
        "guider": ClassifierFreeGuidance(guidance_scale=5.0),  # tiny_call_kwargs' guidance_scale
    }


def build_tiny_gemma_tokenizer() -> transformers.PreTrainedTokenizerBase:
    """A Gemma tokenizer of single characters (no merges), built in code; LTX2Pipeline pads it left."""
    vocab = {token: i for i, token in enumerate(("<pad>", "<eos>", "<bos>", "<unk>"))}
    for char in string.ascii_letters + string.digits + string.punctuation + " ▁":
        vocab.setdefault(char, len(vocab))
    return transformers.GemmaTokenizer(vocab=vocab, merges=[], pad_token="<pad>", eos_token="<eos>",
                                       bos_token="<bos>", unk_token="<unk>")


def _gemma3_text(spec: TinySpec, seed: int) -> dict[str, Any]:
    """LTX-2's Gemma 3 (a tiny vision tower too: the class has one) and the connectors over its layers."""
    from diffusers.pipelines.ltx2 import LTX2TextConnectors

    tokenizer = build_tiny_gemma_tokenizer()
    text = transformers.Gemma3TextConfig(
        vocab_size=len(tokenizer), hidden_size=_LTX2_TEXT, intermediate_size=16, num_hidden_layers=_LTX2_GEMMA_LAYERS,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, sliding_window=8)
    vision = transformers.SiglipVisionConfig(hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=8, patch_size=4)
    gemma = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    return {
        "tokenizer": tokenizer,
        "text_encoder": _seeded(seed, "Gemma3ForConditionalGeneration", transformers, gemma),
        "connectors": _seeded(seed, "LTX2TextConnectors", SimpleNamespace(LTX2TextConnectors=LTX2TextConnectors),
                              **_LTX2_CONNECTORS),
    }


def _audio_components(spec: TinySpec, seed: int) -> dict[str, Any]:
    if not spec.audio:
        return {}
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    return {
        "audio_vae": _seeded(seed, "AutoencoderKLLTX2Audio", diffusers, **_LTX2_AUDIO_VAE),
        "vocoder": _seeded(seed, "LTX2Vocoder", SimpleNamespace(LTX2Vocoder=LTX2Vocoder), **_LTX2_VOCODER),
    }


_TEXT_STACKS = {"t5": _t5_text, "hunyuan15": _hunyuan15_text, "gemma3": _gemma3_text}


def _with_latent_statistics(vae: torch.nn.Module) -> torch.nn.Module:
    """LTX-2's video VAE keeps its per-channel statistics as weights (buffers), built as 0 and 1: a
    missing or doubled denormalisation would then give the same latents. Other values make either
    show (the audio VAE's tests do the same: tests/test_ltx2_audio.py `audio_stats_folder`)."""
    if type(vae).__name__ == "AutoencoderKLLTX2Video":
        channels = vae.latents_mean.numel()
        vae.latents_mean.copy_(torch.linspace(-0.5, 0.5, channels))
        vae.latents_std.copy_(torch.linspace(0.5, 2.0, channels))
    return vae


def _components(spec: TinySpec, seed: int) -> dict[str, Any]:
    components = {
        **_TEXT_STACKS[spec.text_stack](spec, seed),
        "vae": _with_latent_statistics(_seeded(seed, spec.vae, diffusers, **spec.vae_config)),
        "scheduler": getattr(diffusers, spec.scheduler)(**spec.scheduler_config),
        "transformer": _seeded(seed, spec.transformer, diffusers, **spec.transformer_config),
        **_image_components(spec, seed),
        **_audio_components(spec, seed),
    }
    if spec.two_experts:
        # seed + 1: two identical experts would hide a wrong expert switch.
        components["transformer_2"] = _seeded(seed + 1, spec.transformer, diffusers, **spec.transformer_config)
    return components


# --- public verbs --------------------------------------------------------------------------------

def build_tiny_pipeline(variant: str, seed: int = 0) -> diffusers.DiffusionPipeline:
    """Build the tiny random pipeline `variant` (see ``TINY_VARIANTS``) on the CPU, in fp32.

    Deterministic: the same (variant, seed) gives bit-identical weights in any process. Every
    module is put in ``.eval()`` because models built from a config start in training mode
    (T5 dropout on), whereas ``from_pretrained`` returns them in eval mode.
    """
    spec = tiny_spec(variant)
    components = _components(spec, seed)
    for component in components.values():
        if isinstance(component, torch.nn.Module):
            component.eval()
    pipe = getattr(diffusers, spec.pipeline)(**components, **spec.pipeline_config)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def save_tiny_pipeline(variant: str, folder: str | Path, seed: int = 0) -> Path:
    """Build `variant` and save it as a diffusers folder (model_index.json + safetensors).

    The folder reloads offline with ``DiffusionPipeline.from_pretrained(folder)`` and its weights
    are bit-identical to ``build_tiny_pipeline(variant, seed)``. Outputs may still differ in the
    last bits (Wan: ~3e-6): loaded weights are views into the safetensors mapping, not 64-byte
    aligned, and MKL's matrix-vector kernels round differently on unaligned data. Two loads of
    one folder agree bit for bit; so do a built and a loaded pipeline after ``p.data = p.data.clone()``.
    """
    folder = Path(folder)
    build_tiny_pipeline(variant, seed).save_pretrained(folder, safe_serialization=True)
    return folder


def tiny_call_kwargs(variant: str, seed: int = 0, steps: int = 2, output_type: str = "latent",
                     structured: bool = False) -> dict[str, Any]:
    """Keyword arguments for one fast, deterministic call of the tiny `variant` at its default shape.

    Image-conditioned variants get a flat grey PIL image of the run size (first-last-frame ones a lighter
    grey last image too); with `structured`, `tiny_image`'s pictures instead (a flat grey picture
    cannot show a flipped or transposed image). Note the latent
    layouts differ: CogVideoX returns (batch, frames, channels, h, w), Wan (batch, channels, frames, h, w).
    """
    spec = tiny_spec(variant)
    kwargs = dict(
        prompt="a cat", height=spec.height, width=spec.width, num_frames=spec.frames,
        num_inference_steps=steps, guidance_scale=5.0, output_type=output_type,
        generator=torch.Generator("cpu").manual_seed(seed),
    )
    kwargs.update(spec.call_config)
    if spec.guider:
        del kwargs["guidance_scale"]  # the saved guider's config holds the same 5.0
    size = (spec.width, spec.height)
    if spec.needs_image:
        kwargs["image"] = tiny_picture(tiny_image(variant)) if structured else Image.new("RGB", size, (128, 128, 128))
    if spec.last_image:
        kwargs["last_image"] = tiny_picture(tiny_image(variant, last=True)) if structured else Image.new("RGB", size, (200, 200, 200))
    return kwargs


def tiny_image(variant: str, last: bool = False) -> torch.Tensor:
    """A ComfyUI IMAGE [1, H, W, 3] at the variant's run size that every flip, transpose, rotation
    and channel swap changes (a flat grey one hides them all): red rises left to right, green top to
    bottom, blue is bright in the top-left quarter. On whole 8-bit levels, so the Sampler's PIL
    conversion keeps it exactly. `last`: a first-last-frame model's last frame, the colours inverted."""
    spec = tiny_spec(variant)
    height, width = spec.height, spec.width
    red = torch.linspace(0, 1, width).expand(height, width)
    green = torch.linspace(0, 1, height).unsqueeze(1).expand(height, width)
    blue = torch.full((height, width), 0.2)
    blue[: height // 2, : width // 2] = 0.8
    image = (torch.stack([red, green, blue], dim=-1).unsqueeze(0) * 255).round() / 255
    return 1 - image if last else image


def tiny_picture(image: torch.Tensor) -> Image.Image:
    """`tiny_image` as the PIL picture diffusers takes; converted here, not by the Sampler's own code,
    so a comparison of the two paths can catch that code turning the picture."""
    return Image.fromarray((image[0] * 255).round().to(torch.uint8).numpy())
