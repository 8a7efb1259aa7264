"""A file's request for full-precision matmul (ComfyUI's `full_precision_matrix_mult`) is kept per layer, and fp8
matmul leaves those layers upcast, under 'auto' and 'on' alike, with the reason in its receipt.

ComfyUI (comfy/utils.py `convert_old_quants`, comfy/ops.py `MixedPrecisionOps`) reads it from a `scaled_fp8`
marker of two elements (every scaled layer under the marker's prefix), from a `<layer>.comfy_quant` record, or
from the header's `_quantization_metadata` records (which then replace the marker's rule), and always upcasts
those layers. Tested on the CPU: which layers would take torch._scaled_mm, not the kernel."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import safetensors.torch
import torch
from accelerate import init_empty_weights
from torch import nn

from vidmem.memory.storage import StorageError, StoredLinear, assign_weights, fold_scaled_fp8, quantize
from vidmem.memory.storage.fp8_matmul import Fp8MatmulError, fp8_matmul_for_call
from vidmem.memory.storage.modules import FULL_PRECISION_REASON
from vidmem.pipelines.comfy_files import LoadOptions, load_model_files, read_weight_file
from vidmem.pipelines.tiny_files import save_tiny_comfy_files, tiny_catalogue

FULL = {"format": "float8_e4m3fn", "full_precision_matrix_mult": True}
PLAIN = {"format": "float8_e4m3fn"}


def record(config: dict) -> torch.Tensor:
    return torch.tensor(list(json.dumps(config).encode()), dtype=torch.uint8)


def scaled_layers(*names: str, key: str = "scale_weight") -> dict[str, torch.Tensor]:
    """fp8-scaled `<name>.weight` + its scale, 32 x 32 (multiples of 16: the kernel could take each)."""
    tensors = {}
    for i, name in enumerate(names):
        torch.manual_seed(i)
        stored = quantize(torch.randn(32, 32), "fp8_scaled")
        tensors.update({f"{name}.weight": stored.data, f"{name}.{key}": stored.scale, f"{name}.bias": torch.zeros(32)})
    return tensors


def marked(folded: dict) -> set[str]:
    return {name for name, t in folded.items() if getattr(t, "full_precision_matmul", False)}


# --- reading the request ---------------------------------------------------------------------------

@pytest.mark.parametrize("elements, expected", [(0, set()), (1, set()), (2, {"a.weight", "b.weight"})])
def test_a_scaled_fp8_marker_of_two_elements_marks_every_scaled_layer(elements, expected):
    tensors = {**scaled_layers("a", "b"), "scaled_fp8": torch.zeros(elements, dtype=torch.float8_e4m3fn)}
    folded = fold_scaled_fp8(tensors)
    assert "scaled_fp8" not in folded and marked(folded) == expected


def test_a_prefixed_marker_marks_the_layers_under_its_prefix_only():
    tensors = {**scaled_layers("te.a", "model.b"), "te.scaled_fp8": torch.zeros(2, dtype=torch.float8_e4m3fn)}
    folded = fold_scaled_fp8(tensors)
    assert "te.scaled_fp8" not in folded and marked(folded) == {"te.a.weight"}


def test_a_comfy_quant_record_marks_its_own_layer():
    tensors = {**scaled_layers("a", "b", key="weight_scale"), "a.comfy_quant": record(FULL), "b.comfy_quant": record(PLAIN)}
    folded = fold_scaled_fp8(tensors)
    assert set(folded) == {"a.weight", "a.bias", "b.weight", "b.bias"} and marked(folded) == {"a.weight"}


def test_the_headers_records_mark_layers_and_replace_the_markers_rule():
    """As ComfyUI: with `_quantization_metadata` in the header, the marker is not read."""
    tensors = {**scaled_layers("a", "b"), "scaled_fp8": torch.zeros(2, dtype=torch.float8_e4m3fn)}
    header = {"_quantization_metadata": json.dumps({"layers": {"b": FULL, "a": "float8_e4m3fn"}})}
    assert marked(fold_scaled_fp8(tensors, header)) == {"b.weight"}
    with pytest.raises(StorageError, match="'_quantization_metadata' should hold JSON quantization records"):
        fold_scaled_fp8(tensors, {"_quantization_metadata": "[1, 2"})


def test_a_sharded_folders_header_records_are_read_together(tmp_path):
    """A diffusers folder's shards fold as one checkpoint (a scale may sit in another shard than its
    weight): each shard's header records count, wherever the layer's weight is."""
    from vidmem.pipelines.folder_storage import folder_tensors

    layers = scaled_layers("a", "b")
    component = tmp_path / "transformer"
    component.mkdir()
    shards = {"part-1.safetensors": ["a.weight", "a.bias", "b.scale_weight"],
              "part-2.safetensors": ["b.weight", "b.bias", "a.scale_weight"]}
    records = {"part-1.safetensors": {"b": FULL}, "part-2.safetensors": {"a": PLAIN}}
    for shard, names in shards.items():
        safetensors.torch.save_file({n: layers[n] for n in names}, str(component / shard),
                                    metadata={"_quantization_metadata": json.dumps({"layers": records[shard]})})
    weight_map = {name: shard for shard, names in shards.items() for name in names}
    (component / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert marked(folder_tensors(component, "transformer")) == {"b.weight"}


def test_row_views_keep_the_request():
    stored = fold_scaled_fp8({**scaled_layers("a"), "a.comfy_quant": record(FULL)})["a.weight"]
    assert stored.row_range(0, 16).full_precision_matmul and stored.select_rows(torch.tensor([1, 2])).full_precision_matmul


# --- which layers take fp8 matmul --------------------------------------------------------------------

class TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 32)


def loaded(tensors: dict) -> TwoLayers:
    with init_empty_weights():
        model = TwoLayers()
    assign_weights(model, fold_scaled_fp8(tensors), torch.float32)
    return model


def test_on_leaves_the_marked_layer_upcast_with_the_reason_in_the_receipt():
    model = loaded({**scaled_layers("a", "b", key="weight_scale"), "a.comfy_quant": record(FULL), "b.comfy_quant": record(PLAIN)})
    assert isinstance(model.a, StoredLinear) and model.a.fp8_matmul_problem() == FULL_PRECISION_REASON
    x = torch.randn(4, 32)
    upcast = model.a(x)
    with fp8_matmul_for_call({"model": model}, "on", "cpu") as report:
        assert torch.equal(model.a(x), upcast)  # the marked layer multiplies exactly as without fp8 matmul
        model.b(x)
    receipt = report.as_dict()
    assert set(report.tallies) == {"model.b"} and report.refused == {"model.a": FULL_PRECISION_REASON}
    assert receipt["fp8_layers"] == 1 and receipt["fallback_layers"] == {FULL_PRECISION_REASON: 1}
    assert receipt["fallback_examples"] == {FULL_PRECISION_REASON: "model.a"}


def test_auto_and_on_alike_never_multiply_a_marked_model_in_fp8():
    model = loaded({**scaled_layers("a", "b"), "scaled_fp8": torch.zeros(2, dtype=torch.float8_e4m3fn)})
    with fp8_matmul_for_call({"model": model}, "auto", "cpu") as report:
        assert not report.enabled and not report.tallies
    with pytest.raises(Fp8MatmulError, match="none of the model's 2 stored linear layers can take it .*full-precision matmul"):
        with fp8_matmul_for_call({"model": model}, "on", "cpu"):
            pass


# --- from a file, through the loader ------------------------------------------------------------------

@pytest.fixture(scope="module")
def fp8_scaled_wan(tmp_path_factory):
    return save_tiny_comfy_files("wan2.1-t2v", tmp_path_factory.mktemp("wan-fp8"), "fp8_scaled").files


def rewritten(path, target, change) -> object:
    tensors = safetensors.torch.load_file(str(path))
    change(tensors)
    safetensors.torch.save_file(tensors, str(target))
    return target


def stored_linears(loaded) -> dict[str, StoredLinear]:
    return {name: m for name, m in loaded.pipe.transformer.named_modules() if isinstance(m, StoredLinear)}


@pytest.mark.parametrize("on_disk", [True, False])
def test_a_two_element_marker_in_a_file_reaches_every_loaded_layer(fp8_scaled_wan, tmp_path, on_disk):
    """Whether the weights stay in the file's mapping or are copied into RAM (the copy kept the request)."""
    def two_elements(tensors):
        tensors["scaled_fp8"] = torch.zeros(2, dtype=torch.float8_e4m3fn)

    path = rewritten(fp8_scaled_wan.model, tmp_path / "wan_fp8_scaled_fullmm.safetensors", two_elements)
    options = LoadOptions(dtype="fp32", weights_on_disk=on_disk)
    layers = stored_linears(load_model_files(replace(fp8_scaled_wan, model=path), options, tiny_catalogue()))
    assert layers and all(layer.fp8_matmul_problem() == FULL_PRECISION_REASON for layer in layers.values())
    plain = stored_linears(load_model_files(fp8_scaled_wan, options, tiny_catalogue()))
    assert not any(layer.full_precision_matmul for layer in plain.values())  # the usual empty marker asks nothing


def test_a_comfy_quant_record_in_a_file_marks_its_layer_only(fp8_scaled_wan, tmp_path):
    layer = "blocks.0.self_attn.q"

    def newer_layout(tensors):
        del tensors["scaled_fp8"]
        for name in [n for n in tensors if n.endswith(".scale_weight")]:
            weight = name.removesuffix(".scale_weight")
            tensors[f"{weight}.weight_scale"] = tensors.pop(name)
            tensors[f"{weight}.comfy_quant"] = record(FULL if weight == layer else PLAIN)

    path = rewritten(fp8_scaled_wan.model, tmp_path / "wan_fp8mixed.safetensors", newer_layout)
    assert read_weight_file(path, "model", "transformer").tensors["blocks.0.attn1.to_q.weight"].full_precision_matmul
    layers = stored_linears(load_model_files(replace(fp8_scaled_wan, model=path), LoadOptions(dtype="fp32"), tiny_catalogue()))
    assert {name for name, m in layers.items() if m.full_precision_matmul} == {"blocks.0.attn1.to_q"}
