"""The templates with a LoRA between the loader and the Sampler (Load LoRA (VidMem)): one per family.

Wan 2.1 14B and Wan 2.2 A14B carry lightx2v's step- and guidance-distill LoRAs: 4 steps at cfg 1
(no negative pass), flow-match Euler at shift 5, as lightx2v's own configs run them
(`denoising_step_list` 1000/750/500/250, `sample_shift` 5, `enable_cfg` false). On Comfy-Org's
fp8 single files with the weights mapped from disk, they fit an 8 GB card and 32 GB of RAM (the
planner's figures, `vidmem plan ... --steps 4 --no-cfg`). No step-distill LoRA exists for CogVideoX
(lightx2v and Lightning are Wan-only): its template loads a style LoRA instead, e.g. one trained
with the "Train CogVideoX-2b LoRA" template or by CogVideoX-Factory.
"""

from __future__ import annotations

from template_types import NEGATIVE, LoraFile, LoraStep, Machine, Template, diffusers_folder, model_files, strategy
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
            "Memory strategy, offload = block_swap with blocks_to_swap = 38: 38 of the 40 blocks (0.33 GiB each "
            "in fp8) stream to the GPU each step. Predicted peak VRAM 7.8 GiB, the same as without the LoRA "
            "(it is small: its extra bytes are on the Sampler's receipt); 38 is the fewest that fit and all 40 "
            "is predicted no lower (8.0 GiB). The text encoder goes to the GPU alone (6.5 GiB) and leaves once "
            "the prompt is encoded; the VAE decodes in 256 px tiles. weights_on_disk = on: the files stay "
            "in the page cache, the process's own RAM about 4 GiB.\n\n"
            "Check your machine: vidmem plan --model wan2.1-t2v-14b --weights fp8_scaled --disk --size 832x480 "
            "--frames 81 --steps 4 --no-cfg --vram 8 --ram 32."
        ),
        loader=model_files(*WAN21_14B_FILES),
        strategy=strategy("block_swap", "offload_after_encoding", 38),
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
            "Memory strategy, offload = block_swap with blocks_to_swap = 38 per expert: only one expert is on "
            "the GPU at a time, 38 of its 40 blocks streaming in; predicted peak VRAM 7.8 GiB, the fewest blocks "
            "that fit (all 40: 8.0 GiB). weights_on_disk = on: 35 GB of files on a 32 GB "
            "machine live in the page cache; the expert not in use is read again from disk at its turn (the "
            "process's own RAM: about 4 GiB).\n\n"
            "Check your machine: vidmem plan --model wan2.2-t2v-a14b --weights fp8_scaled --disk --size 832x480 "
            "--frames 81 --steps 4 --no-cfg --vram 8 --ram 32."
        ),
        loader=model_files(WAN22_HIGH_FP8, UMT5_FP8_22, WAN21_VAE_22, model_2=WAN22_LOW_FP8),
        strategy=strategy("block_swap", "offload_after_encoding", 38),
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
)
