"""HunyuanVideo 1.5 (8.3B; T2V and I2V at 480p and 720p) declared for the engine.

The pipeline returns latents as [B, C, T, h, w]; its VAE decodes `latent / scaling_factor`.

What differs from Wan and CogVideoX, and each is absorbed here, in `HunyuanVideo15Call`, a
mixin the loader puts in front of diffusers' pipeline class (`FamilySpec.call_adapter`), so the
sampler keeps speaking one interface to every family:
- two prompt encoders: Qwen2.5-VL's text model (`text_encoder`, 7B) and a ByT5 glyph encoder
  (`text_encoder_2`, for quoted text), each with a mask. One prompt's four tensors are packed into
  one [1, L, D] tensor (`pack_prompt`), which is what the prompt cache stores and what the sampler
  passes as `prompt_embeds`; the mixin unpacks it. Packing copies values, never rounds them;
- guidance lives in a stateful `guider` component, not in a `guidance_scale` argument: each call
  gets a fresh guider from the folder's config with the call's scale (the shared one is never
  stepped), and a scale of 1 or less turns the negative pass off, as `guidance_scale <= 1` does
  for Wan and CogVideoX;
- the loop has no `callback_on_step_end`: the mixin calls it after each scheduler step, with the
  step index the scheduler keeps (so a loop resumed after an out-of-memory error counts on);
- image-to-video takes no height or width (it picks the size bucket nearest the image's aspect):
  the mixin makes the requested size the bucket, and the image is cropped to it; its image encodes
  (SigLIP's embeddings, the VAE's first-frame latents) run in the first attempt of a run only: an
  attempt resumed after an out-of-memory error reuses them (`vidmem_once`, pipelines/sample_call.py);
- diffusers' attention builds a dense [B, 1, S, S] mask in every block (12 GiB a copy at 720p):
  for the call, every block's attention masks keys only above a size (hunyuan_video15_attention.py).
"""

from __future__ import annotations

import inspect
from contextlib import ExitStack

import torch

from .family import FamilySpec, SamplerDefaults
from .hunyuan_video15_attention import key_masked_attention
from .hunyuan_video15_vae import hunyuan_video15_stages

# Fixed token counts HunyuanVideo15Pipeline.__init__ sets (the planner's workloads read them).
PROMPT_TOKENS = 1000  # tokenizer_max_length: Qwen tokens kept after the chat template
TEMPLATE_TOKENS = 108  # prompt_template_encode_start_idx: the template's tokens, encoded then cropped
GLYPH_TOKENS = 256  # tokenizer_2_max_length: ByT5 tokens
IMAGE_TOKENS = 729  # vision_num_semantic_tokens: zeros for text-to-video
QWEN_SKIPPED_LAYERS = 2  # the prompt is the hidden state 2 layers before the last


def _to_comfy_latent(pipe, raw: torch.Tensor, frames: int) -> torch.Tensor:
    return raw


def _to_vae_latent(pipe, latent: torch.Tensor) -> torch.Tensor:
    # Same op as HunyuanVideo15Pipeline's decode step, so frames match it bit for bit.
    return latent / pipe.vae.config.scaling_factor


def pack_prompt(embeds: torch.Tensor, mask: torch.Tensor, embeds_2: torch.Tensor, mask_2: torch.Tensor) -> torch.Tensor:
    """One prompt's Qwen and ByT5 embeddings and masks as one [B, L + L2, max(D, D2) + 1] tensor.

    Rows 0..L-1 hold the Qwen tokens, rows L.. the ByT5 tokens (zero-padded to the wider width);
    the last channel holds each token's mask. The pipeline already keeps masks in the embeddings'
    dtype, so nothing is rounded."""
    width = max(embeds.shape[-1], embeds_2.shape[-1])
    rows = [torch.cat([e, e.new_zeros(*e.shape[:-1], width - e.shape[-1]), m.unsqueeze(-1).to(e.dtype)], dim=-1)
            for e, m in ((embeds, mask), (embeds_2, mask_2))]
    return torch.cat(rows, dim=1)


def unpack_prompt(packed: torch.Tensor, text_dim: int, text_dim_2: int, tokens_2: int) -> dict[str, torch.Tensor]:
    """`pack_prompt`'s inverse, as the pipeline's keyword arguments (without the negative_ prefix)."""
    first, second = packed[:, :-tokens_2], packed[:, -tokens_2:]
    return {"prompt_embeds": first[..., :text_dim], "prompt_embeds_mask": first[..., -1],
            "prompt_embeds_2": second[..., :text_dim_2], "prompt_embeds_mask_2": second[..., -1]}


class HunyuanVideo15Call:
    """The call interface vidmem's sampler uses (see the module docstring), over diffusers' own loop."""

    def vidmem_encode_prompt(self, text: str, device: torch.device) -> torch.Tensor:
        """One text's embeddings, packed; the same encode_prompt (and dtype) the pipeline's call runs.

        Qwen runs on `device` (the CPU when the strategy keeps the text encoder there); ByT5 follows
        the tier, so it runs where the strategy placed it: on the execution device."""
        glyphs, glyph_mask = self._get_byt5_prompt_embeds(self.tokenizer_2, self.text_encoder_2, [text],
                                                          self._execution_device, self.tokenizer_2_max_length)
        embeds = self.encode_prompt(prompt=text, device=device, dtype=self.transformer.dtype, batch_size=1,
                                    prompt_embeds_2=glyphs.to(device), prompt_embeds_mask_2=glyph_mask.to(device))
        return pack_prompt(*embeds)

    def __call__(self, *args, guidance_scale: float | None = None, callback_on_step_end=None, **kwargs):
        kwargs = self._unpacked(kwargs)
        size = self._requested_size(kwargs)
        with ExitStack() as undo:  # everything set for this call is put back, whatever happens
            undo.enter_context(key_masked_attention(self.transformer))  # no dense S x S mask at large sizes
            _set_for_call(undo, self, "guider", _call_guider(self.guider, guidance_scale))
            if callback_on_step_end is not None:
                _set_for_call(undo, self.scheduler, "step", self._step_with_callback(self.scheduler.step, callback_on_step_end))
            if size is not None:  # image-to-video: the requested size, not the bucket nearest the image's
                _set_for_call(undo, self.video_processor, "calculate_default_height_width", lambda height, width, target_size: size)
            return super().__call__(*args, **kwargs)

    def encode_image(self, *args, **kwargs):
        """HunyuanVideo15ImageToVideoPipeline's SigLIP embeddings, once per run (module docstring)."""
        encode = super().encode_image
        return _once(self, "encode_image", lambda: encode(*args, **kwargs))

    def prepare_cond_latents_and_mask(self, *args, **kwargs):
        """HunyuanVideo15ImageToVideoPipeline's image latents (a VAE encode) and mask, once per run."""
        prepare = super().prepare_cond_latents_and_mask
        return _once(self, "prepare_cond_latents_and_mask", lambda: prepare(*args, **kwargs))

    def _requested_size(self, kwargs: dict) -> tuple[int, int] | None:
        """(height, width) when the pipeline sizes the video from its image (HunyuanVideo15ImageToVideoPipeline
        takes no height or width: it picks the bucket of `target_size` nearest the image's aspect)."""
        if "height" in inspect.signature(super().__call__).parameters:
            return None
        height, width = kwargs.pop("height", None), kwargs.pop("width", None)
        return None if height is None or width is None else (height, width)

    def _unpacked(self, kwargs: dict) -> dict:
        """Packed `prompt_embeds` / `negative_prompt_embeds` (no mask given) as the pipeline's eight arguments."""
        if kwargs.get("prompt_embeds") is None or kwargs.get("prompt_embeds_mask") is not None:
            return kwargs
        config = self.transformer.config
        sizes = (config.text_embed_dim, config.text_embed_2_dim, self.tokenizer_2_max_length)
        for prefix in ("", "negative_"):
            packed = kwargs.pop(f"{prefix}prompt_embeds", None)
            if packed is not None:
                kwargs.update({prefix + key: value for key, value in unpack_prompt(packed, *sizes).items()})
        return kwargs

    def _step_with_callback(self, step, callback):
        def stepped(model_output, timestep, sample, *args, **kwargs):
            output = step(model_output, timestep, sample, *args, **kwargs)
            latents = output[0] if isinstance(output, tuple) else output.prev_sample
            index = self.scheduler.step_index - 1  # the step just taken, counted over the whole run
            replaced = (callback(self, index, timestep, {"latents": latents}) or {}).get("latents")
            if replaced is None:
                return output
            return (replaced, *output[1:]) if isinstance(output, tuple) else type(output)(prev_sample=replaced)

        return stepped


def _once(pipe, name: str, compute):
    """`compute()` once per sampling run through the call object's `vidmem_once`; computed each time on a
    pipeline called directly (not through pipelines/sample_call.py)."""
    once = getattr(pipe, "vidmem_once", None)
    return once(name, compute) if once is not None else compute()


def _set_for_call(undo: ExitStack, owner: object, name: str, value: object) -> None:
    """`owner.name = value` until `undo` closes; then the instance's own value comes back, or the
    attribute is removed when it was the class's (a scheduler's `step`, a processor's method)."""
    if name in vars(owner):
        undo.callback(setattr, owner, name, vars(owner)[name])
    else:
        undo.callback(delattr, owner, name)
    setattr(owner, name, value)


def _call_guider(guider, guidance_scale: float | None):
    """A fresh guider for one call: the folder's settings, the call's scale; the negative pass
    only runs for a scale above 1 (vidmem encodes no negative prompt otherwise)."""
    if guidance_scale is None:
        return type(guider).from_config(guider.config)
    return type(guider).from_config(guider.config, guidance_scale=guidance_scale, enabled=guidance_scale > 1.0)


HUNYUAN_VIDEO15 = FamilySpec(
    name="hunyuanvideo1.5",
    pipeline_classes=("HunyuanVideo15Pipeline", "HunyuanVideo15ImageToVideoPipeline"),
    image_conditioned=("HunyuanVideo15ImageToVideoPipeline",),  # its own checkpoints (480p_i2v, 720p_i2v)
    denoisers=("transformer",),
    blocks_attr="transformer_blocks",
    # text_encoder_2 (ByT5, ~0.2B) runs only for quoted text; it follows the tier, like the image
    # encoder (SigLIP, I2V): the strategy's `text_encoder` input places Qwen, the large one.
    encoders=("text_encoder", "text_encoder_2", "image_encoder"),
    frame_step=4,  # latent frames (frames - 1) // 4 + 1, decoded back to 4k + 1 frames
    to_comfy_latent=_to_comfy_latent,
    to_vae_latent=_to_vae_latent,
    max_sequence_length=PROMPT_TOKENS,
    # Comfy-Org's repackaged files and Tencent's own, over a diffusers folder (comfy_files/hy15.py)
    single_file_transformer="HunyuanVideo15Transformer3DModel",
    call_adapter=HunyuanVideo15Call,
    attention_masked=True,  # joint attention and the token refiner mask the text padding
    vae_stages=hunyuan_video15_stages,  # the mid-block once over the whole latent, the rest streamed per tile
    # 16x VAE: a 64 px tile is 4 latent pixels. Tencent's own pipeline decodes 128 px tiles at the least (on GPUs
    # under 28 GiB, hyvideo/pipelines/hunyuan_video_pipeline.py, get_vae_inference_config): the planner and the
    # fallback ladder go no smaller (docs/decode.md).
    min_decode_tile=128,
    # The folders ship FlowMatchEulerDiscreteScheduler with shift 5 at 480p, 9 at 720p T2V, 7 at
    # 720p I2V, and a guider at cfg 6 (diffusers' scripts/convert_hunyuan_video1_5_to_diffusers.py);
    # one table per family, so 720p is advised the T2V figure. The folder's own shift runs unless `shift` is given.
    sampler=SamplerDefaults(flow_matching=True, schedulers=(), recommended_shift=((1280 * 720, 9.0), (0, 5.0)),
                            cfg=6.0, steps=50),
)
