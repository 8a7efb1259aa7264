"""bench/gpu_check.sh's parts for issues 28 and 24 (ACT_SECONDS, COMPILE_SECONDS, GOAL_SECONDS): the options the
script passes are ones the benches accept, checked by the benches' own parsers where there is no GPU; the compile
part's `--compile-tiers` runs the tiers named, in that order, and no other; the goal part measures what issue 24's
goal names and writes its JSON as it goes."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import speed  # noqa: E402  (puts the repository root on the path, for bench.support)
from bench.support.speed_compile import compile_rows  # noqa: E402
from bench.support.speed_goal import GOAL_SPEEDUP, goal_rows, goals, row_names_of  # noqa: E402
from bench.support.speed_runs import SpeedConfig, build  # noqa: E402
from vidmem.pipelines.compile import CompileSettings  # noqa: E402

SCRIPT = (ROOT / "bench" / "gpu_check.sh").read_text()


def _command(script_name: str, part: str = "compile", compiled: bool = False) -> list[str]:
    """The arguments bench/gpu_check.sh passes to `python3 bench/<script_name> --device cuda` (for speed.py,
    in the compile part; for activations.py, the eager block or, `compiled`, the compiled one), line continuations
    joined, shell variables left as written, redirections and optional arguments (`${VAR:+--option "$VAR"}`,
    absent when VAR is empty, as by default) dropped."""
    joined = re.sub(r'\$\{\w+:\+[^}]*\}', "", SCRIPT.replace("\\\n", " "))
    line = next(line for line in joined.splitlines() if f"python3 bench/{script_name}" in line and "--device cuda" in line
                and (("--compile " in line) == compiled if "activations" in script_name else f"--parts {part} " in line))
    words = line.split(f"python3 bench/{script_name}", 1)[1].split(">", 1)[0].split()
    return [word.strip('"') for word in words]


def test_the_gpu_check_runs_the_activation_block_with_options_the_bench_knows():
    import activations

    words = _command("activations.py")
    assert words[:2] == ["--device", "cuda"] and re.search(r"^ACT_SECONDS=\$\{ACT_SECONDS:-\d+\}", SCRIPT, re.M)
    args = activations.parse(["--device", "cpu", *words[2:]])  # the same options, parsed where there is no GPU
    assert args.tokens == (32760, 75600) and 1 in args.chunks and args.runs >= 3


def test_the_gpu_check_times_the_activation_block_compiled_at_480p():
    import activations

    words = _command("activations.py", compiled=True)
    assert re.search(r"^ACT_COMPILE_SECONDS=\$\{ACT_COMPILE_SECONDS:-\d+\}", SCRIPT, re.M)
    args = activations.parse(["--device", "cpu", *words[2:]])
    assert args.compile and args.tokens == (32760,) and args.chunks[0] == 1 and len(args.chunks) > 1


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


def test_a_lora_tier_times_compiled_blocks_with_a_lora_traced_into_the_graphs():
    """`none+lora`: tier none with a random LoRA on every block's linear layers, loaded from a real file, eager and
    compiled both carrying it; its hooks traced (no graph break), so its second run compiles nothing either."""
    torch._dynamo.reset()
    config = SpeedConfig(steps=1, blocks=2, runs=1, time_tiers=())
    loaded = build(config)
    found = compile_rows(loaded, config, CompileSettings(True, backend="aot_eager"), log=lambda line: None,
                         tier_names=("none", "none+lora"), lora_rank=4)
    torch._dynamo.reset()
    assert list(found["step_time_ratio"]) == ["none", "none+lora"]
    assert found["lora"] == {"rank": 4, "layers": 2 * 10, "skipped": 0}
    assert found["graph_breaks"] == {"none": 0, "none+lora": 0}
    assert found["recompiles_second_run"] == {"none": 0, "none+lora": 0}
    assert not getattr(loaded, "loras", ())  # the bench's own pipeline is left without the LoRA


def test_lora_tiers_are_the_compile_parts_only(capsys):
    args, _ = speed.parse(["--parts", "compile", "--blocks", "4", "--compile-tiers", "none,block_swap_4+lora"])
    assert args.compile_tiers == ("none", "block_swap_4+lora")
    error = _refusal(["--parts", "compile,goal", "--blocks", "4", "--compile-tiers", "none+lora"], capsys)
    assert "none+lora" in error and "compile part's only" in error
    assert "rank" in _refusal(["--parts", "compile", "--lora-rank", "0"], capsys)


def _refusal(argv: list[str], capsys) -> str:
    """What bench/speed.py's parser says when it refuses `argv` (it must refuse)."""
    with pytest.raises(SystemExit):
        speed.parse(argv)
    return capsys.readouterr().err


def test_an_unknown_compile_tier_is_refused_before_anything_is_built(capsys):
    error = _refusal(["--blocks", "4", "--compile-tiers", "none,block_swap_8"], capsys)
    assert "block_swap_8" in error and "block_swap_4" in error  # names the bad tier and the choices


def test_the_gpu_check_measures_the_goal_at_480p_with_options_the_speed_bench_knows():
    words = _command("speed.py", part="goal")
    assert re.search(r"^GOAL_SECONDS=\$\{GOAL_SECONDS:-\d+\}", SCRIPT, re.M)
    model = re.search(r"^GOAL_MODEL=\$\{GOAL_MODEL:-(\S+)\}", SCRIPT, re.M).group(1)
    args, config = speed.parse(["--device", "cpu", *(model if word == "$GOAL_MODEL" else word for word in words[2:])])
    assert (config.width, config.height, config.frames) == (832, 480, 81) and args.parts == "goal"
    assert config.model == "wan2.1-t2v-14b"  # the width the goal has not been measured at yet
    assert "--json" in words and config.runs >= 2
    assert '${GOAL_ROWS:+--goal-rows "$GOAL_ROWS"}' in SCRIPT
    rows = re.search(r"^GOAL_ROWS=\$\{GOAL_ROWS-(\S*)\}", SCRIPT, re.M).group(1)
    args, _ = speed.parse(["--parts", "goal", "--goal-rows", rows])  # the default rows are rows the bench has
    assert {kernel for kernel, _ in row_names_of(args.goal_rows)} == {"auto"}  # the kernel the 1.3B found fastest
    assert row_names_of(args.goal_rows)[0] == ("auto", "on")  # the row deciding the block swap verdict comes first


def test_the_goal_part_measures_each_setting_against_the_fp8_baseline_and_writes_as_it_goes():
    torch._dynamo.reset()
    config = SpeedConfig(steps=1, blocks=2, runs=1, time_tiers=())
    snapshots = []
    found = goal_rows(build(config), config, CompileSettings(True, backend="aot_eager"), log=lambda line: None,
                      on_row=lambda so_far: snapshots.append({name: list(row) for name, row in so_far["rows"].items()}))
    torch._dynamo.reset()
    rows = found["rows"]
    assert found["tiers"] == ["none", "block_swap_2"] and "fp8_scaled" in found["baseline"]
    assert set(rows) == {"auto+fp8_off", "auto+fp8_on", "sage+fp8_off", "sage+fp8_on"}
    assert all("needs a CUDA GPU" in rows[name]["skipped"] for name in ("sage+fp8_off", "sage+fp8_on"))
    for name in ("auto+fp8_off", "auto+fp8_on"):
        for tier in found["tiers"]:
            row = rows[name][tier]
            assert row["recompiles"] == 0 and not row["fallback"] and row["same_latents_both_calls"]
            assert row["step_time_ratio"] > 0  # present; its value is not a test
        assert set(rows[name]["block_swap_over_none"]) == {"block_swap_2"}
    # fp8 matmul really ran inside the compiled blocks, and only where asked; its latents differ by fp8's rounding
    assert rows["auto+fp8_off"]["none"]["fp8_layers"] == 0 < rows["auto+fp8_on"]["none"]["fp8_layers"]
    assert 35 < rows["auto+fp8_on"]["none"]["psnr_db"] < 80
    assert len(snapshots) == 4 and snapshots[0] == {"sage+fp8_off": ["skipped"], "auto+fp8_off": ["none"]}
    assert found["goals"]["fastest"] in ("auto+fp8_off", "auto+fp8_on") and found["goals"]["lines"]


def test_the_goal_verdicts_judge_the_fastest_row():
    def row(none, swapped):
        return {"none": {"step_time_ratio": none}, "block_swap_over_none": {"block_swap_4": swapped}}

    verdict = goals({"a": row(0.7, 1.01), "b": row(0.6, 1.05), "c": {"skipped": "no"}})
    assert verdict["fastest"] == "b" and verdict["met_speedup"] and not verdict["met_swap_overhead"]
    assert verdict["speedup"] == round(1 / 0.6, 3) and verdict["swap_overhead"] == 1.05
    assert not goals({"a": row(1 / GOAL_SPEEDUP + 0.01, 1.0)})["met_speedup"]
    assert goals({"c": {"skipped": "no"}})["fastest"] is None


def test_goal_rows_run_in_the_order_named_and_an_unknown_one_is_refused(capsys):
    """The order named is the order measured (a lease's limit cuts the last first), each row once."""
    from bench.support.speed_goal import ROWS

    assert row_names_of(()) == ROWS
    assert row_names_of(("auto+fp8_on", "sage+fp8_off")) == (("auto", "on"), ("sage", "off"))
    assert row_names_of(("auto+fp8_on", "auto+fp8_off", "auto+fp8_on")) == (("auto", "on"), ("auto", "off"))
    error = _refusal(["--parts", "goal", "--goal-rows", "auto+fp8_on,flash+fp8_on"], capsys)
    assert "flash+fp8_on" in error and "sage+fp8_off" in error  # names the bad row and the choices
    args, _ = speed.parse(["--parts", "goal", "--goal-rows", "auto+fp8_on"])
    assert args.goal_rows == ("auto+fp8_on",)


def test_the_model_gives_its_own_widths_on_cuda_and_the_narrow_ones_elsewhere():
    wide = SpeedConfig(model="wan2.1-t2v-14b", real_widths=True).describe()
    assert (wide["model"], wide["width"], wide["ffn"]) == ("wan2.1-t2v-14b", 5120, 13824)
    assert SpeedConfig(real_widths=True).describe()["width"] == 1536  # the 1.3B's, the default
    narrow = SpeedConfig(model="wan2.1-t2v-14b", heads=2, head_dim=8, ffn=32, blocks=1).transformer()
    assert (narrow["num_attention_heads"], narrow["attention_head_dim"], narrow["ffn_dim"], narrow["num_layers"]) == \
        (2, 8, 32, 1)
    _, config = speed.parse(["--parts", "goal", "--model", "wan2.1-t2v-14b"])
    assert config.model == "wan2.1-t2v-14b" and not config.real_widths  # the CPU keeps narrow widths


def test_the_cache_part_refuses_a_model_whose_magcache_ratios_it_does_not_have(capsys):
    error = _refusal(["--parts", "goal,cache", "--model", "wan2.1-t2v-14b"], capsys)
    assert "--model wan2.1-t2v-14b" in error and "wan2.1-t2v-1.3b" in error  # names the input and the fix
    assert "--model" in _refusal(["--model", "wan2.1-t2v-14b"], capsys)  # every part, the cache's among them
    assert "invalid choice" in _refusal(["--parts", "goal", "--model", "wan2.2-t2v-a14b"], capsys)


def test_a_compile_tier_that_fails_is_recorded_and_the_next_tier_still_runs(monkeypatch):
    """The lease's first compile tier is the new none+lora: should it raise on the GPU, tier none still runs."""
    from bench.support import speed_compile

    real = speed_compile._logged_row

    def failing_lora(tier, *args):
        if tier.endswith("+lora"):
            raise RuntimeError("a LoRA hook the graph could not trace")
        return real(tier, *args)

    monkeypatch.setattr(speed_compile, "_logged_row", failing_lora)
    torch._dynamo.reset()
    config = SpeedConfig(steps=1, blocks=2, runs=1, time_tiers=())
    lines, snapshots = [], []
    found = compile_rows(build(config), config, CompileSettings(True, backend="aot_eager"), log=lines.append,
                         tier_names=("none+lora", "none"), lora_rank=4, on_row=snapshots.append)
    torch._dynamo.reset()
    assert found["failed"] == {"none+lora": "RuntimeError: a LoRA hook the graph could not trace"}
    assert list(found["step_time_ratio"]) == ["none"] and len(snapshots) == 2
    assert any(line.startswith("  compile none+lora") and "FAILED" in line for line in lines)  # gpu_check.sh shows it


def test_a_goal_tier_that_fails_keeps_the_tiers_done_and_every_row_leaves_a_verdict_so_far(monkeypatch):
    """A failure under block swap keeps the row's tier none (the speed-up goal is judged on it), and after each
    tier the JSON has the verdict so far, so a lease cut short keeps one; off a GPU the figures get no verdict."""
    from bench.support import speed_goal

    def tier_row(stored, config, strategy, speed):
        if strategy.offload.value == "block_swap":
            raise RuntimeError("out of memory")
        return {"step_time_ratio": 0.6, "step_s": 1.0, "recompiles": 0, "psnr_db": None, "compile_seconds": 1.0,
                "fallback": ""}

    monkeypatch.setattr(speed_goal, "_tier_row", tier_row)
    config = SpeedConfig(steps=1, blocks=2, runs=1, time_tiers=())
    snapshots = []
    found = goal_rows(build(config), config, log=lambda line: None, row_names=("auto+fp8_off",),
                      on_row=lambda so_far: snapshots.append(dict(so_far["goals"])))
    row = found["rows"]["auto+fp8_off"]
    assert row["none"]["step_time_ratio"] == 0.6 and row["failed"].startswith("block_swap_2: RuntimeError")
    assert snapshots and snapshots[0]["fastest"] == "auto+fp8_off"
    assert found["goals"]["fastest"] == "auto+fp8_off" and found["goals"]["met_speedup"] is None  # the CPU: not judged
    assert "not judged off a GPU" in found["goals"]["lines"][0]
    assert goals({"auto+fp8_off": {"none": {"step_time_ratio": 0.6}}}, judged=True)["met_speedup"]


def test_the_goal_measures_its_rows_in_the_order_named(monkeypatch):
    """gpu_check.sh names auto+fp8_on first: it must be measured first, so that a lease cut short keeps its verdict."""
    from bench.support import speed_goal

    measured = []

    def tier_row(stored, config, strategy, speed):
        measured.append(f"{speed.attention.value}+fp8_{speed.fp8_matmul.value}")
        return {"step_time_ratio": 0.6, "step_s": 1.0, "recompiles": 0, "psnr_db": None, "compile_seconds": 1.0,
                "fallback": ""}

    monkeypatch.setattr(speed_goal, "_tier_row", tier_row)
    config = SpeedConfig(steps=1, blocks=2, runs=1, time_tiers=())
    found = goal_rows(build(config), config, log=lambda line: None, row_names=("auto+fp8_on", "auto+fp8_off"))
    assert list(found["rows"]) == ["auto+fp8_on", "auto+fp8_off"]
    assert measured == ["auto+fp8_on", "auto+fp8_on", "auto+fp8_off", "auto+fp8_off"]  # tiers none, block swap each
