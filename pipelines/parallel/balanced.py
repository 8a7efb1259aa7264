"""Balanced placement (the seed's `device_map="balanced"`): whole components on different GPUs.

With two or more GPUs and no context parallelism, the transformers go to the first listed GPU
and the prompt encoder to the second, so neither has to leave room for the other.
The choice is a pure function of component sizes and device capacities (tested on the CPU with
made-up devices); `placed_encoder` moves the prompt encoder for one call and makes it take its
inputs from wherever they are.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Iterator, Mapping, Sequence

import torch
from torch import nn

from ...memory.units import GiB
from ..family import ModelError

DENOISERS = ("transformer", "transformer_2")
PROMPT_ENCODER = "text_encoder"


@dataclass(frozen=True)
class DeviceRoom:
    device: str  # "cuda:1", or any name in tests
    memory_bytes: int  # what the GPU holds in all: the run asks the host to make room there


@dataclass(frozen=True)
class Placement:
    """Which device runs the denoisers (the run's compute device) and which the prompt encoder."""

    denoisers: str
    prompt_encoder: str

    def describe(self) -> str:
        return f"balanced: transformers on {self.denoisers}, text encoder on {self.prompt_encoder}"


def balanced_placement(component_bytes: Mapping[str, int], rooms: Sequence[DeviceRoom],
                       offload: str = "none") -> Placement:
    """The denoisers (together: Wan 2.2 A14B's two experts stay on one GPU) on the first listed device,
    the prompt encoder on the second, as the planner plans it (memory.plan.parallel_layout) and the
    Memory Strategy's help says. ModelError, naming what to change, when a device lacks the room the
    tier needs: under `none` every denoiser whole, under `model` the largest one; `block_swap` and
    `sequential` stream blocks and need no such room (the sampler makes room and swaps as planned).
    The prompt encoder always runs whole on its device."""
    if len(rooms) < 2:
        raise ModelError(f"balanced placement needs two or more GPUs; {len(rooms)} given. List them in gpus (e.g. 0,1).")
    home, other = rooms[0], rooms[1]
    denoisers = [component_bytes.get(name, 0) for name in DENOISERS]
    whole = {"none": sum(denoisers), "model": max(denoisers)}.get(offload, 0)
    if whole > home.memory_bytes:
        raise ModelError(
            f"balanced placement: under offload={offload} the transformers need {whole / GiB:.1f} GiB on the first "
            f"listed GPU ({home.device}), which holds {home.memory_bytes / GiB:.1f} GiB; use offload=block_swap, "
            "context_parallel=ulysses, or list the roomiest GPU first in gpus."
        )
    encoder_bytes = component_bytes.get(PROMPT_ENCODER, 0)
    if encoder_bytes > other.memory_bytes:
        raise ModelError(
            f"balanced placement: the text encoder needs {encoder_bytes / GiB:.1f} GiB on the second listed GPU "
            f"({other.device}), which holds {other.memory_bytes / GiB:.1f} GiB; list a roomier GPU second in gpus, "
            "or use gpus=auto with text_encoder=cpu."
        )
    return Placement(home.device, other.device)


def component_bytes(pipe) -> dict[str, int]:
    """Bytes of the weights of each placed component of `pipe` (absent components left out)."""
    sizes = {}
    for name in (*DENOISERS, PROMPT_ENCODER):
        module = getattr(pipe, name, None)
        if isinstance(module, nn.Module):
            sizes[name] = sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))
    return sizes


@contextmanager
def placed_encoder(pipe, device: torch.device) -> Iterator[None]:
    """The prompt encoder on `device` for the length of the `with`, taking inputs from any device.

    The pipeline hands it token ids on the compute device; a forward pre-hook moves them to the
    encoder's own device. Restored (weights and hook) on success, error or Cancel alike, by
    pointing every parameter and buffer back at the tensor it held before: no device-to-host
    copy, and memory-mapped or fp8/GGUF-stored weights stay what they were (`Module.to(home)`
    would turn them into fresh anonymous RAM, the whole encoder's size, after every run).
    """
    encoder = getattr(pipe, PROMPT_ENCODER)
    homes: list[tuple[dict, str, torch.Tensor]] = []
    hook = encoder.register_forward_pre_hook(lambda module, args, kwargs: _to(device, args, kwargs), with_kwargs=True)
    try:
        _place(encoder, device, homes)  # fills `homes` as it goes: a failure halfway is undone too
        yield
    finally:
        hook.remove()
        for table, name, home in homes:
            table[name] = home


def _place(encoder: nn.Module, device: torch.device, homes: list[tuple[dict, str, torch.Tensor]]) -> None:
    """Put a copy of every parameter and buffer on `device` in the module's tables; the originals go
    into `homes` to be put back as they were (tied weights stay tied: one copy per original tensor)."""
    copies = {}
    for module in encoder.modules():
        for table, is_parameter in ((module._parameters, True), (module._buffers, False)):
            for name, home in list(table.items()):
                if home is None:
                    continue
                if id(home) not in copies:
                    moved = home.detach().to(device)
                    copies[id(home)] = nn.Parameter(moved, home.requires_grad) if is_parameter else moved
                homes.append((table, name, home))
                table[name] = copies[id(home)]


def _to(device: torch.device, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    move = lambda value: value.to(device) if isinstance(value, torch.Tensor) else value  # noqa: E731
    return tuple(move(a) for a in args), {k: move(v) for k, v in kwargs.items()}


def sample_balanced(loaded, strategy, request, placement: Placement, hooks=None):
    """Sample with the denoisers on `placement.denoisers` (under the strategy's tier, so a model
    too big for one GPU may still swap blocks there) and the prompt encoder on its own GPU."""
    from ...memory.strategy import Parallelism, TextEncoderPlacement
    from ..hooks import RunHooks
    from ..sample import sample

    # The encoder is placed here, so the tier must leave it alone: the engine's "cpu" placement
    # is exactly "not part of the stage; embeddings are moved to the compute device".
    per_call = replace(strategy, parallel=Parallelism(), text_encoder=TextEncoderPlacement.CPU)
    hooks = hooks or RunHooks()
    encoder_device = torch.device(placement.prompt_encoder)
    # The transformers' GPU gets its room from sample(); the encoder's, which the host's own models may fill, here.
    hooks.make_room(component_bytes(loaded.pipe).get(PROMPT_ENCODER, 0), encoder_device)
    with placed_encoder(loaded.pipe, encoder_device):
        result = sample(loaded, per_call, request, hooks, device=torch.device(placement.denoisers))
    result.receipt.update(strategy=strategy.describe(), placement=placement.describe())
    return result
