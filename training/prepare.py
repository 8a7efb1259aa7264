"""Prepare Training Data: captions -> prompt embeddings, clips -> latents, cached on disk for training.

What is cached: one safetensors file per (clip content, caption, bucket, encoders, dtype, VAE
tiling) holding the latent in the LATENT form the sampler returns ([C, T, h, w]: Wan normalised
by the VAE's mean/std, CogVideoX scaled by its scaling factor) and the prompt embedding [L, D];
the file name is the SHA-256 of those inputs, so a re-run finds it whatever the clip's name, and
an edited clip, caption or bucket gets a new entry. An entry counts as cached only if its header
reads and names both tensors: one cut short (a crash, a full disk) is encoded again. Planning
reads only the media's headers (data.probe_clip); the clips to encode are decoded once before any
model work, so a broken one is named before the encoders load. `manifest.json` lists the entries
of one preparation. The latent is the VAE posterior's mean (Wan's own encoder returns only that;
for CogVideoX it keeps the cache deterministic). Encoding uses diffusers' tiled VAE encode when
the strategy asks for VAE tiling (the same `tile_size` etc.), otherwise whole frames.

Prompt embeddings are encoded first, once per distinct caption, each into its own entry under
`prompts/` (keyed on the caption and the text encoder's identity, dtype and sequence length), and
read back one at a time while the VAE encodes: none is held in RAM across the VAE phase (Wan's
[512, 4096] fp32 embedding is 8 MiB a caption). The prompt entries are removed once every sample
is written; an interrupted run leaves them for the next, which then skips the text encoder.

The text encoder and VAE run under the MemoryStrategy for this call only and are removed
afterwards; the receipt reports the device bytes they held and what freeing returned.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import safetensors.torch
import torch

from ..memory import MemoryStrategy, StageComponents, apply_strategy
from ..memory.cleanup import free_memory
from ..memory.offload import device_weight_bytes
from ..pipelines.family import spatial_multiple
from ..pipelines.prompt_cache import encoder_identity
from .data import Bucket, BucketSettings, Clip, choose_bucket, fit_to_bucket, probe_clip, read_frames, scan_folder
from .errors import TrainingError

MANIFEST = "manifest.json"
CACHE_VERSION = 1
PROMPTS = "prompts"  # the caption entries' subfolder of the cache
LATENT, EMBEDS = "latent", "prompt_embeds"
SAMPLE_TENSORS = (LATENT, EMBEDS)
PROMPT_IDENTITY = ("text_encoder", "class", "dtype", "max_sequence_length", "version")  # what an embedding depends on

log = logging.getLogger("vidmem")


@dataclass(frozen=True)
class PreparedSample:
    key: str
    source: str  # the clip, relative to the data folder
    caption: str
    bucket: Bucket


@dataclass(frozen=True)
class PreparedData:
    """VIDMEM_TRAINING_DATA: where the cached latents and embeddings are, and for which model."""

    cache_folder: str
    family: str
    class_name: str
    latent_channels: int
    embed_dim: int
    samples: tuple[PreparedSample, ...]
    vae_scale: tuple[int, int]  # (spatial, temporal) compression of the VAE that made the latents
    receipt: dict = field(default_factory=dict, compare=False, repr=False)

    def load(self, sample: PreparedSample) -> tuple[torch.Tensor, torch.Tensor]:
        """(latent [C, T, h, w], prompt embedding [L, D]) of one sample, from the cache."""
        path = Path(self.cache_folder) / f"{sample.key}.safetensors"
        if not path.is_file():
            raise TrainingError(f"prepared sample {path} is missing (was the cache folder cleaned?); run Prepare "
                                "Training Data again.")
        tensors = read_entry(path, SAMPLE_TENSORS)
        return tensors[LATENT], tensors[EMBEDS]

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256("|".join(s.key for s in self.samples).encode()).hexdigest()[:16]


def read_entry(path: Path, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The named tensors of a cache entry; TrainingError naming the file when it cannot be read."""
    try:
        tensors = safetensors.torch.load_file(str(path))
        return {name: tensors[name] for name in names}
    except Exception as error:  # noqa: BLE001 - safetensors raises its own error, OSError, KeyError for a foreign file
        raise TrainingError(f"prepared entry {path} cannot be read ({type(error).__name__}: {error}); run Prepare "
                            "Training Data again: it encodes unreadable entries anew.") from None


def entry_is_readable(path: Path, names: tuple[str, ...]) -> bool:
    """Whether `path` exists and its header reads and lists `names` (safetensors checks that the
    header covers the whole file, so a file cut short by a crash or a full disk reads as False)."""
    if not path.is_file():
        return False
    try:
        with safetensors.safe_open(str(path), framework="pt") as entry:
            if set(names) <= set(entry.keys()):
                return True
            problem = f"it holds {sorted(entry.keys())}, not {list(names)}"
    except Exception as error:  # noqa: BLE001 - any unreadable entry is encoded again
        problem = f"{type(error).__name__}: {error}"
    log.warning("vidmem: cached entry %s is unreadable (%s); encoding it again", path, problem)
    return False


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def from_vae_latent(loaded, z: torch.Tensor) -> torch.Tensor:
    """The VAE's latent -> the LATENT form (the inverse of FamilySpec.to_vae_latent)."""
    vae = loaded.pipe.vae
    if loaded.spec.name == "wan":
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(z)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(z)
        return (z - mean) * inv_std
    return z * vae.config.scaling_factor


def prepare_training_data(
    loaded, folder: str | Path, buckets: BucketSettings, strategy: MemoryStrategy, cache_root: Path,
    backend, on_step: Callable[[int, int], None] = lambda done, total: None, check_interrupt: Callable[[], None] = lambda: None,
    make_room: Callable[[int], None] = lambda weight_bytes: None,
) -> PreparedData:
    """Scan, check, encode what the cache lacks, write the manifest; see the module docstring.
    `make_room(weight_bytes)`: before the encoders move, the host is asked to make room for them (the
    bytes of their weights the strategy puts on the device; the caller adds the activations)."""
    if loaded.needs_image:
        raise TrainingError(f"{loaded.class_name} is image-to-video; vidmem prepares text-to-video training data only.")
    buckets.check(loaded.spec.frames_error, spatial_multiple(loaded.pipe))
    clips = scan_folder(folder)
    root = Path(str(folder).strip()).expanduser()
    pipe = loaded.pipe
    identity = {"text_encoder": encoder_identity(pipe.text_encoder), "vae": encoder_identity(pipe.vae),
                "class": loaded.class_name, "dtype": loaded.dtype_name, "max_sequence_length": loaded.spec.max_sequence_length,
                "tiling": _tiling_label(strategy), "version": CACHE_VERSION}
    planned = [_plan(clip, buckets, identity) for clip in clips]  # headers only: all checks first
    cache = Path(cache_root) / loaded.spec.name

    def cached(entry) -> bool:
        return entry_is_readable(cache / f"{entry[2]}.safetensors", SAMPLE_TENSORS)

    # What will be encoded is decoded now, before any model work: a clip with fewer frames than its
    # header counts takes the bucket its frames allow (whose entry may be cached from an earlier run).
    planned = [entry if cached(entry) else _as_decoded(entry, buckets, identity) for entry in planned]
    missing = [entry for entry in planned if not cached(entry)]
    receipt = {"clips": len(clips), "reused": len(clips) - len(missing), "encoded": len(missing), "cache_folder": str(cache)}
    if missing:
        receipt.update(_encode_all(loaded, missing, identity, strategy, cache, backend, on_step, check_interrupt, make_room))
    samples = tuple(PreparedSample(key, str(clip.path.relative_to(root)), clip.caption, bucket) for clip, bucket, key in planned)
    _write_manifest(cache, root, samples, identity)
    receipt["buckets"] = _bucket_counts(samples)
    first = read_entry(cache / f"{samples[0].key}.safetensors", SAMPLE_TENSORS)
    return PreparedData(str(cache), loaded.spec.name, loaded.class_name, first[LATENT].shape[0], first[EMBEDS].shape[-1],
                        samples, (pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal), receipt)


def _plan(clip: Clip, buckets: BucketSettings, identity: dict) -> tuple[Clip, Bucket, str]:
    frames, width, height = probe_clip(clip, max(buckets.frames))
    return _keyed(clip, choose_bucket(clip, frames, width, height, buckets), identity)


def _keyed(clip: Clip, bucket: Bucket, identity: dict) -> tuple[Clip, Bucket, str]:
    fields = {"file": file_sha256(clip.path), "caption": clip.caption, "bucket": bucket.label(), **identity}
    return clip, bucket, hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def _as_decoded(entry: tuple[Clip, Bucket, str], buckets: BucketSettings, identity: dict) -> tuple[Clip, Bucket, str]:
    """`entry` when its clip decodes to its bucket's frames; else the entry of the bucket the decoded frames
    allow. An MP4 whose header counts frames an edit list cuts (phone clips, stream-copied trims) decodes to
    fewer; TrainingError, naming the clip, when they are fewer than the smallest frame bucket."""
    clip, bucket, _ = entry
    frames = read_frames(clip, bucket.frames)
    if frames.shape[0] >= bucket.frames:
        return entry
    log.info("vidmem: %s decodes to %d frames, fewer than its header says; bucketed by what it decodes to",
             clip.path, frames.shape[0])
    return _keyed(clip, choose_bucket(clip, frames.shape[0], frames.shape[2], frames.shape[1], buckets), identity)


def _tiling_label(strategy: MemoryStrategy) -> str:
    tiling = strategy.vae_tiling
    return "none" if tiling is None else f"{tiling.tile_size}/{tiling.overlap}"


def _encode_all(loaded, missing, identity: dict, strategy, cache: Path, backend, on_step, check_interrupt,
                make_room) -> dict:
    pipe, device = loaded.pipe, backend.device
    stage = StageComponents({"text_encoder": pipe.text_encoder, "vae": pipe.vae})
    weight_bytes = device_weight_bytes(stage, strategy)
    prompts = {clip.caption: _prompt_path(cache, clip.caption, identity) for clip, _, _ in missing}
    captions = [caption for caption, path in prompts.items() if not entry_is_readable(path, (EMBEDS,))]
    cache.mkdir(parents=True, exist_ok=True)
    make_room(weight_bytes)
    with apply_strategy(stage, strategy, backend) as handle, _vae_tiling(pipe.vae, strategy), torch.no_grad():
        if captions:  # all already on disk (an interrupted run's): the text encoder never loads
            handle.activate("text_encoder")
        for caption in captions:
            check_interrupt()
            _write_tensors(prompts[caption], {EMBEDS: _encode_prompt(loaded, caption, device)})
        handle.activate("vae")
        for done, (clip, bucket, key) in enumerate(missing, 1):
            check_interrupt()
            latent = _encode_clip(loaded, clip, bucket, device)
            embeds = read_entry(prompts[clip.caption], (EMBEDS,))[EMBEDS]
            _write_tensors(cache / f"{key}.safetensors", {LATENT: latent, EMBEDS: embeds})
            on_step(done, len(missing))
    for path in set(prompts.values()):  # every sample that needs them is written (an interrupt keeps them)
        path.unlink(missing_ok=True)
    freed = free_memory(device, release_kept=False)  # the encoders' copies went with the strategy; others' stay
    return {"captions_encoded": len(captions), "encoder_device_bytes": weight_bytes, "encoders_unloaded": True,
            "free": freed.as_dict()}


def _prompt_path(cache: Path, caption: str, identity: dict) -> Path:
    """A caption's embedding entry: the caption and what the embedding depends on (not the clip, so
    clips sharing a caption share it)."""
    fields = {"caption": caption, **{name: identity[name] for name in PROMPT_IDENTITY}}
    return cache / PROMPTS / f"{hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()}.safetensors"


def _encode_prompt(loaded, caption: str, device: torch.device) -> torch.Tensor:
    embeds, _ = loaded.pipe.encode_prompt(prompt=caption, do_classifier_free_guidance=False, num_videos_per_prompt=1,
                                          max_sequence_length=loaded.spec.max_sequence_length, device=device)
    return embeds[0].to("cpu", torch.float32)


def _encode_clip(loaded, clip: Clip, bucket: Bucket, device: torch.device) -> torch.Tensor:
    vae = loaded.pipe.vae
    pixels = fit_to_bucket(read_frames(clip, bucket.frames), bucket)[None].to(device, vae.dtype)
    z = vae.encode(pixels).latent_dist.mode()
    expected = (bucket.height // loaded.pipe.vae_scale_factor_spatial, bucket.width // loaded.pipe.vae_scale_factor_spatial)
    if tuple(z.shape[-2:]) != expected:  # diffusers' tiling can miscount tiles for some sizes (see FACTS.md)
        raise TrainingError(f"'{clip.path}' encoded to a latent of {tuple(z.shape[-2:])} instead of {expected}; "
                            "change the Memory Strategy's tile_size or turn VAE tiling off.")
    return from_vae_latent(loaded, z.float())[0].to("cpu")


class _vae_tiling:
    """diffusers' tiled encode at the strategy's tile_size/overlap for the call; every tiling
    attribute of the VAE restored afterwards (the pipeline is shared with the sampler)."""

    def __init__(self, vae, strategy: MemoryStrategy) -> None:
        self.vae, self.tiling = vae, strategy.vae_tiling

    def __enter__(self):
        self.saved = {k: v for k, v in vars(self.vae).items() if k == "use_tiling" or k.startswith("tile_")}
        if self.tiling is None or not hasattr(self.vae, "enable_tiling"):
            return
        size, overlap = self.tiling.tile_size, self.tiling.overlap
        accepted = inspect.signature(self.vae.enable_tiling).parameters
        options = {"tile_sample_min_height": size, "tile_sample_min_width": size}
        if "tile_sample_stride_height" in accepted:  # Wan
            options.update(tile_sample_stride_height=size - overlap, tile_sample_stride_width=size - overlap)
        elif "tile_overlap_factor_height" in accepted:  # CogVideoX
            options.update(tile_overlap_factor_height=overlap / size, tile_overlap_factor_width=overlap / size)
        self.vae.enable_tiling(**options)

    def __exit__(self, *exc):
        vars(self.vae).update(self.saved)


def _write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    from .save import write_safetensors_atomic

    write_safetensors_atomic({name: tensor.contiguous() for name, tensor in tensors.items()}, {"format": "pt"}, path)


def _write_manifest(cache: Path, root: Path, samples, identity: dict) -> None:
    manifest = {"version": CACHE_VERSION, "data_folder": str(root), "settings": identity,
                "entries": [{"key": s.key, "source": s.source, "caption": s.caption, "bucket": s.bucket.label()} for s in samples]}
    cache.mkdir(parents=True, exist_ok=True)
    (cache / f"{hashlib.sha256(str(root).encode()).hexdigest()[:16]}.{MANIFEST}").write_text(json.dumps(manifest, indent=1))


def _bucket_counts(samples) -> dict[str, int]:
    counts: dict[str, int] = {}
    for sample in samples:
        counts[sample.bucket.label()] = counts.get(sample.bucket.label(), 0) + 1
    return counts
