"""HunyuanVideo 1.5's VAE decoder in two stages, streamed in time (the shape of pipelines/wan_vae.py).

The decoder is local everywhere but in its mid-block: causal 3x3x3 convolutions, per-pixel RMS
norms and pixel-shuffle upsampling, around one attention that mixes every position of a latent
frame and of every earlier frame. Decoded whole per tile, each tile gets its own attention (and
each temporal chunk forgets the frames before it): with the tiny test model's random weights the
mean error is about 0.03 on 0..1 pixels. diffusers also builds that attention's causal mask as a
dense (T*h*w)^2 tensor: 4.9 GB in bf16 at 480p and 25 GB at 720p for 121 frames, the decode peak
users report for this model (ComfyUI #10855).

So the decode runs in two stages:
- `context` runs `conv_in` and the mid-block once over the whole latent (at 1/256 of the output
  pixels). Its attention is diffusers' own while the mask is small (`EXACT_MASK_BYTES`), so small
  decodes equal `vae.decode` bit for bit; above that it runs one latent frame of queries at a time
  against that frame and the earlier ones (exactly what the mask allows), never building the
  mask: equal up to float rounding, and its peak is one frame's scores.
- `stream()` runs the up-blocks and the head on a tile's chunks in time order, carrying each
  causal convolution's last two input frames from chunk to chunk and upsampling the video's first
  frame the way diffusers does only in the first chunk, so temporal chunks compute what the whole
  decode computes. They equal it up to float rounding, not always bit for bit: the CPU's SiLU
  rounds differently in its vectorised body and its scalar tail, and which elements fall in the
  tail depends on the size of the tensor a call sees. Where a frame's elements fill whole vector
  lanes (the tests' even sizes) chunks equal the whole decode exactly; at odd sizes (5x7x9 on the
  tiny model; 9x2x3 too) they differ by at most about 1e-6 on 0..1 pixels in fp32 (9.1e-7; 1.1e-6) (tests/test_hunyuan_video15.py).
Tiled, the result differs from untiled only within a convolution's reach of a tile border, where
the blend fades one tile into the next.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Above this, the mid-block's dense causal mask is not built: frame-by-frame attention instead.
EXACT_MASK_BYTES = 64 << 20
_DECODER_PARTS = ("conv_in", "mid_block", "up_blocks", "norm_out", "conv_act", "conv_out", "repeat")


@dataclass(frozen=True)
class HunyuanVideo15DecoderStages:
    vae: torch.nn.Module
    exact_mask_bytes: int = EXACT_MASK_BYTES
    frame_batch = 1  # chunks may start at any latent frame: the caches carry the rest

    def context(self, z: torch.Tensor, park: torch.device | str | None = None) -> torch.Tensor:
        """[B, C, T, h, w] latent (already divided by the scaling factor) -> mid-block features on `park`."""
        decoder = self.vae.decoder
        x = decoder.conv_in(z) + z.repeat_interleave(repeats=decoder.repeat, dim=1)
        mid = decoder.mid_block
        x = mid.resnets[0](x)
        for attention, resnet in zip(mid.attentions, mid.resnets[1:]):
            if attention is not None:
                x = self._attend(attention, x)
            x = resnet(x)
        return x.to(park or z.device)

    def stream(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The decode after the mid-block, for consecutive frame chunks of one tile.

        A chunk steps through its latent frames one at a time (as Wan's decoder does), the caches
        carrying the rest: its peak is one latent frame's activations at full resolution, whatever
        the chunk's length, where the chunk whole held all of them (6.8 GiB for a 256 px tile's
        64-frame chunk at 720p, docs/decode.md). `temporal_size` then bounds only the frames one call returns."""
        decoder, caches = self.vae.decoder, _CausalCaches()

        def pixels(features: torch.Tensor) -> torch.Tensor:
            return torch.cat([frame_pixels(features[:, :, i : i + 1]) for i in range(features.shape[2])], dim=2)

        def frame_pixels(features: torch.Tensor) -> torch.Tensor:
            x = features
            for block in decoder.up_blocks:
                for resnet in block.resnets:
                    x = caches.resnet(resnet, x)
                if block.upsamplers is not None:
                    x = caches.upsample(block.upsamplers[0], x)
            x = decoder.conv_act(decoder.norm_out(x))
            x = caches.conv(decoder.conv_out, x)
            caches.first_chunk = False
            return x

        return pixels

    def _attend(self, attention: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The mid-block's attention: diffusers' own while its mask is small (bit for bit its decode), one batch
        item at a time (its [B, N, N] mask meets [B, 1, N, N] scores as if B were the heads: a batch of two fails
        in diffusers' decode); frame by frame above."""
        positions = x.shape[2] * x.shape[3] * x.shape[4]
        if positions * positions * x.element_size() > self.exact_mask_bytes:  # one mask, expanded over the batch
            return frame_causal_attention(attention, x)
        return attention(x) if x.shape[0] == 1 else torch.cat([attention(item) for item in x.split(1)])


def frame_causal_attention(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """HunyuanVideo15AttnBlock's forward without its mask: each latent frame's positions attend to
    that frame's and every earlier frame's, one frame of queries at a time."""
    identity = x
    x = block.norm(x)
    batch, channels, frames, height, width = x.shape
    flat = lambda y: y.reshape(batch, channels, -1).permute(0, 2, 1).unsqueeze(1)  # noqa: E731  [B, 1, N, C]
    query, key, value = flat(block.to_q(x)), flat(block.to_k(x)), flat(block.to_v(x))
    step = height * width
    out = torch.cat([F.scaled_dot_product_attention(query[:, :, i * step : (i + 1) * step], key[:, :, : (i + 1) * step],
                                                    value[:, :, : (i + 1) * step]) for i in range(frames)], dim=2)
    out = out.squeeze(1).reshape(batch, frames, height, width, channels).permute(0, 4, 1, 2, 3)
    return block.proj_out(out) + identity


class _CausalCaches:
    """Each causal convolution's last input frames (after its time padding), carried to the next chunk."""

    def __init__(self) -> None:
        self.tails: dict[torch.nn.Module, torch.Tensor] = {}
        self.first_chunk = True

    def conv(self, conv: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """HunyuanVideo15CausalConv3d on a chunk: the video's first chunk as diffusers runs it
        (time padded by repeating its first frame), later ones after the frames cached before them."""
        context = conv.time_causal_padding[4]  # kernel frames - 1
        if self.first_chunk:
            out = conv(x)
            before = x[:, :, :1].expand(-1, -1, max(0, context - x.shape[2]), -1, -1)  # the repeated first frame
        else:
            before = self.tails[conv]
            out = conv.conv(F.pad(torch.cat([before, x], dim=2), conv.time_causal_padding[:4] + (0, 0), mode=conv.pad_mode))
        self.tails[conv] = torch.cat([before, x[:, :, -context:]], dim=2)[:, :, -context:].clone()
        return out

    def resnet(self, block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """HunyuanVideo15ResnetBlock.forward, its convolutions cached."""
        h = self.conv(block.conv1, block.nonlinearity(block.norm1(x)))
        h = self.conv(block.conv2, block.nonlinearity(block.norm2(h)))
        return h + (block.conv_shortcut(x) if block.conv_shortcut is not None else x)

    def upsample(self, up: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """HunyuanVideo15Upsample.forward: only the video's first frame is upsampled in space alone."""
        h, shuffle = self.conv(up.conv, x), up._dcae_upsample_rearrange
        if not up.add_temporal_upsample:
            return shuffle(h, r1=1, r2=2, r3=2) + shuffle(x.repeat_interleave(repeats=up.repeats, dim=1), r1=1, r2=2, r3=2)
        if not self.first_chunk:
            return shuffle(h, r1=2, r2=2, r3=2) + shuffle(x, r1=2, r2=2, r3=2).repeat_interleave(repeats=up.repeats, dim=1)
        h_first = shuffle(h[:, :, :1], r1=1, r2=2, r3=2)
        h = torch.cat([h_first[:, : h_first.shape[1] // 2], shuffle(h[:, :, 1:], r1=2, r2=2, r3=2)], dim=2)
        x_first = shuffle(x[:, :, :1], r1=1, r2=2, r3=2).repeat_interleave(repeats=up.repeats // 2, dim=1)
        x_next = shuffle(x[:, :, 1:], r1=2, r2=2, r3=2).repeat_interleave(repeats=up.repeats, dim=1)
        return h + torch.cat([x_first, x_next], dim=2)


def hunyuan_video15_stages(vae: torch.nn.Module) -> HunyuanVideo15DecoderStages | None:
    """The staged decoder for a diffusers AutoencoderKLHunyuanVideo15, or None for a layout not known here."""
    decoder = getattr(vae, "decoder", None)
    known = type(vae).__name__ == "AutoencoderKLHunyuanVideo15" and all(hasattr(decoder, p) for p in _DECODER_PARTS)
    return HunyuanVideo15DecoderStages(vae) if known else None
