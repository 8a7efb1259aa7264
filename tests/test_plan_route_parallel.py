"""GET /vidmem/plan with the Strategy's gpus and context_parallel: the rows per GPU that
`vidmem plan --gpus N --cp MODE` prints, the speedup against one GPU, and the Sampler's refusals."""

from __future__ import annotations

import json

import pytest

from vidmem.cli.plan import main as plan_main
from vidmem.nodes import host
from vidmem.nodes.plan_route import PlanRequestError, parse_request, plan_answer
from vidmem.pipelines.configs import load_model
from vidmem.pipelines.loader import DTYPES

WAN = "wan2.1-t2v-14b"
SIZE = {"width": "832", "height": "480", "frames": "81"}
VRAM_GB, RAM_GB = 24, 128
HOST_BUDGETS = (8 << 30, 16 << 30)  # the host's own, never used where the widgets give budgets


def answer(model: str = WAN, visible_gpus: int = 0, device: str = "cpu", **fields) -> dict:
    """The route's answer on a ComfyUI that shows `visible_gpus` GPUs (0: the usual CPU-only planning host)."""
    query = {"model": model, "dtype": "bf16", **SIZE, "offload": "auto", "vram_budget_gb": str(VRAM_GB),
             "ram_budget_gb": str(RAM_GB), **fields}
    request = parse_request(query, [model], list(DTYPES))
    return plan_answer(request, lambda name, dtype, *vae: load_model(name, dtype, *vae), HOST_BUDGETS, device=device,
                       visible_gpus=visible_gpus)


def cli_plan(capsys, *extra: str) -> dict:
    args = ["plan", "--model", WAN, "--size", "832x480", "--frames", "81", "--vram", str(VRAM_GB), "--ram", str(RAM_GB),
            "--json", *extra]
    assert plan_main(args) in (0, 1)
    return json.loads(capsys.readouterr().out)


def assert_same_rows(route: dict, cli: dict) -> None:
    """The route's rows are the command's rows, figure for figure, and it recommends the same one."""
    assert route["status"] == "ok", route
    assert [row["parallel"] for row in route["rows"]] == cli["strategies"]
    assert [row["peak_vram_bytes"] for row in route["rows"]] == [s["per_gpu_peak_bytes"] for s in cli["strategies"]]
    assert [row["peak_ram_bytes"] for row in route["rows"]] == [s["ram_bytes"] for s in cli["strategies"]]
    assert [row["fits"] for row in route["rows"]] == [s["fits"] for s in cli["strategies"]]
    assert route["chosen"] == cli["recommended"] is not None
    parallel = route["parallel"]
    assert (parallel["gpus"], parallel["mode"]) == (cli["gpus"], cli["cp"])
    assert parallel["speedup"] == cli["strategies"][cli["recommended"]]["speedup"]
    assert parallel["one_gpu"]["peak_vram_bytes"] == cli["single_gpu"]["peak_vram_bytes"]


def test_two_gpus_ulysses_are_the_command_s_plan(capsys):
    route, cli = answer(gpus="0,1", context_parallel="ulysses"), cli_plan(capsys, "--gpus", "2", "--cp", "ulysses")
    assert_same_rows(route, cli)
    parallel = route["parallel"]
    assert parallel["interconnect"] == {"name": "PCIe 4.0 x16", "gbps": 25.0, "assumed": "pcie4"}
    assert parallel["interconnect"]["name"] == cli["interconnect"]["name"]
    assert parallel["lines"][0].startswith("per GPU, 2 GPUs, ulysses over PCIe 4.0 x16 (25 GB/s per GPU, assumed)")
    assert f"speedup x{parallel['speedup']:.2f} against one GPU" in parallel["lines"][1]
    chosen = route["rows"][route["chosen"]]
    assert chosen["fits"] and chosen["speedup"] > 1  # two GPUs at 832x480x81 beat one
    # The chart's bars: each stage's VRAM is the fullest GPU's, the RAM every process's together.
    ranks = chosen["parallel"]["ranks"]
    for stage in chosen["stages"]:
        assert stage["vram_bytes"] == max(rank["stages"][stage["name"]] for rank in ranks)
        assert stage["ram_bytes"] == chosen["peak_ram_bytes"]
    assert route["time"]["speedup"] and route["time"]["shown"]
    for row in route["rows"]:
        assert bool(row["over_budget"]) == (row["fits"] is False)


def test_balanced_is_the_command_s_balanced_plan(capsys):
    route, cli = answer(gpus="0,1", context_parallel="off"), cli_plan(capsys, "--gpus", "2", "--cp", "balanced")
    assert_same_rows(route, cli)
    assert route["parallel"]["lines"][0].startswith("per GPU, 2 GPUs, balanced")
    chosen = route["rows"][route["chosen"]]["parallel"]
    assert [rank["components"] for rank in chosen["ranks"]] == [["transformer", "vae"], ["text_encoder"]]


def test_gpus_auto_counts_the_visible_gpus_under_context_parallelism():
    listed = answer("wan2.1-t2v-1.3b", gpus="0,1", context_parallel="ulysses", **{"frames": "33"})
    auto = answer("wan2.1-t2v-1.3b", visible_gpus=2, device="cuda", gpus="auto", context_parallel="ulysses",
                  **{"frames": "33"})
    assert listed["status"] == "ok" and auto == listed  # planned for the GPUs, whatever the host computes on


@pytest.mark.parametrize("fields, visible, input_name, words", [
    ({"gpus": "0,1", "context_parallel": "ulysses"}, 0, "context_parallel",
     "CogVideoXPipeline has no context-parallel plan in diffusers"),
    ({"gpus": "auto", "context_parallel": "ring"}, 0, "gpus", "this one shows none, so the plan cannot count them: list "
                                                             "the GPUs"),
    ({"gpus": "auto", "context_parallel": "ulysses"}, 1, "gpus", "needs two or more GPUs; only GPU 0 is used"),
    ({"gpus": "1", "context_parallel": "ulysses"}, 0, "gpus", "needs two or more GPUs; only GPU 1 is used"),
    ({"gpus": "cpu:2", "context_parallel": "ulysses"}, 0, "gpus", "this plan is for GPUs: list the GPUs"),
    ({"gpus": "0,x", "context_parallel": "off"}, 0, "gpus", "must be auto, GPU indices separated by commas"),
])
def test_refusals_name_the_input_and_the_fix(fields, visible, input_name, words):
    plan = answer("cogvideox-2b", visible_gpus=visible, **{"width": "720", "frames": "49"}, **fields)
    assert plan["status"] == "error" and plan["input"] == input_name, plan
    assert words in plan["error"]
    if input_name == "context_parallel":
        assert "Set context_parallel to off" in plan["error"]  # the fix, as the runtime words it


def test_the_sampler_s_own_refusals_of_the_size_and_the_windows():
    heads = answer("wan2.1-t2v-1.3b", gpus="0,1,2,3,4,5,6,7", context_parallel="ulysses")
    assert heads["input"] == "context_parallel" and "12 attention heads" in heads["error"], heads
    windows = answer("wan2.1-t2v-1.3b", gpus="0,1", context_parallel="ulysses", window="33", window_overlap="8")
    assert windows["input"] == "window" and "do not run with context parallelism" in windows["error"], windows
    mag = answer("wan2.1-t2v-1.3b", gpus="0,1", context_parallel="ulysses", cache_method="mag_cache",
                 cache_threshold="0", cache_retention="0.2", cache_max_skip_steps="3", cache_mag_ratios="auto")
    assert mag["status"] == "error" and "choose taylor_seer" in mag["error"], mag
    taylor = answer("wan2.1-t2v-1.3b", gpus="0,1", context_parallel="ulysses", cache_method="taylor_seer",
                    cache_threshold="0", cache_retention="0.2", cache_max_skip_steps="3", cache_mag_ratios="auto")
    assert taylor["status"] == "ok", taylor


def test_ranks_reopen_the_folder_only(tiny_folder, monkeypatch):
    folder = tiny_folder("wan2.1-t2v")
    monkeypatch.setattr(host, "resolve_model_folder", lambda name, given: folder)
    query = {"model": "Wan-tiny", "dtype": "fp32", "width": "32", "height": "32", "frames": "9", "gpus": "0,1",
             "context_parallel": "ulysses", "weight_dtype": "fp8_scaled"}
    plan = plan_answer(parse_request(query, ["Wan-tiny"], list(DTYPES)), lambda name, dtype: load_model(str(folder), dtype),
                       HOST_BUDGETS, device="cpu", visible_gpus=0)
    assert plan["input"] == "context_parallel" and "weight_dtype default" in plan["error"], plan


def test_one_gpu_is_the_plan_as_before(tiny_folder, monkeypatch):
    """gpus=auto with context_parallel off (the defaults), even on a machine with GPUs: the one-GPU
    answer, with no "parallel" key, exactly as a request that does not send them."""
    folder = tiny_folder("cogvideox-t2v")
    monkeypatch.setattr(host, "resolve_model_folder", lambda name, given: folder)

    def plan(**fields):
        query = {"model": "Cog-tiny", "dtype": "fp32", "width": "32", "height": "32", "frames": "9", **fields}
        return plan_answer(parse_request(query, ["Cog-tiny"], list(DTYPES)),
                           lambda name, dtype: load_model(str(folder), dtype), HOST_BUDGETS, device="cpu", visible_gpus=4)

    before = plan()
    assert before["status"] == "ok" and "parallel" not in before
    assert plan(gpus="auto", context_parallel="off") == before
    assert plan(gpus=" Auto ", context_parallel="off", offload="block_swap", blocks_to_swap="1")["rows"][-1]["label"] \
        == "your settings"


def test_a_bad_context_parallel_names_the_widget():
    with pytest.raises(PlanRequestError, match="context_parallel='tensor' must be one of off, ulysses, ring") as error:
        parse_request({"model": WAN, **SIZE, "context_parallel": "tensor"}, [WAN], list(DTYPES))
    assert error.value.name == "context_parallel"


def test_balanced_auto_on_the_chart_never_chooses_a_disk_row_the_loader_does_not_hold(capsys):
    """Balanced runs the pipeline as loaded, so with RAM below the weights the rows that fit memory-map them:
    a suggestion for the loader, which the command may recommend, never the chart's `auto` (the one-GPU chart
    and the Sampler's auto never pick them either)."""
    route = answer(gpus="0,1", context_parallel="off", ram_budget_gb="40")
    rows = route["rows"]
    assert any(row["fits"] and row["on_disk"] for row in rows)
    cli = cli_plan(capsys, "--gpus", "2", "--cp", "balanced", "--ram", "40")
    assert cli["strategies"][cli["recommended"]]["on_disk"]  # the command's advice: keep the weights on disk
    assert route["chosen"] is None or not rows[route["chosen"]]["on_disk"]
    assert route["chosen"] is None or rows[route["chosen"]]["fits"]
