"""train_lora: LoRA training of one denoiser under a MemoryStrategy, resumable, on the pack's engine.

One step: the step's batch and noise (pure functions of seed and step), the family's loss, its
backward, gradient clipping, the optimizer step. The denoiser runs under the strategy exactly as
in sampling: `none`/`model` keep it on the device for the run; `block_swap`/`sequential` stream
blocks (or layers) in for the forward and, with per-block gradient checkpointing, again in
reverse order for the backward, prefetched in that order (memory/blockswap.py; training/autograd.py
explains why that needs checkpointing). With `activation_offload` the checkpointed blocks' inputs
wait in pooled host buffers and come back on the same side stream ahead of the backward
(memory/activation_offload.py); every buffer returns to the pool after each step, errors included,
and at the run's end the pool is dropped and its pinned memory unlocked.
The base weights are frozen for the run and their `requires_grad` restored afterwards; the
trainable LoRA weights (float32) stay on the device beside the layers (training/adapters.py).

Interrupts (the host's Cancel, checked before every block) and errors during the loop save a
resumable checkpoint of the last completed step first; periodic checkpoints every
`checkpoint_every` steps; the final LoRA goes to `lora_path` atomically, with a last checkpoint
so a later run with more steps continues from it.
"""

from __future__ import annotations

import logging

import math
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch

from ..memory import MemoryStrategy, OffloadTier, StageComponents, apply_strategy
from ..memory.activation_offload import UNPINNED, ActivationOffload, ActivationPool, OffloadMode, copies_for
from ..memory.hostpool import pinned_cap_bytes
from ..memory.blockswap import Observer
from ..memory.cleanup import release_cached_pinned
from ..memory.offload import device_weight_bytes
from ..memory.lora import apply_loras
from ..memory.telemetry import StageMeter
from ..pipelines.lora import describe_loras, lora_patches
from ..pipelines.lora.names import trained_key_stems
from ..pipelines.lora.read import file_identity
from ..pipelines.hooks import interrupt_checks
from .adapters import AttachedLora, build_layers, find_targets, trainable_bytes
from .autograd import check_layering, frozen_saved_by_storage, gradient_checkpointing
from .batches import BatchOrder, step_generator
from .errors import TrainingError
from .inference import normal_tensors, training_mode
from .objective import denoiser_for, objective_for
from .optim import OptimizerSettings, check_available, make_optimizer, state_bytes, state_from_tensors, state_to_tensors
from .prepare import PreparedData
from .save import (CHECKPOINT_DAMAGE, check_output_folders, check_writable, copy_lora_into, damaged_checkpoint,
                   final_lora_tensors, lora_metadata, lora_tensors, read_checkpoint, read_lora_tensors, write_checkpoint,
                   write_safetensors_atomic)
from .settings import TrainSettings

Progress = Callable[[int, int, float], None]  # (steps done, total, last loss)


@dataclass(frozen=True)
class TrainOutputs:
    lora_path: Path  # models/loras/<name>.safetensors
    checkpoint_folder: Path  # a folder replaced as a whole at every checkpoint


@dataclass
class TrainResult:
    lora_path: Path
    losses: list[float]
    receipt: dict = field(default_factory=dict)


@dataclass
class _Run:
    """The mutable state of one run (weights live in `layers`, moments in `optimizer`)."""

    layers: torch.nn.ModuleDict
    optimizer: object
    step: int
    losses: list[float]
    saved_step: int


def check_request(loaded, data: PreparedData, strategy: MemoryStrategy, settings: TrainSettings) -> str:
    """Every check that needs no weights moved; returns the component trained."""
    component = denoiser_for(loaded, settings.expert)
    objective_for(loaded, component)  # refuses image-to-video pipelines
    if not isinstance(data, PreparedData):
        raise TrainingError("data is not prepared training data; connect Prepare Training Data (VidMem).")
    if data.family != loaded.spec.name:
        raise TrainingError(f"the data was prepared for {data.family} ({data.class_name}), but the pipeline is "
                            f"{loaded.spec.name}; prepare the data with this pipeline.")
    config = getattr(loaded.pipe, component).config
    text_dim = config.get("text_dim") or config.get("text_embed_dim")
    if data.latent_channels != config.in_channels or data.embed_dim != text_dim:
        raise TrainingError(f"the data's latents ({data.latent_channels} channels) or prompt embeddings (width "
                            f"{data.embed_dim}) do not fit this {component} ({config.in_channels}, {text_dim}); "
                            "prepare the data with this pipeline.")
    if strategy.streams_blocks and not settings.gradient_checkpointing:
        raise TrainingError(f"offload='{strategy.offload.value}' during training needs gradient_checkpointing on: "
                            "without it the backward keeps every streamed block's weights on the device, so streaming "
                            "saves nothing. Turn gradient_checkpointing on, or choose offload 'model' or 'none'.")
    check_layering(strategy.offload is OffloadTier.SEQUENTIAL)
    check_available(settings.optimizer)
    return component


def train_lora(loaded, data: PreparedData, strategy: MemoryStrategy, settings: TrainSettings, outputs: TrainOutputs,
               backend, progress: Progress = lambda done, total, loss: None,
               check_interrupt: Callable[[], None] = lambda: None, resume: bool = False,
               observer: Observer | None = None,
               make_room: Callable[[int], None] = lambda weight_bytes: None) -> TrainResult:
    """Train a LoRA on `data` and write it to `outputs.lora_path`; see the module docstring.

    `progress(done, total, loss)` after every step; `check_interrupt()` raising stops the run
    within one block, after a checkpoint of the last completed step; `resume` continues from
    `outputs.checkpoint_folder` when it holds a checkpoint of the same data and settings.
    `make_room(weight_bytes)`: before any weight moves, the host is asked to make room for the step,
    given the bytes of weights the strategy puts on the device (the caller adds the activations).
    """
    with training_mode():  # ComfyUI runs nodes under inference_mode (training/inference.py)
        return _train_lora(loaded, data, strategy, settings, outputs, backend, progress, check_interrupt, resume, observer,
                           make_room)


def _train_lora(loaded, data, strategy, settings, outputs, backend, progress, check_interrupt, resume, observer,
                make_room) -> TrainResult:
    component = check_request(loaded, data, strategy, settings)
    if settings.activation_offload is OffloadMode.AUTO:  # before anything moves
        raise TrainingError("activation_offload='auto' is decided by the training plan: resolve it first "
                            "(training.plan.resolve_activation_offload, as Train LoRA does) or pass 'on' or 'off'.")
    check_writable(outputs.lora_path)
    check_output_folders(outputs.lora_path, outputs.checkpoint_folder)
    model = getattr(loaded.pipe, component)
    targets = find_targets(model, component, settings.target_modules, loaded.spec.blocks_attr)
    stems = trained_key_stems(model, targets.paths)  # the file's key names, refused now rather than after the run
    device = backend.device
    run = _start(model, targets, settings, device)
    trained_over = _trained_over(loaded.loras, component)
    state = {"settings": settings.as_record(), "data": data.fingerprint, "component": component,
             "targets": list(targets.paths), "rng": "per-step generators seeded from (seed, step)",
             "trained_over": trained_over}
    if resume:
        _resume(run, outputs.checkpoint_folder, state, settings.steps)
    objective = objective_for(loaded, component)
    order = BatchOrder(data, settings.batch_size, settings.seed)
    blocks = getattr(model, loaded.spec.blocks_attr)
    stage = StageComponents({component: model}, {component: blocks})
    record = {"component": component, "family": loaded.spec.name, "expert": settings.expert, "rank": settings.rank,
              "alpha": settings.alpha, "trained_over": trained_over}
    # the checkpoint keeps the raw tensors resume reads; the file folds alpha / rank into lora_B (training/save.py)
    meta = lora_metadata(settings.rank, settings.alpha, targets.paths, record)
    final_meta = lora_metadata(settings.rank, settings.rank, targets.paths, dict(record, folded_scale=settings.alpha / settings.rank))
    save = lambda: _checkpoint(run, outputs.checkpoint_folder, meta, state)  # noqa: E731
    receipt = {"strategy": strategy.describe(), "device": str(device), "component": component,
               "layers": len(targets.paths), "trainable_bytes": trainable_bytes(run.layers), "start_step": run.step}
    if loaded.loras:
        receipt["trained_over"] = describe_loras(loaded.loras)
    # Device copies kept warm by sampling were made under inference mode and hold the room training needs.
    receipt["warm_released_bytes"] = loaded.release_warm()
    offload = _activation_offload(settings, strategy, backend)
    # read before the weights take their pinned homes, as the plan reads it: pinning them can lower the
    # free RAM the automatic ceiling is a share of, and the homes are subtracted below once made
    ceiling = _pinned_ceiling(strategy, backend, loaded.host_pool) if offload is not None else UNPINNED
    with StageMeter("train", device) as meter:
        # LoRAs already on the pipeline (a distill LoRA, another expert's) apply as at sampling:
        # the new LoRA learns what is missing on top of them; all before the strategy (memory.lora's rule).
        with apply_loras(lora_patches(loaded.pipe, loaded.loras)) as lora_handle, ExitStack() as stack:
            # inside the LoRA block, as the sampler measures it: the applied LoRAs' buffers count
            receipt["device_weight_bytes"], receipt["lora_bytes"] = device_weight_bytes(stage, strategy), lora_handle.nbytes
            make_room(receipt["device_weight_bytes"])  # ComfyUI's models (and other pipelines' kept weights) make way
            stack.enter_context(_training_context(model, run, settings, blocks, check_interrupt, strategy.streams_blocks, offload))
            handle = stack.enter_context(apply_strategy(stage, strategy, backend, observer, loaded.host_pool))
            handle.activate(component)
            if offload is not None:  # what the weights' homes left of the pinned ceiling
                offload.pool.cap_bytes = _activation_cap(ceiling, loaded.host_pool)
            passes = lambda backward: _begin_pass(handle, component, offload, backward)  # noqa: E731
            try:
                times = _train_steps(model, objective, order, run, settings, device, progress, save, passes,
                                     outputs.checkpoint_folder, offload)
            finally:
                if offload is not None:
                    _drop_activation_pool(offload, receipt, backend.can_pin)
    receipt.update(steps=run.step, optimizer_state_bytes=state_bytes(run.optimizer), losses=run.losses[-5:],
                   seconds_per_step=(sum(times) / len(times)) if times else 0.0, stages=[meter.as_dict()])
    if run.step > run.saved_step:
        save()
    write_safetensors_atomic(final_lora_tensors(run.layers, stems, settings.alpha / settings.rank), final_meta, outputs.lora_path)
    receipt.update(lora=str(outputs.lora_path), checkpoint=str(outputs.checkpoint_folder))
    return TrainResult(outputs.lora_path, run.losses, receipt)


def _train_steps(model, objective, order: BatchOrder, run: _Run, settings: TrainSettings, device, progress: Progress,
                 save: Callable[[], None], passes: Callable[[bool], None], checkpoint_folder: Path,
                 offload: ActivationOffload | None = None) -> list[float]:
    """Steps until `settings.steps`; on any exception (Cancel included) the last completed step is saved first."""
    times = []
    try:
        while run.step < settings.steps:
            started = time.perf_counter()
            try:
                loss = _step(model, objective, order.batch(run.step), run, settings, device, passes)
            except BaseException:  # the step's host buffers go back to the pool, after an error too
                if offload is not None:
                    _close_keeping_error(offload)
                raise
            if offload is not None:
                offload.close()
            times.append(time.perf_counter() - started)
            progress(run.step, settings.steps, loss)
            if settings.checkpoint_every and run.step % settings.checkpoint_every == 0 and run.step < settings.steps:
                save()
    except BaseException:
        run.optimizer.zero_grad()
        if run.step > run.saved_step:
            _save_keeping_error(save, checkpoint_folder)  # interrupted or failed: keep the last completed step
        raise
    return times


def _save_keeping_error(save: Callable[[], None], folder: Path) -> None:
    """The checkpoint after a Cancel or an error: if it cannot be written (a full disk), the warning
    says so and the caller raises the run's own exception, which says why the run stopped."""
    try:
        save()
    except Exception as error:  # noqa: BLE001 - any failure here must not replace the run's own
        logging.getLogger("vidmem").warning("vidmem: the checkpoint of the last completed step could not be saved "
                                            "in %s (%s); resume continues from the last one saved, if any.", folder, error)


def _close_keeping_error(offload: ActivationOffload) -> None:
    """The step's buffers back after its error: a sticky CUDA error raised again while waiting for the copies
    must not replace the run's own (a Cancel, the first CUDA error)."""
    try:
        offload.close()
    except Exception as error:  # noqa: BLE001 - any failure here must not replace the run's own
        logging.getLogger("vidmem").warning("vidmem: activation offload's copies not settled after the error (%s).",
                                            error)


def _activation_offload(settings: TrainSettings, strategy: MemoryStrategy, backend) -> ActivationOffload | None:
    """The run's activation offload (None when off); its ceiling is set once the weights have their homes."""
    if settings.activation_offload is not OffloadMode.ON:
        return None
    pin = backend.pin_arena if backend.can_pin else (lambda nbytes: torch.empty(nbytes, dtype=torch.uint8))
    return ActivationOffload(copies_for(backend), ActivationPool(pin, 0), strategy.prefetch_blocks)


def _drop_activation_pool(offload: ActivationOffload, receipt: dict, pinned: bool) -> None:
    """The run is over (or failed): drop the activation buffers and, where they were pinned, unlock
    them. torch's caching host allocator keeps freed pinned blocks locked for reuse, so without
    emptying it the buffers' RAM would stay page-locked after training. Its other unused blocks go
    too; pinned tensors still alive (the pipeline's weight homes) are untouched."""
    receipt["activation_offload"] = dict(offload.stats(), unreturned_buffers=offload.pool.release())
    if pinned:
        try:
            release_cached_pinned()
        except RuntimeError as error:  # runs in a finally: a sticky CUDA error must not hide the run's own
            logging.getLogger("vidmem").warning("vidmem: pinned activation buffers not unlocked (%s).", error)


def _pinned_ceiling(strategy: MemoryStrategy, backend, host_pool) -> int:
    """The strategy's pinned ceiling, shared by the weights' homes and the activation buffers (the
    one training/plan.py plans with); unpinned buffers (a CPU run) are plain RAM, which the planner's
    RAM budget already counts."""
    if not backend.can_pin:
        return UNPINNED
    return pinned_cap_bytes(strategy.max_pinned_ram_gb, getattr(host_pool, "host_room_bytes", None))


def _activation_cap(ceiling: int, host_pool) -> int:
    """What the weights' homes, now made, left of `ceiling` for the activation buffers."""
    if ceiling == UNPINNED:
        return UNPINNED
    return max(0, ceiling - (host_pool.pinned_bytes if host_pool else 0))


def _begin_pass(handle, component: str, offload: ActivationOffload | None, backward: bool) -> None:
    handle.begin_pass(component, backward)  # the weights' prefetch first: the backward needs them first
    if backward and offload is not None:
        offload.begin_backward()


def _start(model, targets, settings: TrainSettings, device) -> _Run:
    layers = build_layers(model, targets, settings.rank, settings.alpha, settings.seed).to(device)
    optimizer = make_optimizer(list(layers.parameters()),
                               OptimizerSettings(settings.optimizer, settings.learning_rate, settings.weight_decay))
    return _Run(layers, optimizer, 0, [], 0)


def _resume(run: _Run, folder: Path, state: dict, steps: int) -> None:
    """Continue `run` from the checkpoint in `folder` (if any), or refuse by name: other data or
    settings, another LoRA stack under it, more steps done than `steps`, a damaged file."""
    found = read_checkpoint(folder)
    if found is None:
        return
    lora_file, tensors, meta, saved = found
    differing = [k for k in ("settings", "data", "component", "targets") if saved.get(k) != state[k]]
    if differing:
        raise TrainingError(f"checkpoint {folder} was made with other {', '.join(differing)}; set resume to false to "
                            "start over (its checkpoint is replaced), or use the same data and settings.")
    # checkpoints from before the stack was recorded have no entry: nothing to compare
    if "trained_over" in saved and saved["trained_over"] != state["trained_over"]:
        raise TrainingError(f"checkpoint {folder} was trained over {_stack_text(saved['trained_over'])}, but this pipeline "
                            f"carries {_stack_text(state['trained_over'])}; the LoRA learned what was missing on top of "
                            "those, so continuing over others would mix two runs. Load the same LoRAs (same files, "
                            "strengths and experts), or set resume to false to start over.")
    # Everything is read and checked before anything is applied. The layers are not attached to the
    # model yet, so any refusal here (the optimizer's own check below included) leaves the model as it
    # was; the run is dropped with the error.
    try:
        lora = read_lora_tensors(run.layers, lora_file)
        optimizer_state = state_from_tensors(tensors, meta)
        step, losses = int(saved["step"]), [float(loss) for loss in saved["losses"]]
    except TrainingError:
        raise
    except CHECKPOINT_DAMAGE as error:
        raise damaged_checkpoint(folder, error) from None
    if step > steps:
        raise TrainingError(f"checkpoint {folder} is at step {step} and steps is {steps}: set steps to {step} or more "
                            "to continue it, or set resume to false to start over (its checkpoint is replaced).")
    copy_lora_into(run.layers, lora)  # first: adamw_cpu_offload's state load copies the weights to its host copies
    try:
        run.optimizer.load_state_dict(optimizer_state)
    except CHECKPOINT_DAMAGE as error:  # torch's optimizers check the groups before they change anything
        raise damaged_checkpoint(folder, error) from None
    run.step = run.saved_step = step
    run.losses = losses


def _trained_over(loras, component: str) -> list[dict]:
    """The pipeline's LoRAs that act on the trained component, as resume compares them: name, file
    identity (size and a hash of its header and ends), strength, expert."""
    found = []
    for spec in loras:
        if spec.strength != 0 and spec.layers.get(component):
            try:
                identity = file_identity(spec.path)
            except OSError:  # moved or deleted since it was loaded; its tensors are still mapped
                identity = {"size": None, "sha256": None}
            found.append({"name": spec.name, "strength": spec.strength, "expert": spec.expert, **identity})
    return found


def _stack_text(stack: list[dict]) -> str:
    if not stack:
        return "no LoRA"
    return "[" + "; ".join(f"{e['name']} x{e['strength']:g} ({e['expert']}, {e['size']} bytes, "
                           f"sha256 {str(e['sha256'])[:12]})" for e in stack) + "]"


def _checkpoint(run: _Run, folder: Path, meta: dict, state: dict) -> None:
    optimizer_tensors, optimizer_meta = state_to_tensors(run.optimizer)
    write_checkpoint(folder, lora_tensors(run.layers), meta, optimizer_tensors, optimizer_meta,
                     dict(state, step=run.step, losses=run.losses))
    run.saved_step = run.step


def _step(model, objective, batch, run: _Run, settings: TrainSettings, device, passes: Callable[[bool], None]) -> float:
    """One optimizer step. `passes(backward)` tells the strategy which pass comes next, so streamed
    blocks are prefetched in the backward's reverse order, then in the next forward's order."""
    generator = step_generator(settings.seed, run.step)
    passes(False)
    with frozen_saved_by_storage():
        loss = objective.loss(model, batch, generator, device)
    value = float(loss.detach())
    if not math.isfinite(value):
        raise TrainingError(f"the loss is {value} at step {run.step + 1}; lower learning_rate (or check the data).")
    passes(True)
    loss.backward()
    passes(False)  # the next forward's first blocks copy during the optimizer step
    parameters = list(run.layers.parameters())
    if settings.max_grad_norm:
        torch.nn.utils.clip_grad_norm_(parameters, settings.max_grad_norm)
    run.optimizer.step()
    run.optimizer.zero_grad()
    run.step += 1
    run.losses.append(value)
    return value


@contextmanager
def _training_context(model, run: _Run, settings: TrainSettings, blocks, check_interrupt,
                      streams_blocks: bool, offload: ActivationOffload | None = None) -> Iterator[None]:
    """Base frozen, LoRA attached, checkpointing set, Cancel checked per block; all undone on exit.

    Nested before apply_strategy, as memory.lora's ordering rule asks: the LoRA hooks run before
    the strategy's eviction hooks.
    """
    with normal_tensors(model):  # weights and LoRAs loaded under the host's inference mode
        with _frozen(model):
            with ExitStack() as stack:
                stack.enter_context(AttachedLora(model, run.layers))
                # Resident blocks: the last block's activations are kept and each re-run skips its
                # self-attention (autograd.gradient_checkpointing). Streamed blocks re-run in full: their
                # weights move inside the re-run, which selective checkpointing's op replay cannot follow.
                # With activation offload blocks re-run in full too: each block's input waits on the host,
                # and a kept self-attention output (as large as the input) would stay on the device.
                keep_last = None if streams_blocks else list(blocks)[-1]
                selective = not streams_blocks and offload is None
                stack.enter_context(gradient_checkpointing(model, settings.gradient_checkpointing, keep_last,
                                                           selective=selective, offload=offload))
                stack.enter_context(interrupt_checks(list(blocks), check_interrupt))
                yield


@contextmanager
def _frozen(model) -> Iterator[None]:
    """Base weights need no gradient for the run; each parameter's flag is restored afterwards."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
        for parameter, _ in flags:
            parameter.requires_grad_(False)
        yield
    finally:
        for parameter, flag in flags:
            parameter.requires_grad_(flag)
