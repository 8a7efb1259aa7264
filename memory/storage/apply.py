"""assign_weights: give a model built on the meta device its weights, stored as the files hold them.

Rules, per tensor of the model (parameters and buffers, by qualified name; tied names share):
- A plain tensor already in its target dtype is used in place: a file-backed tensor stays in the
  file's mapping (page cache), nothing is copied.
- The weight of an `nn.Linear` / `nn.Embedding` that is stored differently from its target dtype
  (fp8, scaled fp8, GGUF, or a plain wider/narrower float such as a bf16 file run in fp32) stays
  stored: the layer is swapped for StoredLinear / StoredEmbedding, which upcasts per call.
- Any other tensor in another dtype (biases, norms, convolutions, modulation tables) is cast once
  at load, and a quantized one is dequantized once; both are listed in the report, because they
  are new anonymous memory.
- The target dtype is `compute_dtype`, or float32 inside modules named in `keep_fp32` (diffusers'
  `_keep_in_fp32_modules`: a pattern matches a whole dotted component of the name). Integer and
  bool tensors keep their dtype.
- A name the model has that `tensors` lacks, or a key `tensors` has that the model lacks, raises
  StorageError listing them: nothing is dropped silently. That includes persistent buffers (LTX-2's
  VAE `latents_mean` / `latents_std`): the files carry them, and the value the model computed when
  built is a placeholder (a std of 1.0), not the trained one. Only a non-persistent buffer (Wan's
  rotary tables) is kept as the model computed it (reported).

Buffers that are not in the files (Wan's rotary tables, position ids) must be computed when the
model is built: build under `accelerate.init_empty_weights()` (parameters on meta, buffers real,
as diffusers' own loader does), not under `torch.device("meta")`. A tensor still on meta after
assignment raises StorageError naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

import torch
from torch import nn

from .accounting import Ledger, StorageReport
from .errors import StorageError
from .formats import StorageFormat
from .modules import StoredEmbedding, StoredLinear
from .stored import FP8_DTYPES, StoredTensor, stored_format_of

LISTED = 10  # names shown in an error message
PLAIN_STORED = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class _Entry:
    """One tensor of the model and every qualified name it is known by (tied names share one)."""

    names: list[str]
    is_parameter: bool
    persistent: bool
    current: torch.Tensor


def assign_weights(
    module: nn.Module,
    tensors: Mapping[str, torch.Tensor | StoredTensor],
    compute_dtype: torch.dtype,
    keep_fp32: Iterable[str] = (),
    source: str = "the weights",
) -> StorageReport:
    """Fill `module` (built with meta parameters) from `tensors`; returns what was held, how.

    `source` names the file(s) in error messages. `module` is changed in place (parameters and
    buffers replaced, quantized Linear/Embedding children swapped); on error it is left as is.
    """
    entries = _entries(module)
    _check_fit(entries, tensors, source)
    keep = tuple(keep_fp32)
    ledger = Ledger()
    swaps: list[tuple[_Entry, StoredTensor, torch.dtype]] = []
    assigned: list[tuple[_Entry, torch.Tensor]] = []
    for entry in entries:
        present = [n for n in entry.names if n in tensors]
        if not present:
            ledger.kept_computed(entry.names[0], entry.current)
            continue
        value, target, stored = _placed(module, entry, tensors[present[0]], compute_dtype, keep)
        if stored:
            _check_lookup(module, entry, value, source)
            swaps.append((entry, value, target))
        else:
            assigned.append((entry, _materialise(entry.names[0], value, target, ledger)))
    for entry, tensor in assigned:
        _point(module, entry, tensor)
    places = _places(module) if swaps else {}
    for entry, stored, target in swaps:
        _swap(module, places, entry, stored, target)
        ledger.stored(entry.names[0], stored)
    _check_no_meta(module, source)
    return ledger.report()


def bytes_copied(module: nn.Module, tensors: Mapping[str, torch.Tensor | StoredTensor], compute_dtype: torch.dtype,
                 keep_fp32: Iterable[str] = ()) -> int:
    """The bytes `assign_weights(module, tensors, compute_dtype, keep_fp32)` allocates anew (the casts and the
    dequantized copies its report lists), from shapes and dtypes only: nothing is allocated and `module` may
    be built on meta. Why: a loader's RAM check counts by the fill's own rules, so what it promises is what
    the fill does. Names the model lacks are ignored here (assign_weights refuses them)."""
    keep, total = tuple(keep_fp32), 0
    for entry in _entries(module):
        present = [n for n in entry.names if n in tensors]
        if not present:
            continue
        value, target, stored = _placed(module, entry, tensors[present[0]], compute_dtype, keep)
        if not stored and _copy_made(value, target) is not None:
            total += value.shape.numel() * target.itemsize
    return total


def _placed(module: nn.Module, entry: _Entry, value: torch.Tensor | StoredTensor, compute_dtype: torch.dtype,
            keep: tuple[str, ...]) -> tuple[torch.Tensor | StoredTensor, torch.dtype | None, bool]:
    """`value` as the model holds it for `entry`, its target dtype, and whether it is swapped in stored."""
    target = _target_dtype(entry.names, value, compute_dtype, keep)
    storable = _storable(module, entry)
    value = _as_stored(value, target, storable)
    return value, target, storable and isinstance(value, StoredTensor) and _stays_stored(value, target)


def _entries(module: nn.Module) -> list[_Entry]:
    entries = _entries_by_identity(module)
    return _merge_declared_ties(entries, getattr(module, "_tied_weights_keys", None))


def _merge_declared_ties(entries: list[_Entry], tied) -> list[_Entry]:
    """transformers declares ties ({target: source}) that it only makes in from_pretrained; a
    model built empty holds two tensors. One file key then serves both, and both names end up
    holding one tensor, as from_pretrained would leave them."""
    if not isinstance(tied, Mapping):
        return entries
    by_name = {name: entry for entry in entries for name in entry.names}
    for target, source in tied.items():
        kept, merged = by_name.get(source), by_name.get(target)
        if kept is None or merged is None or kept is merged:
            continue
        kept.names += merged.names
        for name in merged.names:
            by_name[name] = kept
        entries = [e for e in entries if e is not merged]
    return entries


def _entries_by_identity(module: nn.Module) -> list[_Entry]:
    by_id: dict[int, _Entry] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), _Entry([], True, True, param)).names.append(name)
    for name, buffer in module.named_buffers(remove_duplicate=False):
        owner_name, _, leaf = name.rpartition(".")
        persistent = leaf not in module.get_submodule(owner_name)._non_persistent_buffers_set
        entry = by_id.setdefault(id(buffer), _Entry([], False, persistent, buffer))
        entry.names.append(name)
        entry.persistent = entry.persistent and persistent
    return list(by_id.values())


def check_weights(module: nn.Module, tensors: Mapping[str, torch.Tensor | StoredTensor],
                  source: str = "the weights") -> None:
    """StorageError naming `source` when `tensors` would not fill `module` (missing or extra names, other
    shapes): assign_weights' own checks, with nothing assigned. `module` may be built on meta, so a loader
    checks every file before it fills the first (a broken VAE refused before a 14B transformer is read)."""
    _check_fit(_entries(module), tensors, source)


def _check_fit(entries: list[_Entry], tensors: Mapping, source: str) -> None:
    _check_keys(entries, tensors, source)
    for entry in entries:
        present = next((n for n in entry.names if n in tensors), None)
        if present is not None:
            _check_shape(present, tensors[present], entry.current, source)


def _check_keys(entries: list[_Entry], tensors: Mapping, source: str) -> None:
    known = {name for entry in entries for name in entry.names}
    unexpected = [key for key in tensors if key not in known]
    absent = [entry for entry in entries if not any(n in tensors for n in entry.names)]
    uncomputed = [e.names[0] for e in absent if not e.persistent and e.current.is_meta]
    if uncomputed:
        raise StorageError(
            f"{_listed(uncomputed)} are buffers no file holds (the model computes them when built), but they "
            "are on the meta device: build the model under accelerate.init_empty_weights() (buffers stay "
            "real) instead of torch.device('meta')."
        )
    # A persistent buffer belongs in the files like a parameter: the built model's value is a placeholder.
    missing = [e.names[0] for e in absent if e.is_parameter or e.persistent or e.current.is_meta]
    if not (missing or unexpected):
        return
    parts = []
    if missing:
        parts.append(f"{len(missing)} tensors the model needs are missing ({_listed(missing)})")
    if unexpected:
        parts.append(f"{len(unexpected)} tensors are not part of the model ({_listed(unexpected)})")
    raise StorageError(
        f"{source} do not match the model: {'; '.join(parts)}. The file is for another model or "
        "variant, or uses a key layout vidmem does not know; pick the matching file."
    )


def _check_shape(name: str, value, current: torch.Tensor, source: str) -> None:
    if tuple(value.shape) != tuple(current.shape):
        raise StorageError(
            f"{source}: '{name}' has shape {list(value.shape)} in the file but {list(current.shape)} in the model; "
            "the file is for another model size or variant; pick the matching file."
        )


def _listed(names: list[str]) -> str:
    more = f", and {len(names) - LISTED} more" if len(names) > LISTED else ""
    return ", ".join(names[:LISTED]) + more


def _as_stored(value: torch.Tensor | StoredTensor, target: torch.dtype | None, storable: bool) -> torch.Tensor | StoredTensor:
    """fp8 tensors are stored weights even when passed plain; so is a Linear/Embedding weight in
    another float dtype (a bf16 file computed in fp32): upcast per call, never copied whole."""
    if isinstance(value, StoredTensor) or target is None:
        return value
    if value.dtype in FP8_DTYPES or (storable and value.dtype != target and value.dtype in PLAIN_STORED):
        return StoredTensor(value, stored_format_of(value.dtype), value.shape)
    return value


def _target_dtype(names: list[str], value, compute_dtype: torch.dtype, keep: tuple[str, ...]) -> torch.dtype | None:
    """The dtype the model holds this tensor in; None keeps an integer or bool tensor as it is."""
    if isinstance(value, torch.Tensor) and not value.is_floating_point():
        return None
    if _kept_in_fp32(names, keep):
        return torch.float32
    return compute_dtype


def _kept_in_fp32(names: list[str], keep: tuple[str, ...]) -> bool:
    """Whether a tensor of `names` lies in a module `keep` names (a path component: "time_embedder", "norm1")."""
    return any(pattern in name.split(".") for name in names for pattern in keep)


def _stays_stored(value: StoredTensor, target: torch.dtype) -> bool:
    return value.format.quantized or value.scale is not None or value.format.torch_dtype != target


def stays_stored(module: nn.Module) -> frozenset[str]:
    """The qualified names of the weights `module` can hold stored (every name of a tied one): what
    `assign_weights` keeps stored, so a loader lowers nothing else (the rest would be dequantized
    into a dense copy at load) and the planner counts nothing else at a stored format's bytes."""
    return frozenset(name for entry in _entries(module) if _storable(module, entry) for name in entry.names)


def lowered_weights(module: nn.Module, fmt: StorageFormat, keep_fp32: Iterable[str] = ()) -> frozenset[str]:
    """The qualified names of the weights `fmt` stores narrow in `module`: the format's declaration
    (`StorageFormat.lowers`) on each owning layer, of the weights the model can hold stored
    (`stays_stored`), less those under `keep_fp32`, the modules the model holds in float32 at its compute
    dtype (`assign_weights`'s rule: diffusers' `_keep_in_fp32_modules`): a weight_dtype rounds nothing the
    files' own storage keeps wide. The one rule the loaders lower by; the planner counts by it without
    `keep_fp32` (its storage names a file's format, and a file stored narrow holds those layers narrow too:
    docs/storage.md says what that leaves out)."""
    keep = tuple(keep_fp32)
    return frozenset(name for name in stays_stored(module)
                     if fmt.lowers(_owner(module, name)[0]) and not _kept_in_fp32([name], keep))


def _storable(root: nn.Module, entry: _Entry) -> bool:
    """A Linear or Embedding weight (every owner of a tied one, all of one class) can stay stored;
    not an Embedding subclass with its own forward, which StoredEmbedding's plain lookup would drop
    (Gemma 3's token table scales its rows by sqrt(hidden_size))."""
    if not entry.is_parameter:
        return False
    owners = [_owner(root, name) for name in entry.names]
    kinds = {type(m) for m, leaf in owners if leaf == "weight"}
    if len(kinds) != 1 or any(leaf != "weight" for _, leaf in owners):
        return False
    kind = kinds.pop()
    if issubclass(kind, nn.Embedding):
        return kind.forward is nn.Embedding.forward
    return issubclass(kind, nn.Linear)


def _owner(root: nn.Module, name: str) -> tuple[nn.Module, str]:
    prefix, _, leaf = name.rpartition(".")
    return root.get_submodule(prefix), leaf


def _materialise(name: str, value, target: torch.dtype | None, ledger: Ledger) -> torch.Tensor:
    """The plain tensor the model will hold: in place when possible, else a counted copy."""
    made = _copy_made(value, target)
    if made is None:
        held = value.data if isinstance(value, StoredTensor) else value  # a plain format already in its dtype
        ledger.held(name, held)
        return held
    tensor = value.dequantize(target) if made == "dequantized" else value.to(target)
    ledger.copied(name, tensor, made)
    return tensor


def _copy_made(value: torch.Tensor | StoredTensor, target: torch.dtype | None) -> str | None:
    """What `_materialise` makes of `value` held plain: None where it holds the given tensor in place,
    else how the new tensor of `target` comes ("dequantized" or "cast")."""
    if isinstance(value, StoredTensor):
        return "dequantized" if _stays_stored(value, target) else None
    return None if target is None or value.dtype == target else "cast"


def _point(root: nn.Module, entry: _Entry, tensor: torch.Tensor) -> None:
    shared = nn.Parameter(tensor, requires_grad=False) if entry.is_parameter else tensor
    for name in entry.names:
        owner, leaf = _owner(root, name)
        if entry.is_parameter:
            owner._parameters[leaf] = shared
        else:
            owner._buffers[leaf] = shared


def _places(root: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """Where each module sits: (parent, attribute) for every path it appears at."""
    found: dict[int, list[tuple[nn.Module, str]]] = {}
    for parent in root.modules():
        for leaf, child in parent._modules.items():
            if child is not None:
                found.setdefault(id(child), []).append((parent, leaf))
    return found


def _swap(root: nn.Module, places: dict, entry: _Entry, stored: StoredTensor, target: torch.dtype) -> None:
    """Replace every owner of a stored weight by its Stored* twin, at every place it sits."""
    owners = {id(m): m for m, _ in (_owner(root, name) for name in entry.names)}
    for key, owner in owners.items():
        twin = _twin(owner, stored, target)
        for parent, leaf in places.get(key, []):
            setattr(parent, leaf, twin)


def _twin(owner: nn.Module, stored: StoredTensor, target: torch.dtype) -> nn.Module:
    if isinstance(owner, nn.Linear):
        return StoredLinear(stored, owner.bias, target)
    return StoredEmbedding(stored, target, owner.padding_idx, owner.max_norm)


def _check_lookup(root: nn.Module, entry: _Entry, stored: StoredTensor, source: str) -> None:
    """A stored embedding table must allow row lookups (StoredEmbedding): refuse it at load."""
    owner, _ = _owner(root, entry.names[0])
    problem = stored.row_selection_problem() if isinstance(owner, nn.Embedding) else None
    if problem:
        raise StorageError(f"{source}: '{entry.names[0]}' is stored as {stored.format.name} in a way vidmem cannot look "
                           f"rows up in: {problem}. Use a file that keeps this table as a 2-D tensor (or bf16/fp16).")


def _check_no_meta(module: nn.Module, source: str) -> None:
    left = [n for n, t in (*module.named_parameters(), *module.named_buffers()) if t.is_meta]
    if left:
        raise StorageError(
            f"after loading {source}, {_listed(left)} are still on the meta device: they are not in the "
            "files and were not computed when the model was built. Build the model under "
            "accelerate.init_empty_weights() (buffers stay real) instead of torch.device('meta')."
        )
