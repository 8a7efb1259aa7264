"""A rank reuses its pipeline only while the coordinator's is the same: same folder, same LoRA
files (by size and modification time: a LoRA re-trained under the same name reloads) and the
same context-parallel mode (diffusers' parallelism is set once per copy)."""

from __future__ import annotations

import os
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from vidmem.memory import MemoryStrategy
from vidmem.memory.parallel import RankContext
from vidmem.memory.strategy import Parallelism
from vidmem.pipelines.family import ModelError
from vidmem.pipelines.parallel import job as job_module
from vidmem.pipelines.parallel.job import ParallelSampleJob
from vidmem.pipelines.parallel.source import PipelineSource
from vidmem.pipelines.sample import SampleRequest


def with_lora(loaded, path):
    return replace(loaded, loras=(SimpleNamespace(name="style", path=path, strength=1.0, expert="both"),))


def test_a_lora_rewritten_under_the_same_name_is_another_source(tiny_loaded, tmp_path):
    loaded, path = tiny_loaded("wan2.1-t2v"), tmp_path / "style.safetensors"
    path.write_bytes(b"first")
    first = PipelineSource.of(with_lora(loaded, path))
    assert PipelineSource.of(with_lora(loaded, path)) == first  # unchanged file: the ranks keep their copy
    path.write_bytes(b"retrained")
    stat = os.stat(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # coarse clocks: a later mtime for sure
    assert PipelineSource.of(with_lora(loaded, path)) != first


def test_a_rank_reopens_its_pipeline_when_the_mode_or_source_changes(tiny_loaded, monkeypatch):
    loaded, opened = tiny_loaded("wan2.1-t2v"), []
    monkeypatch.setattr(PipelineSource, "load", lambda self: opened.append(self) or SimpleNamespace(
        pipe=None, spec=SimpleNamespace(denoisers=())))
    monkeypatch.setattr(job_module, "enable_context_parallel", lambda *args: None)
    monkeypatch.setattr(job_module, "check_context_parallel", lambda *args: None)  # ring is refused on the CPU
    source, context = PipelineSource.of(loaded), RankContext(0, 2, torch.device("cpu"))
    request = SampleRequest("a cat", "", 32, 32, 5, 1, 5.0, seed=1)

    def job(mode, source=source):
        return ParallelSampleJob(source, MemoryStrategy(parallel=Parallelism(context_parallel=mode, degree=2)), request)

    job("ulysses")._pipeline(context)
    job("ulysses")._pipeline(context)
    assert len(opened) == 1, "the same source and mode: reused"
    job("ring")._pipeline(context)
    assert len(opened) == 2, "ulysses -> ring: a fresh copy"
    job("ring", replace(source, dtype="fp32" if source.dtype != "fp32" else "bf16"))._pipeline(context)
    assert len(opened) == 3


def test_a_rank_opens_the_vae_at_the_coordinators_vae_dtype(tiny_folder):
    """A rank's copy holds the VAE at the loader's vae_dtype (the image encoding of I2V runs on it), and a
    coordinator that changes only vae_dtype is another source."""
    from vidmem.pipelines.loader import load_pipeline

    folder = tiny_folder("wan2.1-t2v")
    wide = PipelineSource.of(load_pipeline(folder, "bf16", vae_dtype="fp32"))
    assert wide.vae_dtype == "fp32" and wide != PipelineSource.of(load_pipeline(folder, "bf16"))
    assert {t.dtype for t in wide.load().pipe.vae.parameters()} == {torch.float32}


def test_a_pipeline_with_single_files_is_refused_naming_every_file_input(tiny_loaded):
    """The refusal tells which of Load Video Pipeline's inputs to leave at (from the folder): any of the four."""
    loaded = tiny_loaded("wan2.1-t2v")
    from_file = replace(loaded, source=f"{loaded.folder} + umt5_xxl_fp16.safetensors",
                        text_encoder_files={"text_encoder": "umt5_xxl_fp16.safetensors"})
    with pytest.raises(ModelError) as error:
        PipelineSource.of(from_file)
    assert all(name in str(error.value) for name in ("transformer_file", "vae_file", "text_encoder_file",
                                                     "text_encoder_2_file", "(from the folder)"))
