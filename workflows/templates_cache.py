"""Fast variants with a Step Cache (VidMem) on the Sampler: MagCache with its authors' published ratios.

Each is a single-file template of templates_files.py (same files, machine and memory strategy) with
a Step Cache node linked to the Sampler's cache input, run as the ratios were measured
(pipelines/configs/mag_ratios.json, from Zehong-Ma/MagCache): Wan 2.1 T2V 1.3B at 50 steps, UniPC
shift 5; Wan 2.2 T2V A14B at 40 steps, UniPC shift 12, where the high-noise expert takes 26 steps
and the low-noise one 14, the split its per-expert ratios are tied to. The retention and the most
steps skipped in a row are the published ones; threshold 0 takes the published threshold. The steps
computed are `vidmem plan --cache mag_cache`'s (diffusers' own MagCache hook on a stand-in: its
decisions depend on the ratios and the step count only).

CI and the live runs shrink templates onto tiny models, which have no published ratios:
tests/workflow_runner.shrink_for_tiny switches these caches to mag_ratios calibrate there.
"""

from __future__ import annotations

from template_types import FAST_SPEED, NEGATIVE, Machine, Template, mag_cache, model_files, strategy
from templates_files import (
    UMT5_FP8_22, WAN21_1_3B_FILES, WAN21_VAE_22, WAN22_A14B_FILES, WAN22_HIGH_FP8, WAN22_LOW_FP8, files_text,
)

CACHE_QUALITY = (
    "What it costs: a skipped step reuses the last computed step's change instead of computing its own, so "
    "the video is close to, not the same as, the uncached one: textures may soften and motion drift a "
    "little. MagCache's authors report about 2x faster sampling on Wan 2.1 with a small loss of detail. "
    "For more speed raise the Step Cache's threshold (more skipped steps, more loss); for the uncached "
    "video set its method to off. Every memory tier gives the same video with the cache on: the skip "
    "decisions come from the ratios and the step count, not from where the weights are.\n\n"
)

SPEED_TEXT = (
    "Speed (VidMem) on the Sampler: attention = auto (torch's SDPA choosing its own fused kernel, measured the "
    "fastest exact choice on an H100; named in the receipt), compile = true (the transformer's repeated blocks "
    "compiled with torch.compile: the first run spends up to a minute or two compiling, later runs of this graph "
    "reuse it and recompile nothing, under any offload tier), fp8_matmul = auto (fp8 weights are upcast: fp8 "
    "matmul measured slower on an H100 and an H200; set it to on to multiply in fp8 on cards with fp8 tensor "
    "cores, RTX 40xx and H100 and newer). Set compile to false to skip the first run's compile.\n\n"
)


CACHE_TEMPLATES = (
    Template(
        name="wan21_t2v_1_3b_files_magcache",
        title="Wan 2.1 1.3B fast, 8 GB, 16 GB RAM",
        pick="the 1.3B with 58% of its steps skipped",
        note=(
            "Wan 2.1 T2V 1.3B, fast: the files and memory strategy of \"Wan 2.1 1.3B files, 8 GB, 16 GB RAM\" "
            "(8 GB card, 16 GB of RAM, 832x480, 81 frames) with a Step Cache (VidMem) on the Sampler.\n\n"
            + files_text(WAN21_1_3B_FILES, ("2.8 GB", "6.7 GB", "0.25 GB")) +
            "Step Cache: method = mag_cache, mag_ratios = auto, the ratios MagCache's authors published for "
            "Wan 2.1 1.3B (measured at 50 steps, UniPC, shift 5, 832x480x81, which is why this template runs "
            "steps = 50 and shift = 5.0), with their threshold (0: the published 0.12), retention 0.2 (the "
            "first 10 steps always run) and max_skip_steps 4. It computes 21 of the 50 steps (42%): about "
            "30% less denoising time than the 30 uncached steps of the base template, on the 50-step "
            "schedule (vidmem plan --model wan2.1-t2v-1.3b --steps 50 --cache mag_cache). The Sampler's "
            "receipt counts the blocks computed and skipped.\n\n"
            + CACHE_QUALITY + SPEED_TEXT +
            "Memory strategy, offload = model, as the base template: the text encoder on the GPU alone until "
            "the prompt is encoded (7.4 GiB while it encodes), then the transformer (2.6 GiB), then the VAE in "
            "256 px tiles; predicted peak VRAM 7.4 GiB (the denoise 6.1 GiB, the cache's state included). The transformer stays on the GPU while it samples, so here "
            "the cache saves compute. Under block swap (a smaller card: offload = block_swap) a skipped step "
            "also copies none of its swapped blocks: the receipt counts the streamed copies saved."
        ),
        loader=model_files(*WAN21_1_3B_FILES),
        strategy=strategy("model", "offload_after_encoding"),
        prompt="A paper boat drifts down a rain-filled gutter past glowing shop windows at night, close-up.",
        negative_prompt=NEGATIVE,
        width=832, height=480, frames=81, steps=50, cfg=5.0, fps=16.0,
        machine=Machine(8, 16, "wan2.1-t2v-1.3b", {"transformer": "bf16", "text_encoder": "fp8_scaled"}),
        files=WAN21_1_3B_FILES, note_height=None, sampler=dict(shift=5.0), cache=mag_cache(0.2, 4), speed=FAST_SPEED,
    ),
    Template(
        name="wan22_t2v_a14b_fp8_magcache",
        title="Wan 2.2 A14B fast, 12 GB, 32 GB RAM",
        pick="A14B with 35% of its steps skipped",
        note=(
            "Wan 2.2 T2V A14B, fast: the fp8 files and memory strategy of \"Wan 2.2 A14B fp8, 12 GB, 32 GB "
            "RAM\" (12 GB card, 32 GB of RAM, 832x480, 81 frames) with a Step Cache (VidMem) on the Sampler.\n\n"
            + files_text(WAN22_A14B_FILES, ("14 GB", "14 GB", "6.7 GB", "0.25 GB")) +
            "Step Cache: method = mag_cache, mag_ratios = auto, the per-expert ratios from MagCache's authors "
            "for Wan 2.2 T2V A14B, with their threshold (0: the published 0.06), retention 0.4 and "
            "max_skip_steps 2. Those ratios hold only at 40 steps with the high-noise expert taking 26 of "
            "them, so the Sampler runs steps = 40 and shift = 12.0 (Wan 2.2's own setting for this model, "
            "and the one the ratios were measured with; the model folder's default shift 3 gives the "
            "high-noise expert 13 steps). Another step count is refused by name; calibrate for it. It "
            "computes 15 of the high-noise expert's 26 steps and 11 of the low-noise expert's 14: 26 of 40 "
            "(65%) (vidmem plan --model wan2.2-t2v-a14b --steps 40 --cache mag_cache).\n\n"
            + CACHE_QUALITY + SPEED_TEXT +
            "Memory strategy, offload = block_swap with blocks_to_swap = 34 per expert, as the base "
            "template: 34 of 40 blocks (0.33 GiB each in fp8) stream to the GPU on every pass the transformer "
            "computes, weights memory-mapped from the files (weights_on_disk); predicted peak VRAM 11.2 GiB, "
            "the cache's state on the GPU included. "
            "What the cache saves here beyond compute: a skipped step copies none of its 34 swapped blocks, "
            "about 11 GiB of PCIe copies per pass, two passes per step at cfg 4 (and the reads from disk "
            "behind them when the page cache cannot keep the experts). The Sampler's receipt counts the "
            "blocks computed and the streamed copies made and saved."
        ),
        loader=model_files(WAN22_HIGH_FP8, UMT5_FP8_22, WAN21_VAE_22, model_2=WAN22_LOW_FP8),
        strategy=strategy("block_swap", "offload_after_encoding", 34),
        prompt="A paper lantern floats over a night market, steam rising from food stalls, warm light, slow dolly shot.",
        negative_prompt=NEGATIVE,
        width=832, height=480, frames=81, steps=40, cfg=4.0, fps=16.0,
        machine=Machine(12, 32, "wan2.2-t2v-a14b", {"transformer": "fp8_scaled", "transformer_2": "fp8_scaled",
                                                    "text_encoder": "fp8_scaled"}),
        files=WAN22_A14B_FILES, note_height=None, sampler=dict(shift=12.0), cache=mag_cache(0.4, 2), speed=FAST_SPEED,
    ),
)
