"""Which model a set of files is, and whether the files belong together; errors name the fix."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

from ..family import ModelError
from . import detect, text_encoders
from .catalogue import ModelEntry
from .files import WeightFile


def check_experts(model: WeightFile, model_2: WeightFile | None) -> None:
    """Wan 2.2 A14B's two experts are one architecture; anything else is the wrong pairing, and so is one
    file given twice (its shapes fit: Wan 2.1 14B as both would run as Wan 2.2 A14B)."""
    if model_2 is not None and _same_file(model.path, model_2.path):
        raise ModelError(
            f"model_2: '{model_2.name}' is the same file as model ('{model.name}'). Wan 2.2 A14B runs two experts: "
            "model takes the high-noise file and model_2 the low-noise one (e.g. wan2.2_t2v_high_noise_14B_* and "
            "wan2.2_t2v_low_noise_14B_*); for a model with one transformer (Wan 2.1 14B) set model_2 to (none)."
        )
    if model_2 is None or model_2.fields == model.fields:
        return
    diff = detect.differences(model_2.fields, model.fields)
    raise ModelError(
        f"model_2: '{model_2.name}' is not the other expert of '{model.name}' (it has {'; '.join(diff)}). "
        "Wan 2.2 A14B's experts share one architecture: pick the low-noise file of the same model "
        "(e.g. wan2.2_t2v_low_noise_14B_* with wan2.2_t2v_high_noise_14B_*), or set model_2 to (none)."
    )


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)  # a link or another spelling of the path is the same file too
    except OSError:
        return a.resolve() == b.resolve()


# Wan 2.1 T2V / I2V 14B and the Wan 2.2 A14B experts have the same shapes: only the file names tell them apart.
_EXPERT = re.compile(r"(high|low)[ _.-]?noise")
_WAN21 = re.compile(r"wan[ _.-]?2[ _.-]1(?![0-9])")


def name_disagreements(entry: ModelEntry, model: WeightFile, model_2: WeightFile | None) -> list[str]:
    """What the transformer files' names say (a high_noise / low_noise expert, Wan 2.1) that the files as
    given contradict. Shapes cannot tell these models apart, so this is a warning, not a refusal: the
    inputs decide (model_2 set or not), and a renamed file may be right."""
    claims = []
    for role, file in (("model", model), ("model_2", model_2)):
        name = file.name.lower() if file is not None else ""
        expert = _EXPERT.search(name)
        if expert and model_2 is None:
            claims.append(f"model: '{file.name}' is named a {expert.group(1)}-noise expert of Wan 2.2 A14B, but with "
                          f"model_2 at (none) its shapes run as {entry.name}; set model_2 to the low-noise expert to "
                          "run Wan 2.2 A14B")
        elif expert and expert.group(1) != ("high" if role == "model" else "low"):
            claims.append(f"{role}: '{file.name}' is named the {expert.group(1)}-noise expert, but {role} takes the "
                          f"{'high' if role == 'model' else 'low'}-noise one; swap model and model_2")
        if _WAN21.search(name) and model_2 is not None:
            claims.append(f"{role}: '{file.name}' is named Wan 2.1, but with model_2 set the two files run as the "
                          f"experts of {entry.name}")
    return claims


def choose_model(model: WeightFile, experts: int, catalogue: Sequence[ModelEntry]) -> ModelEntry:
    """The first catalogue entry whose transformer config the file's shapes fit, with `experts` files."""
    fits = [e for e in catalogue if detect.transformer_config_fields(e.config("transformer")) == model.fields]
    chosen = [e for e in fits if e.experts == experts]
    if chosen:
        return chosen[0]
    if fits:
        other = fits[0]
        if other.experts == 2:
            raise ModelError(
                f"model: '{model.name}' is one expert of {other.name}, which needs both: set model_2 to its "
                "low-noise expert file (model takes the high-noise one)."
            )
        raise ModelError(f"model_2: {other.name} has a single transformer; set model_2 to (none).")
    found = model.fields
    family = detect.transformer_family(found)
    if family == "LTX-2":
        raise ModelError(
            f"model: '{model.name}' is an LTX-2 checkpoint; these single-file inputs build Wan pipelines. Load LTX-2 with "
            "Load Video Pipeline: its diffusers folder (for Gemma 3 and the text connectors) with this file as transformer_file."
        )
    if family == "HunyuanVideo 1.5":
        raise ModelError(
            f"model: '{model.name}' is a HunyuanVideo 1.5 transformer; these single-file inputs build Wan pipelines. Load "
            "HunyuanVideo 1.5 with Load Video Pipeline: its diffusers folder (for Qwen2.5-VL, ByT5 and the VAE) with this "
            "file as transformer_file."
        )
    known = ", ".join(e.name for e in catalogue)
    raise ModelError(
        f"model: '{model.name}' is a Wan transformer vidmem has no config for (width {found['inner_dim']}, "
        f"{found['num_layers']} blocks, {found['in_channels']} input channels, image embedding: "
        f"{'yes' if found['image_dim'] else 'no'}); vidmem knows {known}. Use one of those models' files."
    )


def check_vae(entry: ModelEntry, vae: WeightFile) -> None:
    if "z_dim" not in vae.fields:  # HunyuanVideo 1.5's (comfy_files/hy15_vae.py): Load Video Pipeline's vae_file reads it
        raise ModelError(f"vae: '{vae.name}' is HunyuanVideo 1.5's VAE, but {entry.name} is a Wan model: use the Wan VAE "
                         "(wan_2.1_vae / wan2.2_vae.safetensors). A HunyuanVideo 1.5 VAE file goes to Load Video Pipeline's "
                         "vae_file, over a HunyuanVideo 1.5 diffusers folder.")
    wanted = detect.vae_config_fields(entry.config("vae"))
    if vae.fields == wanted:
        return
    if vae.fields["z_dim"] != wanted["z_dim"]:
        name = {16: "Wan 2.1 VAE (wan_2.1_vae.safetensors)", 48: "Wan 2.2 VAE (wan2.2_vae.safetensors)"}
        need = name.get(wanted["z_dim"], f"a VAE with {wanted['z_dim']} latent channels")
        raise ModelError(
            f"vae: '{vae.name}' has {vae.fields['z_dim']} latent channels but {entry.name} works in "
            f"{wanted['z_dim']}: use the {need}. (Wan 2.2 TI2V-5B uses the Wan 2.2 VAE; every other Wan model the 2.1 VAE.)"
        )
    raise ModelError(f"vae: '{vae.name}' does not fit {entry.name}: {'; '.join(detect.differences(vae.fields, wanted))}.")


def check_text_encoder(entry: ModelEntry, text_encoder: WeightFile) -> None:
    component = entry.components["text_encoder"]
    wanted = detect.text_encoder_config_fields(component.class_name, component.config)
    found = text_encoder.fields["class"]
    if found != component.class_name:  # another family's encoder: its class says it all
        raise ModelError(
            f"text_encoder: '{text_encoder.name}' is {text_encoders.HELD.get(found, found)}, but {entry.name} runs with "
            "umt5-xxl: use umt5_xxl_fp8_e4m3fn_scaled.safetensors or umt5_xxl_fp16.safetensors from models/text_encoders."
        )
    problems = detect.differences(text_encoder.fields, wanted)
    if problems:
        raise ModelError(
            f"text_encoder: '{text_encoder.name}' does not fit {entry.name} ({'; '.join(problems)}); Wan runs with "
            "umt5-xxl: use umt5_xxl_fp8_e4m3fn_scaled.safetensors or umt5_xxl_fp16.safetensors from models/text_encoders."
        )
    if text_encoder.tokenizer_model is None:
        raise ModelError(
            f"text_encoder: '{text_encoder.name}' has no embedded tokenizer (no 'spiece_model' tensor), and vidmem "
            "builds Wan's umt5 tokenizer from it. Use Comfy-Org's umt5_xxl_fp8_e4m3fn_scaled.safetensors or "
            "umt5_xxl_fp16.safetensors (from Comfy-Org/Wan_2.1_ComfyUI_repackaged), which carry it."
        )


def check_tokenizer(text_encoder: WeightFile) -> None:
    """The embedded tokenizer parses as a SentencePiece model with pieces (checked apart from the
    shapes: transformers' own error for a damaged one blames a missing tiktoken)."""
    if text_encoder.tokenizer_model is not None and _tokenizer_pieces(text_encoder.tokenizer_model) == 0:
        raise ModelError(
            f"text_encoder: '{text_encoder.name}' embeds a tokenizer ('spiece_model') that is not a SentencePiece model "
            "(damaged or empty); download the file again: Comfy-Org's umt5_xxl_fp8_e4m3fn_scaled.safetensors or "
            "umt5_xxl_fp16.safetensors."
        )


def _tokenizer_pieces(model: bytes) -> int:
    """The pieces of a SentencePiece model as transformers reads it (the protobuf, not the
    processor, which refuses repeated pieces transformers accepts); 0 when the bytes are not one."""
    from google.protobuf.message import DecodeError
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    try:
        proto.ParseFromString(model)
    except DecodeError:
        return 0
    return len(proto.pieces)


def check_clip_vision(entry: ModelEntry, clip_vision: WeightFile | None) -> None:
    needed = "image_encoder" in entry.components
    if clip_vision is None and needed:
        raise ModelError(f"clip_vision: {entry.name} encodes its input image with CLIP ViT-H: set clip_vision to clip_vision_h.safetensors.")
    if clip_vision is not None and not needed:
        raise ModelError(f"clip_vision: {entry.name} has no image encoder; set clip_vision to (none).")
    if clip_vision is not None:
        wanted = detect.clip_vision_config_fields(entry.config("image_encoder"))
        problems = detect.differences(clip_vision.fields, wanted)
        if problems:
            raise ModelError(f"clip_vision: '{clip_vision.name}' is not the encoder {entry.name} uses ({'; '.join(problems)}); use clip_vision_h.safetensors.")
