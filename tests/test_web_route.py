"""GET /vidmem/memory: registered only inside a running ComfyUI, once, and answering memory figures
only (RAM, process RSS, per CUDA device), never creating a CUDA context on a CPU-only server."""

from __future__ import annotations

import asyncio
import json
import sys
import types

import pytest
import torch

from vidmem.nodes import host


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
    assert host.register_routes() is True
    assert [(r.method, r.path) for r in comfy_server] == [("GET", "/vidmem/memory")]
    assert host.register_routes() is False, "a second call must not add a duplicate route"
    assert len(comfy_server) == 1


def test_does_nothing_without_comfyui(monkeypatch):
    monkeypatch.delitem(sys.modules, "server", raising=False)
    assert host.register_routes() is False
    monkeypatch.setitem(sys.modules, "server", types.SimpleNamespace())  # some unrelated "server" module
    assert host.register_routes() is False


def test_figures_are_memory_only_and_cpu_lists_no_device():
    figures = host.memory_figures()
    assert set(figures) == {"ram", "process_rss_bytes", "cuda"}
    assert set(figures["ram"]) == {"total_bytes", "available_bytes"}
    assert 0 < figures["ram"]["available_bytes"] <= figures["ram"]["total_bytes"]
    assert figures["process_rss_bytes"] > 0
    if not torch.cuda.is_initialized():
        assert figures["cuda"] == []
    json.dumps(figures)


def test_cuda_figures_per_device(monkeypatch):
    """Two devices: the one in use reports driver free/total, the idle one only its total (no context)."""
    gib = 1 << 30
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
    figures = host.memory_figures()
    assert figures["cuda"] == [
        {"index": 0, "allocated_bytes": 2 * gib, "reserved_bytes": 3 * gib, "free_bytes": 5 * gib, "total_bytes": 8 * gib},
        {"index": 1, "allocated_bytes": 0, "reserved_bytes": 0, "free_bytes": None, "total_bytes": 24 * gib},
    ]
    assert asked == [0], "mem_get_info would create a CUDA context on an idle device"
    assert "secret" not in json.dumps(figures)


def test_handler_answers_json(comfy_server):
    web = pytest.importorskip("aiohttp.web")
    host.register_routes()
    response = asyncio.run(comfy_server[0].handler(None))
    assert isinstance(response, web.Response) and response.content_type == "application/json"
    assert response.headers["Cache-Control"] == "no-store"
    assert set(json.loads(response.body)) == {"ram", "process_rss_bytes", "cuda"}
