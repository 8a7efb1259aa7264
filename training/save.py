"""Writing what training makes: the LoRA file and resumable checkpoints, atomically, safetensors only.

The LoRA file is written so that the pack's loader, diffusers and ComfyUI all apply the scale it
was trained with. ComfyUI reads alpha only from `<layer>.alpha` tensors, diffusers from its
`transformer.`-prefixed `lora_adapter_metadata` (as its `save_lora_weights` writes it) or, for
Wan's original names, from `.alpha` tensors: so `alpha / rank` is folded into `lora_B` (up) and
the metadata records `lora_alpha` = rank (scale 1), which every reader gets right. Keys: Wan in
its original layout (`diffusion_model.blocks.0.self_attn.q.lora_A.weight`, the names ComfyUI
maps and diffusers' Wan loader converts), other families in diffusers' naming
(`transformer.<module path>.lora_A.weight`; ComfyUI has no model for them). A Wan 2.2 expert's
LoRA is named like any other (diffusers loads it with `load_into_transformer_2`, ComfyUI onto
the model it is loaded with); the expert, the trained alpha and rank and the LoRAs trained over
are recorded in the `vidmem_training` metadata, and Load LoRA checks the expert.

Checkpoints keep the raw trained tensors (`transformer.<path>`, alpha unfolded) that resume reads.
Every write goes to a temporary name in the target folder and is renamed into place, so an
interrupted or failed save never leaves a half-written file under the name.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import safetensors
import safetensors.torch
import torch
from torch import nn

from ..pipelines.atomic import PARTIAL_SUFFIX, atomic_path
from .adapters import path_of
from .errors import TrainingError

PEFT_METADATA_KEY = "lora_adapter_metadata"
TRAINED_BY_KEY = "vidmem_training"  # marks files this trainer may overwrite
LORA_SUFFIX = ".safetensors"


def lora_file_name(name: str) -> str:
    """`name` as a file name under models/loras: no folders, no '..', `.safetensors` appended."""
    cleaned = name.strip()
    if cleaned.endswith(LORA_SUFFIX):
        cleaned = cleaned[: -len(LORA_SUFFIX)]
    if not cleaned or any(c in cleaned for c in "/\\:") or cleaned.startswith(".") or cleaned != os.path.basename(cleaned):
        raise TrainingError(f"lora_name={name!r} must be a plain file name such as 'my_style' (no folders, "
                            "not starting with a dot); the LoRA is written to models/loras/<lora_name>.safetensors.")
    return cleaned + LORA_SUFFIX


def check_writable(path: Path) -> None:
    """Refuse, before training, to replace a LoRA this trainer did not write (a downloaded one)."""
    if not path.exists():
        return
    try:
        with safetensors.safe_open(str(path), "pt") as opened:
            metadata = opened.metadata() or {}
    except Exception:  # noqa: BLE001 - anything unreadable is certainly not ours
        metadata = {}
    if TRAINED_BY_KEY not in metadata:
        raise TrainingError(f"{path} already exists and was not written by vidmem's trainer; choose another "
                            "lora_name (or move that file) so it is not overwritten.")


def check_output_folders(lora_path: Path, checkpoint_folder: Path) -> None:
    """Refuse, before training, outputs that cannot be written, rather than fail after every step.

    The LoRA is written in its folder, a checkpoint in a staging folder beside `checkpoint_folder`
    that is then renamed onto it: each of those folders is made and a temporary file written in it
    and removed. Folders made only for the check are removed again, so a refused run leaves nothing.
    """
    if checkpoint_folder.exists() and not checkpoint_folder.is_dir():
        raise TrainingError(f"the checkpoint folder {checkpoint_folder} is a file, not a folder; move that file "
                            "(or choose another lora_name) so checkpoints can be saved. Nothing was trained.")
    _check_folder(lora_path.parent, "the LoRA's folder", "the LoRA can be saved")
    _check_folder(checkpoint_folder.parent, f"the folder of checkpoint {checkpoint_folder.name}", "checkpoints can be saved")


def _check_folder(folder: Path, role: str, purpose: str) -> None:
    made = [p for p in (folder, *folder.parents) if not p.exists()]  # what mkdir makes, deepest first
    try:
        folder.mkdir(parents=True, exist_ok=True)
        handle, probe = tempfile.mkstemp(dir=folder, prefix=".vidmem-write-check.", suffix=PARTIAL_SUFFIX)
        os.close(handle)
        os.unlink(probe)
    except OSError as error:
        raise TrainingError(f"{role} {folder} cannot be written ({error}); make it a writable folder (a file in "
                            f"its place moved away, its permissions fixed) or choose another place, so {purpose}. "
                            "Nothing was trained.") from None
    finally:
        for path in made:
            try:
                path.rmdir()
            except OSError:  # not made here after all, or something was written into it meanwhile
                pass


def lora_tensors(layers: nn.ModuleDict, component_prefix: str = "transformer") -> dict[str, torch.Tensor]:
    """The raw trained tensors as a checkpoint keeps them: diffusers' naming, alpha not folded."""
    stems = {path_of(key): f"{component_prefix}.{path_of(key)}" for key in layers}
    return final_lora_tensors(layers, stems, 1.0)


def final_lora_tensors(layers: nn.ModuleDict, stems: dict[str, str], scale: float) -> dict[str, torch.Tensor]:
    """The LoRA file's tensors: `stems[path]` names each layer, `scale` (alpha / rank) folded into lora_B
    so that readers that take alpha from nowhere but `.alpha` tensors (ComfyUI) apply it too."""
    tensors = {}
    for key, layer in layers.items():
        stem = stems[path_of(key)]
        tensors[f"{stem}.lora_A.weight"] = layer.down.detach().to("cpu", torch.float32).contiguous()
        tensors[f"{stem}.lora_B.weight"] = (layer.up.detach().to("cpu", torch.float32) * scale).contiguous()
    return tensors


def lora_metadata(rank: int, alpha: float, targets: tuple[str, ...], info: dict,
                  component_prefix: str = "transformer") -> dict[str, str]:
    """Metadata as diffusers' save_lora_weights writes it (each PEFT field under `<component>.`, which
    its loader requires), plus the trainer's own record under TRAINED_BY_KEY."""
    adapter = {"r": rank, "lora_alpha": alpha, "target_modules": sorted(set(targets))}
    prefixed = {f"{component_prefix}.{field}": value for field, value in adapter.items()}
    return {PEFT_METADATA_KEY: json.dumps(prefixed, sort_keys=True), TRAINED_BY_KEY: json.dumps(info, sort_keys=True),
            "format": "pt"}


def write_safetensors_atomic(tensors: dict[str, torch.Tensor], metadata: dict[str, str], path: Path) -> Path:
    with atomic_path(path) as temporary:
        safetensors.torch.save_file(tensors, str(temporary), metadata=metadata)
    return path


def read_lora_tensors(layers: nn.ModuleDict, path: Path, component_prefix: str = "transformer") -> dict[str, torch.Tensor]:
    """A saved LoRA's tensors, checked to fit `layers` (same targets and rank, or TrainingError)."""
    saved = safetensors.torch.load_file(str(path))
    expected = lora_tensors(layers, component_prefix)
    if set(saved) != set(expected) or any(saved[k].shape != expected[k].shape for k in expected):
        raise TrainingError(f"checkpoint {path} holds other layers or ranks than this run trains; set resume to "
                            "false to start over, or use the settings it was made with.")
    return saved


def copy_lora_into(layers: nn.ModuleDict, saved: dict[str, torch.Tensor], component_prefix: str = "transformer") -> None:
    """Copy tensors read by read_lora_tensors into `layers` (checked there, so this cannot stop halfway)."""
    with torch.no_grad():
        for key, layer in layers.items():
            stem = f"{component_prefix}.{path_of(key)}"
            layer.down.copy_(saved[f"{stem}.lora_A.weight"])
            layer.up.copy_(saved[f"{stem}.lora_B.weight"])


# --- checkpoints: a folder of safetensors + JSON, replaced as a whole ---------------------------------

CHECKPOINT_FILES = ("lora.safetensors", "optimizer.safetensors", "state.json")


def write_checkpoint(folder: Path, lora: dict[str, torch.Tensor], lora_meta: dict[str, str],
                     optimizer_tensors: dict[str, torch.Tensor], optimizer_meta: str, state: dict) -> Path:
    """Write into a sibling temporary folder, then swap it in: a crash leaves the old checkpoint."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".tmp", dir=folder.parent))
    try:
        safetensors.torch.save_file(lora, str(staging / "lora.safetensors"), metadata=lora_meta)
        safetensors.torch.save_file(optimizer_tensors, str(staging / "optimizer.safetensors"), metadata={"optimizer": optimizer_meta})
        (staging / "state.json").write_text(json.dumps(state, indent=1, sort_keys=True))
        old = folder.with_name(f".{folder.name}.old")
        if folder.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(folder, old)
        os.replace(staging, folder)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return folder


def read_checkpoint(folder: Path) -> tuple[Path, dict[str, torch.Tensor], str, dict] | None:
    """(lora file, optimizer tensors, optimizer JSON, state) or None when there is no complete checkpoint.

    A crash between write_checkpoint's two renames leaves only the previous checkpoint, under its
    `.old` name: it is used rather than silently starting over. A damaged checkpoint is named.
    """
    complete = lambda path: all((path / name).is_file() for name in CHECKPOINT_FILES)  # noqa: E731
    if not complete(folder):
        old = folder.with_name(f".{folder.name}.old")
        if not complete(old):
            return None
        os.replace(old, folder)
    try:
        with safetensors.safe_open(str(folder / "optimizer.safetensors"), "pt") as opened:
            meta = (opened.metadata() or {}).get("optimizer", "")
            tensors = {key: opened.get_tensor(key) for key in opened.keys()}
        state = json.loads((folder / "state.json").read_text())
        if not isinstance(state, dict):
            raise ValueError("state.json does not hold a JSON object")
    except CHECKPOINT_DAMAGE as error:
        raise damaged_checkpoint(folder, error) from None
    return folder / "lora.safetensors", tensors, meta, state


# what reading a damaged checkpoint raises: a cut file (SafetensorError, OSError), bad JSON or a
# value of the wrong kind (ValueError, TypeError), a missing entry (KeyError)
CHECKPOINT_DAMAGE = (OSError, ValueError, TypeError, KeyError, safetensors.SafetensorError)


def damaged_checkpoint(folder: Path, error: BaseException) -> TrainingError:
    return TrainingError(f"the training checkpoint in {folder} is damaged ({type(error).__name__}: {error}); delete "
                         "that folder to start over, or set resume to false.")
