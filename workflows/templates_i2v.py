"""The image-to-video templates: a start image from core Load Image into the Sampler's image input.

Wan on Comfy-Org's fp8 single files (Load Video Model Files, weights memory-mapped), CogVideoX-5b
I2V on its diffusers folder lowered to fp8 at load (it has no Comfy-Org single files). Each names
the machine it is sized for; tests/test_workflows.py plans it at its full size on that machine and
checks that its own strategy fits. The figures in the notes are that plan's (bf16 compute; the
planner counts the image-to-video conditioning: the VAE encoding the start image and, for Wan 2.1,
the CLIP image encoder). The API twins are named `..._i2v_...` so a user finds them.
"""

from __future__ import annotations

from template_types import (
    NEGATIVE, WAN21_REPO, WAN22_REPO, Machine, ModelFile, Template, diffusers_folder, model_files, strategy,
)
from templates_files import UMT5_FP8, UMT5_FP8_22, WAN21_VAE, WAN21_VAE_22, files_text
from templates_lora import DISTILL_SAMPLER, DISTILL_STEPS, LoraFile, LoraStep, lora_text

EXAMPLE_IMAGE = "example.png"  # ships in ComfyUI/input, so the template validates before the user picks a picture
WAN22_I2V_HIGH_FP8 = ModelFile("wan2.2_i2v_high_noise_14B_fp8_scaled.safetensors", WAN22_REPO, "diffusion_models", 14.3)
WAN22_I2V_LOW_FP8 = ModelFile("wan2.2_i2v_low_noise_14B_fp8_scaled.safetensors", WAN22_REPO, "diffusion_models", 14.3)
WAN21_I2V_480P_FP8 = ModelFile("wan2.1_i2v_480p_14B_fp8_scaled.safetensors", WAN21_REPO, "diffusion_models", 16.4)
CLIP_VISION_H = ModelFile("clip_vision_h.safetensors", WAN21_REPO, "clip_vision", 1.26)
WAN21_FLF2V_FP8 = ModelFile("wan2.1_flf2v_720p_14B_fp8_e4m3fn.safetensors", WAN21_REPO, "diffusion_models", 16.4)

WAN22_I2V_FILES = (WAN22_I2V_HIGH_FP8, WAN22_I2V_LOW_FP8, UMT5_FP8_22, WAN21_VAE_22)
WAN21_I2V_FILES = (WAN21_I2V_480P_FP8, UMT5_FP8, WAN21_VAE, CLIP_VISION_H)
WAN21_FLF2V_FILES = (WAN21_FLF2V_FP8, UMT5_FP8, WAN21_VAE, CLIP_VISION_H)
WAN22_I2V_WEIGHTS = {"transformer": "fp8_scaled", "transformer_2": "fp8_scaled", "text_encoder": "fp8_scaled"}
# lightx2v's Wan 2.2 I2V A14B step-distill LoRAs as Comfy-Org repackaged them (sizes estimated, not read from the hub).
LIGHTX2V_I2V_HIGH = LoraFile("wan2.2_i2v_lightx2v_4steps_lora_v1_high_noise.safetensors", WAN22_REPO,
                             "split_files/loras/wan2.2_i2v_lightx2v_4steps_lora_v1_high_noise.safetensors",
                             "about 0.6 GB", 0.6)
LIGHTX2V_I2V_LOW = LoraFile("wan2.2_i2v_lightx2v_4steps_lora_v1_low_noise.safetensors", WAN22_REPO,
                            "split_files/loras/wan2.2_i2v_lightx2v_4steps_lora_v1_low_noise.safetensors",
                            "about 0.6 GB", 0.6)

START_IMAGE = (
    "Start image: core Load Image, into the Sampler's image input. example.png ships with ComfyUI: upload "
    "your own picture there. It becomes the first frame: any size, the Sampler fits it to the video's width "
    "x height (its resize input: crop by default; pad or stretch). Describe the motion in the prompt; the "
    "image already says what the scene looks like.\n\n"
)
WAN_PROMPT = ("The scene comes alive: a gentle breeze moves through it, soft light shifts across the surfaces, "
              "and the camera slowly pushes in.")


def _wan22_note(card: str, size: str, blocks: int, swap_text: str, ram_gib: int) -> str:
    return (
        f"Wan 2.2 I2V A14B from Comfy-Org's fp8 single files on {card}: the start image animated into {size}, "
        "81 frames (about 5 s at 16 fps). A14B is two 14B experts: the high-noise one shapes the first steps, "
        "the low-noise one the rest; only one is on the GPU at a time. Unlike Wan 2.1 I2V, it needs no CLIP "
        "vision file (clip_vision stays (none)).\n\n"
        + START_IMAGE
        + files_text(WAN22_I2V_FILES, ("14 GB", "14 GB", "6.7 GB", "0.25 GB")) +
        "model takes the high-noise expert, model_2 the low-noise one. Storage: fp8 as in the files, upcast to "
        "bf16 per layer. weights_on_disk = on: 35 GB of files on a 32 GB machine; memory-mapped, they live in "
        "the page cache, and the expert not in use is read again from disk when its turn comes (the process's "
        f"own RAM: about {ram_gib} GiB predicted).\n\n"
        f"Memory strategy, offload = block_swap with blocks_to_swap = {blocks} (per expert, of 40): {swap_text} "
        "The text encoder goes to the GPU alone (7.4 GiB while it encodes) and leaves once the prompt is encoded "
        "(text_encoder = offload_after_encoding); the VAE encodes the start image and decodes the video in 256 px tiles.\n\n"
    )


I2V_TEMPLATES = (
    Template(
        name="wan22_i2v_a14b_fp8_8gb",
        title="Wan 2.2 I2V A14B, 8 GB, 32 GB RAM",
        pick="animate a picture with Wan 2.2 on an 8 GB card",
        note=_wan22_note(
            "an 8 GB card with 32 GB of RAM", "832x480", 38,
            "2 blocks stay on the GPU, 38 stream in each step, the next one copied while the current one "
            "computes. Predicted peak VRAM 7.4 GiB, while the text encoder encodes (the denoise 7.2 GiB), "
            "slowdown x1.03; 36 is the fewest that fit (7.9 GiB, no room left).", 3)
        + "Check your machine: vidmem plan --model wan2.2-i2v-a14b --weights fp8_scaled --disk --size 832x480 "
          "--frames 81 --vram 8 --ram 32. If the card also drives a display, set text_encoder = cpu. Every "
          "strategy gives the same frames.",
        loader=model_files(WAN22_I2V_HIGH_FP8, UMT5_FP8_22, WAN21_VAE_22, model_2=WAN22_I2V_LOW_FP8),
        strategy=strategy("block_swap", "offload_after_encoding", 38),
        prompt=WAN_PROMPT, negative_prompt=NEGATIVE,
        width=832, height=480, frames=81, steps=40, cfg=3.5, fps=16.0,
        machine=Machine(8, 32, "wan2.2-i2v-a14b", WAN22_I2V_WEIGHTS),
        files=WAN22_I2V_FILES, note_height=None, image=EXAMPLE_IMAGE,
    ),
    Template(
        name="wan22_i2v_a14b_fp8_24gb",
        title="Wan 2.2 I2V A14B, 24 GB card",
        pick="animate a picture at 720p with Wan 2.2",
        note=_wan22_note(
            "a 24 GB card with 32 GB of RAM", "1280x720 (A14B's own size)", 20,
            "20 blocks stay on the GPU, 20 stream in each step, copied while the blocks before them compute. "
            "Predicted peak VRAM 21.3 GiB, in the denoise, slowdown x1.01; 6 is the fewest that fit (23.8 "
            "GiB, no room left for the desktop).", 4)
        + "Check your machine: vidmem plan --model wan2.2-i2v-a14b --weights fp8_scaled --disk --size 1280x720 "
          "--frames 81 --vram 24 --ram 32. With 64 GB of RAM or more, weights_on_disk can stay on: the page "
          "cache then keeps both experts and nothing is read twice. Every strategy gives the same frames.",
        loader=model_files(WAN22_I2V_HIGH_FP8, UMT5_FP8_22, WAN21_VAE_22, model_2=WAN22_I2V_LOW_FP8),
        strategy=strategy("block_swap", "offload_after_encoding", 20),
        prompt=WAN_PROMPT, negative_prompt=NEGATIVE,
        width=1280, height=720, frames=81, steps=40, cfg=3.5, fps=16.0,
        machine=Machine(24, 32, "wan2.2-i2v-a14b", WAN22_I2V_WEIGHTS),
        files=WAN22_I2V_FILES, note_height=None, image=EXAMPLE_IMAGE,
    ),
    Template(
        name="wan22_i2v_a14b_lightx2v_4step",
        title="Wan 2.2 I2V A14B 4-step, 8 GB card",
        pick="animate a picture in 4 steps on an 8 GB card",
        note=(
            "Wan 2.2 I2V A14B in 4 steps with lightx2v's image-to-video distill LoRAs, one per expert, on an 8 GB "
            "card with 32 GB of RAM: the start image animated into 832x480, 81 frames (about 5 s at 16 fps).\n\n"
            + START_IMAGE
            + files_text(WAN22_I2V_FILES, ("14 GB", "14 GB", "6.7 GB", "0.25 GB"))
            + lora_text((LIGHTX2V_I2V_HIGH, LIGHTX2V_I2V_LOW))
            + DISTILL_STEPS +
            "Two Load LoRA nodes, strength 1.0 each: the high_noise LoRA on expert = high_noise, the low_noise one "
            "on expert = low_noise (the T2V LoRAs do not fit image-to-video: use these). boundary_ratio = 0 keeps "
            "the model's own 0.9: the high-noise expert runs the first 2 steps, the low-noise one the last 2. "
            "cfg_2 = -1: the low-noise expert also runs at cfg 1.\n\n"
            "Memory strategy, offload = block_swap with blocks_to_swap = 38 per expert: only one expert is on the "
            "GPU at a time, 38 of its 40 blocks streaming in; predicted peak VRAM 7.6 GiB, in the denoise, "
            "slowdown x1.16 (what is copied once per run weighs more over 4 steps); 35 is the fewest that fit "
            "(7.8 GiB). The text encoder goes to the GPU alone (7.4 GiB while it encodes) and leaves once the "
            "prompt is encoded; the VAE encodes the start image and decodes in 256 px tiles. weights_on_disk = "
            "on: the expert not in use is read again from disk at its turn (the process's own RAM: about 3 GiB).\n\n"
            "Check your machine: vidmem plan --model wan2.2-i2v-a14b --weights fp8_scaled --disk --size 832x480 "
            "--frames 81 --steps 4 --no-cfg --vram 8 --ram 32."
        ),
        loader=model_files(WAN22_I2V_HIGH_FP8, UMT5_FP8_22, WAN21_VAE_22, model_2=WAN22_I2V_LOW_FP8),
        strategy=strategy("block_swap", "offload_after_encoding", 38),
        prompt=WAN_PROMPT, negative_prompt=NEGATIVE,
        width=832, height=480, frames=81, steps=4, cfg=1.0, fps=16.0,
        machine=Machine(8, 32, "wan2.2-i2v-a14b", WAN22_I2V_WEIGHTS),
        files=WAN22_I2V_FILES, note_height=None, image=EXAMPLE_IMAGE,
        loras=(LoraStep(LIGHTX2V_I2V_HIGH, expert="high_noise"), LoraStep(LIGHTX2V_I2V_LOW, expert="low_noise")),
        sampler=dict(DISTILL_SAMPLER, cfg_2=-1.0, boundary_ratio=0.0),
    ),
    Template(
        name="wan21_i2v_14b_480p_fp8",
        title="Wan 2.1 I2V 14B, 8 GB, 32 GB RAM",
        pick="animate a picture with Wan 2.1 at 480p",
        note=(
            "Wan 2.1 I2V 14B 480p from Comfy-Org's fp8 single files on an 8 GB card with 32 GB of RAM: the start "
            "image animated into 832x480, 81 frames (about 5 s at 16 fps). Wan 2.1 I2V also reads the image "
            "through the CLIP ViT-H vision encoder (clip_vision_h), which the loader takes as clip_vision.\n\n"
            + START_IMAGE
            + files_text(WAN21_I2V_FILES, ("16 GB", "6.7 GB", "0.25 GB", "1.3 GB")) +
            "Storage: the transformer and text encoder stay fp8 as in the files (weight_dtype = default) and are "
            "upcast to bf16 one layer at a time; the CLIP encoder is computed in bf16. weights_on_disk = on: the "
            "files are memory-mapped (page cache, not the process's own RAM: about 3 GiB predicted).\n\n"
            "Memory strategy, offload = block_swap with blocks_to_swap = 40: every one of the 40 transformer "
            "blocks (0.38 GiB each in fp8, a little more than T2V's: each also attends to the image) streams to "
            "the GPU each step, the next one copied while the current one computes. Predicted peak VRAM 7.4 GiB, "
            "while the text encoder encodes (the denoise 7.3 GiB), slowdown x1.02; 38 is the fewest that fit "
            "(7.6 GiB, no room left). The text encoder goes to the GPU alone and leaves once the prompt is "
            "encoded (text_encoder = offload_after_encoding); the VAE encodes the start image and decodes the "
            "video in 256 px tiles.\n\n"
            "Check your machine: vidmem plan --model wan2.1-i2v-14b-480p --weights fp8_scaled --disk --size 832x480 "
            "--frames 81 --vram 8 --ram 32. Every strategy gives the same frames."
        ),
        loader=model_files(WAN21_I2V_480P_FP8, UMT5_FP8, WAN21_VAE, clip_vision=CLIP_VISION_H),
        strategy=strategy("block_swap", "offload_after_encoding", 40),
        prompt=WAN_PROMPT, negative_prompt=NEGATIVE,
        width=832, height=480, frames=81, steps=40, cfg=5.0, fps=16.0,
        machine=Machine(8, 32, "wan2.1-i2v-14b-480p", {"transformer": "fp8_scaled", "text_encoder": "fp8_scaled"}),
        files=WAN21_I2V_FILES, note_height=None, image=EXAMPLE_IMAGE,
    ),
    Template(
        name="wan21_flf2v_14b_720p_fp8",
        title="Wan 2.1 FLF2V 14B, 24 GB card",
        pick="a video from its first and last frame",
        note=(
            "Wan 2.1 FLF2V 14B (first-last-frame) from Comfy-Org's fp8 single files on a 24 GB card with 32 GB of "
            "RAM: a 1280x720 video of 81 frames (about 5 s at 16 fps) that starts on one picture and ends on "
            "another. FLF2V is Wan 2.1 I2V 14B trained on both ends at 720p: the CLIP ViT-H encoder reads both "
            "pictures (clip_vision_h, taken as clip_vision), the VAE encodes them as the first and last frames.\n\n"
            "Start and end: two core Load Image nodes, the upper one into the Sampler's image (the first frame), "
            "the lower one into last_image (the last frame). example.png ships with ComfyUI: upload your own "
            "pictures there. Any size: the Sampler fits both to the video's width x height (resize: crop by "
            "default). Describe the motion between them in the prompt. Without a last image this model stops "
            "with a message; for one picture use the Wan 2.1 I2V template. Wan 2.2 I2V A14B takes a last_image "
            "too.\n\n"
            + files_text(WAN21_FLF2V_FILES, ("16 GB", "6.7 GB", "0.25 GB", "1.3 GB")) +
            "Storage: the transformer stays fp8 (e4m3fn, as in the file) and the text encoder fp8 scaled, upcast "
            "to bf16 one layer at a time. weights_on_disk = on: the files are memory-mapped (page cache; the "
            "process's own RAM about 4 GiB predicted). The sampler runs at the model's own shift (16, as "
            "Wan's FLF2V).\n\n"
            "Memory strategy, offload = block_swap with blocks_to_swap = 18: 22 of the 40 blocks stay on the GPU, "
            "18 stream in each step. At 720p most of the GPU goes to activations (75,600 tokens per pass), not "
            "weights: predicted peak VRAM 22.5 GiB, in the denoise, slowdown x1.00. On a 16 GB card set "
            "blocks_to_swap = 40 and activation_chunks = auto (the Strategy's default): the feed-forward then "
            "runs in token slices. The text encoder goes to the GPU alone and leaves once the prompt is encoded; "
            "the VAE encodes both pictures and decodes the video in 256 px tiles.\n\n"
            "Check your machine: vidmem plan --model wan2.1-flf2v-14b-720p --weights fp8_e4m3fn --disk --size "
            "1280x720 --frames 81 --vram 24 --ram 32. Every strategy gives the same frames."
        ),
        loader=model_files(WAN21_FLF2V_FP8, UMT5_FP8, WAN21_VAE, clip_vision=CLIP_VISION_H),
        strategy=strategy("block_swap", "offload_after_encoding", 18),
        prompt=("The camera glides smoothly from the first view to the last, the light shifting with it, "
                "every object moving naturally into its final place."),
        negative_prompt=NEGATIVE,
        width=1280, height=720, frames=81, steps=40, cfg=5.0, fps=16.0,
        machine=Machine(24, 32, "wan2.1-flf2v-14b-720p", {"transformer": "fp8_e4m3fn", "text_encoder": "fp8_scaled"}),
        files=WAN21_FLF2V_FILES, note_height=None, image=EXAMPLE_IMAGE, last_image=EXAMPLE_IMAGE,
    ),
    Template(
        name="cogvideox_5b_i2v_fp8",
        title="CogVideoX-5b I2V, 8 GB, 16 GB RAM",
        pick="animate a picture with CogVideoX on an 8 GB card",
        note=(
            "CogVideoX-5b image to video on an 8 GB card with 16 GB of RAM, its weights stored in fp8: the start "
            "image animated into 720x480, 49 frames (about 6 s at 8 fps). CogVideoX-5b I2V runs at 720x480 and "
            "49 frames only (its positional embeddings are learned for that size).\n\n"
            + START_IMAGE +
            "Model: the diffusers folder of THUDM/CogVideoX-5b-I2V in ComfyUI/models/diffusers/CogVideoX-5b-I2V, "
            "computed in bf16 (the precision it was trained in).\n\n"
            "Storage: weight_dtype = fp8_scaled lowers the transformer's and the T5 text encoder's matrices to fp8 "
            "with a scale per tensor as they load (the VAE stays bf16) and upcasts them to bf16 one layer at a "
            "time; the files on disk are not changed.\n\n"
            "Memory strategy, offload = block_swap with blocks_to_swap = 16: of the transformer's 42 blocks, 26 "
            "stay on the GPU and 16 stream in each step. Predicted peak VRAM 7.7 GiB, in the denoise, slowdown "
            "x1.02; 14 is the fewest that fit (7.9 GiB, no room left). The T5 text encoder goes to the GPU alone "
            "and leaves once the prompt is encoded (text_encoder = offload_after_encoding). The VAE encodes the "
            "start image and decodes the video in 256 px tiles. About 12 GiB of RAM predicted.\n\n"
            "Check your machine: vidmem plan --model cogvideox-5b-i2v --weights fp8_scaled --size 720x480 "
            "--frames 49 --vram 8 --ram 16. Every strategy gives the same frames."
        ),
        loader=diffusers_folder("CogVideoX-5b-I2V", "bf16", weight_dtype="fp8_scaled"),
        strategy=strategy("block_swap", "offload_after_encoding", 16),
        prompt="The scene comes alive: leaves stir in a light wind, light flickers gently, and the camera slowly pans right.",
        negative_prompt=NEGATIVE,
        width=720, height=480, frames=49, steps=50, cfg=6.0, fps=8.0,
        machine=Machine(8, 16, "cogvideox-5b-i2v", {"transformer": "fp8_scaled", "text_encoder": "fp8_scaled"}),
        note_height=None, image=EXAMPLE_IMAGE,
    ),
)
