"""Training inside a host that runs every node under torch.inference_mode() (ComfyUI's executor does).

Autograd refuses inference tensors: it cannot save them for the backward, and they carry no
version counter. Tensors made while a node ran under inference mode are such tensors: the
pipeline's weights (loaded by the loader node), LoRA matrices loaded by Load LoRA. The trainer
therefore runs with inference mode off and gradients on, and for the run points every parameter
and buffer of the denoiser that is an inference tensor at a normal tensor over the same storage
(no copy), put back exactly afterwards.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn


def _normal_alias(tensor: torch.Tensor) -> torch.Tensor:
    """A non-inference tensor sharing `tensor`'s storage, shape and strides (made outside inference mode)."""
    alias = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    alias.set_(tensor.untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride())
    if isinstance(tensor, nn.Parameter):
        return nn.Parameter(alias, requires_grad=tensor.requires_grad)
    return alias


@contextmanager
def normal_tensors(model: nn.Module) -> Iterator[int]:
    """Swap the model's inference-mode parameters and buffers for normal aliases; yields how many.

    Tensor subclasses (GGUF, torchao) are left as they are: `set_` would drop their type.
    """
    swapped = []
    try:
        for module in model.modules():
            for table in (module._parameters, module._buffers):
                for name, tensor in list(table.items()):
                    if tensor is not None and tensor.is_inference() and type(tensor) in (torch.Tensor, nn.Parameter):
                        swapped.append((table, name, tensor))
                        table[name] = _normal_alias(tensor)
        yield len(swapped)
    finally:
        for table, name, tensor in reversed(swapped):
            table[name] = tensor


@contextmanager
def training_mode() -> Iterator[None]:
    """Inference mode off and gradients on, whatever the host set around the node."""
    with torch.inference_mode(False), torch.enable_grad():
        yield
