"""Comfy-Org's fp8 layouts fold into StoredTensors; the formats of the newer quantization layout
that vidmem does not read are refused by name, never loaded as something else."""

from __future__ import annotations

import json

import pytest
import torch

from vidmem.memory.storage import StorageError, StoredTensor, fold_scaled_fp8, quantize


def config(fmt: str) -> torch.Tensor:
    return torch.tensor(list(json.dumps({"format": fmt}).encode()), dtype=torch.uint8)


def test_the_newer_layout_with_float8_layers_folds_like_scaled_fp8():
    stored = quantize(torch.randn(4, 8), "fp8_scaled")
    folded = fold_scaled_fp8({"l.weight": stored.data, "l.weight_scale": stored.scale, "l.input_scale": torch.ones(()),
                              "l.comfy_quant": config("float8_e4m3fn"), "l.bias": torch.ones(4)})
    assert set(folded) == {"l.weight", "l.bias"}
    assert isinstance(folded["l.weight"], StoredTensor) and folded["l.weight"].format.name == "fp8_scaled"
    assert torch.equal(folded["l.weight"].dequantize(torch.float32), stored.dequantize(torch.float32))


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"l.comfy_quant": config("int8_blockwise")}, "quantized as 'int8_blockwise'"),
        ({"l.weight_scale_2": torch.ones(())}, "NVFP4"),
        ({"l.pre_quant_scale": torch.ones(8)}, "AWQ"),
        ({"l.comfy_quant": torch.tensor([1, 2, 3], dtype=torch.uint8)}, "JSON quantization config"),
    ],
)
def test_formats_vidmem_cannot_read_are_refused_by_name(extra, message):
    with pytest.raises(StorageError, match=message):
        fold_scaled_fp8({"l.weight": torch.zeros(4, 8, dtype=torch.float8_e4m3fn), **extra})


def test_an_integer_weight_with_block_scales_is_refused():
    with pytest.raises(StorageError, match="'l.weight' is torch.int8 with a scale of shape \\[1, 1\\]"):
        fold_scaled_fp8({"l.weight": torch.zeros(128, 128, dtype=torch.int8), "l.weight_scale": torch.ones(1, 1)})


def test_a_scale_on_a_wide_weight_is_applied_once():
    folded = fold_scaled_fp8({"l.weight": torch.full((2, 2), 2.0, dtype=torch.bfloat16), "l.scale_weight": torch.tensor(0.5)})
    assert torch.equal(folded["l.weight"], torch.ones(2, 2, dtype=torch.bfloat16))
