"""assign_weights on small modules: in-place use of mapped tensors, swaps, casts, ties, and every
error path (missing and unexpected keys, shapes, buffers nobody computed)."""

from __future__ import annotations

import gc

import pytest
import torch
from accelerate import init_empty_weights
from safetensors.torch import save_file
from torch import nn

from vidmem.memory.storage import (
    StorageError,
    StoredEmbedding,
    StoredLinear,
    assign_weights,
    fold_scaled_fp8,
    is_file_backed,
    open_safetensors,
    quantize,
)


class Tiny(nn.Module):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, width)
        self.proj = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.conv = nn.Conv1d(width, width, 1)
        self.register_buffer("table", torch.arange(4.0), persistent=False)  # computed, never in files

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.proj(self.embed(ids)))
        return self.conv(x.transpose(1, 2)).transpose(1, 2) + self.table.sum()


def empty(width: int = 64) -> Tiny:
    with init_empty_weights():
        return Tiny(width)


def weights(width: int = 64, seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {k: v.detach().clone() for k, v in Tiny(width).state_dict().items()}


def rss_anon_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def test_same_dtype_tensors_are_used_in_place_from_the_mapping(tmp_path):
    save_file(weights(), tmp_path / "w.safetensors")
    opened = open_safetensors(tmp_path / "w.safetensors")
    model = empty()
    report = assign_weights(model, opened.tensors, torch.float32)
    assert model.proj.weight.data_ptr() == opened.tensors["proj.weight"].data_ptr()  # the very same bytes
    assert all(is_file_backed(p) for p in model.parameters())
    assert report.copied_bytes == 0 and report.mapped_bytes == opened.nbytes and report.stored_layers == 0
    assert report.kept_computed == ("table",)  # not in files (non-persistent): kept as computed at build
    assert torch.equal(model.table, torch.arange(4.0))


def test_quantized_linear_and_embedding_are_swapped_other_modules_dequantized_once():
    tensors = {k: quantize(v, "fp8_scaled") if v.ndim >= 2 else v for k, v in weights().items()}
    model = empty()
    report = assign_weights(model, tensors, torch.float32)
    assert isinstance(model.proj, StoredLinear) and isinstance(model.embed, StoredEmbedding)
    assert isinstance(model.conv, nn.Conv1d) and report.dequantized == ("conv.weight",)
    assert model.proj.in_features == 64 and model.proj.out_features == 64
    assert model.proj.weight.dtype == torch.float32  # the property: dequantized on read
    assert torch.equal(model.proj.weight, tensors["proj.weight"].dequantize(torch.float32))
    with pytest.raises(AttributeError, match="cannot be assigned"):
        model.proj.weight = torch.zeros(64, 64)
    assert {c.format for c in report.formats} == {"fp8_scaled", "fp32"}
    assert report.stored_layers == 2 and "2 layers upcast per call" in report.describe()


def test_embedding_dequantizes_only_the_rows_it_looks_up(monkeypatch):
    tensors = {k: quantize(v, "gguf_q8_0") if k == "embed.weight" else v for k, v in weights().items()}
    model = empty()
    assign_weights(model, tensors, torch.float32)
    ids = torch.tensor([[3, 3, 7], [0, 9, 1]])
    expected = nn.functional.embedding(ids, tensors["embed.weight"].dequantize(torch.float32))
    seen = []
    original = type(tensors["embed.weight"]).dequantize
    monkeypatch.setattr(type(tensors["embed.weight"]), "dequantize", lambda self, *a, **k: seen.append(self.shape) or original(self, *a, **k))
    assert torch.equal(model.embed(ids), expected)
    assert seen == [torch.Size([6, 64])]  # six looked-up rows, not the table of ten


def test_plain_linear_weights_in_another_dtype_stay_stored_small_tensors_are_cast():
    tensors = {k: v.to(torch.bfloat16) for k, v in weights().items()}
    model = empty()
    report = assign_weights(model, tensors, torch.float32)
    assert isinstance(model.proj, StoredLinear) and model.proj.format.name == "bf16"
    assert set(report.cast) == {"proj.bias", "norm.weight", "norm.bias", "conv.weight", "conv.bias"}
    assert model.norm.weight.dtype == torch.float32


def test_keep_fp32_patterns_match_whole_name_components():
    tensors = {k: v.to(torch.bfloat16) for k, v in weights().items()}
    model = empty()
    assign_weights(model, tensors, torch.bfloat16, keep_fp32={"norm"})
    assert model.norm.weight.dtype == torch.float32 and model.conv.weight.dtype == torch.bfloat16
    assert model.proj.weight.dtype == torch.bfloat16


def test_missing_and_unexpected_keys_are_listed_and_nothing_changes():
    tensors = weights()
    del tensors["proj.bias"], tensors["norm.weight"]
    tensors.update({f"extra.{i}": torch.zeros(1) for i in range(12)})
    model = empty()
    with pytest.raises(StorageError) as caught:
        assign_weights(model, tensors, torch.float32, source="model.safetensors")
    message = str(caught.value)
    assert "model.safetensors" in message and "2 tensors the model needs are missing (proj.bias, norm.weight)" in message
    assert "12 tensors are not part of the model" in message and "extra.9" in message and "and 2 more" in message
    assert model.proj.weight.is_meta  # left as it was


def test_a_shape_mismatch_names_the_key_and_both_shapes():
    model = empty()
    with pytest.raises(StorageError, match=r"'proj.weight' has shape \[32, 32\] in the file but \[64, 64\]"):
        assign_weights(model, {**weights(), "proj.weight": torch.zeros(32, 32)}, torch.float32)
    assert model.proj.weight.is_meta


def test_buffers_built_on_meta_must_be_computed():
    with torch.device("meta"):
        model = Tiny()
    with pytest.raises(StorageError, match="table.*missing|init_empty_weights"):
        assign_weights(model, weights(), torch.float32)


def test_a_persistent_buffer_missing_from_the_files_is_named_not_left_at_its_built_value():
    """LTX-2's VAE keeps its latent statistics in persistent buffers the files carry; the value the model
    builds with (a std of 1.0) is a placeholder, so a file without it must be refused, not loaded silently.
    A non-persistent buffer (Wan's rotary tables, `table` here) is still kept as computed."""

    class WithStatistics(Tiny):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("latents_std", torch.ones(4))  # persistent: saved with the weights

    with init_empty_weights():
        model = WithStatistics()
    with pytest.raises(StorageError, match=r"'vae.safetensors' do not match the model: 1 tensors the model needs are "
                                           r"missing \(latents_std\)"):
        assign_weights(model, weights(), torch.float32, source="'vae.safetensors'")
    assert model.proj.weight.is_meta  # nothing assigned
    report = assign_weights(model, {**weights(), "latents_std": torch.full((4,), 3.0)}, torch.float32)
    assert torch.equal(model.latents_std, torch.full((4,), 3.0)) and report.kept_computed == ("table",)


def test_tied_weights_share_one_stored_tensor():
    class Tied(nn.Module):
        _tied_weights_keys = {"head.weight": "embed.weight"}  # transformers' declaration

        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(8, 32)
            self.head = nn.Embedding(8, 32)

    with init_empty_weights():
        model = Tied()
    table = quantize(torch.randn(8, 32), "fp8_e4m3fn")
    assign_weights(model, {"embed.weight": table}, torch.float32)  # the file holds the table once
    assert model.embed.weight_stored is model.head.weight_stored


def test_scaled_fp8_marker_and_input_scales_are_folded_away():
    stored = quantize(torch.randn(4, 8), "fp8_scaled")
    folded = fold_scaled_fp8({"l.weight": stored.data, "l.scale_weight": stored.scale, "l.scale_input": torch.ones(()),
                              "scaled_fp8": torch.empty(0, dtype=torch.float8_e4m3fn), "l.bias": torch.ones(4)})
    assert set(folded) == {"l.weight", "l.bias"} and folded["l.weight"].scale is stored.scale
    with pytest.raises(StorageError, match="scale tensors without a weight: m.scale_weight"):
        fold_scaled_fp8({"m.scale_weight": torch.ones(())})


def test_opening_and_assigning_a_large_file_copies_nothing_to_anonymous_memory(tmp_path):
    """Zero copy: 192 MiB of weights opened, assigned and run; anonymous RSS grows by ~one layer."""
    layers = 3
    path = tmp_path / "big.safetensors"
    save_file({f"{i}.weight": torch.full((8192, 4096), 0.5, dtype=torch.float16) for i in range(layers)}, path)
    gc.collect()
    size = path.stat().st_size
    before = rss_anon_bytes()
    opened = open_safetensors(path)
    with init_empty_weights():
        model = nn.Sequential(*(nn.Linear(4096, 8192, bias=False) for _ in range(layers)))
    report = assign_weights(model, opened.tensors, torch.float16)
    assert report.mapped_bytes == size - (path.stat().st_size - opened.nbytes) and report.copied_bytes == 0
    checksum = sum(float(model[i].weight.float().sum()) for i in range(layers))  # touches every page
    assert checksum == layers * 8192 * 4096 * 0.5
    grown = rss_anon_bytes() - before
    assert grown < 0.25 * size, f"anonymous memory grew by {grown >> 20} MiB for a {size >> 20} MiB file"


def test_a_model_wide_cast_changes_the_compute_dtype_never_the_storage():
    tensors = {k: quantize(v, "fp8_scaled") if v.ndim >= 2 else v for k, v in weights().items()}
    model = empty()
    assign_weights(model, tensors, torch.float32)
    ids = torch.tensor([[1, 2]])
    model.to(torch.bfloat16)
    assert model.proj.weight_stored.dtype == torch.float8_e4m3fn and model.proj.weight_scale.dtype == torch.float32
    assert model.proj.compute_dtype == torch.bfloat16 and model.proj.bias.dtype == torch.bfloat16
    fresh = empty()
    assign_weights(fresh, tensors, torch.bfloat16)
    assert torch.equal(model(ids), fresh(ids))


def test_dtype_only_reads_answer_with_an_empty_tensor_and_leave_the_forward_alone():
    """For callers that read `weight` only for its dtype (transformers' T5 feed-forward): no upcast while open,
    the class default back afterwards, also when the block raises."""
    from vidmem.memory.storage.modules import dtype_only_weight_reads

    tensors = {k: quantize(v, "fp8_scaled") if v.ndim >= 2 else v for k, v in weights().items()}
    model = empty()
    assign_weights(model, tensors, torch.float32)
    x = torch.randn(3, 64)
    expected = model.proj(x)
    with pytest.raises(RuntimeError, match="stop"):
        with dtype_only_weight_reads(model.proj):
            probe = model.proj.weight
            assert probe.dtype == torch.float32 and probe.numel() == 0 and probe.device == model.proj.weight_stored.device
            assert torch.equal(model.proj(x), expected)  # the layer's own forward reads its stored bytes
            raise RuntimeError("stop")
    assert "dtype_only_reads" not in model.proj.__dict__ and torch.equal(model.proj.weight, tensors["proj.weight"].dequantize(torch.float32))


def _stored_as(tensors: dict[str, torch.Tensor], fmt: str) -> dict:
    """Every float tensor of `tensors` in `fmt` where it can be (GGUF needs whole blocks in a row)."""
    from vidmem.memory.storage import storage_format

    target = storage_format(fmt)
    return {name: quantize(t, fmt) if t.is_floating_point() and t.dim() == 2 and target.holds(tuple(t.shape)) else t
            for name, t in tensors.items()}


@pytest.mark.parametrize("source", ["float32", "bfloat16", "float16", "fp8_e4m3fn", "fp8_scaled", "gguf_q8_0"])
@pytest.mark.parametrize("compute", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("keep", [(), ("norm",)])
def test_bytes_copied_is_what_assign_weights_copies(source, compute, keep):
    """The count a loader's RAM check makes before loading (from shapes, on a meta module) equals the
    bytes the fill then copies, for every source format, compute dtype and fp32-kept module."""
    from vidmem.memory.storage import bytes_copied

    plain = weights()
    if source in ("float32", "bfloat16", "float16"):
        tensors = {k: v.to(getattr(torch, source)) if v.is_floating_point() else v for k, v in plain.items()}
    else:
        tensors = _stored_as(plain, source)
    counted = bytes_copied(empty(), tensors, compute, keep)
    report = assign_weights(empty(), tensors, compute, keep)
    assert counted == report.copied_bytes
    if source == "float32" and compute == torch.bfloat16:
        assert counted > 0  # the case is not vacuous: norms, biases and the convolution are cast
