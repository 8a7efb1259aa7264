"""PipelineSource: how a rank opens its own copy of the coordinator's pipeline.

Ranks never receive weights through a pipe: each one reads the same safetensors files (a
memory mapping, so ranks on one machine share the page cache) and reapplies the same LoRA
files. The source is a small frozen dataclass, cheap to send with every job, and its equality
tells a rank whether the pipeline it already holds is the one asked for.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from ...memory.context_parallel import RANK_STORAGE
from ..comfy_files.text_encoder_file import FOLDER_CHOICE
from ..family import ModelError
from ..loader import LoadedPipeline, load_pipeline
from ..lora import load_lora
from ..weight_storage import DEFAULT_WEIGHTS


@dataclass(frozen=True)
class LoraSource:
    name: str
    path: str
    strength: float
    expert: str
    # The file's identity when the coordinator loaded it: a LoRA re-trained under the same name
    # (the train-then-sample templates rewrite models/loras/<name>.safetensors) must reload in the
    # ranks, which compare sources by equality.
    size: int = 0
    mtime_ns: int = 0

    @classmethod
    def of(cls, name: str, path: str, strength: float, expert: str) -> "LoraSource":
        """ModelError when the file has gone since it was applied here: each rank reapplies it from disk."""
        try:
            stat = os.stat(path)
        except OSError as error:
            raise ModelError(f"LoRA '{name}' was applied from {path}, which the ranks cannot read now "
                             f"({error.strerror}); each rank reapplies its LoRAs from their files. Put the file back "
                             "(or reload the LoRA), or set context_parallel to off: this process keeps it applied.") from error
        return cls(name, str(path), strength, expert, stat.st_size, stat.st_mtime_ns)


@dataclass(frozen=True)
class PipelineSource:
    folder: str
    dtype: str
    loras: tuple[LoraSource, ...] = ()
    vae_dtype: str = ""  # the loader's vae_dtype ("" follows dtype)

    @classmethod
    def of(cls, loaded: LoadedPipeline) -> "PipelineSource":
        """The source of a pipeline loaded from a diffusers folder; ModelError for anything else."""
        if loaded.config_name or loaded.storage or loaded.source != loaded.folder:
            raise ModelError(f"{RANK_STORAGE}; this pipeline comes from {loaded.source}. Load the diffusers folder with "
                             f"Load Video Pipeline, its transformer_file, vae_file, text_encoder_file and text_encoder_2_file "
                             f"left at {FOLDER_CHOICE} and weight_dtype at {DEFAULT_WEIGHTS}, or set context_parallel to off.")
        loras = tuple(LoraSource.of(spec.name, str(spec.path), spec.strength, spec.expert) for spec in loaded.loras)
        return cls(loaded.folder, loaded.dtype_name, loras, loaded.vae_dtype_name)

    def load(self) -> LoadedPipeline:
        loaded = load_pipeline(self.folder, self.dtype, vae_dtype=self.vae_dtype)
        specs = tuple(load_lora(lora.path, loaded.pipe, lora.strength, lora.expert, name=lora.name) for lora in self.loras)
        return replace(loaded, loras=specs) if specs else loaded
