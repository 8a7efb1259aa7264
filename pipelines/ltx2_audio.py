"""LTX-2's sound: the audio latents a sampled LATENT carries, decoded to ComfyUI's AUDIO on demand.

LTX-2 denoises audio and video in one transformer, so every run makes audio latents
([B, channels, length, mel bins]: kilobytes beside the video's megabytes). The sampler keeps them in
the LATENT beside the video (`AUDIO_KEY`), as the transformer denoised them: normalised, because a
video-only pipeline has no audio VAE and so no audio statistics (its stand-in, `AudioLatentShape`,
denormalises with 0 and 1; `latent["vidmem"]["audio"]["normalised"]` records it).

`decode_audio` runs LTX2Pipeline's own tail on them (denormalise with the audio VAE's
`latents_mean` / `latents_std`, `audio_vae.decode` -> mel spectrogram, `vocoder` -> waveform at the
vocoder's `output_sampling_rate`) with the audio VAE and the vocoder loaded for that call only and
dropped after it: a graph without Decode Audio never loads or holds them. They come from the
pipeline's diffusers folder (`audio_vae/`, `vocoder/`); when the model came from a single checkpoint
that carries `audio_vae.*`, the audio VAE comes from that file (configured by the folder's
audio_vae/config.json). The checkpoint's `vocoder.*` names have no converter in diffusers 0.42.1, so
the vocoder always comes from the folder.
"""

from __future__ import annotations

import gc
import inspect
import json
import logging
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..memory import resolve_compute_device
from ..memory.cleanup import is_out_of_memory
from ..memory.telemetry import StageMeter
from .family import ModelError
from .folder_check import check_weight_folder
from .hooks import RunHooks
from .loader import LoadedPipeline, torch_dtype
from .ltx2 import AUDIO_PARTS, LTX2

log = logging.getLogger("vidmem")

AUDIO_KEY = "audio_samples"  # the LATENT's audio latents, beside "samples"
FRAME_RATE = 24.0  # LTX2Pipeline.__call__'s frame_rate, which vidmem's sampler leaves at its default
_FIX_LATENT = ("connect the LATENT of an LTX-2 Video Sampler run (this version of vidmem keeps the sound in it); "
               "core Save/Load Latent keep only the video, so sample again rather than load a saved latent.")


@dataclass(frozen=True)
class AudioResult:
    """One decoded sound: `waveform` [batch, channels, samples] float32 on the CPU, at `sample_rate` Hz."""

    waveform: torch.Tensor
    sample_rate: int
    receipt: dict = field(default_factory=dict, compare=False)

    def as_comfy(self) -> dict:
        """ComfyUI's AUDIO type."""
        return {"waveform": self.waveform, "sample_rate": self.sample_rate}


def with_audio(latent: dict, pipe, audio: torch.Tensor) -> dict:
    """`latent` (a new dict) with the run's audio latents and what decoding them needs to know.
    `pipe` is the loaded pipeline: without its own audio VAE, the call denormalised with 0 and 1.
    A run resumed after an out-of-memory error resumed its audio latents with the video's (LTX2Call
    records them each step, pipelines/sample_call.py hands them back), so its sound is the
    uninterrupted run's and is kept like any other."""
    info = {"normalised": getattr(pipe, "audio_vae", None) is None, "frame_rate": FRAME_RATE}
    metadata = dict(latent.get("vidmem", {}), audio=info)
    return dict(latent, **{AUDIO_KEY: audio.detach().to("cpu"), "vidmem": metadata})


def audio_latents(loaded: LoadedPipeline, latent) -> torch.Tensor:
    """The LATENT's audio latents [B, C, L, M], refused with the input and the fix when they are not
    LTX-2's sound from this pipeline."""
    if loaded.spec is not LTX2:
        raise ModelError(f"pipeline: Decode Audio decodes LTX-2's sound, but the pipeline is {loaded.spec.name} "
                         f"({loaded.class_name}); connect the LTX-2 pipeline that sampled the latent.")
    if not isinstance(latent, dict):
        raise ModelError(f"latent: expected a LATENT (a dict), got {type(latent).__name__}; {_FIX_LATENT}")
    metadata, _ = _metadata(latent)
    origin = metadata.get("family")
    if origin not in (None, LTX2.name):
        raise ModelError(f"latent: it came from a {origin} model, which makes no sound; {_FIX_LATENT}")
    audio = latent.get(AUDIO_KEY)
    if not isinstance(audio, torch.Tensor):
        raise ModelError(f"latent: it has no '{AUDIO_KEY}' (the audio latents), only the video; {_FIX_LATENT}")
    if audio.ndim != 4 or audio.numel() == 0 or not audio.is_floating_point():
        raise ModelError(f"latent: its '{AUDIO_KEY}' {tuple(audio.shape)} ({audio.dtype}) are not audio latents "
                         f"[batch, channels, length, mel bins] of floats; {_FIX_LATENT}")
    if not torch.isfinite(audio).all():
        raise ModelError(f"latent: its '{AUDIO_KEY}' hold NaN or infinite values; sample again (check cfg).")
    return audio


def _metadata(latent: dict) -> tuple[dict, dict]:
    """The LATENT's vidmem metadata and its "audio" entry ({} where absent; metadata None counts as
    absent, as before), refused by name when either is not the dict the Sampler writes (an edited or
    foreign LATENT)."""
    metadata = latent.get("vidmem")
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict):
        raise ModelError(f"latent: its 'vidmem' metadata is {type(metadata).__name__}, not the dict the Video Sampler "
                         f"writes; {_FIX_LATENT}")
    audio_info = metadata.get("audio", {})
    if not isinstance(audio_info, dict):
        raise ModelError(f"latent: its vidmem 'audio' entry is {type(audio_info).__name__}, not the dict the Video "
                         f"Sampler writes beside the sound; {_FIX_LATENT}")
    return metadata, audio_info


def audio_parts_error(loaded: LoadedPipeline) -> str | None:
    """Why the audio VAE and vocoder cannot be loaded for `loaded`, naming the fix; None when they can."""
    folder = Path(loaded.folder) if loaded.folder else None
    if folder is None or not (folder / "model_index.json").is_file():
        return ("pipeline: Decode Audio loads LTX-2's audio VAE and vocoder from the model's diffusers folder, and this "
                f"pipeline ({loaded.source}) has none; load it with Load Video Pipeline from an LTX-2 diffusers folder.")
    missing = [name for name in AUDIO_PARTS if not _has_weights(folder / name)]
    if "audio_vae" in missing and (folder / "audio_vae" / "config.json").is_file() and _file_audio_vae(loaded):
        missing.remove("audio_vae")  # the single checkpoint carries it
    if not missing:
        return None
    return (f"pipeline: '{folder}' has no weights for {' or '.join(missing)}, which Decode Audio needs to make sound "
            f"(video needs only audio_vae/config.json); copy {', '.join(f'{name}/' for name in missing)} "
            "(config.json and weights) from the model's diffusers repository into the folder.")


def _has_weights(part: Path) -> bool:
    return (part / "config.json").is_file() and any(part.glob("*.safetensors"))


def _file_audio_vae(loaded: LoadedPipeline) -> bool:
    """Whether the pipeline's single checkpoint carries the audio VAE (read from its header, by the
    reader the loader uses: a GGUF transformer file carries no audio VAE, and is no safetensors file)."""
    if not loaded.transformer_file:
        return False
    from .comfy_files.files import ltx2_parts

    return "audio_vae" in ltx2_parts(loaded.transformer_file, "transformer_file")


def load_audio_parts(loaded: LoadedPipeline,
                     audio: torch.Tensor | None = None) -> tuple[torch.nn.Module, torch.nn.Module, str]:
    """The audio VAE and the vocoder, on the CPU in the pipeline's dtype, and where the audio VAE
    came from ("folder" or the checkpoint's name). The caller drops them after use.

    What the folder's config.json files decide is checked before any weight loads (hundreds of MB):
    the parts present, the vocoder's class, and, given `audio` ([B, C, L, M] latents), that the
    audio VAE decodes their channels and mel bins."""
    error = audio_parts_error(loaded)
    if error:
        raise ModelError(error)
    folder = Path(loaded.folder)
    _vocoder_class(_config(folder / "vocoder"))
    if audio is not None:
        _check_channels(audio, _config(folder / "audio_vae"))
    return _build_parts(loaded)


def _config(part: Path) -> dict:
    """A part's config.json (audio_parts_error found it)."""
    return json.loads((part / "config.json").read_text())


def _build_parts(loaded: LoadedPipeline) -> tuple[torch.nn.Module, torch.nn.Module, str]:
    """load_audio_parts once `audio_parts_error` has found nothing missing."""
    from diffusers import AutoencoderKLLTX2Audio

    folder, dtype = Path(loaded.folder), torch_dtype(loaded.dtype_name)
    if _has_weights(folder / "audio_vae"):
        audio_vae, source = _from_folder(AutoencoderKLLTX2Audio, folder / "audio_vae", dtype), "folder"
    else:
        audio_vae, source = _from_checkpoint(loaded.transformer_file, folder, dtype), Path(loaded.transformer_file).name
    vocoder_class = _vocoder_class(_config(folder / "vocoder"))
    return audio_vae, _from_folder(vocoder_class, folder / "vocoder", dtype), source


def _from_folder(cls, path: Path, dtype: torch.dtype) -> torch.nn.Module:
    check_weight_folder(path, path.name)  # the loader's folder check skips these parts: the pipeline never loads them
    return cls.from_pretrained(path, torch_dtype=dtype, use_safetensors=True, local_files_only=True).eval()


def _vocoder_class(config: dict) -> type:
    """LTX2Vocoder (LTX-2.0) or LTX2VocoderWithBWE (LTX-2.3), as the folder's config names it."""
    from diffusers.pipelines.ltx2 import vocoder

    name = config.get("_class_name", "LTX2Vocoder")
    if not name.startswith("LTX2Vocoder") or not hasattr(vocoder, name):
        raise ModelError(f"pipeline: vocoder/config.json names '{name}', which diffusers' LTX-2 does not have; "
                         "use the vocoder folder of an LTX-2 diffusers repository.")
    return getattr(vocoder, name)


def _from_checkpoint(path: str, folder: Path, dtype: torch.dtype) -> torch.nn.Module:
    """The single checkpoint's audio VAE (a few hundred MB: copied, not mapped), configured by the folder."""
    from diffusers import AutoencoderKLLTX2Audio

    from .comfy_files.files import ltx2_part

    module = AutoencoderKLLTX2Audio.from_config(_config(folder / "audio_vae"))
    module.load_state_dict(ltx2_part(path, "audio_vae", "transformer_file"), strict=True)
    return module.to(dtype).eval()


@torch.no_grad()
def decode_audio(loaded: LoadedPipeline, latent: dict, device: torch.device | None = None,
                 hooks: RunHooks = RunHooks()) -> AudioResult:
    """LTX-2's sound from a sampled LATENT, decoded on `device` (default: CUDA when present) as
    LTX2Pipeline decodes it, with the audio VAE and vocoder loaded for this call and freed after.
    `hooks.make_room` is asked for their weights before they move (their activations, a mel
    spectrogram and a waveform of seconds, are small beside them); `hooks.check_interrupt` before.

    Freeing them touches nothing else: the weights other pipelines keep warm on the device stay
    (only the device's unused cache is returned). When the device runs out of memory the parts
    are dropped from it and the sound is decoded again on the CPU (the receipt's "fallback" says
    why); any other error, here or in the CPU's decode, propagates with every copy of the parts
    off the device and the frames of its traceback cleared, so a host that keeps the exception keeps
    no device memory (those frames' local variables are gone from the traceback; its lines stay)."""
    audio = audio_latents(loaded, latent)
    device = device or resolve_compute_device()
    normalised = _metadata(latent)[1].get("normalised", True)
    hooks.check_interrupt()
    held = [load_audio_parts(loaded, audio)]  # the CPU's fresh copy joins after an out-of-memory error
    try:
        result = _decode_held(loaded, held, audio, device, normalised, hooks)
    except BaseException as error:
        _drop(error, *_modules(held), device=device)
        raise
    _drop(None, *_modules(held), device=device)
    return result


def _modules(held: list) -> list[torch.nn.Module]:
    return [module for audio_vae, vocoder, _ in held for module in (audio_vae, vocoder)]


def _decode_held(loaded: LoadedPipeline, held: list, audio: torch.Tensor, device: torch.device, normalised: bool,
                 hooks: RunHooks) -> AudioResult:
    """decode_audio's body on the parts in `held` (which the caller drops, whatever happens)."""
    audio_vae, vocoder, source = held[0]
    weight_bytes = sum(t.numel() * t.element_size() for m in (audio_vae, vocoder) for t in m.state_dict().values())
    hooks.make_room(weight_bytes, device, weight_bytes=weight_bytes)
    with StageMeter("audio_decode", device) as meter:
        waveform, fallback = _decode_with_cpu_fallback(loaded, held, audio, device, normalised)
    rate = int(vocoder.config.output_sampling_rate)
    receipt = {"device": str(device), "stages": [meter.as_dict()], "audio_vae": source,
               "audio": f"{waveform.shape[-1] / rate:.2f} s at {rate} Hz, {waveform.shape[1]} channels"}
    if fallback:
        receipt["fallback"] = fallback
    return AudioResult(waveform, rate, receipt)


def _decode_with_cpu_fallback(loaded: LoadedPipeline, held: list, audio: torch.Tensor, device: torch.device,
                              normalised: bool) -> tuple[torch.Tensor, str | None]:
    """The waveform decoded on `device`, or, when it runs out of memory there, on a fresh CPU copy
    of the parts (appended to `held`; the device's are dropped first, to give its memory back), and
    why it fell back (None when it did not)."""
    audio_vae, vocoder, _ = held[0]
    try:
        return _decode_on(device, audio, audio_vae, vocoder, normalised), None
    except RuntimeError as error:  # torch.OutOfMemoryError is one; so are cuBLAS/cuDNN allocation failures
        if device.type == "cpu" or not is_out_of_memory(error):
            raise
        _drop(error, audio_vae, vocoder, device=device)
        fallback = f"{device} ran out of memory ({str(error).strip().splitlines()[0]}); decoded on the CPU"
    log.warning("vidmem Decode Audio: %s", fallback)
    held.append(_build_parts(loaded))  # the device's copies are gone; the parts were found complete already
    audio_vae, vocoder, _ = held[-1]
    return _decode_on(torch.device("cpu"), audio, audio_vae, vocoder, normalised), fallback


def _decode_on(device: torch.device, audio: torch.Tensor, audio_vae, vocoder, normalised: bool) -> torch.Tensor:
    """LTX2Pipeline's audio tail on `device`: denormalise the fp32 latents, then cast them to the
    audio VAE's dtype (as the pipeline does: casting first rounds the latents before the statistics
    scale them), mel spectrogram, waveform; float32 on the CPU."""
    audio_vae.to(device)
    vocoder.to(device)
    z = audio.to(device, torch.float32)
    if normalised:
        z = denormalise(z, audio_vae)
    waveform = vocoder(audio_vae.decode(z.to(audio_vae.dtype), return_dict=False)[0])
    return waveform.float().cpu().contiguous()


def _drop(error: BaseException | None, *parts: torch.nn.Module, device: torch.device | None = None) -> None:
    """The parts' weights off the device, then the device's unused cache back to the driver.

    Their weights go to the meta device (no copy, no host memory: they are dropped anyway), so
    whatever still holds the modules (the frames of `error`'s traceback) holds no device memory;
    those frames are cleared too, for the activations their locals hold. Unlike
    memory.cleanup.free_memory, this leaves the weights other pipelines keep warm on the device."""
    for part in parts:
        part.to("meta")
    if error is not None:
        traceback.clear_frames(error.__traceback__)  # skips the frames still running (this call's own)
    gc.collect()
    if device is not None and device.type == "cuda":
        torch.cuda.empty_cache()


def denormalise(z: torch.Tensor, audio_vae) -> torch.Tensor:
    """LTX2Pipeline's denormalisation of [B, C, L, M] audio latents: per packed feature (C x M)."""
    from diffusers import LTX2Pipeline

    packed = LTX2Pipeline._pack_audio_latents(z)
    packed = LTX2Pipeline._denormalize_audio_latents(packed, audio_vae.latents_mean, audio_vae.latents_std)
    return LTX2Pipeline._unpack_audio_latents(packed, z.shape[2], num_mel_bins=z.shape[3])


def _check_channels(audio: torch.Tensor, config: dict) -> None:
    """The latents' channels and mel bins against what the audio VAE of `config` (config.json) decodes."""
    from diffusers import AutoencoderKLLTX2Audio
    from diffusers.models.autoencoders.autoencoder_kl_ltx2_audio import LATENT_DOWNSAMPLE_FACTOR

    defaults = inspect.signature(AutoencoderKLLTX2Audio.__init__).parameters  # for keys a config leaves out
    setting = lambda name: config.get(name, defaults[name].default)  # noqa: E731
    expected = (setting("latent_channels"), setting("mel_bins") // LATENT_DOWNSAMPLE_FACTOR)
    if (audio.shape[1], audio.shape[3]) != expected:
        raise ModelError(f"latent: its audio latents have {audio.shape[1]} channels x {audio.shape[3]} mel bins, but this "
                         f"pipeline's audio VAE decodes {expected[0]} x {expected[1]}; decode with the LTX-2 pipeline "
                         "that sampled it.")

