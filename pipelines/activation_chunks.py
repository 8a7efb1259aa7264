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
1. keys, values and queries of self-attention for every slice: keys and values written into two
   preallocated tensors, queries parked in the output tensor (still empty then);
2. per slice: its queries read back, attention against all keys and values, the residual,
   cross-attention (its keys and values, the text's, made once per call), the feed-forward and its
   residual, written into the output over those queries.
So the full-size tensors alive at once are the input, the output, the keys and the values;
everything else is 1/chunks of its unchunked size. HunyuanVideo 1.5's block (joint attention over video
and text) runs the same two passes over its video tokens, its keys and values those of every token, video
and text, and the text's queries as one more slice (`hunyuan_video15_block_forward`). CogVideoX's block
chunks its feed-forward half only: norm, feed-forward, residual.

Result: the chunked block calls the block's own modules (so LoRA hooks, stored fp8 layers and the
engine's hooks run as before) on row slices, and every operation is per token except attention,
whose keys and values are whole; the slices keep torch's CPU attention kernel's query blocks as the whole
run has them (`token_slices`). On the CPU that gives bit-identical latents (tests/
test_activation_chunks.py verifies it per family and tier; it is checked, not assumed: a kernel
that picked a different reduction order by row count would break it). On CUDA, cuBLAS may pick
another GEMM algorithm for fewer rows: expect last-bit differences there, as between batch sizes.

Not chunked: blocks of other classes, fused QKV projections, attention processors other than
diffusers' own (or, for HunyuanVideo 1.5, vidmem's key-masked wrapper of it), and context parallelism
(its all-to-all splits the very tokens chunked here).
`chunk_problem` says which; an explicit chunk count refuses them, `auto` leaves them unchunked with a
note (pipelines/sample_chunks.py, which also asks the planner for auto's count in a run).
Under offload=sequential every layer streams per call, so a chunked block copies its layers once per
slice: correct, but that many more copies; the planner counts them (memory/plan/stages.py `_chunked_copies`).

Compiled blocks: each slice's work is a step, a module-level function of the block and tensors, called through
the hook's `run` (plainly, or compiled for a call by pipelines/compile.py through `AppliedChunks.steps_run_by`),
so one compiled graph per step serves every block and slice.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..memory.strategy import StrategyError
from .hunyuan_video15_attention import diffusers_processor, masks_keys_only
from .hook_attributes import as_found, leave_as_found

CHUNK_HOOK = "vidmem_activation_chunks"  # the hook's name in each block's diffusers HookRegistry


class ChunkError(StrategyError):
    """activation_chunks cannot apply to this model or call; the message names the input and the fix."""


@dataclass(frozen=True)
class AppliedChunks:
    """What one call chunked, for the receipt."""

    chunks: int  # 1: nothing chunked; else the count asked for
    blocks: int = 0
    family: str = ""
    note: str = ""  # why auto left it off, when it did
    # The slice counts the blocks ran, filled in by the hooks as they run: token_slices runs fewer than
    # asked where the tokens are few (64 asked of 40 tokens: 10). A record of the call, not its settings.
    slices_ran: set[int] = field(default_factory=set, compare=False)
    hooks: tuple = field(default=(), compare=False, repr=False)  # the blocks' ChunkHooks, for steps_run_by

    @contextlib.contextmanager
    def steps_run_by(self, run: StepRunner) -> Iterator[None]:
        """Every chunked block's slice steps called through `run(step, block, *args)` for the `with` body
        (compiled blocks' runner: pipelines/compile.py), and called plainly again after it, however it ends."""
        for hook in self.hooks:
            hook.run = run
        try:
            yield
        finally:
            for hook in self.hooks:
                hook.run = _eager

    def as_dict(self) -> dict:
        found = {"chunks": self.chunks, "blocks": self.blocks}
        if self.slices_ran:
            found["slices"] = sorted(self.slices_ran)
        if self.family:
            found["family"] = self.family
        if self.note:
            found["note"] = self.note
        return found


# No slice is made smaller than this: with 1-3 rows the CPU's BLAS takes matrix-vector paths that sum
# in another order (measured on a tiny Wan: 1-3 rows per slice differ in the last bits, 4 and up are
# identical). Real sizes never come near it (720p Wan 14B in 64 slices: 1,181 tokens each).
MIN_SLICE_TOKENS = 4


def token_slices(tokens: int, chunks: int, followed: bool = False) -> list[slice]:
    """At most `chunks` contiguous slices covering `tokens` rows, none under MIN_SLICE_TOKENS (unless
    `tokens` is), each query row computed by the CPU's attention kernel as in the unsliced run.

    Why the last condition: torch's CPU flash attention takes the queries in blocks (`query_block`), and a
    block of 1-3 rows sums in another order, as such matrices do anywhere (MIN_SLICE_TOKENS). Equal slices
    can leave such a block where the whole run has none (1,540 tokens in 2: 770 = 3 x 256 + 2), so they are
    used only where every row's block is the same size as in the whole run or 4 rows or more in both
    (sizes then differ by at most one, which is nearly always); otherwise the slices are multiples of 4 rows
    and the last is sized to end as the whole run ends (`_blocked_sizes`).

    `followed`: more query rows follow these in the same attention call (HunyuanVideo 1.5's text after its video
    tokens), so these rows do not end the run: the last slice too keeps 4 rows or more in its last block."""
    bounds = [0]
    for size in _slice_sizes(tokens, chunks, followed):
        bounds.append(bounds[-1] + size)
    return [slice(start, stop) for start, stop in zip(bounds, bounds[1:])]


@functools.lru_cache(maxsize=512)  # every block of every step asks again; the fallback scans the possible last slices
def _slice_sizes(tokens: int, chunks: int, followed: bool = False) -> tuple[int, ...]:
    count = max(1, min(chunks, tokens // MIN_SLICE_TOKENS))
    sizes = tuple(tokens * (i + 1) // count - tokens * i // count for i in range(count))
    ends = MIN_SLICE_TOKENS if followed else _last_block(tokens)  # the rows in the whole run's block these end in
    return sizes if _same_query_blocks(ends, sizes) else _blocked_sizes(tokens, count, ends)


def query_block(rows: int) -> int:
    """The rows per query block of torch's CPU flash attention over `rows` queries (aten/src/ATen/native/
    cpu/FlashAttentionKernel.cpp, `flash_attention_kernel_impl`): 256 from 768 up, 64 from 192, else 32."""
    return min(256 if rows >= 768 else 64 if rows >= 192 else 32, rows)


def _last_block(rows: int) -> int:
    """The rows in the last query block of `rows` (only the last can be short)."""
    return (rows - 1) % query_block(rows) + 1


def _ends_as_whole(whole: int, last: int) -> bool:
    """Whether a last slice of `last` rows ends in a query block like the whole run's last one (`whole` rows):
    the same 1-3 rows, or 4 rows or more in both. The whole run's other blocks are 32 rows or more."""
    if whole < MIN_SLICE_TOKENS:
        return _last_block(last) == whole
    return _last_block(last) >= MIN_SLICE_TOKENS


def _same_query_blocks(ends: int, sizes: tuple[int, ...]) -> bool:
    *inner, last = sizes
    return all(_last_block(size) >= MIN_SLICE_TOKENS for size in inner) and _ends_as_whole(ends, last)


def _blocked_sizes(tokens: int, count: int, ends: int) -> tuple[int, ...]:
    """Slice sizes whose query blocks are the whole run's: all but the last a multiple of 4 rows (so is every
    block of theirs), the last one that ends as the whole run does, chosen to keep the largest slice
    smallest. Fewer slices where none fits (a few dozen tokens at most): one always does."""
    step = MIN_SLICE_TOKENS
    for inner in range(count - 1, 0, -1):
        # the last slice's possible sizes: those that leave the others their multiples of 4
        fitting = [last for last in range(tokens - step * inner, step - 1, -step) if _ends_as_whole(ends, last)]
        if fitting:
            last = min(fitting, key=lambda size: (max(size, -(-(tokens - size) // (step * inner)) * step), size))
            quads = (tokens - last) // step
            return (*(step * (quads * (i + 1) // inner - quads * i // inner) for i in range(inner)), last)
    return (tokens,)


# --- Wan -------------------------------------------------------------------------------------------

# The modulation's six parts, in the order WanTransformerBlock.forward unpacks them.
SHIFT, SCALE, GATE, C_SHIFT, C_SCALE, C_GATE = range(6)


def _eager(step, block: nn.Module, *args):
    """How a slice's step runs unless compiled blocks are on: called as it is (`StepRunner`)."""
    return step(block, *args)


# run(step, block, *args) -> step(block, *args), or its compiled twin (pipelines/compile.py, `_Runner.run`).
# Each step is a module-level function taking the block and tensors, so one compiled graph serves every block
# and every slice: the slices differ only in their row count and their offset in the tensors, and dynamo guards
# neither an offset nor (after the second size, with dynamic 'auto') a size.
StepRunner = Callable[..., object]


def _wan_modulation(block, temb: torch.Tensor) -> torch.Tensor:
    """What every slice takes its modulation from (`_wan_part`): for broadcast `temb` ([B, 6, C], Wan 2.1 and
    2.2 A14B) diffusers' own sum `scale_shift_table + temb.float()`, made once per block call (6 x C numbers;
    made per part and slice, it was a dozen more small kernels per slice); per-token `temb` as it is."""
    return temb if temb.ndim == 4 else block.scale_shift_table + temb.float()


def _wan_part(table: torch.Tensor, modulation: torch.Tensor, index: int) -> torch.Tensor:
    """One of the modulation's six parts (shift, scale, gate; the feed-forward's), as WanTransformerBlock.forward
    makes it, from `_wan_modulation`'s result for the rows given (all of them, or one slice's rows when the
    modulation is per token).

    Why per slice where it is per token: Wan 2.2 TI2V's modulation is per token (temb [B, S, 6, C]). Built whole,
    as diffusers does, its float32 copy and the float32 sum are two full-size tensors alive through the whole
    block (1.9 GiB each for TI2V-5B at 1280x704x121), more than the slices save. Each element is the same float32
    addition either way, so the result does not change."""
    if modulation.ndim == 4:  # per token: [1, C] + [B, rows, C]
        return table[:, index] + modulation[:, :, index].float()
    return modulation[:, index : index + 1]  # [B, 1, C], a view of the sum made once


def _rows_of(modulation: torch.Tensor, rows: slice) -> torch.Tensor:
    """`_wan_modulation`'s result for the tokens `rows`: its own rows when it is per token, else all of it."""
    return modulation[:, rows] if modulation.ndim == 4 else modulation


def _wan_rotary(hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """diffusers' WanAttnProcessor `apply_rotary_emb`, operation for operation (it is a local function there)."""
    x1, x2 = hidden.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(hidden)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(hidden)


def _wan_norm1(block, x: torch.Tensor, modulation: torch.Tensor) -> torch.Tensor:
    """The self-attention's input for the rows `x` (`modulation`: `_wan_modulation`'s, their rows where per token)."""
    table = block.scale_shift_table
    return (block.norm1(x.float()) * (1 + _wan_part(table, modulation, SCALE))
            + _wan_part(table, modulation, SHIFT)).type_as(x)


def _wan_query(block, x: torch.Tensor, cos, sin) -> torch.Tensor:
    """WanAttnProcessor's queries for normalised rows `x` (cos, sin: their rotary rows, or None)."""
    attn = block.attn1
    query = attn.norm_q(attn.to_q(x)).unflatten(2, (attn.heads, -1))
    return _wan_rotary(query, cos, sin) if cos is not None else query


def _wan_slice_projections(block, x: torch.Tensor, modulation: torch.Tensor, cos, sin, with_query: bool):
    """Pass 1's step for one slice's rows `x`: self-attention's (queries or None, keys, values), as
    WanAttnProcessor makes them."""
    attn = block.attn1
    x = _wan_norm1(block, x, modulation)
    query = _wan_query(block, x, cos, sin) if with_query else None
    key = attn.norm_k(attn.to_k(x)).unflatten(2, (attn.heads, -1))
    if cos is not None:
        key = _wan_rotary(key, cos, sin)
    return query, key, attn.to_v(x).unflatten(2, (attn.heads, -1))


def _wan_projections(block, hidden, modulation, rope, slices, out,
                     run: StepRunner) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Wan's pass 1 (`_slice_projections`): self-attention's keys and values over the block's own tokens."""
    return _slice_projections(run, _wan_slice_projections, block, hidden, slices, out, hidden.shape[1],
                              lambda rows: (_rows_of(modulation, rows), *_rope_rows(rope, rows)))


def _slice_projections(run: StepRunner, step, block, hidden, slices, out, tokens: int,
                       arguments: Callable[[slice], tuple]) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Pass 1 of a chunked block: `step(block, hidden[:, rows], *arguments(rows), with_query)` -> (queries or
    None, keys, values) for each slice `rows`. Keys and values are written into two tensors of `tokens` rows
    (hidden's first; joint attention's other tokens, written by the caller, after them); queries are parked in
    `out` (the block's output, still empty: each slice's output overwrites its own rows only after its queries
    are read back). Why park them: pass 2 would otherwise normalise every token a second time for its queries,
    full-size float32 work that cost a real Wan 14B block 7% at 480p on an H200 (docs/activation-chunks.md),
    and `out` holds them at no extra memory. Returns (keys, values, queries parked): queries of another dtype
    than `out` are not parked, and pass 2 makes them again."""
    keys = values = None
    parked = True
    for rows in slices:
        query, key, value = run(step, block, hidden[:, rows], *arguments(rows), parked)
        parked = query is not None and query.dtype == out.dtype
        if parked:
            out[:, rows] = query.flatten(2, 3)
        del query
        if keys is None:
            keys = key.new_empty((key.shape[0], tokens, *key.shape[2:]))
            values = value.new_empty((value.shape[0], tokens, *value.shape[2:]))
        keys[:, rows], values[:, rows] = key, value
        del key, value
    return keys, values, parked


def _rope_rows(rope, rows: slice) -> tuple:
    """(cos, sin) of the tokens `rows`, or (None, None) without rotary embeddings."""
    return (rope[0][:, rows], rope[1][:, rows]) if rope is not None else (None, None)


# WanAttnProcessor's text context length: it takes the tokens before the last 512 as the image's (hardcoded there).
_WAN_TEXT_TOKENS = 512


def _wan_cross_context(block, encoder_hidden_states: torch.Tensor) -> tuple:
    """Cross-attention's (keys, values, image keys, image values) as WanAttnProcessor makes them from
    `encoder_hidden_states`: the text's, and Wan 2.1 I2V's image tokens' (None, None without them).

    Why once per block call: the processor projects them each time attn2 is called; called per slice, the same
    512-token projections were made `chunks` times (at 480p, a Wan 14B block in 16 slices spent 2% of its FLOPs
    on it). They do not depend on the slice: made once by the same layers on the same input, the same values."""
    attn = block.attn2
    text, image = encoder_hidden_states, None
    if attn.add_k_proj is not None:  # I2V: the image's tokens come first
        split = encoder_hidden_states.shape[1] - _WAN_TEXT_TOKENS
        image, text = encoder_hidden_states[:, :split], encoder_hidden_states[:, split:]
    keys = attn.norm_k(attn.to_k(text)).unflatten(2, (attn.heads, -1))
    values = attn.to_v(text).unflatten(2, (attn.heads, -1))
    if image is None:
        return keys, values, None, None
    image_keys = attn.norm_added_k(attn.add_k_proj(image)).unflatten(2, (attn.heads, -1))
    return keys, values, image_keys, attn.add_v_proj(image).unflatten(2, (attn.heads, -1))


def _attend(attn, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask=None) -> torch.Tensor:
    """diffusers' dispatcher with the processor's backend, flattened back to [B, rows, heads x dim] as it does."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    out = dispatch_attention_fn(query, keys, values, attn_mask=mask, dropout_p=0.0, is_causal=False,
                                backend=diffusers_processor(attn.processor)._attention_backend, parallel_config=None)
    return out.flatten(2, 3).type_as(query)


def _wan_slice_rest(block, x: torch.Tensor, parked, keys, values, cross: tuple, modulation: torch.Tensor, cos, sin):
    """Pass 2's step for one slice's rows `x`: its queries (read back from `parked`, their rows of the block's
    output, or made again when None) against every key and value, the residual, cross-attention against the
    keys and values made once, the feed-forward and its residual: the slice's output rows."""
    table = block.scale_shift_table
    if parked is not None:  # contiguous as made (a batch of several makes the parked rows a strided view)
        query = parked.unflatten(2, (block.attn1.heads, -1)).contiguous()
    else:
        query = _wan_query(block, _wan_norm1(block, x, modulation), cos, sin)
    attn1 = block.attn1
    attn_output = attn1.to_out[1](attn1.to_out[0](_attend(attn1, query, keys, values)))
    del query
    h = (x.float() + attn_output * _wan_part(table, modulation, GATE)).type_as(x)
    del attn_output
    h = h + _wan_cross_attention(block, block.norm2(h.float()).type_as(h), *cross)
    y = (block.norm3(h.float()) * (1 + _wan_part(table, modulation, C_SCALE))
         + _wan_part(table, modulation, C_SHIFT)).type_as(h)
    ff_output = block.ffn(y)
    del y
    return (h.float() + ff_output.float() * _wan_part(table, modulation, C_GATE)).type_as(h)


def _wan_cross_attention(block, x: torch.Tensor, keys, values, image_keys, image_values) -> torch.Tensor:
    """WanAttnProcessor's cross-attention for one slice's normalised rows `x`, against keys and values made once."""
    attn = block.attn2
    query = attn.norm_q(attn.to_q(x)).unflatten(2, (attn.heads, -1))
    out = _attend(attn, query, keys, values)
    if image_keys is not None:  # the processor adds the image's attention to the text's, text first
        out = out + _attend(attn, query, image_keys, image_values)
    return attn.to_out[1](attn.to_out[0](out))


def wan_block_forward(block: nn.Module, chunks: int, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                      temb: torch.Tensor, rotary_emb=None, *, run: StepRunner = _eager) -> torch.Tensor:
    """diffusers' WanTransformerBlock.forward over `chunks` token slices (see the module docstring); `run` calls
    each slice's step (compiled where compiled blocks are on)."""
    slices = token_slices(hidden_states.shape[1], chunks)
    out = torch.empty_like(hidden_states)
    modulation = _wan_modulation(block, temb)
    keys, values, parked = _wan_projections(block, hidden_states, modulation, rotary_emb, slices, out, run)
    cross = _wan_cross_context(block, encoder_hidden_states)
    for rows in slices:
        out[:, rows] = run(_wan_slice_rest, block, hidden_states[:, rows], out[:, rows] if parked else None, keys,
                           values, cross, _rows_of(modulation, rows), *_rope_rows(rotary_emb, rows))
    return out


def _wan_problem(block: nn.Module) -> str | None:
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    for name in ("attn1", "attn2"):
        attn = getattr(block, name)
        if type(attn.processor) is not WanAttnProcessor:
            return f"its {name} runs {type(attn.processor).__name__}, not diffusers' WanAttnProcessor"
    for name, what in (("attn1", "self"), ("attn2", "cross")):
        if getattr(getattr(block, name), "fused_projections", False):
            return f"its {what}-attention projections are fused (fuse_qkv_projections)"
    if block.attn1.add_k_proj is not None:
        return "its self-attention has added key/value projections"
    return None


# --- CogVideoX -------------------------------------------------------------------------------------

def _cogvideox_attention_half(block, hidden_states, encoder_hidden_states, temb, image_rotary_emb, attention_kwargs):
    """CogVideoXBlock.forward's attention half, diffusers' own code path (joint attention over text and video),
    with its residuals: (video tokens, text tokens)."""
    norm_h, norm_e, gate_msa, enc_gate_msa = block.norm1(hidden_states, encoder_hidden_states, temb)
    attn_h, attn_e = block.attn1(hidden_states=norm_h, encoder_hidden_states=norm_e, image_rotary_emb=image_rotary_emb,
                                 **attention_kwargs)
    del norm_h, norm_e
    return hidden_states + gate_msa * attn_h, encoder_hidden_states + enc_gate_msa * attn_e


def _modulated_feed_forward(norm: nn.Module, ff: nn.Module, x: torch.Tensor, shift, scale, gate) -> torch.Tensor:
    """A joint-attention block's feed-forward half and its residual for the tokens `x`, as CogVideoXBlock.forward
    and HunyuanVideo15TransformerBlock.forward compute it: norm, modulation, feed-forward, gated residual (each
    element the same arithmetic as theirs)."""
    y = norm(x) * (1 + scale[:, None]) + shift[:, None]
    return x + gate.unsqueeze(1) * ff(y)


def _cogvideox_feed_forward(block, x: torch.Tensor, shift, scale, gate) -> torch.Tensor:
    """CogVideoXBlock.forward's feed-forward half and its residual for the tokens `x` (a slice of the video's, or
    the text's), under norm2's modulation (shift, scale, gate) for them."""
    return _modulated_feed_forward(block.norm2.norm, block.ff, x, shift, scale, gate)


def cogvideox_block_forward(block: nn.Module, chunks: int, hidden_states: torch.Tensor,
                            encoder_hidden_states: torch.Tensor, temb: torch.Tensor, image_rotary_emb=None,
                            attention_kwargs=None, *, run: StepRunner = _eager) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' CogVideoXBlock.forward with its feed-forward half over `chunks` slices of the video tokens.

    The attention half is diffusers' own code path; the feed-forward, which diffusers runs on the text and video
    tokens concatenated, runs per slice of the video's tokens and once on the text's. `run` calls each step
    (compiled where compiled blocks are on)."""
    hidden_states, encoder_hidden_states = run(_cogvideox_attention_half, block, hidden_states, encoder_hidden_states,
                                               temb, image_rotary_emb, attention_kwargs or {})
    norm2 = block.norm2  # CogVideoXLayerNormZero, its modulation computed once for every slice
    shift, scale, gate, enc_shift, enc_scale, enc_gate = norm2.linear(norm2.silu(temb)).chunk(6, dim=1)
    out = torch.empty_like(hidden_states)
    for rows in token_slices(hidden_states.shape[1], chunks):
        out[:, rows] = run(_cogvideox_feed_forward, block, hidden_states[:, rows], shift, scale, gate)
    return out, run(_cogvideox_feed_forward, block, encoder_hidden_states, enc_shift, enc_scale, enc_gate)


def _cogvideox_problem(block: nn.Module) -> str | None:
    from diffusers.models.normalization import CogVideoXLayerNormZero

    if type(block.norm2) is not CogVideoXLayerNormZero:
        return f"its norm2 is {type(block.norm2).__name__}, not diffusers' CogVideoXLayerNormZero"
    return None


# --- HunyuanVideo 1.5 ------------------------------------------------------------------------------

def _hunyuan_video15_modulation(norm: nn.Module, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """AdaLayerNormZero's six parts (shift, scale, gate of the attention; of the feed-forward), as it makes them:
    once per block call, every slice takes its rows' modulation from them."""
    return norm.linear(norm.silu(temb)).chunk(6, dim=1)


def _hunyuan_video15_norm1(norm: nn.Module, x: torch.Tensor, modulation) -> torch.Tensor:
    """AdaLayerNormZero's output for the rows `x` (norm1's for video rows, norm1_context's for the text)."""
    shift, scale = modulation[0], modulation[1]
    return norm.norm(x) * (1 + scale[:, None]) + shift[:, None]


def _hunyuan_video15_query(block, x: torch.Tensor, cos, sin) -> torch.Tensor:
    """HunyuanVideo15AttnProcessor2_0's queries for normalised video rows `x` (cos, sin: their rotary rows)."""
    from diffusers.models.embeddings import apply_rotary_emb

    attn = block.attn
    query = attn.norm_q(attn.to_q(x).unflatten(2, (attn.heads, -1)))
    return apply_rotary_emb(query, (cos, sin), sequence_dim=1) if cos is not None else query


def _hunyuan_video15_slice_projections(block, x: torch.Tensor, modulation, cos, sin, with_query: bool):
    """Pass 1's step for one slice of video rows `x`: the joint attention's (queries or None, keys, values) for
    them, as HunyuanVideo15AttnProcessor2_0 makes them (projection, QK norm, rotary)."""
    from diffusers.models.embeddings import apply_rotary_emb

    attn = block.attn
    x = _hunyuan_video15_norm1(block.norm1, x, modulation)
    query = _hunyuan_video15_query(block, x, cos, sin) if with_query else None
    key = attn.norm_k(attn.to_k(x).unflatten(2, (attn.heads, -1)))
    if cos is not None:
        key = apply_rotary_emb(key, (cos, sin), sequence_dim=1)
    return query, key, attn.to_v(x).unflatten(2, (attn.heads, -1))


def _hunyuan_video15_text_projections(block, text: torch.Tensor, modulation):
    """The text tokens' (queries, keys, values), as the processor makes them: added projections and norms, no
    rotary."""
    attn = block.attn
    x = _hunyuan_video15_norm1(block.norm1_context, text, modulation)
    query, key, value = (proj(x).unflatten(2, (attn.heads, -1)) for proj in (attn.add_q_proj, attn.add_k_proj,
                                                                           attn.add_v_proj))
    if attn.norm_added_q is not None:
        query = attn.norm_added_q(query)
    if attn.norm_added_k is not None:
        key = attn.norm_added_k(key)
    return query, key, value


def _hunyuan_video15_slice_rest(block, x: torch.Tensor, parked, keys, values, mask, modulation, cos, sin):
    """Pass 2's step for one slice of video rows `x`: its queries (read back from `parked`, or made again when
    None) against every key and value (video and text), the output projection and gated residual, then the
    video's feed-forward and its residual: the slice's output rows."""
    attn = block.attn
    if parked is not None:  # contiguous as made (a batch of several makes the parked rows a strided view)
        query = parked.unflatten(2, (attn.heads, -1)).contiguous()
    else:
        query = _hunyuan_video15_query(block, _hunyuan_video15_norm1(block.norm1, x, modulation), cos, sin)
    attn_output = attn.to_out[1](attn.to_out[0](_attend(attn, query, keys, values, mask)))
    del query
    _, _, gate_msa, shift_mlp, scale_mlp, gate_mlp = modulation
    x = x + attn_output * gate_msa.unsqueeze(1)
    del attn_output
    return _modulated_feed_forward(block.norm2, block.ff, x, shift_mlp, scale_mlp, gate_mlp)


def _hunyuan_video15_text_rest(block, text: torch.Tensor, query, keys, values, mask, lead: int, modulation):
    """Pass 2's step for the text tokens: their queries (after `lead` video rows', see `_text_lead`) against every
    key and value, the text's output projection and gated residual, its feed-forward and its residual."""
    attn = block.attn
    attn_output = attn.to_add_out(_attend(attn, query, keys, values, mask)[:, lead:])
    _, _, gate_msa, shift_mlp, scale_mlp, gate_mlp = modulation
    text = text + attn_output * gate_msa.unsqueeze(1)
    del attn_output
    return _modulated_feed_forward(block.norm2_context, block.ff_context, text, shift_mlp, scale_mlp, gate_mlp)


def _hunyuan_video15_rope(freqs_cis) -> Callable[[slice], tuple]:
    """rows -> (cos, sin) of those video rows (freqs_cis: [video, head dim] each), or (None, None) without."""
    if freqs_cis is None:
        return lambda rows: (None, None)
    return lambda rows: (freqs_cis[0][rows], freqs_cis[1][rows])


def _text_lead(video: int, text: int) -> int:
    """How many of the last video rows' queries the text's attention takes before its own, so that its query
    rows end in a block like the whole run's last one (`token_slices`: a last block of 1-3 rows sums in another
    order). Nearly always 0; at most the video tokens, which is the whole run."""
    whole = _last_block(video + text)
    return next(lead for lead in range(video + 1) if _ends_as_whole(whole, lead + text))


def _hunyuan_video15_masks(block, video: int, text_mask, lead: int) -> tuple:
    """(the video rows' mask, the text rows') as the running processor masks them. Where vidmem's wrapper masks
    keys only: both the valid keys. Where diffusers' processor runs (the wrapper below its size, or alone) it
    masks queries too: the text's padded rows attend to nothing (its SDPA writes zeros there), and the video rows,
    all valid, see the keys' mask. `text_mask` [B, text] (None: nothing masked); `lead` video rows, all valid, go
    before the text's (`_text_lead`)."""
    if text_mask is None:
        return None, None
    batch, tokens = text_mask.shape[0], video + text_mask.shape[1]
    keys = F.pad(text_mask, (video, 0), value=True).bool().view(batch, 1, 1, tokens)
    if masks_keys_only(block.attn.processor, batch, tokens, text_mask):
        return keys, keys
    return keys, keys & F.pad(text_mask, (lead, 0), value=True).bool().view(batch, 1, -1, 1)


def _text_queries(block, text_query, lead: int, out, parked: bool, hidden, modulation, rope) -> torch.Tensor:
    """The text's queries after those of its `lead` video rows (`_text_lead`): parked in `out`, or made again."""
    if not lead:
        return text_query
    led = slice(hidden.shape[1] - lead, hidden.shape[1])
    if parked:
        lead_query = out[:, led].unflatten(2, (block.attn.heads, -1))
    else:
        lead_query = _hunyuan_video15_query(block, _hunyuan_video15_norm1(block.norm1, hidden[:, led], modulation),
                                            *rope(led))
    return torch.cat([lead_query, text_query], dim=1)


def hunyuan_video15_block_forward(block: nn.Module, chunks: int, hidden_states: torch.Tensor,
                                  encoder_hidden_states: torch.Tensor, temb: torch.Tensor, attention_mask=None,
                                  freqs_cis=None, *args, run: StepRunner = _eager,
                                  **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' HunyuanVideo15TransformerBlock.forward over `chunks` slices of the video tokens, in Wan's two
    passes (module docstring). Attention is joint over video and text: pass 1 makes the video slices' keys and
    values, then the text's, into tensors of every token in the processor's order (video, then text), the
    video's queries parked in the output; pass 2 runs the text's queries as one slice of their own first (with,
    rarely, a lead of parked video queries: `_text_lead`), then per video slice its queries against every key and
    value, masked as the running processor masks them (`_hunyuan_video15_masks`), the output projection, the
    gated residual and the feed-forward. `run` calls each step (compiled where compiled blocks are on).

    Every row the same arithmetic as unchunked, on the CPU bit for bit: the video rows, the text's valid rows and
    its padded ones too (zeros under diffusers' mask; under vidmem's keys-only mask, values that nothing reads:
    the next block masks them as keys, and the model's output keeps the video's). Checked on whole blocks with
    either mask (tests/test_activation_chunks_review.py) and on sampled latents (tests/test_activation_chunks.py,
    tests/test_hunyuan_video15.py)."""
    video, text = hidden_states.shape[1], encoder_hidden_states.shape[1]
    slices = _hunyuan_video15_slices(video, chunks)
    rope = _hunyuan_video15_rope(freqs_cis)
    modulation = _hunyuan_video15_modulation(block.norm1, temb)
    text_modulation = _hunyuan_video15_modulation(block.norm1_context, temb)
    out = torch.empty_like(hidden_states)
    keys, values, parked = _slice_projections(run, _hunyuan_video15_slice_projections, block, hidden_states, slices,
                                              out, video + text, lambda rows: (modulation, *rope(rows)))
    text_query, keys[:, video:], values[:, video:] = run(_hunyuan_video15_text_projections, block,
                                                         encoder_hidden_states, text_modulation)
    lead = _text_lead(video, text)
    video_mask, text_mask = _hunyuan_video15_masks(block, video, attention_mask, lead)
    text_query = _text_queries(block, text_query, lead, out, parked, hidden_states, modulation, rope)
    text_out = run(_hunyuan_video15_text_rest, block, encoder_hidden_states, text_query, keys, values, text_mask,
                   lead, text_modulation)
    del text_query
    for rows in slices:
        out[:, rows] = run(_hunyuan_video15_slice_rest, block, hidden_states[:, rows], out[:, rows] if parked else None,
                           keys, values, video_mask, modulation, *rope(rows))
    return out, text_out


def _hunyuan_video15_slices(video: int, chunks: int) -> list[slice]:
    """The video tokens' slices: the text's queries follow them in the same attention call (`token_slices`)."""
    return token_slices(video, chunks, followed=True)


def _hunyuan_video15_problem(block: nn.Module) -> str | None:
    from diffusers.models.attention import FeedForward
    from diffusers.models.normalization import AdaLayerNormZero
    from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15AttnProcessor2_0

    processor = diffusers_processor(block.attn.processor)
    if type(processor) is not HunyuanVideo15AttnProcessor2_0:  # the slices make its arithmetic themselves
        return f"its attn runs {type(processor).__name__}, not diffusers' HunyuanVideo15AttnProcessor2_0"
    for name in ("norm1", "norm1_context"):
        norm = getattr(block, name)
        if type(norm) is not AdaLayerNormZero or norm.emb is not None or type(norm.norm) is not nn.LayerNorm:
            return f"its {name} is not diffusers' AdaLayerNormZero over a LayerNorm, modulated by temb"
    for name in ("norm2", "norm2_context"):
        if type(getattr(block, name)) is not nn.LayerNorm:
            return f"its {name} is {type(getattr(block, name)).__name__}, not torch's LayerNorm"
    for name in ("ff", "ff_context"):
        if type(getattr(block, name)) is not FeedForward:
            return f"its {name} is {type(getattr(block, name)).__name__}, not diffusers' FeedForward"
    return None


# Block class name -> (family, chunked forward, what may stop it, the slices its forward cuts the block's
# `hidden_states` rows into: the receipt counts them). Classes are matched exactly: a subclass may compute
# differently, and chunking it would silently change the video.
_FORWARDS = {
    "WanTransformerBlock": ("wan", wan_block_forward, _wan_problem, token_slices),
    "CogVideoXBlock": ("cogvideox", cogvideox_block_forward, _cogvideox_problem, token_slices),
    "HunyuanVideo15TransformerBlock": ("hunyuan_video15", hunyuan_video15_block_forward, _hunyuan_video15_problem,
                                       _hunyuan_video15_slices),
}


def _known(block: nn.Module) -> tuple | None:
    entry = _FORWARDS.get(type(block).__name__)
    return entry if entry and type(block).__module__.startswith("diffusers.") else None


def chunk_problem(block: nn.Module) -> str | None:
    """Why `block` cannot be chunked (None: it can)."""
    entry = _known(block)
    if entry is None:
        return f"vidmem chunks diffusers' {', '.join(_FORWARDS)} only, not {type(block).__name__}"
    if _split_across_ranks(block):  # before _wrapped: diffusers' context-parallel hooks wrap block 0 too
        return "context parallelism splits the tokens across GPUs already"
    if _wrapped(block):
        return ("its forward is already wrapped (a step cache or compile applied first); activation chunks must be "
                "applied before them")
    return entry[2](block)


def _split_across_ranks(block: nn.Module) -> bool:
    """diffusers' context parallelism set its config on the block's attention processors (behind vidmem's
    key-masked wrapper, for HunyuanVideo 1.5's)."""
    return any(getattr(diffusers_processor(getattr(module, "processor", None)), "_parallel_config", None) is not None
               for module in (getattr(block, name, None) for name in ("attn1", "attn2", "attn")))


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

        def __init__(self, forward, slices, chunks: int, slices_ran: set[int]) -> None:
            super().__init__()
            self.chunked_forward = forward
            self.slices = slices  # the family's slicing rule, as its forward applies it (_FORWARDS)
            self.chunks = chunks
            self.slices_ran = slices_ran
            self.run: StepRunner = _eager  # AppliedChunks.steps_run_by sets compiled blocks' runner for a call

        def new_forward(self, module: nn.Module, *args, **kwargs):
            hidden_states = args[0] if args else kwargs["hidden_states"]
            self.slices_ran.add(len(self.slices(hidden_states.shape[1], self.chunks)))
            return self.chunked_forward(module, self.chunks, *args, run=self.run, **kwargs)

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

    hook, slices_ran, hooks = _hook_class(), set(), []
    applied: list[tuple[nn.Module, dict]] = []
    try:
        for _, _, block in listed:
            applied.append((block, as_found(block)))
            _, forward, _, slices = _known(block)
            hooks.append(hook(forward, slices, chunks, slices_ran))
            HookRegistry.check_if_exists_or_initialize(block).register_hook(hooks[-1], CHUNK_HOOK)
        _forget_child_registries(denoisers)
        families = sorted({_known(block)[0] for _, _, block in listed})
        yield AppliedChunks(chunks, len(listed), ",".join(families), slices_ran=slices_ran, hooks=tuple(hooks))
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


def _restore(block: nn.Module, before: dict) -> None:
    """Take the hook off and leave the block as found (pipelines/hook_attributes.py)."""
    registry = getattr(block, "_diffusers_hook", None)
    if registry is not None and registry.get_hook(CHUNK_HOOK) is not None:
        registry.remove_hook(CHUNK_HOOK, recurse=False)
    leave_as_found(block, before)


def refusal(blocks: Mapping[str, Sequence[nn.Module]]) -> str | None:
    """The first reason these blocks cannot be chunked (None: all can): what auto logs when it leaves chunking off."""
    for name, group in blocks.items():
        for index, block in enumerate(group):
            problem = chunk_problem(block)
            if problem:
                return f"{name} block {index}: {problem}"
    return None

