"""Weight files by content: safetensors and GGUF are mapped in place; pickles and damaged files
are refused, with messages that name the file and the fix, before anything is unpickled."""

from __future__ import annotations

import json
import pickle
import struct

import gguf
import numpy as np
import psutil
import pytest
import torch
from safetensors.torch import save_file

from vidmem.memory.storage import (
    FORMATS,
    StorageError,
    StoredTensor,
    is_file_backed,
    open_gguf,
    open_safetensors,
    open_weights,
    quantize,
    sniff,
)

ALL_SAFETENSORS_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                          torch.int16, torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.fixture
def no_unpickling(monkeypatch):
    """Any attempt to unpickle fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("something tried to unpickle a file")

    class Refusing(pickle.Unpickler):
        def __init__(self, *args, **kwargs):
            refuse()

    monkeypatch.setattr(pickle, "Unpickler", Refusing)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(torch, "load", refuse)


def write_gguf(path, tensors: dict, metadata: dict | None = None) -> None:
    """tensors: name -> numpy float array, or (raw uint8 blocks, GGMLQuantizationType)."""
    writer = gguf.GGUFWriter(path, "wan")
    for key, value in (metadata or {}).items():
        writer.add_array(key, value) if isinstance(value, list) else writer.add_string(key, value)
    for name, value in tensors.items():
        if isinstance(value, tuple):
            writer.add_tensor(name, value[0], raw_dtype=value[1])
        else:
            writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("suffix", [".pt", ".safetensors", ".sft", ".gguf", ".ckpt"])
@pytest.mark.parametrize("legacy", [False, True])
def test_pickles_are_refused_before_any_unpickling(tmp_path, suffix, legacy, no_unpickling):
    path = tmp_path / f"model{suffix}"
    torch.save({"w": torch.ones(2)}, path, _use_new_zipfile_serialization=not legacy)
    for opener in (sniff, open_safetensors, open_gguf, open_weights):
        with pytest.raises(StorageError, match="pickle.*never unpickles.*safetensors") as caught:
            opener(path)
        assert str(path) in str(caught.value)


def test_every_safetensors_dtype_is_a_zero_copy_view_of_the_mapping(tmp_path):
    tensors = {f"t{i}": (torch.rand(3, 5) * 100).to(dtype) for i, dtype in enumerate(ALL_SAFETENSORS_DTYPES)}
    tensors["empty"] = torch.zeros(0, 4)
    path = tmp_path / "all.weights"  # no extension to go by
    save_file(tensors, path, metadata={"format": "pt"})
    assert sniff(path) == "safetensors"
    opened = open_safetensors(path)
    assert dict(opened.metadata) == {"format": "pt"}
    whole = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)
    for name, tensor in tensors.items():
        got = opened.tensors[name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape
        assert torch.equal(got.view(torch.uint8), tensor.view(torch.uint8)) if got.numel() else True
        if got.numel():
            assert is_file_backed(got), name
    assert not is_file_backed(torch.ones(10))
    assert whole.numel() == path.stat().st_size


def test_writing_a_mapped_tensor_never_reaches_the_file(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file({"w": torch.zeros(16)}, path)
    before = path.read_bytes()
    opened = open_safetensors(path)
    opened.tensors["w"].add_(1)  # copy-on-write: private pages, no crash, file unchanged
    assert path.read_bytes() == before
    assert torch.equal(open_safetensors(path).tensors["w"], torch.zeros(16))


def test_a_file_larger_than_ram_and_swap_maps(tmp_path):
    """The disk tier's reason to exist: a plain copy-on-write mapping of such a file fails (ENOMEM)."""
    numel = (psutil.virtual_memory().total + psutil.swap_memory().total) // 2 + (1 << 30)
    raw = json.dumps({"w": {"dtype": "BF16", "shape": [numel], "data_offsets": [0, 2 * numel]}}).encode()
    path = tmp_path / "huge.safetensors"
    with open(path, "wb") as handle:  # sparse: takes no disk space
        handle.write(struct.pack("<Q", len(raw)) + raw)
        handle.truncate(8 + len(raw) + 2 * numel)
    weight = open_safetensors(path).tensors["w"]
    assert weight.shape == (numel,) and is_file_backed(weight)
    assert torch.equal(weight[-3:], torch.zeros(3, dtype=torch.bfloat16))


def test_read_only_mappings_where_copy_on_write_is_unavailable(tmp_path, monkeypatch, recwarn):
    from vidmem.memory.storage import mapping

    monkeypatch.setattr(mapping, "NORESERVE", 0)  # other systems, or strict overcommit
    save_file({"w": torch.arange(6.0)}, tmp_path / "w.safetensors")
    weight = open_safetensors(tmp_path / "w.safetensors").tensors["w"]
    assert torch.equal(weight * 2, torch.arange(6.0) * 2) and is_file_backed(weight)
    assert not [w for w in recwarn if "not writable" in str(w.message)]


def header_file(tmp_path, header: dict, data: bytes) -> str:
    raw = json.dumps(header).encode()
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


@pytest.mark.parametrize(
    "header, data, message",
    [
        ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8, "truncated"),
        ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}, b"\0" * 16, "does not match its 12 data bytes"),
        ({"w": {"dtype": "Q9", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 16, "dtype 'Q9'"),
        ({"w": {"shape": [4]}}, b"", "lacks dtype/shape/data_offsets"),
        ({"w": {"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}}, b"\0" * 16, "malformed"),
        # Two tensors over the same bytes (safetensors: "invalid offset"), a gap, trailing bytes.
        ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
          "b": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 32, "'b' starts at data byte 0 and overlaps"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
          "b": {"dtype": "F32", "shape": [2], "data_offsets": [12, 20]}}, b"\0" * 20, "'b' .* leaves data bytes 8..12 unused"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 12, "end at data byte 8 but the file holds 12"),
        # __metadata__ is an object of strings to strings.
        *[({"__metadata__": meta, "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4, "__metadata__")
          for meta in ("abc", [1, 2], 5, {"a": 1})],
    ],
)
def test_bad_safetensors_headers_name_the_file_and_the_fix(tmp_path, header, data, message):
    path = header_file(tmp_path, header, data)
    with pytest.raises(StorageError, match=message) as caught:
        open_weights(path)
    assert str(path) in str(caught.value) and ("download it again" in str(caught.value) or "Re-save" in str(caught.value))


@pytest.mark.parametrize("content", [b"", b"abc", b"\xff" * 64, struct.pack("<Q", 10**12) + b"{}", struct.pack("<Q", 2) + b"[]",
                                     b"GGUF", b"GGUF" + struct.pack("<I", 99) + b"\0" * 16])
def test_anything_else_is_refused(tmp_path, content):
    path = tmp_path / "x.safetensors"
    path.write_bytes(content)
    with pytest.raises(StorageError, match=str(path)):
        sniff(path)


def test_header_entries_in_any_order_and_empty_tensors_fill_the_data(tmp_path):
    """The layout check sorts by offset (JSON order is free) and lets empty tensors share an offset."""
    header = {"b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}, "e": {"dtype": "F32", "shape": [0], "data_offsets": [8, 8]},
              "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "__metadata__": {"format": "pt"}}
    tensors = open_weights(header_file(tmp_path, header, struct.pack("<4f", 1, 2, 3, 4))).tensors
    assert tensors["a"].tolist() == [1, 2] and tensors["b"].tolist() == [3, 4] and tensors["e"].shape == (0,)


def test_a_truncated_safetensors_file_is_refused(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file({"a": torch.ones(100), "b": torch.ones(100)}, path)
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(StorageError, match="truncated"):
        open_safetensors(path)


GGUF_TYPES = [f for f in FORMATS.values() if f.gguf_type]


def random_blocks(fmt, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Valid random blocks of any GGUF type: random bytes with sane fp16 scale fields."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * cols // fmt.block_size, fmt.block_bytes), dtype=np.uint8)
    scales = rng.uniform(0.001, 0.1, size=(blocks.shape[0], 2)).astype(np.float16).view(np.uint8)
    if fmt.gguf_type == "Q6_K":  # d is the block's last two bytes
        blocks[:, -2:] = scales[:, :2]
    else:  # d (and dmin / m) lead the block
        width = 4 if fmt.gguf_type in ("Q4_K", "Q5_K", "Q4_1", "Q5_1") else 2
        blocks[:, :width] = scales[:, :width]
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("fmt", GGUF_TYPES, ids=lambda f: f.name)
def test_gguf_tensors_dequantize_like_the_gguf_reference(tmp_path, fmt):
    qtype = gguf.GGMLQuantizationType[fmt.gguf_type]
    blocks = random_blocks(fmt, 6, 512)
    write_gguf(tmp_path / "m.gguf", {"q": (blocks, qtype), "f": np.arange(12, dtype=np.float32).reshape(3, 4)})
    opened = open_weights(tmp_path / "m.gguf")
    stored = opened.tensors["q"]
    assert isinstance(stored, StoredTensor) and stored.format is fmt and stored.shape == (6, 512)
    assert is_file_backed(stored.data)
    reference = torch.from_numpy(gguf.quants.dequantize(blocks, qtype).astype(np.float32))
    assert torch.equal(stored.dequantize(torch.float32), reference)
    assert torch.equal(stored.dequantize(torch.bfloat16), reference.to(torch.bfloat16))
    assert torch.equal(opened.tensors["f"], torch.arange(12.0).reshape(3, 4))
    rows = torch.tensor([4, 0, 4])
    assert torch.equal(stored.select_rows(rows).dequantize(torch.float32), reference[rows])


def test_gguf_shapes_and_plain_types(tmp_path):
    x = np.random.default_rng(1).standard_normal((2, 3, 64)).astype(np.float32)
    write_gguf(
        tmp_path / "m.gguf",
        {"f16": x.astype(np.float16), "bf16": (gguf.quants.quantize(x, gguf.GGMLQuantizationType.BF16), gguf.GGMLQuantizationType.BF16),
         "flat": x.reshape(6, 64)},
        {"comfy.gguf.orig_shape.flat": [2, 3, 64]},
    )
    opened = open_gguf(tmp_path / "m.gguf")
    assert opened.tensors["f16"].shape == (2, 3, 64) and opened.tensors["f16"].dtype == torch.float16
    assert opened.tensors["bf16"].dtype == torch.bfloat16
    assert torch.equal(opened.tensors["bf16"], torch.from_numpy(x).to(torch.bfloat16))
    assert opened.tensors["flat"].shape == (2, 3, 64)
    assert opened.metadata["general.architecture"] == "wan"


def test_unsupported_gguf_types_are_named_with_the_supported_ones(tmp_path):
    qtype = gguf.GGMLQuantizationType.Q2_K
    blocks = np.zeros((1, gguf.GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)
    write_gguf(tmp_path / "m.gguf", {"w": (blocks, qtype)})
    with pytest.raises(StorageError, match=r"GGUF type Q2_K.*supported: F32, F16, BF16, F64, I8, I16, I32, I64, Q8_0.*Q4_K"):
        open_gguf(tmp_path / "m.gguf")


def test_a_truncated_gguf_is_refused(tmp_path):
    write_gguf(tmp_path / "m.gguf", {"w": np.ones((64, 64), dtype=np.float32)})
    data = (tmp_path / "m.gguf").read_bytes()
    (tmp_path / "m.gguf").write_bytes(data[: len(data) // 2])
    with pytest.raises(StorageError, match="damaged or truncated GGUF.*download it again"):
        open_weights(tmp_path / "m.gguf")


@pytest.mark.parametrize("name", [f.name for f in FORMATS.values() if f.name != "fp32"])
def test_quantize_round_trips_within_the_format_error(name):
    x = torch.randn(8, 512, generator=torch.Generator().manual_seed(0)) * 3
    stored = quantize(x, name)
    assert stored.format is FORMATS[name] and stored.shape == x.shape
    error = (stored.dequantize(torch.float32) - x).pow(2).mean().sqrt() / x.pow(2).mean().sqrt()
    assert 0 < error < (0.1 if "4" in name or "e5m2" in name else 0.05)  # 3-4 bits of precision vs 5+
    assert torch.equal(stored.dequantize(torch.float32), stored.dequantize(torch.float32))


@pytest.mark.parametrize("fmt", GGUF_TYPES, ids=lambda f: f.name)
def test_quantized_blocks_read_back_with_the_gguf_reference(fmt):
    """Our blocks (k-quants: our own quantizer) mean the same values to gguf's numpy dequantizer."""
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(2))
    stored = quantize(x, fmt)
    reference = gguf.quants.dequantize(stored.data.numpy(), gguf.GGMLQuantizationType[fmt.gguf_type])
    assert torch.equal(stored.dequantize(torch.float32), torch.from_numpy(reference.astype(np.float32)))


def test_scaled_fp8_uses_the_whole_fp8_range():
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(3)) * 1e-3  # below fp8's normal range
    stored = quantize(x, "fp8_scaled")
    assert stored.scale.shape == () and stored.scale.dtype == torch.float32
    assert stored.data.to(torch.float32).abs().max() == 448
    assert (stored.dequantize(torch.float32) - x).abs().max() <= x.abs().max() / 16  # 3 mantissa bits
    plain = quantize(x, "fp8_e4m3fn")
    assert (plain.dequantize(torch.float32) - x).abs().max() > (stored.dequantize(torch.float32) - x).abs().max()


def test_gguf_quantize_needs_whole_blocks():
    with pytest.raises(StorageError, match="multiple of 256.*bf16/fp16"):
        quantize(torch.randn(2, 100), "gguf_q4_k")


@pytest.mark.parametrize("name", ["fp8_scaled", "gguf_q8_0", "gguf_q4_k", "gguf_q6_k", "gguf_q5_1"])
def test_large_layers_upcast_in_row_chunks_with_the_same_bits(monkeypatch, name):
    from vidmem.memory.storage import stored

    x = torch.randn(6, 5, 512, generator=torch.Generator().manual_seed(4))
    weight = quantize(x, name)
    whole = weight.dequantize(torch.bfloat16)
    monkeypatch.setattr(stored, "DEQUANT_CHUNK", 1500)  # three rows of 2560 weights: one row per chunk
    assert weight._rows_per_chunk() == 1
    assert torch.equal(weight.dequantize(torch.bfloat16), whole)


@pytest.mark.parametrize("fmt", GGUF_TYPES, ids=lambda f: f.name)
def test_ggml_dequantizers_equal_diffusers_and_build_no_constants_from_host_data(fmt):
    """Same bits as diffusers' port; and no torch.tensor([...]) constants (aten.lift_fresh), which
    on a GPU are synchronous host-to-device copies that stall the CPU on every layer."""
    from diffusers.quantizers.gguf.utils import dequantize_functions
    from torch.utils._python_dispatch import TorchDispatchMode

    from vidmem.memory.storage.ggml import DEQUANTIZE

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.add(str(func))
            return func(*args, **(kwargs or {}))

    blocks = torch.from_numpy(random_blocks(fmt, 4, 512, seed=7)).reshape(-1, fmt.block_bytes)
    qtype = gguf.GGMLQuantizationType[fmt.gguf_type]
    theirs = dequantize_functions[qtype](blocks, fmt.block_size, fmt.block_bytes, dtype=torch.float32)
    with Ops() as ops:
        ours = DEQUANTIZE[fmt.gguf_type](blocks)
    assert torch.equal(ours, theirs)
    assert not any("lift_fresh" in op for op in ops.seen), ops.seen


def test_a_quantized_tensor_reshaped_before_quantizing_keeps_its_original_shape(tmp_path):
    """city96's converters flatten e.g. a 5-D conv weight to rows of blocks and record the original
    shape: the blocks tile the whole tensor, not its (original) last dimension of 2."""
    qtype = gguf.GGMLQuantizationType.Q8_0
    x = np.random.default_rng(2).standard_normal((64, 16, 1, 2, 2)).astype(np.float32)
    blocks = gguf.quants.quantize(x.reshape(64, 64), qtype)
    write_gguf(tmp_path / "m.gguf", {"conv": (blocks, qtype)}, {"comfy.gguf.orig_shape.conv": [64, 16, 1, 2, 2]})
    stored = open_gguf(tmp_path / "m.gguf").tensors["conv"]
    reference = torch.from_numpy(gguf.quants.dequantize(blocks, qtype).astype(np.float32)).reshape(64, 16, 1, 2, 2)
    assert stored.shape == (64, 16, 1, 2, 2)
    assert torch.equal(stored.dequantize(torch.float32), reference)


def test_a_mapping_unmapped_while_the_registry_is_read_neither_deadlocks_nor_stays_registered():
    """The garbage collector runs a mapping's finalizer inside whatever allocation triggers it, also
    one made while this thread holds the registry's lock (is_file_backed's generator did: a test run
    hung there). The finalizer must not wait for that lock, and the range must still leave. (Should this
    fail, its daemon thread keeps holding the lock: later disk-tier tests in the process then hang.)"""
    import threading
    import weakref

    from vidmem.memory.storage import mapping

    class Owner:
        pass

    owner, before = Owner(), mapping.mapped_bytes()
    mapping.register_range(1 << 40, 4096, owner)
    assert mapping.mapped_bytes() == before + 4096
    gone = weakref.ref(owner)

    def unmap_under_the_lock():
        nonlocal owner
        with mapping._lock:
            owner = None  # the finalizer runs right here, as inside an allocation under the lock

    worker = threading.Thread(target=unmap_under_the_lock, daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive(), "the mapping's finalizer waited for the lock its own thread held"
    assert gone() is None and mapping.mapped_bytes() == before


@pytest.mark.parametrize("orig_shape", [[3, 5, 7], [64, -1, -64], ["64", "64"], [64.0, 64.0]])
@pytest.mark.parametrize("quantized", [True, False])
def test_an_original_shape_that_does_not_hold_the_tensor_is_named(tmp_path, orig_shape, quantized):
    """A `comfy.gguf.orig_shape.<name>` record that contradicts the tensor (or is not integers) is a
    StorageError naming the file and the tensor, not a raw error from reshaping."""
    x = np.random.default_rng(3).standard_normal((64, 64)).astype(np.float32)
    qtype = gguf.GGMLQuantizationType.Q8_0
    value = (gguf.quants.quantize(x, qtype), qtype) if quantized else x
    path = tmp_path / "m.gguf"
    write_gguf(path, {"w": value}, {"comfy.gguf.orig_shape.w": orig_shape})
    with pytest.raises(StorageError, match=r"m.gguf: tensor 'w' records an original shape .* does not hold its 4096 elements"):
        open_gguf(path)


def test_every_plain_gguf_type_read_is_listed_as_supported():
    from vidmem.memory.storage.gguf_files import PLAIN_TYPES, supported_gguf_types

    assert set(PLAIN_TYPES) <= set(supported_gguf_types())


def test_an_empty_gguf_tensor_is_read_empty_not_called_outside_the_file(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, {"empty": np.zeros((0, 32), np.float32), "w": np.ones((2, 32), np.float32)})
    tensors = open_gguf(path).tensors
    assert tensors["empty"].shape == (0, 32) and torch.equal(tensors["w"], torch.ones(2, 32))
