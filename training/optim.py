"""Optimizers for LoRA training, and their state as plain tensors (saved as safetensors, never pickled).

- `adamw`: torch.optim.AdamW; two float32 states per trained weight (8 bytes).
- `adamw_8bit`: bitsandbytes' AdamW8bit: block-wise 8-bit states (2 bytes per weight plus one
  float32 scale per 256), ~25% of AdamW's. Chosen over torchao's AdamW8bit because its state is
  plain uint8/float32 tensors (torchao's are tensor subclasses, which safetensors cannot hold)
  and it runs on the CPU too (bitsandbytes >= 0.50), so it is tested here. Layers with fewer
  than 4096 weights keep 32-bit states (bitsandbytes' `min_8bit_size`).
- `adamw_cpu_offload`: AdamW whose states and float32 master weights live in host RAM; after each
  backward the gradients are copied to the host, the step runs there, and the new weights are
  copied back. torchao's CPUOffloadOptimizer does this with overlapped streams but refuses any
  device other than CUDA/XPU, so vidmem has this simple synchronous one: it runs (and is tested)
  on the CPU, where it gives AdamW's result bit for bit.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum

import torch

from .errors import TrainingError

BETAS = (0.9, 0.999)
EPS = 1e-8


class OptimizerName(str, Enum):
    ADAMW = "adamw"
    ADAMW_8BIT = "adamw_8bit"
    ADAMW_CPU_OFFLOAD = "adamw_cpu_offload"


@dataclass(frozen=True)
class OptimizerSettings:
    name: OptimizerName
    learning_rate: float
    weight_decay: float


def make_optimizer(params: list[torch.nn.Parameter], settings: OptimizerSettings):
    kwargs = dict(lr=settings.learning_rate, betas=BETAS, eps=EPS, weight_decay=settings.weight_decay)
    if settings.name is OptimizerName.ADAMW:
        return torch.optim.AdamW(params, **kwargs)
    if settings.name is OptimizerName.ADAMW_8BIT:
        return _bitsandbytes().optim.AdamW8bit(params, **kwargs)
    return HostOffloadAdamW(params, **kwargs)


def _bitsandbytes():
    try:
        import bitsandbytes
    except ImportError:
        raise TrainingError("optimizer='adamw_8bit' needs bitsandbytes, which is not installed; install it in "
                            "ComfyUI's Python (pip install 'vidmem[train]' or pip install bitsandbytes), or choose "
                            "optimizer 'adamw' or 'adamw_cpu_offload'.") from None
    return bitsandbytes


def check_available(name: OptimizerName) -> None:
    """Raise before training starts if the optimizer's library is missing."""
    if name is OptimizerName.ADAMW_8BIT:
        _bitsandbytes()


class HostOffloadAdamW:
    """AdamW stepping on float32 host copies of the parameters (see the module docstring)."""

    def __init__(self, params: list[torch.nn.Parameter], **kwargs) -> None:
        self.params = list(params)
        pin = any(p.device.type == "cuda" for p in self.params)
        self.host = [torch.nn.Parameter(_host_copy(p.detach(), pin)) for p in self.params]
        self.inner = torch.optim.AdamW(self.host, **kwargs)

    @property
    def state(self):
        return self.inner.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None
        self.inner.zero_grad(set_to_none)

    @torch.no_grad()
    def step(self) -> None:
        for param, host in zip(self.params, self.host):
            if param.grad is not None:
                host.grad = _host_copy(param.grad, host.is_pinned()) if host.grad is None else host.grad.copy_(param.grad)
        self.inner.step()
        for param, host in zip(self.params, self.host):
            param.copy_(host)

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)
        with torch.no_grad():
            for param, host in zip(self.params, self.host):
                host.copy_(param)  # the weights come from the checkpoint's LoRA, loaded before


def _host_copy(tensor: torch.Tensor, pin: bool) -> torch.Tensor:
    copy = torch.empty(tensor.shape, dtype=torch.float32, device="cpu", pin_memory=pin)
    return copy.copy_(tensor)


def state_bytes(optimizer) -> int:
    """Bytes of every tensor in the optimizer's state (the per-step `step` counters included)."""
    return sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))


def state_to_tensors(optimizer) -> tuple[dict[str, torch.Tensor], str]:
    """(tensors for safetensors, JSON of the rest) of the optimizer's state_dict, nested dicts and
    all (bitsandbytes keeps its quantization state in one); tensors appear in the JSON as
    {"tensor": key}. Tuples come back as lists, which the optimizers accept."""
    tensors: dict[str, torch.Tensor] = {}

    def flat(value, key: str):
        if torch.is_tensor(value):
            tensors[key] = value.detach().to("cpu").contiguous()
            return {TENSOR_REF: key}
        if isinstance(value, dict):
            return {"dict": [[_json_key(k), flat(v, f"{key}.{k}")] for k, v in value.items()]}
        if isinstance(value, (list, tuple)):
            return [flat(v, f"{key}.{i}") for i, v in enumerate(value)]
        return value

    return tensors, json.dumps(flat(optimizer.state_dict(), "optimizer"))


TENSOR_REF = "tensor"


def _json_key(key):
    if isinstance(key, (str, int, float, bool)) or key is None:
        return key
    raise TrainingError(f"optimizer state has a key of type {type(key).__name__}; it cannot be saved as JSON.")


def load_state_tensors(optimizer, tensors: dict[str, torch.Tensor], meta: str) -> None:
    optimizer.load_state_dict(state_from_tensors(tensors, meta))


def state_from_tensors(tensors: dict[str, torch.Tensor], meta: str) -> dict:
    """The state_dict state_to_tensors saved, rebuilt; damaged JSON raises ValueError, TypeError or KeyError."""
    def build(value):
        if isinstance(value, dict) and set(value) == {TENSOR_REF}:
            return tensors[value[TENSOR_REF]]
        if isinstance(value, dict):
            return {k: build(v) for k, v in value["dict"]}
        if isinstance(value, list):
            return [build(v) for v in value]
        return value

    state = build(json.loads(meta))
    if not isinstance(state, dict):
        raise ValueError(f"the optimizer state is a {type(state).__name__}, not a state_dict")
    return state
