"""Prompt embeddings for one run: counted (so a cut prompt is reported), looked up in the
prompt cache, and encoded only when missing.

Each text is encoded on its own with the family's `encode_prompt` (no guidance), which runs the
same `_get_t5_prompt_embeds` the pipeline runs for the prompt and for the negative prompt, so
cached and fresh embeddings are the same bits as diffusers' own. A family whose pipeline encodes
otherwise (HunyuanVideo 1.5: two encoders and masks) brings `vidmem_encode_prompt` through its
call adapter (`FamilySpec.call_adapter`), which returns one packed tensor.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from .prompt_cache import EncoderIdentityError, PromptCache, encoder_identity, prompt_key

log = logging.getLogger("vidmem")


@dataclass(frozen=True)
class PromptText:
    """One text the run encodes: the prompt, or the negative prompt when cfg > 1."""

    role: str  # "prompt" or "negative_prompt"
    text: str
    token_ids: tuple[int, ...]  # as typed, special tokens included, before truncation
    max_sequence_length: int

    @property
    def cut_tokens(self) -> int:
        return max(0, len(self.token_ids) - self.max_sequence_length)

    def as_dict(self) -> dict:
        kept = min(len(self.token_ids), self.max_sequence_length)
        return {"tokens": len(self.token_ids), "kept": kept, "cut": self.cut_tokens,
                "max_sequence_length": self.max_sequence_length}


@dataclass
class PromptEmbeddings:
    """What the cache had and what is left to encode; `embeds` maps role -> [1, L, D] tensor."""

    texts: list[PromptText]
    embeds: dict[str, torch.Tensor] = field(default_factory=dict)
    keys: dict[str, str] = field(default_factory=dict)
    cache: PromptCache | None = None
    cache_note: str = "off"  # why the cache was not consulted, when it was not
    unstored: int = 0  # encoded texts the cache folder refused

    @property
    def missing(self) -> list[PromptText]:
        return [t for t in self.texts if t.role not in self.embeds]

    @property
    def complete(self) -> bool:
        return not self.missing


def prompt_texts(pipe, max_sequence_length: int, prompt: str, negative_prompt: str, guided: bool) -> list[PromptText]:
    """The texts this run encodes, with their token counts (the tokenizer only, no encoder)."""
    roles = [("prompt", prompt)] + ([("negative_prompt", negative_prompt or "")] if guided else [])
    texts = []
    for role, text in roles:
        ids = pipe.tokenizer(text, add_special_tokens=True, truncation=False, verbose=False)["input_ids"]
        texts.append(PromptText(role, text, tuple(int(i) for i in ids), max_sequence_length))
        if texts[-1].cut_tokens:
            log.warning("vidmem: the %s has %d tokens; the text encoder reads %d, so the last %d are cut",
                        role.replace("_", " "), len(ids), max_sequence_length, texts[-1].cut_tokens)
    return texts


def look_up(pipe, texts: list[PromptText], cache: PromptCache | None) -> PromptEmbeddings:
    """Cached embeddings for `texts`, before any weight moves (the encoder's identity is read
    from its weights where they rest)."""
    found = PromptEmbeddings(texts)
    if cache is None:
        return found
    try:
        # Every prompt encoder the embedding depends on (HunyuanVideo 1.5's ByT5 too): either changed misses.
        encoders = [pipe.text_encoder] + [e for e in [getattr(pipe, "text_encoder_2", None)] if e is not None]
        identity = "+".join(encoder_identity(encoder) for encoder in encoders)
    except (EncoderIdentityError, RuntimeError) as error:
        found.cache_note = f"unavailable: {error}"
        return found
    found.cache = cache
    for text in texts:
        key = prompt_key(identity, pipe.text_encoder.dtype, text.max_sequence_length, text.text, list(text.token_ids))
        found.keys[text.role] = key
        cached = cache.load(key)
        if cached is not None:
            found.embeds[text.role] = cached
    return found


@torch.no_grad()  # as the pipeline's own __call__: no autograd graph, same kernels
def encode_missing(pipe, found: PromptEmbeddings, device: torch.device) -> None:
    """Encode every text the cache did not have on `device`, and store it in the cache."""
    family_encode = getattr(pipe, "vidmem_encode_prompt", None)
    for text in found.missing:
        if family_encode is not None:
            embeds = family_encode(text.text, device)
        else:
            embeds, _ = pipe.encode_prompt(
                prompt=text.text,
                do_classifier_free_guidance=False,
                num_videos_per_prompt=1,
                max_sequence_length=text.max_sequence_length,
                device=device,
            )
        found.embeds[text.role] = embeds
        if found.cache is not None:
            stored = found.cache.store(found.keys[text.role], embeds, {"role": text.role, "tokens": len(text.token_ids)})
            found.unstored += not stored


def call_embeds(found: PromptEmbeddings, device: torch.device) -> dict:
    """The pipeline's `prompt_embeds` / `negative_prompt_embeds`, on the compute device."""
    move = lambda role: found.embeds[role].to(device) if role in found.embeds else None  # noqa: E731
    return {"prompt_embeds": move("prompt"), "negative_prompt_embeds": move("negative_prompt")}


def prompt_receipt(found: PromptEmbeddings, hits: int) -> dict:
    """For the receipt: token counts (and how many were cut) per text, and what the cache did."""
    if found.cache is None:
        cache = found.cache_note
    elif hits == len(found.texts):
        cache = "used"  # the text encoder did not run and was not loaded
    else:
        stored = "not stored (the cache folder cannot be written)" if found.unstored else "stored"
        used = f"used for {hits} of {len(found.texts)} texts; the rest encoded, " if hits else "encoded, "
        cache = used + stored
    receipt = {"cache": cache, **{t.role: t.as_dict() for t in found.texts}}
    if found.cache is not None:
        receipt["cache_folder"] = str(found.cache.folder)
    return receipt
