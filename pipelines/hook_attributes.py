"""What registering a diffusers hook adds to a module, and how the module is left as found.

diffusers' `HookRegistry` puts a registry on the module (`_diffusers_hook`) and the hooked forward as
an instance attribute (`forward`); `remove_hook` takes the hook out but leaves both behind. vidmem's
hooks (step cache, context windows, activation chunks) each note what a module held before and, once
its registry holds no hook (someone else's still there: theirs to undo), put exactly that back.
"""

from __future__ import annotations

from torch import nn

TOUCHED = ("forward", "_diffusers_hook")  # instance attributes registering a diffusers hook may add


def as_found(module: nn.Module) -> dict:
    """The instance attributes of TOUCHED that `module` holds now."""
    return {key: module.__dict__[key] for key in TOUCHED if key in module.__dict__}


def leave_as_found(module: nn.Module, before: dict) -> None:
    """Put back `before` (as_found's) once `module`'s registry holds no hook."""
    registry = getattr(module, "_diffusers_hook", None)
    if registry is not None and registry.hooks:
        return
    for key in TOUCHED:
        if key in before:
            module.__dict__[key] = before[key]
        else:
            module.__dict__.pop(key, None)
