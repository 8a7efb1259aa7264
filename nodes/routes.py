"""Read-only HTTP routes the pack adds to ComfyUI's server: memory figures for the web meter and
the Memory Strategy's live plan. The pack's __init__ registers them once, when ComfyUI's
PromptServer is running (host.prompt_server); nothing here imports ComfyUI.
"""

from __future__ import annotations

import asyncio
import logging

from ..memory.telemetry import default_budgets
from ..memory.warm import kept_everywhere
from ..pipelines.configs import load_model
from ..pipelines.loader import DTYPES
from . import host  # model lists and the device come from the host at request time
from .plan_route import PLAN_ROUTE, PlanRequestError, PlanService, parse_request, plan_answer

log = logging.getLogger("vidmem")

MEMORY_ROUTE = "/vidmem/memory"


def memory_figures() -> dict:
    """RAM total/available, this process's RSS, per CUDA device allocated/reserved/free/total bytes, and
    the device bytes vidmem keeps between runs (warm runs; 0 after ComfyUI's `POST /free` unloads).

    Only memory figures, nothing else (no names, paths or versions). CUDA devices are listed only
    when this process has initialised CUDA, so a `--cpu` server never creates a CUDA context for it;
    free/total come from the driver (`mem_get_info`) for devices this process already uses.
    """
    import psutil
    import torch

    ram = psutil.virtual_memory()
    devices = []
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for index in range(torch.cuda.device_count()):
            reserved = torch.cuda.memory_reserved(index)
            in_use = reserved > 0 or index == torch.cuda.current_device()
            free, total = torch.cuda.mem_get_info(index) if in_use else (None, torch.cuda.get_device_properties(index).total_memory)
            devices.append({"index": index, "allocated_bytes": torch.cuda.memory_allocated(index),
                            "reserved_bytes": reserved, "free_bytes": free, "total_bytes": total})
    return {
        "ram": {"total_bytes": ram.total, "available_bytes": ram.available},
        "process_rss_bytes": psutil.Process().memory_info().rss,
        "cuda": devices,
        "vidmem_kept_bytes": kept_everywhere(),  # weights vidmem keeps on the device between runs
    }


def register_routes() -> bool:
    """Add the read-only GET /vidmem/memory to ComfyUI's server (also served as /api/vidmem/memory).

    Only when ComfyUI's PromptServer is already running in this process (it is imported before
    custom nodes load); without it, or if the route exists already, nothing is done. Returns
    whether the route was added.
    """
    routes = getattr(host.prompt_server(), "routes", None)
    if routes is None or any(getattr(route, "path", None) == MEMORY_ROUTE for route in routes):
        return False

    async def vidmem_memory(request):
        from aiohttp import web  # ComfyUI's web server; imported only when a request arrives

        return web.json_response(memory_figures(), headers={"Cache-Control": "no-store"})

    routes.get(MEMORY_ROUTE)(vidmem_memory)
    log.info("vidmem: serving GET %s (memory figures, read-only)", MEMORY_ROUTE)
    _register_plan_route(routes)
    return True


def planning_failed(error: Exception) -> dict:
    """The plan route's answer when planning raised what plan_answer does not expect (its own errors name their
    input): JSON like every answer, so the node shows the error's type and message, not a JSON parse error."""
    return {"status": "error", "input": None,
            "error": f"planning failed: {type(error).__name__}: {error} (the traceback is in ComfyUI's log)"}


def _register_plan_route(routes) -> None:
    """GET /vidmem/plan: the Memory Strategy's plan for a model of the pack's list (nodes/plan_route.py)."""
    budgets = []  # the host's default budgets, read once at the first plan (never at import)

    def answer(plan_request):
        if not budgets:
            budgets.append(default_budgets(host.compute_device()))
        return plan_answer(plan_request, plannable, budgets[0], device=host.compute_device().type)

    def plannable(name: str, dtype: str, vae_dtype: str = "", removed: tuple[str, ...] = ()):
        folder = str(host.resolve_model_folder(name, ""))
        return load_model(folder, dtype, vae_dtype or None, removed)  # config files only, on meta

    service = PlanService(answer)

    async def vidmem_plan(request):
        from aiohttp import web

        headers = {"Cache-Control": "no-store"}
        try:
            # off the event loop: it stats the folder's files (its stamp), which a network disk may take time over
            plan_request = await asyncio.to_thread(parse_request, request.query, host.diffusers_model_names(), list(DTYPES))
            plan = await service.plan(plan_request, request.query.get("client", ""))
        except PlanRequestError as error:
            return web.json_response({"status": "error", "input": error.name, "error": str(error)}, status=400,
                                     headers=headers)
        except Exception as error:  # a bug, not a bad input: the node gets words to show, the log the traceback
            log.exception("vidmem: planning %r failed", request.query.get("model"))
            return web.json_response(planning_failed(error), status=500, headers=headers)
        return web.json_response(plan, headers=headers)

    routes.get(PLAN_ROUTE)(vidmem_plan)
    log.info("vidmem: serving GET %s (plans from model configs, read-only)", PLAN_ROUTE)
