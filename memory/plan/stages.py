"""One function per stage (the vocabulary they share lives in `types.py`).

Each stage is a list of phases, one per component that computes in it; a phase is the resident
weights (per the tier) plus that component's traced allocations, replayed through the allocator
model. The stage's device figure is its worst phase; its host figure adds what the run keeps in RAM.
Which components a stage holds comes from the model (`PlannerModel.stage_components`, the
declaration the engine reads too); how they are resident mirrors vidmem.memory.offload.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace


from .allocator import replay
from .costs import (CUBLAS_WORKSPACE_BYTES, CUDA_CONTEXT_BYTES, Traffic, Work, chunk_compute_share, exposed_copy_share,
                    host_runtime_bytes)
from .schedule import (ComponentWeights, Streaming, stream_timeline, table_computing_residency, table_resident_tensors,
                       table_streamed_unit_bytes)
from .types import (Allocator, CacheState, Call, ModelLayout, Phase, PlannerModel, PlanOptions, Runtime, StagePlan,
                    VideoShape)
from ..storage.fp8_matmul import multiplied_as_stored
from ..strategy import MemoryStrategy, OffloadTier, TextEncoderPlacement, family_tiling
from ..vae_tiles import plan_tiles
from ..windows import WindowSchedule

__all__ = ["Allocator", "Call", "ModelLayout", "Phase", "PlannerModel", "PlanOptions", "Runtime", "StagePlan",
           "VideoShape", "cache_state_bytes", "compute_seconds", "decode_stage", "denoise_stage", "host_base",
           "sequence_tokens", "text_encode_stage", "transformer_config"]


def text_encode_stage(model: PlannerModel, shape: VideoShape, strategy: MemoryStrategy, options: PlanOptions) -> StagePlan:
    phases, work = [], []
    stage = sample_stage_components(model, strategy)
    on_device = [] if strategy.text_encoder is TextEncoderPlacement.CPU else list(model.layout.text_encoders)
    host, page_cache = host_base(model, options, strategy)
    for name in model.layout.text_encoders:
        call = Call("text_encode", name, shape)
        trace = model.trace(call, options.attention)
        if name not in on_device:  # encodes in RAM (from the page cache on disk); only the embeddings move
            weights = component_weights(model, name, options)
            host += trace.peak_bytes + weights.transient_bytes
            work.append(_host_work(trace.flops, weights))
            continue
        resident = tier_residency(model, name, strategy, stage, options, call)
        in_host = weights_in_host(model, name, options, resident)
        phases.append(phase(model, call, resident, options, name, in_host=in_host))
        work.append(device_work(model, name, strategy, options, trace.flops, 1))
    return StagePlan("text_encode", tuple(phases), host, page_cache, tuple(work), options.on_cpu)


def denoise_stage(model: PlannerModel, shape: VideoShape, strategy: MemoryStrategy, options: PlanOptions) -> StagePlan:
    layout, phases, work = model.layout, [], []
    stage = sample_stage_components(model, strategy)
    if strategy.text_encoder is TextEncoderPlacement.OFFLOAD_AFTER_ENCODING:  # evicted once prompts are encoded
        stage = [n for n in stage if n not in layout.text_encoders]
    host, page_cache = host_base(model, options, strategy)
    host += 2 * _numel(model.latent_shape(shape)) * 4  # CPU noise, the returned latent
    labels = {**{name: f"{name} (image)" for name in layout.conditioning}, **{name: name for name in layout.call_encoders}}
    for name, label in labels.items():
        call = Call("condition", name, shape)
        trace = model.trace(call, options.attention)
        if name not in stage:  # an image encoder placed on the CPU encodes there
            weights = component_weights(model, name, options)
            host += trace.peak_bytes + weights.transient_bytes
            work.append(_host_work(trace.flops, weights))
            continue
        resident = tier_residency(model, name, strategy, stage, options, call)
        in_host = weights_in_host(model, name, options, resident)
        phases.append(phase(model, call, resident, options, label, in_host=in_host))
        work.append(device_work(model, name, strategy, options, trace.flops, 1))
    steps_per_denoiser = _split_steps(options.steps, len(layout.denoisers))
    passes, clip = window_passes(model, shape)
    for name, steps in zip(layout.denoisers, steps_per_denoiser):
        call = Call("denoise", name, shape.one_window(), chunks=strategy.chunk_count)
        flops = model.trace(call, options.attention).flops * steps * passes  # traced first: it records the module order
        resident, held, streaming = denoiser_residency(model, call, strategy, stage, options)
        kept = [*clip, *cache_state_bytes(model, shape, name, options.cache_state_of(name))]
        phases.append(phase(model, call, resident, options, name, held, streaming,
                            weights_in_host(model, name, options, resident), kept))
        work.append(device_work(model, name, strategy, options, flops, steps * model.forward_passes(shape) * passes,
                                call))
    return StagePlan("denoise", tuple(phases), host, page_cache, tuple(work), options.on_cpu)


def window_passes(model: PlannerModel, shape: VideoShape) -> tuple[int, list[int]]:
    """Denoiser passes per step (one per context window) and, when windowed, the whole clip's
    device tensors that outlive the passes: the latents and the blended fp32 output (a batch of two
    where cfg runs as one batch: counted as two, a few MiB at most)."""
    if not shape.windowed:
        return 1, []
    frames = model.latent_shape(shape)[2]
    window = model.latent_shape(shape.one_window())[2]
    schedule = WindowSchedule(frames, window, shape.window_overlap // model.geometry.temporal_factor)
    latent = _numel(model.latent_shape(shape))
    return schedule.count, [latent * 4, latent * 4 * 2]


def transformer_config(model: PlannerModel, denoiser: str):
    return model.module(denoiser).config


def sequence_tokens(model: PlannerModel, shape: VideoShape, denoiser: str | None = None) -> int:
    """Tokens the transformer blocks see for one video: latent frames x rows x columns, per patch (a temporal
    patch given as `patch_size_t`, as CogVideoX 1.5's, pads the frames to its multiple, as the model does)."""
    config = transformer_config(model, denoiser or model.layout.denoisers[0])
    _, _, frames, height, width = model.latent_shape(shape)
    patch = config.patch_size if isinstance(config.patch_size, (list, tuple)) else (1, config.patch_size, config.patch_size)
    patch = (getattr(config, "patch_size_t", None) or patch[0], *patch[1:])
    frames += (-frames) % patch[0]
    return (frames // patch[0]) * (height // patch[1]) * (width // patch[2])


def cache_state_bytes(model: PlannerModel, shape: VideoShape, denoiser: str, state: CacheState) -> list[int]:
    """The tensors a step cache keeps on the device through `denoiser`'s passes (see CacheState): `state`'s
    per cache context, for every context a step has (each guidance branch the family runs as its own pass,
    each context window). Text tokens' tensors (First Block Cache's on families that return them) are a
    few MiB and not counted. Wan 2.2's first expert's state goes when the second takes over
    (pipelines/step_cache.py, `AppliedCache.finished`), so each denoiser's phase holds its own only."""
    if not state.hidden and not state.output:
        return []
    passes = model.forward_passes(shape)  # guidance as its own pass: a context each
    rows = shape.batch * (2 if shape.cfg else 1) // passes  # guidance as a batch: one context of both
    contexts = passes * window_passes(model, shape)[0]
    window = shape.one_window()
    kept = []
    if state.hidden:
        config = transformer_config(model, denoiser)
        width = config.num_attention_heads * config.attention_head_dim
        kept += [rows * sequence_tokens(model, window, denoiser) * width * model.dtype_bytes(denoiser)] * state.hidden
    if state.output:
        kept += [rows * _numel(model.latent_shape(window)[1:]) * 4] * state.output
    return kept * contexts


def piece_call(model: PlannerModel, shape: VideoShape, piece: tuple[int, ...]) -> Call:
    """How vidmem decodes one latent piece (pipelines.decode.vae_decoder): the family's staged stream where it
    declares one, after its frame-wide layers ran once on the whole latent ("decode_context"); else `vae.decode`."""
    return Call("decode_stream" if model.vae_stream_batch is not None else "decode", model.layout.vae, shape, piece)


def decode_calls(model: PlannerModel, shape: VideoShape, strategy: MemoryStrategy) -> list[tuple[Call, int]]:
    """The calls vidmem's decode makes, each with how often: the frame-wide layers once per batch group where the
    family runs them on the whole latent (memory.vae.decode_video's `prepare`), then every distinct piece."""
    latent = model.latent_shape(shape)
    calls = [(piece_call(model, shape, piece), count) for piece, count in piece_counts(model, shape, strategy).items()]
    if model.vae_shared_context:
        groups = latent[0] if strategy.vae_slicing else 1
        parked = sum(count for _, count in calls) > groups  # a group of several pieces: parked on the host
        context = Call("decode_context", model.layout.vae, shape, (latent[0] // groups, *latent[1:]), parked=parked)
        calls.insert(0, (context, groups))
    return calls


def parked_context_bytes(model: PlannerModel, calls: list[tuple[Call, int]], options: PlanOptions) -> int:
    """The host memory the frame-wide layers' output takes while a group's pieces are cut from it (memory.vae parks
    it there when a group decodes in several pieces): one group's, the decode letting go of it before the next's."""
    parked = [call for call, _ in calls if call.kind == "decode_context" and call.parked]
    return model.trace(replace(parked[0], parked=False), options.attention).live_bytes if parked else 0


def decode_stage(model: PlannerModel, shape: VideoShape, strategy: MemoryStrategy, options: PlanOptions) -> StagePlan:
    vae, latent = model.layout.vae, model.latent_shape(shape)
    itemsize = model.dtype_bytes(vae)
    z = _numel(latent) * itemsize  # the latent on the device in the VAE's dtype, whole, during the decode
    if options.runtime is Runtime.DIFFUSERS:
        calls = [(Call("decode", vae, shape, latent, vae_tiling=strategy.vae_tiling is not None), 1)]
    else:
        calls = decode_calls(model, shape, strategy)
    pieces = sum(count for call, count in calls if call.kind != "decode_context")
    phases, flops, largest_piece = [], 0.0, 0
    for call, count in calls:
        flops += model.trace(call, options.attention).flops * count  # traced first: it records the order
        # each piece's own module order: a causal VAE decodes a one-frame piece without its temporal convolutions
        resident = tier_residency(model, vae, strategy, [vae], options, call)
        if options.runtime is Runtime.DIFFUSERS and strategy.offload is OffloadTier.NONE:
            resident = tier_residency(model, vae, strategy, list(model.layout.all), options)  # pipe.to("cuda"): all stay
        in_host = weights_in_host(model, vae, options, resident)
        what = "frame-wide layers on" if call.kind == "decode_context" else "decode"
        label = f"{vae} {what} {'x'.join(map(str, call.piece[2:]))} ({count} calls)"
        phases.append(phase(model, call, [*resident, z], options, label, in_host=in_host))
        if call.kind == "decode_context":
            continue
        pixels = 3 * model.geometry.frames(call.piece[2]) * _numel(call.piece[3:]) * model.geometry.spatial_factor ** 2
        largest_piece = max(largest_piece, call.piece[0] * pixels * itemsize)  # copied to the host per piece
    host_frames = model.trace(Call("postprocess", vae, shape), options.attention).peak_bytes
    host, page_cache = host_base(model, options, strategy)
    host += parked_context_bytes(model, calls, options)
    work = device_work(model, vae, strategy, options, flops, pieces)
    if not options.on_cpu and pieces > 1:
        largest_piece *= 2  # landed through a pinned pair: one piece blended while the next is copied (memory.vae)
    return StagePlan("decode", tuple(phases), host + host_frames + largest_piece, page_cache, (work,), options.on_cpu)


def phase(model: PlannerModel, call: Call, resident: list[int], options: PlanOptions, label: str,
          held: list[int] = (), streaming: Streaming | None = None, in_host: int = 0, kept: list[int] = ()) -> Phase:
    """Replay resident weights, then the call's allocations, through the allocator model. A CPU
    device has no CUDA context or cuBLAS workspace, and its allocator keeps no cache: live bytes.
    `held`: streamed weights evicted but still read by the GPU (reserved, not allocated).
    `streaming`: weights the sequential tier moves while the call runs, replayed between its
    allocations where the engine moves them (`schedule.stream_timeline`); `resident` then holds only
    what stays on the device throughout. `in_host`: of `resident`, the host's own weights (Phase.in_host_bytes).
    `kept`: tensors other than weights that live on the device throughout (a windowed clip's latents,
    a step cache's state): resident like weights, but room the host must leave beside them."""
    trace = model.trace(call, options.attention)
    if options.on_cpu:
        peak = replay((*resident, *kept), trace.events)
        return Phase(label, sum(resident), peak, peak.allocated, (*resident, *kept), trace.events, in_host_bytes=in_host)
    tensors, held = (CUBLAS_WORKSPACE_BYTES, *resident, *kept), tuple(held)
    timeline = stream_timeline(streaming, trace.marks) if streaming is not None else None
    peak = replay(tensors, trace.events, held=held, timeline=timeline)
    footprint = peak.reserved if options.allocator.resolved() is Allocator.NATIVE else peak.active + sum(held)
    weights = sum(resident) + sum(held) + (sum(streaming.peak) if streaming is not None else 0)
    return Phase(label, weights, peak, CUDA_CONTEXT_BYTES + footprint, tensors, trace.events, held, streaming, timeline)


def tier_residency(model: PlannerModel, active: str, strategy: MemoryStrategy, stage_names: list[str],
                   options: PlanOptions = PlanOptions(), call: Call | None = None) -> list[int]:
    """Weight tensors (as stored) resident while `active` computes; under `none` every stage
    component is. A stored-quantized component adds its one dequantized layer (the transient). On a
    CPU device memory-mapped weights are computed where they lie: page cache, not device bytes."""
    weights = component_weights(model, active, options)
    transient = [weights.transient_bytes] if weights.transient_bytes else []
    if options.weights_in_place:
        return transient
    if strategy.offload is OffloadTier.NONE:
        names = dict.fromkeys([*stage_names, active])
        return [t for name in names for t in component_weights(model, name, options).tensors] + transient
    order = model.stream_order(call) if call is not None else None  # the order `call` ran the modules in
    return table_resident_tensors(weights.table, strategy, order) + transient


def denoiser_residency(model: PlannerModel, call: Call, strategy: MemoryStrategy, stage_names: list[str],
                       options: PlanOptions) -> tuple[list[int], list[int], Streaming | None]:
    """`tier_residency` for the denoiser `call` runs, while its blocks compute, as (tensors on the device
    throughout, evicted ones the GPU may still read, what streams meanwhile). Block swap: the
    blocks live then and the evicted one (`schedule.computing_residency`). Sequential: the tensors
    that stay, and the leaves (with a stored layer's upcast workspace), which the phase replays
    where the engine moves them (`schedule.stream_timeline`), so at the activations' peak only the
    leaves the engine holds then are on the device (measured on an H200 for Wan 14B: 3.575 GiB
    allocated, 3.574 planned; holding the pass's largest leaves throughout planned 3.93).
    The text encoders and the VAE keep the tier's weight peak throughout: their streamed leaves are
    small next to their activations or dominate both (umt5's token table), and no GPU measured them."""
    active = call.component
    weights = component_weights(model, active, options)
    transient = [weights.transient_bytes] if weights.transient_bytes else []
    order = model.stream_order(call)
    if options.weights_in_place or strategy.offload not in (OffloadTier.BLOCK_SWAP, OffloadTier.SEQUENTIAL):
        return tier_residency(model, active, strategy, stage_names, options, call), [], None
    if strategy.offload is OffloadTier.BLOCK_SWAP:
        live, held = table_computing_residency(weights.table, strategy, order)
        return live + transient, held, None
    whole = table_resident_tensors(weights.table, strategy, order) + transient
    stays, per_unit, _ = weights.table.units(strategy)
    if options.on_cpu or not per_unit:
        return whole, [], None
    fixed = weights.table.nbytes(stays)  # `resident_tensors` lists these first, then the streamed peak
    return fixed, [], Streaming(weights.table, strategy, options.runtime is Runtime.VIDMEM, tuple(whole[len(fixed):]))


def weights_in_host(model: PlannerModel, active: str, options: PlanOptions, resident: list[int]) -> int:
    """Of `resident` (tier_residency's tensors while `active` computes), the bytes that are the host's own
    weights, which host_base already counts: on a CPU device every one but `active`'s upcast transient
    (CpuBackend.copy_group returns the host tensors themselves; memory-mapped weights are page cache and
    tier_residency then lists the transient alone). On a GPU the device holds copies: none."""
    if not options.on_cpu:
        return 0
    return sum(resident) - component_weights(model, active, options).transient_bytes


def component_weights(model: PlannerModel, name: str, options: PlanOptions) -> ComponentWeights:
    return model.weights(name, options.storage_of(name))


def sample_stage_components(model: PlannerModel, strategy: MemoryStrategy) -> list[str]:
    """The components `sample()` applies the strategy to: the model says (PlannerModel.stage_components,
    the same declaration vidmem.pipelines.sample reads), so the two cannot drift apart."""
    return list(model.stage_components(strategy.text_encoder))


def host_base(model: PlannerModel, options: PlanOptions = PlanOptions(),
              strategy: MemoryStrategy | None = None) -> tuple[int, int]:
    """(anonymous, page cache) bytes the loaded pipeline keeps in RAM for its lifetime.

    Without the disk tier the loader copies every weight, as stored, into anonymous RAM once
    (streamed groups later move into pinned homes under the ceiling: moved, not doubled). On disk
    the weights stay in their files: page cache. Anonymous RAM then holds the runtime and the
    pinned staging slots streamed groups are read through on their way to the device.
    """
    weights = sum(component_weights(model, n, options).nbytes for n in model.layout.all)
    runtime = host_runtime_bytes(options.on_cpu)
    if not options.on_disk:
        return runtime + weights, 0
    return runtime + staging_bytes(model, strategy or MemoryStrategy(), options), weights


def staging_bytes(model: PlannerModel, strategy: MemoryStrategy, options: PlanOptions) -> int:
    """Pinned staging slots for streamed groups read from files (memory.hostpool.StagingRing).

    The streamed ring copies a group chunk by chunk through at most MAX_STAGING_SLOTS slots, each
    the largest streamed group rounded up to a power of two (as torch's pinned allocator rounds)
    but at most RESIDENT_CHUNK_BYTES; they live as long as the pipeline's backend, so the largest
    group of any component the run streams sets them. Whole components (tiers none and model) pass
    through a ring of their own of at most RESIDENT_SLOTS such chunks.
    """
    from ..hostpool import MAX_STAGING_SLOTS, RESIDENT_CHUNK_BYTES, RESIDENT_SLOTS

    if options.on_cpu:  # nothing is copied to a device: no staging
        return 0
    on_device = {*sample_stage_components(model, strategy), model.layout.vae}
    largest = 0
    for name in on_device:
        weights = component_weights(model, name, options)
        units = table_streamed_unit_bytes(weights.table, strategy)
        largest = max(largest, *units, 0)
    if not largest:
        return 0
    slot = min(1 << (largest - 1).bit_length(), RESIDENT_CHUNK_BYTES)
    slots = min(MAX_STAGING_SLOTS, (strategy.prefetch_blocks + 2) * -(-largest // slot))
    return slots * slot + RESIDENT_SLOTS * RESIDENT_CHUNK_BYTES


def piece_counts(model: PlannerModel, shape: VideoShape, strategy: MemoryStrategy) -> Counter:
    """Distinct latent pieces a vidmem decode calls the VAE on, and how often each."""
    latent = model.latent_shape(shape)
    tiling = family_tiling(strategy.vae_tiling, model.vae_min_tile).tiling  # the tile the decode runs
    tiles = plan_tiles(latent, model.geometry, tiling, stream_batch=model.vae_stream_batch)
    batch = 1 if strategy.vae_slicing else latent[0]
    counts: Counter = Counter()
    for frames in tiles.frames:
        for rows in tiles.rows:
            for cols in tiles.cols:
                t = frames.stop - frames.start + frames.context
                counts[(batch, latent[1], t, rows.stop - rows.start, cols.stop - cols.start)] += latent[0] // batch
    return counts


def compute_seconds(model: PlannerModel, shape: VideoShape, strategy: MemoryStrategy, options: PlanOptions) -> float:
    """Every stage's compute with nothing streamed and the decode untiled (its work, not its memory)."""
    attention, layout = options.attention, model.layout
    flops = sum(model.trace(Call("text_encode", n, shape), attention).flops for n in layout.text_encoders)
    flops += sum(model.trace(Call("condition", n, shape), attention).flops for n in (*layout.conditioning, *layout.call_encoders))
    flops += decode_flops_untiled(model, shape, strategy, options)
    seconds = flops / options.rates.flops_per_s
    for name, steps in zip(layout.denoisers, _split_steps(options.steps, len(layout.denoisers))):
        # resident, so compiled blocks compile whole: the run's best, what a tier's slowdown is against
        denoise = model.trace(Call("denoise", name, shape), attention).flops * steps / options.rates.flops_per_s
        seconds += denoise * _speed_ratio(name, OffloadTier.NONE, options)
    return seconds


def decode_flops_untiled(model: PlannerModel, shape: VideoShape, strategy: MemoryStrategy, options: PlanOptions) -> float:
    """Convolution FLOPs scale with decoded voxels: the tiled pieces' FLOPs less their overlaps."""
    if options.runtime is Runtime.DIFFUSERS:
        latent = model.latent_shape(shape)
        return model.trace(Call("decode", model.layout.vae, shape, latent, strategy.vae_tiling is not None), options.attention).flops
    geometry, latent = model.geometry, model.latent_shape(shape)
    decoded = flops = shared = 0.0
    for call, count in decode_calls(model, shape, strategy):
        if call.kind == "decode_context":  # on the whole latent, tiled or not
            shared += model.trace(call, options.attention).flops * count
            continue
        flops += model.trace(call, options.attention).flops * count
        decoded += geometry.frames(call.piece[2]) * call.piece[3] * call.piece[4] * call.piece[0] * count
    return shared + flops * geometry.frames(latent[2]) * latent[3] * latent[4] * latent[0] / decoded


def device_work(model: PlannerModel, name: str, strategy: MemoryStrategy, options: PlanOptions, flops: float,
                passes: int, call: Call | None = None) -> Work:
    """`name`'s compute on the device: its FLOPs, the weights it moves, the stored weights it upcasts each pass.
    `call`: the denoise call, whose chunked blocks call some layers once per token slice."""
    weights = component_weights(model, name, options)
    chunked = call is not None and call.chunks > 1
    upcasts = weights.stored.stored_weights
    if chunked and not (options.speed.fp8_matmul_on and _fp8_stored(name, options)):  # fp8 matmul: no slice upcasts
        upcasts = _upcasts_per_pass(model, call, weights, options)
    return Work(flops, passes, _traffic(model, name, strategy, options, call), dequant_weights=upcasts,
                dequant_widens=weights.stored.widens, rates=options.rates,
                # launches cost only where kernels launch
                compute_share=chunk_compute_share(call.chunks) if chunked and not options.on_cpu else 0.0,
                time_ratio=_speed_ratio(name, strategy.offload, options) if call is not None else 1.0)


def _speed_ratio(name: str, tier: OffloadTier, options: PlanOptions) -> float:
    """The measured step-time ratio of the run's Speed choices for denoiser `name` on `tier` (MeasuredSpeed): blocks
    compile whole on every tier but sequential, and fp8 matmul takes a denoiser stored in float8_e4m3fn."""
    return options.speed.ratio(tier is OffloadTier.SEQUENTIAL, _fp8_stored(name, options))


def _fp8_stored(name: str, options: PlanOptions) -> bool:
    """Whether `name` is stored in float8_e4m3fn: what fp8 matmul multiplies as stored."""
    stored = options.storage_of(name)
    return stored is not None and multiplied_as_stored(stored)


def _upcasts_per_pass(model: PlannerModel, call: Call, weights: ComponentWeights, options: PlanOptions) -> int:
    """Stored weights upcast per pass of a chunked denoise call. A stored layer upcasts its weight at every call
    (memory/storage/modules.py, StoredLinear), and a chunked block calls its per-token layers once per slice that
    ran: the unchunked count scaled by the calls the chunked trace makes of the stored layers, weighted by their
    stored bytes (the modules whose upcast workspace is not 0)."""
    stored = weights.stored.stored_weights
    table = weights.table
    if not stored:
        return 0
    chunked = _module_calls(model, call, options, table)
    plain = _module_calls(model, replace(call, chunks=1), options, table)
    held = {name: sum(table.sizes[t] for t in slots)
            for name, slots, workspace in zip(table.modules, table.slots, table.workspace) if workspace}
    plain_bytes = sum(plain[name] * nbytes for name, nbytes in held.items())
    if not plain_bytes:
        return stored
    return round(stored * sum(chunked[name] * nbytes for name, nbytes in held.items()) / plain_bytes)


def _host_work(flops: float, weights: ComponentWeights) -> Work:
    """A component computing in RAM (text_encoder=cpu): it reads its weights where they are."""
    return Work(flops, on_host=True, host_weight_bytes=weights.nbytes, dequant_weights=weights.stored.stored_weights)


def _traffic(model: PlannerModel, name: str, strategy: MemoryStrategy, options: PlanOptions,
             call: Call | None = None) -> Traffic:
    """Host-to-device bytes as stored: what streams per pass, and what is onloaded once. On a CPU
    device nothing is copied; memory-mapped weights are read in place every pass (page faults:
    synchronous), from the disk when the page cache cannot keep them."""
    weights = component_weights(model, name, options)
    if options.on_cpu:
        return Traffic(weights.nbytes if options.on_disk else 0, 0, 0, overlapped=False)
    if strategy.offload is OffloadTier.NONE:  # onloaded with the stage, as in the baseline; from files on disk
        return Traffic(once_bytes=weights.nbytes) if options.on_disk else Traffic()
    units = table_streamed_unit_bytes(weights.table, strategy)
    distinct = sum(units)  # the page cache keeps a layer's pages after its first slice: the disk reads it once
    if strategy.offload is OffloadTier.SEQUENTIAL and call is not None and call.chunks > 1:
        units = [size for size, copies in zip(units, _chunked_copies(model, call, weights.table, strategy, options))
                 for _ in range(copies)]
    # Overlapped even without a prefetch: the host runs a block ahead, so block i's copy queues on
    # the side stream while block i-1 computes (measured: 97% of the copy time hidden on an H200).
    exposed = exposed_copy_share(strategy.offload is OffloadTier.SEQUENTIAL, strategy.prefetch_blocks)
    return Traffic(sum(units), len(units), weights.nbytes - distinct, exposed_share=exposed,
                   distinct_per_pass_bytes=distinct)


def _chunked_copies(model: PlannerModel, call: Call, table, strategy: MemoryStrategy,
                    options: PlanOptions) -> list[int]:
    """Copies per pass of each streamed unit of a chunked denoise call (sequential copies a layer each time
    it is called: the engine's events, tests/test_activation_chunks.py). A chunked block calls its per-token
    layers once per slice that ran (token_slices may run fewer than asked) but its attention over all tokens
    (CogVideoX's) once, like the layers outside the blocks: so a unit is copied once, as unchunked, plus the
    calls per pass the chunked trace adds to the unchunked one (a traced call runs every guidance pass: the
    fewest calls of any module that ran, the patch embedding's, is the passes)."""
    _, per_unit, unit_of = table.units(strategy)  # unit_of: head module name -> unit index
    chunked = _module_calls(model, call, options, table)
    plain = _module_calls(model, replace(call, chunks=1), options, table)
    passes = min((calls for calls in plain.values() if calls), default=1)
    copies = [1] * len(per_unit)
    for name, unit in unit_of.items():
        copies[unit] = max(1, 1 + round((chunked[name] - plain[name]) / passes))
    return copies


def _module_calls(model: PlannerModel, call: Call, options: PlanOptions, table) -> dict[str, int]:
    """How often each module of the full-size component (`table.modules`) starts a forward in `call`'s trace.
    The trace runs the first blocks only; the others run as the last traced one does (blocks are identical)."""
    traced = Counter(name for _, starts, name in model.trace(call, options.attention).marks if starts)
    last = max((b for name, b in zip(table.modules, table.block) if b >= 0 and name in traced), default=-1)
    return {name: traced[_as_traced(name, block, last)] for name, block in zip(table.modules, table.block)}


def _as_traced(name: str, block: int, last: int) -> str:
    """The name module `name` of block `block` has in a trace that ran blocks 0..`last`: the last one's."""
    return name if block <= last else f"{name}.".replace(f".{block}.", f".{last}.", 1)[:-1]


def _split_steps(steps: int, denoisers: int) -> list[int]:
    """Steps per denoiser; Wan 2.2 A14B hands over at a boundary timestep, about halfway."""
    if denoisers <= 1:
        return [steps] * denoisers
    first = steps // 2
    return [first, steps - first]


def _numel(shape) -> int:
    count = 1
    for n in shape:
        count *= n
    return count
