"""dequantize_into: a stored table dequantized at load in row chunks straight into a preallocated tensor of
the compute dtype (no whole-table float32 temporary), bit for bit as the one-pass StoredTensor.dequantize."""

from __future__ import annotations

import pytest
import torch

from vidmem.memory.storage import StorageError, dequantize_into, quantize
from vidmem.memory.storage import stored as stored_module

ROWS, COLUMNS = 37, 512  # an odd row count: the last chunk is short
CHUNK_ROWS = 4


def spy_upcasts(monkeypatch) -> list[int]:
    """The rows of each float32 pass (`_upcast`) from now on, with DEQUANT_CHUNK made CHUNK_ROWS rows."""
    seen, upcast = [], stored_module._upcast
    monkeypatch.setattr(stored_module, "DEQUANT_CHUNK", CHUNK_ROWS * COLUMNS)
    monkeypatch.setattr(stored_module, "_upcast", lambda data, *args: seen.append(data.shape[0]) or upcast(data, *args))
    return seen


@pytest.fixture
def upcasts(monkeypatch):
    return spy_upcasts(monkeypatch)


@pytest.mark.parametrize("fmt", ["gguf_q8_0", "gguf_q4_k", "fp8_scaled"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_chunks_give_the_one_pass_bits(fmt, dtype, monkeypatch):
    table = quantize(torch.randn(ROWS, COLUMNS, generator=torch.Generator().manual_seed(0)), fmt)
    one_pass = table.dequantize(dtype)  # small: a single float32 pass
    seen = spy_upcasts(monkeypatch)
    out = torch.full((ROWS + 3, COLUMNS), 7.0, dtype=dtype)  # a padded table: only its leading rows are written
    assert dequantize_into(table, out[:ROWS]).data_ptr() == out.data_ptr()
    assert torch.equal(out[:ROWS], one_pass)
    assert torch.all(out[ROWS:] == 7)
    assert seen == [CHUNK_ROWS] * (ROWS // CHUNK_ROWS) + [ROWS % CHUNK_ROWS]  # the chunked path, a chunk at a time


def test_a_per_row_scale_goes_with_its_rows(upcasts):
    data = torch.randn(ROWS, COLUMNS, generator=torch.Generator().manual_seed(1)).to(torch.float8_e4m3fn)
    scale = torch.rand(ROWS, 1, generator=torch.Generator().manual_seed(2)) + 0.5
    table = stored_module.StoredTensor(data, quantize(torch.ones(1, 1), "fp8_scaled").format, data.shape, scale)
    expected = (data.to(torch.float32) * scale).to(torch.bfloat16)
    assert torch.equal(dequantize_into(table, torch.empty(ROWS, COLUMNS, dtype=torch.bfloat16)), expected)
    assert len(upcasts) > 1


def test_a_plain_table_is_copied_without_a_float32_pass(upcasts):
    table = quantize(torch.randn(ROWS, COLUMNS), "bf16")
    out = dequantize_into(table, torch.empty(ROWS, COLUMNS, dtype=torch.float32))
    assert torch.equal(out, table.data.to(torch.float32)) and upcasts == []


def test_a_tensor_of_another_shape_is_refused_naming_both():
    table = quantize(torch.randn(ROWS, COLUMNS), "gguf_q8_0")
    wanted = rf"shape \[{ROWS + 1}, {COLUMNS}\].*pass one of its shape \[{ROWS}, {COLUMNS}\]"
    with pytest.raises(StorageError, match=wanted):
        dequantize_into(table, torch.empty(ROWS + 1, COLUMNS))
