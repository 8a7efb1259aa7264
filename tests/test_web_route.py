"""GET /vidmem/memory: registered only inside a running ComfyUI, once, and answering memory figures
only (RAM, process RSS, per CUDA device), never creating a CUDA context on a CPU-only server."""

from __future__ import annotations

import asyncio
import json
import re
import sys
import threading
import types

import pytest
import torch

from vidmem.memory.units import GiB
from vidmem.nodes import host, routes


class Routes(list):
    """The slice of aiohttp's RouteTableDef that register_routes uses."""

    def get(self, path):
        def add(handler):
            self.append(types.SimpleNamespace(method="GET", path=path, handler=handler))
            return handler

        return add


@pytest.fixture
def comfy_server(monkeypatch):
    routes = Routes()
    prompt_server = type("PromptServer", (), {"instance": types.SimpleNamespace(routes=routes)})
    monkeypatch.setitem(sys.modules, "server", types.SimpleNamespace(PromptServer=prompt_server))
    return routes


def test_registers_once_inside_comfyui(comfy_server):
    assert routes.register_routes() is True
    assert [(r.method, r.path) for r in comfy_server] == [("GET", "/vidmem/memory"), ("GET", "/vidmem/plan")]
    assert routes.register_routes() is False, "a second call must not add a duplicate route"
    assert len(comfy_server) == 2


def test_does_nothing_without_comfyui(monkeypatch):
    monkeypatch.delitem(sys.modules, "server", raising=False)
    assert routes.register_routes() is False
    monkeypatch.setitem(sys.modules, "server", types.SimpleNamespace())  # some unrelated "server" module
    assert routes.register_routes() is False


def test_figures_are_memory_only_and_cpu_lists_no_device():
    figures = routes.memory_figures()
    assert set(figures) == {"ram", "process_rss_bytes", "cuda", "vidmem_kept_bytes"}
    assert figures["vidmem_kept_bytes"] >= 0
    assert set(figures["ram"]) == {"total_bytes", "available_bytes"}
    assert 0 < figures["ram"]["available_bytes"] <= figures["ram"]["total_bytes"]
    assert figures["process_rss_bytes"] > 0
    if not torch.cuda.is_initialized():
        assert figures["cuda"] == []
    json.dumps(figures)


def test_cuda_figures_per_device(monkeypatch):
    """Two devices: the one in use reports driver free/total, the idle one only its total (no context)."""
    gib = GiB
    cuda = torch.cuda
    monkeypatch.setattr(cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(cuda, "device_count", lambda: 2)
    monkeypatch.setattr(cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cuda, "memory_reserved", lambda i: [3 * gib, 0][i])
    monkeypatch.setattr(cuda, "memory_allocated", lambda i: [2 * gib, 0][i])
    asked = []
    monkeypatch.setattr(cuda, "mem_get_info", lambda i: asked.append(i) or (5 * gib, 8 * gib))
    monkeypatch.setattr(cuda, "get_device_properties", lambda i: types.SimpleNamespace(total_memory=24 * gib, name="secret"))
    figures = routes.memory_figures()
    assert figures["cuda"] == [
        {"index": 0, "allocated_bytes": 2 * gib, "reserved_bytes": 3 * gib, "free_bytes": 5 * gib, "total_bytes": 8 * gib},
        {"index": 1, "allocated_bytes": 0, "reserved_bytes": 0, "free_bytes": None, "total_bytes": 24 * gib},
    ]
    assert asked == [0], "mem_get_info would create a CUDA context on an idle device"
    assert "secret" not in json.dumps(figures)


def test_handler_answers_json(comfy_server):
    web = pytest.importorskip("aiohttp.web")
    routes.register_routes()
    response = asyncio.run(comfy_server[0].handler(None))  # the memory route
    assert isinstance(response, web.Response) and response.content_type == "application/json"
    assert response.headers["Cache-Control"] == "no-store"
    assert set(json.loads(response.body)) == {"ram", "process_rss_bytes", "cuda", "vidmem_kept_bytes"}


# --- GET /vidmem/plan ------------------------------------------------------------------------------

from vidmem.nodes.plan_route import PlanRequestError, PlanService, parse_request, plan_answer  # noqa: E402

TINY = "Wan-tiny"  # the name the tiny folder is listed under in these tests


def query(**change):
    base = dict(model=TINY, dtype="fp32", offload="block_swap", blocks_to_swap="1", prefetch_blocks="1",
                max_pinned_ram_gb="-1", non_blocking="true", text_encoder="cpu", vae_slicing="false",
                vae_tiling="true", tile_size="64", overlap="16", temporal_size="8", temporal_overlap="4",
                vram_budget_gb="1", ram_budget_gb="64", width="32", height="32", frames="9", cfg="5")
    return {k: v for k, v in (base | change).items() if v is not None}


@pytest.fixture
def planner(tiny_folder):
    from vidmem.pipelines.configs import load_model

    folder = tiny_folder("wan2.1-t2v")
    loads = []

    def plannable(name, dtype):
        loads.append(name)
        return load_model(str(folder), dtype)

    return lambda request: plan_answer(request, plannable, (8 * GiB, 64 * GiB)), loads


@pytest.mark.parametrize("change, name", [
    (dict(model="/etc/passwd"), "model"), (dict(model=None), "model"), (dict(dtype="int4"), "dtype"),
    (dict(offload="fast"), "offload"), (dict(blocks_to_swap="2.5"), "blocks_to_swap"),
    (dict(prefetch_blocks="99"), "prefetch_blocks"), (dict(non_blocking="maybe"), "non_blocking"),
    (dict(vram_budget_gb="-5"), "vram_budget_gb"), (dict(width="-16"), "width"), (dict(frames="0"), "frames"),
    (dict(cfg="nan"), "cfg"), (dict(ram_budget_gb="inf"), "ram_budget_gb"),
])
def test_plan_request_names_the_bad_parameter(change, name):
    with pytest.raises(PlanRequestError) as caught:
        parse_request(query(**change), [TINY], ["fp32", "bf16"])
    assert caught.value.name == name and name in str(caught.value)


def test_plan_rows_per_tier_with_the_users_row_chosen(planner):
    answer, loads = planner
    plan = answer(parse_request(query(), [TINY], ["fp32"]))
    assert plan["status"] == "ok" and not plan["auto"]
    labels = [row["label"] for row in plan["rows"]]
    assert [label.split()[0] for label in labels[:4]] == ["none", "model", "block_swap", "sequential"]
    assert re.fullmatch(r"block_swap \d+", labels[2]) and labels[-1] == "your settings"
    assert set(plan["time"]) == {"shown", "resolution", "range", "relative_to"}
    assert plan["chosen"] == len(labels) - 1 and "blocks_to_swap=1" in plan["rows"][-1]["strategy"]
    assert plan["budgets"] == {"vram_bytes": GiB, "ram_bytes": 64 * GiB}
    for row in plan["rows"]:
        assert [s["name"] for s in row["stages"]] == ["text_encode", "denoise", "decode"]
        assert row["peak_vram_bytes"] == max(s["vram_bytes"] for s in row["stages"]) > 0
    json.dumps(plan)
    assert loads == [TINY]


def test_auto_marks_the_planners_choice(planner):
    answer, _ = planner
    auto = answer(parse_request(query(offload="auto", blocks_to_swap="0"), [TINY], ["fp32"]))
    assert auto["auto"] and "your settings" not in [r["label"] for r in auto["rows"]]
    assert auto["chosen"] is not None and auto["rows"][auto["chosen"]]["fits"]


def test_more_swapped_blocks_lower_the_denoise_peak_of_a_real_size_model():
    """Wan 2.1 1.3B's shipped config on meta at 832x480x81: the tiny model's blocks vanish in the CUDA context."""
    from vidmem.pipelines.configs import load_model

    def denoise_mib(blocks: int) -> int:
        q = query(model="wan", dtype="bf16", blocks_to_swap=str(blocks), width="832", height="480", frames="81",
                  tile_size="256", overlap="32", temporal_size="64", temporal_overlap="8", vram_budget_gb="8")
        plan = plan_answer(parse_request(q, ["wan"], ["bf16"]), lambda n, d: load_model("wan2.1-t2v-1.3b", d),
                           (8 * GiB, 64 * GiB))
        return next(s["vram_bytes"] for s in plan["rows"][-1]["stages"] if s["name"] == "denoise")

    assert denoise_mib(10) < denoise_mib(5)


def test_a_real_size_plan_over_budget_says_per_stage_what_would_fit_and_drops_a_time_column_that_says_nothing():
    """Wan 2.1 14B at 832x480x81, bf16 weights in RAM, 8 GB card, 32 GB of RAM, block swap 30: every
    tier's time is within the model's resolution (the copies hide behind compute), so no time column;
    each stage over a budget gets one line with the change that makes it fit."""
    from vidmem.pipelines.configs import load_model

    q = query(model="wan", dtype="bf16", blocks_to_swap="30", text_encoder="offload_after_encoding", width="832",
              height="480", frames="81", tile_size="256", overlap="32", temporal_size="64", temporal_overlap="8",
              vram_budget_gb="8", ram_budget_gb="32", activation_chunks="off")  # chunks' slices cost time: shown
    plan = plan_answer(parse_request(q, ["wan"], ["bf16"]), lambda n, d: load_model("wan2.1-t2v-14b", d), (8 * GiB, 32 * GiB),
                       device="cuda")
    assert plan["status"] == "ok" and plan["time"]["shown"] is False, plan["time"]
    assert plan["time"]["relative_to"] == "the same run with every weight on the GPU and the decode in one piece"
    mine = plan["rows"][plan["chosen"]]
    assert mine["label"] == "your settings" and not mine["fits"]
    assert [line.split(":")[0] for line in mine["over_budget"]] == ["text encode", "denoise", "decode"]
    encode, denoise, decode = mine["over_budget"]
    assert re.fullmatch(r"text encode: VRAM \d+\.\d > 8\.0 GiB, RAM \d+\.\d > 32\.0 GiB; "
                        r"fix: text encoder on the CPU, weights on disk", encode), encode
    assert re.fullmatch(r"denoise: VRAM .*; fix: blocks_to_swap (\d+), weights on disk", denoise), denoise
    assert decode.endswith("fix: weights on disk")
    assert "+disk" in " ".join(row["label"] for row in plan["rows"])  # weights in RAM: the planner tried the disk tier


@pytest.mark.parametrize("change, name", [
    (dict(tile_size="100"), "tile_size"), (dict(overlap="64"), "overlap"),
    (dict(blocks_to_swap="99"), "blocks_to_swap"), (dict(frames="10"), "frames"),
])
def test_plan_reports_a_bad_combination_on_its_input(planner, change, name):
    answer, _ = planner
    plan = answer(parse_request(query(**change), [TINY], ["fp32"]))
    assert plan["status"] == "error" and plan["input"] == name, plan


def test_a_blocks_to_swap_the_tier_ignores_is_planned_with_a_note(planner):
    answer, _ = planner
    plan = answer(parse_request(query(offload="none", blocks_to_swap="3"), [TINY], ["fp32"]))
    assert plan["status"] == "ok" and plan["rows"][-1]["strategy"].startswith("offload=none"), plan
    assert plan["notes"] == ["blocks_to_swap=3 ignored: it applies only to offload=block_swap (offload is none)."]
    assert answer(parse_request(query(), [TINY], ["fp32"]))["notes"] == []


def test_service_caches_and_drops_superseded_requests():
    calls = []
    started = threading.Event()
    release = threading.Event()

    def slow(request):
        calls.append(request.shape.frames)
        started.set()
        release.wait(5)
        return {"status": "ok", "frames": request.shape.frames}

    service = PlanService(slow)
    first, second, third = (parse_request(query(frames=str(f)), [TINY], ["fp32"]) for f in (9, 13, 17))

    async def scenario():
        running = asyncio.create_task(service.plan(first, "node-2"))
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 5)
        waiting = asyncio.create_task(service.plan(second, "node-2"))
        await asyncio.sleep(0.05)
        newest = asyncio.create_task(service.plan(third, "node-2"))  # replaces `second` before it ran
        await asyncio.sleep(0.05)
        release.set()
        results = await asyncio.gather(running, waiting, newest)
        again = await service.plan(third, "node-2")
        return results, again

    (a, b, c), again = asyncio.run(scenario())
    assert a["frames"] == 9 and b == {"status": "superseded"} and c["frames"] == 17
    assert calls == [9, 17] and service.computed == 2
    assert again["cached"] is True and again["frames"] == 17 and calls == [9, 17]
    assert service._latest == {}  # nothing kept per client once answered: every page load asks as a new one


def test_a_page_flood_of_clients_keeps_nothing_per_client():
    service = PlanService(lambda request: {"status": "ok", "frames": request.shape.frames})
    requests = [parse_request(query(frames=str(9 + 4 * (i % 3))), [TINY], ["fp32"]) for i in range(50)]

    async def flood():
        return await asyncio.gather(*(service.plan(r, f"page-{i}:7") for i, r in enumerate(requests)))

    answers = asyncio.run(flood())
    assert all(a["status"] == "ok" for a in answers) and service._latest == {}


def test_wan22s_second_guidance_scale_keeps_the_negative_pass_as_the_sampler_does():
    """cfg 1 and cfg_2 3.5: the low-noise expert still runs the negative prompt's pass (nodes/sampler.py guided)."""
    assert parse_request(query(cfg="1.0", cfg_2="3.5"), [TINY], ["fp32"]).shape.cfg is True
    assert parse_request(query(cfg="1.0"), [TINY], ["fp32"]).shape.cfg is False
    assert parse_request(query(cfg="1.0", cfg_2="-1"), [TINY], ["fp32"]).shape.cfg is False
    with pytest.raises(PlanRequestError, match="cfg_2=31.0 must be from -1.0 to 30.0"):
        parse_request(query(cfg_2="31"), [TINY], ["fp32"])


def test_a_number_with_one_bound_says_that_bound():
    with pytest.raises(PlanRequestError, match=r"trained_loras=-1 must be at least 0\.$"):
        parse_request(query(trained_loras="-1"), [TINY], ["fp32"])


def test_plan_route_answers_without_blocking_the_loop(comfy_server, monkeypatch, tiny_folder):
    pytest.importorskip("aiohttp.web")
    monkeypatch.setattr(host, "diffusers_model_names", lambda: [TINY])
    monkeypatch.setattr(host, "resolve_model_folder", lambda name, path: tiny_folder("wan2.1-t2v"))
    routes.register_routes()
    handler = next(r.handler for r in comfy_server if r.path == "/vidmem/plan")

    async def ask(q):
        response = await handler(types.SimpleNamespace(query=q))
        return response.status, json.loads(response.body)

    status, plan = asyncio.run(ask(query()))
    assert status == 200 and plan["status"] == "ok" and plan["cached"] is False
    status, bad = asyncio.run(ask(query(model="../../secret")))
    assert status == 400 and bad["input"] == "model"
    assert not torch.cuda.is_initialized()


def test_an_unexpected_planning_error_answers_json_naming_it_and_logs_its_traceback(comfy_server, monkeypatch, caplog):
    """Not a plain-text 500 that the page would show as a JSON parse error ("Unexpected token ...")."""
    pytest.importorskip("aiohttp.web")
    monkeypatch.setattr(host, "diffusers_model_names", lambda: [TINY])

    def broken(*args, **kwargs):
        raise KeyError("blocks")

    monkeypatch.setattr(routes, "plan_answer", broken)  # what the service's answer calls
    routes.register_routes()
    handler = next(r.handler for r in comfy_server if r.path == "/vidmem/plan")
    with caplog.at_level("ERROR", logger="vidmem"):
        response = asyncio.run(handler(types.SimpleNamespace(query=query())))
    assert response.status == 500 and response.content_type == "application/json"
    assert response.headers["Cache-Control"] == "no-store"
    answer = json.loads(response.body)
    assert answer["status"] == "error" and answer["input"] is None
    assert answer["error"].startswith("planning failed: KeyError: 'blocks'"), answer
    (record,) = [r for r in caplog.records if r.name == "vidmem" and r.levelname == "ERROR"]
    assert TINY in record.getMessage() and record.exc_info[0] is KeyError  # the traceback goes to ComfyUI's log


def _wan_13b_cache_plan(**cache):
    """Wan 2.1 1.3B at 832x480x81 and 50 steps, with a Step Cache node's widgets sent as cache_<name>."""
    from vidmem.pipelines.configs import load_model

    q = query(model="wan", dtype="bf16", width="832", height="480", frames="81", steps="50", tile_size="256",
              overlap="32", temporal_size="64", temporal_overlap="8", vram_budget_gb="8",
              **{f"cache_{name}": value for name, value in cache.items()})
    return plan_answer(parse_request(q, ["wan"], ["bf16"]), lambda n, d: load_model("wan2.1-t2v-1.3b", d),
                       (8 * GiB, 64 * GiB), device="cuda")


def test_the_plan_says_what_a_connected_step_cache_skips_before_the_run():
    from vidmem.pipelines.step_cache import CacheMethod, StepCache, mag_schedule, published_cache, taylor_computes

    assert _wan_13b_cache_plan()["speed"] == []  # no Step Cache node connected
    widgets = dict(method="mag_cache", threshold="0", retention="0.2", max_skip_steps="3", mag_ratios="auto")
    plain = _wan_13b_cache_plan(**widgets)["speed"]
    # The same schedule the run takes: the published ratios at the node's K, retention and default threshold.
    published = published_cache("WanPipeline transformer:30x12x128")
    expected = sum(mag_schedule(StepCache(CacheMethod.MAG, published.threshold, 0.2, 3, expert_ratios=published.expert_ratios,
                                          ratio_steps=published.ratio_steps), 50))
    assert len(plain) == 1 and f"steps computed transformer {expected} of 50" in plain[0], plain
    # the chosen row's time with the cache: the denoise scaled by the passes computed, encode and decode as they are
    time = float(re.search(r"Time with the cache: about x(\d\.\d\d) of the same run uncached", plain[0]).group(1))
    assert expected / 50 - 0.005 <= time < 1.0, plain
    bolder = _wan_13b_cache_plan(**dict(widgets, threshold="0.3", max_skip_steps="6"))["speed"][0]
    assert int(re.search(r"transformer (\d+) of 50", bolder).group(1)) < expected, bolder
    assert float(re.search(r"about x(\d\.\d\d)", bolder).group(1)) < time, bolder
    fbc = _wan_13b_cache_plan(**dict(widgets, method="first_block_cache"))["speed"][0]
    assert "known only after the run" in fbc and "Time with the cache" not in fbc
    assert "computes every step" in _wan_13b_cache_plan(**dict(widgets, mag_ratios="calibrate"))["speed"][0]
    with pytest.raises(PlanRequestError, match="mag_ratios='gone.json' must be one of auto, calibrate"):
        _wan_13b_cache_plan(**dict(widgets, mag_ratios="gone.json"))  # not a file the node lists: never opened
    assert _wan_13b_cache_plan(**dict(widgets, method="off"))["speed"] == []
    taylor = _wan_13b_cache_plan(**dict(widgets, method="taylor_seer", interval="4", warmup_steps="2",
                                        end_steps="3"))["speed"][0]
    computed = sum(taylor_computes(step, 4, 2, 47) for step in range(50))
    assert f"taylor_seer (interval 4, warm-up 2, end steps 3, order 1): steps computed {computed} of 50" in taylor, taylor
    assert f"({computed / 50:.0%} of the denoise passes computed" in taylor, taylor
    defaults = _wan_13b_cache_plan(**dict(widgets, method="taylor_seer"))["speed"][0]  # widgets of an older graph
    assert "taylor_seer (interval 5, warm-up 3, end steps 0, order 1)" in defaults, defaults
    refused = _wan_13b_cache_plan(**dict(widgets, method="taylor_seer", warmup_steps="40", end_steps="10"))["speed"][0]
    assert "leave nothing to predict in 50 steps" in refused, refused


def test_a_bad_step_cache_widget_is_named_with_its_node():
    with pytest.raises(PlanRequestError) as caught:
        parse_request(query(cache_method="mag_cache", cache_threshold="nan"), [TINY], ["fp32"])
    assert caught.value.name == "cache_threshold" and "Step Cache" in str(caught.value)
    with pytest.raises(PlanRequestError) as caught:
        parse_request(query(steps="0"), [TINY], ["fp32"])
    assert caught.value.name == "steps"


def _wan_13b_speed_plan(offload="block_swap", **speed):
    from vidmem.pipelines.configs import load_model

    q = query(model="wan", dtype="bf16", width="832", height="480", frames="81", tile_size="256", overlap="32",
              temporal_size="64", temporal_overlap="8", vram_budget_gb="80", offload=offload,
              **{f"speed_{name}": value for name, value in speed.items()})
    return plan_answer(parse_request(q, ["wan"], ["bf16"]), lambda n, d: load_model("wan2.1-t2v-1.3b", d),
                       (80 * GiB, 64 * GiB), device="cpu")


def test_the_plan_says_what_a_connected_speed_node_will_run_here_and_counts_a_kernel_that_holds_the_scores():
    base = dict(attention="auto", compile="true", compile_mode="default", compile_dynamic="auto", fp8_matmul="auto")
    plain = _wan_13b_speed_plan()
    auto = _wan_13b_speed_plan(**base)
    (line,) = auto["speed"]
    assert line.startswith("speed: attention sdpa (auto); compiled blocks") and "fp8 weights upcast" in line, line
    assert auto["rows"][-1]["peak_vram_bytes"] == plain["rows"][-1]["peak_vram_bytes"]
    math_plan = _wan_13b_speed_plan(**dict(base, attention="math"))
    assert math_plan["rows"][-1]["peak_vram_bytes"] > plain["rows"][-1]["peak_vram_bytes"]  # the score matrix
    if not torch.cuda.is_available():
        (refused,) = _wan_13b_speed_plan(**dict(base, attention="sage"))["speed"]
        assert "refused: attention='sage' cannot run here" in refused
    with pytest.raises(PlanRequestError) as caught:
        parse_request(query(speed_attention="fastest", speed_compile="true"), [TINY], ["fp32"])
    assert caught.value.name == "speed_attention" and "Speed node" in str(caught.value)


def test_the_time_baseline_says_it_has_no_upcasts_where_the_weights_are_stored_narrow():
    """On a CPU host an fp8 model's rows are all about x3.7: the upcasts. 'against the same run with nothing
    streamed' read as if the row with nothing streamed were slower than itself."""
    from types import SimpleNamespace

    from vidmem.memory.plan.types import PlanOptions
    from vidmem.nodes.plan_route import _time

    rows = [SimpleNamespace(est_slowdown=3.7, stages=()), SimpleNamespace(est_slowdown=3.8, stages=())]
    stored = _time(rows, PlanOptions(device="cpu", storage=(("transformer", "fp8_scaled"),)), "bf16")["relative_to"]
    assert stored == ("the same run with nothing streamed in the compute dtype (no per-layer upcasts) and the decode "
                      "in one piece")
    assert "upcasts" not in _time(rows, PlanOptions(device="cpu"), "bf16")["relative_to"]
    assert "upcasts" not in _time(rows, PlanOptions(device="cpu", storage=(("transformer", "bf16"),)), "bf16")["relative_to"]
