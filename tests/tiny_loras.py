"""Tiny stand-ins for the LoRAs and the training clips the LoRA and train templates name.

A LoRA template names real files (Kijai's `Wan21_T2V_14B_lightx2v_cfg_step_distill_lora_rank32.safetensors`,
Comfy-Org's `wan2.2_t2v_lightx2v_4steps_lora_v1.1_high_noise.safetensors`, ...). For the tests and a test
host, `place_tiny_loras` writes, under exactly those names in a models/loras folder, a random LoRA
shaped for the tiny model that stands in for the template's loader, in the key layout the real file
uses: lightx2v's (`diffusion_model.blocks.N.self_attn.q.lora_down.weight` + `.alpha`, original Wan
names) for Wan, diffusers/PEFT (`transformer.transformer_blocks.N.attn1.to_q.lora_A.weight`, as
CogVideoX-Factory saves) for CogVideoX, Lightricks' (`diffusion_model.transformer_blocks.N.attn1.to_q
.lora_A.weight`, the audio branch too) for LTX-2, and Tencent's train.py's (`double_blocks.N.img_attn_q
.lora_A.weight`, no prefix) for HunyuanVideo 1.5. An existing file is never overwritten.

    python tests/workflow_runner.py place-loras /path/to/ComfyUI/models/loras
    python tests/workflow_runner.py place-clips /tmp/vidmem_clips

`place_tiny_clips` writes a few tiny captioned clips (clip0.mp4 + clip0.txt, ...) for the train templates.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

try:
    from . import model_files
    from . import workflow_runner as wr
except ImportError:  # tests/ is not a package: run from tests/ or with tests/ on sys.path
    import model_files
    import workflow_runner as wr

LORA_NODE = "VidMemLoadLoRA"
RANK = 4
# diffusers module name -> the original Wan name lightx2v's files use (attention, then feed-forward)
WAN_ORIGINAL = (("attn1.to_out.0", "self_attn.o"), ("attn2.to_out.0", "cross_attn.o"), ("attn1.to_", "self_attn."),
                ("attn2.to_", "cross_attn."), ("ffn.net.0.proj", "ffn.0"), ("ffn.net.2", "ffn.2"))
WAN_LAYERS = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "attn2.to_k", "attn2.to_v",
              "attn2.to_out.0", "ffn.net.0.proj", "ffn.net.2")
COG_LAYERS = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0")
# LTX-2: the video and audio self-attention and the cross-modal attention (names as in diffusers)
LTX2_LAYERS = tuple(f"{a}.{p}" for a in ("attn1", "audio_attn1", "audio_to_video_attn", "video_to_audio_attn")
                    for p in ("to_q", "to_k", "to_v", "to_out.0"))
# HunyuanVideo 1.5: diffusers name -> Tencent's, the image and text streams' attention
HY15_ORIGINAL = (("attn.to_q", "img_attn_q"), ("attn.to_k", "img_attn_k"), ("attn.to_v", "img_attn_v"),
                 ("attn.to_out.0", "img_attn_proj"), ("attn.add_q_proj", "txt_attn_q"), ("attn.to_add_out", "txt_attn_proj"))


def loader_variant(api: dict, node_id: str) -> str:
    """The tiny model standing in for the loader at the start of `node_id`'s pipeline chain."""
    node = api[node_id]
    while node["class_type"] not in (wr.FOLDER_LOADER, wr.FILES_LOADER):
        node = api[node["inputs"]["pipeline"][0]]
    if node["class_type"] == wr.FILES_LOADER:
        names = tuple((role, node["inputs"][role]) for role in model_files.FOLDERS
                      if node["inputs"].get(role, model_files.UNUSED) != model_files.UNUSED)
        return model_files.TemplateFiles(names).variant
    return wr.tiny_variant_for(node["inputs"]["model"])


def referenced_loras(paths: list[Path] | None = None) -> dict[str, str]:
    """LoRA file name -> the tiny variant it must fit, for every Load LoRA node of the API workflows."""
    found = {}
    for path in paths or wr.api_files():
        api = wr.load_json(path)
        for nid, node in api.items():
            if node["class_type"] == LORA_NODE:
                found[node["inputs"]["lora_name"]] = loader_variant(api, nid)
    return found


def tiny_lora_tensors(variant: str, seed: int = 0) -> dict:
    """A random rank-RANK LoRA for the tiny `variant`'s transformer, in its family's usual key layout."""
    import torch

    from vidmem.pipelines.tiny import build_tiny_pipeline

    transformer = build_tiny_pipeline(variant).transformer
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    family = next((f for f in ("wan", "ltx2", "hunyuanvideo1.5") if variant.startswith(f)), "cogvideox")
    blocks = "blocks" if family == "wan" else "transformer_blocks"
    layers = {"wan": WAN_LAYERS, "ltx2": LTX2_LAYERS, "hunyuanvideo1.5": tuple(d for d, _ in HY15_ORIGINAL)}.get(family, COG_LAYERS)
    for index in range(len(getattr(transformer, blocks))):
        for layer in layers:
            module = transformer.get_submodule(f"{blocks}.{index}.{layer}")
            down = torch.randn(RANK, module.in_features, generator=gen) * 0.1
            up = torch.randn(module.out_features, RANK, generator=gen) * 0.1
            if family == "wan":
                name = f"diffusion_model.blocks.{index}.{_original(layer)}"
                tensors.update({f"{name}.lora_down.weight": down, f"{name}.lora_up.weight": up,
                                f"{name}.alpha": torch.tensor(float(RANK))})
            else:
                name = _peft_name(family, index, layer)
                tensors.update({f"{name}.lora_A.weight": down, f"{name}.lora_B.weight": up})
    return tensors


def _peft_name(family: str, index: int, layer: str) -> str:
    """The module name a PEFT-tensor LoRA of `family` uses for block `index`'s `layer` (a diffusers name)."""
    if family == "ltx2":  # Lightricks' LoRAs: the original names, which are diffusers' inside the blocks
        return f"diffusion_model.transformer_blocks.{index}.{layer}"
    if family == "hunyuanvideo1.5":  # Tencent's train.py: its own names, no prefix
        return f"double_blocks.{index}.{dict(HY15_ORIGINAL)[layer]}"
    return f"transformer.transformer_blocks.{index}.{layer}"  # CogVideoX-Factory


def _original(layer: str) -> str:
    for diffusers_name, original in WAN_ORIGINAL:
        layer = layer.replace(diffusers_name, original)
    return layer


def place_tiny_loras(loras_dir: Path, paths: list[Path] | None = None) -> list[Path]:
    """A tiny LoRA under every name the API workflows' Load LoRA nodes use; existing files are kept.

    Written beside the target and renamed, so a server never lists half a file."""
    import safetensors.torch

    loras_dir = Path(loras_dir)
    loras_dir.mkdir(parents=True, exist_ok=True)
    placed = []
    for seed, (name, variant) in enumerate(sorted(referenced_loras(paths).items())):
        target = loras_dir / name
        if not target.exists():
            handle, scratch = tempfile.mkstemp(suffix=".safetensors.tmp", dir=loras_dir)
            os.close(handle)
            safetensors.torch.save_file(tiny_lora_tensors(variant, seed), scratch, metadata={"vidmem": "tiny test LoRA"})
            os.replace(scratch, target)
        placed.append(target)
    return placed


def place_tiny_clips(folder: Path, clips: int = 2) -> Path:
    """A few tiny captioned clips (64x64, 9 frames: covers every tiny model's bucket) for the train templates."""
    try:
        from .test_train_support import make_dataset
    except ImportError:
        from test_train_support import make_dataset
    folder = Path(folder)
    if not any(folder.glob("*.mp4")):
        make_dataset(folder, clips=clips, frames=9, width=64, height=64)
    return folder
