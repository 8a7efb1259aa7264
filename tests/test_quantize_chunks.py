"""quantize in row chunks: a large tensor (or a stored one lowered further) is widened to float32 and
quantized a chunk of rows at a time, straight into the preallocated result, bit for bit as the
whole-tensor pass, with a transient of one chunk whatever the tensor's size.

The chunk size is made a few rows so that many chunks and a ragged last one run. The patches pass
raising=False so that, on code without chunking, these tests fail on what they assert (the bits, the
chunks, the bytes), not on a missing attribute."""

from __future__ import annotations

import importlib

import gguf
import pytest
import torch

from test_storage_workspace import peak_allocated
from vidmem.memory.storage import FORMATS, StoredTensor, quantize
from vidmem.memory.storage.kquants import quantize_k

# The module, not the function the package exports under the same name.
quantize_module = importlib.import_module("vidmem.memory.storage.quantize")

ROWS, COLUMNS = 37, 512  # 512: a whole number of blocks for every GGUF format; 37 rows: a ragged last chunk
CHUNK_ROWS = 4
PLAIN = [name for name, fmt in FORMATS.items() if not fmt.quantized]  # fp32, bf16, fp16: a plain tensor is cast
STORED_SOURCES = ["fp8_e4m3fn", "fp8_e5m2", "fp8_scaled", "gguf_q8_0", "gguf_q4_k", "gguf_q6_k"]


def whole_pass(values: torch.Tensor, name: str) -> StoredTensor:
    """The reference: `values` stored in format `name` in one pass over the whole tensor (the maths
    quantize did before it chunked: one float32 copy, one quantizer call, one absmax)."""
    fmt = FORMATS[name]
    wide = values.to(torch.float32)
    if fmt.gguf_type in quantize_module.K_QUANTS:
        data = quantize_k(wide, fmt.gguf_type).reshape(*values.shape[:-1], -1)
    elif fmt.gguf_type is not None:
        data = torch.from_numpy(gguf.quants.quantize(wide.numpy(), gguf.GGMLQuantizationType[fmt.gguf_type]))
    elif fmt.scaled:
        amax = values.abs().amax().to(torch.float32)
        scale = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
        return StoredTensor((wide / scale).clamp(-448, 448).to(fmt.torch_dtype), fmt, values.shape, scale)
    elif fmt.quantized:
        limit = torch.finfo(fmt.torch_dtype).max
        data = wide.clamp(-limit, limit).to(fmt.torch_dtype)
    else:
        data = wide.to(fmt.torch_dtype)
    return StoredTensor(data, fmt, values.shape)


def assert_same_bits(found: StoredTensor, expected: StoredTensor) -> None:
    assert found.format == expected.format and found.shape == expected.shape
    assert found.data.dtype == expected.data.dtype and found.data.shape == expected.data.shape
    assert torch.equal(found.data.reshape(-1).view(torch.uint8), expected.data.reshape(-1).view(torch.uint8))
    assert (found.scale is None) == (expected.scale is None)
    if found.scale is not None:
        assert torch.equal(found.scale, expected.scale)


def table(rows: int = ROWS, dtype: torch.dtype = torch.bfloat16, seed: int = 0, shape=None) -> torch.Tensor:
    shape = shape if shape is not None else (rows, COLUMNS)
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)


def small_chunks(monkeypatch, rows: int = CHUNK_ROWS, width: int = COLUMNS) -> list[int]:
    """QUANTIZE_CHUNK made `rows` rows of `width`; returns the rows of each chunk quantized from now on."""
    seen, encode = [], getattr(quantize_module, "_encode", None)
    monkeypatch.setattr(quantize_module, "QUANTIZE_CHUNK", rows * width, raising=False)
    def spy(values, *args):
        seen.append(values.shape[0])
        return encode(values, *args)

    monkeypatch.setattr(quantize_module, "_encode", spy, raising=False)
    return seen


def spy_dequantize(monkeypatch) -> list[int]:
    """The leading rows of every StoredTensor dequantized from now on."""
    seen, dequantize = [], StoredTensor.dequantize
    def spy(self, *args, **kwargs):
        seen.append(self.shape[0])
        return dequantize(self, *args, **kwargs)

    monkeypatch.setattr(StoredTensor, "dequantize", spy)
    return seen


RAGGED = [CHUNK_ROWS] * (ROWS // CHUNK_ROWS) + [ROWS % CHUNK_ROWS]


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_chunks_give_the_whole_pass_bits(name, dtype, monkeypatch):
    values = table(dtype=dtype)
    chunks = small_chunks(monkeypatch)
    assert_same_bits(quantize(values, name), whole_pass(values, name))
    assert chunks == ([] if name in PLAIN else RAGGED)  # a plain format is one cast, with no float32 copy


@pytest.mark.parametrize("source", STORED_SOURCES)
@pytest.mark.parametrize("name", FORMATS)
def test_a_stored_source_is_dequantized_a_chunk_at_a_time(source, name, monkeypatch):
    """An fp8 / GGUF tensor lowered further (a Q8_0 file held as Q4_K) gives the bits of its whole
    float32 dequantization quantized whole, and is never dequantized whole."""
    stored = quantize(table(), source)
    expected = whole_pass(stored.dequantize(torch.float32), name)
    chunks, dequantized = small_chunks(monkeypatch), spy_dequantize(monkeypatch)
    assert_same_bits(quantize(stored, name), expected)
    assert chunks == RAGGED
    passes = 2 if FORMATS[name].scaled else 1  # the absmax first, then the values
    assert dequantized == RAGGED * passes


@pytest.mark.parametrize("name", ["fp8_scaled", "gguf_q4_k", "bf16"])
def test_a_per_row_scale_is_cut_with_its_rows(name, monkeypatch):
    data = table(dtype=torch.float32).to(torch.float8_e4m3fn)
    scale = torch.rand(ROWS, 1, generator=torch.Generator().manual_seed(2)) + 0.5
    stored = StoredTensor(data, FORMATS["fp8_scaled"], data.shape, scale)
    expected = whole_pass(stored.dequantize(torch.float32), name)
    chunks = small_chunks(monkeypatch)
    assert_same_bits(quantize(stored, name), expected)
    assert chunks == RAGGED


@pytest.mark.parametrize("shape", [(3, 7, COLUMNS), (1, 2 * COLUMNS), (2 * COLUMNS,), (2, 1, 3, COLUMNS)])
@pytest.mark.parametrize("name", FORMATS)
def test_other_shapes_go_by_the_rows_of_their_flattened_leading_dimensions(shape, name, monkeypatch):
    """A tensor of any rank is chunked over the rows of its leading dimensions flattened; one row
    (a 1-D tensor too) is one chunk, however long."""
    values = table(shape=shape)
    expected = whole_pass(values, name)
    chunks = small_chunks(monkeypatch)
    stored = quantize(values, name)
    assert_same_bits(stored, expected)
    rows = values.reshape(-1, shape[-1]).shape[0]
    per_chunk = max(1, CHUNK_ROWS * COLUMNS // shape[-1])
    expected_chunks = [min(per_chunk, rows - start) for start in range(0, rows, per_chunk)]
    assert chunks == ([] if name in PLAIN else expected_chunks)


@pytest.mark.parametrize("name", [name for name, fmt in FORMATS.items() if fmt.gguf_type is None])
def test_a_scalar_is_stored_as_a_whole_pass_stores_it(name, monkeypatch):
    value = torch.tensor(-3.25)
    small_chunks(monkeypatch)
    assert_same_bits(quantize(value, name), whole_pass(value, name))


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("shape", [(0, COLUMNS), (0,), (4, 0, COLUMNS)])
def test_an_empty_tensor_is_stored_empty(name, shape, monkeypatch):
    """Nothing to quantize, nothing done: fp8_scaled's scale is 1 (as for an all-zero tensor), where
    a whole-tensor absmax of no values fails."""
    if not FORMATS[name].holds(shape):
        pytest.skip(f"{name} holds no tensor of shape {shape}")
    chunks = small_chunks(monkeypatch)
    stored = quantize(torch.empty(shape, dtype=torch.bfloat16), name)
    assert stored.shape == shape and stored.data.numel() == 0 and chunks == []
    assert stored.dequantize(torch.float32).shape == shape
    if FORMATS[name].scaled:
        assert stored.scale.item() == 1


def test_a_stored_tensor_of_three_dimensions_with_one_scale_goes_by_flattened_rows(monkeypatch):
    stored = quantize(table(shape=(3, 7, COLUMNS)), "fp8_scaled")
    expected = whole_pass(stored.dequantize(torch.float32), "gguf_q4_k")
    chunks, dequantized = small_chunks(monkeypatch), spy_dequantize(monkeypatch)
    assert_same_bits(quantize(stored, "gguf_q4_k"), expected)
    assert chunks == [4, 4, 4, 4, 4, 1] and dequantized == chunks


def test_a_gguf_tensor_flattened_before_quantizing_is_read_in_one_pass(monkeypatch):
    """A GGUF tensor stored as one run of blocks (its shape only in the file's metadata) keeps no rows:
    it is dequantized whole, once, and still quantized a chunk at a time."""
    rows = quantize(table(), "gguf_q8_0")
    flat = StoredTensor(rows.data.reshape(-1), rows.format, rows.shape)
    expected = whole_pass(flat.dequantize(torch.float32), "gguf_q4_0")
    chunks, dequantized = small_chunks(monkeypatch), spy_dequantize(monkeypatch)
    assert_same_bits(quantize(flat, "gguf_q4_0"), expected)
    assert dequantized == [ROWS] and chunks == [ROWS]


# --- the transient is one chunk's -------------------------------------------------------------------

BOUNDED = [name for name in FORMATS if name not in PLAIN]


def transient_bytes(fn) -> int:
    """Peak bytes the CPU allocator holds while `fn` runs, less the result it returns (its stored data):
    the temporaries. The source exists before, so it is not counted."""
    fn()  # a first call: lazy imports and one-off allocations are not the transient
    result = []
    peak = peak_allocated(lambda: result.append(fn()))
    data = result[0].data if isinstance(result[0], StoredTensor) else result[0]
    return peak - data.untyped_storage().nbytes()


@pytest.mark.parametrize("name", BOUNDED)
@pytest.mark.parametrize("stored_source", [False, True])
def test_the_transient_does_not_grow_with_the_tensor(name, stored_source, monkeypatch):
    """Eight times the rows, the same temporaries (a chunk's), well under one float32 copy of the table."""
    small_chunks(monkeypatch, rows=8)

    def transient(rows: int) -> int:
        values = table(rows=rows)
        source = quantize(values, "gguf_q8_0") if stored_source else values
        return transient_bytes(lambda: quantize(source, name))

    small, large = transient(64), transient(512)
    assert large <= 1.25 * small, (small, large)
    assert large < 512 * COLUMNS * 4 / 4, large


NUMPY_QUANTIZED = [name for name, fmt in FORMATS.items() if fmt.gguf_type and fmt.gguf_type not in quantize_module.K_QUANTS]


@pytest.mark.parametrize("name", NUMPY_QUANTIZED)
def test_the_numpy_quantizers_see_one_chunk_at_a_time(name, monkeypatch):
    """gguf-py's quantizers (numpy: not seen by torch's allocator) make several temporaries the size of
    their input: they are given one chunk's rows, never the table."""
    seen, numpy_quantize = [], gguf.quants.quantize
    def spy(values, kind):
        seen.append(values.shape[0])
        return numpy_quantize(values, kind)

    monkeypatch.setattr(gguf.quants, "quantize", spy)
    small_chunks(monkeypatch)
    quantize(table(), name)
    assert seen == RAGGED


def test_lower_storage_never_makes_a_float32_copy_of_a_stored_table(monkeypatch):
    """Load-time lowering (weight_dtype) of a Q8_0 matrix to Q4_K: the whole-pass bits, with temporaries
    under a quarter of the table's float32 size (dequantizing it whole first costs all of it)."""
    from vidmem.pipelines.weight_storage import lower_storage

    rows = 512
    module = torch.nn.Linear(COLUMNS, rows, bias=False, device="meta")
    stored = quantize(table(rows=rows), "gguf_q8_0")
    expected = whole_pass(stored.dequantize(torch.float32), "gguf_q4_k")
    small_chunks(monkeypatch, rows=8)
    transient = transient_bytes(lambda: lower_storage(module, {"weight": stored}, "gguf_q4_k", torch.bfloat16)["weight"])
    assert transient < rows * COLUMNS * 4 / 4, transient
    assert_same_bits(lower_storage(module, {"weight": stored}, "gguf_q4_k", torch.bfloat16)["weight"], expected)
