"""Free VRAM (VidMem): collect garbage and return cached GPU memory where the graph puts it."""

from __future__ import annotations

import json
from dataclasses import replace

from ..memory import free_memory
from ..memory.hostpool import LIVE_POOLS, HostPool
from ..memory.telemetry import snapshot
from ..memory.warm import kept_everywhere, rehome_everywhere
from ..pipelines.parallel.run import close_all_pools
from . import host
from .receipts import human_bytes

ANY = "*"  # ComfyUI 0.8.0 accepts "*" as matching every type


class VidMemFreeVRAM:
    DESCRIPTION = (
        "Drops the weights vidmem keeps on the GPU between runs (warm runs), then runs gc.collect(), "
        "torch.cuda.empty_cache() and torch.cuda.ipc_collect() when the value passing through arrives, "
        "and passes it on unchanged. Shows memory before and after, and the RAM vidmem's pipelines keep pinned for "
        "streamed blocks (unload_comfy_models unpins it). It runs on every queue: the next queue "
        "is cold (uploads the weights again) and every node after it runs again each time, so give it a "
        "branch of its own (its output unconnected), if at all: ComfyUI takes kept weights back by itself "
        "when it needs the room."
    )
    CATEGORY = "vidmem"
    FUNCTION = "free"
    OUTPUT_NODE = True
    RETURN_TYPES = (ANY,)
    RETURN_NAMES = ("passthrough",)
    OUTPUT_TOOLTIPS = ("The input, unchanged. Every node connected after it runs again on every queue (this node "
                       "is never cached): leave it unconnected unless a later node must wait for the cleanup.",)

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "anything": (ANY, {"tooltip": "Any value; the cleanup runs when it arrives and it is passed on. "
                                   "The weights kept for the next queue are dropped: the next queue is cold. "
                                   "Every pipeline's context-parallel ranks (one process per GPU) are stopped too; "
                                   "the next parallel run starts them again."}),
                "unload_comfy_models": ("BOOLEAN", {"default": False, "tooltip":
                    "Also ask ComfyUI to unload its own loaded models, and unpin the RAM vidmem's loaded pipelines "
                    "keep page-locked for streamed blocks (block_swap, sequential): the next such run pins it "
                    "again. Off: only vidmem's caches are freed, and the receipt says how much RAM stays pinned."}),
            }
        }

    @classmethod
    def IS_CHANGED(cls, **inputs):
        return float("nan")  # never equal to itself: the cleanup runs on every queue

    def free(self, anything, unload_comfy_models=False):
        device = host.compute_device()
        # Measured before ComfyUI unloads: its unload_all_models also empties vidmem's stores (they are
        # its loaded models), and the receipt must count what this node freed, that share included.
        before, kept = snapshot(device), kept_everywhere()
        unloaded = host.unload_host_models() if unload_comfy_models else False
        stopped = close_all_pools()  # context-parallel ranks hold their own copies on their GPUs
        receipt = free_memory(device)
        receipt = replace(receipt, before=before, warm_released_bytes=max(0, kept - kept_everywhere()))
        pools = live_host_pools()  # after free_memory's gc.collect(): a dropped pipeline's pool is gone by then
        unpinned = unpin(pools) if unload_comfy_models else 0
        report = receipt.as_dict() | {"comfy_models_unloaded": unloaded, "parallel_pools_stopped": stopped,
                                      "pinned_host": pinned_report(pools, unpinned, unload_comfy_models)}
        return {"ui": {"text": [format_free(report)], "vidmem_receipt": [report]}, "result": (anything,)}


def live_host_pools() -> list[HostPool]:
    """Every loaded pipeline's pinned pool (memory/hostpool.py keeps them weakly: a dropped pipeline's is gone
    after the gc.collect() free_memory runs)."""
    return list(LIVE_POOLS)


def unpin(pools: list[HostPool]) -> int:
    """Unpin every pool's homes (their weights move to pageable RAM); returns the bytes unpinned. One arena
    at a time, newest first: `fit_ceiling` copies a dropped arena's homes to pageable memory before it lets
    the arena go, so dropping all at once would hold every pinned byte twice for a moment. Free VRAM runs
    between nodes, when every module points at its host tensors, as fit_ceiling asks; the warm stores'
    copies follow their bytes (rehome_everywhere)."""
    unpinned = 0
    for pool in pools:
        while pool.pinned_bytes:
            dropped = pool.fit_ceiling(pool.pinned_bytes - pool.arena_bytes, rehome_everywhere)
            if not dropped:
                break
            unpinned += dropped
    return unpinned


def pinned_report(pools: list[HostPool], unpinned: int, asked: bool) -> dict:
    """What the pools still pin after the cleanup (their own stats), what this node unpinned, and whether it was
    asked to (unload_comfy_models)."""
    held = [pool.stats()["pinned_bytes"] for pool in pools]
    return {"pinned_bytes": sum(held), "pools": sum(1 for n in held if n), "unpinned_bytes": unpinned,
            "unpin_asked": asked}


def format_free(report: dict) -> str:
    lines = ["Free VRAM"]
    for key in report["before"]:
        before, after = report["before"][key], report["after"][key]
        lines.append(f"{key}: {human_bytes(before)} -> {human_bytes(after)}")
    if report.get("warm_released_bytes"):
        lines.append(f"weights vidmem kept on the device between runs: {human_bytes(report['warm_released_bytes'])} released")
    lines.extend(pinned_lines(report.get("pinned_host", {})))
    lines.append(f"gc collected {report['collected_objects']} objects; ComfyUI models unloaded: {report['comfy_models_unloaded']}")
    lines.append(json.dumps(report, sort_keys=True))
    return "\n".join(lines)


def pinned_lines(pinned: dict) -> list[str]:
    """Page-locked RAM the loaded pipelines keep for streamed blocks: unpinned here, or still held (and how
    to unpin it)."""
    lines = []
    if pinned.get("unpinned_bytes"):
        lines.append(f"pinned RAM for streamed blocks: {human_bytes(pinned['unpinned_bytes'])} unpinned (the next "
                     "block_swap or sequential run pins it again)")
    if pinned.get("pinned_bytes"):
        pipelines = f"{pinned['pools']} loaded pipeline{'s' * (pinned['pools'] != 1)}"
        hint = "" if pinned.get("unpin_asked") else " (turn unload_comfy_models on to unpin it)"
        lines.append(f"pinned RAM still locked by {pipelines} for streamed blocks: "
                     f"{human_bytes(pinned['pinned_bytes'])}{hint}")
    return lines
