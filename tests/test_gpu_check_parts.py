"""bench/gpu_check.sh's parts for issues 28 and 24 (ACT_SECONDS, COMPILE_SECONDS): the options the script passes
are ones the benches accept, checked by the benches' own parsers where there is no GPU, and the compile part's
`--compile-tiers` runs the tiers named, in that order, and no other."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import speed  # noqa: E402  (puts the repository root on the path, for bench.support)
from bench.support.speed_compile import compile_rows  # noqa: E402
from bench.support.speed_runs import SpeedConfig, build  # noqa: E402
from vidmem.pipelines.compile import CompileSettings  # noqa: E402

SCRIPT = (ROOT / "bench" / "gpu_check.sh").read_text()


def _command(script_name: str) -> list[str]:
    """The arguments bench/gpu_check.sh passes to `python3 bench/<script_name> --device cuda` (for speed.py,
    in the compile part), line continuations joined, shell variables left as written, redirections dropped."""
    joined = SCRIPT.replace("\\\n", " ")
    line = next(line for line in joined.splitlines() if f"python3 bench/{script_name}" in line and "--device cuda" in line
                and ("activations" in script_name or "--parts compile " in line))
    words = line.split(f"python3 bench/{script_name}", 1)[1].split(">", 1)[0].split()
    return [word.strip('"') for word in words]


def test_the_gpu_check_runs_the_activation_block_with_options_the_bench_knows():
    import activations

    words = _command("activations.py")
    assert words[:2] == ["--device", "cuda"] and re.search(r"^ACT_SECONDS=\$\{ACT_SECONDS:-\d+\}", SCRIPT, re.M)
    args = activations.parse(["--device", "cpu", *words[2:]])  # the same options, parsed where there is no GPU
    assert args.tokens == (32760, 75600) and 1 in args.chunks and args.runs >= 3


def test_the_gpu_check_compiles_at_480p_on_tiers_the_speed_bench_has():
    words = _command("speed.py")
    tiers = re.search(r"^COMPILE_TIERS=\$\{COMPILE_TIERS:-(\S+)\}", SCRIPT, re.M).group(1)
    assert re.search(r"^COMPILE_SECONDS=\$\{COMPILE_SECONDS:-\d+\}", SCRIPT, re.M)
    argv = [tiers if word == "$COMPILE_TIERS" else word for word in words]
    args, config = speed.parse(["--device", "cpu", *argv[2:]])  # parse checks the tiers against --blocks
    assert (config.width, config.height, config.frames) == (832, 480, 81) and args.parts == "compile"
    assert "none" in args.compile_tiers


def test_compile_tiers_runs_the_tiers_named_in_their_order():
    torch._dynamo.reset()
    config = SpeedConfig(steps=1, blocks=2, runs=1, time_tiers=())
    found = compile_rows(build(config), config, CompileSettings(True, backend="aot_eager"), log=lambda line: None,
                         tier_names=("block_swap_2", "none"))
    torch._dynamo.reset()
    assert list(found["step_time_ratio"]) == ["block_swap_2", "none"]
    assert all(count == 0 for count in found["recompiles_second_run"].values())


def test_an_unknown_compile_tier_is_refused_before_anything_is_built(capsys):
    try:
        speed.parse(["--blocks", "4", "--compile-tiers", "none,block_swap_8"])
    except SystemExit:
        pass
    else:
        raise AssertionError("--compile-tiers block_swap_8 at 4 blocks was accepted")
    error = capsys.readouterr().err
    assert "block_swap_8" in error and "block_swap_4" in error  # names the bad tier and the choices
