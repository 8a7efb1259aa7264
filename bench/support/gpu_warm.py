"""bench/gpu.py, warm rows: one stage called twice on one WarmStore, cold then warm (issue 22).

A ComfyUI user queues the same graph again and again; the second call should find the resident
weights where the first left them instead of uploading them again. A warm row applies its tier
through the engine's own path (`apply_strategy(..., warm=store)` on the bench's backend, on CUDA
the real `CudaBackend`), twice, on the same store, backend and pinned pool, as a loaded pipeline
keeps them between Sampler calls. For each call it records what the store counted (resident bytes
uploaded, bytes streamed, bytes found on the device and reused, bytes kept for the next call), the
seconds from applying the strategy until the transformer is on the device for its first step
(`activate`, then a device synchronise: the onload), the first step, and the median of the steps
after it.

A `_keep` row also gives streamed blocks a keep budget (`apply_strategy(keep_bytes=...)`), from free
device memory as the sampler computes it (`pipelines.room.keep_bytes`): a block kept after its
forward is not copied again on later steps, nor on the next call.

The dry run (`--device cpu`) has no device: `CopyingCpuBackend` stands in, copying every onload into
fresh CPU memory, so the byte counts are real (CI checks them); its seconds mean nothing.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable

import torch

from vidmem.memory import MemoryStrategy
from vidmem.memory.device import CpuBackend, backend_for
from vidmem.memory.hostpool import HostPool
from vidmem.memory.offload import StageComponents, apply_strategy, device_weight_bytes
from vidmem.memory.plan.planner import PlanOptions, VideoShape, plan_run
from vidmem.memory.units import human_bytes
from vidmem.memory.warm import WarmStore

GOAL_SECONDS = 0.1
GOAL_MODEL, GOAL_SIZE = "wan2.1-t2v-1.3b", (832, 480)
GOAL = (f"the warm call uploads no resident byte and its time before the first step is under {GOAL_SECONDS} s "
        f"(Wan 2.1 1.3B at {GOAL_SIZE[0]}x{GOAL_SIZE[1]}, on a GPU)")
COMPONENT = "transformer"


class CopyingCpuBackend(CpuBackend):
    """The CPU as a stand-in device: every onload is a real copy into fresh memory, so a warm store
    has copies to keep and its byte counts mean what they mean on a GPU."""

    copies_to_device = True

    def copy_group(self, hosts, non_blocking, side_stream, timed):
        return [host.clone() for host in hosts], None


def warm_backend(device: torch.device):
    """The backend both calls of a row share: the real one, or the copying stand-in on the CPU."""
    return CopyingCpuBackend() if device.type == "cpu" else backend_for(device)


def measure_call(stage: StageComponents, strategy: MemoryStrategy, backend, store: WarmStore, pool: HostPool,
                 keep_bytes: int, run_steps: Callable[[int], list[float]], steps: int,
                 synchronize: Callable[[], None]) -> dict:
    """One call as the sampler makes it (`store.in_use`, then the strategy applied with the store):
    the onload timed to the transformer being ready, one first step, then `steps` steps."""
    with store.in_use(backend.device, backend):
        synchronize()
        start = time.perf_counter()
        with apply_strategy(stage, strategy, backend, host_pool=pool, warm=store, keep_bytes=keep_bytes) as handle:
            handle.activate(COMPONENT)  # tiers model and block_swap onload the core here, tier none when applied
            synchronize()
            ready = time.perf_counter() - start
            onload = dataclasses.asdict(store.tally)  # what moved before the first step
            first = run_steps(1)[0]
            later = run_steps(steps)
            keep = handle.keep.as_dict()
    return {"before_first_step_seconds": ready, "first_step_seconds": first, "step_seconds": statistics.median(later),
            "steps_seconds": later, **store.as_dict(), "onload": onload, "keep": keep}


def keep_budget(model, shape: VideoShape, strategy: MemoryStrategy, stage: StageComponents, device: torch.device,
                held_bytes: int) -> int:
    """Device bytes streamed blocks may keep, as the sampler computes them: free memory now, less the
    call's weights, the planner's activations and the margin (`pipelines.room.keep_bytes`; the store's
    `held_bytes` count as free, being part of the call's weights). The dry run knows no free figure:
    room for every streamed block."""
    if device.type != "cuda":
        blocks = list(stage.blocks[COMPONENT])[-strategy.blocks_to_swap:]
        return sum(t.numel() * t.element_size() for block in blocks for t in [*block.parameters(), *block.buffers()])
    from vidmem.pipelines.room import RoomRequest, activation_bytes, keep_bytes

    free, _ = torch.cuda.mem_get_info(device)
    denoise = plan_run(model, shape, strategy, PlanOptions()).stage("denoise")
    room = RoomRequest(device_weight_bytes(stage, strategy), activation_bytes([denoise]), predicted=True)
    return keep_bytes(free, room, held_bytes)


def pinned_weight_bytes(module: torch.nn.Module, device: torch.device) -> int | None:
    """Bytes of `module`'s weights in page-locked host memory (a cold upload's source speed), on CUDA."""
    if device.type != "cuda":
        return None
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()] if t.is_pinned())


def goal_verdict(model_name: str, shape: VideoShape, device: torch.device, warm: dict) -> dict:
    """Issue 22's goal for the warm call; `met` is None where the run is not the goal's setting."""
    applies = device.type == "cuda" and model_name == GOAL_MODEL and (shape.width, shape.height) == GOAL_SIZE
    met = warm["uploaded_bytes"] == 0 and warm["before_first_step_seconds"] < GOAL_SECONDS
    return {"goal": GOAL, "applies": applies, "met": met if applies else None,
            "warm_before_first_step_seconds": warm["before_first_step_seconds"], "warm_uploaded_bytes": warm["uploaded_bytes"]}


def warm_lines(name: str, row: dict) -> str:
    """The row's two calls as table lines, then the goal's verdict."""
    lines = []
    for label, call in row["calls"].items():
        keep = call["keep"]
        kept = f"  keep {keep['kept_groups']} blocks ({human_bytes(keep['kept_bytes'])})" if keep["limit_bytes"] else ""
        lines.append(f"{name if not lines else '':32s} {label}  before step {call['before_first_step_seconds']:7.3f} s  "
                     f"first {call['first_step_seconds']:7.3f} s  step {call['step_seconds']:7.3f} s  "
                     f"uploaded {human_bytes(call['uploaded_bytes']):>10}  streamed {human_bytes(call['streamed_bytes']):>10}  "
                     f"reused {human_bytes(call['reused_bytes']):>10}{kept}")
    goal = row["goal"]
    verdict = {True: "met", False: "MISSED", None: "not judged here (the goal is Wan 2.1 1.3B at 832x480 on a GPU)"}[goal["met"]]
    lines.append(f"{'':32s} goal: warm call {goal['warm_before_first_step_seconds']:.3f} s before its first step, "
                 f"{human_bytes(goal['warm_uploaded_bytes'])} uploaded: {verdict}")
    return "\n".join(lines)
