"""A model the planner can measure: its real classes built on `meta`, two blocks per denoiser.

`MetaModel` implements `vidmem.memory.plan.planner.PlannerModel` for a CogVideoX or Wan pipeline
described by component configs (a shipped JSON file or a diffusers folder's config.json files).
Components are built lazily, once, with the dtypes `from_pretrained(torch_dtype=...)` gives
(`_keep_in_fp32_modules` stay float32). Block-bearing components are built with at most two
blocks: blocks are identical, so their weights are extrapolated to the real count and the
activation peak of two blocks is the peak of all of them. Traces are memoised per call, and
kept on disk across processes with the components' split into tensors (`plan_cache.py`): a plan
the cache holds builds no module and imports no diffusers or transformers class.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field, replace
from functools import cached_property

import torch

from ...memory.accounting import Attention, OpCache, Trace, trace
from ...memory.plan.planner import Call, ModelLayout, VideoShape
from ...memory.plan.schedule import ComponentWeights, SlotTable, slot_table
from ...memory.plan.storage import StoredSizes, stored_sizes
from ...memory.storage import storage_format
from ...memory.strategy import StrategyError, TextEncoderPlacement
from ...memory.units import DTYPES
from ...memory.vae_tiles import VaeGeometry
from ..family import FamilySpec, ModelError, positions_error
from ..stages import stage_components
from . import workloads
from .plan_cache import PlanCache, digest, log
from .streams import expand_blocks

# Class -> the config key holding its block count (what build_meta caps at TRACED_BLOCKS).
BLOCK_COUNT = {
    "CogVideoXTransformer3DModel": "num_layers",
    "WanTransformer3DModel": "num_layers",
    "T5EncoderModel": "num_layers",
    "UMT5EncoderModel": "num_layers",
    "CLIPVisionModel": "num_hidden_layers",
    "CLIPVisionModelWithProjection": "num_hidden_layers",
    "HunyuanVideo15Transformer3DModel": "num_layers",
    "LTX2VideoTransformer3DModel": "num_layers",
    "Qwen2_5_VLTextModel": "num_hidden_layers",
    "SiglipVisionModel": "num_hidden_layers",
}
# Encoder class -> dotted path of its block list (what the planner extrapolates). A denoiser's
# blocks are its family's own declaration, FamilySpec.blocks_attr: the list the engine swaps.
ENCODER_BLOCKS = {
    "T5EncoderModel": "encoder.block",
    "UMT5EncoderModel": "encoder.block",
    "CLIPVisionModel": "encoder.layers|vision_model.encoder.layers",  # transformers 5 | 4
    "CLIPVisionModelWithProjection": "vision_model.encoder.layers",
    "Qwen2_5_VLTextModel": "layers",
    "SiglipVisionModel": "vision_model.encoder.layers",
}
TRACED_BLOCKS = 2
# Calls whose components a tier can stream module by module: their traces mark where each module ran.
STREAMED_KINDS = ("text_encode", "condition", "denoise", "decode", "decode_context", "decode_stream")


@dataclass(frozen=True)
class ComponentConfig:
    name: str
    library: str  # "diffusers" | "transformers"
    class_name: str
    config: dict
    source: str = ""


@dataclass
class MetaModel:
    name: str
    pipeline_class: str
    spec: FamilySpec
    components: dict[str, ComponentConfig]
    dtype_name: str
    pipeline_config: dict = field(default_factory=dict)
    source: str = ""
    vae_dtype_name: str = ""  # "" when the VAE runs in dtype_name (Wan's docs run it in fp32)
    disk_cache: bool = True  # keep measurements in the user's plan cache (plan_cache.py; VIDMEM_PLAN_CACHE=0: off)
    # "component.sub.module" paths the loader removed (a Gemma 3 text encoder file without its vision tower):
    # left out of every build, so their weights are not counted.
    removed: tuple[str, ...] = ()
    _built: dict = field(default_factory=dict, repr=False)
    _weights: dict = field(default_factory=dict, repr=False)
    _traces: dict = field(default_factory=dict, repr=False)
    _streams: dict = field(default_factory=dict, repr=False)
    _cache: OpCache = field(default_factory=OpCache, repr=False)

    # --- PlannerModel -----------------------------------------------------------------------

    @cached_property
    def layout(self) -> ModelLayout:
        present = lambda names: tuple(n for n in names if n in self.components)  # noqa: E731
        image = self.pipeline_class in self.spec.image_conditioned
        conditioning = (*present(("image_encoder",)), "vae") if image else ()
        return ModelLayout(("text_encoder",), present(self.spec.denoisers), "vae", present(self.spec.encoders), conditioning,
                           present(self.spec.call_encoders))

    @cached_property
    def geometry(self) -> VaeGeometry:
        config = self.components["vae"].config
        if "spatial_compression_ratio" in config:  # VAEs that state their factors (HunyuanVideo 1.5)
            return VaeGeometry(int(config["spatial_compression_ratio"]), int(config.get("temporal_compression_ratio", 4)),
                               config["latent_channels"])
        if self.spec.name == "cogvideox":
            spatial = 2 ** (len(config.get("block_out_channels", (128, 256, 256, 512))) - 1)
            return VaeGeometry(spatial, int(config.get("temporal_compression_ratio", 4)), config.get("latent_channels", 16))
        return VaeGeometry(config.get("scale_factor_spatial", 8), config.get("scale_factor_temporal", 4), config.get("z_dim", 16))

    @property
    def vae_stream_batch(self) -> int | None:
        """The latent frames per batch if the VAE's decode streams across chunks (see FamilySpec.vae_stages)."""
        return self._vae_stages[0]

    @property
    def vae_shared_context(self) -> bool:
        """Whether the staged decode runs frame-wide layers once on the whole latent first (stages.context)."""
        return self._vae_stages[1]

    @cached_property
    def _vae_stages(self) -> tuple[int | None, bool]:
        cached = self._cached("weights", "vae_stages", lambda entry: (entry["frame_batch"], bool(entry["context"])))
        if cached is not None:
            return cached[0]
        stages = self.spec.vae_stages(self.module("vae"))
        found = (stages.frame_batch, stages.context is not None) if stages else (None, False)
        self._keep("weights", "vae_stages", {"frame_batch": found[0], "context": found[1]})
        return found

    @property
    def vae_min_tile(self) -> int:
        return self.spec.min_decode_tile

    def stage_components(self, text_encoder: TextEncoderPlacement, encode_text: bool = True) -> tuple[str, ...]:
        """What `pipelines.sample` applies the strategy to, for this pipeline class (pipelines/stages.py)."""
        image = self.pipeline_class in self.spec.image_conditioned
        return stage_components(self.spec, self.components, text_encoder, image, encode_text)

    def check_shape(self, shape: VideoShape) -> None:
        problem = self.spec.frames_error(shape.frames)
        if problem:
            raise ModelError(problem)
        multiple = self.geometry.spatial_factor * self._patch
        for label, value in (("width", shape.width), ("height", shape.height)):
            if value < multiple or value % multiple:
                fix = max(multiple, value // multiple * multiple)
                rule = f"a multiple of {multiple}" + (f", at least {multiple}" if value < multiple else "")
                raise ModelError(f"{label}={value} must be {rule} for {self.name}; use {fix} or {fix + multiple}.")
        config = self.components[self.layout.denoisers[0]].config
        if config.get("use_learned_positional_embeddings"):
            size = (config.get("sample_width", 90) * self.geometry.spatial_factor, config.get("sample_height", 60) * self.geometry.spatial_factor)
            if (shape.width, shape.height) != size:
                raise ModelError(f"width={shape.width}, height={shape.height}: {self.name} has learned positional embeddings "
                                 f"and only generates {size[0]}x{size[1]}; use width {size[0]} and height {size[1]} "
                                 f"(--size {size[0]}x{size[1]}).")
        problem = positions_error(self.spec, config, self.geometry.spatial_factor, self.geometry.temporal_factor,
                                  self.name, shape.width, shape.height, shape.frames)
        if problem:
            raise ModelError(problem)
        if shape.batch < 1:
            raise ModelError(f"batch={shape.batch} must be at least 1.")

    def latent_shape(self, shape: VideoShape) -> tuple[int, int, int, int, int]:
        s, g = self.geometry.spatial_factor, self.geometry
        return (shape.batch, g.latent_channels, (shape.frames - 1) // g.temporal_factor + 1, shape.height // s, shape.width // s)

    def forward_passes(self, shape: VideoShape) -> int:
        return 2 if shape.cfg and not self.spec.cfg_as_batch else 1

    def weights(self, component: str, storage: str | None = None) -> ComponentWeights:
        """The component's tensors as stored: `storage` names a StorageFormat (None: the compute dtype)."""
        key = (component, storage)
        if key not in self._weights:
            cached = self._cached("weights", f"{component}|{storage or ''}", lambda e: _weights_from_json(component, e))
            if cached is not None:
                self._weights[key] = cached[0]
                return cached[0]
            module, blocks = self.module(component), self.blocks(component)
            fmt = storage_format(storage) if storage else None
            stored = stored_sizes(module, fmt)
            table = slot_table(module, blocks, stored)
            self._weights[key] = ComponentWeights(component, sum(table.sizes), table.block_count, table.sizes, stored, table)
            self._keep("weights", f"{component}|{storage or ''}", _weights_json(self._weights[key]))
        return self._weights[key]

    def module(self, component: str) -> torch.nn.Module:
        """The full-size component on meta (weights and residency come from it)."""
        if component not in self._built:
            self._built[component] = self._without_removed(component, build_meta(self.components[component],
                                                                                 self.dtype_of(component)))
        return self._built[component]

    def blocks(self, component: str) -> torch.nn.ModuleList | None:
        """The blocks the engine swaps: a denoiser's `spec.blocks_attr`, else None."""
        if component not in self.layout.denoisers:
            return None
        return getattr(self.module(component), self.spec.blocks_attr)

    def stream_order(self, call: Call):
        """The module order `call` ran in (None before it was traced): its own, never another call's of
        the same kind, which may differ (a VAE encodes and decodes in different orders, a causal VAE
        decodes one latent frame in another than 21, activation chunks call some layers per slice), so
        a plan does not depend on what the process planned before it."""
        return self._streams.get(call)

    def trace(self, call: Call, attention: Attention) -> Trace:
        key = (call, Attention(attention))
        if key not in self._traces:
            streams = call.kind in STREAMED_KINDS
            record = streams and call not in self._streams
            file, entry = _trace_file(call, attention), _call_key(call)
            cached = self._cached(file, entry, _trace_from_json)
            if cached is not None and not (record and cached[0][1] is None):  # kept without the order it ran in
                self._traces[key], order = cached[0]
                if record:
                    self._streams[call] = order
                return self._traces[key]
            try:
                module = self.traced_module(call.component) if streams else None
                measured = trace(self._workload(call), attention, self._cache, module)
            except StrategyError:  # the strategy's own refusal (activation_chunks on blocks that cannot chunk): its fix
                raise
            except (ValueError, RuntimeError) as error:
                raise ModelError(f"width={call.shape.width}, height={call.shape.height}, frames={call.shape.frames}: "
                                 f"{self.name} cannot run {call.kind} at this size ({error}); change width, height "
                                 "or frames to a size the model is made for.") from error
            self._traces[key] = replace(measured, flops=measured.flops * self._block_scale(call.component))
            # an order already recorded (the same call under another attention kernel) is kept with this entry too
            order = self._order(call.component, measured.marks) if record and measured.marks else self._streams.get(call)
            if order is not None:
                self._streams[call] = order
            self._keep(file, entry, _trace_json(self._traces[key], order))
        return self._traces[key]

    def _order(self, component: str, marks) -> tuple:
        """The module order of a traced call (the sequential tier's schedule input), its traced
        blocks extended to the real count: blocks are identical and run in index order."""
        events = [(start, name) for _, start, name in marks]
        path = self._blocks_of(component)
        traced = len(self._block_list(component)) if path else 0
        count = self.real_block_count(component)
        return tuple(expand_blocks(events, path, traced, count) if path and count > traced else events)

    def _block_scale(self, component: str) -> float:
        """FLOPs are almost all in the blocks: scale a two-block trace to the real count."""
        blocks = self._block_list(component)
        return self.real_block_count(component) / len(blocks) if blocks else 1.0

    # --- the disk cache (plan_cache.py) ------------------------------------------------------

    def identity(self) -> dict:
        """Everything this model's measurements depend on besides the code: its resolved configuration."""
        return {"name": self.name, "pipeline": self.pipeline_class, "pipeline_config": self.pipeline_config,
                "dtype": self.dtype_name, "vae_dtype": self.vae_dtype_name,
                "components": {n: [c.library, c.class_name, c.config] for n, c in sorted(self.components.items())},
                **({"removed": list(self.removed)} if self.removed else {})}  # absent: the caches of before stay valid

    @cached_property
    def _disk(self) -> PlanCache | None:
        return PlanCache.open(self.identity()) if self.disk_cache else None

    def _cached(self, file: str, key: str, decode) -> tuple | None:
        """(value,) from the disk cache, or None on a miss; an entry that does not decode is logged and missed."""
        entry = self._disk.get(file, key) if self._disk is not None else None
        if entry is None:
            return None
        try:
            return (decode(entry),)
        except (KeyError, TypeError, ValueError, IndexError) as error:
            log.warning("vidmem: ignoring a damaged plan cache entry %s in %s/%s.json (%r); it is measured again",
                        key, self._disk.folder, file, error)
            return None

    def _keep(self, file: str, key: str, value) -> None:
        if self._disk is not None:
            self._disk.put(file, key, value)

    # --- building ---------------------------------------------------------------------------

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.dtype_name]

    def dtype_of(self, component: str) -> torch.dtype:
        """The dtype `component` computes in: the model's, or the VAE's own when it differs."""
        if component == "vae" and self.vae_dtype_name:
            return DTYPES[self.vae_dtype_name]
        return self.dtype

    def dtype_bytes(self, component: str) -> int:
        return self.dtype_of(component).itemsize

    @property
    def _patch(self) -> int:
        patch = self.components[self.layout.denoisers[0]].config.get("patch_size", 2)
        return patch[-1] if isinstance(patch, (list, tuple)) else patch

    def traced_module(self, component: str) -> torch.nn.Module:
        """The component with at most two blocks: what the traces run (blocks are identical)."""
        key = f"{component}@traced"
        if key not in self._built:
            if self._blocks_of(component) is None:
                self._built[key] = self.module(component)
            else:
                built = build_meta(self.components[component], self.dtype_of(component), TRACED_BLOCKS)
                self._built[key] = self._without_removed(component, built)
        return self._built[key]

    def _without_removed(self, component: str, module: torch.nn.Module) -> torch.nn.Module:
        """`module` with the submodules `removed` names under `component` set to None, as the loader left them."""
        for path in self.removed:
            owner, _, sub = path.partition(".")
            if owner == component:
                parent, _, leaf = sub.rpartition(".")
                setattr(module.get_submodule(parent), leaf, None)
        return module

    def real_block_count(self, component: str) -> int:
        path = self._blocks_of(component)
        return len(_get(self.module(component), path)) if path else 0

    def _blocks_of(self, component: str) -> str | None:
        """Dotted path of the block list (the first that exists, for paths that moved between versions)."""
        if component in self.spec.denoisers:
            paths = self.spec.blocks_attr
        else:
            paths = ENCODER_BLOCKS.get(self.components[component].class_name)
        if paths is None:
            return None
        module = self.module(component)
        return next((path for path in paths.split("|") if _get(module, path) is not None), None)

    def _block_list(self, component: str):
        path = self._blocks_of(component)
        return _get(self.traced_module(component), path) if path else None

    def _workload(self, call: Call):
        return workloads.workload_for(self, call)


def _weights_json(weights: ComponentWeights) -> dict:
    stored = weights.stored
    return {"table": weights.table.as_json(), "storage": stored.storage, "transient_bytes": stored.transient_bytes,
            "stored_weights": stored.stored_weights}


def _weights_from_json(component: str, entry: dict) -> ComponentWeights:
    table = SlotTable.from_json(entry["table"])
    # Per-tensor stored bytes are already in the table's sizes; by_tensor keys module objects, never cached.
    stored = StoredSizes(entry["storage"], transient_bytes=int(entry["transient_bytes"]),
                         stored_weights=int(entry["stored_weights"]))
    return ComponentWeights(component, sum(table.sizes), table.block_count, table.sizes, stored, table)


def _trace_file(call: Call, attention: Attention) -> str:
    """One file per shape and attention kernel: what the planner measures for one request."""
    shape = call.shape
    return f"traces-{digest([shape.width, shape.height, shape.frames, shape.batch, shape.cfg, Attention(attention).value])[:16]}"


def _call_key(call: Call) -> str:
    chunks = [call.chunks] if call.chunks != 1 else []  # unchunked calls keep the keys they were cached under
    # a context-parallel rank's trace (RankCall) is its own: without these a rank read the one-GPU trace back
    rank = [{"degree": call.degree, "mode": call.mode}] if getattr(call, "degree", 1) > 1 else []
    parked = [{"parked": True}] if call.parked else []  # a parked context's trace is its own
    return json.dumps([call.kind, call.component, call.piece, call.vae_tiling, *chunks, *rank, *parked])


def _trace_json(measured: Trace, order) -> dict:
    return {"peak_bytes": measured.peak_bytes, "events": measured.events, "flops": measured.flops,
            "live_bytes": measured.live_bytes, "marks": [[p, s, n] for p, s, n in measured.marks],
            "order": None if order is None else [[s, n] for s, n in order]}


def _trace_from_json(entry: dict) -> tuple[Trace, tuple | None]:
    """The trace, and the module order it ran in (None: not a streamed kind, or kept before orders were kept per call)."""
    measured = Trace(int(entry["peak_bytes"]), tuple(int(e) for e in entry["events"]), entry["flops"],
                     int(entry["live_bytes"]), tuple((int(p), bool(s), str(n)) for p, s, n in entry["marks"]))
    if not isinstance(measured.flops, (int, float)):
        raise TypeError(f"flops {measured.flops!r}")
    order = None if entry["order"] is None else tuple((bool(s), str(n)) for s, n in entry["order"])
    return measured, order


def build_meta(component: ComponentConfig, dtype: torch.dtype, max_blocks: int | None = None,
               device: torch.device | str = "meta") -> torch.nn.Module:
    """The component's class on `meta` (blocks capped at `max_blocks`), dtypes as from_pretrained gives them.

    Another `device` builds it there with the class's own random initialisation: the GPU bench and
    suite make real-size models that way (no files, no hub), at the dtypes a loaded model has.
    """
    cls = component_class(component.library, component.class_name)
    from_diffusers = component.library != "transformers"  # diffusers, or a diffusers pipeline's own module
    config = dict(component.config)
    count = BLOCK_COUNT.get(component.class_name)
    if max_blocks and count in config:
        config[count] = min(int(config[count]), max_blocks)
        if isinstance(config.get("layer_types"), list):  # transformers 5 (Qwen) wants one entry per layer
            config["layer_types"] = config["layer_types"][: config[count]]
    # Never inference tensors, whoever builds first (a Sampler node runs under ComfyUI's inference
    # mode): the cached module is also traced for training, whose backward cannot use them.
    with torch.device(device), torch.inference_mode(False):
        if from_diffusers:
            module = cls.from_config({k: v for k, v in config.items() if not k.startswith("_")})
        else:
            module = cls(cls.config_class(**config))
        # Cast inside too: setting a normal parameter's data to an inference tensor is refused.
        _cast(module, dtype, _fp32_modules(cls, component.library, dtype), keep_unsaved=from_diffusers)
    return module.eval()


def component_class(library: str, class_name: str) -> type | None:
    """The class model_index.json names. diffusers records a pipeline's own modules (LTX-2's
    connectors and vocoder) under the pipeline's package name ("ltx2"), found in diffusers.pipelines; a module
    of diffusers or transformers ("diffusers.models") is read as it is spelled, as diffusers reads it."""
    module = library if library.partition(".")[0] in ("diffusers", "transformers") else f"diffusers.pipelines.{library}"
    try:
        return getattr(importlib.import_module(module), class_name, None)
    except ImportError:
        return None


def _fp32_modules(cls, library: str, dtype: torch.dtype) -> set[str]:
    """diffusers keeps `_keep_in_fp32_modules` in float32 for any dtype; transformers only for
    float16 (and `_keep_in_fp32_modules_strict` for float16 and bfloat16)."""
    if dtype == torch.float32:
        return set()
    keep = set(getattr(cls, "_keep_in_fp32_modules", None) or ())
    if library == "transformers":
        strict = set(getattr(cls, "_keep_in_fp32_modules_strict", None) or ())
        keep = (keep if dtype == torch.float16 else set()) | strict
    return keep


def _cast(module: torch.nn.Module, dtype: torch.dtype, fp32: set[str], keep_unsaved: bool = False) -> None:
    """With `keep_unsaved`, buffers not in the state dict keep the dtype they were made in, as diffusers'
    from_pretrained leaves them (CogVideoX's float64 sinusoidal `pos_embedding`)."""
    unsaved = {f"{prefix}{'.' if prefix else ''}{name}" for prefix, sub in module.named_modules()
               for name in sub._non_persistent_buffers_set} if keep_unsaved else set()
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if tensor.is_floating_point() and name not in unsaved:
            target = torch.float32 if fp32 & set(name.split(".")) else dtype
            tensor.data = tensor.data.to(target)


def _get(module: torch.nn.Module, path: str):
    for part in path.split("."):
        module = getattr(module, part, None)
    return module
