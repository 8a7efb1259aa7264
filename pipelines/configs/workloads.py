"""What each stage runs, per family, on meta tensors: the calls the diffusers pipelines make.

Each function returns a zero-argument callable for `vidmem.memory.accounting.trace`: it creates
the tensors the pipeline creates in that stage (latents, embeddings, guidance copies) and calls
the meta modules the way `CogVideoXPipeline` / `WanPipeline` (and their image-to-video variants)
do in diffusers 0.42, so the ledger sees the same allocations. Tensors that exist before the
stage (a decode piece is a view of the whole latent) are made outside the callable.
"""

from __future__ import annotations

from typing import Callable

import torch

from ...memory.plan.planner import VideoShape

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


def clip_image(encoder, dtype: torch.dtype, size: int) -> Run:
    """WanImageToVideoPipeline.encode_image: the penultimate hidden state of a CLIP vision tower."""
    def run():
        pixels = _empty(1, 3, size, size, dtype=dtype)
        return encoder(pixel_values=pixels, output_hidden_states=True).hidden_states[-2]
    return run


def vae_encode_condition(vae, shape: VideoShape, frames: int, dtype: torch.dtype) -> Run:
    """Image-to-video conditioning: the image (CogVideoX) or the image plus empty frames (Wan)."""
    def run():
        video = _empty(1, 3, frames, shape.height, shape.width, dtype=dtype)
        return vae.encode(video).latent_dist.mode().repeat(shape.batch, 1, 1, 1, 1)
    return run


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
             image_tokens: int | None, expand_timesteps: bool, device: torch.device | str = "meta") -> Run:
    """One WanPipeline step: fp32 latents, cond and uncond as two passes of the same transformer."""
    config = transformer.config
    batch, channels, frames, height, width = latent

    def run():
        latents = _empty(*latent, dtype=torch.float32, device=device)
        text = _empty(batch, 512, config.text_dim, dtype=dtype, device=device)
        negative = _empty(batch, 512, config.text_dim, dtype=dtype, device=device) if shape.cfg else None
        image = _empty(batch, image_tokens, config.image_dim, dtype=dtype, device=device) if image_tokens else None
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
    if call.kind == "text_encode":
        return text_encode(model.traced_module(call.component), model.spec.max_sequence_length, shape, pad_copy=wan)
    if call.kind == "condition" and call.component == "image_encoder":
        size = model.components["image_encoder"].config.get("image_size", 224)
        return clip_image(model.traced_module("image_encoder"), dtype, size)
    if call.kind == "condition":
        whole_video = wan and not model.pipeline_config.get("expand_timesteps", False)
        return vae_encode_condition(model.traced_module("vae"), shape, shape.frames if whole_video else 1, model.dtype_of("vae"))
    if call.kind == "denoise":
        return _denoise(model, call.component, shape, call.chunks)
    if call.kind == "decode":
        piece = torch.empty(call.piece, dtype=model.dtype_of(call.component), device="meta")  # a view of the whole latent: not counted
        return decode(model.traced_module(call.component), piece, call.vae_tiling)
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


def denoise_step(model, component: str, shape: VideoShape, transformer, device: torch.device | str = "meta") -> Run:
    """One denoise step of `model` (a `MetaModel`) through `transformer`, as the pipeline runs it.

    On meta it is what the planner traces; given a real transformer and device (random inputs on
    that device) it is the same step for real, which is how the GPU suite and bench hold the
    planner's predicted peaks against measured ones, on the very same call.
    """
    config = model.components[component].config
    batch, channels, frames, height, width = model.latent_shape(shape)
    image = model.pipeline_class in model.spec.image_conditioned
    if model.spec.name == "cogvideox":
        patch_t = config.get("patch_size_t") or 1
        frames += (-frames) % patch_t  # CogVideoX 1.5 pads the latent to whole temporal patches
        return cogvideox_step(transformer, (batch, frames, channels, height, width), shape, model.dtype, image, device)
    condition = config.get("in_channels", channels) - channels
    image_tokens = 257 if config.get("image_dim") else None  # CLIP ViT-H/14 at 224 px: 16 x 16 patches + class token
    expand = bool(model.pipeline_config.get("expand_timesteps", False))
    return wan_step(transformer, (batch, channels, frames, height, width), shape, model.dtype, condition, image_tokens, expand,
                    device)
