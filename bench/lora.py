"""LoRA benchmark: what a rank-64 LoRA beside the layers costs, per memory tier, on the CPU.

Setup: a Wan 2.1 14B transformer at its real width (5120, 40 heads, FFN 13824, text 4096) cut to
`--blocks` blocks, fp32 (bf16 is 4-5x slower on this CPU), random weights, one forward on a small
latent (64 image tokens, 32 text tokens). The LoRA targets every linear layer of every block
(self/cross attention q, k, v, o and both FFN layers) at rank 64, written as a lightx2v-style file
(`diffusion_model.blocks.N.self_attn.q.lora_down.weight` + `.alpha`) in fp32, the compute dtype.

Per tier (none, model, block_swap, sequential; the CPU backend, so tiers add hooks, not copies):
- `time_ratio`: median wall time of a forward with the LoRA / without, samples interleaved (the
  order alternates each round) after a warm-up, so machine load hits both alike;
  `paired_time_ratio`: the median of the per-round ratios (less moved by load on a shared machine);
  `min_time_ratio`: fastest with / fastest without (load only ever adds time); `cpu_time_ratio`.
- `extra_rss_bytes`: peak RSS growth of loading the LoRA and making a call with it, minus that of a
  call without (peak reset through /proc/self/clear_refs), vs `lora_file_bytes`: the LoRA's pages
  are mapped from the file and touched once (by the load's NaN check), so the goal is <= 1.1x the file.
- `bitwise_equal`: the tier's LoRA output equals tier none's bit for bit.
And once, in `setup`: `flop_ratio`, the FLOPs of a forward with the LoRA over those without: the
share of extra work no machine load can move.

One torch thread by default: with two threads on a machine shared with other jobs, every small
parallel op can wait a scheduler slice for the descheduled thread, which inflates the many small
LoRA ops (measured x1.3-2.0 under a load average of 6) far more than the few large matmuls.

    python bench/lora.py --json bench/results/lora.json

About 3 minutes on 2 shared cores (building the model takes ~15 s).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
from bench.support.checkout import use_this_checkout  # noqa: E402

use_this_checkout()  # `import vidmem` is this clone, installed or not

import torch  # noqa: E402

from vidmem.memory import MemoryStrategy  # noqa: E402
from vidmem.memory.device import CpuBackend  # noqa: E402
from vidmem.memory.lora import apply_loras  # noqa: E402
from vidmem.memory.offload import StageComponents, apply_strategy  # noqa: E402
from vidmem.memory.storage import mapped_bytes  # noqa: E402
from vidmem.pipelines.lora import load_lora, lora_patches  # noqa: E402
from bench.support.lora_files import write_lora  # noqa: E402
from bench.support.memwatch import peak_growth, rss_in_child  # noqa: E402

CONFIG = ROOT / "pipelines" / "configs" / "models" / "wan2.1-t2v-14b.json"
RANK = 64
TIERS = {
    "none": MemoryStrategy(offload="none"),
    "model": MemoryStrategy(offload="model"),
    "block_swap": MemoryStrategy(offload="block_swap", blocks_to_swap=1, prefetch_blocks=1),
    "sequential": MemoryStrategy(offload="sequential", prefetch_blocks=1),
}


class Holder:
    """What lora_patches needs of a pipeline: its denoiser as `transformer`."""

    def __init__(self, transformer):
        self.transformer = transformer


def build_model(blocks: int):
    import diffusers

    config = json.loads(CONFIG.read_text())["components"]["transformer"]["config"]
    torch.manual_seed(0)
    return diffusers.WanTransformer3DModel(**dict(config, num_layers=blocks)).eval()


def inputs():
    gen = torch.Generator().manual_seed(2)
    return dict(hidden_states=torch.randn(1, 16, 1, 16, 16, generator=gen), timestep=torch.tensor([500]),
                encoder_hidden_states=torch.randn(1, 32, 4096, generator=gen), return_dict=False)


def forward(model, strategy, patches):
    """One call as the sampler makes it: LoRAs first, then the strategy, both removed after."""
    stage = StageComponents({"transformer": model}, {"transformer": model.blocks})
    with torch.no_grad(), apply_loras(patches), apply_strategy(stage, strategy, CpuBackend()):
        return model(**inputs())[0]


def timed(model, strategy, patches) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    forward(model, strategy, patches)
    return time.perf_counter() - wall, time.process_time() - cpu


def time_ratios(model, strategy, patches, samples: int) -> dict[str, float]:
    """Wall time with / without as a ratio of medians; the median of per-round ratios (rounds are
    adjacent in time, so less moved by other users of the machine); and the CPU-time ratio."""
    forward(model, strategy, patches)  # warm-up
    base, lora = [], []
    for round_ in range(samples):
        order = ((base, []), (lora, patches)) if round_ % 2 == 0 else ((lora, patches), (base, []))
        for into, used in order:
            into.append(timed(model, strategy, used))
    median = lambda runs, i: statistics.median(run[i] for run in runs)  # noqa: E731
    return {
        "time_ratio": round(median(lora, 0) / median(base, 0), 4),
        "paired_time_ratio": round(statistics.median(w[0] / wo[0] for w, wo in zip(lora, base)), 4),
        "cpu_time_ratio": round(median(lora, 1) / median(base, 1), 4),
        "min_time_ratio": round(min(run[0] for run in lora) / min(run[0] for run in base), 4),
        "base_seconds": round(median(base, 0), 3),
    }


def flop_ratio(model, patches) -> float:
    """(base FLOPs + LoRA FLOPs) / base FLOPs of one forward: the load-independent share of extra work.

    Base FLOPs from torch's FlopCounterMode; the LoRA's counted from the rows each targeted layer
    sees (its `addmm_` is not in the counter's table): 2 x rows x rank x (in + out) per layer.
    """
    from torch.utils.flop_counter import FlopCounterMode

    rows: dict[int, int] = {}
    hooks = [p.module.register_forward_hook(lambda m, args, out: rows.__setitem__(id(m), args[0].numel() // args[0].shape[-1]))
             for p in patches]
    with FlopCounterMode(display=False) as counter:
        forward(model, TIERS["none"], [])
    for hook in hooks:
        hook.remove()
    extra = sum(2 * rows[id(p.module)] * p.down.shape[0] * (p.down.shape[1] + p.up.shape[0]) for p in patches)
    return (counter.get_total_flops() + extra) / counter.get_total_flops()


def extra_rss(model, strategy, path: Path) -> int:
    """Peak growth of loading a LoRA and making a call with it, minus that of a call without one.

    The load is inside the measured call: Load LoRA reads every value of the file (the NaN/inf
    check), so the mapped pages enter RSS there, not in the forward. Measured around the forward
    alone, they were already resident when the peak was reset and the growth read ~0.
    """
    holder = Holder(model)
    forward(model, strategy, [])  # warm-up: the allocator's first-call growth is not the LoRA's
    base = peak_growth(lambda: forward(model, strategy, []))
    assert mapped_bytes() == 0, "a LoRA mapping from an earlier measurement is still alive"

    def load_and_call():
        spec = load_lora(path, holder, 1.0)
        forward(model, strategy, lora_patches(holder, [spec]))

    with_lora = peak_growth(load_and_call)
    gc.collect()
    return with_lora - base


def measure_rss(args) -> None:
    model = build_model(args.blocks)
    with tempfile.TemporaryDirectory() as folder:
        path = write_lora(model, args.blocks, Path(folder) / "rank64.safetensors", RANK)
        args.rss_only.write_text(json.dumps({name: extra_rss(model, strategy, path) for name, strategy in TIERS.items()}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--samples", type=int, default=5, help="timed forwards per variant and tier")
    parser.add_argument("--threads", type=int, default=1, help="torch threads; 1 keeps a shared machine's "
                        "scheduling stalls out of the many small LoRA ops")
    parser.add_argument("--rss-only", type=Path, help=argparse.SUPPRESS)  # the child of rss_in_child
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.rss_only:
        return measure_rss(args)
    extra = rss_in_child(__file__, args)
    model = build_model(args.blocks)
    with tempfile.TemporaryDirectory() as folder:
        path = write_lora(model, args.blocks, Path(folder) / "rank64.safetensors", RANK)
        file_bytes = path.stat().st_size
        results, reference = {}, None
        holder = Holder(model)
        flops = flop_ratio(model, lora_patches(holder, [load_lora(path, holder, 1.0)]))
        print(f"FLOPs with the LoRA / without: x{flops:.4f}", flush=True)
        for name, strategy in TIERS.items():
            holder = Holder(model)
            patches = lora_patches(holder, [load_lora(path, holder, 1.0)])
            output = forward(model, strategy, patches)
            reference = output if reference is None else reference
            times = time_ratios(model, strategy, patches, args.samples)
            results[name] = {**times, "extra_rss_bytes": extra[name], "lora_file_bytes": file_bytes,
                             "bitwise_equal": bool(torch.equal(output, reference))}
            print(f"{name:11s} time x{times['time_ratio']:.3f} (paired x{times['paired_time_ratio']:.3f}, "
                  f"min x{times['min_time_ratio']:.3f}, CPU "
                  f"x{times['cpu_time_ratio']:.3f}, base {times['base_seconds']:.2f} s)  extra RSS {extra[name] / 2**20:7.1f} MiB "
                  f"({extra[name] / file_bytes:.2f}x the {file_bytes / 2**20:.1f} MiB file)  bitwise {results[name]['bitwise_equal']}", flush=True)
    report = {
        "setup": {"model": f"Wan 2.1 14B widths, {args.blocks} blocks, fp32, CPU, random weights", "rank": RANK,
                  "tokens": {"image": 64, "text": 32}, "samples": args.samples, "threads": torch.get_num_threads(),
                  "flop_ratio": round(flops, 4)},
        "tiers": results,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
