"""Wan's VAE decoder in two stages, so that every tile sees the frame-wide attention.

Wan's decoder is local almost everywhere: causal 3x3x3 convolutions and per-pixel RMS norms. The
one exception is the attention in its mid-block, which mixes every position of a frame. A tile
decoded by the whole decoder gets its own attention, so its colours drift from its neighbours'
(mean error 0.05 on [-1, 1] at 400x600 in bench/vae_decode.py, visible as tile outlines).

So the decode runs in two stages:
- `context` runs `post_quant_conv`, `conv_in` and the mid-block once over the whole latent. This
  stage works at latent resolution (1/64 of the output pixels, 1/256 for Wan 2.2 TI2V) and is
  a few percent of the compute. Each frame's features move to the host as they are made.
- `pixels` runs the up-blocks and the output head on one tile of the context stage's output,
  which keeps the latent's [B, C, T, h, w] grid.

The tiled result then differs from the untiled one only within a convolution's reach of a tile
border, where the blend fades one tile into the next. Untiled, the two stages equal
`vae.decode(z).sample` bit for bit (tests/test_vae_stages.py).

Each stage keeps its own causal feature caches, one per convolution, and streams frames exactly
as `AutoencoderKLWan._decode` does. `stream()` keeps a tile's caches from one frame chunk to the
next, so temporal chunks of a Wan decode are exact too (no context frames, no blending). Decoder layouts this module does not recognise get None from
`wan_stages`, so they are decoded with the whole decoder per tile.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

# AutoencoderKLWan keeps the last 2 frames of each convolution's input for the next frame.
_CACHE_FRAMES = 2
_DECODER_PARTS = ("conv_in", "mid_block", "up_blocks", "norm_out", "nonlinearity", "conv_out")


@dataclass(frozen=True)
class WanDecoderStages:
    vae: torch.nn.Module
    frame_batch = 1  # the decoder steps through time one latent frame at a time

    def context(self, z: torch.Tensor, park: torch.device | str | None = None) -> torch.Tensor:
        """[B, z_dim, T, h, w] latent (un-normalised) -> mid-block features [B, C, T, h, w] on `park`
        (default: z's device); each frame moves there as soon as it is made, into the one output (no
        second copy of it at the end)."""
        out = None
        for i, frame in enumerate(self.context_frames(z)):
            if out is None:
                out = frame.new_empty((*frame.shape[:2], z.shape[2], *frame.shape[3:]), device=park or z.device)
            out[:, :, i : i + 1] = frame
        return out

    def context_frames(self, z: torch.Tensor) -> Iterator[torch.Tensor]:
        """The mid-block features of each latent frame in turn, on z's device: what `context` parks. Declared so
        that the planner traces a parked context as it runs, one frame of it on the device at a time."""
        decoder, caches = self.vae.decoder, _Caches()
        x = self.vae.post_quant_conv(z)
        for i in range(x.shape[2]):
            index = [0]
            frame = caches.conv(decoder.conv_in, x[:, :, i : i + 1], index)
            yield decoder.mid_block(frame, feat_cache=caches.slots, feat_idx=index)

    def pixels(self, features: torch.Tensor) -> torch.Tensor:
        """Mid-block features of a tile -> pixels [B, 3, F, H, W] in [-1, 1], as `decode().sample`."""
        return self.stream()(features)

    def stream(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """`pixels` for consecutive frame chunks of one tile: the caches carry over between calls."""
        decoder, caches, seen = self.vae.decoder, _Caches(), [0]

        def pixels(features: torch.Tensor) -> torch.Tensor:
            frames = []
            for i in range(features.shape[2]):
                index, x = [0], features[:, :, i : i + 1]
                for block in decoder.up_blocks:
                    x = block(x, feat_cache=caches.slots, feat_idx=index, first_chunk=seen[0] == 0)
                x = decoder.nonlinearity(decoder.norm_out(x))
                frames.append(caches.conv(decoder.conv_out, x, index))
                seen[0] += 1
            return self._finish(torch.cat(frames, dim=2))

        return pixels

    def _finish(self, out: torch.Tensor) -> torch.Tensor:
        if self.vae.config.patch_size is not None:
            from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

            out = unpatchify(out, patch_size=self.vae.config.patch_size)
        return out.clamp(-1.0, 1.0)


class _Caches:
    """The causal convolutions' per-frame feature caches, indexed in call order like diffusers'."""

    def __init__(self) -> None:
        self.slots: list[torch.Tensor | None] = _GrowingList()

    def conv(self, conv: torch.nn.Module, x: torch.Tensor, index: list[int]) -> torch.Tensor:
        """Run one causal convolution on a frame with its cache, then cache the frame's tail."""
        slot = index[0]
        tail = x[:, :, -_CACHE_FRAMES:].clone()
        previous = self.slots[slot]
        if tail.shape[2] < _CACHE_FRAMES and previous is not None:
            tail = torch.cat([previous[:, :, -1:].to(tail.device), tail], dim=2)
        out = conv(x, previous)
        self.slots[slot] = tail
        index[0] += 1
        return out


class _GrowingList(list):
    """A cache list that is long enough for any decoder: unknown slots read as None."""

    def __getitem__(self, slot):
        return super().__getitem__(slot) if isinstance(slot, slice) or slot < len(self) else None

    def __setitem__(self, slot, value) -> None:
        if isinstance(slot, int) and slot >= len(self):
            self.extend([None] * (slot + 1 - len(self)))
        super().__setitem__(slot, value)


def wan_stages(vae: torch.nn.Module) -> WanDecoderStages | None:
    """The two-stage decoder for a diffusers AutoencoderKLWan, or None for a layout not known here."""
    decoder = getattr(vae, "decoder", None)
    known = (
        type(vae).__name__ == "AutoencoderKLWan"
        and hasattr(vae, "post_quant_conv")
        and all(hasattr(decoder, part) for part in _DECODER_PARTS)
    )
    return WanDecoderStages(vae) if known else None
