"""What each stage runs, per family, on meta tensors: the calls the diffusers pipelines make.

Each function returns a zero-argument callable for `vidmem.memory.accounting.trace`: it creates
the tensors the pipeline creates in that stage (latents, embeddings, guidance copies) and calls
the meta modules the way `CogVideoXPipeline` / `WanPipeline` (and their image-to-video variants) /
`HunyuanVideo15Pipeline` do in diffusers 0.42, so the ledger sees the same allocations. Tensors
that exist before the stage (a decode piece is a view of the whole latent) are made outside the
callable. A new family adds its step here (a function, chosen in `denoise_step`) and, where its
prompt encoding differs from T5's, its text encoding (chosen in `workload_for`).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Callable

import torch

from ...memory.plan.planner import VideoShape
from .. import hunyuan_video15 as hy15
from .. import ltx2
from ..hunyuan_video15_attention import key_masked_attention

Run = Callable[[], object]
GUIDANCE = 6.0


def _empty(*shape: int, dtype: torch.dtype, device: torch.device | str = "meta") -> torch.Tensor:
    """A tensor the pipeline would create: shape only on meta; on a real device, random values
    (never uninitialised memory, which can hold NaNs and take slower kernel paths), drawn in
    `dtype` so the device allocates what the traced step does: a float32 draw cast down made a
    temporary the planner never saw, enough to move the caching allocator's segments (Wan 1.3B
    sequential, guidance on: 2.39 GiB reserved planned with it, 2.57 without; docs/gpu.md)."""
    if torch.device(device).type == "meta":
        return torch.empty(shape, dtype=dtype, device="meta")
    return torch.randn(shape, dtype=dtype, device=device)


def text_encode(encoder, tokens: int, shape: VideoShape, pad_copy: bool) -> Run:
    """encode_prompt: prompt, then the negative prompt (cfg), batch 1 each, repeated per video.

    `pad_copy`: Wan trims each embedding to its true length and pads it back (one more copy).
    """
    def run():
        embeds = []
        for _ in range(2 if shape.cfg else 1):
            ids = torch.zeros((1, tokens), dtype=torch.long, device="meta")
            out = encoder(ids).last_hidden_state  # the attention mask is left out: meta cannot read it
            if pad_copy:
                out = torch.stack([torch.cat([out[0], out.new_zeros(0, out.shape[-1])])])
            embeds.append(out.repeat(1, shape.batch, 1).view(shape.batch, tokens, -1))
        return embeds
    return run


def qwen_text_encode(encoder, shape: VideoShape) -> Run:
    """HunyuanVideo15Pipeline._get_mllm_prompt_embeds: the chat template and prompt padded to a fixed
    length, every hidden state kept (`output_hidden_states`), one of them cropped past the template."""
    tokens = hy15.TEMPLATE_TOKENS + hy15.PROMPT_TOKENS

    def run():
        embeds = []
        for _ in range(2 if shape.cfg else 1):
            ids = torch.zeros((1, tokens), dtype=torch.long, device="meta")
            states = encoder(input_ids=ids, output_hidden_states=True).hidden_states
            embeds.append(states[-(hy15.QWEN_SKIPPED_LAYERS + 1)][:, hy15.TEMPLATE_TOKENS:].repeat(1, shape.batch, 1))
            del states
        return embeds
    return run


def gemma_text_encode(encoder, shape: VideoShape) -> Run:
    """LTX2Pipeline._get_gemma_prompt_embeds: the whole Gemma 3 forward (its logits included, as the
    pipeline calls it), every layer's hidden state stacked and flattened into one embedding."""
    def run():
        embeds = []
        for _ in range(2 if shape.cfg else 1):
            ids = torch.zeros((1, ltx2.PROMPT_TOKENS), dtype=torch.long, device="meta")
            # the padding mask is left out: transformers reads its values to pick a mask, meta cannot
            states = encoder(input_ids=ids, output_hidden_states=True).hidden_states
            embeds.append(torch.stack(states, dim=-1).flatten(2, 3).repeat(1, shape.batch, 1))
            del states
        return embeds
    return run


def clip_image(encoder, dtype: torch.dtype, size: int) -> Run:
    """WanImageToVideoPipeline.encode_image: the penultimate hidden state of a CLIP vision tower."""
    def run():
        pixels = _empty(1, 3, size, size, dtype=dtype)
        return encoder(pixel_values=pixels, output_hidden_states=True).hidden_states[-2]
    return run


def siglip_image(encoder, dtype: torch.dtype, size: int) -> Run:
    """HunyuanVideo15ImageToVideoPipeline._get_image_embeds: SigLIP's last hidden state."""
    def run():
        return encoder(pixel_values=_empty(1, 3, size, size, dtype=dtype)).last_hidden_state
    return run


def vae_encode_condition(vae, shape: VideoShape, dtype: torch.dtype) -> Run:
    """Image-to-video conditioning encoded on its own: the image as one frame (CogVideoX, Wan 2.2 TI2V; Wan's
    whole-clip conditioning is `wan_condition_video`)."""
    def run():
        video = _empty(1, 3, 1, shape.height, shape.width, dtype=dtype)
        return vae.encode(video).latent_dist.mode().repeat(shape.batch, 1, 1, 1, 1)
    return run


def wan_condition_video(vae, shape: VideoShape, latent: tuple[int, ...], dtype: torch.dtype, last_image: bool) -> Run:
    """WanImageToVideoPipeline.prepare_latents as vidmem runs it (pipelines/sample_call.py): the noise
    latents drawn (fp32), the image (and `last_image`) preprocessed in fp32 and cast to the VAE's `dtype`,
    empty frames made and concatenated with them in that dtype into the whole clip, the VAE's per-channel
    mean and reciprocal std (fp32), then the encode. While the concatenation runs the clip exists twice
    (the empty frames and the result), the peak of a long clip; the cast keeps both at the VAE's 2 bytes
    a value, not float32's 4."""
    height, width, images = shape.height, shape.width, 2 if last_image else 1
    channels = (1, latent[1], 1, 1, 1)

    def run():
        latents = _empty(*latent, dtype=torch.float32)
        pixels = [_empty(1, 3, height, width, dtype=torch.float32) for _ in range(images)]  # diffusers' preprocess
        first, *last = [image.to(dtype).unsqueeze(2) for image in pixels]
        video = torch.cat([first, first.new_zeros(1, 3, shape.frames - images, height, width), *last], dim=2)
        mean, inverse_std = _empty(*channels, dtype=torch.float32), 1.0 / _empty(*channels, dtype=torch.float32)
        encoded = vae.encode(video).latent_dist.mode().repeat(shape.batch, 1, 1, 1, 1)
        return latents, mean, inverse_std, encoded
    return run


def takes_last_image(model) -> bool:
    """Whether `model` (a `MetaModel`) can take a last frame, by its family's own rule (FamilySpec.last_frame_error,
    which reads the pipeline's and the first denoiser's configs): Wan 2.1 FLF2V must, Wan 2.2 I2V A14B may.
    The planner traces the larger conditioning of the two: one float32 frame more."""
    denoiser = model.components[model.layout.denoisers[0]]
    as_pipe = SimpleNamespace(transformer=SimpleNamespace(config=denoiser.config), transformer_2=None,
                              config=model.pipeline_config)
    return model.spec.last_frame_error(as_pipe, True) is None


def cogvideox_step(transformer, latent: tuple[int, ...], shape: VideoShape, dtype: torch.dtype, image: bool,
                   device: torch.device | str = "meta") -> Run:
    """One CogVideoXPipeline step: cfg as one batch of 2, fp32 noise prediction, scheduler update."""
    config = transformer.config
    batch, frames, channels, height, width = latent
    rope = _cogvideox_rope(config, frames, height, width, device) if config.use_rotary_positional_embeddings else None

    def run():
        latents = _empty(*latent, dtype=dtype, device=device)
        embeds = _empty(batch * (2 if shape.cfg else 1), config.max_text_seq_length, config.text_embed_dim, dtype=dtype, device=device)
        model_input = torch.cat([latents] * 2) if shape.cfg else latents
        if image:
            image_latents = _empty(*latent, dtype=dtype, device=device)
            model_input = torch.cat([model_input, torch.cat([image_latents] * 2) if shape.cfg else image_latents], dim=2)
        timestep = torch.zeros((model_input.shape[0],), dtype=torch.long, device=device)
        ofs = None if config.ofs_embed_dim is None else latents.new_full((1,), 2.0)
        noise = transformer(hidden_states=model_input, encoder_hidden_states=embeds, timestep=timestep, ofs=ofs,
                            image_rotary_emb=rope, return_dict=False)[0].float()
        if shape.cfg:
            uncond, text = noise.chunk(2)
            noise = uncond + GUIDANCE * (text - uncond)
        return (latents.float() - 0.1 * noise).to(dtype)  # the scheduler's update, latent-sized temporaries
    return run


def _cogvideox_rope(config, frames: int, height: int, width: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    p, p_t = config.patch_size, config.patch_size_t or 1
    tokens = (frames // p_t) * (height // p) * (width // p)
    return (_empty(tokens, config.attention_head_dim, dtype=torch.float32, device=device),
            _empty(tokens, config.attention_head_dim, dtype=torch.float32, device=device))


def wan_step(transformer, latent: tuple[int, ...], shape: VideoShape, dtype: torch.dtype, condition_channels: int,
             image_tokens: tuple[int, int] | None, expand_timesteps: bool, device: torch.device | str = "meta") -> Run:
    """One WanPipeline step: fp32 latents, cond and uncond as two passes of the same transformer.
    `image_tokens`: (images, CLIP tokens per image) for Wan 2.1 I2V and FLF2V, whose image embedder
    takes the images as batch entries."""
    config = transformer.config
    batch, channels, frames, height, width = latent

    def run():
        latents = _empty(*latent, dtype=torch.float32, device=device)
        text = _empty(batch, 512, config.text_dim, dtype=dtype, device=device)
        negative = _empty(batch, 512, config.text_dim, dtype=dtype, device=device) if shape.cfg else None
        image = _empty(batch * image_tokens[0], image_tokens[1], config.image_dim, dtype=dtype, device=device) \
            if image_tokens else None
        if condition_channels:
            condition = _empty(batch, condition_channels, frames, height, width, dtype=dtype, device=device)
            model_input = torch.cat([latents, condition], dim=1).to(dtype)
        else:
            model_input = latents.to(dtype)
        if expand_timesteps:
            tokens = frames * (height // config.patch_size[1]) * (width // config.patch_size[2])
            timestep = _empty(tokens, dtype=torch.float32, device=device).unsqueeze(0).expand(batch, -1)
        else:
            timestep = torch.zeros((batch,), dtype=torch.long, device=device)
        noise = transformer(hidden_states=model_input, timestep=timestep, encoder_hidden_states=text,
                            encoder_hidden_states_image=image, return_dict=False)[0]
        if negative is not None:
            uncond = transformer(hidden_states=model_input, timestep=timestep, encoder_hidden_states=negative,
                                 encoder_hidden_states_image=image, return_dict=False)[0]
            noise = uncond + GUIDANCE * (noise - uncond)
        return latents - 0.1 * noise.float()  # flow-matching scheduler update in fp32
    return run


def hunyuan15_step(transformer, latent: tuple[int, ...], shape: VideoShape, dtype: torch.dtype,
                   device: torch.device | str = "meta") -> Run:
    """One HunyuanVideo15Pipeline step: latents, zero condition latents and mask concatenated in
    the transformer's dtype, cond and uncond as two passes (the guider), a flow-matching update."""
    config = transformer.config
    batch, channels, frames, height, width = latent

    def run():
        latents = _empty(*latent, dtype=dtype, device=device)
        model_input = torch.cat([latents, torch.zeros_like(latents), latents.new_zeros(batch, 1, frames, height, width)], dim=1)
        image = torch.zeros((batch, hy15.IMAGE_TOKENS, config.image_embed_dim), dtype=dtype, device=device)
        timestep = torch.zeros((batch,), dtype=dtype, device=device)
        preds = []
        for _ in range(2 if shape.cfg else 1):
            text = _empty(batch, hy15.PROMPT_TOKENS, config.text_embed_dim, dtype=dtype, device=device)
            glyphs = _empty(batch, hy15.GLYPH_TOKENS, config.text_embed_2_dim, dtype=dtype, device=device)
            masks = (torch.ones((batch, hy15.PROMPT_TOKENS), dtype=dtype, device=device),
                     torch.ones((batch, hy15.GLYPH_TOKENS), dtype=dtype, device=device))
            preds.append(_hunyuan15_forward(transformer, model_input, timestep, text, glyphs, image, masks))
        noise = preds[0] if len(preds) == 1 else preds[1] + GUIDANCE * (preds[0] - preds[1])
        return (latents.float() - 0.1 * noise).to(dtype)  # FlowMatchEulerDiscreteScheduler.step upcasts to fp32
    return run


def _hunyuan15_forward(transformer, hidden_states, timestep, text, glyphs, image, masks) -> torch.Tensor:
    """HunyuanVideo15Transformer3DModel.forward with shapes only: diffusers reorders the text tokens
    by their masks (valid first) and tests whether the image embeddings are all zero, which meta
    tensors cannot answer; the reordered tokens are the same count, so a concatenation allocates
    what the reorder does. Every module runs as in diffusers (same hooks, same order)."""
    t = transformer
    batch, _, frames, height, width = hidden_states.shape
    rotary = t.rope(hidden_states)
    temb = t.time_embed(timestep, timestep_r=None)
    hidden_states = t.x_embedder(hidden_states)
    kinds = lambda x, kind: t.cond_type_embed(torch.full_like(x[:, :, 0], kind, dtype=torch.long))  # noqa: E731
    text = t.context_embedder(text, timestep, masks[0])
    text = text + kinds(text, 0)
    glyphs = t.context_embedder_2(glyphs)
    glyphs = glyphs + kinds(glyphs, 1)
    image = t.image_embedder(image) * 0.0
    image = image + kinds(image, 2)
    context = torch.cat([image, glyphs, text], dim=1)
    mask = torch.cat([torch.zeros(image.shape[:2], dtype=torch.bool, device=image.device), masks[1].bool(), masks[0].bool()], dim=1)
    with key_masked_attention(t):  # as the sampler's call adapter runs the blocks
        for block in t.transformer_blocks:
            hidden_states, context = block(hidden_states, context, temb, mask, rotary)
    hidden_states = t.proj_out(t.norm_out(hidden_states, temb))
    return hidden_states.reshape(batch, frames, height, width, -1).permute(0, 4, 1, 2, 3)


def ltx2_connectors(connectors, shape: VideoShape, dtype: torch.dtype) -> Run:
    """LTX2Pipeline's call, before its loop: the connectors over Gemma's stacked layers (negative
    and positive as one batch), left padding as Gemma's tokenizer pads."""
    config = connectors.config

    def run():
        passes = shape.batch * (2 if shape.cfg else 1)
        states = _empty(passes, ltx2.PROMPT_TOKENS, config.caption_channels * config.text_proj_in_factor, dtype=dtype)
        mask = torch.ones((passes, ltx2.PROMPT_TOKENS), dtype=torch.long, device="meta")
        return connectors(states, mask, padding_side="left")
    return run


def ltx2_step(transformer, connectors_config: dict, latent: tuple[int, ...], shape: VideoShape, dtype: torch.dtype,
              image: bool = False, device: torch.device | str = "meta") -> Run:
    """One LTX2Pipeline step, video only: packed video and audio tokens (the audio branch runs with
    the video's: pipelines/ltx2.py), cfg as one batch of two, fp32 predictions, the x0 guidance
    arithmetic and two scheduler updates (video and audio).

    `image`: LTX2ImageToVideoPipeline's step. It keeps the first latent frame clean by giving the
    transformer one timestep per video token (`timestep.unsqueeze(-1) * (1 - conditioning_mask)`, fp32;
    the audio keeps one per video), so the transformer builds its modulation per token, once and in
    every block: twice the text-to-video peak at 768x512x121 (4.2 GiB against 2.0). Its scheduler then
    updates every frame but the first."""
    config = transformer.config
    batch, channels, frames, height, width = latent
    video_tokens = frames * height * width  # patch sizes 1 (the LTX-2 checkpoints)
    audio_frames = ltx2.audio_latent_frames(shape.frames, config.audio_sampling_rate, config.audio_hop_length,
                                            config.audio_scale_factor)
    passes = batch * (2 if shape.cfg else 1)
    connector_width = lambda kind: (connectors_config[f"{kind}_connector_num_attention_heads"]  # noqa: E731
                                    * connectors_config[f"{kind}_connector_attention_head_dim"])  # output width
    video_width, audio_width = connector_width("video"), connector_width("audio")
    first_frame = height * width if image else 0  # the tokens the image-to-video update leaves as they are

    def run():
        latents = _empty(batch, video_tokens, channels, dtype=torch.float32, device=device)
        audio = _empty(batch, audio_frames, config.audio_in_channels, dtype=torch.float32, device=device)
        repeat = lambda x: (torch.cat([x] * 2) if shape.cfg else x).to(dtype)  # noqa: E731
        text = _empty(passes, ltx2.PROMPT_TOKENS, video_width, dtype=dtype, device=device)
        audio_text = _empty(passes, ltx2.PROMPT_TOKENS, audio_width, dtype=dtype, device=device)
        mask = torch.ones((passes, ltx2.PROMPT_TOKENS), dtype=torch.long, device=device)
        timestep = torch.zeros((passes,), dtype=torch.float32, device=device)
        video_timestep = _ltx2_video_timestep(timestep, passes, video_tokens, first_frame) if image else timestep
        video_pred, audio_pred = transformer(
            hidden_states=repeat(latents), audio_hidden_states=repeat(audio), encoder_hidden_states=text,
            audio_encoder_hidden_states=audio_text, timestep=video_timestep, audio_timestep=timestep, sigma=timestep,
            encoder_attention_mask=mask, audio_encoder_attention_mask=mask, num_frames=frames, height=height,
            width=width, fps=24.0, audio_num_frames=audio_frames, return_dict=False,
            use_cross_timestep=ltx2.cross_timestep(connectors_config))
        updated = []
        for state, pred, kept in ((latents, video_pred.float(), first_frame), (audio, audio_pred.float(), 0)):
            if shape.cfg:
                uncond, cond = pred.chunk(2)
                x0, x0_uncond = state - cond * 0.5, state - uncond * 0.5
                pred = x0 + (GUIDANCE - 1) * (x0 - x0_uncond)
                pred = (state - pred) / 0.5
            stepped = state[:, kept:] - 0.1 * pred[:, kept:]  # FlowMatchEulerDiscreteScheduler.step in fp32
            updated.append(torch.cat([state[:, :kept], stepped], dim=1) if kept else stepped)
        return updated
    return run


def _ltx2_video_timestep(timestep: torch.Tensor, passes: int, tokens: int, first_frame: int) -> torch.Tensor:
    """LTX2ImageToVideoPipeline's per-token video timestep: its conditioning mask (fp32, 1 on the first
    latent frame's tokens, made before the loop and repeated for cfg) turned into timesteps."""
    conditioning = torch.zeros((passes, tokens), dtype=torch.float32, device=timestep.device)
    conditioning[:, :first_frame] = 1.0
    return timestep.unsqueeze(-1) * (1 - conditioning)


def decode(vae, piece: torch.Tensor, own_tiling: bool) -> Run:
    """One `vae.decode` call; `own_tiling` switches on the VAE's own (diffusers) tiling for it."""
    def run():
        if own_tiling:
            vae.enable_tiling()
        try:
            return vae.decode(piece).sample
        finally:
            if own_tiling:
                vae.disable_tiling()
    return run


def staged_decode(stages, kind: str, piece: tuple[int, ...], dtype: torch.dtype, parked: bool = False) -> Run:
    """A family's staged decode as vidmem runs it (pipelines.decode.vae_decoder): "decode_context", its
    frame-wide layers once on the whole latent `piece` (their output, the features, left on the device; when
    `parked` and the family makes them a frame at a time (`context_frames`: Wan), each frame leaves the device
    as it is made); "decode_stream", a fresh stream over one piece of those features, copied to the device
    for the call (a view of the latent, not counted, where the family has no frame-wide layers: CogVideoX)."""
    latent = torch.empty(piece, dtype=dtype, device="meta")
    if kind == "decode_context" and parked and hasattr(stages, "context_frames"):
        return lambda: all(True for _ in stages.context_frames(latent))  # each frame copied to the host, then dropped
    if kind == "decode_context":  # made whole on the device (HunyuanVideo 1.5 moves it at the end)
        return lambda: stages.context(latent)
    if stages.context is None:
        return lambda: stages.stream()(latent)
    features = stages.context(latent)  # its shape only: built here, outside the trace

    def run():
        return stages.stream()(torch.empty_like(features))
    return run


def postprocess(shape: VideoShape, out_frames: int, spatial_factor: int) -> Run:
    """Host side of vidmem's decode: the float32 frame buffer, postprocess_video, the IMAGE copy."""
    from diffusers.video_processor import VideoProcessor

    processor = VideoProcessor(vae_scale_factor=spatial_factor)

    def run():
        video = torch.zeros((shape.batch, 3, out_frames, shape.height, shape.width), dtype=torch.float32, device="meta")
        frames = processor.postprocess_video(video, output_type="pt")
        return frames.flatten(0, 1).permute(0, 2, 3, 1).float().contiguous()
    return run


def workload_for(model, call) -> Run:
    """The callable that runs `call` on `model`'s meta components (a `MetaModel`)."""
    shape, dtype, wan = call.shape, model.dtype, model.spec.name == "wan"
    if call.kind == "text_encode" and model.components[call.component].class_name == "Qwen2_5_VLTextModel":
        return qwen_text_encode(model.traced_module(call.component), shape)
    if call.kind == "text_encode" and model.components[call.component].class_name == "Gemma3ForConditionalGeneration":
        return gemma_text_encode(model.traced_module(call.component), shape)
    if call.kind == "text_encode":
        return text_encode(model.traced_module(call.component), model.spec.max_sequence_length, shape, pad_copy=wan)
    if call.kind == "condition" and call.component == "connectors":
        return ltx2_connectors(model.traced_module("connectors"), shape, dtype)
    if call.kind == "condition" and call.component == "image_encoder":
        config = model.components["image_encoder"]
        size = config.config.get("image_size", 224)
        if config.class_name == "SiglipVisionModel":
            return siglip_image(model.traced_module("image_encoder"), dtype, size)
        return clip_image(model.traced_module("image_encoder"), dtype, size)
    if call.kind == "condition" and wan and not model.pipeline_config.get("expand_timesteps", False):
        return wan_condition_video(model.traced_module("vae"), shape, model.latent_shape(shape), model.dtype_of("vae"),
                                   takes_last_image(model))
    if call.kind == "condition":
        return vae_encode_condition(model.traced_module("vae"), shape, model.dtype_of("vae"))
    if call.kind == "denoise":
        return _denoise(model, call.component, shape, call.chunks)
    if call.kind == "decode":
        piece = torch.empty(call.piece, dtype=model.dtype_of(call.component), device="meta")  # a view of the whole latent: not counted
        return decode(model.traced_module(call.component), piece, call.vae_tiling)
    if call.kind in ("decode_context", "decode_stream"):
        return staged_decode(model.spec.vae_stages(model.traced_module(call.component)), call.kind, call.piece,
                             model.dtype_of(call.component), call.parked)
    if call.kind == "postprocess":
        latent = model.latent_shape(shape)
        return postprocess(shape, model.geometry.frames(latent[2]), model.geometry.spatial_factor)
    raise ValueError(f"unknown call kind {call.kind!r}")


def _denoise(model, component: str, shape: VideoShape, chunks: int = 1) -> Run:
    run = denoise_step(model, component, shape, model.traced_module(component))
    return run if chunks == 1 else chunked(model, component, run, chunks)


def chunked(model, component: str, run: Run, chunks: int) -> Run:
    """`run` with the traced denoiser's blocks computing in `chunks` token slices, as the engine runs them."""
    from ..activation_chunks import activation_chunks

    transformer = model.traced_module(component)
    blocks = {component: getattr(transformer, model.spec.blocks_attr)}

    def run_chunked():
        with activation_chunks({component: transformer}, blocks, chunks):
            return run()
    return run_chunked


def denoise_step(model, component: str, shape: VideoShape, transformer, device: torch.device | str = "meta",
                 per_sample_timesteps: bool = False) -> Run:
    """One denoise step of `model` (a `MetaModel`) through `transformer`, as the pipeline runs it.

    `per_sample_timesteps`: one timestep per sample, as the LoRA trainer calls the transformer
    (training/objective.py), where Wan 2.2 TI2V's pipeline gives one per token (`expand_timesteps`):
    the same result for text-to-video, without the per-token time projection's memory.

    On meta it is what the planner traces; given a real transformer and device (random inputs on
    that device) it is the same step for real, which is how the GPU suite and bench hold the
    planner's predicted peaks against measured ones, on the very same call.
    """
    config = model.components[component].config
    batch, channels, frames, height, width = model.latent_shape(shape)
    image = model.pipeline_class in model.spec.image_conditioned
    if model.spec.name == ltx2.LTX2.name:
        return ltx2_step(transformer, model.components["connectors"].config, (batch, channels, frames, height, width),
                         shape, model.dtype, image, device)
    if model.spec.name == hy15.HUNYUAN_VIDEO15.name:
        return hunyuan15_step(transformer, (batch, channels, frames, height, width), shape, model.dtype, device)
    if model.spec.name == "cogvideox":
        patch_t = config.get("patch_size_t") or 1
        frames += (-frames) % patch_t  # CogVideoX 1.5 pads the latent to whole temporal patches
        return cogvideox_step(transformer, (batch, frames, channels, height, width), shape, model.dtype, image, device)
    condition = config.get("in_channels", channels) - channels
    # CLIP ViT-H/14 at 224 px: 16 x 16 patches + class token. Wan 2.1 FLF2V positions a first and a
    # last image: its pos_embed has a row per token of both.
    images = 2 if config.get("pos_embed_seq_len") else 1
    tokens = config["pos_embed_seq_len"] // 2 if images == 2 else 257
    image_tokens = (images, tokens) if config.get("image_dim") else None
    expand = bool(model.pipeline_config.get("expand_timesteps", False)) and not per_sample_timesteps
    return wan_step(transformer, (batch, channels, frames, height, width), shape, model.dtype, condition, image_tokens, expand,
                    device)
