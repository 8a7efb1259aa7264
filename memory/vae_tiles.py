"""Where to cut a video latent for decoding, and how to blend the pieces back: pure arithmetic.

A plan cuts each axis into overlapping spans of latent indices. Each span knows the output range
it produces and a blend weight over that range; on every axis the weights of all spans sum to 1 at
every output position, so the product over (frames, rows, cols) sums to 1 over the whole video.

Time is causal in both CogVideoX and Wan: latent frame 0 decodes to one output frame, each later
latent frame to `temporal_factor` frames. A chunk decoded on its own treats its first latent frame
as "frame 0", so every chunk but the first is decoded with one extra latent frame in front
(`context`) whose output is thrown away. Chunks hold an even number of new latent frames, so every
decode call sees an odd count: CogVideoX's VAE applies the first-frame rule only to odd counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .strategy import VaeTiling

RGB = 3
_AUTO_SAFETY = 0.75  # auto_tiling plans for this share of the free bytes it is given


@dataclass(frozen=True)
class VaeGeometry:
    """How a VAE maps latent positions to output pixels and frames."""

    spatial_factor: int  # 8 for CogVideoX and Wan 2.1; 16 for Wan 2.2 TI2V-5B
    temporal_factor: int  # 4 for both families
    latent_channels: int | None = None  # checked against the latent when given (16 or 48)

    def __post_init__(self) -> None:
        for name in ("spatial_factor", "temporal_factor"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"VaeGeometry.{name}={value!r} must be a positive int.")

    def frames(self, latent_frames: int) -> int:
        """Output frames of `latent_frames` decoded together (causal first-frame rule)."""
        return 1 + self.temporal_factor * (latent_frames - 1)

    def check_latents(self, latents: object) -> None:
        """Raise ValueError naming `latents` unless it is a [B, C, T, h, w] tensor this VAE decodes."""
        if not isinstance(latents, torch.Tensor):
            raise ValueError(f"latents must be a torch.Tensor [B, C, T, h, w], got {type(latents).__name__}.")
        if latents.ndim != 5:
            raise ValueError(
                f"latents must be 5-D [B, C, T, h, w] (a video latent), got shape {tuple(latents.shape)}; "
                "an image latent [B, C, h, w] needs a frame axis: latents.unsqueeze(2)."
            )
        if self.latent_channels is not None and latents.shape[1] != self.latent_channels:
            raise ValueError(
                f"latents has {latents.shape[1]} channels but this VAE takes {self.latent_channels}: "
                "the latent comes from another model family (CogVideoX and Wan 2.1: 16, Wan 2.2 5B: 48)."
            )
        if min(latents.shape) < 1:
            raise ValueError(f"latents has an empty axis: shape {tuple(latents.shape)}.")


@dataclass(frozen=True, eq=False)
class Span:
    """One piece of one axis: decode latents [start - context, stop), keep outputs [out_start, out_stop)."""

    start: int
    stop: int
    out_start: int
    out_stop: int
    weight: torch.Tensor  # float32 [out_stop - out_start]; sums to 1 across spans at every position
    context: int = 0  # leading latent frames decoded only as causal context, their output discarded


@dataclass(frozen=True, eq=False)
class TilePlan:
    frames: tuple[Span, ...]
    rows: tuple[Span, ...]
    cols: tuple[Span, ...]

    @property
    def out_shape(self) -> tuple[int, int, int]:
        return self.frames[-1].out_stop, self.rows[-1].out_stop, self.cols[-1].out_stop

    @property
    def tiles(self) -> int:
        return len(self.rows) * len(self.cols)

    @property
    def chunks(self) -> int:
        return len(self.frames)


def plan_tiles(latent_shape: tuple[int, ...] | torch.Size, geometry: VaeGeometry, tiling: VaeTiling | None,
               stream_batch: int | None = None) -> TilePlan:
    """The spans to decode for a [B, C, T, h, w] latent; `tiling=None` is one span per axis.

    `stream_batch` is for decoders that carry their causal state from one chunk of a tile to the
    next (see `Streaming`): chunks then follow each other without overlap or context frames, and
    every chunk but the first holds a multiple of `stream_batch` latent frames (the first takes
    the remainder), so they split into the frame batches the VAE uses on the whole video.
    """
    continuous = stream_batch is not None
    frame_bounds, row_bounds, col_bounds = _bounds(latent_shape, geometry, tiling, stream_batch)
    s, tf = geometry.spatial_factor, geometry.temporal_factor
    frame_out = [(0 if a == 0 else tf * (a - 1) + 1, tf * (b - 1) + 1) for a, b in frame_bounds]
    frames = tuple(
        Span(a, b, o0, o1, w, context=0 if a == 0 or continuous else 1)
        for (a, b), (o0, o1), w in zip(frame_bounds, frame_out, _blend_weights(frame_out))
    )
    return TilePlan(frames, _spatial_spans(row_bounds, s), _spatial_spans(col_bounds, s))


def auto_tiling(
    free_bytes: int, latent_shape: tuple[int, ...] | torch.Size, geometry: VaeGeometry, bytes_per_pixel_estimate: float,
    min_tile: int = 0, stream_batch: int | None = None,
) -> VaeTiling | None:
    """The cheapest tiling whose predicted peak fits `free_bytes`; None when the whole decode fits.

    Conservative rule: a decode call peaks at `bytes_per_pixel_estimate` times the output pixels it
    produces at once (height x width x frames, counting discarded context frames; `peak_call_pixels`), and only 75% of
    `free_bytes` is planned for. Among the tilings that fit, the one decoding the fewest redundant
    pixels (overlaps, context frames) wins; if none fits, the smallest tiling is returned and the
    fallback ladder has the last word. Tiles start at `min_tile` (the family's smallest tile that
    decodes close to untiled, FamilySpec.min_decode_tile; 64 px at least): below it only shorter
    chunks are searched, so the planner never advises a tile the family decodes with seams.
    `stream_batch`: the decoder carries its causal state across a tile's chunks (`plan_tiles`), so its
    chunks repeat no frames and one step (`stream_batch` latent frames) sets the activation peak, whatever
    the chunk's length: a streamed decode keeps its tiles as large as fit and its chunks whole (only a chunk's
    output grows with it, which the untiled trace's per-pixel figure already covers), where counting a
    context frame per chunk chose 64 px tiles over them. Below `min_tile` a streamed decode has nothing
    shorter to gain: the smallest tiling comes back.
    """
    budget = free_bytes * _AUTO_SAFETY
    frames, height, width = _out_size(latent_shape, geometry)
    if bytes_per_pixel_estimate * peak_call_pixels(latent_shape, geometry, None, stream_batch) <= budget:
        return None
    floor = tile_floor(min_tile)
    best: tuple[float, int, VaeTiling] | None = None
    smallest = _tiling(floor, 8)
    for tile in range(floor, max(floor, min(_round_up(max(height, width), 32), 4096)) + 1, 32):
        for temporal in _halvings(min(_round_up(frames, 4), 4096), 8, 4):
            tiling = _tiling(tile, temporal)
            peak, work = _plan_cost(latent_shape, geometry, tiling, stream_batch)
            if bytes_per_pixel_estimate * peak <= budget and (best is None or (work, -peak) < best[:2]):
                best = (work, -peak, tiling)
    return best[2] if best else smallest


def _tiling(tile_size: int, temporal_size: int) -> VaeTiling:
    """A tiling with overlaps that hide seams: 1/4 of the tile up to 64 px, 8 frames or half a chunk."""
    return VaeTiling(
        tile_size=tile_size,
        overlap=min(64, tile_size // 4 // 8 * 8),
        temporal_size=temporal_size,
        temporal_overlap=min(8, temporal_size // 2 // 4 * 4),
    )


def _plan_cost(latent_shape, geometry: VaeGeometry, tiling: VaeTiling,
               stream_batch: int | None = None) -> tuple[int, float]:
    """(largest decode call in output pixels x frames, decoded pixels / output pixels)."""
    frame_bounds, row_bounds, col_bounds = _bounds(latent_shape, geometry, tiling, stream_batch)
    s = geometry.spatial_factor
    if stream_batch is None:  # every chunk but the first decodes one context frame more (and discards it)
        call_frames = [geometry.frames(b - a + (a > 0)) for a, b in frame_bounds]
        peak_frames = max(call_frames)
    else:  # streamed: a chunk after the first gives temporal_factor frames per latent frame, nothing repeated,
        # and the decoder steps through it `stream_batch` latent frames at a time: a step sets the peak
        call_frames = [geometry.frames(b) if a == 0 else geometry.temporal_factor * (b - a) for a, b in frame_bounds]
        peak_frames = min(max(call_frames), geometry.temporal_factor * stream_batch)
    rows = [(b - a) * s for a, b in row_bounds]
    cols = [(b - a) * s for a, b in col_bounds]
    frames, height, width = _out_size(latent_shape, geometry)
    work = sum(call_frames) * sum(rows) * sum(cols) / (frames * height * width)
    return peak_frames * max(rows) * max(cols), work


def peak_call_pixels(latent_shape, geometry: VaeGeometry, tiling: VaeTiling | None,
                     stream_batch: int | None = None) -> int:
    """Output pixels x frames of the largest decode call (of a streamed decoder: the largest step)
    `tiling` makes; `auto_tiling`'s peaks are `bytes_per_pixel_estimate` times this."""
    return _plan_cost(latent_shape, geometry, tiling, stream_batch)[0]


def _bounds(latent_shape, geometry: VaeGeometry, tiling: VaeTiling | None, stream_batch: int | None = None):
    """Latent (start, stop) pairs along frames, rows and cols."""
    latent_frames, height, width = (int(n) for n in latent_shape[-3:])
    if tiling is None:
        return [(0, latent_frames)], [(0, height)], [(0, width)]
    s, tf = geometry.spatial_factor, geometry.temporal_factor
    tile = max(1, tiling.tile_size // s)
    overlap = min(math.ceil(tiling.overlap / s), tile - 1)
    if stream_batch is not None:
        frames = _stream_bounds(latent_frames, tiling.temporal_size // tf, stream_batch)
        return frames, _spatial_bounds(height, tile, overlap), _spatial_bounds(width, tile, overlap)
    new_frames = max(2, tiling.temporal_size // tf // 2 * 2)  # even: every decode call is odd-length
    frame_overlap = min(math.ceil(tiling.temporal_overlap / tf), new_frames - 1)
    size, ends = _even_split(latent_frames - 1, new_frames, frame_overlap, even=True)
    frames = [(0, 1 + ends[0])] + [(1 + e - size, 1 + e) for e in ends[1:]]
    return frames, _spatial_bounds(height, tile, overlap), _spatial_bounds(width, tile, overlap)


def _stream_bounds(length: int, cap: int, batch: int) -> list[tuple[int, int]]:
    """Back-to-back chunks of `step` frames (a multiple of `batch`, <= cap if possible), aligned to
    the end. The first chunk takes what is left over, and at least the VAE's own first batch
    (`batch` frames plus the remainder of `length`), so it may run a few frames over `cap`."""
    step = max(batch, cap // batch * batch)
    first_batch = min(length, batch + length % batch)
    first = length - (length - first_batch) // step * step
    return [(0, first)] + [(a, a + step) for a in range(first, length, step)]


def _spatial_bounds(length: int, tile: int, overlap: int) -> list[tuple[int, int]]:
    size, ends = _even_split(length, tile, overlap)
    return [(e - size, e) for e in ends]


def _even_split(length: int, cap: int, overlap: int, even: bool = False) -> tuple[int, list[int]]:
    """(size, ends): the fewest spans of equal size <= cap covering [0, length), sharing >= overlap.

    Spans are spread evenly, so no sliver tile is left at the end; `even` rounds the size up to
    an even number (cap must then be even).
    """
    if length <= cap:
        return length, [length]
    count = 1 + math.ceil((length - cap) / (cap - overlap))
    size = math.ceil((length + (count - 1) * overlap) / count)
    size += size % 2 if even else 0
    step = (length - size) / (count - 1)
    return size, [size + round(k * step) for k in range(count)]


def _spatial_spans(bounds: list[tuple[int, int]], factor: int) -> tuple[Span, ...]:
    out = [(a * factor, b * factor) for a, b in bounds]
    return tuple(Span(a, b, o0, o1, w) for (a, b), (o0, o1), w in zip(bounds, out, _blend_weights(out)))


def _blend_weights(out_bounds: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Raised-cosine ramps across each overlap, normalised so all spans sum to 1 at every position."""
    raw = []
    for k, (start, stop) in enumerate(out_bounds):
        weight = torch.ones(stop - start, dtype=torch.float64)
        if k > 0:  # fade in across the overlap with the previous span
            n = min(out_bounds[k - 1][1], stop) - start
            weight[:n] *= _ramp(n)
        if k + 1 < len(out_bounds):  # fade out across the overlap with the next span
            n = stop - max(out_bounds[k + 1][0], start)
            weight[stop - start - n:] *= _ramp(n).flip(0)
        raw.append(weight)
    total = torch.zeros(out_bounds[-1][1], dtype=torch.float64)
    for (start, stop), weight in zip(out_bounds, raw):
        total[start:stop] += weight
    return [(w / total[a:b]).float() for (a, b), w in zip(out_bounds, raw)]


def _ramp(n: int) -> torch.Tensor:
    """sin^2 rising from ~0 to ~1 over n samples; ramp + flipped ramp == 1."""
    return torch.sin(torch.pi / 2 * (torch.arange(n, dtype=torch.float64) + 0.5) / n) ** 2


def _out_size(latent_shape, geometry: VaeGeometry) -> tuple[int, int, int]:
    latent_frames, height, width = (int(n) for n in latent_shape[-3:])
    s = geometry.spatial_factor
    return geometry.frames(latent_frames), height * s, width * s


def _halvings(start: int, low: int, multiple: int) -> list[int]:
    """start, start/2, ... down to low, each rounded down to `multiple`, no repeats."""
    sizes, size = [], max(start, low)
    while size >= low:
        sizes.append(size)
        size = size // 2 // multiple * multiple
    return sizes


def tile_floor(min_tile: int = 0) -> int:
    """The smallest tile (px) the planner and the fallback ladder use: the family's `min_tile`
    rounded up to a multiple of 32, and 64 px at least."""
    return max(64, _round_up(min_tile, 32))


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
