"""Real-size random-weight model files in ComfyUI's layouts, written tensor by tensor.

For benches that need files larger than RAM (a bf16 Wan 14B transformer is 28 GB): the
component is built without weights from its config, the safetensors header is computed from
the shapes and the storage format alone, and each tensor is generated and written in row
chunks, so memory stays at one chunk whatever the file size. Values: matrices and tables
~ N(0, std), 1-D norm weights 1, other 1-D tensors 0 (so activations neither vanish nor blow
up); fp8 scaled uses a fixed per-tensor scale (4 std maps to fp8's largest value). Normal
values are drawn once into a pool per stored dtype and each chunk is a slice of it at a random
offset: drawing 14 billion values would take far longer than writing them, and a bench only
needs weights that are random-looking, not independent.

    write_random_file(entry.components["transformer"], "wan2.1_t2v_14B_fp8_scaled.safetensors", "fp8_scaled")
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch

from ...memory.storage import storage_format
from ...memory.storage.files import SAFETENSORS_DTYPES
from ..configs.meta import ComponentConfig
from .build import build_empty
from . import hy15, ltx2
from .files import TOKENIZER_KEY
from .keys import COMFY_PREFIX, KeyLayout, original_transformer_names, vae_original_names
from .write import SCALED_FP8_MARKER

_HY15 = "HunyuanVideo15Transformer3DModel"
_LTX2_PARTS = {"LTX2VideoTransformer3DModel": "transformer", "AutoencoderKLLTX2Video": "vae"}
CHUNK_ELEMENTS = 1 << 24  # 16 M values per generated chunk (64 MB in fp32)
_SAFETENSORS_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


def write_random_file(component: ComponentConfig, path: str | Path, storage: str = "bf16",
                      layout: KeyLayout = KeyLayout.ORIGINAL, seed: int = 0, std: float = 0.02,
                      spiece_model: bytes | None = None, holes: bool = False) -> Path:
    """Write `component` (transformer / vae / text encoder / CLIP vision) with random weights.

    Transformers and text encoders store their Linear weights in `storage` (fp8, fp8_scaled or a
    plain dtype) and everything else in bf16 (fp32 when `storage` is fp32); VAEs and encoders of
    other kinds store all in `storage` when it is plain. Wan transformers and VAEs are written in
    their original layouts (`layout` for the transformer), as Comfy-Org ships them; LTX-2's
    transformer and video VAE under the names and prefixes of Lightricks' checkpoints; HunyuanVideo
    1.5's transformer under Comfy-Org's names, q/k/v fused (one scale per fused matrix).

    `holes`: the weights are left as holes of a sparse file (zeros, no disk space; the header,
    fp8 scales and tokenizer are written): a real-size file in seconds, for what reads headers
    only (the planner, the plan on the Memory Strategy node), never for a run.
    """
    fmt = storage_format(storage)
    if fmt.gguf_type is not None:
        raise ValueError(f"write_random_file writes safetensors; storage='{storage}' is GGUF (use write.py's GGUF writer on small models).")
    with torch.device("meta"):
        module = build_empty(component)
    linear = {f"{n}.weight" for n, m in module.named_modules() if isinstance(m, torch.nn.Linear)}
    shapes = _unique_shapes(module)
    names, fill_of = _file_names(component, shapes, layout), {}
    if component.class_name == _HY15 and layout is not KeyLayout.DIFFUSERS:  # q, k, v fused: other shapes
        shapes, linear, fill_of = _hy15_shapes(shapes, linear, layout)
        names = {name: name for name in shapes}
    plain = fmt.torch_dtype if not fmt.quantized else torch.bfloat16
    plan = []  # (file name, shape, dtype, kind of values, scale)
    for name, shape in shapes.items():
        quantized = fmt.quantized and name in linear
        dtype = fmt.torch_dtype if quantized else plain
        scale = 4 * std / torch.finfo(torch.float8_e4m3fn).max if (quantized and fmt.scaled) else None
        plan.append((names[name], shape, dtype, _fill(fill_of.get(name, name), shape), scale))
        if scale is not None:
            plan.append((names[name].removesuffix("weight") + "scale_weight", (), torch.float32, "scale", scale))
    extras = {}
    if fmt.scaled:
        extras[SCALED_FP8_MARKER] = torch.empty(0, dtype=torch.float8_e4m3fn)
    if spiece_model is not None:
        extras[TOKENIZER_KEY] = torch.frombuffer(bytearray(spiece_model), dtype=torch.uint8)
    plan += [(name, tuple(t.shape), t.dtype, t, None) for name, t in extras.items()]
    return _write_streaming(Path(path), plan, torch.Generator().manual_seed(seed), std, holes)


def _unique_shapes(module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """Parameter and persistent-buffer shapes, each tied tensor once (as safetensors saves)."""
    seen, shapes = set(), {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            shapes[name] = tuple(tensor.shape)
    return shapes


def _file_names(component: ComponentConfig, shapes: dict, layout: KeyLayout) -> dict[str, str]:
    if component.class_name in _LTX2_PARTS:  # Lightricks' checkpoint layout, whatever `layout` says
        return ltx2.original_names(_LTX2_PARTS[component.class_name], shapes)
    if component.class_name == "WanTransformer3DModel" and layout is not KeyLayout.DIFFUSERS:
        return original_transformer_names(shapes, COMFY_PREFIX if layout is KeyLayout.PREFIXED else "")
    if component.class_name == "AutoencoderKLWan":
        return vae_original_names(shapes)
    return {name: name for name in shapes}


def _hy15_shapes(shapes: dict, linear: set, layout: KeyLayout) -> tuple[dict, set, dict]:
    """A HunyuanVideo 1.5 transformer's file names and shapes in Comfy-Org's or ComfyUI's layout (from its
    diffusers `shapes`, mapped on meta), the matrices among them, and for each the diffusers name
    whose kind of values it gets (a fused q/k/v: its q's)."""
    meta = {name: torch.empty(shape, device="meta") for name, shape in shapes.items()}
    original = hy15.original_tensors(meta, layout)
    prefix = hy15.SAVED_PREFIX if layout is KeyLayout.PREFIXED else ""
    fill_of = {name: hy15.diffusers_targets(name.removeprefix(prefix))[0] for name in original}
    return ({name: tuple(t.shape) for name, t in original.items()},
            {name for name, source in fill_of.items() if source in linear}, fill_of)


def _fill(name: str, shape: tuple) -> str:
    if len(shape) == 1:
        return "ones" if ("norm" in name or name.endswith("gamma")) and not name.endswith("bias") else "zeros"
    return "normal"


def _write_streaming(path: Path, plan: list, generator: torch.Generator, std: float, holes: bool = False) -> Path:
    pools: dict = {}
    header, offset = {}, 0
    for name, shape, dtype, _, _ in plan:
        nbytes = _numel(shape) * dtype.itemsize
        header[name] = {"dtype": _SAFETENSORS_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads its header to 8 bytes
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as out:
        out.write(len(raw).to_bytes(8, "little") + raw)
        for name, shape, dtype, values, scale in plan:
            if holes and isinstance(values, str) and values != "scale":
                out.seek(_numel(shape) * dtype.itemsize, 1)  # a hole: reads as zeros
                continue
            for chunk in _chunks(shape, dtype, values, scale, generator, std, pools):
                out.write(chunk.contiguous().view(torch.uint8).numpy().tobytes())
        out.truncate()  # a file ending in a hole still has its full size
    return path


def _chunks(shape, dtype, values, scale, generator, std, pools: dict) -> Iterator[torch.Tensor]:
    if isinstance(values, torch.Tensor):
        yield values.reshape(-1)
        return
    if values == "scale":
        yield torch.tensor([scale], dtype=torch.float32)
        return
    total = _numel(shape)
    for start in range(0, total, CHUNK_ELEMENTS):
        count = min(CHUNK_ELEMENTS, total - start)
        if values == "normal":
            pool = pools.get((dtype, scale))
            if pool is None:
                pool = pools[(dtype, scale)] = _normal_pool(dtype, scale, generator, std)
            begin = int(torch.randint(0, CHUNK_ELEMENTS, (), generator=generator))
            yield pool[begin:begin + count]
        else:
            yield (torch.ones(count) if values == "ones" else torch.zeros(count)).to(dtype)


def _normal_pool(dtype: torch.dtype, scale: float | None, generator: torch.Generator, std: float) -> torch.Tensor:
    values = torch.randn(2 * CHUNK_ELEMENTS, generator=generator) * std
    if scale is not None:
        limit = torch.finfo(torch.float8_e4m3fn).max
        values = (values / scale).clamp(-limit, limit)
    return values.to(dtype)


def _numel(shape) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count
