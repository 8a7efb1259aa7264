"""The templates of HunyuanVideo 1.5 and LTX-2 (issue 27): text to video from diffusers folders
(Load Video Pipeline), one for an 8 GB card and one for a 24 GB card per family.

Both families load from diffusers folders only (no Comfy-Org single files yet), so the weights live
in RAM: the 8 GB templates lower them to fp8 at load (weight_dtype = fp8_scaled) to halve that RAM
and every copy to the GPU. Each names the machine it is sized for; tests/test_workflows.py plans it
there with its own widgets and fails if it does not fit. The figures in the notes are that plan's.

Steps, guidance and shot as the model authors publish them:
- HunyuanVideo 1.5: 50 steps at guidance 6 (diffusers' HunyuanVideo15Pipeline example and
  __call__ default of 50 steps; scripts/convert_hunyuan_video1_5_to_diffusers.py's guider
  ClassifierFreeGuidance(guidance_scale=6.0)); 121 frames, the pipeline's default num_frames.
  Frames 4k+1 (the VAE's temporal factor 4), width and height multiples of 16.
- LTX-2: LTX2Pipeline.__call__'s defaults in diffusers 0.42.1: 768x512, 121 frames at frame_rate
  24, 30 steps, guidance_scale 3.0 (its docstring example uses the same). Frames 8k+1 (temporal
  factor 8), width and height multiples of 32. Video only: the audio parts are not loaded, except in
  "LTX-2 with sound", where Decode Audio (VidMem) loads the audio VAE and vocoder for its own run and
  feeds core Create Video's audio input.
"""

from __future__ import annotations

from template_types import NEGATIVE, Machine, Template, diffusers_folder, strategy

FP8 = {"transformer": "fp8_scaled", "text_encoder": "fp8_scaled"}
BF16 = {"transformer": "bf16", "text_encoder": "bf16"}
LTX2_NEGATIVE = "worst quality, inconsistent motion, blurry, jittery, distorted"  # LTX2Pipeline's docstring example
# What vidmem runs differently from LTX2Pipeline's defaults (pipelines/ltx2.py VIDEO_ONLY_GUIDANCE), and
# how its VAE decodes in time (docs/decode.md): said in every LTX-2 template.
LTX2_GUIDANCE = (
    "Guidance differs from LTX2Pipeline's defaults: the one cfg guides video and sound alike (LTX2Pipeline: "
    "audio cfg 7), and its spatio-temporal (stg 1, block 28) and modality-isolation (3) passes are off, as each "
    "costs another transformer pass per step that the planner does not count; so the frames are not "
    "LTX2Pipeline's default output for the same seed. ")
LTX2_CHUNKS = (
    "The VAE decodes in 64-frame chunks blended over 8 frames; LTX-2's decoder is not causal, so frames near "
    "a chunk boundary differ slightly from a whole decode (temporal_size 121 or more decodes exactly, for more "
    "VRAM: check with vidmem plan; docs/decode.md).")

FAMILY_TEMPLATES = (
    Template(
        name="hunyuan15_t2v_480p_fp8",
        title="HunyuanVideo 1.5 480p, 8 GB card",
        pick="HunyuanVideo 1.5 at 480p, weights in fp8",
        note=(
            "HunyuanVideo 1.5 text to video on an 8 GB card with 32 GB of RAM: 848x480, 121 frames (about 5 s "
            "at 24 fps). Frames must be 4k+1, width and height multiples of 16.\n\n"
            "Model: the diffusers folder of hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v in "
            "ComfyUI/models/diffusers/HunyuanVideo-1.5-Diffusers-480p_t2v, computed in bf16.\n\n"
            "Storage: weight_dtype = fp8_scaled lowers the 8.3B transformer's and the Qwen2.5-VL text encoder's "
            "matrices to fp8 with a scale per tensor as they load, and upcasts them one layer at a time: half "
            "the RAM and half of every copy to the GPU, at a small error against bf16.\n\n"
            "Memory strategy, offload = sequential: every layer streams to the GPU as it runs, the next one "
            "copied while the current one computes; at 848x480x121 a layer computes longer than it copies, so "
            "the planner predicts x1.02 the time of a resident run. The text encoder streams the same way "
            "(text_encoder = offload_after_encoding). The VAE decodes in 256 px tiles, a latent frame at a time "
            "(2.2 GiB while it decodes, below the denoise's peak). Predicted: 5.6 GiB VRAM at the peak (the denoise), 21 GiB of RAM.\n\n"
            "Check your machine: vidmem plan --model hunyuanvideo1.5-t2v-480p --weights fp8_scaled --size "
            "848x480 --frames 121 --vram 8 --ram 32. 50 steps at cfg 6, as the authors run it. "
            "Every strategy gives the same frames."
        ),
        loader=diffusers_folder("HunyuanVideo-1.5-Diffusers-480p_t2v", "bf16", weight_dtype="fp8_scaled"),
        strategy=strategy("sequential", "offload_after_encoding"),
        prompt="A cat walks on the grass in a sunlit garden, realistic, tracking shot.",
        negative_prompt=NEGATIVE,
        width=848, height=480, frames=121, steps=50, cfg=6.0, fps=24.0,
        machine=Machine(8, 32, "hunyuanvideo1.5-t2v-480p", FP8),
        note_height=270,
    ),
    Template(
        name="hunyuan15_t2v_720p",
        title="HunyuanVideo 1.5 720p, 24 GB card",
        pick="HunyuanVideo 1.5 at 720p in bf16, 64 GB of RAM",
        note=(
            "HunyuanVideo 1.5 text to video on a 24 GB card with 64 GB of RAM: 1280x720, 121 frames (about 5 s "
            "at 24 fps). Frames must be 4k+1, width and height multiples of 16.\n\n"
            "Model: the diffusers folder of hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-720p_t2v in "
            "ComfyUI/models/diffusers/HunyuanVideo-1.5-Diffusers-720p_t2v, in bf16 as published.\n\n"
            "Memory strategy, offload = block_swap with blocks_to_swap = 12: of the transformer's 54 blocks, "
            "42 stay on the GPU and the last 12 stream in from system RAM every step, the next one copied "
            "while the current one computes (prefetch_blocks = 1). At 720p a block computes far longer than it "
            "copies, so the planner predicts no slowdown. The Qwen2.5-VL text encoder goes to the GPU alone "
            "and leaves once the prompt is encoded (text_encoder = offload_after_encoding); the VAE decodes "
            "in 256 px tiles. Predicted: 22.3 GiB VRAM at the peak (the denoise), 37 GiB of RAM.\n\n"
            "Check your machine: vidmem plan --model hunyuanvideo1.5-t2v-720p --size 1280x720 --frames 121 "
            "--vram 24 --ram 64. If you run out of memory, raise blocks_to_swap by 4 at a time. 50 steps at "
            "cfg 6, as the authors run it. Every strategy gives the same frames."
        ),
        loader=diffusers_folder("HunyuanVideo-1.5-Diffusers-720p_t2v", "bf16"),
        strategy=strategy("block_swap", "offload_after_encoding", 12),
        prompt="A lighthouse on a rocky cliff at dusk, waves crashing below, its beam sweeping through sea mist, aerial shot.",
        negative_prompt=NEGATIVE,
        width=1280, height=720, frames=121, steps=50, cfg=6.0, fps=24.0,
        machine=Machine(24, 64, "hunyuanvideo1.5-t2v-720p", BF16),
    ),
    Template(
        name="ltx2_t2v_fp8_sequential",
        title="LTX-2 fp8, 8 GB, 48 GB RAM",
        pick="the 19B LTX-2 on an 8 GB card, video only",
        note=(
            "LTX-2 text to video on an 8 GB card with 48 GB of RAM: 768x512, 121 frames (about 5 s at 24 fps), "
            "video only (no audio). Frames must be 8k+1, width and height multiples of 32.\n\n"
            "Model: the diffusers folder of Lightricks/LTX-2 in ComfyUI/models/diffusers/LTX-2, computed in "
            "bf16; its audio VAE and vocoder are never loaded.\n\n"
            "Storage: weight_dtype = fp8_scaled lowers the 19B transformer's and the Gemma 3 12B text "
            "encoder's matrices to fp8 with a scale per tensor as they load, and upcasts them one layer at a "
            "time: in bf16 the planner predicts 66 GiB of RAM.\n\n"
            "Memory strategy, offload = sequential: every layer streams to the GPU as it runs, the next one "
            "copied while the current one computes; the text encoder streams the same way (text_encoder = "
            "offload_after_encoding). The planner predicts 7.0 GiB VRAM at the peak (the denoise), 38 GiB of "
            "RAM, and x1.14 the time of a resident run (the fp8 upcast and the copies). The VAE decodes in "
            "512 px tiles: vidmem raises the strategy's default 256 px tiles for LTX-2's 32x VAE (2.2 GiB while it decodes). "
            + LTX2_CHUNKS + "\n\n"
            "Check your machine: vidmem plan --model ltx2-t2v-19b --weights fp8_scaled --size 768x512 --frames "
            "121 --vram 8 --ram 48. 30 steps at cfg 3: LTX2Pipeline's defaults. " + LTX2_GUIDANCE +
            "Every strategy gives the same frames."
        ),
        loader=diffusers_folder("LTX-2", "bf16", weight_dtype="fp8_scaled"),
        strategy=strategy("sequential", "offload_after_encoding"),
        prompt="A jazz pianist's hands glide over the keys in a dim club, warm stage light, slow push-in, close-up.",
        negative_prompt=LTX2_NEGATIVE,
        width=768, height=512, frames=121, steps=30, cfg=3.0, fps=24.0,
        machine=Machine(8, 48, "ltx2-t2v-19b", FP8),
        note_height=None,
    ),
    Template(
        name="ltx2_t2v_fp8_blockswap",
        title="LTX-2 fp8, 24 GB, 64 GB RAM",
        pick="LTX-2 on a 24 GB card: 36 of 48 blocks resident",
        note=(
            "LTX-2 text to video on a 24 GB card with 64 GB of RAM: 768x512, 121 frames (about 5 s at 24 fps), "
            "video only (no audio). Frames must be 8k+1, width and height multiples of 32.\n\n"
            "Model: the diffusers folder of Lightricks/LTX-2 in ComfyUI/models/diffusers/LTX-2, computed in "
            "bf16, the transformer and the Gemma 3 12B text encoder stored in fp8 (weight_dtype = "
            "fp8_scaled, lowered at load): in bf16 the planner predicts 66 GiB of RAM.\n\n"
            "Memory strategy, offload = block_swap with blocks_to_swap = 12: of the transformer's 48 blocks, "
            "36 stay on the GPU and the last 12 stream in from system RAM every step, the next one copied "
            "while the current one computes (prefetch_blocks = 1). The text encoder goes to the GPU alone "
            "and leaves once the prompt is encoded (text_encoder = offload_after_encoding); the VAE decodes "
            "in 512 px tiles (the default 256, raised for LTX-2's 32x VAE). Predicted: 19.2 GiB VRAM at the peak "
            "(the denoise), 38 GiB of RAM (8 blocks swapped: 20.8 GiB, little room left). "
            + LTX2_CHUNKS + "\n\n"
            "Check your machine: vidmem plan --model ltx2-t2v-19b --weights fp8_scaled --size 768x512 --frames "
            "121 --vram 24 --ram 64. 30 steps at cfg 3: LTX2Pipeline's defaults. " + LTX2_GUIDANCE +
            "Every strategy gives the same frames."
        ),
        loader=diffusers_folder("LTX-2", "bf16", weight_dtype="fp8_scaled"),
        strategy=strategy("block_swap", "offload_after_encoding", 12),
        prompt="A red fox trots through fresh snow in a pine forest at sunrise, breath steaming, tracking shot.",
        negative_prompt=LTX2_NEGATIVE,
        width=768, height=512, frames=121, steps=30, cfg=3.0, fps=24.0,
        machine=Machine(24, 64, "ltx2-t2v-19b", FP8),
        note_height=None,
    ),
    Template(
        name="ltx2_t2v_fp8_sound",
        title="LTX-2 with sound, 8 GB, 48 GB RAM",
        pick="LTX-2 video and its sound as one MP4",
        note=(
            "LTX-2 text to video with sound on an 8 GB card with 48 GB of RAM: 768x512, 121 frames (about 5 s at "
            "24 fps) and the sound LTX-2 makes with them, saved together by core Create Video and Save Video. "
            "Frames must be 8k+1, width and height multiples of 32.\n\n"
            "Model: the diffusers folder of Lightricks/LTX-2 in ComfyUI/models/diffusers/LTX-2, computed in "
            "bf16, the transformer and the Gemma 3 12B text encoder stored in fp8 (weight_dtype = fp8_scaled). "
            "The folder must hold audio_vae/ and vocoder/ with their weights.\n\n"
            "Sound: the transformer denoises audio with the video, so the Sampler's LATENT carries the audio "
            "latents; Decode Audio (VidMem) loads the audio VAE and the vocoder for its own run only, decodes "
            "the waveform (at the vocoder's rate) and frees them. Without that node nothing of them is loaded, "
            "and the frames are the same with or without it.\n\n"
            "Memory strategy, offload = sequential, as in \"LTX-2 fp8, 8 GB, 48 GB RAM\": 7.0 GiB VRAM at the "
            "peak (the denoise), 38 GiB of RAM; the audio parts are small beside it. The VAE decodes in 512 px "
            "tiles (the default 256, raised for LTX-2's 32x VAE). " + LTX2_CHUNKS + "\n\n"
            "Check your machine: vidmem plan --model ltx2-t2v-19b --weights fp8_scaled --size 768x512 --frames "
            "121 --vram 8 --ram 48. 30 steps at cfg 3: LTX2Pipeline's defaults. " + LTX2_GUIDANCE +
            "Create Video's fps must stay 24."
        ),
        loader=diffusers_folder("LTX-2", "bf16", weight_dtype="fp8_scaled"),
        strategy=strategy("sequential", "offload_after_encoding"),
        prompt="A street drummer plays a fast beat on upturned buckets, crowd cheering, handheld close-up.",
        negative_prompt=LTX2_NEGATIVE,
        width=768, height=512, frames=121, steps=30, cfg=3.0, fps=24.0,
        machine=Machine(8, 48, "ltx2-t2v-19b", FP8),
        note_height=None,
        audio=True,
    ),
)
