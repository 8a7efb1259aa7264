"""VAE decode that fits any budget: whole, sliced, or tiled in space and time; and a fallback ladder.

How it works: the output [B, 3, F, H, W] float32 is allocated once on `out_device` (the host by
default) and each decoded piece is blended straight into it, so the compute device only ever
holds the VAE, the latent and one piece's activations. Pieces overlap; their blend weights sum to
1 everywhere (see vae_tiles.py), so an exact per-pixel decoder gives the untiled result exactly,
and a real VAE differs only near tile borders, where the weights fade one tile into the next.

Trade-off: smaller tiles lower the peak and cost extra compute for the overlaps (and, for a
plain decode callable, one context latent frame per temporal chunk; a `Streaming` decoder carries
its caches instead and needs none); `auto_tiling` picks the cheapest tiling that fits a budget,
and `decode_with_fallback` walks down a ladder on out-of-memory errors, logging each rung.

    images = decode_video(lambda z: vae.decode(z).sample, latents, VaeGeometry(8, 4, 16), VaeTiling())

The caller must switch the VAE's own tiling off (`vae.disable_tiling()`): CogVideoX's diffusers
tiling can return a wrong size, and a decode that returns a wrong size is refused here.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

import torch

from .strategy import VaeTiling, family_tiling
from .cleanup import is_out_of_memory
from .vae_tiles import RGB, Span, TilePlan, VaeGeometry, auto_tiling, plan_tiles, tile_floor

__all__ = ["DecodeReport", "PinnedLanding", "Rung", "Streaming", "VaeGeometry", "auto_tiling", "decode_video", "decode_with_fallback",
           "fallback_rungs", "plan_tiles"]

logger = logging.getLogger(__name__)

Decode = Callable[[torch.Tensor], torch.Tensor]
Prepare = Callable[[torch.Tensor, torch.device], torch.Tensor]  # (latent, park) -> features on `park`


@dataclass(frozen=True)
class Streaming:
    """A decoder that carries its causal state from one frame chunk of a tile to the next.

    `start()` returns a fresh decode for one tile, which is then called with that tile's chunks
    in order (Wan's feature caches, CogVideoX's conv caches). Chunks need no context frames and
    no temporal blending: they compute what the whole decode computes, equal to it up to float
    rounding (an elementwise kernel can round an element differently when a call's size moves it
    between its vectorised body and its tail); `temporal_size` then only bounds the frames one call
    returns. Every chunk but the first holds a multiple of `frame_batch` latent frames, the batch
    the VAE itself steps through time with; the first also holds the VAE's whole first batch, so
    it can run up to one batch over `temporal_size`.
    """

    start: Callable[[], Decode]
    frame_batch: int = 1


@dataclass(frozen=True)
class PinnedLanding:
    """Page-locked memory for overlapped landings (`_Landing`): `pin(nbytes)` returns a pinned uint8 buffer (a
    backend's `pin_arena`), and the pair of piece buffers may pin at most `budget_bytes` (the strategy's pinned
    ceiling less what the call has pinned already; None: no ceiling). Over the budget, or where pinning fails,
    pieces land the blocking way."""

    pin: Callable[[int], torch.Tensor]
    budget_bytes: int | None = None


@dataclass
class DecodeReport:
    """What a decode did, for the node's receipt. Filled in by decode_video / decode_with_fallback."""

    mode: str = ""  # "whole" or "tiled"
    sliced: bool = False
    tiles: int = 0  # spatial tiles per frame
    chunks: int = 0  # temporal chunks
    decode_calls: int = 0
    seconds: float = 0.0
    tiling: VaeTiling | None = None
    device: str = ""  # where the latent was decoded
    shared_context: bool = False  # frame-wide layers ran once on the whole latent (see `prepare`)
    streamed: bool = False  # the VAE's caches carried over between a tile's chunks (see `Streaming`)
    fallbacks: list[str] = field(default_factory=list)  # one line per out-of-memory rung, in order

    def describe(self) -> str:
        text = f"{self.mode} decode on {self.device}"
        if self.tiling is not None:
            t = self.tiling
            frames = f"{t.temporal_size}" if self.streamed else f"{t.temporal_size}/{t.temporal_overlap}"
            pieces = f"{self.tiles} tile{'s' * (self.tiles != 1)} x {self.chunks} chunk{'s' * (self.chunks != 1)}"
            text += f": {pieces} (tile {t.tile_size}/{t.overlap} px, {frames} frames)"
        if self.shared_context and self.tiles > 1:
            text += ", frame-wide layers shared by the tiles"
        if self.streamed and self.chunks > 1:
            text += ", chunks streamed with the causal caches carried"  # equal to untiled up to float rounding
        calls = f"{self.decode_calls} call{'' if self.decode_calls == 1 else 's'}"
        text += f"{', sliced' if self.sliced else ''}, {calls}, {self.seconds:.1f} s"
        return text + "".join(f"\n  fallback: {line}" for line in self.fallbacks)

    def as_dict(self) -> dict:
        data = asdict(self)
        data["tiling"] = asdict(self.tiling) if self.tiling else None
        return data


def decode_video(
    decode: Decode | Streaming,
    latents: torch.Tensor,
    geometry: VaeGeometry,
    tiling: VaeTiling | None,
    slicing: bool = False,
    *,
    prepare: Prepare | None = None,
    out_device: torch.device | str = "cpu",
    report: DecodeReport | None = None,
    on_step: Callable[[int, int], None] | None = None,
    pinned: PinnedLanding | None = None,
    overlap_copies: bool | None = None,
) -> torch.Tensor:
    """Decode un-normalised latents [B, C, T, h, w] to pixels [B, 3, F, H, W] float32 on `out_device`.

    Args:
        decode: runs the VAE on a latent piece [b, C, t, h', w'] and returns [b, 3, frames, h'*s, w'*s]
            in [-1, 1], e.g. `lambda z: vae.decode(z).sample`. It may return more leading frames than
            the causal rule gives (CogVideoX on an even frame count); only the trailing ones are kept.
            A `Streaming` decoder gets each tile's chunks in order, back to back.
        geometry: the VAE's factors; F = 1 + temporal_factor * (T - 1), H = h * spatial_factor.
        tiling: None decodes the whole latent in one call; otherwise spatial tiles and temporal chunks
            (sizes in output pixels and frames) blended across their overlaps.
        slicing: decode one batch item at a time.
        prepare: the decoder's frame-wide layers (Wan's mid-block attention), run once per batch group
            on the whole latent as `prepare(latent, park)`; `decode` then gets pieces of its output
            instead of the latent's. The output must keep the latent's [b, C', T, h, w] grid and be
            on `park` (`out_device` when tiled, so that the compute device holds only the piece
            being decoded; `prepare` should move each frame there as it is made).
        on_step: called as on_step(done, total) after each piece (progress bars, interrupts).
        pinned: pinned memory for landing pieces on the host (`PinnedLanding`); without it pieces land the
            blocking way.
        overlap_copies: blend each piece on the host while the device decodes the next (`_Landing`); None
            (default) does so when `pinned` is given and a CUDA decode lands in host memory in more than one
            piece; True also without pinned memory (tests). The frames are the same either way.
    """
    geometry.check_latents(latents)
    streaming = isinstance(decode, Streaming)
    plan = plan_tiles(latents.shape, geometry, tiling, stream_batch=decode.frame_batch if streaming else None)
    batch = latents.shape[0]
    out = torch.zeros((batch, RGB, *plan.out_shape), dtype=torch.float32, device=out_device)
    groups = [(i, i + 1) for i in range(batch)] if slicing else [(0, batch)]
    blended = plan.chunks * plan.tiles > 1
    weights = _weights_on(plan, out.device) if blended else {}
    if streaming:  # tile after tile, each tile's chunks in time order
        pieces = [(frames, rows, cols) for rows, cols in itertools.product(plan.rows, plan.cols) for frames in plan.frames]
    else:
        pieces = list(itertools.product(plan.frames, plan.rows, plan.cols))
    total, done = len(groups) * len(pieces), 0
    if overlap_copies is None:
        overlap_copies = pinned is not None and latents.device.type == "cuda" and out.device.type == "cpu" and total > 1
    landing = _Landing(weights, overlap_copies, pinned, _largest_piece(plan, batch if not slicing else 1))
    started = time.perf_counter()
    try:
        with torch.no_grad():
            for b0, b1 in groups:
                source = _prepared(prepare, latents[b0:b1], out.device if len(pieces) > 1 else latents.device)
                for piece in pieces:
                    if streaming and piece[0] is plan.frames[0]:
                        tile_decode = decode.start()
                    # handed over at once: the device output must not outlive its piece (it would during the next
                    # piece's decode)
                    landing.put(_decode_piece(tile_decode if streaming else decode, source, piece, latents.device),
                                out[b0:b1], piece)
                    done += 1
                    if on_step is not None:
                        on_step(done, total)
                source = None  # the next group's frame-wide output is made without this one still held
            landing.flush()
    finally:
        landing.release()  # also when a piece ran out of memory or was interrupted: nothing stays pinned
    if report is not None:
        report.mode = "tiled" if blended else "whole"
        report.sliced, report.tiles, report.chunks = slicing and batch > 1, plan.tiles, plan.chunks  # one item: no slices
        report.decode_calls, report.tiling = total, tiling if blended else None
        report.shared_context, report.streamed = prepare is not None, streaming
        report.seconds = time.perf_counter() - started
        report.device = str(latents.device)
    return out


def _prepared(prepare: Prepare | None, latents: torch.Tensor, park: torch.device) -> torch.Tensor:
    """What the pieces are cut from: the latent itself, or the frame-wide layers' output parked on `park`."""
    if prepare is None:
        return latents
    features = prepare(latents, park)
    if not isinstance(features, torch.Tensor) or features.shape[:1] + features.shape[2:] != latents.shape[:1] + latents.shape[2:]:
        got = tuple(features.shape) if isinstance(features, torch.Tensor) else type(features).__name__
        raise ValueError(f"prepare must keep the latent's [b, C, T, h, w] grid: got {got} for {tuple(latents.shape)}.")
    return features.to(park)


def _decode_piece(decode: Decode, source: torch.Tensor, piece, device: torch.device) -> torch.Tensor:
    """Decode one (chunk, row, col) piece of `source` on `device`: the pixels it owns, still on `device`."""
    frames, rows, cols = piece
    cut = source[:, :, frames.start - frames.context : frames.stop, rows.start : rows.stop, cols.start : cols.stop]
    cut = cut.to(device)
    return _checked(decode(cut), cut, frames, rows, cols)


class _Landing:
    """Where decoded pieces land in `out`: blended (or copied, untiled) at once, or one piece behind.

    Why one behind: a CUDA piece copied to pageable host memory blocks the CPU until the GPU is idle, and the
    CPU's blend that follows leaves the GPU idle in turn, once per piece. With `overlap`, each piece is copied
    into one of two pinned buffers behind its decode on the same stream (non_blocking, an event recorded after
    it), and blended only after the next piece's decode has been queued, so the CPU blends while the GPU
    decodes. The blends run in the same order on the same values: the frames are identical. The pair is pinned
    once per decode, within `pinned.budget_bytes`, and unpinned when the decode ends (`release`); where it
    would not fit, or pinning fails, pieces land the blocking way.
    """

    def __init__(self, weights: dict, overlap: bool, pinned: PinnedLanding | None, largest: int) -> None:
        self.weights, self.overlap, self.pinned, self.largest = weights, overlap, pinned, largest
        self.pending: tuple | None = None
        self._pair: list[torch.Tensor] | None = None  # two byte buffers of the largest piece, used in turn
        self._turn = 0

    def put(self, pixels: torch.Tensor, out: torch.Tensor, piece) -> None:
        if not self.overlap or (self._pair is None and not self._make_pair(pixels.element_size())):
            _blend(pixels, out, piece, self.weights)
            return
        host = self._pair[self._turn][: pixels.numel() * pixels.element_size()].view(pixels.dtype).view(pixels.shape)
        self._turn ^= 1  # the other buffer's piece was blended when this one was handed over
        host.copy_(pixels, non_blocking=host.is_pinned())
        copied = torch.cuda.Event() if pixels.is_cuda else None
        if copied is not None:
            copied.record(torch.cuda.current_stream(pixels.device))
        previous, self.pending = self.pending, (host, copied, out, piece)
        if previous is not None:
            self._land(previous)

    def flush(self) -> None:
        if self.pending is not None:
            previous, self.pending = self.pending, None
            self._land(previous)

    def release(self) -> None:
        """Drop the pair and the pending piece, and unpin (torch's host allocator keeps freed pinned blocks cached
        for the process otherwise; the call releases only blocks no tensor holds)."""
        pinned = self._pair is not None and self._pair[0].is_pinned()
        self._pair = self.pending = None
        empty = getattr(torch._C, "_host_emptyCache", None)
        if pinned and empty is not None:
            empty()

    def _make_pair(self, itemsize: int) -> bool:
        nbytes = self.largest * itemsize
        if self.pinned is None:  # overlap asked for without pinned memory (tests, or a host that does not pin)
            whole = torch.empty(2 * nbytes, dtype=torch.uint8)
        elif self.pinned.budget_bytes is not None and 2 * nbytes > self.pinned.budget_bytes:
            logger.info("vidmem VAE decode: two pieces (%d MiB) exceed the pinned ceiling (%d MiB left); pieces land "
                        "the blocking way", 2 * nbytes >> 20, self.pinned.budget_bytes >> 20)
            self.overlap = False
            return False
        else:
            try:
                whole = self.pinned.pin(2 * nbytes)
            except RuntimeError as error:  # the driver's page-lock limit (WSL, Windows): not the device's memory
                logger.warning("vidmem VAE decode: could not pin %d MiB for the pieces (%s); they land the blocking way",
                               2 * nbytes >> 20, str(error).splitlines()[0] if str(error) else type(error).__name__)
                self.overlap = False
                return False
        self._pair = [whole[:nbytes], whole[nbytes:]]
        return True

    def _land(self, pending: tuple) -> None:
        host, copied, out, piece = pending
        if copied is not None:
            copied.synchronize()
        _blend(host, out, piece, self.weights)


def _largest_piece(plan: TilePlan, batch: int) -> int:
    """Elements of the largest decoded piece (what one landing buffer must hold)."""
    return max(batch * RGB * (f.out_stop - f.out_start) * (r.out_stop - r.out_start) * (c.out_stop - c.out_start)
               for f in plan.frames for r in plan.rows for c in plan.cols)


def _blend(pixels: torch.Tensor, out: torch.Tensor, piece, weights: dict) -> None:
    """Blend one decoded piece into `out` with its weights (copy it, untiled)."""
    frames, rows, cols = piece
    target = out[:, :, frames.out_start : frames.out_stop, rows.out_start : rows.out_stop,
                 cols.out_start : cols.out_stop]
    if weights:
        weight = weights[id(frames)][:, None, None] * weights[id(rows)][:, None] * weights[id(cols)]
        target.addcmul_(pixels.to(out.device), weight)
    else:
        target.copy_(pixels)


def _weights_on(plan: TilePlan, device: torch.device) -> dict[int, torch.Tensor]:
    return {id(span): span.weight.to(device) for span in (*plan.frames, *plan.rows, *plan.cols)}


def _checked(pixels: object, piece: torch.Tensor, frames: Span, rows: Span, cols: Span) -> torch.Tensor:
    """The decoded piece trimmed to the frames it owns; ValueError if its size is not the VAE's."""
    want_frames = frames.out_stop - frames.out_start
    want = (piece.shape[0], RGB, want_frames, rows.out_stop - rows.out_start, cols.out_stop - cols.out_start)
    if not isinstance(pixels, torch.Tensor) or pixels.ndim != 5:
        got = tuple(pixels.shape) if isinstance(pixels, torch.Tensor) else type(pixels).__name__
        raise ValueError(f"decode must return pixels [b, 3, frames, H, W]; got {got} for latent {tuple(piece.shape)}.")
    if pixels.shape[:2] != want[:2] or pixels.shape[3:] != want[3:] or pixels.shape[2] < want_frames:
        raise ValueError(
            f"decode returned {tuple(pixels.shape)} for latent {tuple(piece.shape)}; expected {want} "
            "(frames may be more). Check VaeGeometry, and switch the VAE's own tiling off "
            "(vae.disable_tiling()): diffusers' CogVideoX tiling returns wrong sizes at some tile sizes."
        )
    return pixels[:, :, pixels.shape[2] - want_frames :]


@dataclass(frozen=True)
class Rung:
    """One attempt of the fallback ladder."""

    tiling: VaeTiling | None
    slicing: bool
    on_cpu: bool
    label: str


def fallback_rungs(
    latent_shape: tuple[int, ...] | torch.Size,
    geometry: VaeGeometry,
    tiling: VaeTiling | None,
    slicing: bool = False,
    *,
    cpu_available: bool = True,
    stream_batch: int | None = None,
    min_tile: int = 0,
) -> list[Rung]:
    """The ladder: as asked; sliced; smaller tiles down to 64 px (or `min_tile`); shorter chunks
    down to 8 frames; CPU.

    `min_tile` is the family's smallest tile that decodes close to untiled
    (FamilySpec.min_decode_tile): the ladder does not halve below it, since shorter chunks and then
    the CPU give the same video where smaller tiles would give seams, and the CPU rung's default
    tile is raised to it as the decode raises the strategy's (strategy.family_tiling). A tile the
    user chose below it stays as chosen.
    A rung whose plan is the same as an earlier rung's is left out: it would fail the same way.
    `stream_batch` is the `Streaming` decoder's frame batch, whose chunks are planned differently.
    """
    frames, height, width = plan_tiles(latent_shape, geometry, None).out_shape
    whole_video = min(4096, max(8, -(-frames // 4) * 4))
    whole_frame = min(4096, max(64, -(-max(height, width) // 32) * 32))
    base = tiling or VaeTiling(tile_size=whole_frame, overlap=min(64, whole_frame // 4 // 8 * 8),
                               temporal_size=whole_video, temporal_overlap=min(8, whole_video // 2 // 4 * 4))
    rungs = [Rung(tiling, slicing, False, "as requested"), Rung(tiling, True, False, "one batch item at a time")]
    tile, floor = base.tile_size, tile_floor(min_tile)
    while tile > floor:
        tile = max(floor, tile // 2 // 32 * 32)
        smaller = replace(base, tile_size=tile, overlap=min(base.overlap, tile // 4 // 8 * 8))
        rungs.append(Rung(smaller, True, False, f"tile_size {tile}"))
    spatial = rungs[-1].tiling or base
    temporal = min(base.temporal_size, whole_video)
    while temporal > 8:
        temporal = max(8, temporal // 2 // 4 * 4)
        shorter = replace(spatial, temporal_size=temporal,
                          temporal_overlap=min(spatial.temporal_overlap, temporal // 2 // 4 * 4))
        rungs.append(Rung(shorter, True, False, f"temporal_size {temporal}"))
    if cpu_available:
        rungs.append(Rung(family_tiling(tiling or VaeTiling(), min_tile).tiling, True, True, "decode on the CPU"))
    return _distinct(rungs, latent_shape, geometry, stream_batch)


def _skip_predicted_overruns(rungs: list[Rung], predict, report: DecodeReport) -> list[Rung]:
    """The rungs from the first device rung predicted to fit (or the last device rung) onwards."""
    device_rungs = [rung for rung in rungs if not rung.on_cpu]
    if predict is None or not device_rungs:
        return rungs
    for rung in device_rungs[:-1]:
        try:
            overrun = predict(rung)
        except Exception as error:  # noqa: BLE001 - a failed prediction must not stop the decode
            logger.info("vidmem VAE decode: no memory prediction for %s (%s); trying it", rung.label, error)
            overrun = None
        if overrun is None:
            break
        line = f"{rung.label} skipped: predicted to run out of memory ({overrun})"
        logger.warning("vidmem VAE decode: %s", line)
        report.fallbacks.append(line)
    else:
        rung = device_rungs[-1]
    return rungs[rungs.index(rung):]


def _distinct(rungs: list[Rung], latent_shape, geometry: VaeGeometry, stream_batch: int | None) -> list[Rung]:
    seen, kept = set(), []
    for rung in rungs:
        plan = plan_tiles(latent_shape, geometry, rung.tiling, stream_batch)
        key = (rung.on_cpu, rung.slicing and latent_shape[0] > 1,
               *(tuple((s.start, s.stop) for s in axis) for axis in (plan.frames, plan.rows, plan.cols)))
        if key not in seen:
            seen.add(key)
            kept.append(rung)
    return kept


def decode_with_fallback(
    decode: Decode | Streaming,
    latents: torch.Tensor,
    geometry: VaeGeometry,
    tiling: VaeTiling | None,
    slicing: bool = False,
    *,
    free_memory: Callable[[], object],
    to_cpu: Callable[[], Decode | Streaming] | None = None,
    prepare: Prepare | None = None,
    predict: Callable[[Rung], str | None] | None = None,
    out_device: torch.device | str = "cpu",
    report: DecodeReport | None = None,
    on_step: Callable[[int, int], None] | None = None,
    pinned: PinnedLanding | None = None,
    min_tile: int = 0,
) -> torch.Tensor:
    """decode_video that answers torch.OutOfMemoryError by walking down `fallback_rungs` (whose
    tiles stay at or above the family's `min_tile`).

    `predict(rung)`, when given, returns why a device rung would run out of memory (a planner
    prediction against the free device memory) or None. Rungs predicted to overrun are skipped
    before anything runs, each logged like a failure; the last device rung is always tried, since
    a prediction can be pessimistic and the CPU is far slower.

    After each failure `free_memory()` runs (outside the except block, so the failed attempt's
    tensors are already released), the rung is logged as a warning and appended to
    `report.fallbacks`. The last rung calls `to_cpu()`, which must move the VAE to the CPU and
    return a decode running there (`prepare`, if given, must then run there too); without `to_cpu`
    the ladder stops before it. If every rung fails, torch.OutOfMemoryError is raised listing
    them; the latents are left untouched.
    """
    report = report if report is not None else DecodeReport()
    geometry.check_latents(latents)
    rungs = fallback_rungs(latents.shape, geometry, tiling, slicing, cpu_available=to_cpu is not None,
                           stream_batch=decode.frame_batch if isinstance(decode, Streaming) else None, min_tile=min_tile)
    rungs = _skip_predicted_overruns(rungs, predict, report)
    failures, started = [], time.perf_counter()
    for index, rung in enumerate(rungs):
        if rung.on_cpu:
            decode, latents = to_cpu(), latents.to("cpu")
        try:
            out = decode_video(decode, latents, geometry, rung.tiling, rung.slicing, prepare=prepare,
                               out_device=out_device, report=report, on_step=on_step, pinned=pinned)
            report.seconds = time.perf_counter() - started  # failed rungs included
            return out
        except RuntimeError as error:  # torch.OutOfMemoryError is one; so are cuBLAS/cuDNN allocation failures
            if not is_out_of_memory(error):
                raise
            reason = str(error).strip().splitlines()[0] if str(error).strip() else "out of memory"
        failures.append(f"{rung.label}: {reason}")
        free_memory()
        if index + 1 < len(rungs):
            line = f"{rung.label} ran out of memory ({reason}); retrying with {rungs[index + 1].label}"
            logger.warning("vidmem VAE decode: %s", line)
            report.fallbacks.append(line)
    raise torch.OutOfMemoryError(
        "VAE decode ran out of memory at every rung of the fallback ladder: " + "; ".join(failures)
        + ". The latents are intact: save them and decode with a smaller tile_size, or with more free memory."
    )
