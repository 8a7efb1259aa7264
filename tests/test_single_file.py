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
    twin.pipe.transformer.load_state_dict(dequantized(stored), assign=True)  # fresh memory, as dequantized per layer
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


@pytest.mark.reproducible_blas
def test_gguf_and_diffusers_layout_transformer_files_are_used_in_place(tiny_folder, tmp_path):
    """A city96-style GGUF file and a diffusers-named one both replace the folder's transformer;
    the GGUF weights stay quantized (widened per layer), the diffusers-named one computes the same.

    Both files' plain fp32 weights (all of the diffusers-named one, GGUF's unquantized ones) are
    used in place at the files' own offsets, the folder's at its files': in MKL's default mode the
    timestep embedding's matrix-vector products round by that alignment (docs/bit-identity.md)."""
    folder = load_pipeline(tiny_folder("wan2.1-t2v"), "fp32")
    stored = store_tensors(folder.pipe.transformer, "gguf_q8_0")
    gguf_file = write_transformer(stored, tmp_path / "wan_q8_0.gguf", KeyLayout.ORIGINAL)
    loaded = load_pipeline(tiny_folder("wan2.1-t2v"), "fp32", gguf_file)
    assert loaded.storage["transformer"] == "gguf_q8_0"
    twin = load_pipeline(tiny_folder("wan2.1-t2v"), "fp32")
    twin.pipe.transformer.load_state_dict(dequantized(stored), assign=True)  # fresh memory, as dequantized per layer
    assert torch.equal(run(loaded), run(twin))
    plain = write_transformer(store_tensors(folder.pipe.transformer, "fp32"), tmp_path / "wan.sft", KeyLayout.DIFFUSERS)
    assert torch.equal(run(load_pipeline(tiny_folder("wan2.1-t2v"), "fp32", plain)), run(folder))


def test_transformer_file_lists_gguf_and_names_its_input_when_gone(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from vidmem.nodes import host
    from vidmem.nodes.loader import VidMemLoadPipeline

    models = tmp_path / "diffusion_models"
    models.mkdir()
    for name in ("a.safetensors", "b.gguf", "c.sft", "d.ckpt"):
        (models / name).write_bytes(b"x")
    fake = SimpleNamespace(get_filename_list=lambda key: sorted(p.name for p in models.iterdir()) if key == "diffusion_models" else [],
                           get_folder_paths=lambda key: [str(models)] if key == "diffusion_models" else [])
    monkeypatch.setattr(host, "folder_paths", fake)
    monkeypatch.setenv("VIDMEM_ALLOW_ANY_PATH", "1")  # the folder is given by path, outside this fake's model folders
    assert host.single_file_transformer_names() == ["a.safetensors", "b.gguf", "c.sft"]  # never a pickle
    assert host.resolve_single_file("b.gguf") == models / "b.gguf"
    with pytest.raises(ModelError, match="transformer_file 'gone.gguf' was not found in models/diffusion_models"):
        VidMemLoadPipeline().load("ignored", "fp32", str(tmp_path), "gone.gguf")
