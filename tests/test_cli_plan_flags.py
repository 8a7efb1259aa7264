"""`vidmem plan`'s flags: numbers that cannot describe a machine or a run are refused with exit 2 and
a message naming the flag, never a traceback or a plan of something else (--frames 0 planned as 81)."""

from __future__ import annotations

import pytest

from vidmem.cli import main

PLAN = ["plan", "--model", "wan2.1-t2v-1.3b", "--vram", "8", "--ram", "16"]


@pytest.mark.parametrize("flags, message", [
    (["--vram", "inf"], "--vram inf must be a positive finite number, a budget in GiB"),
    (["--vram", "nan"], "--vram nan must be a positive finite number"),
    (["--ram", "1e400"], "--ram inf must be a positive finite number"),
    (["--ram", "-2"], "--ram -2.0 must be a positive finite number"),
    (["--disk", "--disk-gbps", "nan"], "--disk-gbps nan must be a positive finite number, a read rate in GB/s"),
    (["--frames", "0"], "--frames 0 must be at least 1"),
    (["--steps", "0"], "--steps 0 must be from 1 to 1000"),
    (["--steps", "-5", "--cache", "mag_cache"], "--steps -5 must be from 1 to 1000"),
    (["--steps", "1001"], "--steps 1001 must be from 1 to 1000"),
    (["--activation-chunks", "3"], "--activation-chunks 3 must be one of auto, off, 2, 4, 8, 16, 32, 64"),
], ids=["vram-inf", "vram-nan", "ram-overflow", "ram-negative", "disk-nan", "frames-0", "steps-0", "steps-neg-cache",
        "steps-1001", "chunks-3"])
def test_numbers_that_describe_no_machine_or_run_are_refused_naming_the_flag(flags, message, capsys):
    assert main(PLAN + flags) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


@pytest.mark.parametrize("flags, message", [
    (["--prefetch", "-1"], "vidmem: --prefetch -1 must be 0 or more"),
    (["--batch", "0"], "vidmem: --batch 0 must be at least 1"),
    (["--size", "0x0"], "vidmem: --size width 0 must be a multiple of 16, at least 16"),
    (["--window-overlap", "16"], "vidmem: --window-overlap 16 needs a window: set --window (e.g. 81) or "
                                 "--window-overlap to 0."),
])
def test_engine_refusals_are_written_as_the_flags(flags, message, capsys):
    assert main(PLAN + flags) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flags, named", [
    (["--window", "81"], "--window plans sampling"),
    (["--disk"], "--disk plans sampling"),
    (["--cache", "mag_cache"], "--cache plans sampling"),
    (["--window", "81", "--window-overlap", "16", "--disk-gbps", "1"], "--window, --window-overlap, --disk-gbps plan sampling"),
    (["--device", "cpu"], "--device plans sampling"),
    (["--allocator", "cudaMallocAsync", "--text-encoder", "device", "--no-cfg", "--activation-chunks", "64",
      "--vae-dtype", "fp32", "--steps", "1"],
     "--allocator, --text-encoder, --no-cfg, --activation-chunks, --vae-dtype, --steps plan sampling"),
])
def test_train_refuses_the_sampling_flags_it_would_ignore(flags, named, capsys):
    assert main(PLAN + ["--train"] + flags) == 2
    assert named in capsys.readouterr().err


def test_the_node_choices_and_train_without_sampling_flags_still_plan(capsys):
    assert main(PLAN + ["--activation-chunks", "4", "--steps", "1", "--frames", "1", "--json"]) in (0, 1)
    assert main(PLAN + ["--train", "--size", "320x192", "--frames", "9", "--json"]) in (0, 1)


@pytest.mark.parametrize("flags, message", [
    (["--device", "cpu"], "--device cpu plans the CPU computing; --gpus 2 plans GPUs"),
    (["--cache", "mag_cache"], "--cache mag_cache is planned on one GPU only; drop it with --gpus 2"),
])
def test_gpus_refuses_the_flags_it_would_drop(flags, message, capsys):
    assert main(PLAN + ["--gpus", "2"] + flags) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("value", ["inf", "nan", "0"])
def test_an_interconnect_rate_must_be_finite_and_positive(value, capsys):
    assert main(PLAN + ["--gpus", "2", "--interconnect-gbps", value]) == 2
    assert f"--interconnect-gbps {float(value)} must be a positive finite number" in capsys.readouterr().err


def test_a_tiny_budget_is_printed_with_its_digits(capsys):
    """--ram 0.001 read "0.0 GiB RAM" in the table's head and in the advice: as if no RAM were given."""
    assert main(["plan", "--model", "wan2.1-t2v-1.3b", "--size", "832x480", "--frames", "81", "--vram", "8",
                 "--ram", "0.001"]) == 1
    out = capsys.readouterr().out
    assert "budget 8.0 GiB VRAM, 0.001 GiB RAM" in out and "> 0.001 GiB" in out and " 0.0 GiB" not in out


def test_rows_slowed_by_encoding_on_the_cpu_say_so(capsys):
    """Wan 1.3B on 8 GiB: the rows that fit whole encode the prompt on the CPU, and that is their slowdown
    (x1.15 at 30 steps against sequential's x1.01): a line under the table says what it adds, from the same
    time model (the share follows the steps: fewer steps, a larger share)."""
    shares = {}
    for steps in ("30", "10"):
        assert main(["plan", "--model", "wan2.1-t2v-1.3b", "--vram", "8", "--ram", "32", "--steps", steps]) == 0
        out = capsys.readouterr().out
        line = next(line for line in out.splitlines() if line.startswith("text enc. cpu: "))
        shares[steps] = int(line.split("adds about ")[1].split("%")[0])
        cpu_row = next(line for line in out.splitlines() if line.startswith("none "))
        assert f"x{1 + shares[steps] / 100:.2f}" in cpu_row or abs(
            float(cpu_row.split(" x")[1].split()[0]) - (1 + shares[steps] / 100)) <= 0.011, (cpu_row, line)
    assert 5 < shares["30"] < shares["10"]
    # No such row, no such line.
    assert main(["plan", "--model", "wan2.1-t2v-1.3b", "--vram", "24", "--ram", "64", "--text-encoder", "device"]) == 0
    assert "text enc. cpu:" not in capsys.readouterr().out


def test_the_tiles_column_says_all_where_one_temporal_tile_holds_the_clip(capsys):
    """CogVideoX-5b, 49 frames: the plan's temporal tile is the clip rounded up to the VAE's 4-frame grid (52),
    shown as "all", not "52f"; a shorter tile keeps its frame count; a line under the table explains the column."""
    from vidmem.memory.plan.candidates import tiles_text
    from vidmem.memory.strategy import VaeTiling

    assert tiles_text(None, 49) == "-"
    assert tiles_text(VaeTiling(tile_size=416, temporal_size=52), 49) == "416px/all"
    assert tiles_text(VaeTiling(tile_size=256, temporal_size=16), 49) == "256px/16f"
    assert main(["plan", "--model", "cogvideox-5b", "--vram", "8", "--ram", "64"]) == 0
    out = capsys.readouterr().out
    assert "px/all" in out and "px/52f" not in out and "VAE tiles: the decode's tile side in pixels" in out


def test_a_cpu_plan_needs_no_vram_budget_and_says_the_cpu_computes(capsys, monkeypatch):
    """--device cpu on a machine without a GPU: the RAM budget is the compute's (no --vram asked for, none shown)."""
    import json

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cpu = ["plan", "--model", "wan2.1-t2v-1.3b", "--device", "cpu", "--ram", "32"]
    assert main(cpu) == 0
    out = capsys.readouterr().out
    assert "budget 32.0 GiB RAM (the CPU computes)" in out and "VRAM" not in out.splitlines()[0]
    assert "peak compute" in out
    assert main(cpu + ["--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert planned["device"] == "cpu" and planned["vram_bytes"] is None and planned["ram_bytes"] == 32 << 30
    assert main(["plan", "--model", "wan2.1-t2v-1.3b", "--device", "cpu"]) == 0  # no budget at all: this machine's RAM
    assert "RAM (the CPU computes)" in capsys.readouterr().out
    assert main(["plan", "--model", "wan2.1-t2v-1.3b", "--ram", "32"]) == 2  # a GPU plan still needs a budget
    assert "give the budget to plan for, e.g. --vram 12" in capsys.readouterr().err


def test_json_holds_what_the_table_prints(capsys):
    """--json carries the strategy and VAE tiles as the table writes them, the budgets, the steps, and the paragraphs
    under the table (windows, cold and warm, the step cache)."""
    import json

    flags = PLAN + ["--cache", "mag_cache", "--frames", "161", "--window", "81", "--window-overlap", "16"]
    assert main(flags) in (0, 1)
    table = capsys.readouterr().out
    assert main(flags + ["--json"]) in (0, 1)
    planned = json.loads(capsys.readouterr().out)
    assert planned["vram_bytes"] == 8 << 30 and planned["ram_bytes"] == 16 << 30 and planned["steps"] == 50
    assert planned["cache"]["method"] == "mag_cache" and planned["cache"]["text"] in table
    assert planned["windows"] in table
    if planned["recommended"] is not None:
        assert planned["warm"] in table
    for row in planned["strategies"]:
        assert row["strategy"] and row["vae_tiles"] in table


def test_the_default_allocator_is_named_with_the_flag_that_gives_comfyuis_figures(capsys):
    assert main(PLAN) == 0
    out = capsys.readouterr().out
    assert "native allocator" in out.splitlines()[0] and "--allocator cudaMallocAsync gives its figures" in out
    assert main(PLAN + ["--allocator", "cudaMallocAsync"]) == 0
    out = capsys.readouterr().out
    assert "cudaMallocAsync allocator" in out.splitlines()[0] and "gives its figures" not in out


@pytest.mark.parametrize("flags, named", [
    (["--rank", "32"], "--rank plans a LoRA training step; without --train the plan is for sampling"),
    (["--optimizer", "adamw_8bit", "--no-checkpointing"], "--optimizer, --no-checkpointing plan a LoRA training step"),
    (["--targets", "to_q", "--activation-offload"], "--targets, --activation-offload plan a LoRA training step"),
    (["--max-pinned-ram-gb", "4"], "--max-pinned-ram-gb plans a LoRA training step"),
    (["--cp", "ring"], "--cp plans a run on several GPUs; without --gpus the plan is one GPU's"),
    (["--gpus", "1", "--interconnect", "nvlink", "--interconnect-gbps", "50"],
     "--interconnect, --interconnect-gbps plan a run on several GPUs; with --gpus 1 the plan is one GPU's"),
])
def test_flags_the_plan_would_ignore_are_refused_naming_them(flags, named, capsys):
    """A training flag without --train, a several-GPU flag without --gpus 2 or more: the plan printed would not
    read them, as --train does not read the sampling flags."""
    assert main(PLAN + flags) == 2
    assert named in capsys.readouterr().err


def test_the_ignored_flag_tables_hold_the_parsers_defaults():
    """Each table entry's default is the parser's: else the flag reads as given when it was not (or the reverse)."""
    import argparse

    from vidmem.cli.plan import add_plan_parser
    from vidmem.cli.plan_parallel import PARALLEL_ONLY
    from vidmem.cli.plan_train import SAMPLING_ONLY, TRAIN_ONLY

    parsed = vars(add_plan_parser(argparse.ArgumentParser().add_subparsers()).parse_args([]))
    for flag, name, default in (*SAMPLING_ONLY, *TRAIN_ONLY, *PARALLEL_ONLY):
        assert flag.removeprefix("--").replace("-", "_") == name and parsed[name] == default, (flag, parsed[name])


def test_windows_under_context_parallelism_are_refused_naming_window(capsys):
    """The Sampler refuses context windows with context parallelism: no plan of a run that cannot start.
    Balanced placement splits nothing and runs them."""
    windows = ["--window", "41", "--window-overlap", "16"]
    assert main(PLAN + ["--gpus", "2", *windows]) == 2
    assert "--window 41: context windows do not run with context parallelism yet" in capsys.readouterr().err
    assert main(PLAN + ["--gpus", "2", "--cp", "balanced", *windows]) in (0, 1)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("message, spelled", [
    ("activation_chunks=2 with context_parallel=ring: a rank's blocks", "--activation-chunks 2 with --cp ring: a rank"),
    ("context_parallel=ulysses with 5 ranks; use 2 GPUs (or CPU processes, gpus=cpu:N), or context_parallel=ring",
     "--cp ulysses with 5 ranks; use 2 GPUs (or CPU processes, gpus=cpu:N), or --cp ring"),
    ("seed=-1 must be between 0 and 18446744073709551615.", "--seed -1 must be between"),
    ("gpus=0 must be at least 1.", "--gpus 0 must be at least 1."),
    ("tile_width=3 and warmup_steps=2 stay", "tile_width=3 and warmup_steps=2 stay"),
    # a path the message quotes keeps its folders named like inputs
    ("model folder '/runs/frames=81/seed=7/model' does not exist", "model folder '/runs/frames=81/seed=7/model'"),
    ("--out /tmp/out/seed=7: cannot write there", "--out /tmp/out/seed=7: cannot write there"),
    ("(seed=3 and gpus=2)", "(--seed 3 and --gpus 2)"),
])
def test_engine_messages_name_every_input_a_flag_sets_as_the_flag(message, spelled):
    from vidmem.cli.plan import in_flag_spelling

    assert in_flag_spelling(message).startswith(spelled)


def test_a_ulysses_refusal_names_cp_not_the_node_input(capsys):
    assert main(PLAN + ["--gpus", "5"]) == 2
    err = capsys.readouterr().err
    assert "vidmem: --cp ulysses with 5 ranks" in err and "or on CUDA GPUs --cp ring" in err, err


@pytest.mark.parametrize("flag, value, unit", [("--vram", "8GB", "GiB, e.g. 8"), ("--ram", "32 GiB", "GiB, e.g. 8"),
                                               ("--disk-gbps", "3GB/s", "GB/s, e.g. 3"),
                                               ("--interconnect-gbps", "fast", "GB/s, e.g. 25")])
def test_a_number_with_a_unit_is_refused_naming_the_unit(flag, value, unit, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(PLAN + [flag, value])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"argument {flag}: {value!r} is not a number: give a number of {unit}" in err, err
