"""Free VRAM (VidMem): collect garbage and return cached GPU memory where the graph puts it."""

from __future__ import annotations

import json
from dataclasses import replace

from ..memory import free_memory
from ..memory.telemetry import snapshot
from ..memory.warm import kept_everywhere
from ..pipelines.parallel.run import close_all_pools
from . import host
from .receipts import human_bytes

ANY = "*"  # ComfyUI 0.8.0 accepts "*" as matching every type


class VidMemFreeVRAM:
    DESCRIPTION = (
        "Drops the weights vidmem keeps on the GPU between runs (warm runs), then runs gc.collect(), "
        "torch.cuda.empty_cache() and torch.cuda.ipc_collect() when the value passing through arrives, "
        "and passes it on unchanged. Shows memory before and after. It runs on every queue: the next queue "
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
                    "Also ask ComfyUI to unload its own loaded models (off: only vidmem's caches are freed)."}),
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
        report = receipt.as_dict() | {"comfy_models_unloaded": unloaded, "parallel_pools_stopped": stopped}
        return {"ui": {"text": [format_free(report)], "vidmem_receipt": [report]}, "result": (anything,)}


def format_free(report: dict) -> str:
    lines = ["Free VRAM"]
    for key in report["before"]:
        before, after = report["before"][key], report["after"][key]
        lines.append(f"{key}: {human_bytes(before)} -> {human_bytes(after)}")
    if report.get("warm_released_bytes"):
        lines.append(f"weights vidmem kept on the device between runs: {human_bytes(report['warm_released_bytes'])} released")
    lines.append(f"gc collected {report['collected_objects']} objects; ComfyUI models unloaded: {report['comfy_models_unloaded']}")
    lines.append(json.dumps(report, sort_keys=True))
    return "\n".join(lines)
