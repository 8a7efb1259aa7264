"""GET /vidmem/plan: the Memory Strategy's plan before anything is queued. No ComfyUI imports.

The web extension sends the model name (one of the pack's own model lists, never a path), the
Strategy node's widget values and the Sampler's shape. The answer is every tier's predicted
peak VRAM and RAM per stage against the budgets, with the row the run would use: under `auto`, the
Sampler's choice, with the weights where the loader holds them (`+disk` rows are shown with the
loader input they need, never chosen). For a Load
Video Model Files node (loader=VidMemLoadModelFiles) the files, from the host's own lists, are
recognised from their headers (nodes/plan_files.py) and planned with their real storage and the
disk tier, as the run will hold them. The Sampler's context window (window, window_overlap) is
planned per window, and the windows the Sampler would refuse come back as its refusal. The
Strategy's gpus and context_parallel, as the Sampler resolves them, plan two or more GPUs per GPU
(nodes/plan_route_parallel.py: context parallelism or balanced placement, the speedup against one
GPU); gpus=auto with context_parallel off is the one-GPU plan. The Load LoRA nodes on the pipeline's
path are counted as the Sampler counts them, from their files' headers (nodes/plan_loras.py). Planning
builds the architecture on the meta device from config files: no weight is read and no GPU is
touched. It runs on one worker thread, one request at a time, off the server's event loop;
answers are cached by request, and a request that a newer one from the same node replaced
while it waited is answered "superseded" without planning. `nodes/host.py` only registers it.
"""

from __future__ import annotations

import asyncio
import math
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from ..memory import OffloadTier, StrategyError
from ..memory.accounting import Attention
from ..memory.plan.advice import over_budget_lines
from ..memory.plan.candidates import times_differ
from ..memory.plan.costs import TIME_RESOLUTION, MeasuredSpeed
from ..memory.plan.parallel import GpuSharing
from ..memory.plan.planner import PlanOptions, candidate_plans, plan_run, recommended
from ..memory.plan.stages import VideoShape
from .plan_route_parallel import PARALLEL_DEVICE, gpu_rows, gpu_summary, gpu_time, plan_gpus, planned_layout
from .plan_loras import LORA_WIDGETS, TRAINED, LoraRequest, lora_prefix, lora_request, planned_with_loras
from .plan_files import (DEFAULT_WEIGHTS, FILE_ROLES, FILES_LOADER, FilesProblem, FilesRequest, files_request,
                         folder_options, folder_removed, listed_folder_stamp, recognise, text_encoder_files_request,
                         transformer_file_request,
                         vae_dtype_request, weight_dtype_request)
from ..pipelines.comfy_files.text_encoder_file import ROLES as TEXT_ROLES
from ..pipelines.compile import CompileSettings
from ..pipelines.loader import torch_dtype
from .cache import VidMemStepCache
from .lora import VidMemLoadLoRA
from .sampler import VidMemVideoSampler
from .speed import VidMemSpeed
from .strategy import (AUTO, BUDGETS, PARALLEL_WIDGETS, WIDGETS, GiB, VidMemMemoryStrategy, build_strategy, strategy_notes,
                       tile_size_problem)

PLAN_ROUTE = "/vidmem/plan"
STEPS = (1, 1000)  # the Sampler's range
CACHE_PREFIX = "cache_"  # query parameters carrying the Step Cache node's widgets
SPEED_PREFIX = "speed_"  # and the Speed node's
SHAPE = {"width": (16, 4096), "height": (16, 4096), "frames": (1, 1025)}  # the Sampler's ranges
CHUNKS = "activation_chunks"  # an optional Strategy input the plan reads (a query parameter of that name)
WINDOWS = ("window", "window_overlap")  # the Sampler's context windows, in video frames; absent or 0: off


class PlanRequestError(ValueError):
    """A query parameter is missing or wrong; `name` is the parameter (a widget or shape input)."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name


@dataclass(frozen=True)
class PlanRequest:
    model: str
    dtype: str
    shape: VideoShape
    widgets: tuple[tuple[str, object], ...]  # the Strategy's widgets, in INPUT_TYPES order
    vram_budget_gb: float
    ram_budget_gb: float
    files: FilesRequest | None = None  # a Load Video Model Files node's widgets; None for a folder
    transformer_file: tuple[str, int, int] | None = None  # Load Video Pipeline's single-file transformer
    text_encoder_files: tuple[tuple[str, str, int, int], ...] = ()  # its text-encoder files: (component, name, size, mtime)
    weight_dtype: str = DEFAULT_WEIGHTS  # Load Video Pipeline's storage choice for the folder
    vae_dtype: str = ""  # Load Video Pipeline's VAE precision ("" follows dtype); the files' is in `files`
    steps: int = 50  # the Sampler's
    cache: tuple[tuple[str, object], ...] = ()  # the connected Step Cache node's widgets; () when none is
    speed: tuple[tuple[str, object], ...] = ()  # the connected Speed node's widgets; () when none is
    activation_chunks: str = "auto"  # the Strategy's last optional input (nodes/strategy.py CHUNK_CHOICES)
    gpus: str = AUTO  # the Strategy's gpus text ("auto", "0,1", "cpu:2"), checked when planned (parse_parallel)
    context_parallel: str = "off"  # the Strategy's context_parallel choice
    loras: tuple[LoraRequest, ...] = ()  # the Load LoRA nodes from the loader to the Sampler, in order
    trained_loras: int = 0  # the Train LoRA nodes on that path (their LoRAs are not written yet)
    folder_stamp: int = 0  # a folder's files as they are now (pipelines.configs.folder_stamp): a changed folder is planned again

    @property
    def auto(self) -> bool:
        return dict(self.widgets)["offload"] == AUTO


def parse_request(query: Mapping[str, str], model_names: list[str], dtypes: list[str]) -> PlanRequest:
    """A PlanRequest from the query string; PlanRequestError naming the first bad parameter."""
    model = _required(query, "model")
    files = transformer_file = None
    text_encoder_files = ()
    weight_dtype, vae_dtype = DEFAULT_WEIGHTS, ""
    try:
        if query.get("loader") == FILES_LOADER:
            files = files_request(query, dtypes)
        else:
            transformer_file = transformer_file_request(query)
            text_encoder_files = text_encoder_files_request(query)
            weight_dtype = weight_dtype_request(query)
            vae_dtype = vae_dtype_request(query, "vae_dtype", dtypes)
    except FilesProblem as error:
        raise PlanRequestError(error.name, str(error)) from None
    if files is None and model not in model_names:
        raise PlanRequestError("model", f"model={model!r} is not in the pack's model list; choose one the "
                                        "Load Video Pipeline node offers.")
    stamp = listed_folder_stamp(model) if files is None else 0
    dtype = query.get("dtype", "bf16")
    if dtype not in dtypes:
        raise PlanRequestError("dtype", f"dtype={dtype!r} must be one of {', '.join(dtypes)}.")
    spec = {**VidMemMemoryStrategy.INPUT_TYPES()["required"], **VidMemMemoryStrategy.INPUT_TYPES()["optional"]}
    values = {name: _widget(query, name, spec[name]) for name in (*WIDGETS, *BUDGETS, CHUNKS, *PARALLEL_WIDGETS)}
    width, height, frames = (_number(query, name, "INT", *SHAPE[name]) for name in SHAPE)
    cfg = _number(query, "cfg", "FLOAT", 0.0, 30.0) if "cfg" in query else 6.0
    sampler = VidMemVideoSampler.INPUT_TYPES()["optional"]  # the Sampler's own ranges
    # Wan 2.2 A14B's low-noise expert's guidance: the run holds the negative prompt's pass when either is above 1
    cfg_2 = _widget(query, "cfg_2", sampler["cfg_2"])  # -1: as cfg
    window, window_overlap = (_widget(query, name, sampler[name]) for name in WINDOWS)
    shape = VideoShape(width, height, frames, cfg=cfg > 1.0 or cfg_2 > 1.0, window=window, window_overlap=window_overlap)
    steps = _number(query, "steps", "INT", *STEPS) if "steps" in query else 50
    trained = _number(query, TRAINED, "INT", 0, None) if TRAINED in query else 0
    return PlanRequest(model, dtype, shape, tuple((n, values[n]) for n in WIDGETS), *(values[n] for n in BUDGETS),
                       files=files, transformer_file=transformer_file, text_encoder_files=text_encoder_files,
                       weight_dtype=weight_dtype, vae_dtype=vae_dtype,
                       steps=steps, cache=_node_widgets(query, CACHE_PREFIX, VidMemStepCache, "Step Cache"),
                       speed=_node_widgets(query, SPEED_PREFIX, VidMemSpeed, "Speed"), activation_chunks=values[CHUNKS],
                       loras=_loras(query), trained_loras=trained, folder_stamp=stamp,
                       **{name: values[name] for name in PARALLEL_WIDGETS})


def _loras(query: Mapping[str, str]) -> tuple[LoraRequest, ...]:
    """The Load LoRA nodes' widgets, sent as lora<i>_<widget> from i=0 (plan_loras.py); () when none is."""
    if lora_prefix(0) + "lora_name" not in query:  # before INPUT_TYPES: it lists the loras folder
        return ()
    spec = VidMemLoadLoRA.INPUT_TYPES()["required"]
    found = []
    while (prefix := lora_prefix(len(found))) + "lora_name" in query:
        sent = {name[len(prefix):]: text for name, text in query.items() if name.startswith(prefix)}
        try:
            strength, expert = (_widget(sent, name, spec[name]) for name in LORA_WIDGETS[1:])
            found.append(lora_request(len(found), sent["lora_name"], strength, expert))
        except PlanRequestError as error:
            raise PlanRequestError(prefix + error.name, f"the Load LoRA node's {error}") from None
        except FilesProblem as error:
            raise PlanRequestError(error.name, str(error)) from None
    return tuple(found)


def _node_widgets(query: Mapping[str, str], prefix: str, node_cls, node: str) -> tuple[tuple[str, object], ...]:
    """A node connected to the Sampler, its widgets sent as <prefix><name>; () when none is (its
    first widget absent). Every list widget must be one of the node's own choices: the Step Cache's
    mag_ratios becomes a file path when planned, so a name the node does not list (an absolute path,
    `..`, a FIFO) is refused here, before any file is opened."""
    if not any(name.startswith(prefix) for name in query):  # before INPUT_TYPES: the cache node's lists files
        return ()
    types = node_cls.INPUT_TYPES()
    if prefix + next(iter(types["required"])) not in query:
        return ()
    spec = {**types["required"], **types.get("optional", {})}  # optional widgets not sent take their defaults
    sent = {name[len(prefix):]: text for name, text in query.items() if name.startswith(prefix)}
    found = []
    for name, entry in spec.items():
        try:
            found.append((name, _widget(sent, name, entry)))
        except PlanRequestError as error:
            raise PlanRequestError(prefix + name, f"the {node} node's {error}") from None
    return tuple(found)


def _required(query: Mapping[str, str], name: str) -> str:
    value = query.get(name)
    if value is None or value == "":
        raise PlanRequestError(name, f"{name} is missing.")
    return value


def _widget(query: Mapping[str, str], name: str, entry: tuple):
    kind, options = entry
    if isinstance(kind, list):
        value = query.get(name, options.get("default"))
        if value not in kind:
            raise PlanRequestError(name, f"{name}={value!r} must be one of {', '.join(kind)}.")
        return value
    if name not in query:
        return options.get("default")
    if kind == "STRING":  # free text (gpus), checked where it is used
        return query[name]
    if kind == "BOOLEAN":
        text = query[name].lower()
        if text not in ("true", "false"):
            raise PlanRequestError(name, f"{name}={query[name]!r} must be true or false.")
        return text == "true"
    return _number(query, name, kind, options.get("min"), options.get("max"))


def _number(query: Mapping[str, str], name: str, kind: str, low, high):
    text = _required(query, name)
    try:
        value = int(text) if kind == "INT" else float(text)
    except ValueError:
        raise PlanRequestError(name, f"{name}={text!r} must be {'a whole number' if kind == 'INT' else 'a number'}.") from None
    if kind == "FLOAT" and not math.isfinite(value):
        raise PlanRequestError(name, f"{name}={text} must be a finite number.")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"at least {low}" if high is None else f"at most {high}" if low is None else f"from {low} to {high}"
        raise PlanRequestError(name, f"{name}={value} must be {bounds}.")
    return value


def plan_answer(request: PlanRequest, load_model: Callable[[str, str], object], budgets: tuple[int, int],
                device: str | None = None, visible_gpus: int | None = None) -> dict:
    """The plan as JSON-ready data: one row per tier (and the user's own settings), the chosen row marked.

    `load_model(name, dtype[, vae_dtype][, removed=])` gives the plannable meta model; `budgets` are the host's default
    (VRAM, RAM) bytes, used where the widgets say 0; `device` the torch device type the host
    computes on (None: cuda when present, else cpu); `visible_gpus` the CUDA GPUs it shows (None:
    probed), which gpus=auto counts under context parallelism. Two or more GPUs are planned per GPU
    (plan_route_parallel.py) with a "parallel" summary; one GPU's answer has no "parallel" key. Bad
    widgets or a shape the model cannot take come back as {"status": "error", "input": name, "error": message}.
    """
    widgets = dict(request.widgets)
    try:
        problem = tile_size_problem(widgets["tile_size"]) if widgets["vae_tiling"] else None
        if problem:
            raise StrategyError(problem)
        strategy = build_strategy(**widgets, activation_chunks=request.activation_chunks)
        layout = planned_layout(request.gpus, request.context_parallel,
                                _visible_gpus() if visible_gpus is None else visible_gpus)
        model, options = _model_and_options(request, load_model)
        model, loras = planned_with_loras(model, request.loras, request.trained_loras)  # as the Sampler plans them
        _check_windows(request, model)
        if layout is not None and layout.mode is not GpuSharing.BALANCED:
            from ..pipelines.sample_checks import refuse_cache_in_parallel, refuse_windows_in_parallel

            refuse_windows_in_parallel(request.shape)  # the Sampler's refusals, before any rank starts
            cache = _step_cache(request)
            if not isinstance(cache, StrategyError):
                refuse_cache_in_parallel(cache)
        device = device or _probed_device()
        options = replace(options, device=device, steps=request.steps,
                          attention=_planned_attention(request, device, torch_dtype(request.dtype), _masked_by(request, model)),
                          speed=_measured_speed(request, device), cache_state=_cache_state(request, model))
        vram = int(request.vram_budget_gb * GiB) or budgets[0]
        ram = int(request.ram_budget_gb * GiB) or budgets[1]
        base = replace(strategy, offload=OffloadTier.MODEL, blocks_to_swap=0)
        if layout is not None:
            return _gpus_answer(request, model, options, plan_gpus(model, request.shape, layout, vram, ram, base, options,
                                                                   None if request.auto else strategy), (vram, ram), loras)
        plans = candidate_plans(model, request.shape, vram, ram, base=base, options=options)
        labels = [_label(plan, options) for plan in plans]
        chosen = as_loaded_choice(plans, options)
        if not request.auto:
            plans.append(plan_run(model, request.shape, strategy, options, vram_budget_bytes=vram, ram_budget_bytes=ram))
            labels.append("your settings")
            chosen = len(plans) - 1
    except (FilesProblem, ValueError, OSError) as error:  # StrategyError, PlanError, ModelError: all name their input
        return _error(error)
    needs = _disk_input(request)
    return {
        **_head(request, model, options, vram, ram, loras),
        "rows": [_row(label, plan, model, needs if plan.on_disk != options.on_disk else "")
                 for label, plan in zip(labels, plans)],
        "chosen": chosen,
        "time": _time(plans, options, request.dtype),
        "notes": list(strategy_notes(widgets["offload"], widgets["blocks_to_swap"])),  # values the tier ignores
        "speed": _speed_lines(request, model, options, plans[chosen] if chosen is not None else None),
    }


def as_loaded_choice(plans, options: PlanOptions) -> int | None:
    """The row the Sampler's `auto` runs (pipelines/planning.choose_for): the fastest that fits with the
    weights held as the loader holds them. A `+disk` row needs another load, so it is shown, never chosen."""
    held = [i for i, plan in enumerate(plans) if plan.on_disk == options.on_disk]
    best = recommended([plans[i] for i in held])
    return None if best is None else held[best]


def _disk_input(request: PlanRequest) -> str:
    """The loader input that keeps the weights memory-mapped from their files, for the `+disk` rows."""
    if request.files is not None:
        if not request.files.weights_on_disk:
            return "weights_on_disk on (Load Video Model Files)"
        # weight_dtype re-stored the matrices at load: those live in RAM whatever weights_on_disk says.
        return "weight_dtype default, weights_on_disk on (Load Video Model Files)"
    if request.transformer_file or request.text_encoder_files:  # replaced components are held in RAM
        return ("Load Video Pipeline with the folder's own transformer and text encoder, weight_dtype the format "
                "its files store (e.g. bf16)")
    return "weight_dtype set to the format the folder's files store, e.g. bf16 (Load Video Pipeline)"


def _error(error: Exception) -> dict:
    if isinstance(error, FilesProblem):
        return {"status": "error", "input": error.name, "error": str(error)}
    return {"status": "error", "input": _input_named(str(error)), "error": str(error)}


def _head(request: PlanRequest, model, options: PlanOptions, vram: int, ram: int, loras: list[str]) -> dict:
    """What every answer starts with: the model, its storage, the shape and its windows, the budgets, and
    the LoRAs counted (`loras`: plan_loras' lines, [] when none is on the path)."""
    s = request.shape
    return {
        "status": "ok", "model": request.model, "auto": request.auto,
        "config": getattr(model, "name", request.model), "storage": dict(options.storage), "on_disk": options.on_disk,
        "shape": {"width": s.width, "height": s.height, "frames": s.frames, "window": s.window,
                  "window_overlap": s.window_overlap},
        "windows": _window_lines(request.shape, model),
        "budgets": {"vram_bytes": vram, "ram_bytes": ram},
        "device": options.device,  # "cpu": the host computes on its CPU (--cpu, no CUDA), so the RAM budget decides
        "loras": loras,
    }


def _gpus_answer(request: PlanRequest, model, options: PlanOptions, found, budgets: tuple[int, int],
                 loras: list[str]) -> dict:
    """Two or more GPUs: the rows per GPU (plan_route_parallel.gpu_rows, the one-GPU rows' shape), the
    time as the speedup against one GPU, and "parallel", what the chart's title line says."""
    widgets = dict(request.widgets)
    return {
        **_head(request, model, replace(options, device=PARALLEL_DEVICE), *budgets, loras),  # planned for the GPUs
        "rows": gpu_rows(found),
        "chosen": found.chosen,
        "time": gpu_time(found),
        "notes": list(strategy_notes(widgets["offload"], widgets["blocks_to_swap"])),
        "speed": _speed_lines(request, model, replace(options, device=PARALLEL_DEVICE)),  # no cached time: one GPU's rule
        "parallel": gpu_summary(found),
    }


def _check_windows(request: PlanRequest, model) -> None:
    """The Sampler's refusals of these windows on this model (ModelError naming window or
    window_overlap): its frame grid, the families and CogVideoX 1.5 that take no windows. A step cache
    runs beside windows (one cache state per window), so it is not asked about."""
    from ..pipelines.context_windows import ContextWindows, window_problem
    from ..pipelines.family import ModelError

    s = request.shape
    config = model.components[model.layout.denoisers[0]].config
    problem = window_problem(model.spec.name, config, ContextWindows(s.window, s.window_overlap), s.frames,
                             model.spec.frames_error, model.geometry.temporal_factor)
    if problem:
        raise ModelError(problem)


def _window_lines(shape: VideoShape, model) -> list[str]:
    """What the windows are, for the line under the verdict: [] when off."""
    from ..pipelines.context_windows import ContextWindows, window_note

    windows = ContextWindows(shape.window, shape.window_overlap)
    note = window_note(windows, shape.frames)
    if not windows.on or note:
        return [note] if note else []
    schedule = windows.schedule(shape.frames, model.geometry.temporal_factor)
    return [f"{shape.window}-frame windows, overlap {shape.window_overlap}, of {shape.frames} frames: {schedule.count} "
            "windows a step; the denoise peak follows one window, latents and decode the whole clip"]


def _speed_lines(request: PlanRequest, model, options: PlanOptions, plan=None) -> list[str]:
    """What makes this run faster than the rows say: the connected Speed node's choices as they would
    resolve on this device, and the connected step cache's skips and the time they save on `plan`
    (the chosen row), both known before the run."""
    return [*_speed_node_lines(request, options, model), *_cache_lines(request, model, plan)]


def _masked_by(request: PlanRequest, model) -> str:
    """The model, when its attention passes a mask (as the Sampler's `sample_checks.masked_by` names it)."""
    return f"{model.spec.name} ({request.model})" if model.spec.attention_masked else ""


def _planned_attention(request: PlanRequest, device: str, dtype, masked_by: str = "") -> Attention:
    """As the run plans it (ResolvedSpeed.planned_attention): the kernel resolved on this host's device, where it
    computes there, so an auto that falls back to SDPA's math kernel (an sm75 card in bf16) holds the whole score
    matrix as the run will; for a GPU this process cannot see, math and flex chosen on the Speed node do."""
    import torch

    from ..pipelines.attention import resolve_attention
    from ..pipelines.speed import ResolvedSpeed, Speed, planned_attention

    try:
        speed = Speed(dict(request.speed).get("attention", "auto"))
        if device == "cuda" and not torch.cuda.is_available():
            return planned_attention(speed)
        return ResolvedSpeed(speed, resolve_attention(speed.attention, device, dtype, masked_by)).planned_attention
    except StrategyError:  # named in the speed line
        return Attention.FUSED


def _requested_speed(request: PlanRequest):
    """The connected Speed node's Speed (None when none is); StrategyError naming a bad widget."""
    from ..pipelines.speed import Speed

    if not request.speed:
        return None
    widgets = dict(request.speed)
    return Speed(widgets["attention"], CompileSettings(widgets["compile"], widgets["compile_mode"],
                                                       widgets["compile_dynamic"]), widgets["fp8_matmul"])


def _measured_speed(request: PlanRequest, device: str) -> MeasuredSpeed:
    """What the Speed node's choices measured on this device (the time the rows estimate), with the Load LoRA nodes'
    hooks and the Strategy's context parallelism as the Sampler would run them; none when bad (named in the speed
    line) or not measured here."""
    from ..pipelines.speed import measured_speed

    try:
        speed = _requested_speed(request)
    except StrategyError:
        return MeasuredSpeed()
    if speed is None:
        return MeasuredSpeed()
    return measured_speed(speed, device, lora_hooks=any(lora.strength != 0 for lora in request.loras),
                          context_parallel=_context_parallel(request))


def _context_parallel(request: PlanRequest) -> bool:
    return request.context_parallel != "off"


def _speed_node_lines(request: PlanRequest, options: PlanOptions, model) -> list[str]:
    from ..pipelines.speed import speed_plan_line

    try:
        speed = _requested_speed(request)
    except StrategyError as error:
        return [f"speed: {error}"]
    if speed is None:
        return []
    masked_by = _masked_by(request, model)  # as the Sampler refuses
    stored = {options.storage_of(name) for name in model.layout.denoisers} - {None}  # as the loader holds them
    line = speed_plan_line(speed, options.device, torch_dtype(request.dtype), masked_by, _context_parallel(request),
                           tuple(stored))
    return [f"speed: {line}"]


def _step_cache(request: PlanRequest):
    """The connected Step Cache node's StepCache (off when none is), or the StrategyError its widgets make."""
    from ..pipelines.step_cache import StepCache

    if not request.cache:
        return StepCache()
    widgets = dict(request.cache)
    try:
        taylor = {name: widgets[name] for name in ("interval", "warmup_steps", "end_steps", "order") if name in widgets}
        return StepCache(widgets["method"], widgets["threshold"], widgets["retention"], widgets["max_skip_steps"],
                         calibrate=True, **taylor)  # the ratios are found by plan_line; calibrate lets it build without them
    except StrategyError as error:
        return error


def _cache_state(request: PlanRequest, model) -> dict:
    """What the connected step cache keeps on the device per denoiser (none where its widgets are refused:
    the cache lines say why)."""
    cache = _step_cache(request)
    return {} if isinstance(cache, StrategyError) else cache.planned_state(model.layout.denoisers)


def _cache_lines(request: PlanRequest, model, plan=None) -> list[str]:
    """The connected step cache's skips, and with them the chosen row's time (`plan`, None: no row chosen)."""
    if not request.cache:
        return []
    from ..pipelines.context_windows import ContextWindows
    from ..pipelines.step_cache import cache_plan, cached_time_line, layout_key
    from .host import mag_ratios_folder

    widgets = dict(request.cache)
    cache = _step_cache(request)
    if isinstance(cache, StrategyError):
        return [f"step cache: {cache}"]
    denoisers = {name: (c.config["num_layers"], c.config) for name, c in model.components.items()
                 if name.startswith("transformer")}
    windows = ContextWindows(request.shape.window, request.shape.window_overlap)
    planned = cache_plan(layout_key(model.pipeline_class, denoisers), request.steps, list(denoisers), cache,
                         str(widgets["mag_ratios"]), mag_ratios_folder(),
                         windows.count(request.shape.frames, model.geometry.temporal_factor))
    if not planned.text:
        return []
    time = f" {cached_time_line(plan, planned.share)}" if plan is not None and planned.share is not None else ""
    return [f"step cache: {planned.text}{time}"]


def _probed_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _model_and_options(request: PlanRequest, load_model: Callable[[str, str], object]) -> tuple[object, PlanOptions]:
    """The plannable model and how its weights are held: a folder's at the compute dtype; single
    files recognised from their headers, with their own storage and the disk tier."""
    if request.files is None:  # the VAE's own dtype only when set: load_model(name, dtype[, vae_dtype][, removed=])
        removed = folder_removed(request.model, request.text_encoder_files)  # a Gemma file without its vision tower
        model = load_model(request.model, request.dtype, *([request.vae_dtype] if request.vae_dtype else []),
                           **({"removed": removed} if removed else {}))
        return model, folder_options(request.model, request.weight_dtype, request.transformer_file, request.text_encoder_files,
                                     request.dtype)
    recognised = recognise(request.files, request.dtype)
    return recognised.planner_model, recognised.options


def _label(plan, options: PlanOptions) -> str:
    """"block_swap 37", "chunks 4" where blocks compute in token slices, and "+disk" where the planner put
    weights on disk that the loader holds in RAM."""
    s = plan.strategy
    blocks = f" {s.blocks_to_swap}" if s.offload is OffloadTier.BLOCK_SWAP else ""
    chunks = f" chunks {s.activation_chunks}" if s.activation_chunks != 1 else ""
    return s.offload.value + blocks + chunks + (" +disk" if plan.on_disk and not options.on_disk else "")


def _row(label: str, plan, model, needs: str = "") -> dict:
    """One chart row; `needs`: the loader input this row's weights need (a `+disk` row), "" when it runs as loaded."""
    return {
        "label": label, "strategy": plan.strategy.describe(), "fits": plan.fits, "on_disk": plan.on_disk, "needs": needs,
        "est_slowdown": plan.est_slowdown, "peak_vram_bytes": plan.peak_vram_bytes, "peak_ram_bytes": plan.peak_ram_bytes,
        # on a CPU a stage's RAM holds its compute too (StagePlan.ram_bytes): what fits the RAM budget
        "stages": [{"name": s.name, "vram_bytes": s.device_bytes, "ram_bytes": s.ram_bytes} for s in plan.stages],
        "over_budget": over_budget_lines(model, plan),  # one line per stage, with the fix that makes it fit
    }


def _time(plans, options: PlanOptions, dtype: str = "") -> dict:
    """Whether the rows' estimated times say anything (they differ by more than the model can tell),
    and what they are relative to: the same run with every weight where it computes, the decode whole.
    `dtype`: the compute dtype's name; a weight stored otherwise is upcast in every row, never in the baseline."""
    where = "every weight on the GPU" if not options.on_cpu else "nothing streamed"
    if any(fmt != dtype for name, fmt in options.storage if name != "vae"):  # a wider VAE computes as stored
        where += " in the compute dtype (no per-layer upcasts)"
    times = [plan.est_slowdown for plan in plans]
    return {"shown": times_differ(plans), "resolution": TIME_RESOLUTION, "range": [min(times), max(times)],
            "relative_to": f"the same run with {where} and the decode in one piece"}


def _input_named(message: str) -> str | None:
    """The input a planner or strategy message is about: its messages start 'name=value'."""
    head = message.split("=", 1)[0].strip()
    role = message.split(":", 1)[0].strip()
    role = role if " " not in role else role.split(" ", 1)[0]  # "transformer_file 'x' is not the transformer of ..."
    # The file loaders' messages start 'role: ...'.
    if role in (*FILE_ROLES, "transformer_file", *TEXT_ROLES.values(), "weight_dtype"):
        return role
    known = (*WIDGETS, *BUDGETS, CHUNKS, *SHAPE, *WINDOWS, *PARALLEL_WIDGETS)
    return head if head in known else next((name for name in known if f"{name}=" in message), None)


class PlanService:
    """Cache, one worker thread, and newest-wins per client (the node that asked)."""

    def __init__(self, answer: Callable[[PlanRequest], dict], cache_size: int = 64) -> None:
        self._answer = answer
        self._cache: OrderedDict[PlanRequest, dict] = OrderedDict()
        self._cache_size = cache_size
        self._latest: dict[str, PlanRequest] = {}
        self._lock: asyncio.Lock | None = None  # made on the server's loop at the first request
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vidmem-plan")
        self.computed = 0  # plans made (not served from the cache), for tests and logs

    async def plan(self, request: PlanRequest, client: str = "") -> dict:
        cached = self._cached(request)
        if cached is not None:
            return cached
        self._latest[client] = request
        if self._lock is None:
            self._lock = asyncio.Lock()
        try:
            async with self._lock:  # one plan at a time; later requests wait here
                if self._latest.get(client) != request:
                    return {"status": "superseded"}
                cached = self._cached(request)
                if cached is None:
                    answer = await asyncio.get_running_loop().run_in_executor(self._worker, self._answer, request)
                    self.computed += 1
                    cached = self._store(request, answer)
                return cached
        finally:  # answered (or superseded, or failed): nothing kept per client, however many pages asked
            if self._latest.get(client) is request:
                del self._latest[client]

    def _cached(self, request: PlanRequest) -> dict | None:
        answer = self._cache.get(request)
        if answer is not None:
            self._cache.move_to_end(request)
            return dict(answer, cached=True)
        return None

    def _store(self, request: PlanRequest, answer: dict) -> dict:
        self._cache[request] = answer
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return dict(answer, cached=False)
