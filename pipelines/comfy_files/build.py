"""Build a component from its config with no weights, then give it a file's tensors in place.

Parameters are created on the meta device (`accelerate.init_empty_weights`, as diffusers' own
loader does) while buffers the files do not carry (Wan's rotary tables, CLIP's position ids) are
computed for real. `assign_weights` then points every parameter at the file's tensors: a tensor
already in its target dtype is used where it lies (the file's mapping), a quantized or narrower
Linear / Embedding weight stays stored and is upcast per call, so no whole-model copy is made.
Lowering to a narrower storage format (`weight_dtype`) is `pipelines.weight_storage`'s, shared
with the diffusers-folder loader.
The fp32 islands follow each library's `from_pretrained`: diffusers keeps `_keep_in_fp32_modules`
in float32 at every dtype, transformers only under fp16 (and `_keep_in_fp32_modules_strict`
under fp16 and bf16), so a file-loaded model holds the dtypes a folder-loaded one does.
"""

from __future__ import annotations

import functools
import importlib
import tempfile
from pathlib import Path
from typing import Any, Mapping

import torch

from ...memory.storage import StorageError, StorageReport, StoredLinear, assign_weights
from ...memory.storage.modules import dtype_only_weight_reads
from ..configs.meta import ComponentConfig
from ..family import ModelError


def build_empty(component: ComponentConfig) -> torch.nn.Module:
    """The component's class built from its config, parameters on meta, buffers computed."""
    from accelerate import init_empty_weights

    cls = getattr(importlib.import_module(component.library), component.class_name)
    with init_empty_weights():
        if component.library == "diffusers":
            return cls.from_config(dict(component.config))
        model = cls(cls.config_class(**component.config))
    model.tie_weights()  # transformers ties embeddings after building; not on meta by itself
    return model


def keep_fp32(module: torch.nn.Module, dtype: torch.dtype) -> tuple[str, ...]:
    """The modules `module` computes in float32 computing in `dtype`, as from_pretrained casts them: those whose
    weights it keeps wide (`kept_in_fp32`), and transformers' plain list at fp16 (T5's `wo`)."""
    kept = kept_in_fp32(module, dtype)
    if dtype != torch.float16 or module.__class__.__module__.startswith("diffusers"):
        return kept
    return tuple(getattr(module, "_keep_in_fp32_modules", None) or ()) + kept


def kept_in_fp32(module: torch.nn.Module, dtype: torch.dtype) -> tuple[str, ...]:
    """The modules whose weights `module` keeps in float32 computing in `dtype`: what a weight_dtype must not
    lower. diffusers' `_keep_in_fp32_modules` at every dtype (Wan's time embedder: saved in fp32 even in a bf16
    folder) and transformers' strict list at fp16/bf16; not transformers' plain list (T5's `wo` at fp16), which
    keeps the computation in float32 for range, not the stored weights: lowered, they upcast to float32."""
    if module.__class__.__module__.startswith("diffusers"):
        return tuple(getattr(module, "_keep_in_fp32_modules", None) or ())
    half = dtype in (torch.float16, torch.bfloat16)
    return tuple(getattr(module, "_keep_in_fp32_modules_strict", None) or ()) if half else ()


def fill(module: torch.nn.Module, tensors: Mapping[str, Any], dtype: torch.dtype, source: str) -> StorageReport:
    """Assign `tensors` to `module` (see module doc); ModelError naming `source` on a mismatch."""
    try:
        report = assign_weights(module, tensors, dtype, keep_fp32(module, dtype), source=f"'{source}'")
    except StorageError as error:
        raise ModelError(str(error)) from None
    module.eval()  # built from a config: training mode (T5 dropout) until told otherwise
    module.requires_grad_(False)
    answer_dtype_probes(module)
    return report


# transformers' T5 / UMT5 feed-forwards (T5DenseActDense, T5DenseGatedActDense and their UMT5 twins).
T5_FEED_FORWARDS = ("DenseActDense", "DenseGatedActDense")


def answer_dtype_probes(module: torch.nn.Module) -> int:
    """Let the T5-family feed-forwards whose `wo` is stored read `wo.weight` for its dtype without an upcast.

    Why: their forward reads `self.wo.weight` two or three times per call only to cast its input to wo's dtype
    (kept for int8 T5 checkpoints whose wo stays float32). A stored wo upcasts its whole matrix for every read
    (UMT5-XXL: 2 x 24 reads of 4096 x 10240 per prompt, on the host while the tier keeps wo there), and under
    a streamed tier a read can come before wo's own copy to the device was waited for. Inside these forwards
    the reads get an empty tensor of wo's compute dtype (`dtype_only_weight_reads`); wo's own forward reads
    its stored bytes as always. Returns how many feed-forwards it wrapped."""
    wrapped = 0
    for ffn in module.modules():
        wo = getattr(ffn, "wo", None)
        if (isinstance(wo, StoredLinear) and type(ffn).__name__.endswith(T5_FEED_FORWARDS)
                and "forward" not in ffn.__dict__):
            ffn.forward = _with_dtype_only_reads(ffn.forward, wo)
            wrapped += 1
    return wrapped


def _with_dtype_only_reads(forward, wo: StoredLinear):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        with dtype_only_weight_reads(wo):
            return forward(*args, **kwargs)

    return run


def tokenizer_from_spiece(model: bytes):
    """transformers' T5 tokenizer (as Wan's pipelines use) read from SentencePiece model bytes.

    transformers reads spiece models only from a folder, so the bytes go to a temporary one
    (needs the `sentencepiece` and `protobuf` packages, both vidmem dependencies).
    """
    import transformers

    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "spiece.model").write_bytes(model)
        return transformers.T5Tokenizer.from_pretrained(folder, local_files_only=True)
