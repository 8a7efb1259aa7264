"""`vidmem plan --gpus N --cp balanced`: rows that memory-map the weights say so (+disk, and on_disk in
JSON), and "nothing fits" advises by what is over budget and by the flags already given."""

from __future__ import annotations

import json

from vidmem.cli import main

WAN14 = ["plan", "--model", "wan2.1-t2v-14b", "--size", "832x480", "--frames", "81", "--vram", "24", "--ram", "40",
         "--gpus", "2", "--cp", "balanced"]


def test_disk_rows_are_labelled_in_the_table_and_the_json(capsys):
    assert main(WAN14 + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = out["strategies"]
    assert [row["on_disk"] for row in rows] == [row["page_cache_bytes"] > 0 for row in rows]
    assert rows[out["recommended"]]["on_disk"] is True and not all(row["on_disk"] for row in rows)
    assert out["single_gpu"]["on_disk"] is True  # one key for "weights memory-mapped" in every plan the command prints
    assert main(WAN14) == 0
    lines = capsys.readouterr().out.splitlines()
    recommended = next(line for line in lines if line.endswith("<- recommended"))
    assert recommended.startswith("block_swap 15 +disk"), recommended
    assert next(line for line in lines if line.startswith("one GPU:")).startswith("one GPU: block_swap 15 +disk")
    assert any(line.startswith("+disk: weights memory-mapped") for line in lines)
    tiers = [line.split("  ")[0] for line in lines if line.startswith(("none", "model", "block_swap", "sequential"))]
    assert len(tiers) == len(set(tiers)) == 8, tiers  # each tier once in RAM, once on disk


def test_nothing_fits_names_the_encoders_gpu_and_does_not_ask_for_the_given_disk(capsys):
    args = ["plan", "--model", "wan2.1-t2v-1.3b", "--vram", "8", "--ram", "16", "--gpus", "2", "--cp", "balanced", "--disk"]
    assert main(args) == 1
    message = capsys.readouterr().out.rstrip().splitlines()[-1]
    assert "GPU 1 holds text_encoder whole (11.2 GiB)" in message, message
    assert "--disk" not in message and "One GPU of 8.0 GiB fits: sequential" in message, message
