"""The "train a LoRA, then sample with it" templates: Prepare Training Data -> Train LoRA -> Video Sampler.

One queue encodes the clips (cached: a second queue reuses them), trains the LoRA under the
Memory Strategy, writes it to models/loras and samples with it at once (Train LoRA's pipeline
output carries it at strength 1). The figures in the notes are the planner's
(`vidmem plan --train --rank 16 ...`, model offload, gradient checkpointing, AdamW).
"""

from __future__ import annotations

from template_types import NEGATIVE, Template, Training, diffusers_folder, strategy

CLIPS_FOLDER = "/path/to/your/clips"  # a placeholder: Prepare Training Data needs the full path of the user's folder
TRAIN = dict(rank=16, alpha=16.0, learning_rate=1e-4, steps=500, batch_size=1, seed=0,
             target_modules="to_q,to_k,to_v,to_out.0", gradient_checkpointing=True, optimizer="adamw",
             checkpoint_every=100, resume=True, expert="both")
MODEL_OFFLOAD = strategy("model", "offload_after_encoding")


def howto(lora_name: str, buckets: str, frames_rule: str) -> str:
    """The note's part every train template shares: the data, the run, what to do next."""
    return (
        "1. Your clips: a folder of short videos (.mp4 .mov .webm ...) and/or images, each with a caption of the "
        "same name (clip01.mp4 + clip01.txt, one sentence describing the clip, the style or subject in the same "
        "words every time). 10-50 clips is a usual start. Put the folder's FULL path in Prepare Training "
        "Data's folder (it holds a placeholder: the run stops on it, saying so).\n"
        f"2. Buckets: {buckets} Each clip is scaled to cover the nearest bucket and centre-cropped; {frames_rule}\n"
        "3. Queue once: the clips are encoded (cached in output/vidmem_training: a second queue reuses them), the "
        "text encoder and VAE are unloaded, the LoRA trains (the node shows step and loss), is written to "
        f"models/loras/{lora_name}.safetensors, and the Sampler samples with it right away. Write the prompt "
        "in the words of your captions.\n"
        "4. Cancel saves a checkpoint; queue again with resume on to go on, or raise steps to train longer. "
        "Next time, load the file with Load LoRA (VidMem) instead of training again: bypass the two training "
        "nodes (Ctrl+B) and connect the loader to a Load LoRA node.\n\n"
        "Train LoRA: rank 16, alpha 16 (scale 1), learning_rate 1e-4, 500 steps, batch 1, attention layers "
        "only (to_q, to_k, to_v, to_out.0, as CogVideoX-Factory trains), gradient_checkpointing on (about a "
        "third of the activation memory for about 1.4x the step time, the same LoRA), AdamW with fp32 states; "
        "adamw_8bit needs bitsandbytes. A checkpoint every 100 steps.\n\n"
    )


TRAIN_TEMPLATES = (
    Template(
        name="wan21_1_3b_train_lora",
        title="Train Wan 2.1 1.3B LoRA, 12 GB card",
        pick="a LoRA of your clips for Wan 2.1 1.3B",
        note=(
            "Train a LoRA for Wan 2.1 T2V 1.3B on your clips, then sample with it, on a 12 GB card.\n\n"
            "Model: the diffusers folder of Wan-AI/Wan2.1-T2V-1.3B-Diffusers in "
            "ComfyUI/models/diffusers/Wan2.1-T2V-1.3B-Diffusers, bf16.\n\n"
            + howto("wan21_1_3b_my_lora", "832x480 and 480x832, 33 frames (about 2 s at 16 fps).",
                    "Wan takes 4k+1 frames, a video uses its first 33.") +
            "Memory strategy, offload = model: while training only the transformer is on the GPU (2.65 GiB "
            "bf16) with the LoRA, its gradients and AdamW states (0.18 GiB) and the activations of one "
            "832x480x33 sample with checkpointing (4.4 GiB): predicted peak 7.8 GiB (vidmem plan --model "
            "wan2.1-t2v-1.3b --train --rank 16 --size 832x480 --frames 33 --vram 12). On an 8 GB card use "
            "offload = sequential (4.0 GiB, slower) or smaller buckets. The text encoder (10.6 GiB) goes to the "
            "GPU alone to encode the captions and the prompt, then leaves (on a card that also drives a "
            "display, set text_encoder = cpu). Sampling: 832x480, 81 frames, 30 steps, cfg 5."
        ),
        loader=diffusers_folder("Wan2.1-T2V-1.3B-Diffusers", "bf16"),
        strategy=MODEL_OFFLOAD,
        prompt="A paper boat drifts down a rain-filled gutter past glowing shop windows at night, close-up.",
        negative_prompt=NEGATIVE,
        width=832, height=480, frames=81, steps=30, cfg=5.0, fps=16.0, note_height=None,
        training=Training(CLIPS_FOLDER, "832x480, 480x832", "33", dict(TRAIN, lora_name="wan21_1_3b_my_lora")),
    ),
    Template(
        name="cogvideox_2b_train_lora",
        title="Train CogVideoX-2b LoRA, 12 GB card",
        pick="a LoRA of your clips for CogVideoX-2b",
        note=(
            "Train a LoRA for CogVideoX-2b on your clips, then sample with it, on a 12 GB card, as "
            "CogVideoX-Factory trains it (v-prediction, attention layers) but inside ComfyUI.\n\n"
            "Model: the diffusers folder of THUDM/CogVideoX-2b in ComfyUI/models/diffusers/CogVideoX-2b, fp16.\n\n"
            + howto("cogvideox_2b_my_lora", "720x480 (CogVideoX-2b's only size), 49 frames (about 6 s at 8 fps).",
                    "CogVideoX takes 8k+1 frames, a video uses its first 49.") +
            "Memory strategy, offload = model: while training only the transformer is on the GPU (3.4 GiB fp16) "
            "with the LoRA, gradients and states (0.11 GiB) and one sample's activations with checkpointing "
            "(5.7 GiB): predicted peak 9.7 GiB (vidmem plan --model cogvideox-2b --train --rank 16 --size "
            "720x480 --frames 49 --vram 12). On an 8 GB card use offload = sequential (4.7 GiB, slower). The T5 text "
            "encoder (8.9 GiB) goes to the GPU alone to encode the captions and the prompt, then leaves. "
            "Sampling: 720x480, 49 frames, 50 steps, cfg 6. Later runs: the \"CogVideoX-2b LoRA, 12 GB card\" "
            "template loads a LoRA by name."
        ),
        loader=diffusers_folder("CogVideoX-2b", "fp16"),
        strategy=MODEL_OFFLOAD,
        prompt="A steaming cup of coffee on a wooden table by a window, rain on the glass, soft morning light.",
        negative_prompt=NEGATIVE,
        width=720, height=480, frames=49, steps=50, cfg=6.0, fps=8.0, note_height=None,
        training=Training(CLIPS_FOLDER, "720x480", "49", dict(TRAIN, lora_name="cogvideox_2b_my_lora")),
    ),
    Template(
        name="wan22_ti2v_5b_train_lora",
        title="Train Wan 2.2 5B LoRA, 16 GB card",
        pick="a LoRA of your clips for Wan 2.2 5B",
        note=(
            "Train a LoRA for Wan 2.2 TI2V-5B on your clips, then sample with it, on a 16 GB card.\n\n"
            "Model: the diffusers folder of Wan-AI/Wan2.2-TI2V-5B-Diffusers in "
            "ComfyUI/models/diffusers/Wan2.2-TI2V-5B-Diffusers, bf16.\n\n"
            + howto("wan22_5b_my_lora", "832x480 and 480x832 (multiples of 32 for this model), 33 frames.",
                    "Wan takes 4k+1 frames, a video uses its first 33. Training at 480p is cheaper; the LoRA "
                    "samples at 1280x704 too.") +
            "Memory strategy, offload = model: while training only the transformer is on the GPU (9.3 GiB bf16) "
            "with the LoRA, gradients and states (0.35 GiB) and one sample's activations with checkpointing "
            "(2.2 GiB): predicted peak 12.4 GiB (vidmem plan --model wan2.2-ti2v-5b --train --rank 16 --size "
            "832x480 --frames 33 --vram 16). On a 12 GB card use offload = sequential (2.6 GiB, slower). The "
            "text encoder (10.6 GiB) goes to the GPU alone and leaves. Sampling: 1280x704, 121 frames, 50 "
            "steps, cfg 5 (the same strategy: the transformer alone fits 16 GB)."
        ),
        loader=diffusers_folder("Wan2.2-TI2V-5B-Diffusers", "bf16"),
        strategy=MODEL_OFFLOAD,
        prompt="A street musician plays violin under a bridge at golden hour, pigeons taking off around him, cinematic.",
        negative_prompt=NEGATIVE,
        width=1280, height=704, frames=121, steps=50, cfg=5.0, fps=24.0, note_height=None,
        training=Training(CLIPS_FOLDER, "832x480, 480x832", "33", dict(TRAIN, lora_name="wan22_5b_my_lora")),
    ),
)
