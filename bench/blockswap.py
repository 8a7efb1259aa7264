"""Block swap benchmark: CPU wall time per tier, our sampler vs diffusers, and the modelled GPU cost.

Three parts, written as issue 3's evidence JSON:
- `cpu` (measured): one process, a mid-size Wan (the 1.3B widths, 6 blocks, fp32, random weights,
  the tiny text encoder and VAE from vidmem.pipelines.tiny), one `sample()` call per tier, rounds
  interleaved with the order rotated each round, median of `--runs` after an untimed warm-up round,
  and that every tier gives the tier-`none` latent bit for bit. On the CPU a tier adds only its
  hooks' bookkeeping, a few milliseconds, while other users of a shared machine move wall times by
  10-40%: so tier none is timed twice (the control row shows the noise floor), and the same
  variants run on a narrow model with the same modules, whose fastest runs give the bookkeeping
  in milliseconds (printed, not in the JSON).
- `sampler_vs_diffusers` (measured): vidmem's `sample()` at tier none vs the plain diffusers
  pipeline on the same modules, same seed, prompt and steps.
- `modelled` (NOT measured, no GPU here): per-block bytes and FLOPs of the published Wan 2.1 and
  CogVideoX transformers, built on the meta device, fed to `vidmem.memory.swap_model`.

    python bench/blockswap.py --json bench/results/blockswap.json

About 4 minutes on 2 shared cores; `--skip-cpu` runs only the modelled part (~20 s).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from vidmem.memory import MemoryStrategy  # noqa: E402
from vidmem.memory.device import CpuBackend  # noqa: E402
from vidmem.memory.swap_model import BlockCost, GpuSpec, simulate  # noqa: E402

# --- modelled: the published transformers on the meta device -------------------------------------

# The published transformer configs, as shipped in pipelines/configs/models/<name>.json
# (taken there from diffusers' conversion scripts).
CONFIG_DIR = ROOT / "vidmem" / "pipelines" / "configs" / "models"
MODELS = ("wan2.1-t2v-1.3b", "wan2.1-t2v-14b", "cogvideox-2b", "cogvideox-5b")


@dataclass(frozen=True)
class Family:
    """How a family's pipeline calls its transformer: what the model needs to know."""

    blocks_attr: str
    channels_first: bool  # latents [B, C, T, H, W] (Wan) or [B, T, C, H, W] (CogVideoX)
    text_tokens: int  # the pipeline's max_sequence_length
    cfg_batch: int  # classifier-free guidance as one forward at this batch...
    forwards_per_step: int  # ...or as this many forwards per step
    shapes: tuple[tuple[int, int, int], ...]  # (width, height, frames) at 480p and 720p


FAMILIES = {  # by transformer class
    "WanTransformer3DModel": Family("blocks", True, 512, 1, 2, ((832, 480, 81), (1280, 720, 81))),
    "CogVideoXTransformer3DModel": Family("transformer_blocks", False, 226, 2, 1, ((720, 480, 49), (1280, 720, 81))),
}


def transformer_config(name: str) -> tuple[str, dict]:
    """(diffusers class name, constructor config) of a shipped model's transformer."""
    spec = json.loads((CONFIG_DIR / f"{name}.json").read_text())["components"]["transformer"]
    return spec["class"], spec["config"]


STEPS = 50  # both pipelines' default num_inference_steps
BANDWIDTHS = {"PCIe 3.0 x4": 3.2e9, "PCIe 3.0 x8": 6.5e9, "PCIe 3.0 x16": 12.5e9, "PCIe 4.0 x16": 25e9,
              "PCIe 5.0 x16": 50e9}


@dataclass(frozen=True)
class Measured:
    """One architecture at one shape, per transformer forward (FLOPs of matmuls and attention)."""

    key: str  # "<model>@<W>x<H>x<F>"
    block_bytes: tuple[int, ...]  # bf16 parameter bytes per block
    block_flops: tuple[float, ...]
    other_flops: float  # embeddings and head
    forwards: int  # per call, at STEPS steps

    def costs(self, gpu: GpuSpec) -> tuple[list[BlockCost], float]:
        blocks = [BlockCost(b, gpu.compute_s(f)) for b, f in zip(self.block_bytes, self.block_flops)]
        return blocks, gpu.compute_s(self.other_flops)


def meta_inputs(family: Family, config: dict, shape: tuple[int, int, int]) -> dict:
    """The transformer's inputs at `shape` (VAE 8x spatial, 4x temporal; 16 latent channels)."""
    width, height, frames = shape
    latent_frames, batch = (frames - 1) // 4 + 1, family.cfg_batch
    meta = partial(torch.empty, device="meta")
    layout = (batch, 16, latent_frames) if family.channels_first else (batch, latent_frames, 16)
    inputs = dict(hidden_states=meta(*layout, height // 8, width // 8),
                  encoder_hidden_states=meta(batch, family.text_tokens, 4096), timestep=meta(batch, dtype=torch.long))
    if config.get("use_rotary_positional_embeddings"):  # CogVideoX-5b: the pipeline passes RoPE in
        tokens, head_dim = latent_frames * (height // 16) * (width // 16), config.get("attention_head_dim", 64)
        inputs["image_rotary_emb"] = (meta(tokens, head_dim), meta(tokens, head_dim))
    return inputs


def measure(name: str, shape: tuple[int, int, int]) -> Measured:
    """Bytes and FLOPs of every block from one forward of the real-size model on the meta device."""
    import diffusers

    class_name, config = transformer_config(name)
    family = FAMILIES[class_name]
    with torch.device("meta"):
        model = getattr(diffusers, class_name)(**config).eval()
    blocks = getattr(model, family.blocks_attr)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(**meta_inputs(family, config, shape))
    counts = {module: sum(ops.values()) for module, ops in counter.get_flop_counts().items()}
    prefix = f"{class_name}.{family.blocks_attr}"
    block_flops = tuple(float(counts[f"{prefix}.{i}"]) for i in range(len(blocks)))
    block_bytes = tuple(2 * sum(p.numel() for p in block.parameters()) for block in blocks)
    key = f"{name}@{'x'.join(map(str, shape))}"
    return Measured(key, block_bytes, block_flops, counts["Global"] - sum(block_flops), STEPS * family.forwards_per_step)


def modelled_tiers(blocks: int) -> list[tuple[str, int, int]]:
    """(tier, N, prefetch): block_swap N in {1, half, all}; sequential as every block streamed."""
    tiers = [("block_swap", n, k) for n in sorted({1, blocks // 2, blocks}) for k in (0, 1, 2)]
    return tiers + [("sequential", blocks, k) for k in (0, 1, 2)]


def model_overheads(measured: list[Measured], gpu: GpuSpec) -> dict[str, float]:
    overheads = {}
    for m in measured:
        blocks, other_s = m.costs(gpu)
        for tier, n, k in modelled_tiers(len(blocks)):
            timeline = simulate(blocks, n, k, gpu.pcie_bytes_per_s, forwards=m.forwards, other_compute_s=other_s)
            overheads[f"{m.key}/{tier}:{n}:{k}"] = timeline.overhead
    return overheads


def bandwidth_sweep(measured: list[Measured], gpu: GpuSpec) -> dict[str, dict[str, float]]:
    """Overhead of streaming every block at prefetch 0 and 1, per PCIe link, at 480p Wan."""
    sweep = {}
    for m in (m for m in measured if m.key.startswith("wan") and "x480x" in m.key):
        blocks, other_s = m.costs(gpu)
        for k in (0, 1):
            sweep[f"{m.key} all:{k}"] = {
                link: simulate(blocks, len(blocks), k, bw, forwards=m.forwards, other_compute_s=other_s).overhead
                for link, bw in BANDWIDTHS.items()
            }
    return sweep


# --- measured on this CPU ------------------------------------------------------------------------

MID_CHANGES = dict(num_layers=6, text_dim=32)  # Wan 1.3B widths, 6 blocks; 32: the tiny text encoder's width
# The same modules at negligible width: what a tier adds to a call is then its hooks' bookkeeping alone,
# small enough in absolute terms to measure through this shared machine's noise.
NARROW_CHANGES = dict(MID_CHANGES, num_attention_heads=2, attention_head_dim=12, ffn_dim=32)
CPU_RUN = dict(prompt="a cat and a dog dance", negative_prompt="", width=64, height=64, frames=5, steps=1, cfg=5.0, seed=0)
CONTROL = "none (control)"  # tier none timed a second time: the measurement's own noise floor


def build_pipeline(config: dict):
    """The tiny Wan pipeline's tokenizer, text encoder, VAE and scheduler around a transformer of `config`."""
    import diffusers

    from vidmem.pipelines.loader import LoadedPipeline, pinned_pipeline_class
    from vidmem.pipelines.tiny import build_tiny_pipeline
    from vidmem.pipelines.wan import WAN

    torch.manual_seed(0)
    transformer = diffusers.WanTransformer3DModel(**config).eval()
    components = dict(build_tiny_pipeline("wan2.1-t2v").components, transformer=transformer)
    pipe = pinned_pipeline_class("WanPipeline")(**components)
    pipe.set_progress_bar_config(disable=True)
    return LoadedPipeline(pipe, WAN, "WanPipeline", f"Wan transformer {config['num_layers']} blocks", "fp32")


def cpu_tiers(blocks: int) -> dict[str, MemoryStrategy]:
    tiers = {"none": MemoryStrategy(offload="none"), "model": MemoryStrategy(offload="model")}
    for n in sorted({1, blocks // 2, blocks}):
        for k in (0, 1, 2):
            tiers[f"block_swap:{n}:{k}"] = MemoryStrategy(offload="block_swap", blocks_to_swap=n, prefetch_blocks=k)
    tiers["sequential"] = MemoryStrategy(offload="sequential")
    return tiers


def vidmem_latent(loaded, strategy: MemoryStrategy) -> torch.Tensor:
    from vidmem.pipelines.sample import SampleRequest, sample

    return sample(loaded, strategy, SampleRequest(**CPU_RUN), backend=CpuBackend()).latent["samples"]


def diffusers_latent(loaded, plain) -> torch.Tensor:
    """The plain diffusers call, as a user would make it, in vidmem's LATENT layout."""
    run = CPU_RUN
    with torch.no_grad():
        frames = plain(
            prompt=run["prompt"], negative_prompt=run["negative_prompt"], height=run["height"], width=run["width"],
            num_frames=run["frames"], num_inference_steps=run["steps"], guidance_scale=run["cfg"],
            generator=torch.Generator("cpu").manual_seed(run["seed"]), output_type="latent",
            max_sequence_length=loaded.spec.max_sequence_length,
        ).frames
    return loaded.spec.to_comfy_latent(plain, frames, run["frames"])


@dataclass
class CpuTimes:
    seconds: dict[str, list[float]]  # wall seconds per timed run
    latents: dict[str, torch.Tensor]  # the first latent of each variant
    stable: dict[str, bool]  # the same latent in every run

    def median(self, name: str) -> float:
        return statistics.median(self.seconds[name])

    def fastest(self, name: str) -> float:
        """The least disturbed run: on a shared machine, interference only ever adds time."""
        return min(self.seconds[name])


def time_interleaved(variants: dict, runs: int) -> CpuTimes:
    """Round 0 warms up untimed; each round runs every variant once, the order rotated per round.

    After the warm-up every live object is frozen out of the garbage collector's reach, so its
    automatic passes stay short and land on no variant in particular.
    """
    names = list(variants)
    result = CpuTimes({name: [] for name in names}, {}, dict.fromkeys(names, True))
    for round_ in range(runs + 1):
        if round_ == 1:
            gc.collect()
            gc.freeze()
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            latent = variants[name]()
            elapsed = time.perf_counter() - start
            if round_:
                result.seconds[name].append(elapsed)
            result.stable[name] &= torch.equal(result.latents.setdefault(name, latent), latent)
    gc.unfreeze()
    return result


def time_cpu(changes: dict, runs: int) -> CpuTimes:
    """Every tier, tier none again as a control, and the plain diffusers call, on one pipeline
    whose transformer is Wan 2.1 1.3B's with `changes`."""
    import diffusers

    config = dict(transformer_config("wan2.1-t2v-1.3b")[1], **changes)
    print(f"  timing a Wan transformer of width {config['num_attention_heads'] * config['attention_head_dim']}, "
          f"{config['num_layers']} blocks: {runs} rounds after a warm-up", flush=True)
    loaded = build_pipeline(config)
    plain = diffusers.WanPipeline(**loaded.pipe.components)  # the same modules, no vidmem subclass
    plain.set_progress_bar_config(disable=True)
    variants = {name: partial(vidmem_latent, loaded, s) for name, s in cpu_tiers(config["num_layers"]).items()}
    variants[CONTROL] = variants["none"]
    variants["diffusers"] = partial(diffusers_latent, loaded, plain)
    return time_interleaved(variants, runs)


def evidence(times: CpuTimes) -> tuple[dict, dict]:
    """The `cpu` and `sampler_vs_diffusers` entries: wall-time medians, bit-equality with tier none."""
    reference, none = times.latents["none"], times.median("none")
    equal = lambda name: times.stable[name] and times.stable["none"] and torch.equal(times.latents[name], reference)  # noqa: E731
    tiers = [name for name in times.seconds if name not in (CONTROL, "diffusers")]
    cpu = {name: {"ratio_vs_none": times.median(name) / none, "bitwise_equal": equal(name)} for name in tiers}
    sampler = {"ratio": none / times.median("diffusers"), "bitwise_equal": equal("diffusers")}
    return cpu, sampler


# --- reporting -----------------------------------------------------------------------------------

def print_cpu(mid: CpuTimes, narrow: CpuTimes) -> None:
    none, fastest_none = mid.median("none"), mid.fastest("none")
    print(f"\nCPU, measured: one sample() call per variant ({CPU_RUN['width']}x{CPU_RUN['height']}x{CPU_RUN['frames']}, "
          f"steps={CPU_RUN['steps']}, cfg -> 2 forwards), wall time of {len(mid.seconds['none'])} interleaved runs; "
          f"bookkeeping = fastest run minus tier none's on the narrow model ({len(narrow.seconds['none'])} runs), "
          f"as % of the mid-size tier-none call")
    print(f"{'variant':<16} {'median s':>9} {'min s':>7} {'max s':>7} {'x none':>7} {'x none(min)':>11} {'bitwise':>8} "
          f"{'bookkeeping ms':>14} {'% of call':>9}")
    reference = mid.latents["none"]
    for name, seconds in mid.seconds.items():
        extra_ms = 1e3 * (narrow.fastest(name) - narrow.fastest("none"))
        equal = mid.stable[name] and torch.equal(mid.latents[name], reference)
        print(f"{name:<16} {statistics.median(seconds):>9.3f} {min(seconds):>7.3f} {max(seconds):>7.3f} "
              f"{statistics.median(seconds) / none:>7.3f} {min(seconds) / fastest_none:>11.3f} {str(equal):>8} "
              f"{extra_ms:>14.1f} {extra_ms / (10 * fastest_none):>8.2f}%")
    print(f"sampler_vs_diffusers: vidmem none / plain diffusers = {none / mid.median('diffusers'):.3f} (medians), "
          f"{fastest_none / mid.fastest('diffusers'):.3f} (fastest runs)")


def print_modelled(measured: list[Measured], overheads: dict, sweep: dict, gpu: GpuSpec) -> None:
    print(f"\nMODELLED, not measured: GPU {gpu.peak_flops / 1e12:.0f} TFLOPS bf16 x {gpu.achieved_fraction} achieved, "
          f"PCIe {gpu.pcie_bytes_per_s / 1e9:.1f} GB/s, copies on a side stream, {STEPS} steps")
    print(f"{'model@WxHxF':<28} {'blocks':>6} {'MB/block':>8} {'copy ms':>8} {'TFLOP/blk':>9} {'compute ms':>10} "
          f"{'fwd/call':>8} {'call s (resident)':>17}")
    for m in measured:
        blocks, other_s = m.costs(gpu)
        call_s = m.forwards * (other_s + sum(b.compute_s for b in blocks))
        print(f"{m.key:<28} {len(blocks):>6} {m.block_bytes[-1] / 1e6:>8.1f} {gpu.copy_s(m.block_bytes[-1]) * 1e3:>8.1f} "
              f"{m.block_flops[-1] / 1e12:>9.2f} {blocks[-1].compute_s * 1e3:>10.1f} {m.forwards:>8} {call_s:>17.0f}")
    print(f"\n{'model@WxHxF':<28} {'tier:N':<16} {'overhead p0':>11} {'p1':>8} {'p2':>8}   (sequential ~ every block streamed)")
    for m in measured:
        for tier, n, _ in modelled_tiers(len(m.block_bytes))[::3]:
            cells = [overheads[f"{m.key}/{tier}:{n}:{k}"] for k in (0, 1, 2)]
            print(f"{m.key:<28} {f'{tier}:{n}':<16} " + " ".join(f"{100 * c:>7.3f}%".rjust(w) for c, w in zip(cells, (11, 8, 8))))
    print(f"\nMODELLED overhead vs PCIe link, every block streamed:\n{'model@WxHxF all:prefetch':<32} "
          + " ".join(f"{link:>13}" for link in BANDWIDTHS))
    for label, row in sweep.items():
        print(f"{label:<32} " + " ".join(f"{100 * v:>12.3f}%" for v in row.values()))


def plot(path: Path, measured: list[Measured], overheads: dict, sweep: dict, gpu: GpuSpec) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: skipped {path} (pip install matplotlib to draw it)")
        return
    fig, axes = plt.subplots(3, 3, figsize=(15, 12))
    for ax, m in zip(axes.flat, measured):
        tiers = modelled_tiers(len(m.block_bytes))[::3]
        for k in (0, 1, 2):
            values = [100 * overheads[f"{m.key}/{tier}:{n}:{k}"] for tier, n, _ in tiers]
            ax.bar([i + (k - 1) * 0.27 for i in range(len(tiers))], values, width=0.27, label=f"prefetch {k}")
        ax.set_xticks(range(len(tiers)), [f"{'seq' if t == 'sequential' else 'swap'} {n}" for t, n, _ in tiers])
        ax.set_title(m.key, fontsize=10)
        ax.set_ylabel("modelled overhead, %")
    ax = axes.flat[-1]
    for label, row in sweep.items():
        ax.plot([bw / 1e9 for bw in BANDWIDTHS.values()], [100 * v for v in row.values()], marker="o", label=label)
    ax.set(xscale="log", yscale="log", xlabel="PCIe GB/s (modelled)", ylabel="overhead, %", title="all blocks streamed vs link")
    ax.set_xticks([bw / 1e9 for bw in BANDWIDTHS.values()], [f"{bw / 1e9:g}" for bw in BANDWIDTHS.values()])
    ax.tick_params(axis="x", which="minor", labelbottom=False)
    ax.legend(fontsize=7)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(f"MODELLED (not measured) block swap overhead vs all-resident: {gpu.peak_flops / 1e12:.0f} TFLOPS bf16 x "
                 f"{gpu.achieved_fraction}, PCIe {gpu.pcie_bytes_per_s / 1e9:.0f} GB/s, side-stream copies, {STEPS} steps")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    print(f"wrote {path}")


def print_goals(cpu: dict | None, sampler: dict | None, overheads: dict, mid=None, narrow=None) -> None:
    print("\nGoals")
    if cpu is not None:
        worst = max(cpu, key=lambda name: cpu[name]["ratio_vs_none"])
        unequal = [name for name, r in cpu.items() if not r["bitwise_equal"]]
        print(f"  CPU <= 1.02x per tier (wall): {'PASS' if cpu[worst]['ratio_vs_none'] <= 1.02 else 'FAIL'} "
              f"(worst {worst} {cpu[worst]['ratio_vs_none']:.3f}; tier none vs itself "
              f"{mid.median(CONTROL) / mid.median('none'):.3f}); bit-identical: {unequal or 'all'}")
        costly = max(cpu, key=lambda name: narrow.fastest(name))
        share = (narrow.fastest(costly) - narrow.fastest("none")) / mid.fastest("none")
        print(f"  bookkeeping <= 2% of the call: {'PASS' if share <= 0.02 else 'FAIL'} (worst {costly} {100 * share:.2f}%)")
        ok = sampler["ratio"] <= 1.0 and sampler["bitwise_equal"]
        print(f"  sampler <= 1.00x and bit-identical: {'PASS' if ok else 'FAIL'} "
              f"({sampler['ratio']:.3f}, {sampler['bitwise_equal']})")
    wan14 = {k: v for k, v in overheads.items() if k.startswith("wan2.1-t2v-14b@832x480x81/") and k.endswith(":1")}
    worst = max(wan14, key=wan14.get)
    print(f"  modelled Wan 14B 480p prefetch 1 <= 5%: {'PASS' if wan14[worst] <= 0.05 else 'FAIL'} "
          f"(worst {worst} {100 * wan14[worst]:.2f}%)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the evidence JSON here")
    parser.add_argument("--png", type=Path, default=ROOT / "bench" / "results" / "blockswap_modelled.png")
    parser.add_argument("--runs", type=int, default=5, help="timed rounds (after one warm-up round)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (fixed, for stable timings)")
    parser.add_argument("--skip-cpu", action="store_true", help="only the modelled part")
    parser.add_argument("--pcie-gbps", type=float, default=25.0, help="effective host-to-device GB/s")
    parser.add_argument("--tflops", type=float, default=165.0, help="peak dense bf16 TFLOPS")
    parser.add_argument("--efficiency", type=float, default=0.5, help="fraction of peak the kernels reach")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gpu = GpuSpec(args.pcie_gbps * 1e9, args.tflops * 1e12, args.efficiency)
    started = time.perf_counter()
    measured = [measure(name, shape) for name in MODELS for shape in FAMILIES[transformer_config(name)[0]].shapes]
    overheads, sweep = model_overheads(measured, gpu), bandwidth_sweep(measured, gpu)
    print_modelled(measured, overheads, sweep, gpu)
    plot(args.png, measured, overheads, sweep, gpu)
    cpu = sampler = mid = narrow = None
    if not args.skip_cpu:
        print(f"\nCPU part: threads={args.threads}, load average {os.getloadavg()[0]:.1f} at start", flush=True)
        mid = time_cpu(MID_CHANGES, args.runs)
        cpu, sampler = evidence(mid)
        narrow = time_cpu(NARROW_CHANGES, 4 * args.runs)
        print_cpu(mid, narrow)
        print(f"load average {os.getloadavg()[0]:.1f} at end")
    print_goals(cpu, sampler, overheads, mid, narrow)
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    if args.json:
        write_json(args.json, cpu, sampler, overheads)


def write_json(path: Path, cpu: dict | None, sampler: dict | None, overheads: dict) -> None:
    """Issue 3's evidence format, nothing more."""
    report = {"cpu": cpu or {}, "sampler_vs_diffusers": sampler or {},
              "modelled": {key: {"overhead": value} for key, value in overheads.items()}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
