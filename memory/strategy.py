"""MemoryStrategy: one frozen, validated description of where weights live during a run.

Every check raises `StrategyError` with a message that names the input and the fix, so the
node, the CLI and the engine all report bad input the same way. Checks that need the model
(does it have that many blocks?) live in `check_against_model`, called before any hook is set.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from numbers import Integral, Real


class StrategyError(ValueError):
    """A strategy input is invalid; the message says which input and what to set instead."""


class OffloadTier(str, Enum):
    NONE = "none"  # every component of the stage resident for the whole call
    MODEL = "model"  # whole components onloaded when used, evicted when another is used
    BLOCK_SWAP = "block_swap"  # the last N transformer blocks stream in per step
    SEQUENTIAL = "sequential"  # every leaf layer streams in when it runs


class TextEncoderPlacement(str, Enum):
    DEVICE = "device"  # on the compute device for the whole call (tier permitting)
    OFFLOAD_AFTER_ENCODING = "offload_after_encoding"  # onloaded to encode, evicted at once
    CPU = "cpu"  # encodes on the CPU; only the embeddings move


class ContextParallel(str, Enum):
    OFF = "off"  # one process; with two or more GPUs listed, whole components are placed on different GPUs
    ULYSSES = "ulysses"  # attention heads exchanged by all-to-all; any attention kernel
    RING = "ring"  # key/value blocks passed round a ring; GPU only (what splits with which mode: context_parallel.py)


@dataclass(frozen=True)
class Parallelism:
    """Which GPUs a run uses and how the work is split between them.

    `gpus` None means automatic: the host's one device when `context_parallel` is off, every
    visible GPU when it is on. `degree` 0 means one rank per GPU used; on a machine without
    GPUs a degree of N runs N CPU processes (gloo), which is how CI checks the parallel runtime.
    `cpu` True runs `degree` CPU processes even where GPUs are visible (the node's gpus=cpu:N).
    """

    gpus: tuple[int, ...] | None = None
    context_parallel: ContextParallel = ContextParallel.OFF
    degree: int = 0
    cpu: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "context_parallel", parse_enum(ContextParallel, self.context_parallel, "context_parallel"))
        _check_int("degree", self.degree)
        if self.degree < 0 or self.degree == 1:
            raise StrategyError(f"degree={self.degree} must be 0 (one rank per GPU) or 2 or more.")
        if self.gpus is not None:
            if not isinstance(self.gpus, tuple):
                raise StrategyError(f"gpus={self.gpus!r} must be a tuple of GPU indices or None (automatic).")
            for index in self.gpus:
                _check_int("gpus", index)
            if any(index < 0 for index in self.gpus) or len(set(self.gpus)) != len(self.gpus) or not self.gpus:
                raise StrategyError(f"gpus={self.gpus!r} must list distinct GPU indices (0, 1, ...), at least one.")
        if self.context_parallel is ContextParallel.OFF and self.degree:
            raise StrategyError(f"degree={self.degree} only applies with context_parallel on; set it to 0, "
                                "or choose context_parallel='ulysses'.")
        if not isinstance(self.cpu, bool):
            raise StrategyError(f"cpu={self.cpu!r} must be True (CPU processes) or False.")
        if self.cpu and (self.degree < 2 or self.gpus is not None or not self.context_parallel_on):
            raise StrategyError(f"cpu=True runs `degree` CPU processes (gpus=cpu:N): it needs context_parallel on, "
                                f"degree 2 or more and no gpus listed (got degree={self.degree}, gpus={self.gpus!r}).")
        if self.degree and self.gpus is not None and self.degree != len(self.gpus):
            raise StrategyError(f"degree={self.degree} but gpus lists {len(self.gpus)} GPUs; context parallelism runs "
                                "one rank per GPU: set degree to 0 or to the number of GPUs listed.")

    @property
    def context_parallel_on(self) -> bool:
        return self.context_parallel is not ContextParallel.OFF

    @property
    def balanced(self) -> bool:
        """Whole components on different GPUs: two or more GPUs listed and no context parallelism."""
        return not self.context_parallel_on and self.gpus is not None and len(self.gpus) >= 2

    def describe(self) -> str:
        gpus = f"cpu:{self.degree}" if self.cpu else "auto" if self.gpus is None else ",".join(map(str, self.gpus))
        if self.context_parallel_on:
            return f"{self.context_parallel.value} degree={self.degree or 'all'} gpus={gpus}"
        return f"balanced gpus={gpus}" if self.balanced else ""


# activation_chunks: how many token slices each denoiser block computes in (pipelines/activation_chunks.py).
CHUNKS_AUTO = "auto"  # the planner picks the fewest slices that fit the device budget
CHUNKS_OFF = 1  # every block computes all its tokens at once, as diffusers does
MAX_ACTIVATION_CHUNKS = 64  # 720p Wan 14B in 64 slices: 1,181 tokens each, past where slicing still lowers the peak


# Core VAEDecodeTiled ranges (comfy nodes.py), so shared values mean the same thing.
TILE_SIZE_RANGE = (64, 4096)
TEMPORAL_SIZE_RANGE = (8, 4096)


@dataclass(frozen=True)
class VaeTiling:
    """Spatial and temporal decode tiles, named and measured like core `VAEDecodeTiled`.

    `tile_size`/`overlap` are output pixels; `temporal_size`/`temporal_overlap` are output frames.
    """

    tile_size: int = 256
    overlap: int = 32  # 64 decodes ~1.45x the pixels at 256 px tiles; 32 keeps seams invisible (bench/vae_decode.py)
    temporal_size: int = 64
    temporal_overlap: int = 8

    def __post_init__(self) -> None:
        for name in ("tile_size", "overlap", "temporal_size", "temporal_overlap"):
            _check_int(name, getattr(self, name))
        _check_range("tile_size", self.tile_size, *TILE_SIZE_RANGE)
        _check_range("temporal_size", self.temporal_size, *TEMPORAL_SIZE_RANGE)
        _check_multiple("tile_size", self.tile_size, 32)
        _check_multiple("overlap", self.overlap, 8)
        _check_multiple("temporal_size", self.temporal_size, 4)
        _check_multiple("temporal_overlap", self.temporal_overlap, 4)
        if not 0 <= self.overlap <= self.tile_size // 4:
            raise StrategyError(
                f"overlap={self.overlap} must be between 0 and tile_size/4 = {self.tile_size // 4}; "
                "lower overlap or raise tile_size."
            )
        if not 0 <= self.temporal_overlap <= self.temporal_size // 2:
            raise StrategyError(
                f"temporal_overlap={self.temporal_overlap} must be between 0 and temporal_size/2 = "
                f"{self.temporal_size // 2}; lower temporal_overlap or raise temporal_size."
            )


@dataclass(frozen=True)
class FamilyTiling:
    """The tiling a decode runs for one model family, and why it is not the strategy's own."""

    tiling: VaeTiling | None
    note: str = ""  # why the tile was raised, or why the chosen tile is below the family's minimum
    warns: bool = False  # the note is a warning: a tile the user chose is below the family's minimum


def family_tiling(tiling: VaeTiling | None, min_tile: int, family: str = "this model") -> FamilyTiling:
    """`tiling` for a VAE whose tiles need at least `min_tile` output pixels to see enough of the
    frame (LTX-2's 32x VAE: a 256 px tile is 8 latent pixels, less than its decoder's receptive field).

    A spatial tile left at its defaults (`VaeTiling()`'s tile_size and overlap: nobody chose one) is
    raised to `min_tile`, its overlap scaled with it; the temporal tile is the user's either way, so
    changing only temporal_size neither keeps the small tile nor warns about it. A tile chosen below
    the minimum is honoured, with a warning. The Strategy node cannot tell a tile_size typed as 256
    from one left there: pick 224 or 288 to force small tiles. The decode and the planner both call
    this, so the planner plans the tile the decode runs."""
    if tiling is None or tiling.tile_size >= min_tile:
        return FamilyTiling(tiling)
    default = VaeTiling()
    if (tiling.tile_size, tiling.overlap) == (default.tile_size, default.overlap):
        overlap = min(tiling.overlap * min_tile // tiling.tile_size // 8 * 8, min_tile // 4)
        raised = VaeTiling(min_tile, overlap, tiling.temporal_size, tiling.temporal_overlap)
        return FamilyTiling(raised, f"default tile {tiling.tile_size}/{tiling.overlap} px raised to "
                                    f"{min_tile}/{overlap} px, {family}'s smallest tile that keeps decoding close "
                                    "to untiled")
    return FamilyTiling(tiling, f"warning: tile_size {tiling.tile_size} is below {min_tile} px, {family}'s smallest "
                                "tile that keeps decoding close to untiled; expect visible seams (raise tile_size)",
                        warns=True)


@dataclass(frozen=True)
class MemoryStrategy:
    """Where weights live during one Sampler or Decode call; removed again when the call ends."""

    offload: OffloadTier = OffloadTier.MODEL
    blocks_to_swap: int = 0
    prefetch_blocks: int = 1
    non_blocking: bool = True
    max_pinned_ram_gb: float | None = None  # None: half the free RAM, keeping 8 GiB unpinned
    text_encoder: TextEncoderPlacement = TextEncoderPlacement.OFFLOAD_AFTER_ENCODING
    vae_slicing: bool = False
    vae_tiling: VaeTiling | None = None
    parallel: Parallelism = field(default_factory=lambda: Parallelism())  # per GPU, every rank applies the fields above to its own copy
    # "auto", or the token slices each denoiser block computes in: 1 (off) .. MAX_ACTIVATION_CHUNKS;
    # "off" is accepted and stored as 1. Same video, lower activation peak (pipelines/activation_chunks.py).
    activation_chunks: int | str = CHUNKS_OFF

    def __post_init__(self) -> None:
        object.__setattr__(self, "activation_chunks", _parse_chunks(self.activation_chunks))
        if not isinstance(self.parallel, Parallelism):
            raise StrategyError(f"parallel={self.parallel!r} must be a Parallelism (gpus, context_parallel, degree).")
        object.__setattr__(self, "offload", parse_enum(OffloadTier, self.offload, "offload"))
        object.__setattr__(
            self, "text_encoder", parse_enum(TextEncoderPlacement, self.text_encoder, "text_encoder")
        )
        _check_int("blocks_to_swap", self.blocks_to_swap)
        _check_int("prefetch_blocks", self.prefetch_blocks)
        for name in ("non_blocking", "vae_slicing"):
            _check_bool(name, getattr(self, name))
        if self.max_pinned_ram_gb is not None:
            _check_finite("max_pinned_ram_gb", self.max_pinned_ram_gb, "leave it unset for the automatic ceiling")
        if self.vae_tiling is not None and not isinstance(self.vae_tiling, VaeTiling):
            raise StrategyError(f"vae_tiling={self.vae_tiling!r} must be a VaeTiling or None (no tiling).")
        if self.blocks_to_swap < 0:
            raise StrategyError(f"blocks_to_swap={self.blocks_to_swap} must be 0 or more.")
        if self.offload is OffloadTier.BLOCK_SWAP and self.blocks_to_swap == 0:
            raise StrategyError(
                "offload='block_swap' needs blocks_to_swap >= 1; set blocks_to_swap, "
                "or choose offload='none' to keep every block resident."
            )
        if self.offload is not OffloadTier.BLOCK_SWAP and self.blocks_to_swap:
            raise StrategyError(
                f"blocks_to_swap={self.blocks_to_swap} only applies to offload='block_swap' "
                f"(offload is '{self.offload.value}'); set blocks_to_swap to 0 or offload to 'block_swap'."
            )
        if self.prefetch_blocks < 0:
            raise StrategyError(f"prefetch_blocks={self.prefetch_blocks} must be 0 or more.")
        if self.max_pinned_ram_gb is not None and self.max_pinned_ram_gb < 0:
            raise StrategyError(
                f"max_pinned_ram_gb={self.max_pinned_ram_gb} must be 0 (no pinning) or more; "
                "leave it unset for the automatic ceiling."
            )

    @property
    def chunks_auto(self) -> bool:
        return self.activation_chunks == CHUNKS_AUTO

    @property
    def chunk_count(self) -> int:
        """The token slices per block this strategy computes in; 1 while `auto` is unresolved."""
        return CHUNKS_OFF if self.chunks_auto else self.activation_chunks

    @property
    def streams_blocks(self) -> bool:
        return self.offload in (OffloadTier.BLOCK_SWAP, OffloadTier.SEQUENTIAL)

    def check_against_model(self, block_count: int, component: str) -> None:
        """Checks that need the loaded model; call before applying anything."""
        if self.blocks_to_swap > block_count:
            raise StrategyError(
                f"blocks_to_swap={self.blocks_to_swap} but this model's {component} has {block_count} "
                f"blocks; use 1..{block_count} (or offload='sequential' to stream every layer)."
            )

    def describe(self) -> str:
        parts = [f"offload={self.offload.value}"]
        if self.offload is OffloadTier.BLOCK_SWAP:
            parts.append(f"blocks_to_swap={self.blocks_to_swap}")
        if self.streams_blocks:
            parts.append(f"prefetch={self.prefetch_blocks}")
        if self.max_pinned_ram_gb is not None:  # 0: weights stream from pageable homes (slower copies, same frames)
            parts.append(f"max_pinned_ram_gb={self.max_pinned_ram_gb:g}")
        if not self.non_blocking:
            parts.append("non_blocking=False")
        parts.append(f"text_encoder={self.text_encoder.value}")
        if self.vae_slicing:
            parts.append("vae_slicing")
        if self.vae_tiling:
            t = self.vae_tiling
            parts.append(f"vae_tiling={t.tile_size}/{t.overlap}px,{t.temporal_size}/{t.temporal_overlap}f")
        if self.activation_chunks != CHUNKS_OFF:
            parts.append(f"activation_chunks={self.activation_chunks}")
        if self.parallel.describe():
            parts.append(self.parallel.describe())
        return " ".join(parts)


def _parse_chunks(value: object) -> int | str:
    """"auto", "off" (stored as 1) or a whole number 1..MAX_ACTIVATION_CHUNKS (a numeric string from a widget too)."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text in (CHUNKS_AUTO, "off"):
            return CHUNKS_AUTO if text == CHUNKS_AUTO else CHUNKS_OFF
        if not text.isdigit():
            raise StrategyError(f"activation_chunks={value!r} must be 'auto', 'off' or a whole number of token slices "
                                f"from 2 to {MAX_ACTIVATION_CHUNKS}, e.g. 4.")
        value = int(text)
    _check_int("activation_chunks", value)
    if not CHUNKS_OFF <= value <= MAX_ACTIVATION_CHUNKS:
        raise StrategyError(f"activation_chunks={value} must be 'auto', 'off' (or 1) or 2..{MAX_ACTIVATION_CHUNKS}; "
                            f"more slices lower the denoise peak less and less: try 4 or 8.")
    return value


def parse_enum(enum_type: type[Enum], value: object, name: str) -> Enum:
    try:
        return enum_type(value)
    except ValueError:
        accepted = ", ".join(repr(m.value) for m in enum_type)
        raise StrategyError(f"{name}={value!r} is not one of {accepted}.") from None


def _check_int(name: str, value: object) -> None:
    """Whole numbers only: 2.5 blocks, True blocks or '4' blocks are typing mistakes, not values."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise StrategyError(f"{name}={value!r} must be a whole number (got {type(value).__name__}).")


def _check_bool(name: str, value: object) -> None:
    """True/False (or 1/0); a string such as "false" would otherwise count as true."""
    if not (isinstance(value, Integral) and value in (0, 1)):
        raise StrategyError(f"{name}={value!r} must be true or false (got {type(value).__name__}).")


def _check_finite(name: str, value: object, fix: str) -> None:
    """NaN and infinity pass every `<` check silently and then fail deep in the engine: refuse them here."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise StrategyError(f"{name}={value!r} must be a number (got {type(value).__name__}); {fix}.")
    if not math.isfinite(value):
        raise StrategyError(f"{name}={value} is not a finite number; give a number such as 4, or {fix}.")


def _check_range(name: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise StrategyError(f"{name}={value} must be between {low} and {high}.")


def _check_multiple(name: str, value: int, step: int) -> None:
    if value % step:
        lower, upper = value - value % step, value - value % step + step
        raise StrategyError(f"{name}={value} must be a multiple of {step}; use {lower} or {upper}.")
