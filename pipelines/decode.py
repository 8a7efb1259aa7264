"""Decode a LATENT to ComfyUI IMAGE frames [F, H, W, C] in 0..1, honouring slicing and tiling."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

import torch

from ..memory import MemoryStrategy, OffloadTier, StageComponents, apply_strategy, resolve_compute_device
from ..memory.blockswap import Observer
from ..memory.device import Backend
from ..memory.telemetry import StageMeter, free_device_bytes
from ..memory.cleanup import free_memory
from ..memory.hostpool import HostPool, pinned_cap_bytes
from ..memory.vae import Decode, DecodeReport, PinnedLanding, Prepare, Streaming, VaeGeometry, decode_with_fallback
from ..memory.offload import device_weight_bytes, stage_tensors
from ..memory.strategy import family_tiling
from ..memory.units import GiB
from ..memory.warm import WarmStore, WarmStoreBusy, call_on
from .family import FamilySpec, ModelError
from .hooks import RunHooks, interrupt_checks, outer_blocks
from .latents import check_latent
from .loader import LoadedPipeline
from .planning import decode_overrun
from .room import decode_room

log = logging.getLogger("vidmem")

# Decoding with no strategy connected: the whole VAE on the device, as diffusers does.
DEFAULT_DECODE_STRATEGY = MemoryStrategy(offload=OffloadTier.NONE)


@dataclass
class DecodeResult:
    frames: torch.Tensor
    receipt: dict = field(default_factory=dict)


def latent_channels(pipe) -> int:
    config = pipe.vae.config
    return config.get("latent_channels") or config.get("z_dim")


def validate_latent(loaded: LoadedPipeline, latent: dict) -> torch.Tensor:
    """The LATENT must be this pipeline's: 5-D [B, C, T, h, w], finite, its VAE's channels, its family."""
    samples = check_latent(latent)  # a dict with a 5-D `samples` tensor
    if samples.numel() == 0:
        raise ModelError(
            f"latent samples {tuple(samples.shape)} are empty, so they are not a video latent; "
            "connect the LATENT from a VidMem Video Sampler or core Load Latent."
        )
    if not samples.is_floating_point():
        raise ModelError(f"latent samples have dtype {samples.dtype}; a video latent holds floating-point values.")
    metadata = latent.get("vidmem")
    origin = metadata.get("family") if isinstance(metadata, dict) else None
    if origin is not None and origin != loaded.spec.name:
        raise ModelError(f"latent came from a {origin} model but the pipeline is {loaded.spec.name}; decode it with the {origin} pipeline.")
    _check_scaling_factor(loaded, metadata)
    expected = latent_channels(loaded.pipe)
    if samples.shape[1] != expected:
        raise ModelError(
            f"latent has {samples.shape[1]} channels but {loaded.describe()} decodes {expected}; "
            "decode with the pipeline that sampled it."
        )
    if not torch.isfinite(samples).all():
        bad = int((~torch.isfinite(samples)).sum())
        raise ModelError(
            f"latent contains {bad} NaN or infinite values; decoding would give NaN frames. "
            "Sample it again (check cfg and the sampler's inputs) or load a saved latent that is intact."
        )
    return samples


def _check_scaling_factor(loaded: LoadedPipeline, metadata) -> None:
    """Same family and channels do not make the same latent space: CogVideoX-2b's VAE scales latents by
    1.15258426, 5B's and 1.5's by 0.7, so a 2b latent decoded by the others is off in every pixel. The
    Sampler records its VAE's factor; a latent without it (older, or a VAE without one) is not checked."""
    recorded = metadata.get("vae_scaling_factor") if isinstance(metadata, dict) else None
    own = loaded.pipe.vae.config.get("scaling_factor")
    if not isinstance(recorded, (int, float)) or not isinstance(own, (int, float)) or abs(recorded - own) <= 1e-6 * abs(own):
        return
    raise ModelError(f"latent was sampled by a VAE with scaling_factor {recorded} but {loaded.describe()}'s VAE has "
                     f"{own}, so it would decode to wrong colours; decode it with the pipeline that sampled it "
                     "(CogVideoX-2b latents need the 2b pipeline, 5B and 1.5 latents theirs).")


def geometry(pipe) -> VaeGeometry:
    return VaeGeometry(pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal, latent_channels(pipe))


def pinned_landing(backend: Backend, strategy: MemoryStrategy, pool: HostPool) -> PinnedLanding | None:
    """Pinned memory for landing decoded pieces while the next decodes, within the strategy's pinned ceiling less
    what the pipeline's pool already pinned (None where the backend does not pin: the CPU)."""
    if not backend.can_pin:
        return None
    ceiling = pinned_cap_bytes(strategy.max_pinned_ram_gb, pool.host_room_bytes)
    return PinnedLanding(backend.pin_arena, max(0, ceiling - pool.pinned_bytes))


def vae_decoder(spec: FamilySpec, vae) -> tuple[Decode | Streaming, Prepare | None]:
    """How vidmem runs this VAE on a piece: the family's declared stages (a streamed decode, and
    the frame-wide layers to run once) or, for a layout they do not know, `vae.decode` per piece."""
    stages = spec.vae_stages(vae)
    if stages is None:
        return (lambda chunk: vae.decode(chunk).sample), None
    return Streaming(stages.stream, stages.frame_batch), stages.context


@torch.no_grad()
def decode(
    loaded: LoadedPipeline,
    latent: dict,
    strategy: MemoryStrategy | None = None,
    backend: Backend | None = None,
    observer: Observer | None = None,
    device: torch.device | None = None,
    hooks: RunHooks = RunHooks(),
    free_bytes: int | None = None,
) -> DecodeResult:
    """Decode on `device` (default: CUDA when present), or on a given `backend`.

    Before anything runs, ladder rungs the planner predicts to overrun the free device memory are
    skipped (and listed in the receipt). `free_bytes` is measured once the VAE and the latent are
    on a CUDA device; elsewhere there is no prediction unless it is given. Where the hooks' budget
    binds, the Sampler's kept weights give back what the decode's room lacks first (`leave_the_budget`).
    """
    samples = validate_latent(loaded, latent)
    strategy, tiling_note = tiling_for_family(loaded, strategy or DEFAULT_DECODE_STRATEGY)
    backend = backend or loaded.backend(device or resolve_compute_device())
    device = backend.device
    pipe, vae = loaded.pipe, loaded.pipe.vae
    report = DecodeReport()
    stage = StageComponents({"vae": vae})
    hooks.check_interrupt()
    room = decode_room(loaded, tuple(samples.shape), strategy, device_weight_bytes(stage, strategy), device)
    warm = loaded.warm_store("decode", backend)  # the VAE as the last decode left it on the device
    released = 0
    if warm is not None:  # image-to-video's sampler keeps the VAE too (it encodes the image): one copy, taken over
        sampler_store = loaded.warm_store("sample", backend)
        warm.share_with(sampler_store)
        warm.retain(stage_tensors(stage), take_over=True, device=backend.device)  # the VAE, its only component, stays to the end
        # the decode store's copies are allocated already and part of the room's weights
        released = leave_the_budget(sampler_store, hooks, device, room.total_bytes - warm.held_bytes)
    hooks.make_room(room.total_bytes, device, warm=warm, weight_bytes=room.weight_bytes)  # weights + activations
    loaded.host_pool.host_room_bytes = hooks.pinned_room()  # the host's pool changes between runs

    def on_step(done: int, total: int) -> None:
        hooks.on_step(done, total)
        hooks.check_interrupt()

    decode_piece, prepare = vae_decoder(loaded.spec, vae)
    # Cancel is checked between pieces (on_step) and, inside a piece, before each VAE block.
    with interrupt_checks(outer_blocks(vae), hooks.check_interrupt), call_on(warm, backend), \
            apply_strategy(stage, strategy, backend, observer, loaded.host_pool, warm=warm,
                           unpin_beyond_ceiling=False) as handle:  # the pool's homes are the sampler's
        handle.activate("vae")

        def decode_on_cpu():
            """Last rung of the ladder: take the strategy off (weights back on their host
            storage); the ladder moves the latent there too."""
            handle.remove()
            return decode_piece

        with StageMeter("decode", device) as meter:
            z = loaded.spec.to_vae_latent(pipe, samples.to(device, vae.dtype))
            free = free_bytes if free_bytes is not None else _free_for_rungs(hooks, device)
            video = decode_with_fallback(
                decode_piece,
                z,
                geometry(pipe),
                strategy.vae_tiling,
                strategy.vae_slicing,
                free_memory=lambda: free_memory(device),
                to_cpu=decode_on_cpu if device.type != "cpu" else None,
                prepare=prepare,
                predict=decode_overrun(loaded, tuple(z.shape), strategy, free) if free is not None else None,
                report=report,
                on_step=on_step,
                pinned=pinned_landing(backend, strategy, loaded.host_pool),
                min_tile=loaded.spec.min_decode_tile,
            )
    frames = pipe.video_processor.postprocess_video(video, output_type="pt")  # [B, F, C, H, W] in 0..1
    frames = frames.flatten(0, 1).permute(0, 2, 3, 1).float().contiguous()
    receipt = {"strategy": decode_as_run(strategy, report, device), "device": str(device),
               "stages": [meter.as_dict()], "decode": report.as_dict(), "decode_summary": report.describe(),
               "room": room.as_dict()}
    if tiling_note:
        receipt["tiling_note"] = tiling_note
    if released:
        receipt["budget_released_bytes"] = released
    if warm is not None:
        receipt["warm"] = warm.as_dict()
    return DecodeResult(frames, receipt)


def leave_the_budget(sampler_store: WarmStore, hooks: RunHooks, device: torch.device, need_bytes: int) -> int:
    """Within a vram_budget_gb that binds (the budgeted figure below the device's free memory), the copies the
    Sampler's store kept (the transformer under tiers none and model) give back what the decode's room
    (`need_bytes`: weights not yet on the device plus activations) lacks; returns the bytes dropped.

    Why: the planner's decode phase holds only the VAE and the latent, but the kept copies count in the budgeted
    figure, and ComfyUI (make_room) unloads only when physical memory runs short, so on a card larger than the
    budget nothing evicted them: the ladder skipped rungs the plan predicted to fit, and the device stayed above
    the budget through the decode. Without a budget, or one above the card, the copies stay for the next Sampler
    call and ComfyUI takes them back when it needs the room."""
    budgeted, free = hooks.device_budget(device), free_device_bytes(device)
    if budgeted is None or free is None or budgeted >= free or need_bytes <= budgeted:
        return 0
    try:
        released = sampler_store.release(need_bytes - budgeted)  # streamed blocks first, then idle cores
    except WarmStoreBusy:  # a Sampler call on another thread holds it: it gives them back when it ends
        return 0
    log.info("vidmem: decode within the VRAM budget: released %.2f GiB the Sampler kept on the device",
             released / GiB)
    return released


def _free_for_rungs(hooks: RunHooks, device: torch.device) -> int | None:
    """What the ladder's rungs may take: the hooks' budget (the Decode node's: free memory within the user's
    vram_budget_gb, as the Sampler's), else the device's free memory."""
    budget = hooks.device_budget(device)
    return budget if budget is not None else free_device_bytes(device)


def decode_as_run(strategy: MemoryStrategy, report: DecodeReport, device: torch.device) -> str:
    """The receipt's strategy line: how the VAE decode ran, not every widget of the Strategy. The VAE is one
    component without transformer blocks, so block_swap places it as model does (whole, for the decode) and
    blocks_to_swap, the text encoder's placement and activation chunks do not apply; the fallback ladder may
    have changed the tiling, the slicing and the device (`report`, filled in by the rung that ran)."""
    parts = [_vae_placement(strategy, report, device)]
    t = report.tiling
    if t is not None:
        parts.append(f"vae_tiling={t.tile_size}/{t.overlap}px,{t.temporal_size}/{t.temporal_overlap}f")
    else:
        parts.append("untiled" + (" (one tile covers the latent)" if strategy.vae_tiling else ""))
    alone = " (one video: nothing to slice)" if strategy.vae_slicing else ""
    parts.append("vae_slicing" if report.sliced else f"unsliced{alone}")
    return "; ".join(parts)


def _vae_placement(strategy: MemoryStrategy, report: DecodeReport, device: torch.device) -> str:
    """Where the VAE's weights were while it decoded, and the copy settings that applied to them."""
    if report.device == "cpu" and device.type != "cpu":  # the ladder's last rung took the offload off: no copies
        return "VAE on the CPU (the fallback ladder's last rung; the offload was removed)"
    tier = strategy.offload
    if tier is OffloadTier.SEQUENTIAL:
        text = f"VAE offload=sequential prefetch={strategy.prefetch_blocks}"
    elif tier is OffloadTier.BLOCK_SWAP:
        text = "VAE offload=model (asked block_swap, which swaps transformer blocks: the VAE has none and moves whole)"
    else:
        text = f"VAE offload={tier.value}"
    if strategy.max_pinned_ram_gb is not None:  # caps the pinned landing of decoded pieces (and sequential's homes)
        text += f" max_pinned_ram_gb={strategy.max_pinned_ram_gb:g}"
    return text + (" non_blocking=False" if not strategy.non_blocking else "")


def tiling_for_family(loaded: LoadedPipeline, strategy: MemoryStrategy) -> tuple[MemoryStrategy, str]:
    """`strategy` with the tile the family's VAE needs (FamilySpec.min_decode_tile), and the note
    saying what changed or warning of a tile chosen below it; the planner resolves it the same way."""
    chosen = family_tiling(strategy.vae_tiling, loaded.spec.min_decode_tile, loaded.spec.name)
    if chosen.warns:
        log.warning("vidmem: %s", chosen.note)
    return replace(strategy, vae_tiling=chosen.tiling), chosen.note
