"""Wan's single-file transformer (original checkpoint layout) loads offline into the pipeline."""

from __future__ import annotations

import pytest
import safetensors.torch
import torch

from vidmem.memory import MemoryStrategy
from vidmem.memory.device import CpuBackend
from vidmem.pipelines.family import ModelError
from vidmem.pipelines.loader import load_pipeline
from vidmem.pipelines.sample import sample
from test_tiers import request_for

# diffusers key -> original Wan key, the inverse of diffusers' convert_wan_transformer_to_diffusers
# for a text-to-video model. Applied in order; norm2/norm3 swap through a placeholder.
TO_ORIGINAL = [
    ("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
    ("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
    ("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
    ("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
    ("condition_embedder.time_proj", "time_projection.1"),
    ("attn2", "cross_attn"), ("attn1", "self_attn"),
    (".to_out.0.", ".o."), (".to_q.", ".q."), (".to_k.", ".k."), (".to_v.", ".v."),
    ("ffn.net.0.proj", "ffn.0"), ("ffn.net.2", "ffn.2"),
    ("norm2", "norm__swap"), ("norm3", "norm2"), ("norm__swap", "norm3"),
    ("proj_out", "head.head"), (".scale_shift_table", ".modulation"),
]


def original_wan_checkpoint(transformer, path):
    renamed = {}
    for key, tensor in transformer.state_dict().items():
        for old, new in TO_ORIGINAL:
            key = key.replace(old, new)
        renamed["head.modulation" if key == "scale_shift_table" else key] = tensor.contiguous()
    safetensors.torch.save_file(renamed, str(path))
    return path


def test_single_file_transformer_replaces_the_folders_and_samples_the_same(tiny_folder, tiny_loaded, tmp_path):
    reference = tiny_loaded("wan2.1-t2v")
    checkpoint = original_wan_checkpoint(reference.pipe.transformer, tmp_path / "wan2.1_t2v_tiny.safetensors")
    loaded = load_pipeline(tiny_folder("wan2.1-t2v"), "fp32", checkpoint)
    ours, theirs = loaded.pipe.transformer.state_dict(), reference.pipe.transformer.state_dict()
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert loaded.source.endswith("+ wan2.1_t2v_tiny.safetensors")
    strategy = MemoryStrategy(offload="block_swap", blocks_to_swap=1)
    a = sample(loaded, strategy, request_for("wan2.1-t2v"), backend=CpuBackend()).latent["samples"]
    b = sample(reference, strategy, request_for("wan2.1-t2v"), backend=CpuBackend()).latent["samples"]
    assert torch.allclose(a, b, atol=1e-5)  # same weights; storage alignment may move the last bits


def test_single_file_is_refused_where_it_cannot_apply(tiny_folder, tmp_path):
    pickled = tmp_path / "model.ckpt"
    pickled.write_bytes(b"")
    with pytest.raises(ModelError, match="must be an existing .safetensors file"):
        load_pipeline(tiny_folder("wan2.1-t2v"), "fp32", pickled)
    with pytest.raises(ModelError, match="not supported for cogvideox"):
        load_pipeline(tiny_folder("cogvideox-t2v"), "fp32", tmp_path / "x.safetensors")
    with pytest.raises(ModelError, match="two experts"):
        load_pipeline(tiny_folder("wan2.2-a14b"), "fp32", tmp_path / "x.safetensors")
