"""The templates on diffusers folders (Load Video Pipeline): one per model and VRAM tier.

Figures: bf16 weight bytes = parameters x 2 (parameter counts of the real configs, built on the meta
device); activations and the CUDA context come on top, so each tier keeps a reserve (3 GiB for the
small models, 6 GiB for the large ones) and the table in web/docs/VidMemMemoryStrategy.md gives the
same choices for every model and card.
"""

from __future__ import annotations

from template_types import NEGATIVE, Machine, Template, diffusers_folder, strategy

FOLDER_TEMPLATES = (
    Template(
        name="cogvideox_t2v",
        title="CogVideoX-2b, 12 GB card",
        pick="CogVideoX on a 12 GB card: the prompt encodes on the GPU",
        note=(
            "CogVideoX-2b text to video on a 12 GB card: 720x480, 49 frames (about 6 s at 8 fps).\n\n"
            "Model: the diffusers folder of THUDM/CogVideoX-2b in ComfyUI/models/diffusers/CogVideoX-2b "
            "(the dropdown lists folders by name, so this workflow finds it on any machine). "
            "fp16 is the precision CogVideoX-2b was trained in.\n\n"
            "Memory strategy, offload = model: the text encoder, the transformer and the VAE each go to the "
            "GPU only while they run, so the peak is the largest component plus its activations, not their "
            "sum. The largest is the T5-XXL text encoder (about 9.5 GB in fp16); with text_encoder = "
            "offload_after_encoding it leaves the GPU as soon as the prompt is encoded. On a card under "
            "12 GB set text_encoder = cpu (encoding then takes a while in system RAM and no VRAM).\n\n"
            "VAE tiling: decoding 720x480x49 in one piece needs about 16 GB in fp16; 256 px tiles with "
            "32 px overlap keep the decode to a few GB.\n\n"
            "Every strategy gives the same frames; they differ only in memory and speed."
        ),
        loader=diffusers_folder("CogVideoX-2b", "fp16"),
        strategy=strategy("model", "offload_after_encoding"),
        prompt="A golden retriever runs through a sunlit meadow of tall grass, slow motion, shallow depth of field.",
        negative_prompt=NEGATIVE,
        width=720, height=480, frames=49, steps=50, cfg=6.0, fps=8.0,
    ),
    Template(
        name="wan21_t2v_blockswap",
        title="Wan 2.1 1.3B, small card, block swap",
        pick="a card under 8 GB, or 8 GB that also drives a display",
        note=(
            "Wan 2.1 T2V 1.3B text to video: 832x480, 81 frames (about 5 s at 16 fps), for small cards.\n\n"
            "Model: the diffusers folder of Wan-AI/Wan2.1-T2V-1.3B-Diffusers in "
            "ComfyUI/models/diffusers/Wan2.1-T2V-1.3B-Diffusers.\n\n"
            "Memory strategy, offload = block_swap with blocks_to_swap = 20: of the transformer's 30 "
            "blocks, the first 10 stay on the GPU and the last 20 live in system RAM and stream in each "
            "step, the next one copied while the current one computes (prefetch_blocks = 1). The "
            "transformer then holds about a third of its 2.8 GB (bf16) on the GPU. The UMT5-XXL text "
            "encoder (about 11 GB in bf16) encodes on the CPU (text_encoder = cpu), so it never takes "
            "VRAM, and the VAE decodes in 256 px tiles.\n\n"
            "With 12 GB or more, offload = model and blocks_to_swap = 0 is faster. Fewer swapped blocks "
            "run faster and use more VRAM. Every strategy gives the same frames."
        ),
        loader=diffusers_folder("Wan2.1-T2V-1.3B-Diffusers", "bf16"),
        strategy=strategy("block_swap", "cpu", 20),
        prompt="A red fox trots through fresh snow in a pine forest, morning light, tracking shot.",
        negative_prompt=NEGATIVE,
        width=832, height=480, frames=81, steps=30, cfg=5.0, fps=16.0,
    ),
    # --- one template per VRAM tier (figures: see the module's docstring)
    Template(
        name="wan21_t2v_1_3b_8gb",
        title="Wan 2.1 1.3B, 8 GB card",
        pick="Wan 2.1 from a diffusers folder on an 8 GB card",
        note=(
            "Wan 2.1 T2V 1.3B on an 8 GB card: 832x480, 81 frames (about 5 s at 16 fps).\n\n"
            "Model: the diffusers folder of Wan-AI/Wan2.1-T2V-1.3B-Diffusers in "
            "ComfyUI/models/diffusers/Wan2.1-T2V-1.3B-Diffusers.\n\n"
            "Memory strategy, offload = model: the transformer (1.42 billion parameters, 2.6 GiB of bf16 "
            "weights) is on the GPU only while it samples and the VAE only while it decodes, so the "
            "weights on the card never exceed 2.6 GiB. The UMT5-XXL text encoder (5.7 billion parameters, "
            "10.6 GiB) cannot fit an 8 GB card, so text_encoder = cpu: the prompt is encoded in system RAM "
            "(no VRAM, but it takes a while and needs about 11 GiB of free RAM). The VAE decodes in 256 px "
            "tiles.\n\n"
            "These are weight sizes; activations (a few GiB at this size) and the CUDA context come on top. "
            "The Memory Strategy node shows the predicted peaks for the Sampler's size before you queue. If "
            "it still runs out of memory, the \"Wan 2.1 1.3B, small card, block swap\" "
            "template streams 20 of the 30 blocks from RAM. Every strategy gives the same frames."
        ),
        loader=diffusers_folder("Wan2.1-T2V-1.3B-Diffusers", "bf16"),
        strategy=strategy("model", "cpu"),
        prompt="A paper boat drifts down a rain-filled gutter past glowing shop windows at night, close-up.",
        negative_prompt=NEGATIVE,
        width=832, height=480, frames=81, steps=30, cfg=5.0, fps=16.0,
    ),
    Template(
        name="wan21_t2v_1_3b_12gb",
        title="Wan 2.1 1.3B, 12 GB card",
        pick="12 GB: the prompt encodes on the GPU, in seconds",
        note=(
            "Wan 2.1 T2V 1.3B on a 12 GB card: 832x480, 81 frames (about 5 s at 16 fps).\n\n"
            "Model: the diffusers folder of Wan-AI/Wan2.1-T2V-1.3B-Diffusers in "
            "ComfyUI/models/diffusers/Wan2.1-T2V-1.3B-Diffusers.\n\n"
            "Memory strategy, offload = model with text_encoder = offload_after_encoding: the UMT5-XXL text "
            "encoder (10.6 GiB of bf16 weights) goes to the GPU alone, encodes the prompt in about a second "
            "and leaves; then the transformer (2.6 GiB) samples, then the VAE decodes in 512 px tiles. "
            "10.6 GiB on a 12 GB card is tight: if the card also drives your display or ComfyUI holds "
            "other models, set text_encoder = cpu (the 8 GB template).\n\n"
            "These are weight sizes; activations and the CUDA context come on top. The Memory Strategy node "
            "shows the predicted peaks for the Sampler's size before you queue. Every strategy gives the same frames."
        ),
        loader=diffusers_folder("Wan2.1-T2V-1.3B-Diffusers", "bf16"),
        strategy=strategy("model", "offload_after_encoding", tile_size=512, overlap=128),
        prompt="A hummingbird hovers at a red flower in a sunlit garden, slow motion, macro shot.",
        negative_prompt=NEGATIVE,
        width=832, height=480, frames=81, steps=30, cfg=5.0, fps=16.0,
    ),
    Template(
        name="wan21_t2v_14b_24gb",
        title="Wan 2.1 14B, 24 GB card",
        pick="the 14B from a diffusers folder on a 24 GB card",
        note=(
            "Wan 2.1 T2V 14B on a 24 GB card: 832x480, 81 frames (about 5 s at 16 fps).\n\n"
            "Model: the diffusers folder of Wan-AI/Wan2.1-T2V-14B-Diffusers in "
            "ComfyUI/models/diffusers/Wan2.1-T2V-14B-Diffusers.\n\n"
            "Memory strategy, offload = block_swap with blocks_to_swap = 15: the transformer has 14.3 billion "
            "parameters (26.6 GiB in bf16), more than the card holds. Its 40 blocks are 0.65 GiB each; 25 "
            "stay on the GPU (16.8 GiB with the embeddings and head) and the last 15 live in system RAM and "
            "stream in every step, the next one copied while the current one computes (prefetch_blocks = 1). "
            "That leaves about 6 GiB for activations and the CUDA context. The UMT5-XXL text encoder "
            "(10.6 GiB) goes to the GPU alone to encode the prompt and leaves at once "
            "(text_encoder = offload_after_encoding); the VAE decodes in 256 px tiles.\n\n"
            "System RAM: every weight lives there between runs, about 38 GiB (transformer, text encoder, "
            "VAE), plus pinned copies of the streamed blocks; 64 GB of RAM is comfortable. At 1280x720 "
            "the activations grow about 2.3x: swap more blocks (each one frees 0.65 GiB). If you run out of "
            "memory, raise blocks_to_swap by 4 at a time. The Memory Strategy node shows the predicted peaks for the Sampler's size "
            "before you queue. Every strategy gives the same frames."
        ),
        loader=diffusers_folder("Wan2.1-T2V-14B-Diffusers", "bf16"),
        strategy=strategy("block_swap", "offload_after_encoding", 15),
        prompt="A lighthouse on a rocky cliff at dusk, waves crashing below, its beam sweeping through sea mist, aerial shot.",
        negative_prompt=NEGATIVE,
        width=832, height=480, frames=81, steps=40, cfg=5.0, fps=16.0,
    ),
    Template(
        name="cogvideox_2b_t2v_8gb",
        title="CogVideoX-2b, 8 GB card",
        pick="CogVideoX on an 8 GB card",
        note=(
            "CogVideoX-2b on an 8 GB card: 720x480, 49 frames (about 6 s at 8 fps).\n\n"
            "Model: the diffusers folder of THUDM/CogVideoX-2b in ComfyUI/models/diffusers/CogVideoX-2b; "
            "fp16, the precision CogVideoX-2b was trained in.\n\n"
            "Memory strategy, offload = model: the transformer (1.69 billion parameters, 3.2 GiB in fp16) is "
            "on the GPU only while it samples, the VAE only while it decodes (256 px tiles). The T5-XXL text "
            "encoder (4.8 billion parameters, 8.9 GiB) does not fit an 8 GB card, so text_encoder = cpu: "
            "the prompt is encoded in system RAM (slow, no VRAM). With 12 GB or more, the \"CogVideoX-2b, 12 GB card\" "
            "template encodes on the GPU instead.\n\n"
            "These are weight sizes; activations and the CUDA context come on top. The Memory Strategy node "
            "shows the predicted peaks for the Sampler's size before you queue. Every strategy gives the same frames."
        ),
        loader=diffusers_folder("CogVideoX-2b", "fp16"),
        strategy=strategy("model", "cpu"),
        prompt="A steaming cup of coffee on a wooden table by a window, rain on the glass, soft morning light.",
        negative_prompt=NEGATIVE,
        width=720, height=480, frames=49, steps=50, cfg=6.0, fps=8.0,
    ),
    Template(
        name="wan22_ti2v_5b_12gb",
        title="Wan 2.2 TI2V-5B, 12 GB card",
        pick="1280x704 at 24 fps from the 5B on a 12 GB card",
        note=(
            "Wan 2.2 TI2V-5B on a 12 GB card, text to video: 1280x704, 121 frames (about 5 s at 24 fps). "
            "Width and height must be multiples of 32 for this model and frames 4k+1.\n\n"
            "Model: the diffusers folder of Wan-AI/Wan2.2-TI2V-5B-Diffusers in "
            "ComfyUI/models/diffusers/Wan2.2-TI2V-5B-Diffusers.\n\n"
            "Memory strategy, offload = block_swap with blocks_to_swap = 22: the transformer has 5.0 billion "
            "parameters (9.3 GiB in bf16) in 30 blocks of 0.31 GiB; 8 stay on the GPU and 22 stream in from "
            "system RAM every step. At this size (1280x704x121 with CFG) the activations are the larger part: "
            "the planner predicts the denoise 11.4 GiB with 22 blocks streamed, slowdown x1.01; 18 is the "
            "fewest that fit (11.96 GiB, no room left). The UMT5-XXL text encoder (10.6 GiB in bf16) goes "
            "to the GPU alone to encode the prompt, then leaves (text_encoder = offload_after_encoding, 11.2 "
            "GiB while it encodes; set it to cpu if the card also drives a display). Its VAE compresses 16x "
            "and decodes 1280x704x121 in 256 px tiles. About 27 GiB of RAM at the peak, so 32 GB of system "
            "RAM.\n\n"
            "Check your machine: vidmem plan --model wan2.2-ti2v-5b --size 1280x704 --frames 121 --vram 12 "
            "--ram 32. The Memory Strategy node shows the predicted peaks for the Sampler's size "
            "before you queue. Every strategy gives the same frames."
        ),
        loader=diffusers_folder("Wan2.2-TI2V-5B-Diffusers", "bf16"),
        strategy=strategy("block_swap", "offload_after_encoding", 22),
        prompt="A street musician plays violin under a bridge at golden hour, pigeons taking off around him, cinematic.",
        negative_prompt=NEGATIVE,
        width=1280, height=704, frames=121, steps=50, cfg=5.0, fps=24.0,
        machine=Machine(12, 32, "wan2.2-ti2v-5b", {"transformer": "bf16", "text_encoder": "bf16"}),
    ),
    Template(
        name="cogvideox_5b_fp8",
        title="CogVideoX-5b fp8, 8 GB, 16 GB RAM",
        pick="CogVideoX-5b on 8 GB, weights in fp8",
        note=(
            "CogVideoX-5b text to video on an 8 GB card with 16 GB of RAM, its weights stored in fp8: 720x480, "
            "49 frames (about 6 s at 8 fps).\n\n"
            "Model: the diffusers folder of THUDM/CogVideoX-5b in ComfyUI/models/diffusers/CogVideoX-5b, computed "
            "in bf16 (the precision CogVideoX-5b was trained in).\n\n"
            "Storage: weight_dtype = fp8_scaled lowers the transformer's and the T5 text encoder's matrices to fp8 "
            "with a scale per tensor as they load (the VAE stays bf16) and upcasts them to bf16 one layer at a "
            "time: half the RAM and half of every copy to the GPU, at a small error against bf16 (the frames are "
            "those of a bf16 model holding the dequantized weights). Lowering happens at every load; the files "
            "on disk are not changed.\n\n"
            "Memory strategy, offload = block_swap with blocks_to_swap = 16: of the transformer's 42 blocks "
            "(0.12 GiB each in fp8), 26 stay on the GPU and 16 stream in each step. Predicted peak VRAM 7.5 GiB, "
            "in the denoise; 13 is the fewest that fit (7.9 GiB, no room left), 16 keeps some room. The T5 text encoder (4.5 GiB in fp8) "
            "goes to the GPU alone and leaves once the prompt is encoded (text_encoder = offload_after_encoding); "
            "in bf16 it would not fit 8 GB next to nothing else. The VAE decodes in 256 px tiles.\n\n"
            "Check your machine: vidmem plan --model cogvideox-5b --weights fp8_scaled --size 720x480 --frames 49 "
            "--vram 8 --ram 16. Every strategy gives the same frames."
        ),
        loader=diffusers_folder("CogVideoX-5b", "bf16", weight_dtype="fp8_scaled"),
        strategy=strategy("block_swap", "offload_after_encoding", 16),
        prompt="A golden retriever runs through a sunlit meadow of tall grass, slow motion, shallow depth of field.",
        negative_prompt=NEGATIVE,
        width=720, height=480, frames=49, steps=50, cfg=6.0, fps=8.0,
        machine=Machine(8, 16, "cogvideox-5b", {"transformer": "fp8_scaled", "text_encoder": "fp8_scaled"}),
        note_height=270,
    ),
)
