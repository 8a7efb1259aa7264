"""LTX-2 (Lightricks, 19B audio-video DiT; Gemma 3 12B text encoder) declared for the engine.

The pipeline returns video latents as [B, C, T, h, w], already denormalised with the VAE's
per-channel mean and std (`output_type="latent"`), which is what its VAE decodes: both latent
conversions are the identity.

What differs from Wan and CogVideoX, and each is absorbed here, in `LTX2Call`, a mixin the loader
puts in front of diffusers' pipeline class (`FamilySpec.call_adapter`):
- the prompt is Gemma 3's hidden states of every layer, stacked ([1, 1024, hidden x (layers + 1)]),
  with a left-padding mask the connectors need; `pack_prompt` appends the mask as one more
  channel (values 0 and 1 are exact in any float dtype) so the prompt cache keeps one tensor.
  The pipeline tells the connectors the tokenizer's `padding_side`, which only its encode sets to
  left: a call over cached embeddings sets it too (for the call), or a tokenizer saved with right
  padding would unpad them from the wrong end;
- one transformer denoises video and audio together: every block runs an audio branch and
  cross-attention both ways, so the audio tokens change the video and the branch cannot be left
  out without changing the video. A video-only run keeps the transformer whole but never loads
  the audio VAE or the vocoder (`unloaded` in the spec): for the call, a weightless stand-in
  (`AudioLatentShape`) gives the pipeline the audio latent shape from `audio_vae/config.json`,
  so the audio noise drawn, and so the video, are the ones the full pipeline makes. The audio
  latents the call returns ride along in the LATENT; `ltx2_audio.py` decodes them on request
  (Decode Audio), loading the audio parts for that call only;
- LTX-2.3 guidance (spatio-temporal and modality-isolation passes) costs two more transformer
  passes per step that vidmem's sampler and planner do not count: off unless asked, and the
  audio cfg follows the video's (`VIDEO_ONLY_GUIDANCE`); cfg runs as one batch of two, as in diffusers;
- `use_cross_timestep` is the LTX-2.3 behaviour; LTX-2.0 folders (whose connectors project one
  shared text embedding: `per_modality_projections` false) get the 2.0 behaviour by default.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch

from .family import FamilySpec, ModelError, SamplerDefaults

PROMPT_TOKENS = 1024  # LTX2Pipeline.__call__'s max_sequence_length (Gemma tokens, left-padded)
AUDIO_PARTS = ("audio_vae", "vocoder")  # what a video-only run never loads

# The extra guidance passes the sampler does not drive are off (diffusers' own fast tests pin the
# same values); the audio cfg follows the sampler's one cfg (None: "the video value"), so the
# negative pass runs exactly when vidmem encodes a negative prompt (cfg above 1).
VIDEO_ONLY_GUIDANCE = {
    "stg_scale": 0.0, "audio_stg_scale": 0.0, "spatio_temporal_guidance_blocks": None,
    "modality_scale": 1.0, "audio_modality_scale": 1.0, "audio_guidance_scale": None,
}


def _identity_comfy(pipe, raw: torch.Tensor, frames: int) -> torch.Tensor:
    return raw


def _identity_vae(pipe, latent: torch.Tensor) -> torch.Tensor:
    return latent


def audio_latent_frames(frames: int, sampling_rate: int, hop_length: int, compression: int, frame_rate: float = 24.0) -> int:
    """The audio latent frames LTX2Pipeline makes for `frames` video frames (its __call__'s rule)."""
    return round(frames / frame_rate * (sampling_rate / hop_length / float(compression)))


def cross_timestep(connectors_config) -> bool:
    """The `use_cross_timestep` a call runs with by default: LTX-2.3's (connectors with per-modality
    projections) true, LTX-2.0's false (module docstring). The planner traces the same."""
    return bool(connectors_config.get("per_modality_projections", False))


def pack_prompt(embeds: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, L, D] embeddings and their [B, L] token mask as one [B, L, D + 1] tensor (mask last)."""
    return torch.cat([embeds, mask.unsqueeze(-1).to(embeds.dtype)], dim=-1)


def unpack_prompt(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`pack_prompt`'s inverse: the embeddings and the tokenizer's integer mask, as the pipeline makes them."""
    return packed[..., :-1], packed[..., -1].to(torch.int64)


@dataclass(frozen=True)
class AudioLatentShape:
    """What LTX2Pipeline reads from its audio VAE to shape the audio latents, without its weights.

    The pipeline reads `config` (mel_bins, latent_channels, sample_rate, mel_hop_length), the two
    compression ratios (fixed at 4 in AutoencoderKLLTX2Audio), and `latents_mean` / `latents_std`
    only to denormalise the audio latents it returns: a video-only run drops them, so 0 and 1 stand in."""

    config: SimpleNamespace
    mel_compression_ratio: int = 4
    temporal_compression_ratio: int = 4
    latents_mean: torch.Tensor = field(default_factory=lambda: torch.zeros(()))
    latents_std: torch.Tensor = field(default_factory=lambda: torch.ones(()))
    dtype: torch.dtype = torch.float32

    @classmethod
    def from_folder(cls, folder: Path) -> "AudioLatentShape":
        path = folder / "audio_vae" / "config.json"
        if not path.is_file():
            raise ModelError(
                f"'{folder}' has no audio_vae/config.json: LTX-2 denoises audio with the video, so even a "
                "video-only run needs the audio latent shape it states; copy audio_vae/config.json from the "
                "model's diffusers repository into the folder (its weights are not needed for video)."
            )
        return cls(SimpleNamespace(**json.loads(path.read_text())))

    def decode(self, latents: torch.Tensor, return_dict: bool = False) -> tuple[None]:
        """No sound without the audio VAE: the pipeline's decoded output then carries audio None."""
        return (None,)


class LTX2Call:
    """The call interface vidmem's sampler uses (see the module docstring), over diffusers' own loop."""

    # diffusers' list, and the audio latents (a local of the loop): the step callback records them,
    # so a run resumed after an out-of-memory error resumes the audio with the video.
    _callback_tensor_inputs = ["latents", "prompt_embeds", "negative_prompt_embeds", "audio_latents"]

    # The VAE factors under the names the engine reads (Wan's; LTX2Pipeline calls them *_compression_ratio).
    @property
    def vae_scale_factor_spatial(self) -> int:
        return self.vae_spatial_compression_ratio

    @property
    def vae_scale_factor_temporal(self) -> int:
        return self.vae_temporal_compression_ratio

    def vidmem_encode_prompt(self, text: str, device: torch.device) -> torch.Tensor:
        """One text's Gemma hidden states and mask, packed; the encode the pipeline's call runs."""
        with ExitStack() as undo:  # diffusers' encode sets left padding on the shared tokenizer: put back after
            _pad_left(undo, self)
            embeds, mask = self._get_gemma_prompt_embeds(prompt=text, max_sequence_length=PROMPT_TOKENS, device=device)
        return pack_prompt(embeds, mask)

    def __call__(self, *args, **kwargs):
        kwargs = self._unpacked(kwargs)
        for name, value in VIDEO_ONLY_GUIDANCE.items():
            kwargs.setdefault(name, value)
        kwargs.setdefault("use_cross_timestep", cross_timestep(self.connectors.config))
        if kwargs.get("callback_on_step_end") is not None:
            kwargs = self._recording_audio(kwargs)
        with ExitStack() as undo:  # everything set for this call is put back, whatever happens
            _pad_left(undo, self)  # as the encode it may skip (cached prompts) would have (module docstring)
            if self.audio_vae is None:
                self._stand_in_for_audio(undo)
            return super().__call__(*args, **kwargs)

    def _recording_audio(self, kwargs: dict) -> dict:
        """The step callback with the audio latents asked for and kept on the call (`_vidmem_step_audio`,
        which pipelines/sample_call.py's StepRecord reads): the callback itself sees what it asked for."""
        callback = kwargs["callback_on_step_end"]
        asked = list(kwargs.get("callback_on_step_end_tensor_inputs") or ["latents"])

        def recording(pipe, step: int, timestep, tensors: dict) -> dict:
            self._vidmem_step_audio = tensors["audio_latents"]
            return callback(pipe, step, timestep, {k: v for k, v in tensors.items() if k in asked})

        return dict(kwargs, callback_on_step_end=recording,
                    callback_on_step_end_tensor_inputs=list(dict.fromkeys([*asked, "audio_latents"])))

    def _unpacked(self, kwargs: dict) -> dict:
        """Packed `prompt_embeds` / `negative_prompt_embeds` (no mask given) as embeddings and masks."""
        if kwargs.get("prompt_embeds") is None or kwargs.get("prompt_attention_mask") is not None:
            return kwargs
        for prefix in ("", "negative_"):
            packed = kwargs.pop(f"{prefix}prompt_embeds", None)
            if packed is not None:
                kwargs[f"{prefix}prompt_embeds"], kwargs[f"{prefix}prompt_attention_mask"] = unpack_prompt(packed)
        return kwargs

    def _stand_in_for_audio(self, undo: ExitStack) -> None:
        """For one video-only call: the audio latent shape from the folder's config, and the audio
        settings LTX2Pipeline.__init__ derived from the audio VAE it did not get."""
        shape = AudioLatentShape.from_folder(_model_folder(self))
        values = {"audio_vae": shape, "audio_sampling_rate": shape.config.sample_rate,
                  "audio_hop_length": shape.config.mel_hop_length,
                  "audio_vae_mel_compression_ratio": shape.mel_compression_ratio,
                  "audio_vae_temporal_compression_ratio": shape.temporal_compression_ratio,
                  "vocoder": _no_sound}
        for name, value in values.items():
            _set_in_dict(undo, self, name, value)


def _pad_left(undo: ExitStack, pipe) -> None:
    """The tokenizer's `padding_side` "left" until `undo` closes, as LTX2Pipeline._get_gemma_prompt_embeds
    sets it (Gemma's chat-style prompts are left-padded) and as its call then tells the connectors."""
    tokenizer = getattr(pipe, "tokenizer", None)
    if tokenizer is not None:
        undo.callback(setattr, tokenizer, "padding_side", tokenizer.padding_side)
        tokenizer.padding_side = "left"


def _no_sound(mel: None) -> None:
    """The vocoder of a video-only call (`AudioLatentShape.decode` made no spectrogram)."""
    return None


def _model_folder(pipe) -> Path:
    """The diffusers folder `pipe` was loaded from. vidmem's per-call pipelines are built from the
    loaded one's components, so the pipeline's own config does not carry it; every model diffusers
    loads from a folder records its `<folder>/<component>` (the VAE and connectors always are)."""
    for name in ("vae", "connectors", "transformer"):
        path = getattr(getattr(pipe, name, None), "config", {}).get("_name_or_path")
        if path:
            return Path(path).parent
    raise ModelError("this LTX-2 pipeline was not loaded from a diffusers folder, so its audio latent shape "
                     "(audio_vae/config.json) is unknown; load the model from its diffusers folder.")


def _set_in_dict(undo: ExitStack, owner: object, name: str, value: object) -> None:
    """`owner.name = value` until `undo` closes, written to the instance's dict: DiffusionPipeline's
    __setattr__ would record a component's class in the pipeline's config (and save it)."""
    state = vars(owner)
    undo.callback(state.__setitem__, name, state[name]) if name in state else undo.callback(state.pop, name, None)
    state[name] = value


def audio_error(pipe) -> str | None:
    """Why `pipe` cannot make sound, naming the fix; None when it has its audio VAE and vocoder."""
    missing = [name for name in AUDIO_PARTS if getattr(pipe, name, None) is None]
    if not missing:
        return None
    return (f"this LTX-2 pipeline holds no {' or '.join(missing)} (vidmem loads them only inside Decode Audio, "
            f"from the folder); for sound, connect Decode Audio (VidMem) to a folder that has {', '.join(AUDIO_PARTS)} "
            "with their weights (pipelines/ltx2_audio.py: audio_parts_error).")


LTX2 = FamilySpec(
    name="ltx2",
    # One checkpoint makes both: a text-to-video folder also runs image-to-video (`image_variant`).
    pipeline_classes=("LTX2Pipeline", "LTX2ImageToVideoPipeline"),
    image_conditioned=("LTX2ImageToVideoPipeline",),
    image_variant=lambda pipe: "LTX2ImageToVideoPipeline",
    denoisers=("transformer",),
    blocks_attr="transformer_blocks",
    # Gemma 3 (12B) is placed by the strategy's `text_encoder` input; the connectors (two small
    # transformers over the text tokens, run inside the pipeline's call) follow the tier.
    encoders=("text_encoder", "connectors"),
    frame_step=8,  # the VAE's temporal factor: (frames - 1) // 8 + 1 latent frames
    to_comfy_latent=_identity_comfy,
    to_vae_latent=_identity_vae,
    max_sequence_length=PROMPT_TOKENS,
    single_file_transformer="LTX2VideoTransformer3DModel",  # Lightricks' / Comfy-Org's checkpoints (comfy_files/ltx2.py)
    call_adapter=LTX2Call,
    attention_masked=True,  # the cross-attention masks the text padding (LTX2AudioVideoAttnProcessor)
    unloaded=AUDIO_PARTS,
    call_encoders=("connectors",),
    # FlowMatchEulerDiscreteScheduler with a resolution-dependent shift (`mu` from the token count,
    # computed by the pipeline): no fixed shift to recommend. cfg and steps: LTX2Pipeline.__call__'s defaults.
    sampler=SamplerDefaults(flow_matching=True, schedulers=(), recommended_shift=(), cfg=3.0, steps=30),
    cfg_as_batch=True,  # torch.cat([negative, positive]) through the transformer, like CogVideoX
    # 32x VAE: a 256 px tile is 8 latent pixels, below its decoder's receptive field (error 4x diffusers'
    # tiling in bench/vae_decode.py); diffusers' own LTX-2 tiles are 512 px (docs/decode.md).
    min_decode_tile=512,
)
