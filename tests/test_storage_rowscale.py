"""fp8 tables with one scale per row: looked up exactly (rows and their scales together), and a
table that cannot be looked up is refused when the model loads, naming the file, not at first use."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import vidmem.memory.storage.stored as stored_module
from vidmem.memory.storage import FORMATS, StorageError, StoredEmbedding, StoredTensor, assign_weights, fold_scaled_fp8, open_weights
from vidmem.pipelines.comfy_files.files import read_weight_file
from vidmem.pipelines.family import ModelError


def per_row_file(path, rows=64, width=32, scale_shape=None):
    table = torch.randn(rows, width)
    scale = table.abs().amax(dim=1, keepdim=True) / 448  # one scale per row, as row-wise fp8 converters write
    save_file({"weight": (table / scale).to(torch.float8_e4m3fn),
               "scale_weight": scale.reshape(scale_shape or scale.shape).contiguous()}, path)
    return path


def test_a_per_row_scaled_table_is_looked_up_exactly(tmp_path):
    tensors = fold_scaled_fp8(open_weights(per_row_file(tmp_path / "emb.safetensors")).tensors)
    holder = nn.Sequential(nn.Embedding(64, 32, device="meta"))
    assign_weights(holder, {"0.weight": tensors["weight"]}, torch.bfloat16, source="'emb.safetensors'")
    assert isinstance(holder[0], StoredEmbedding)
    ids = torch.tensor([[3, 0, 63, 3]])
    whole = tensors["weight"].dequantize(torch.bfloat16)
    assert torch.equal(holder(ids), whole[ids])


def test_per_row_scales_upcast_in_row_chunks_give_the_same_bits(monkeypatch):
    table = torch.randn(256, 1024)
    scale = table.abs().amax(dim=1, keepdim=True) / 448
    stored = StoredTensor((table / scale).to(torch.float8_e4m3fn), FORMATS["fp8_scaled"], table.shape, scale)
    whole = stored.dequantize(torch.bfloat16)
    monkeypatch.setattr(stored_module, "DEQUANT_CHUNK", 1 << 14)  # 16 rows at a time
    assert torch.equal(stored.dequantize(torch.bfloat16), whole)
    assert torch.equal(whole, ((table / scale).to(torch.float8_e4m3fn).float() * scale).to(torch.bfloat16))


def test_a_table_that_cannot_be_looked_up_is_refused_at_load_naming_the_file():
    flat = StoredTensor(torch.zeros(FORMATS["gguf_q8_0"].stored_bytes(64 * 32), dtype=torch.uint8), FORMATS["gguf_q8_0"], (64, 32))
    holder = nn.Sequential(nn.Embedding(64, 32, device="meta"))
    with pytest.raises(StorageError, match="'umt5.gguf': '0.weight' .* cannot look rows up"):
        assign_weights(holder, {"0.weight": flat}, torch.bfloat16, source="'umt5.gguf'")


def test_a_scale_that_fits_no_row_or_column_is_named_with_its_file(tmp_path):
    path = per_row_file(tmp_path / "umt5_rowwise.safetensors", rows=64, width=32, scale_shape=(64,))  # [rows]: ambiguous
    with pytest.raises(StorageError, match="'weight' and its scale 'scale_weight' do not fit together"):
        fold_scaled_fp8(open_weights(path).tensors)
    with pytest.raises(ModelError, match="text_encoder: 'umt5_rowwise.safetensors'"):
        read_weight_file(path, "text_encoder", "text_encoder")
