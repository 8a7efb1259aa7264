"""The templates with a LoRA between the loader and the Sampler (Load LoRA (VidMem)): one per family.

Wan 2.1 14B and Wan 2.2 A14B carry lightx2v's step- and guidance-distill LoRAs: 4 steps at cfg 1
(no negative pass), flow-match Euler at shift 5, as lightx2v's own configs run them
(`denoising_step_list` 1000/750/500/250, `sample_shift` 5, `enable_cfg` false). On Comfy-Org's
fp8 single files with the weights mapped from disk, they fit an 8 GB card and 32 GB of RAM (the
planner's figures, `vidmem plan ... --steps 4 --no-cfg`). No step-distill LoRA exists for CogVideoX
(lightx2v and Lightning are Wan-only): its template loads a style LoRA instead, e.g. one trained
with the "Train CogVideoX-2b LoRA" template or by CogVideoX-Factory.

LTX-2 carries one of Lightricks' own camera-control LoRAs (dolly in), at LTX2Pipeline's defaults;
HunyuanVideo 1.5 a style LoRA of the user's own (no distill LoRA is published for it), e.g. one
trained with Tencent's train.py. Each reuses its family's template of the same card (templates_families).
"""

from __future__ import annotations

from template_types import NEGATIVE, LoraFile, LoraStep, Machine, Template, diffusers_folder, model_files, strategy
from templates_families import FP8, LTX2_CHUNKS, LTX2_GUIDANCE, LTX2_NEGATIVE
from templates_files import (
    UMT5_FP8_22, WAN21_14B_FILES, WAN21_VAE_22, WAN22_A14B_FILES, WAN22_HIGH_FP8, WAN22_LOW_FP8, files_text,
)

KIJAI_REPO = "Kijai/WanVideo_comfy"
WAN22_REPO = "Comfy-Org/Wan_2.2_ComfyUI_Repackaged"
# Sizes: rank x (in + out) per adapted layer of the 14B model, 16-bit (not read from the hub).
LIGHTX2V_WAN21 = LoraFile("Wan21_T2V_14B_lightx2v_cfg_step_distill_lora_rank32.safetensors", KIJAI_REPO,
                          "Wan21_T2V_14B_lightx2v_cfg_step_distill_lora_rank32.safetensors", "about 0.3 GB", 0.3)
LIGHTX2V_WAN22_HIGH = LoraFile("wan2.2_t2v_lightx2v_4steps_lora_v1.1_high_noise.safetensors", WAN22_REPO,
                               "split_files/loras/wan2.2_t2v_lightx2v_4steps_lora_v1.1_high_noise.safetensors",
                               "about 0.6 GB", 0.6)
LIGHTX2V_WAN22_LOW = LoraFile("wan2.2_t2v_lightx2v_4steps_lora_v1.1_low_noise.safetensors", WAN22_REPO,
                              "split_files/loras/wan2.2_t2v_lightx2v_4steps_lora_v1.1_low_noise.safetensors",
                              "about 0.6 GB", 0.6)
COGVIDEOX_STYLE = LoraFile("cogvideox_2b_style_lora.safetensors", "")  # the user's own: trained, not downloaded
LTX2_DOLLY_IN = LoraFile("ltx-2-19b-lora-camera-control-dolly-in.safetensors", "Lightricks/LTX-2-19b-LoRA-Camera-Control-Dolly-In",
                         "ltx-2-19b-lora-camera-control-dolly-in.safetensors", "0.33 GB", 0.33)
HUNYUAN15_STYLE = LoraFile("hunyuan15_480p_style_lora.safetensors", "")  # the user's own

DISTILL_SAMPLER = dict(scheduler="flow_match_euler", shift=5.0)
DISTILL_STEPS = (
    "Sampler: steps = 4, cfg = 1, scheduler = flow_match_euler, shift = 5.0: what lightx2v runs its distill "
    "LoRAs with (4 steps from t = 1000, shift 5, no classifier-free guidance). cfg = 1 runs no negative pass, "
    "so the negative prompt is not even encoded and each step costs one transformer pass, not two: about 20x "
    "less compute than 40 steps at cfg 5. More steps or a higher cfg do not help a distilled model; they "
    "burn the image. diffusers' flow-match Euler puts the 4 steps at t = 1000, 910, 717, 24 (lightx2v's "
    "own list: 1000, 938, 833, 625 after the shift), close but not identical.\n\n"
)


def lora_text(loras: tuple[LoraFile, ...]) -> str:
    """The note's paragraph on the LoRA files: where each comes from and where it goes."""
    lines = [f"- models/loras/{f.name} ({f.size}), from {f.repo} on Hugging Face ({f.repo_path})" for f in loras]
    return "LoRA files, each into ComfyUI/models/loras/:\n" + "\n".join(lines) + "\n\n"


LORA_TEMPLATES = (
    Template(
        name="wan21_t2v_14b_lightx2v_4step",
        title="Wan 2.1 14B 4-step, 8 GB card",
        pick="the 14B in 4 steps: 20x less compute than 40",
        note=(
            "Wan 2.1 T2V 14B in 4 steps with lightx2v's step-distill LoRA, on an 8 GB card with 32 GB of RAM: "
            "832x480, 81 frames (about 5 s at 16 fps).\n\n"
            + files_text(WAN21_14B_FILES, ("14 GB", "6.7 GB", "0.25 GB"))
            + lora_text((LIGHTX2V_WAN21,))
            + DISTILL_STEPS +
            "Load LoRA: strength 1.0, the strength it was distilled at; lower weakens the distillation and "
            "needs more steps. The LoRA runs beside each layer (the fp8 weights are never rewritten), "
            "streamed with its block; the Sampler's receipt names it and its extra bytes.\n\n"
            "Memory strategy, offload = block_swap with blocks_to_swap = 37: 37 of the 40 blocks (0.33 GiB each "
            "in fp8) stream to the GPU each step. Predicted without the LoRA (it is small: its extra bytes are on "
            "the Sampler's receipt): peak VRAM 7.7 GiB; 37 is the fewest that fit (7.7 GiB), and more is not "
            "lower here (40 blocks swapped: 8.0 GiB). The text encoder goes to the GPU alone (7.4 GiB while it "
            "encodes) and leaves once the prompt is encoded; the VAE decodes in 256 px tiles. weights_on_disk = "
            "on: the files stay in the page cache, the process's own RAM about 3 GiB.\n\n"
            "Check your machine: vidmem plan --model wan2.1-t2v-14b --weights fp8_scaled --disk --size 832x480 "
            "--frames 81 --steps 4 --no-cfg --vram 8 --ram 32."
        ),
        loader=model_files(*WAN21_14B_FILES),
        strategy=strategy("block_swap", "offload_after_encoding", 37),
        prompt="A lighthouse on a rocky cliff at dusk, waves crashing below, its beam sweeping through sea mist, aerial shot.",
        negative_prompt=NEGATIVE,
        width=832, height=480, frames=81, steps=4, cfg=1.0, fps=16.0,
        machine=Machine(8, 32, "wan2.1-t2v-14b", {"transformer": "fp8_scaled", "text_encoder": "fp8_scaled"}),
        files=WAN21_14B_FILES, note_height=None,
        loras=(LoraStep(LIGHTX2V_WAN21),), sampler=DISTILL_SAMPLER,
    ),
    Template(
        name="wan22_t2v_a14b_lightx2v_4step",
        title="Wan 2.2 A14B 4-step, 8 GB card",
        pick="Wan 2.2 A14B in 4 steps on an 8 GB card",
        note=(
            "Wan 2.2 T2V A14B in 4 steps with lightx2v's Lightning LoRAs, one per expert, on an 8 GB card "
            "with 32 GB of RAM: 832x480, 81 frames (about 5 s at 16 fps).\n\n"
            + files_text(WAN22_A14B_FILES, ("14 GB", "14 GB", "6.7 GB", "0.25 GB"))
            + lora_text((LIGHTX2V_WAN22_HIGH, LIGHTX2V_WAN22_LOW))
            + DISTILL_STEPS +
            "Two Load LoRA nodes, strength 1.0 each: the high_noise LoRA on expert = high_noise (the first steps), "
            "the low_noise one on expert = low_noise. boundary_ratio = 0 keeps the model's own 0.875: the high-noise "
            "expert runs the first 2 steps, the low-noise one the last 2, as lightx2v splits them. cfg_2 = -1: "
            "the low-noise expert also runs at cfg 1.\n\n"
            "Memory strategy, offload = block_swap with blocks_to_swap = 37 per expert: only one expert is on "
            "the GPU at a time, 37 of its 40 blocks streaming in; predicted peak VRAM 7.7 GiB; 37 is the fewest "
            "that fit (7.7 GiB), and more is not lower here (40 blocks swapped: 8.0 GiB). weights_on_disk = on: "
            "35 GB of files on a 32 GB machine live in the page cache; the expert not in use is read again from "
            "disk at its turn (the process's own RAM: about 3 GiB).\n\n"
            "Check your machine: vidmem plan --model wan2.2-t2v-a14b --weights fp8_scaled --disk --size 832x480 "
            "--frames 81 --steps 4 --no-cfg --vram 8 --ram 32."
        ),
        loader=model_files(WAN22_HIGH_FP8, UMT5_FP8_22, WAN21_VAE_22, model_2=WAN22_LOW_FP8),
        strategy=strategy("block_swap", "offload_after_encoding", 37),
        prompt="A paper lantern floats over a night market, steam rising from food stalls, warm light, slow dolly shot.",
        negative_prompt=NEGATIVE,
        width=832, height=480, frames=81, steps=4, cfg=1.0, fps=16.0,
        machine=Machine(8, 32, "wan2.2-t2v-a14b", {"transformer": "fp8_scaled", "transformer_2": "fp8_scaled",
                                                   "text_encoder": "fp8_scaled"}),
        files=WAN22_A14B_FILES, note_height=None,
        loras=(LoraStep(LIGHTX2V_WAN22_HIGH, expert="high_noise"), LoraStep(LIGHTX2V_WAN22_LOW, expert="low_noise")),
        sampler=dict(DISTILL_SAMPLER, cfg_2=-1.0, boundary_ratio=0.0),
    ),
    Template(
        name="cogvideox_2b_style_lora",
        title="CogVideoX-2b LoRA, 12 GB card",
        pick="your own CogVideoX-2b style LoRA",
        note=(
            "CogVideoX-2b with a style LoRA on a 12 GB card: 720x480, 49 frames (about 6 s at 8 fps).\n\n"
            "No step-distill LoRA exists for CogVideoX (lightx2v's and the Lightning LoRAs are Wan-only; we "
            "found none published for CogVideoX-2b), so this template cannot cut the steps: it shows a style "
            "LoRA, sampled at CogVideoX's own 50 steps and cfg 6.\n\n"
            "Model: the diffusers folder of THUDM/CogVideoX-2b in ComfyUI/models/diffusers/CogVideoX-2b, fp16.\n"
            "LoRA: models/loras/cogvideox_2b_style_lora.safetensors is your own: one the \"Train CogVideoX-2b "
            "LoRA, 12 GB card\" template wrote (rename it, or pick its name in the list), or a CogVideoX-Factory "
            "LoRA trained on CogVideoX-2b (its pytorch_lora_weights.safetensors, renamed). A LoRA made for "
            "CogVideoX-5b does not fit 2b and is refused, naming the layer.\n\n"
            "Load LoRA: strength 1.0; 0 gives the base model's frames exactly, values between blend. Several "
            "Load LoRA nodes chain. expert = both (single-transformer models).\n\n"
            "Memory strategy, offload = model: the text encoder (8.9 GiB in fp16) goes to the GPU alone and "
            "leaves once the prompt is encoded (text_encoder = offload_after_encoding); the transformer "
            "(3.2 GiB) with its LoRA samples; the VAE decodes in 256 px tiles. On a card under 12 GB set "
            "text_encoder = cpu."
        ),
        loader=diffusers_folder("CogVideoX-2b", "fp16"),
        strategy=strategy("model", "offload_after_encoding"),
        prompt="A steaming cup of coffee on a wooden table by a window, rain on the glass, soft morning light.",
        negative_prompt=NEGATIVE,
        width=720, height=480, frames=49, steps=50, cfg=6.0, fps=8.0, note_height=None,
        loras=(LoraStep(COGVIDEOX_STYLE),),
    ),
    Template(
        name="ltx2_t2v_camera_lora",
        title="LTX-2 LoRA, 24 GB, 64 GB RAM",
        pick="LTX-2 with Lightricks' dolly-in camera LoRA",
        note=(
            "LTX-2 text to video with one of Lightricks' camera-control LoRAs (dolly in) on a 24 GB card with "
            "64 GB of RAM: 768x512, 121 frames (about 5 s at 24 fps), video only (no audio). Frames must be 8k+1, "
            "width and height multiples of 32.\n\n"
            "Model: the diffusers folder of Lightricks/LTX-2 in ComfyUI/models/diffusers/LTX-2, computed in bf16, "
            "the transformer and the Gemma 3 12B text encoder stored in fp8 (weight_dtype = fp8_scaled).\n"
            + lora_text((LTX2_DOLLY_IN,)) +
            "Load LoRA: strength 1.0. The prompt names the move (\"the camera dollies in\"), as Lightricks' "
            "examples do. Lightricks' LoRAs (and ltx-trainer's, ai-toolkit's, musubi's) use LTX-2's own key "
            "names; Load LoRA maps them through diffusers' LTX-2 converter, the audio branch's layers included, "
            "and lists any key it cannot apply. The LoRA runs beside each layer (the fp8 weights are never "
            "rewritten), streamed with its block. 30 steps at cfg 3: LTX2Pipeline's defaults.\n\n"
            "Memory strategy: as the \"LTX-2 fp8, 24 GB, 64 GB RAM\" template, block_swap with blocks_to_swap = "
            "12 (36 of the 48 blocks stay on the GPU). Predicted without the LoRA: 19.2 GiB VRAM at the peak, 38 "
            "GiB of RAM; the LoRA adds at most its 0.33 GB (the Sampler's receipt shows its bytes). If you run "
            "out of memory, raise blocks_to_swap by 4. " + LTX2_CHUNKS + "\n\n"
            "Check your machine: vidmem plan --model ltx2-t2v-19b --weights fp8_scaled --size 768x512 --frames "
            "121 --vram 24 --ram 64. " + LTX2_GUIDANCE
        ),
        loader=diffusers_folder("LTX-2", "bf16", weight_dtype="fp8_scaled"),
        strategy=strategy("block_swap", "offload_after_encoding", 12),
        prompt="The camera dollies in toward a lighthouse keeper reading by lamplight in a small stone room, rain on the window.",
        negative_prompt=LTX2_NEGATIVE,
        width=768, height=512, frames=121, steps=30, cfg=3.0, fps=24.0,
        machine=Machine(24, 64, "ltx2-t2v-19b", FP8), note_height=None,
        loras=(LoraStep(LTX2_DOLLY_IN),),
    ),
    Template(
        name="hunyuan15_t2v_480p_style_lora",
        title="HunyuanVideo 1.5 LoRA, 8 GB card",
        pick="your own HunyuanVideo 1.5 style LoRA on 8 GB",
        note=(
            "HunyuanVideo 1.5 text to video with a style LoRA on an 8 GB card with 32 GB of RAM: 848x480, 121 "
            "frames (about 5 s at 24 fps). Frames must be 4k+1, width and height multiples of 16.\n\n"
            "No step-distill LoRA is published for HunyuanVideo 1.5 (Tencent publishes distilled checkpoints, "
            "not LoRAs), so this template keeps the authors' 50 steps at cfg 6.\n\n"
            "Model: the diffusers folder of hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v in "
            "ComfyUI/models/diffusers/HunyuanVideo-1.5-Diffusers-480p_t2v, computed in bf16, stored in fp8 "
            "(weight_dtype = fp8_scaled).\n"
            "LoRA: models/loras/hunyuan15_480p_style_lora.safetensors is your own (rename yours, or pick its "
            "name in the list): one trained with Tencent's HunyuanVideo-1.5 train.py (its lora/ folder's "
            "safetensors file, Tencent's own key names and its lora_alpha read from the file), with musubi-tuner "
            "or a diffusers trainer, or one made for ComfyUI (fused img_attn.qkv, split onto q, k and v here). "
            "Only the final modulation layer (which train.py's default all-linear also trains) has no "
            "one-to-one diffusers layer: it is listed as not applied. A LoRA for another HunyuanVideo 1.5 size "
            "is refused, naming the layer.\n\n"
            "Load LoRA: strength 1.0; 0 gives the base model's frames exactly. Several Load LoRA nodes chain.\n\n"
            "Memory strategy: as the \"HunyuanVideo 1.5 480p, 8 GB card\" template, offload = sequential: every "
            "layer streams to the GPU as it runs, its LoRA with it. Predicted without the LoRA: 5.6 GiB VRAM "
            "at the peak, 21 GiB of RAM; the VAE decodes in 256 px tiles.\n\n"
            "Check your machine: vidmem plan --model hunyuanvideo1.5-t2v-480p --weights fp8_scaled --size "
            "848x480 --frames 121 --vram 8 --ram 32."
        ),
        loader=diffusers_folder("HunyuanVideo-1.5-Diffusers-480p_t2v", "bf16", weight_dtype="fp8_scaled"),
        strategy=strategy("sequential", "offload_after_encoding"),
        prompt="A cat walks on the grass in a sunlit garden, watercolor style, tracking shot.",
        negative_prompt=NEGATIVE,
        width=848, height=480, frames=121, steps=50, cfg=6.0, fps=24.0,
        machine=Machine(8, 32, "hunyuanvideo1.5-t2v-480p", FP8), note_height=None,
        loras=(LoraStep(HUNYUAN15_STYLE),),
    ),
)
