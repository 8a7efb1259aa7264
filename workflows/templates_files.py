"""The templates on ComfyUI's own single files (Load Video Model Files): Comfy-Org's repackaged
Wan files, fp8 where Comfy-Org ships fp8, weights memory-mapped from the files.

Each names the machine it is sized for; tests/test_workflows.py plans every one of them with the
planner at its full size on that machine (fp8 files as fp8_scaled storage, weights on disk) and
checks that the template's own strategy fits. The figures in the notes are that plan's
(`vidmem plan ... --disk`, bf16 compute). CogVideoX has no Comfy-Org single files: its templates
stay on diffusers folders.
"""

from __future__ import annotations

from template_types import (
    NEGATIVE, WAN21_REPO, WAN22_REPO, Machine, ModelFile, Template, model_files, strategy,
)

UMT5_FP8 = ModelFile("umt5_xxl_fp8_e4m3fn_scaled.safetensors", WAN21_REPO, "text_encoders", 6.7)
WAN21_VAE = ModelFile("wan_2.1_vae.safetensors", WAN21_REPO, "vae", 0.25)
WAN21_14B_FP8 = ModelFile("wan2.1_t2v_14B_fp8_scaled.safetensors", WAN21_REPO, "diffusion_models", 14.3)
WAN21_1_3B = ModelFile("wan2.1_t2v_1.3B_bf16.safetensors", WAN21_REPO, "diffusion_models", 2.8)
# Wan 2.2's repository carries the same text encoder and VAE files: one download place for A14B.
WAN22_HIGH_FP8 = ModelFile("wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors", WAN22_REPO, "diffusion_models", 14.3)
WAN22_LOW_FP8 = ModelFile("wan2.2_t2v_low_noise_14B_fp8_scaled.safetensors", WAN22_REPO, "diffusion_models", 14.3)
UMT5_FP8_22 = ModelFile(UMT5_FP8.name, WAN22_REPO, "text_encoders", UMT5_FP8.size_gb)
WAN21_VAE_22 = ModelFile(WAN21_VAE.name, WAN22_REPO, "vae", WAN21_VAE.size_gb)



def files_text(files: tuple[ModelFile, ...], sizes: tuple[str, ...]) -> str:
    """The note's paragraph on the files: where each comes from and where it goes."""
    repos = sorted({f.repo for f in files})
    lines = [f"- models/{f.folder}/{f.name} ({size})" for f, size in zip(files, sizes)]
    return (f"Files, from {' and '.join(repos)} on Hugging Face (split_files/<folder>/<file>), each into "
            "ComfyUI/models/<folder>/:\n" + "\n".join(lines) + "\nNo diffusers folder is needed: the loader "
            "recognises each file from its tensors.\n\n")


WAN21_14B_FILES = (WAN21_14B_FP8, UMT5_FP8, WAN21_VAE)
WAN22_A14B_FILES = (WAN22_HIGH_FP8, WAN22_LOW_FP8, UMT5_FP8_22, WAN21_VAE_22)
WAN21_1_3B_FILES = (WAN21_1_3B, UMT5_FP8, WAN21_VAE)

FILE_TEMPLATES = (
    Template(
        name="wan21_t2v_14b_fp8_files",
        title="Wan 2.1 14B fp8, 8 GB, 32 GB RAM",
        pick="Wan 2.1 14B quality on an 8 GB card",
        note=(
            "Wan 2.1 T2V 14B from Comfy-Org's fp8 single files on an 8 GB card with 32 GB of RAM: 832x480, "
            "81 frames (about 5 s at 16 fps).\n\n"
            + files_text(WAN21_14B_FILES, ("14 GB", "6.7 GB", "0.25 GB")) +
            "Storage: the weights stay fp8 as in the files (weight_dtype = default) and are upcast to bf16 one "
            "layer at a time. weights_on_disk = on: the files are memory-mapped, so their 21 GB sit in the page "
            "cache, which the system can reclaim, not in the process's own RAM (about 3 GiB of RAM predicted).\n\n"
            "Memory strategy, offload = block_swap with blocks_to_swap = 37: 37 of the 40 transformer blocks "
            "(0.33 GiB each in fp8) stream to the GPU each step, the next one copied while the current one "
            "computes; at this size a block computes longer than it copies, so the copies cost no time (the "
            "planner's x1.02 is widening the fp8 weights each pass). Predicted peak VRAM 7.7 GiB, in the denoise; 37 is the "
            "fewest that fit (7.7 GiB; with 36 blocks swapped: 9.3 GiB), and more is not lower here (40 blocks swapped: 8.0 GiB, "
            "one more staging buffer). The text encoder goes to the GPU alone (7.4 GiB while it encodes) and leaves once the "
            "prompt is encoded (text_encoder = offload_after_encoding); a repeated prompt comes from the prompt cache. "
            "The VAE decodes in 256 px tiles (1.7 GiB while it decodes).\n\n"
            "Check your machine: vidmem plan --model wan2.1-t2v-14b --weights fp8_scaled --disk --size 832x480 "
            "--frames 81 --vram 8 --ram 32. If the card also drives a display, set text_encoder = cpu or "
            "fewer frames. Every strategy gives the same frames."
        ),
        loader=model_files(*WAN21_14B_FILES),
        strategy=strategy("block_swap", "offload_after_encoding", 37),
        prompt="A lighthouse on a rocky cliff at dusk, waves crashing below, its beam sweeping through sea mist, aerial shot.",
        negative_prompt=NEGATIVE,
        width=832, height=480, frames=81, steps=40, cfg=5.0, fps=16.0,
        machine=Machine(8, 32, "wan2.1-t2v-14b", {"transformer": "fp8_scaled", "text_encoder": "fp8_scaled"}),
        files=WAN21_14B_FILES, note_height=280,
    ),
    Template(
        name="wan22_t2v_a14b_fp8_files",
        title="Wan 2.2 A14B fp8, 12 GB, 32 GB RAM",
        pick="Wan 2.2's two 14B experts on a 12 GB card",
        note=(
            "Wan 2.2 T2V A14B from Comfy-Org's fp8 single files on a 12 GB card with 32 GB of RAM: 832x480, "
            "81 frames (about 5 s at 16 fps). A14B is two 14B experts: the high-noise one shapes the first "
            "steps, the low-noise one the rest; only one is on the GPU at a time.\n\n"
            + files_text(WAN22_A14B_FILES, ("14 GB", "14 GB", "6.7 GB", "0.25 GB")) +
            "model takes the high-noise expert, model_2 the low-noise one. Storage: fp8 as in the files, "
            "upcast to bf16 per layer. weights_on_disk = on: 35 GB of files on a 32 GB machine; memory-mapped, "
            "they live in the page cache, and the expert not in use is read again from disk when its turn "
            "comes, instead of the machine running out of RAM (the process's own RAM: about 3 GiB "
            "predicted).\n\n"
            "Memory strategy, offload = block_swap with blocks_to_swap = 34 (per expert, of 40): 6 blocks stay "
            "on the GPU, 34 stream in each step, the next one copied while the current one computes. "
            "Predicted peak VRAM 10.0 GiB on a 12 GiB budget, predicted slowdown x1.03; 25 is the "
            "fewest that fit (11.8 GiB, no room left). The text encoder goes to the GPU alone (7.4 GiB while it "
            "encodes) and leaves (text_encoder = offload_after_encoding); the VAE decodes in 256 px tiles.\n\n"
            "Check your machine: vidmem plan --model wan2.2-t2v-a14b --weights fp8_scaled --disk --size 832x480 "
            "--frames 81 --vram 12 --ram 32. Every strategy gives the same frames."
        ),
        loader=model_files(WAN22_HIGH_FP8, UMT5_FP8_22, WAN21_VAE_22, model_2=WAN22_LOW_FP8),
        strategy=strategy("block_swap", "offload_after_encoding", 34),
        prompt="A paper lantern floats over a night market, steam rising from food stalls, warm light, slow dolly shot.",
        negative_prompt=NEGATIVE,
        width=832, height=480, frames=81, steps=40, cfg=4.0, fps=16.0,
        machine=Machine(12, 32, "wan2.2-t2v-a14b", {"transformer": "fp8_scaled", "transformer_2": "fp8_scaled",
                                                    "text_encoder": "fp8_scaled"}),
        files=WAN22_A14B_FILES, note_height=310,
    ),
    Template(
        name="wan21_t2v_1_3b_files",
        title="Wan 2.1 1.3B files, 8 GB, 16 GB RAM",
        pick="quick drafts on an 8 GB card, small downloads",
        note=(
            "Wan 2.1 T2V 1.3B from Comfy-Org's single files on an 8 GB card with 16 GB of RAM: 832x480, "
            "81 frames (about 5 s at 16 fps).\n\n"
            + files_text(WAN21_1_3B_FILES, ("2.8 GB", "6.7 GB", "0.25 GB")) +
            "Storage: the transformer in bf16 as in its file (Comfy-Org ships no fp8 1.3B), the text encoder "
            "in fp8 as in its file, upcast to bf16 per layer. weights_on_disk = on: the 9.8 GB of files are "
            "memory-mapped (page cache, not the process's own RAM: about 2.7 GiB predicted), which leaves a 16 GB "
            "machine room to spare.\n\n"
            "Memory strategy, offload = model: the text encoder goes to the GPU alone (7.4 GiB while it encodes) "
            "and leaves once the prompt is encoded (text_encoder = offload_after_encoding); then the transformer "
            "(2.6 GiB) samples, then the VAE decodes in 256 px tiles. Predicted peak VRAM 7.4 GiB while the text "
            "encoder encodes (the denoise 5.7 GiB), no predicted slowdown. If the card also drives a display, set "
            "text_encoder = cpu (the peak is then the denoise's; the prompt encodes slower, once per prompt thanks "
            "to the prompt cache).\n\n"
            "Check your machine: vidmem plan --model wan2.1-t2v-1.3b --weights fp8_scaled --disk --size 832x480 "
            "--frames 81 --vram 8 --ram 16 (fp8 for both: a little under these files' needs). Every strategy "
            "gives the same frames."
        ),
        loader=model_files(*WAN21_1_3B_FILES),
        strategy=strategy("model", "offload_after_encoding"),
        prompt="A paper boat drifts down a rain-filled gutter past glowing shop windows at night, close-up.",
        negative_prompt=NEGATIVE,
        width=832, height=480, frames=81, steps=30, cfg=5.0, fps=16.0,
        machine=Machine(8, 16, "wan2.1-t2v-1.3b", {"transformer": "bf16", "text_encoder": "fp8_scaled"}),
        files=WAN21_1_3B_FILES, note_height=280,
    ),
)
