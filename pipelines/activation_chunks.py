"""Activation chunks: a denoiser block computed over slices of its tokens, with the same result.

Why: at 1280x720x81 Wan 14B runs 75,600 tokens of 5,120 channels. diffusers' `WanTransformerBlock`
holds the hidden state, a normalised copy, the attention's output and, in its residual updates,
three full-size float32 temporaries at once (1.5 GB each), and its feed-forward a 13,824-wide
intermediate (2.1 GB, twice: the projection and its GELU). Those, not the weights, are the denoise
peak of a small card. Every one of them is per token: only self-attention reads all tokens, and
it reads them only as keys and values.

How: for one call, each block's `forward` is replaced (a named diffusers hook, `CHUNK_HOOK`, in the
block's own `HookRegistry`, so the step cache's hooks wrap it and the two compose) by the same
arithmetic in two passes over `chunks` slices of the tokens:
1. keys and values of self-attention for every slice, written into two preallocated tensors;
2. per slice: its queries, attention against all keys and values, the residual, cross-attention,
   the feed-forward and its residual, written into the output.
So the full-size tensors alive at once are the input, the output, the keys and the values;
everything else is 1/chunks of its unchunked size. CogVideoX's block (joint attention over text
and video, far fewer tokens) chunks its feed-forward half only: norm, feed-forward, residual.

Result: the chunked block calls the block's own modules (so LoRA hooks, stored fp8 layers and the
engine's hooks run as before) on row slices, and every operation is per token except attention,
whose keys and values are whole. On the CPU that gives bit-identical latents (tests/
test_activation_chunks.py verifies it per family and tier; it is checked, not assumed: a kernel
that picked a different reduction order by row count would break it). On CUDA, cuBLAS may pick
another GEMM algorithm for fewer rows: expect last-bit differences there, as between batch sizes.

Not chunked: blocks of other classes, fused QKV projections, attention processors other than
diffusers' own, and context parallelism (its all-to-all splits the very tokens chunked here).
`chunk_problem` says which; an explicit chunk count refuses them, `auto` leaves them unchunked with a
note (pipelines/sample_chunks.py, which also asks the planner for auto's count in a run).
Under offload=sequential every layer streams per call, so a chunked block copies its layers once per
slice: correct, but that many more copies; the planner counts them (memory/plan/stages.py `_traffic`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..memory.strategy import StrategyError

CHUNK_HOOK = "vidmem_activation_chunks"  # the hook's name in each block's diffusers HookRegistry


class ChunkError(StrategyError):
    """activation_chunks cannot apply to this model or call; the message names the input and the fix."""


@dataclass(frozen=True)
class AppliedChunks:
    """What one call chunked, for the receipt."""

    chunks: int  # 1: nothing chunked
    blocks: int = 0
    family: str = ""
    note: str = ""  # why auto left it off, when it did

    def as_dict(self) -> dict:
        found = {"chunks": self.chunks, "blocks": self.blocks}
        if self.family:
            found["family"] = self.family
        if self.note:
            found["note"] = self.note
        return found


# No slice is made smaller than this: with 1-3 rows the CPU's BLAS takes matrix-vector paths that sum
# in another order (measured on a tiny Wan: 1-3 rows per slice differ in the last bits, 4 and up are
# identical). Real sizes never come near it (720p Wan 14B in 64 slices: 1,181 tokens each).
MIN_SLICE_TOKENS = 4


def token_slices(tokens: int, chunks: int) -> list[slice]:
    """At most `chunks` contiguous slices covering `tokens` rows, none under MIN_SLICE_TOKENS (unless
    `tokens` is), sizes differing by at most one."""
    count = max(1, min(chunks, tokens // MIN_SLICE_TOKENS))
    bounds = [tokens * i // count for i in range(count + 1)]
    return [slice(start, stop) for start, stop in zip(bounds, bounds[1:])]


# --- Wan -------------------------------------------------------------------------------------------

def _rows(tensor: torch.Tensor, rows: slice) -> torch.Tensor:
    """A modulation tensor's rows for a slice: per-token ones (Wan 2.2 TI2V, [B, S, C]) are sliced,
    broadcast ones ([B, 1, C]) are used whole."""
    return tensor if tensor.shape[1] == 1 else tensor[:, rows]


def _wan_modulation(block: nn.Module, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """shift, scale, gate (self-attention) and the feed-forward's, as WanTransformerBlock.forward makes them."""
    if temb.ndim == 4:
        return tuple(part.squeeze(2) for part in (block.scale_shift_table.unsqueeze(0) + temb.float()).chunk(6, dim=2))
    return (block.scale_shift_table + temb.float()).chunk(6, dim=1)


def _wan_rotary(hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """diffusers' WanAttnProcessor `apply_rotary_emb`, operation for operation (it is a local function there)."""
    x1, x2 = hidden.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(hidden)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(hidden)


def _wan_norm1(block, hidden: torch.Tensor, rows: slice, shift, scale) -> torch.Tensor:
    x = hidden[:, rows]
    return (block.norm1(x.float()) * (1 + _rows(scale, rows)) + _rows(shift, rows)).type_as(x)


def _wan_keys_values(block, hidden, rope, shift, scale, slices) -> tuple[torch.Tensor, torch.Tensor]:
    """Self-attention's keys and values for every token, computed a slice at a time."""
    attn, keys, values = block.attn1, None, None
    for rows in slices:
        x = _wan_norm1(block, hidden, rows, shift, scale)
        key = attn.norm_k(attn.to_k(x)).unflatten(2, (attn.heads, -1))
        value = attn.to_v(x).unflatten(2, (attn.heads, -1))
        del x
        if rope is not None:
            key = _wan_rotary(key, rope[0][:, rows], rope[1][:, rows])
        if keys is None:
            keys = key.new_empty((key.shape[0], hidden.shape[1], *key.shape[2:]))
            values = value.new_empty((value.shape[0], hidden.shape[1], *value.shape[2:]))
        keys[:, rows], values[:, rows] = key, value
    return keys, values


def _wan_self_attention(block, x: torch.Tensor, keys, values, rope, rows: slice) -> torch.Tensor:
    """WanAttnProcessor's self-attention for the queries of one slice, against every key and value."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    attn = block.attn1
    query = attn.norm_q(attn.to_q(x)).unflatten(2, (attn.heads, -1))
    if rope is not None:
        query = _wan_rotary(query, rope[0][:, rows], rope[1][:, rows])
    out = dispatch_attention_fn(query, keys, values, attn_mask=None, dropout_p=0.0, is_causal=False,
                                backend=attn.processor._attention_backend, parallel_config=None)
    out = out.flatten(2, 3).type_as(query)
    return attn.to_out[1](attn.to_out[0](out))


def wan_block_forward(block: nn.Module, chunks: int, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                      temb: torch.Tensor, rotary_emb=None) -> torch.Tensor:
    """diffusers' WanTransformerBlock.forward over `chunks` token slices (see the module docstring)."""
    shift, scale, gate, c_shift, c_scale, c_gate = _wan_modulation(block, temb)
    slices = token_slices(hidden_states.shape[1], chunks)
    keys, values = _wan_keys_values(block, hidden_states, rotary_emb, shift, scale, slices)
    out = torch.empty_like(hidden_states)
    for rows in slices:
        x = _wan_norm1(block, hidden_states, rows, shift, scale)
        attn_output = _wan_self_attention(block, x, keys, values, rotary_emb, rows)
        del x
        h = (hidden_states[:, rows].float() + attn_output * _rows(gate, rows)).type_as(hidden_states)
        del attn_output
        h = h + block.attn2(block.norm2(h.float()).type_as(h), encoder_hidden_states, None, None)
        x = (block.norm3(h.float()) * (1 + _rows(c_scale, rows)) + _rows(c_shift, rows)).type_as(h)
        ff_output = block.ffn(x)
        del x
        out[:, rows] = (h.float() + ff_output.float() * _rows(c_gate, rows)).type_as(h)
    return out


def _wan_problem(block: nn.Module) -> str | None:
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    for name in ("attn1", "attn2"):
        attn = getattr(block, name)
        if type(attn.processor) is not WanAttnProcessor:
            return f"its {name} runs {type(attn.processor).__name__}, not diffusers' WanAttnProcessor"
        if getattr(attn.processor, "_parallel_config", None) is not None:
            return "context parallelism splits the tokens across GPUs already"
    if getattr(block.attn1, "fused_projections", False):
        return "its self-attention projections are fused (fuse_qkv_projections)"
    if block.attn1.add_k_proj is not None:
        return "its self-attention has added key/value projections"
    return None


# --- CogVideoX -------------------------------------------------------------------------------------

def cogvideox_block_forward(block: nn.Module, chunks: int, hidden_states: torch.Tensor,
                            encoder_hidden_states: torch.Tensor, temb: torch.Tensor, image_rotary_emb=None,
                            attention_kwargs=None) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' CogVideoXBlock.forward with its feed-forward half over `chunks` slices of the video tokens.

    The attention half is diffusers' own code path (joint attention over text and video); the
    feed-forward, which diffusers runs on the text and video tokens concatenated, runs per slice."""
    attention_kwargs = attention_kwargs or {}
    norm_h, norm_e, gate_msa, enc_gate_msa = block.norm1(hidden_states, encoder_hidden_states, temb)
    attn_h, attn_e = block.attn1(hidden_states=norm_h, encoder_hidden_states=norm_e, image_rotary_emb=image_rotary_emb,
                                 **attention_kwargs)
    del norm_h, norm_e
    hidden_states = hidden_states + gate_msa * attn_h
    encoder_hidden_states = encoder_hidden_states + enc_gate_msa * attn_e
    del attn_h, attn_e
    norm2 = block.norm2  # CogVideoXLayerNormZero, its modulation computed once for every slice
    shift, scale, gate, enc_shift, enc_scale, enc_gate = norm2.linear(norm2.silu(temb)).chunk(6, dim=1)
    out = torch.empty_like(hidden_states)
    for rows in token_slices(hidden_states.shape[1], chunks):
        x = norm2.norm(hidden_states[:, rows]) * (1 + scale)[:, None, :] + shift[:, None, :]
        out[:, rows] = hidden_states[:, rows] + gate[:, None, :] * block.ff(x)
    x = norm2.norm(encoder_hidden_states) * (1 + enc_scale)[:, None, :] + enc_shift[:, None, :]
    encoder_out = encoder_hidden_states + enc_gate[:, None, :] * block.ff(x)
    return out, encoder_out


def _cogvideox_problem(block: nn.Module) -> str | None:
    from diffusers.models.normalization import CogVideoXLayerNormZero

    if type(block.norm2) is not CogVideoXLayerNormZero:
        return f"its norm2 is {type(block.norm2).__name__}, not diffusers' CogVideoXLayerNormZero"
    return None


# Block class name -> (family, chunked forward, what may stop it). Classes are matched exactly:
# a subclass may compute differently, and chunking it would silently change the video.
_FORWARDS = {
    "WanTransformerBlock": ("wan", wan_block_forward, _wan_problem),
    "CogVideoXBlock": ("cogvideox", cogvideox_block_forward, _cogvideox_problem),
}


def _known(block: nn.Module) -> tuple | None:
    entry = _FORWARDS.get(type(block).__name__)
    return entry if entry and type(block).__module__.startswith("diffusers.") else None


def chunk_problem(block: nn.Module) -> str | None:
    """Why `block` cannot be chunked (None: it can)."""
    entry = _known(block)
    if entry is None:
        return f"vidmem chunks diffusers' {' and '.join(_FORWARDS)} only, not {type(block).__name__}"
    if _wrapped(block):
        return ("its forward is already wrapped (a step cache or compile applied first); activation chunks must be "
                "applied before them")
    return entry[2](block)


def _wrapped(block: nn.Module) -> bool:
    """Something replaced the block's forward (diffusers leaves the plain bound method behind when it
    removes its hooks: that one is the class's own forward, not a wrapper)."""
    forward = block.__dict__.get("forward")
    registry = getattr(block, "_diffusers_hook", None)
    if registry is not None and registry.hooks:
        return True
    return forward is not None and getattr(forward, "__func__", None) is not type(block).forward


# --- applying it for one call ----------------------------------------------------------------------

@functools.cache  # built on first use: importing diffusers' hooks is not free, and the CLI must stay light
def _hook_class():
    from diffusers.hooks import ModelHook

    class ChunkHook(ModelHook):
        """Replaces the block's forward by its chunked twin (diffusers' ModelHook.new_forward)."""

        def __init__(self, forward, chunks: int) -> None:
            super().__init__()
            self.chunked_forward = forward
            self.chunks = chunks

        def new_forward(self, module: nn.Module, *args, **kwargs):
            return self.chunked_forward(module, self.chunks, *args, **kwargs)

    return ChunkHook


@contextlib.contextmanager
def activation_chunks(denoisers: Mapping[str, nn.Module], blocks: Mapping[str, Sequence[nn.Module]],
                      chunks: int) -> Iterator[AppliedChunks]:
    """Chunk every block in `blocks` (denoiser name -> its blocks) over `chunks` token slices for the `with` body.

    Apply it before the step cache and compile (they wrap what it installs). Everything is checked
    before any block changes: ChunkError names the block and why. On exit, success or error, every
    block's `forward` and hook registry are as they were before.

        with activation_chunks({"transformer": pipe.transformer}, denoiser_blocks(pipe, spec), 4) as applied:
            pipe(...)
    """
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ChunkError(f"activation_chunks={chunks!r} must be a whole number of token slices, 1 (off) or more.")
    if chunks == 1:
        yield AppliedChunks(1)
        return
    listed = [(name, index, block) for name, group in blocks.items() for index, block in enumerate(group)]
    for name, index, block in listed:
        problem = chunk_problem(block)
        if problem:
            raise ChunkError(f"activation_chunks={chunks}: {name} block {index} cannot be chunked: {problem}. "
                             "Set activation_chunks to 'off' (or 'auto', which leaves such models unchunked).")
    from diffusers.hooks import HookRegistry

    hook = _hook_class()
    applied: list[tuple[nn.Module, dict]] = []
    try:
        for _, _, block in listed:
            applied.append((block, {key: block.__dict__[key] for key in _TOUCHED if key in block.__dict__}))
            HookRegistry.check_if_exists_or_initialize(block).register_hook(hook(_known(block)[1], chunks), CHUNK_HOOK)
        _forget_child_registries(denoisers)
        families = sorted({_known(block)[0] for _, _, block in listed})
        yield AppliedChunks(chunks, len(listed), ",".join(families))
    finally:
        for block, before in reversed(applied):
            _restore(block, before)
        _forget_child_registries(denoisers)


def _forget_child_registries(denoisers: Mapping[str, nn.Module]) -> None:
    """A denoiser's own registry caches which blocks carry registries (diffusers' `_get_child_registries`):
    adding or removing the blocks' registries stales it, as diffusers' enable_cache notes."""
    for denoiser in denoisers.values():
        registry = getattr(denoiser, "_diffusers_hook", None)
        if registry is not None:
            registry.invalidate_child_registries_cache()


_TOUCHED = ("forward", "_diffusers_hook")  # instance attributes registering a diffusers hook may add


def _restore(block: nn.Module, before: dict) -> None:
    """Take the hook off and leave the block as found: diffusers' remove_hook leaves the bound method
    as an instance attribute (and the registry) behind, which the block may not have had."""
    registry = getattr(block, "_diffusers_hook", None)
    if registry is not None and registry.get_hook(CHUNK_HOOK) is not None:
        registry.remove_hook(CHUNK_HOOK, recurse=False)
    if registry is not None and registry.hooks:
        return  # someone else's hooks remain (applied after this one and not yet removed): theirs to undo
    for key in _TOUCHED:
        if key in before:
            block.__dict__[key] = before[key]
        else:
            block.__dict__.pop(key, None)


def refusal(blocks: Mapping[str, Sequence[nn.Module]]) -> str | None:
    """The first reason these blocks cannot be chunked (None: all can): what auto logs when it leaves chunking off."""
    for name, group in blocks.items():
        for index, block in enumerate(group):
            problem = chunk_problem(block)
            if problem:
                return f"{name} block {index}: {problem}"
    return None

