"""Stored weights run a real (small) Wan transformer bit for bit like the same model holding the
dequantized weights as ordinary parameters, under every offload tier, from real files.

Files are written as the field ships them: fp8 and Comfy-Org's scaled fp8 as safetensors (fp8
weight + `<layer>.scale_weight` + the `scaled_fp8` marker), GGUF through gguf.GGUFWriter with
small tensors left in F32 (as GGUF converters do).
"""

from __future__ import annotations

import gguf
import pytest
import torch
from accelerate import init_empty_weights
from diffusers import WanTransformer3DModel
from safetensors.torch import save_file

from backends import Recorder, StrictBackend
from test_storage_files import write_gguf
from vidmem.memory import MemoryStrategy, StageComponents, apply_strategy
from vidmem.memory.device import CpuBackend
from vidmem.memory.hostpool import HostPool
from vidmem.memory.storage import (
    FORMATS,
    StoredLinear,
    StoredTensor,
    assign_weights,
    fold_scaled_fp8,
    open_weights,
    quantize,
)

# Wide enough that every linear layer's rows hold whole GGUF blocks (256 weights for k-quants).
WAN = dict(
    patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=128, in_channels=16, out_channels=16,
    text_dim=256, freq_dim=256, ffn_dim=512, num_layers=3, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
)
FP8 = ["fp8_e4m3fn", "fp8_e5m2", "fp8_scaled"]
GGUF = ["gguf_q8_0", "gguf_q6_k", "gguf_q5_k", "gguf_q5_1", "gguf_q5_0", "gguf_q4_k", "gguf_q4_1", "gguf_q4_0"]
ALL_FORMATS = FP8 + GGUF


def wan_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {k: v.detach().clone() for k, v in WanTransformer3DModel(**WAN).state_dict().items()}


def quantizable(name: str, tensor: torch.Tensor, fmt) -> bool:
    """A linear layer's weight whose rows hold whole blocks (what fp8 files and GGUF converters store low)."""
    return name.endswith(".weight") and tensor.ndim == 2 and tensor.shape[-1] % fmt.block_size == 0 and tensor.shape[0] > 16


def write_model_file(path, state: dict[str, torch.Tensor], name: str) -> None:
    fmt = FORMATS[name]
    if fmt.gguf_type is None:
        out = {}
        for key, tensor in state.items():
            if not quantizable(key, tensor, fmt):
                out[key] = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
                continue
            stored = quantize(tensor, fmt)
            out[key] = stored.data
            if stored.scale is not None:
                out[key.removesuffix("weight") + "scale_weight"] = stored.scale
        if fmt.scaled:
            out["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
        save_file(out, path)
        return
    qtype = gguf.GGMLQuantizationType[fmt.gguf_type]
    tensors = {}
    for key, tensor in state.items():
        if not quantizable(key, tensor, fmt):
            tensors[key] = tensor.numpy()
        else:
            tensors[key] = (quantize(tensor, fmt).data.numpy(), qtype)
    write_gguf(path, tensors)


def load(path, compute_dtype: torch.dtype, dequantize_first: bool = False):
    """A meta-built Wan transformer given the file's weights (stored, or dequantized as plain parameters)."""
    tensors = fold_scaled_fp8(open_weights(path).tensors)
    if dequantize_first:  # in float32; assign_weights rounds each to its own target dtype once
        tensors = {k: v.dequantize(torch.float32) if isinstance(v, StoredTensor) else v for k, v in tensors.items()}
    with init_empty_weights():
        model = WanTransformer3DModel(**WAN)
    report = assign_weights(model, tensors, compute_dtype, keep_fp32=model._keep_in_fp32_modules, source=str(path))
    return model.eval(), report


def inputs(dtype: torch.dtype) -> dict:
    generator = torch.Generator().manual_seed(1)
    return dict(
        hidden_states=torch.randn(1, 16, 2, 8, 8, generator=generator).to(dtype),
        timestep=torch.tensor([500]),
        encoder_hidden_states=torch.randn(1, 8, 256, generator=generator).to(dtype),
        return_dict=False,
    )


def tiers(blocks: int) -> dict[str, MemoryStrategy]:
    found = {"none": MemoryStrategy(offload="none"), "model": MemoryStrategy(offload="model"),
             "sequential": MemoryStrategy(offload="sequential"),
             "sequential/p0": MemoryStrategy(offload="sequential", prefetch_blocks=0)}
    for swap in (1, blocks):
        for prefetch in (0, 1, 2):
            found[f"block_swap:{swap}:{prefetch}"] = MemoryStrategy(offload="block_swap", blocks_to_swap=swap, prefetch_blocks=prefetch)
    return found


@pytest.fixture(scope="module")
def state():
    return wan_state()


@pytest.mark.parametrize("name", ALL_FORMATS)
def test_stored_model_equals_its_dequantized_twin_under_every_tier(tmp_path, state, name):
    path = tmp_path / f"wan.{name}"
    write_model_file(path, state, name)
    stored, report = load(path, torch.float32)
    reference, plain_report = load(path, torch.float32, dequantize_first=True)
    assert report.stored_layers > 0 and plain_report.stored_layers == 0
    assert any(c.format == name for c in report.formats)
    assert stored.dtype == torch.float32  # a stored weight never sets the model's dtype
    assert not any(p.dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8) for p in stored.parameters())
    with torch.no_grad():
        expected = reference(**inputs(torch.float32))[0]
        assert torch.isfinite(expected).all()
        stage = StageComponents({"transformer": stored}, {"transformer": stored.blocks})
        for label, strategy in tiers(len(stored.blocks)).items():
            for backend in (CpuBackend(), StrictBackend(), StrictBackend(pinning=True)):
                recorder = Recorder()
                with apply_strategy(stage, strategy, backend, recorder, HostPool(1 << 20)) as handle:
                    handle.activate("transformer")
                    got = stored(**inputs(torch.float32))[0]
                assert torch.equal(got, expected), f"{name} {label} {type(backend).__name__}"
                if strategy.streams_blocks:
                    assert recorder.peak_streamed <= strategy.prefetch_blocks + 1


def test_poisoned_eviction_reaches_stored_buffers(tmp_path, state):
    """StrictBackend's poison for fp8 and raw GGUF blocks really ruins an output that uses them."""
    for name in ("fp8_scaled", "gguf_q8_0"):
        path = tmp_path / f"wan.{name}"
        write_model_file(path, state, name)
        model, _ = load(path, torch.float32)
        layer = next(m for m in model.modules() if isinstance(m, StoredLinear))
        backend = StrictBackend()
        for buffer_name in ("weight_stored", "weight_scale"):
            buffer = getattr(layer, buffer_name)
            if buffer is not None:
                layer._buffers[buffer_name] = backend.evicted(buffer)
        assert torch.isnan(layer(torch.ones(1, layer.in_features))).all(), name


@pytest.mark.parametrize("name", ["fp8_scaled", "gguf_q8_0"])
def test_bf16_compute_from_stored_files(tmp_path, state, name):
    path = tmp_path / f"wan.{name}"
    write_model_file(path, state, name)
    stored, _ = load(path, torch.bfloat16)
    reference, _ = load(path, torch.bfloat16, dequantize_first=True)
    assert stored.dtype == torch.bfloat16
    assert stored.condition_embedder.time_embedder.linear_1.bias.dtype == torch.float32  # _keep_in_fp32_modules
    with torch.no_grad():
        assert torch.equal(stored(**inputs(torch.bfloat16))[0], reference(**inputs(torch.bfloat16))[0])


def test_file_weights_are_used_in_place(tmp_path, state):
    path = tmp_path / "wan.fp8_scaled"
    write_model_file(path, state, "fp8_scaled")
    stored, report = load(path, torch.bfloat16)
    file_bytes = path.stat().st_size
    assert report.copied_bytes < 0.02 * file_bytes  # only the fp32-kept tables are cast
    assert report.mapped_bytes > 0.9 * file_bytes
    keep = WanTransformer3DModel._keep_in_fp32_modules
    assert report.cast and all(set(name.split(".")) & set(keep) for name in report.cast)  # only the fp32-kept ones
    assert report.kept_computed == ("rope.freqs_cos", "rope.freqs_sin")  # not in files: computed at build


def test_twenty_runs_of_a_stored_model_do_not_grow_anonymous_memory(tmp_path, state):
    from test_storage_apply import rss_anon_bytes

    path = tmp_path / "wan.gguf_q4_k"
    write_model_file(path, state, "gguf_q4_k")
    model, _ = load(path, torch.float32)
    stage = StageComponents({"transformer": model}, {"transformer": model.blocks})
    strategy = MemoryStrategy(offload="block_swap", blocks_to_swap=len(model.blocks), prefetch_blocks=1)
    measured = []
    for _ in range(20):
        with torch.no_grad(), apply_strategy(stage, strategy, CpuBackend()) as handle:
            handle.activate("transformer")
            model(**inputs(torch.float32))
        measured.append(rss_anon_bytes())
    assert measured[-1] - measured[2] < 0.01 * measured[2], [m >> 20 for m in measured]
