"""Training inside a host that runs every node under torch.inference_mode() (ComfyUI's executor does).

Autograd refuses inference tensors: it cannot save them for the backward, and they carry no
version counter. Tensors made while a node ran under inference mode are such tensors: the
pipeline's weights (loaded by the loader node), LoRA matrices loaded by Load LoRA. The trainer
therefore runs with inference mode off and gradients on, and for the run points every parameter
and buffer of the denoiser that is an inference tensor at a normal tensor over the same storage
(no copy); afterwards the module holds its own objects again.

Why an inference parameter is emptied for the run, then pointed at its alias's bytes: a streaming
tier gives the alias a pinned home (HostPool copies the bytes once and re-points the alias there).
Were the original still holding the pageable bytes, the streamed blocks would sit in RAM twice
during training, and the original, put back pageable, would be pinned a second time by the next
sampler run. So the alias holds the only reference to those bytes while it runs, and afterwards the
original Parameter (the same object, an inference tensor again) lies over whatever its alias lies
over: the pinned home, kept, as a sampler run leaves it. A buffer is not emptied, since its object
may be another's (Load LoRA registers its matrices as they are); one the pool replaced by a home is
put back as an inference view of that home, again as a sampler run leaves it.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch.utils.weak import WeakIdKeyDictionary
from torch import nn


def _normal_alias(tensor: torch.Tensor) -> torch.Tensor:
    """A non-inference tensor sharing `tensor`'s storage, shape and strides (made outside inference mode)."""
    alias = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    alias.set_(tensor.untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride())
    if isinstance(tensor, nn.Parameter):
        return nn.Parameter(alias, requires_grad=tensor.requires_grad)
    return alias


def _inference_view(tensor: torch.Tensor) -> torch.Tensor:
    """An inference tensor over `tensor`'s storage, shape and strides (no copy)."""
    with torch.inference_mode():
        view = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
        return view.set_(tensor.untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride())


def _swappable(tensor: torch.Tensor | None) -> bool:
    # Tensor subclasses (GGUF, torchao) are left as they are: `set_` would drop their type.
    return tensor is not None and tensor.is_inference() and type(tensor) in (torch.Tensor, nn.Parameter)


def _parameter_alias(parameter: nn.Parameter, aliases: dict) -> nn.Parameter:
    """The parameter's alias, one per object (weights tied between modules stay tied); the first
    call empties the original, so the alias holds the only reference to its bytes."""
    if id(parameter) not in aliases:
        aliases[id(parameter)] = (parameter, _normal_alias(parameter))
        with torch.inference_mode():  # it stays an inference tensor, with no bytes of its own for the run
            parameter.data = torch.empty(0, dtype=parameter.dtype, device=parameter.device)
    return aliases[id(parameter)][1]


# An inference buffer (Load LoRA's matrices) -> its normal alias, the same object run after run: the host pool
# knows a source by identity, so a new alias per training run took a new pinned home each run. Weak: it goes
# with the buffer (the alias holds the buffer's storage, not the buffer).
_BUFFER_ALIASES = WeakIdKeyDictionary()


def _buffer_alias(buffer: torch.Tensor) -> torch.Tensor:
    alias = _BUFFER_ALIASES.get(buffer)
    if alias is None or not _same_bytes(alias, buffer):
        alias = _BUFFER_ALIASES[buffer] = _normal_alias(buffer)
    return alias


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


@contextmanager
def normal_tensors(model: nn.Module) -> Iterator[int]:
    """Swap the model's inference-mode parameters and buffers for normal aliases; yields how many.

    Afterwards each original parameter is back, over the bytes its alias ended over (a pinned home
    made for the run is kept); each buffer is back, or an inference view of what replaced it.
    """
    aliases: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # id(original) -> (original, alias)
    swapped = []
    try:
        for module in model.modules():
            for table, is_parameter in ((module._parameters, True), (module._buffers, False)):
                for name, tensor in list(table.items()):
                    if _swappable(tensor):
                        swapped.append((table, name, tensor))
                        table[name] = _parameter_alias(tensor, aliases) if is_parameter else _buffer_alias(tensor)
        yield len(swapped)
    finally:
        for original, alias in aliases.values():
            # Its own bytes were given up: it takes its alias's, on its own device even if a failed clean-up
            # left the alias on the GPU (a copy then, where it would otherwise hold device memory).
            data = alias.data if alias.device == original.device else alias.data.to(original.device)
            with torch.inference_mode():  # so the original stays an inference tensor
                original.data = _inference_view(data)
        for table, name, tensor in reversed(swapped):
            current = table.get(name)
            kept = isinstance(tensor, nn.Parameter) or current is None or _same_bytes(current, tensor)
            table[name] = tensor if kept else _inference_view(current)


@contextmanager
def training_mode() -> Iterator[None]:
    """Inference mode off and gradients on, whatever the host set around the node."""
    with torch.inference_mode(False), torch.enable_grad():
        yield
