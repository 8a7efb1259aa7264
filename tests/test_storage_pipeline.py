"""A tiny Wan pipeline whose transformer and UMT5 text encoder come from fp8 / scaled fp8 / GGUF
files samples exactly the latents of the same pipeline holding the dequantized weights, through
vidmem's sampler under every tier (the session pipeline is only read: its VAE, tokenizer and
scheduler are shared, its transformer and encoder are rebuilt)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from accelerate import init_empty_weights
from diffusers import ModelMixin
from safetensors.torch import save_file

from backends import StrictBackend
from test_storage_files import write_gguf
from test_tiers import request_for, strategies
from vidmem.memory.device import CpuBackend
from vidmem.memory.hostpool import HostPool
from vidmem.memory.storage import FORMATS, StoredEmbedding, StoredLinear, StoredTensor, assign_weights, fold_scaled_fp8, open_weights, quantize
from vidmem.pipelines.sample import sample

VARIANT = "wan2.1-t2v"


def write_stored(path, module: torch.nn.Module, name: str) -> None:
    """The module's weights as a file of format `name`: 2-D weights with whole blocks stored low."""
    fmt = FORMATS[name]
    state = {k: v.detach() for k, v in module.state_dict().items()}
    if fmt.gguf_type is not None:
        import gguf

        qtype = gguf.GGMLQuantizationType[fmt.gguf_type]
        write_gguf(path, {k: (quantize(v, fmt).data.numpy(), qtype) if _low(k, v, fmt) else v.numpy() for k, v in state.items()})
        return
    out = {}
    for key, tensor in state.items():
        if _low(key, tensor, fmt):
            stored = quantize(tensor, fmt)
            out[key] = stored.data
            if stored.scale is not None:
                out[key.removesuffix("weight") + "scale_weight"] = stored.scale
        else:
            out[key] = tensor
    save_file(out, path)


def _low(key: str, tensor: torch.Tensor, fmt) -> bool:
    return key.endswith("weight") and tensor.ndim == 2 and tensor.shape[-1] % fmt.block_size == 0


def rebuilt(module: torch.nn.Module, path, dequantize_first: bool) -> torch.nn.Module:
    tensors = fold_scaled_fp8(open_weights(path).tensors)
    if dequantize_first:
        tensors = {k: v.dequantize(torch.float32) if isinstance(v, StoredTensor) else v for k, v in tensors.items()}
    with init_empty_weights():  # parameters on meta, computed buffers real
        empty = type(module).from_config(module.config) if isinstance(module, ModelMixin) else type(module)(module.config)
    assign_weights(empty, tensors, torch.float32, keep_fp32=getattr(module, "_keep_in_fp32_modules", None) or (), source=str(path))
    return empty.eval()


def pipeline_with(loaded, tmp_path, name: str, dequantize_first: bool):
    pipe = loaded.pipe
    parts = {}
    for component in ("transformer", "text_encoder"):
        path = tmp_path / f"{component}.{name}"
        if not path.exists():
            write_stored(path, getattr(pipe, component), name)
        parts[component] = rebuilt(getattr(pipe, component), path, dequantize_first)
    new = type(pipe)(**{**pipe.components, **parts})
    new.set_progress_bar_config(disable=True)
    return dataclasses.replace(loaded, pipe=new, host_pool=HostPool(1 << 20))


@pytest.mark.parametrize("name", ["fp8_e4m3fn", "fp8_scaled", "gguf_q8_0"])
def test_stored_pipeline_samples_like_its_dequantized_twin_under_every_tier(tiny_loaded, tmp_path, name):
    loaded = tiny_loaded(VARIANT)
    stored = pipeline_with(loaded, tmp_path, name, dequantize_first=False)
    twin = pipeline_with(loaded, tmp_path, name, dequantize_first=True)
    if name.startswith("fp8"):  # the tied UMT5 table is one stored embedding, shared by both names
        encoder = stored.pipe.text_encoder
        assert isinstance(encoder.shared, StoredEmbedding)
        assert encoder.shared.weight_stored is encoder.encoder.embed_tokens.weight_stored
    for component in ("transformer", "text_encoder"):
        assert any(isinstance(m, StoredLinear) for m in getattr(stored.pipe, component).modules()), component
    expected = sample(twin, strategies(twin)["none"], request_for(VARIANT), backend=CpuBackend()).latent["samples"]
    original = sample(loaded, strategies(loaded)["none"], request_for(VARIANT), backend=CpuBackend()).latent["samples"]
    assert torch.isfinite(expected).all() and not torch.equal(expected, original)  # storage changed the weights
    for label, strategy in strategies(stored).items():
        for backend in (CpuBackend(), StrictBackend(pinning=True)):
            got = sample(stored, strategy, request_for(VARIANT), backend=backend).latent["samples"]
            assert torch.equal(got, expected), f"{name} {label} {type(backend).__name__}"
