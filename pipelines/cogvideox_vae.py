"""CogVideoX's VAE decode as a stream, so that temporal chunks of a tile are exact.

`AutoencoderKLCogVideoX._decode` steps through time in batches of `num_latent_frames_batch_size`
(2) latent frames, the first batch taking the odd one out, and hands each batch the convolution
caches the previous one left. A chunk decoded on its own starts with empty caches and regroups
the batches, so its first frames differ from the whole decode's (mean error up to 0.03 on
[-1, 1] after a chunk boundary with random weights). `stream()` keeps a tile's caches from one
chunk to the next and batches every chunk as the whole decode would, so the tiled output's
frames equal the untiled ones wherever the spatial tiles are not blended.

There is no frame-wide stage to share, unlike Wan: the decoder normalises with GroupNorm per
frame batch over the whole tile, so spatial tiles keep a small difference everywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CogVideoXDecoderStream:
    vae: torch.nn.Module
    context = None  # no frame-wide layers to run once on the whole latent

    @property
    def frame_batch(self) -> int:
        return self.vae.num_latent_frames_batch_size

    def stream(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """A decode for consecutive frame chunks of one tile: the caches carry over between calls."""
        vae, caches = self.vae, [None]

        def pixels(z: torch.Tensor) -> torch.Tensor:
            out = []
            for start, stop in frame_batches(z.shape[2], self.frame_batch):
                x = z[:, :, start:stop]
                if vae.post_quant_conv is not None:
                    x = vae.post_quant_conv(x)
                x, caches[0] = vae.decoder(x, conv_cache=caches[0])
                out.append(x)
            return torch.cat(out, dim=2)

        return pixels


def frame_batches(frames: int, batch: int) -> Iterator[tuple[int, int]]:
    """diffusers' grouping: batches of `batch` latent frames, the first one taking the remainder."""
    remainder = frames % batch
    for i in range(max(frames // batch, 1)):
        yield batch * i + (0 if i == 0 else remainder), batch * (i + 1) + remainder


def cogvideox_stream(vae: torch.nn.Module) -> CogVideoXDecoderStream | None:
    """The streaming decoder for a diffusers AutoencoderKLCogVideoX, or None for a layout not known here."""
    known = (
        type(vae).__name__ == "AutoencoderKLCogVideoX"
        and hasattr(vae, "decoder")
        and hasattr(vae, "post_quant_conv")
        and isinstance(getattr(vae, "num_latent_frames_batch_size", None), int)
    )
    return CogVideoXDecoderStream(vae) if known else None
