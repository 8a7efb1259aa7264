"""A diffusers folder's VAE replaced by a single VAE file (Load Video Pipeline's `vae_file`).

The file is read by its tensors, as Load Video Model Files reads its `vae` (files.read_weight_file):
Wan 2.1 / 2.2 VAEs in their original or diffusers names, HunyuanVideo 1.5's as Comfy-Org ships it
or ComfyUI's Save VAE writes it (hy15_vae.py), either behind a checkpoint's prefix. It must be the folder's VAE class and fit the folder's vae/config.json field by field;
otherwise it is refused naming the file and the fix before anything is built. CogVideoX has no
single-file VAE in vidmem, and LTX-2's checkpoint brings its own (transformer_file).

The VAE is built empty from the folder's config and given the file's tensors in place, cast to the
compute dtype as the folder's VAE is by diffusers (so an fp16 file over a bf16 folder runs in bf16,
as the planner assumes: the VAE's dtype is the loader's dtype / vae_dtype, never the file's).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch

from ..family import FamilySpec, ModelError
from . import detect, hy15_vae
from .files import WeightFile, model_tensors, read_weight_file

ROLE = "vae_file"
# The VAE class of each family that takes a VAE file, and the files it takes (for messages).
READ_CLASSES = {"AutoencoderKLWan": "a Wan VAE (wan_2.1_vae / wan2.2_vae.safetensors)",
                hy15_vae.CLASS_NAME: "HunyuanVideo 1.5's VAE (hunyuanvideo15_vae_fp16.safetensors)"}
_SHOWN = {"ltx2": "LTX-2", "cogvideox": "CogVideoX"}


def check_family(spec: FamilySpec, vae_class: str | None) -> None:
    """Refuse `vae_file` for a folder whose VAE vidmem reads no single file of (before any file is read)."""
    if vae_class in READ_CLASSES:
        return
    fix = "leave vae_file at (from the folder)"
    if spec.name == "ltx2":
        fix = f"an LTX-2 checkpoint (ltx-2-19b-dev*) carries its video VAE: pick it as transformer_file and {fix}"
    raise ModelError(f"vae_file is not supported for {_SHOWN.get(spec.name, spec.name)} (its VAE is {vae_class}; vidmem "
                     f"reads the VAE files of Wan and HunyuanVideo 1.5 only); {fix}.")


def read_vae_file(path: str | Path, vae_class: str, config: Mapping[str, Any], folder: str | Path) -> WeightFile:
    """The VAE file at `path`, checked to be the folder's VAE (`vae_class` configured by `config`)."""
    path, folder = Path(path), Path(folder)
    file = read_weight_file(path, ROLE, detect.VAE, takes=READ_CLASSES.get(vae_class, ""))  # the folder's VAE, not KIND_NAMES' Wan
    is_hy15 = hy15_vae.is_vae(file.tensors)
    if is_hy15 != (vae_class == hy15_vae.CLASS_NAME):
        held = "HunyuanVideo 1.5's VAE" if is_hy15 else "a Wan VAE"
        raise ModelError(f"vae_file '{path.name}' is {held}, but '{folder.name}' uses {READ_CLASSES[vae_class]}; "
                         "pick that file, or leave vae_file at (from the folder).")
    wanted = hy15_vae.vae_config_fields(config) if is_hy15 else detect.vae_config_fields(config)
    problems = detect.differences(file.fields, wanted)
    if problems:
        raise ModelError(f"vae_file '{path.name}' is not the VAE of '{folder.name}' ({'; '.join(problems)}); pick the "
                         "VAE of the folder's model (Wan 2.2 TI2V-5B: wan2.2_vae; other Wan models: wan_2.1_vae), or "
                         "leave vae_file at (from the folder).")
    return file


def load_vae_file(path: str | Path, vae_class: str, config: Mapping[str, Any], folder: str | Path, dtype: torch.dtype):
    """The folder's VAE built from `config` and filled from the file at `path`, used in place from its
    mapping where already in `dtype`. Returns (module, held format, report)."""
    from ..configs.meta import ComponentConfig
    from ..weight_storage import DEFAULT_WEIGHTS, hold
    from .build import build_empty

    file = read_vae_file(path, vae_class, config, folder)
    component = ComponentConfig("vae", "diffusers", vae_class, dict(config), str(Path(folder) / "vae" / "config.json"))
    module = build_empty(component)
    tensors = model_tensors(file, module.state_dict().keys())
    report, _ = hold(module, tensors, dtype, DEFAULT_WEIGHTS, copy_to_ram=False, source=file.name)
    # Its convolutions are cast to `dtype` at load (as load.py's VAEs): report what it is held in.
    return module, report.formats[0].format, report
