"""bench/speed.py, reporting: the evidence per method against the uncached run, the goals, the tables."""

from __future__ import annotations

import torch

from .blockswap_cpu import CpuTimes
from .speed_runs import CONTROL, UNCACHED, Call, SpeedConfig, methods, psnr_db

MAG_BLOCKS_GOAL = 0.60  # MagCache with the Wan 2.1 ratios computes at most this share of a 50-step run's blocks
GOAL_STEPS = 50
COPIES_SLACK = 0.05  # copies_ratio <= blocks_ratio + this, on every streamed tier


def evidence(calls: dict[str, dict[str, Call]], times: CpuTimes | None, config: SpeedConfig) -> dict:
    """`cache`: per method, its ratios against the uncached run, tier by tier."""
    passes = 2 if config.cfg > 1 else 1
    total = config.steps * passes * config.blocks
    uncached = calls[UNCACHED]
    settings = methods(config)
    report = {}
    for method, by_tier in calls.items():
        none = by_tier["none"]
        computed = none.receipt["cache"]["blocks_computed"] if "cache" in none.receipt else total
        copies = {tier: _copies(by_tier[tier], uncached[tier]) for tier in by_tier if uncached[tier].audit["copies"]}
        timed, fastest = _time_ratios(times, method, config, "median"), _time_ratios(times, method, config, "fastest")
        report[method] = {
            "settings": settings[method].describe(),
            "blocks_computed": computed, "blocks_total": total, "blocks_ratio": computed / total,
            "copies_ratio": max(c["ratio"] for c in copies.values()) if copies else None,
            "copies_ratio_by_tier": {tier: c["ratio"] for tier, c in copies.items()},
            "time_ratio": timed.get(config.time_tiers[0]) if timed else None,
            "time_ratio_by_tier": timed,
            "time_ratio_fastest_by_tier": fastest,  # interference on a shared machine only adds time
            "seconds_by_tier": {t: times.seconds[f"{method}@{t}"] for t in config.time_tiers} if times else {},
            "psnr_db": psnr_db(uncached["none"].latent, none.latent),
            "bitwise_equal_to_uncached": torch.equal(uncached["none"].latent, none.latent),
            "tiers_bitwise_equal": all(torch.equal(c.latent, none.latent) for c in by_tier.values()),
            "tiers_same_blocks_computed": len({_computed(c) for c in by_tier.values()}) == 1,
            "copies_by_tier": copies,
        }
    return report


def _computed(call: Call) -> int | None:
    return call.receipt.get("cache", {}).get("blocks_computed")


def _copies(cached: Call, uncached: Call) -> dict:
    """One streamed tier: copies with the cache and without, what the receipt says the cache saved,
    and the copies that were never used (see CopyAudit)."""
    found = {"copies": cached.audit["copies"], "uncached_copies": uncached.audit["copies"],
             "ratio": cached.audit["copies"] / uncached.audit["copies"],
             "wasted": cached.audit["wasted"], "uncached_wasted": uncached.audit["wasted"]}
    receipt = cached.receipt.get("cache")
    if receipt is not None:
        found["saved_by_cache"] = receipt["streamed_copies_skipped"]  # streamed groups called but not copied
        found["receipt_agrees"] = receipt["streamed_copies"] == cached.audit["copies"]
    return found


def _time_ratios(times: CpuTimes | None, method: str, config: SpeedConfig, statistic: str) -> dict:
    """Wall time with the cache / uncached (`statistic`: "median" or "fastest" of the runs), per
    timed tier; the uncached method's ratio is its second copy's (the control: the noise floor)."""
    if times is None:
        return {}
    own = CONTROL if method == UNCACHED else method
    measure = getattr(times, statistic)
    return {tier: measure(f"{own}@{tier}") / measure(f"{UNCACHED}@{tier}") for tier in config.time_tiers}


def goals(report: dict, config: SpeedConfig) -> dict:
    """The issue's three goals, each with its verdict and what it rests on."""
    mag = report["mag_cache"]["blocks_ratio"]
    mag_goal = {"pass": mag <= MAG_BLOCKS_GOAL if config.steps == GOAL_STEPS else None,
                "detail": f"mag_cache computes {mag:.3f} of the blocks (goal <= {MAG_BLOCKS_GOAL})"
                          + ("" if config.steps == GOAL_STEPS else f"; not judged: the goal is for {GOAL_STEPS} steps")}
    falls, details = True, []
    for method, entry in report.items():
        if method == UNCACHED:
            continue
        for tier, ratio in entry["copies_ratio_by_tier"].items():
            ok = ratio <= entry["blocks_ratio"] + COPIES_SLACK
            falls &= ok
            details.append(f"{method}@{tier}: copies {ratio:.3f} vs blocks {entry['blocks_ratio']:.3f}"
                           f"{'' if ok else ' FAILS'}")
    equal = {method: entry["tiers_bitwise_equal"] for method, entry in report.items()}
    return {"mag_cache_blocks_ratio": mag_goal,
            "copies_fall_with_blocks": {"pass": falls, "detail": "; ".join(details)},
            "tiers_bit_identical": {"pass": all(equal.values()),
                                    "detail": ", ".join(f"{m}: {v}" for m, v in equal.items())}}


def _num(value, fmt: str = ".3f", width: int = 7) -> str:
    return f"{'-' if value is None else format(value, fmt):>{width}}"


def print_tables(report: dict, config: SpeedConfig) -> None:
    streamed = list(next(iter(report.values()))["copies_ratio_by_tier"])
    print(f"\n{'method':<24} {'blocks':>7} " + " ".join(f"{'copies ' + t:>20}" for t in streamed)
          + f" {'copies':>7} {'time':>7} {'fastest':>7} {'PSNR dB':>8} {'tiers =':>7}")
    first = config.time_tiers[0] if config.time_tiers else None
    for method, entry in report.items():
        cells = " ".join(_num(entry["copies_ratio_by_tier"][t], width=20) for t in streamed)
        psnr = "equal" if entry["bitwise_equal_to_uncached"] else _num(entry["psnr_db"], ".1f", 8)
        fastest = entry["time_ratio_fastest_by_tier"].get(first)
        print(f"{method:<24} {_num(entry['blocks_ratio'])} {cells} {_num(entry['copies_ratio'])} "
              f"{_num(entry['time_ratio'])} {_num(fastest)} {psnr:>8} {str(entry['tiers_bitwise_equal']):>7}")
    if config.time_tiers:
        print(f"(ratios against the uncached run; time at tier {first}: median and fastest of {config.runs} "
              "interleaved rounds; for 'off' the uncached call timed twice, the noise floor)")
    print(f"\n{'copies: method@tier':<40} {'cached':>7} {'uncached':>8} {'saved':>6} {'wasted: head':>12} "
          f"{'other':>8} {'at end':>6} {'uncached wasted':>15}")
    for method, entry in report.items():
        for tier, c in entry["copies_by_tier"].items():
            w = c["wasted"]
            print(f"{method + '@' + tier:<40} {c['copies']:>7} {c['uncached_copies']:>8} "
                  f"{c.get('saved_by_cache', 0):>6} {w['head_block']:>12} {w['other']:>8} {w['at_end']:>6} "
                  f"{sum(c['uncached_wasted'].values()):>15}")


def print_goals(verdicts: dict) -> None:
    print("\ngoals:")
    for name, verdict in verdicts.items():
        state = {True: "PASS", False: "FAIL", None: "n/a"}[verdict["pass"]]
        print(f"  {state:<4} {name}: {verdict['detail']}")
