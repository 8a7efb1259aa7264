"""HunyuanVideo 1.5's transformer attention without its dense [B, 1, S, S] mask.

diffusers' HunyuanVideo15AttnProcessor2_0 masks the text padding by turning the per-token mask
(video tokens and valid text tokens True) into a [B, 1, S, S] boolean that masks queries and keys
alike, in every block of every step. S is every video token plus 1985 text positions: 51,275 at
480p and 113,585 at 720p for 121 frames, so each copy is 2.4 GiB and 12 GiB, and two are live at
once (the repeated mask and the AND of it with its transpose): that, not the weights, is most of
the denoise peak at 720p (`vidmem plan --model hunyuanvideo1.5-t2v-720p`).

The padded text positions only ever serve as keys (they enter zeroed, and the transformer's
output keeps the video tokens), so masking the keys alone gives every valid token the same
attention, up to rounding, through a [B, 1, 1, S] mask that broadcasts. Padded rows then hold
finite values instead of zeros, which nothing reads.

Below `EXACT_MASK_BYTES` diffusers' own processor runs, so small runs stay bit-identical with it.
`key_masked_attention(transformer)` puts the wrapper on every block for one call (the sampler's
call adapter and the planner's workload both use it, so the planner predicts what runs).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

EXACT_MASK_BYTES = 64 << 20  # diffusers' mask up to this size per copy: bit-identical with diffusers


class KeyMaskedAttention:
    """A block's processor for one call: diffusers' own while its mask is small, keys-only masking above."""

    def __init__(self, exact, exact_mask_bytes: int | None = None) -> None:
        self.exact = exact
        self.exact_mask_bytes = EXACT_MASK_BYTES if exact_mask_bytes is None else exact_mask_bytes

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, image_rotary_emb: torch.Tensor | None = None):
        tokens = hidden_states.shape[1] + (encoder_hidden_states.shape[1] if encoder_hidden_states is not None else 0)
        if not self.masks_keys_only(hidden_states.shape[0], tokens, attention_mask):
            return self.exact(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        return self._keys_masked(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)

    def masks_keys_only(self, batch: int, tokens: int, attention_mask: torch.Tensor | None) -> bool:
        """Whether a call of `batch` x `tokens` (video and text) masks keys only, or runs diffusers' processor.
        Activation chunks ask too (pipelines/activation_chunks.py): their slices must mask as this call would."""
        return attention_mask is not None and batch * tokens * tokens > self.exact_mask_bytes

    def _keys_masked(self, attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb):
        """HunyuanVideo15AttnProcessor2_0.__call__ with its mask over keys only (same projections,
        norms, rotary embedding and output split, through the same attention dispatcher)."""
        from diffusers.models.attention_dispatch import dispatch_attention_fn
        from diffusers.models.embeddings import apply_rotary_emb

        heads = lambda x: x.unflatten(2, (attn.heads, -1))  # noqa: E731
        query, key, value = heads(attn.to_q(hidden_states)), heads(attn.to_k(hidden_states)), heads(attn.to_v(hidden_states))
        query, key = attn.norm_q(query), attn.norm_k(key)
        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
        if encoder_hidden_states is not None:
            text = [heads(attn.add_q_proj(encoder_hidden_states)), heads(attn.add_k_proj(encoder_hidden_states)),
                    heads(attn.add_v_proj(encoder_hidden_states))]
            if attn.norm_added_q is not None:
                text[0] = attn.norm_added_q(text[0])
            if attn.norm_added_k is not None:
                text[1] = attn.norm_added_k(text[1])
            query, key, value = (torch.cat([x, t], dim=1) for x, t in zip((query, key, value), text))
        batch, tokens = query.shape[:2]
        keys = F.pad(attention_mask, (tokens - attention_mask.shape[1], 0), value=True).bool().view(batch, 1, 1, tokens)
        out = dispatch_attention_fn(query, key, value, attn_mask=keys, dropout_p=0.0, is_causal=False,
                                    backend=self.exact._attention_backend, parallel_config=self.exact._parallel_config)
        out = out.flatten(2, 3).to(query.dtype)
        if encoder_hidden_states is None:
            return out, None  # as diffusers' processor: no output projection without text
        out, text_out = out[:, : -encoder_hidden_states.shape[1]], out[:, -encoder_hidden_states.shape[1] :]
        if getattr(attn, "to_out", None) is not None:
            out = attn.to_out[1](attn.to_out[0](out))
        if getattr(attn, "to_add_out", None) is not None:
            text_out = attn.to_add_out(text_out)
        return out, text_out


def masks_keys_only(processor, batch: int, tokens: int, attention_mask: torch.Tensor | None) -> bool:
    """What `processor` (a block's: this wrapper, or diffusers' own, which always masks queries and keys) does
    for such a call: mask keys only (True) or queries and keys alike."""
    return isinstance(processor, KeyMaskedAttention) and processor.masks_keys_only(batch, tokens, attention_mask)


def diffusers_processor(processor):
    """The diffusers processor behind `processor` (itself, or the one this wrapper runs below the size)."""
    return processor.exact if isinstance(processor, KeyMaskedAttention) else processor


@contextmanager
def key_masked_attention(transformer: torch.nn.Module, exact_mask_bytes: int | None = None) -> Iterator[None]:
    """Every block's attention wrapped in `KeyMaskedAttention` until the block exits; then each
    block has its own processor object back (never a copy)."""
    attentions = [block.attn for block in transformer.transformer_blocks]
    originals = [attention.processor for attention in attentions]
    try:
        for attention, original in zip(attentions, originals):
            attention.processor = KeyMaskedAttention(original, exact_mask_bytes)
        yield
    finally:
        for attention, original in zip(attentions, originals):
            attention.processor = original
