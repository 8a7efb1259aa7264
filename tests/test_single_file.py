"""Wan's single-file transformer (any layout and storage) replaces a folder's and samples the same."""

from __future__ import annotations

import pickle

import pytest
import torch

from vidmem.memory import MemoryStrategy
from vidmem.memory.device import CpuBackend
from vidmem.pipelines.comfy_files.keys import KeyLayout
from vidmem.pipelines.comfy_files.write import dequantized, store_tensors, write_transformer
from vidmem.pipelines.family import ModelError
from vidmem.pipelines.loader import load_pipeline
from vidmem.pipelines.sample import sample
from test_tiers import request_for

STRATEGY = MemoryStrategy(offload="block_swap", blocks_to_swap=1)


def run(loaded):
    return sample(loaded, STRATEGY, request_for("wan2.1-t2v"), backend=CpuBackend()).latent["samples"]


def test_single_file_transformer_replaces_the_folders_and_samples_the_same(tiny_folder, tiny_loaded, tmp_path):
    reference = tiny_loaded("wan2.1-t2v")
    stored = store_tensors(reference.pipe.transformer, "fp32")
    checkpoint = write_transformer(stored, tmp_path / "wan2.1_t2v_tiny.safetensors", KeyLayout.ORIGINAL)
    loaded = load_pipeline(tiny_folder("wan2.1-t2v"), "fp32", checkpoint)
    ours, theirs = loaded.pipe.transformer.state_dict(), reference.pipe.transformer.state_dict()
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert loaded.source.endswith("+ wan2.1_t2v_tiny.safetensors") and loaded.storage["transformer"] == "fp32"
    assert torch.allclose(run(loaded), run(reference), atol=1e-5)  # same weights; storage alignment may move the last bits


def test_fp8_scaled_transformer_file_is_dequantized_not_misread(tiny_folder, tmp_path):
    """diffusers' from_single_file ignores scale_weight (FACTS); vidmem multiplies it in, per layer."""
    folder = load_pipeline(tiny_folder("wan2.1-t2v"), "fp32")
    stored = store_tensors(folder.pipe.transformer, "fp8_scaled")
    checkpoint = write_transformer(stored, tmp_path / "wan_fp8_scaled.safetensors", KeyLayout.PREFIXED)
    loaded = load_pipeline(tiny_folder("wan2.1-t2v"), "fp32", checkpoint)
    assert loaded.storage["transformer"] == "fp8_scaled" and "fp8_scaled" in loaded.describe()
    twin = load_pipeline(tiny_folder("wan2.1-t2v"), "fp32")
    twin.pipe.transformer.load_state_dict(dequantized(stored))
    assert torch.equal(run(loaded), run(twin))


class _Marker:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):  # unpickling this would create the file: proof that nothing unpickled it
        return (open, (str(self.path), "w"))


def test_single_file_is_refused_where_it_cannot_apply(tiny_folder, tmp_path):
    pickled = tmp_path / "model.safetensors"
    pickled.write_bytes(pickle.dumps(_Marker(tmp_path / "unpickled")))
    with pytest.raises(ModelError, match="pickle"):
        load_pipeline(tiny_folder("wan2.1-t2v"), "fp32", pickled)
    assert not (tmp_path / "unpickled").exists()
    with pytest.raises(ModelError, match="not supported for cogvideox"):
        load_pipeline(tiny_folder("cogvideox-t2v"), "fp32", tmp_path / "x.safetensors")
    with pytest.raises(ModelError, match="two experts"):
        load_pipeline(tiny_folder("wan2.2-a14b"), "fp32", tmp_path / "x.safetensors")
