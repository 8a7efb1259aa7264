"""ComfyUI's own model files that the single-file templates name, and tiny stand-ins under those names.

A template on Load Video Model Files names Comfy-Org's files (wan2.1_t2v_14B_fp8_scaled.safetensors,
umt5_xxl_fp8_e4m3fn_scaled.safetensors, ...). For the tests and a test host, `place_tiny_model_files`
writes the tiny random Wan model of `vidmem.pipelines.tiny_files` under exactly those names, in the
storage the name says (fp8 scaled, fp16, bf16), into a ComfyUI-style models folder:

    python tests/workflow_runner.py place-files /path/to/ComfyUI/models

An existing file is never overwritten (a running server may have it memory-mapped): files are
written to a scratch folder beside the target and moved into place only where the name is free.
The tiny model's config goes to models/vidmem_configs/, where the loader node matches files.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

try:
    from . import workflow_runner as wr
except ImportError:  # tests/ is not a package: run from tests/ or with tests/ on sys.path
    import workflow_runner as wr

FOLDERS = {"model": "diffusion_models", "model_2": "diffusion_models", "text_encoder": "text_encoders", "vae": "vae",
           "clip_vision": "clip_vision"}
CONFIGS = "vidmem_configs"
UNUSED = "(none)"


@dataclass(frozen=True)
class TemplateFiles:
    """The files one Load Video Model Files node names: loader input -> file name."""

    names: tuple[tuple[str, str], ...]

    @property
    def by_role(self) -> dict[str, str]:
        return dict(self.names)

    @property
    def variant(self) -> str:
        """The tiny model that stands in for these files (an A14B when a second expert is named: the
        I2V one when the name says so)."""
        roles = self.by_role
        variant = wr.tiny_variant_for(roles["model"])
        if "model_2" in roles and not variant.endswith("a14b"):
            return "wan2.2-a14b"
        return variant

    def paths(self, models_root: Path) -> dict[str, Path]:
        return {role: Path(models_root) / FOLDERS[role] / name for role, name in self.names}


def referenced_model_files(paths: list[Path] | None = None) -> list[TemplateFiles]:
    """Every distinct set of files the API workflows' Load Video Model Files nodes name."""
    found = []
    for path in paths or wr.api_files():
        for node in wr.load_json(path).values():
            if node["class_type"] == wr.FILES_LOADER:
                names = tuple((role, node["inputs"][role]) for role in FOLDERS if node["inputs"].get(role, UNUSED) != UNUSED)
                found.append(TemplateFiles(names))
    return list(dict.fromkeys(found))


def storage_named(file_name: str) -> str:
    """The storage a Comfy-Org file name states: fp8 ..._scaled, fp8_e4m3fn, fp16 or bf16 (the default)."""
    name = file_name.lower()
    if "fp8" in name:
        return "fp8_scaled" if "scaled" in name else "fp8_e4m3fn"
    return "fp16" if "fp16" in name else "bf16"


def place_tiny_model_files(models_root: Path, paths: list[Path] | None = None) -> list[Path]:
    """Tiny files under every name the API workflows' file loaders use; existing files are kept.

    Returns the path of every named file (placed now or already there).
    """
    from vidmem.pipelines.tiny_files import save_tiny_comfy_files

    models_root = Path(models_root)
    placed = []
    for files in referenced_model_files(paths):
        targets = files.paths(models_root)
        for storage, roles in _roles_by_storage(files).items():
            missing = [role for role in roles if not targets[role].is_file()]
            if not missing:
                continue
            with tempfile.TemporaryDirectory(dir=_scratch_parent(models_root)) as scratch:
                written = save_tiny_comfy_files(files.variant, scratch, storage, reference=False,
                                                file_names={role: files.by_role[role] for role in FOLDERS if role in files.by_role})
                for role in missing:
                    _move_if_free(Path(getattr(written.files, role)), targets[role])
                config = Path(scratch) / CONFIGS / f"tiny-{files.variant}.json"
                (models_root / CONFIGS).mkdir(parents=True, exist_ok=True)
                os.replace(config, models_root / CONFIGS / config.name)  # a JSON read per load: replacing is safe
        placed += list(targets.values())
    return placed


def _roles_by_storage(files: TemplateFiles) -> dict[str, list[str]]:
    """Roles grouped by the storage their names state; the VAE goes with the model (plain weights)."""
    roles = files.by_role
    groups: dict[str, list[str]] = {}
    for role in roles:
        storage = storage_named(roles["model"] if role == "vae" else roles[role])
        groups.setdefault(storage, []).append(role)
    return groups


def _scratch_parent(models_root: Path) -> Path:
    """A scratch folder on the models folder's file system, so the final move is a rename."""
    models_root.mkdir(parents=True, exist_ok=True)
    return models_root


def _move_if_free(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists():
        return
    shutil.move(str(source), str(target))


# The Comfy-Org files the single-file templates name, by role, with the shipped config and storage they are.
REAL_FILES = {
    "wan2.1_t2v_1.3B_bf16.safetensors": ("wan2.1-t2v-1.3b", "transformer", "bf16"),
    "wan2.1_t2v_14B_fp8_scaled.safetensors": ("wan2.1-t2v-14b", "transformer", "fp8_scaled"),
    "wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors": ("wan2.2-t2v-a14b", "transformer", "fp8_scaled"),
    "wan2.2_t2v_low_noise_14B_fp8_scaled.safetensors": ("wan2.2-t2v-a14b", "transformer_2", "fp8_scaled"),
    "umt5_xxl_fp8_e4m3fn_scaled.safetensors": ("wan2.1-t2v-14b", "text_encoder", "fp8_scaled"),
    "wan_2.1_vae.safetensors": ("wan2.1-t2v-14b", "vae", "bf16"),
    "wan2.2_i2v_high_noise_14B_fp8_scaled.safetensors": ("wan2.2-i2v-a14b", "transformer", "fp8_scaled"),
    "wan2.2_i2v_low_noise_14B_fp8_scaled.safetensors": ("wan2.2-i2v-a14b", "transformer_2", "fp8_scaled"),
    "wan2.1_i2v_480p_14B_fp8_scaled.safetensors": ("wan2.1-i2v-14b-480p", "transformer", "fp8_scaled"),
    "clip_vision_h.safetensors": ("wan2.1-i2v-14b-480p", "image_encoder", "fp16"),
    "wan2.1_flf2v_720p_14B_fp8_e4m3fn.safetensors": ("wan2.1-flf2v-14b-720p", "transformer", "fp8_e4m3fn"),
}
ROLE_OF = {"transformer": "model", "transformer_2": "model_2", "text_encoder": "text_encoder", "vae": "vae",
           "image_encoder": "clip_vision"}


def place_real_size_headers(models_root: Path) -> list[Path]:
    """Comfy-Org's files for the single-file templates at their real size, with every weight a hole
    of a sparse file (a few MB on disk): the plan on the Memory Strategy node then plans the real
    models (it reads headers only), as in docs/screenshots/plan_*.png. Never for a run: the weights
    are zeros. Existing files are kept."""
    from vidmem.pipelines.comfy_files import shipped_catalogue
    from vidmem.pipelines.comfy_files.random_files import write_random_file
    from vidmem.pipelines.tiny_files import tiny_spiece_model

    entries = {entry.name: entry for entry in shipped_catalogue()}
    written = []
    for name, (model, component, storage) in REAL_FILES.items():
        path = Path(models_root) / FOLDERS[ROLE_OF[component]] / name
        if not path.exists():
            spiece = tiny_spiece_model() if component == "text_encoder" else None
            write_random_file(entries[model].components[component], path, storage, spiece_model=spiece, holes=True)
        written.append(path)
    return written
