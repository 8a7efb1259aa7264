"""bench/blockswap.py, reporting: the tables, the goals and the modelled-overhead figure."""

from __future__ import annotations

import statistics
from pathlib import Path

import torch

from vidmem.memory.swap_model import GpuSpec

from .blockswap_cpu import CONTROL, CPU_RUN, CpuTimes
from .blockswap_modelled import BANDWIDTHS, STEPS, Measured, modelled_tiers


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
