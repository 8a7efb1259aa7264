"""A stand-in for ComfyUI 0.8.0's memory manager, so CI can check how vidmem lives inside it.

`FakeComfy.install(monkeypatch)` puts `comfy`, `comfy.model_management` and `comfy.model_patcher` into
`sys.modules`; `import comfy.model_patcher` in product code then finds this fake. It behaves like
ComfyUI 0.8.0 (pollockjj/ComfyUI @ 618b803d, read and rewritten from its behaviour, no code copied)
where vidmem's warm runs depend on it: `LoadedModel`, `current_loaded_models`, `free_memory`,
`load_models_gpu`, `unload_all_models`, the free-memory figure, the pinned budget, and a base
`ModelPatcher`. Citations: `MM:` comfy/model_management.py, `MP:` comfy/model_patcher.py, `main.py:`,
`execution.py:`, `server.py:`, as in docs/design/warm-runs.md section 2.

How the fake GPU works: one device, `cuda:0`, of `total_bytes`. Nothing is allocated: device bytes are
a ledger, the sum of every live patcher's `loaded_size()` (listed or not, as the GPU does not know the
list; a clone counts once, since it shares its module) plus `fake.other_used` (memory held outside the
manager, set by tests). `fake.cached` is torch's cached-but-unused memory: it counts as free, as in
0.8.0's `get_free_memory`, and `soft_empty_cache()` returns it to the driver. Native models are
patchers over stub modules whose meta buffers report their size; they load and unload whole blocks, as
0.8.0 moves whole modules.

`fake.log` records, in order:
    ("load_models_gpu", [names])          names: the class names of the patchers' modules
    ("free_memory", memory_required)
    ("partially_load", name, extra)       LoadedModel asks for more weight memory (grant, 1e32 or 0.1)
    ("partially_unload", name, n)         LoadedModel.model_unload asks for n bytes
    ("detach", name, unpatch_all)         model_unload (unpatch_all=True) or the clone pop (False)
    ("__del__", name)                     a base ModelPatcher is collected (it then detaches, False)
    ("unload_all_models",) ("soft_empty_cache",) ("gc_collect",)
    ("reset_caches",) ("restore_functions",)   the prompt worker's cache reset and hook-breaker restore
"""

from __future__ import annotations

import enum
import gc
import logging
import sys
import types
import uuid
import weakref

import torch

MiB = 1 << 20
GiB = 1 << 30
CPU = torch.device("cpu")
log = logging.getLogger("comfy")

_active: FakeComfy | None = None  # the installed fake: patchers built now keep their ledger there


class VRAMState(enum.Enum):
    """MM:31-37: the member names and values of 0.8.0."""

    DISABLED = 0
    NO_VRAM = 1
    LOW_VRAM = 2
    NORMAL_VRAM = 3
    HIGH_VRAM = 4
    SHARED = 5


def module_size(module: torch.nn.Module) -> int:
    """MM:454: bytes of every tensor in the state dict (meta tensors count, so stubs cost nothing)."""
    return sum(t.nbytes for t in module.state_dict().values())


def name_of(patcher) -> str:
    """How 0.8.0 names a model in its log lines: its module's class name (MM:605, MM:655)."""
    return "<dead>" if patcher is None else type(patcher.model).__name__


def _on_gpu(device) -> bool:
    # One physical GPU: `cuda` and `cuda:0` hold the same memory, although 0.8.0 compares them as
    # different devices (torch.device("cuda") != torch.device("cuda", 0)).
    return getattr(device, "type", None) == "cuda"


# ---------------------------------------------------------------------------------------------
# comfy.model_patcher
# ---------------------------------------------------------------------------------------------


class _Block(torch.nn.Module):
    def __init__(self, nbytes: int) -> None:
        super().__init__()
        self.register_buffer("weight", torch.empty(nbytes, dtype=torch.uint8, device="meta"))


class StubModule(torch.nn.Module):
    """A model's module reporting `nbytes` in `blocks` leaf modules of meta buffers (no memory used)."""

    def __init__(self, nbytes: int, blocks: int = 8) -> None:
        super().__init__()
        sizes = [nbytes // blocks] * blocks if nbytes else []
        if sizes:
            sizes[-1] += nbytes - sum(sizes)
        self.blocks = torch.nn.ModuleList(_Block(n) for n in sizes)


def stub_module(nbytes: int, name: str, blocks: int = 8) -> StubModule:
    """A StubModule whose class is called `name`, as ComfyUI names models by their module's class."""
    return type(name, (StubModule,), {})(nbytes, blocks)


class ModelPatcher:
    """0.8.0's ModelPatcher (MP:215) reduced to what LoadedModel and load_models_gpu touch.

    The weights of a plain module are a ledger: `model.model_loaded_weight_memory` bytes of its leaf
    modules are "on the device" (flag `comfy_patched_weights`, as 0.8.0 marks them). A subclass may
    override model_size, loaded_size, partially_load, partially_unload, detach, current_loaded_device;
    the fake GPU then counts what its `loaded_size()` says. One class serves every install, so a product
    subclass defined once keeps working; each patcher keeps the ledger of the fake installed when it was
    built.
    """

    def __init__(self, model, load_device, offload_device, size=0, weight_inplace_update=False):
        if _active is None:
            raise RuntimeError("comfy_fake: call FakeComfy.install(monkeypatch) before building a ModelPatcher")
        self._fake = _active
        self.size = size
        self.model = model
        if getattr(model, "device", None) is None:  # MP:218-222: a module without one starts offloaded
            model.device = offload_device
        self.load_device, self.offload_device = load_device, offload_device
        self.weight_inplace_update = weight_inplace_update
        self.parent = None
        self.patches, self.backup, self.object_patches = {}, {}, {}
        self.model_options = {"transformer_options": {}}
        self.patches_uuid = uuid.uuid4()
        self.pinned = set()
        for attr, default in (("model_loaded_weight_memory", 0), ("lowvram_patch_counter", 0),
                              ("model_lowvram", False), ("current_weight_patches_uuid", None),
                              ("model_offload_buffer_memory", 0)):
            if not hasattr(model, attr):  # MP:257-270: bookkeeping lives on the module, shared by clones
                setattr(model, attr, default)
        self._fake._track(self)

    def model_size(self) -> int:
        # MP:272: `size` when given, else measured once from the state dict and remembered.
        if self.size > 0:
            return self.size
        self.size = module_size(self.model)
        return self.size

    def get_ram_usage(self) -> int:
        return self.model_size()  # MP:278; --cache-ram reads it

    def loaded_size(self) -> int:
        return self.model.model_loaded_weight_memory  # MP:281

    def lowvram_patch_counter(self) -> int:
        return self.model.lowvram_patch_counter

    def clone(self) -> ModelPatcher:
        # MP:287: same module, parent set; load_models_gpu treats it as a clone (is_clone).
        n = self.__class__(self.model, self.load_device, self.offload_device, self.model_size(),
                           weight_inplace_update=self.weight_inplace_update)
        n.parent, n.patches_uuid = self, self.patches_uuid
        return n

    def is_clone(self, other) -> bool:
        return hasattr(other, "model") and self.model is other.model  # MP:346

    def model_patches_to(self, device) -> None:
        # MP:508: moves model_options patches that can move; the fake's have none unless a test adds some.
        for patches in self.model_options["transformer_options"].get("patches", {}).values():
            patches[:] = [p.to(device) if hasattr(p, "to") else p for p in patches]

    def model_patches_models(self) -> list:
        # MP:529: patcher objects that patches bring along; load_models_gpu loads them too.
        found = []
        for patches in self.model_options["transformer_options"].get("patches", {}).values():
            found += [m for p in patches if hasattr(p, "models") for m in p.models()]
        return found

    def model_dtype(self):
        return self.model.get_dtype() if hasattr(self.model, "get_dtype") else None  # MP:553

    def _blocks(self) -> list[tuple[int, torch.nn.Module]]:
        # MP:657 _load_list: the leaf modules that own tensors, the grain 0.8.0 loads and unloads.
        return [(module_size(m), m) for m in self.model.modules()
                if next(iter(m.parameters(recurse=False)), None) is not None
                or next(iter(m.buffers(recurse=False)), None) is not None]

    def partially_load(self, device_to, extra_memory=0, force_patch_weights=False) -> int:
        """MP:957: load up to `extra_memory` more bytes; a negative grant unloads that much instead.

        A fully loaded model answers 0. 0.8.0 also re-patches weights when its patches changed; the fake
        has no weight patches.
        """
        if extra_memory < 0:
            self.partially_unload(self.offload_device, -extra_memory, force_patch_weights=force_patch_weights)
            return 0
        before = self.model.model_loaded_weight_memory
        if not self.model.model_lowvram and before > 0:
            return 0
        self._load(device_to, before + extra_memory, full_load=before + extra_memory > self.model_size())
        return self.model.model_loaded_weight_memory - before

    def _load(self, device_to, budget: float, full_load: bool) -> None:
        # MP:687 load(): largest modules first while they fit strictly under the budget; everything on a
        # full load. (0.8.0 also keeps an offload buffer for streamed modules; the fake leaves it out.)
        loaded = self.model.model_loaded_weight_memory
        for size, block in sorted(self._blocks(), key=lambda b: -b[0]):
            if not getattr(block, "comfy_patched_weights", False) and (full_load or loaded + size < budget):
                block.comfy_patched_weights = True
                loaded += size
        self.model.model_lowvram = any(not getattr(b, "comfy_patched_weights", False) for _, b in self._blocks())
        self.model.device = device_to
        self.model.model_loaded_weight_memory = loaded

    def partially_unload(self, device_to, memory_to_free=0, force_patch_weights=False) -> int:
        # MP:872: smallest loaded modules first until more than `memory_to_free` is freed (strictly:
        # asked for 0, it still frees one). The module stays on the load device, in lowvram mode.
        freed = 0
        for size, block in sorted(self._blocks(), key=lambda b: b[0]):
            if memory_to_free < freed:
                break
            if getattr(block, "comfy_patched_weights", False):
                block.comfy_patched_weights = False
                freed += size
        self.model.model_lowvram = True
        self.model.model_loaded_weight_memory -= freed
        self._fake.cached += freed  # freed tensors stay in torch's cache until soft_empty_cache
        return freed

    def detach(self, unpatch_all=True):
        # MP:985: unpatch_all=True unloads everything to the offload device; False keeps the weights.
        self.model_patches_to(self.offload_device)
        if unpatch_all:
            for _, block in self._blocks():
                block.comfy_patched_weights = False
            self._fake.cached += self.model.model_loaded_weight_memory
            self.model.model_loaded_weight_memory = 0
            self.model.model_lowvram = False
            self.model.device = self.offload_device
        return self.model

    def current_loaded_device(self):
        return self.model.device  # MP:994

    def unpin_all_weights(self) -> None:
        pass  # the fake pins no weights of its own

    def __del__(self):
        # MP:1356: unpin, then detach(unpatch_all=False): collecting a patcher never unloads its module.
        fake = getattr(self, "_fake", None)
        if fake is not None:
            fake.log.append(("__del__", name_of(self)))
        self.unpin_all_weights()
        self.detach(unpatch_all=False)


# ---------------------------------------------------------------------------------------------
# comfy.model_management
# ---------------------------------------------------------------------------------------------


class LoadedModel:
    """MM:462. One entry of current_loaded_models; `mm` is the module it belongs to (set per install)."""

    mm: FakeModelManagement

    def __init__(self, model):
        self._set_model(model)
        self.device = model.load_device
        self.real_model = None
        self.currently_used = True
        self.model_finalizer = None
        self._patcher_finalizer = None  # as in 0.8.0, after _set_model: the parent switch stays registered

    def _set_model(self, model):
        # MM:471: the patcher is held weakly; a clone's entry moves to its parent when the clone dies.
        self._model = weakref.ref(model)
        if model.parent is not None:
            self._parent_model = weakref.ref(model.parent)
            self._patcher_finalizer = weakref.finalize(model, self._switch_parent)

    def _switch_parent(self):
        parent = self._parent_model()
        if parent is not None:
            self._set_model(parent)

    @property
    def model(self):
        return self._model()

    def model_memory(self):
        return self.model.model_size()

    def model_loaded_memory(self):
        return self.model.loaded_size()

    def model_offloaded_memory(self):
        return self.model.model_size() - self.model.loaded_size()

    def model_memory_required(self, device):
        # MM:495: only the offloaded part when the patcher says it is already on `device`.
        if device == self.model.current_loaded_device():
            return self.model_offloaded_memory()
        return self.model_memory()

    def model_load(self, lowvram_model_memory=0, force_patch_weights=False):
        # MM:501: patches to the device and dtype, then the weight grant (0 means "all": 1e32); the
        # finalizer on the module drops the entry when the module dies.
        self.model.model_patches_to(self.device)
        self.model.model_patches_to(self.model.model_dtype())
        self.model_use_more_vram(lowvram_model_memory or 1e32, force_patch_weights=force_patch_weights)
        real_model = self.model.model
        self.real_model = weakref.ref(real_model)
        self.model_finalizer = weakref.finalize(real_model, self.mm.cleanup_models)
        return real_model

    def model_use_more_vram(self, extra_memory, force_patch_weights=False):
        self.mm._fake.log.append(("partially_load", name_of(self.model), extra_memory))
        return self.model.partially_load(self.device, extra_memory, force_patch_weights=force_patch_weights)

    def should_reload_model(self, force_patch_weights=False):
        return bool(force_patch_weights and self.model.lowvram_patch_counter() > 0)

    def model_unload(self, memory_to_free=None, unpatch_weights=True):
        # MM:526: a partial unload when it can cover the request (the entry stays: False); otherwise a
        # full detach (True: the caller pops the entry). Bookkeeping is cleared only after detach returns.
        if memory_to_free is not None and memory_to_free < self.model.loaded_size():
            self.mm._fake.log.append(("partially_unload", name_of(self.model), memory_to_free))
            freed = self.model.partially_unload(self.model.offload_device, memory_to_free)
            if freed >= memory_to_free:
                return False
        self.mm._fake.log.append(("detach", name_of(self.model), unpatch_weights))
        self.model.detach(unpatch_weights)
        self.model_finalizer.detach()
        self.model_finalizer = None
        self.real_model = None
        return True

    def __eq__(self, other):
        return self.model is other.model  # MM:541: same patcher object

    def __del__(self):
        if self._patcher_finalizer is not None:
            self._patcher_finalizer.detach()

    def is_dead(self):
        # MM:548: the module lives on while its patcher is gone (a reference cycle or a leak).
        return self.real_model() is not None and self.model is None


class FakeModelManagement(types.ModuleType):
    """The `comfy.model_management` module. Its functions read the module's attributes at call time,
    as 0.8.0 reads its globals, so a test may set `vram_state`, `DISABLE_SMART_MEMORY`, ... on it."""

    VRAMState = VRAMState
    OOM_EXCEPTION = torch.cuda.OutOfMemoryError
    PINNING_ALLOWED_TYPES = {"Parameter", "QuantizedTensor"}  # MM:1127

    class InterruptProcessingException(Exception):
        pass

    def __init__(self, fake: FakeComfy, vram_state: VRAMState, smart_memory: bool, max_pinned: float) -> None:
        super().__init__("comfy.model_management")
        self._fake = fake
        self.current_loaded_models = []  # MM:452
        self.LoadedModel = type("LoadedModel", (LoadedModel,), {"mm": self})
        self.vram_state = vram_state
        self.DISABLE_SMART_MEMORY = not smart_memory  # MM:420, --disable-smart-memory
        self.lowvram_available = True
        self.MIN_WEIGHT_MEMORY_RATIO = 0.0  # MM:313-315: 0.0 on NVIDIA (0.4 on other GPUs)
        self.EXTRA_RESERVED_VRAM = 400 * MiB  # MM:568: Linux without --reserve-vram
        self.MAX_PINNED_MEMORY = max_pinned  # MM:1118-1125: 95% of RAM on Linux; -1 when disabled
        self.TOTAL_PINNED_MEMORY = 0
        self.PINNED_MEMORY = {}
        self.interrupt_processing = False

    # -- devices and figures ------------------------------------------------------------------

    def get_torch_device(self):
        # MM:171-189: torch.device(torch.cuda.current_device()), which is cuda:0, never bare `cuda`.
        return torch.device("cuda", 0)

    def is_device_type(self, device, type):
        return getattr(device, "type", None) == type

    def is_device_cpu(self, device):
        return self.is_device_type(device, "cpu")

    def is_device_cuda(self, device):
        return self.is_device_type(device, "cuda")

    def get_free_memory(self, dev=None, torch_free_too=False):
        # MM:1278: driver free + torch's cached-but-unused (reserved - active), i.e. total minus what
        # tensors hold; the CPU answers the RAM available.
        dev = self.get_torch_device() if dev is None else dev
        if dev.type in ("cpu", "mps"):
            free = cached = self._fake.ram_free
        else:
            free, cached = self._fake.total_bytes - self._fake.device_bytes() - self._fake.other_used, self._fake.cached
        return (free, cached) if torch_free_too else free

    def extra_reserved_memory(self):
        return self.EXTRA_RESERVED_VRAM  # MM:578

    def minimum_inference_memory(self):
        return GiB * 0.8 + self.extra_reserved_memory()  # MM:581

    def soft_empty_cache(self, force=False):
        # MM:1538: torch.cuda.empty_cache + ipc_collect: the cache goes back to the driver.
        self._fake.empty_cache_calls += 1
        self._fake.cached = 0
        self._fake.log.append(("soft_empty_cache",))

    # -- the list of loaded models ------------------------------------------------------------

    def loaded_models(self, only_currently_used=False):
        # MM:711; controlnet.py re-loads these, so partially_load can arrive between vidmem's calls.
        return [m.model for m in self.current_loaded_models if m.currently_used or not only_currently_used]

    def cleanup_models_gc(self):
        # MM:722: a dead entry (module alive, patcher gone) costs a full gc.collect on every load.
        dead = next((m for m in self.current_loaded_models if m.is_dead()), None)
        if dead is None:
            return
        log.info("Potential memory leak detected with model %s, doing a full garbage collect",
                 type(dead.real_model()).__name__)
        self._fake.log.append(("gc_collect",))
        gc.collect()
        self.soft_empty_cache()
        for m in self.current_loaded_models:
            if m.is_dead():
                log.warning("WARNING, memory leak with model %s.", type(m.real_model()).__name__)

    def cleanup_models(self):
        # MM:742, the modules' finalizer: drop entries whose module died.
        for i in reversed(range(len(self.current_loaded_models))):
            if self.current_loaded_models[i].real_model() is None:
                self.current_loaded_models.pop(i)

    def free_memory(self, memory_required, device, keep_loaded=[]):
        """MM:584. Candidates: entries on `device` (compared exactly) not in keep_loaded and not dead;
        partially loaded first, then fewer references, smaller, older. With smart memory it stops once
        more than `memory_required` is free and asks each model only for the shortfall; without, it
        unloads every candidate fully. Pops happen after the loop, so a raise leaves the list as it was
        (entries already detached stay, their real_model cleared)."""
        self._fake.log.append(("free_memory", memory_required))
        self.cleanup_models_gc()
        candidates = []
        for i in reversed(range(len(self.current_loaded_models))):
            entry = self.current_loaded_models[i]
            if entry.device == device and entry not in keep_loaded and not entry.is_dead():
                candidates.append((-entry.model_offloaded_memory(), sys.getrefcount(entry.model),
                                   entry.model_memory(), i))
                entry.currently_used = False
        unloaded = []
        for *_, i in sorted(candidates):
            shortfall = None
            if not self.DISABLE_SMART_MEMORY:
                free = self.get_free_memory(device)
                if free > memory_required:
                    break
                shortfall = memory_required - free
            if self.current_loaded_models[i].model_unload(shortfall):
                unloaded.append(i)
        popped = [self.current_loaded_models.pop(i) for i in sorted(unloaded, reverse=True)]
        self._empty_cache_after_free(device, bool(popped))
        return popped

    def _empty_cache_after_free(self, device, unloaded_any: bool):
        # MM:612-618: always after a full unload; otherwise only when torch's unused cache is over a
        # quarter of the free memory and the state is not HIGH_VRAM.
        if unloaded_any:
            self.soft_empty_cache()
        elif self.vram_state != VRAMState.HIGH_VRAM:
            free, cached = self.get_free_memory(device, torch_free_too=True)
            if cached > free * 0.25:
                self.soft_empty_cache()

    def load_models_gpu(self, models, memory_required=0, force_patch_weights=False,
                        minimum_memory_required=None, force_full_load=False):
        """MM:621-706, in 0.8.0's order."""
        self._fake.log.append(("load_models_gpu", [name_of(m) for m in models]))
        self.cleanup_models_gc()
        extra_mem = max(self.minimum_inference_memory(), memory_required + self.extra_reserved_memory())
        if minimum_memory_required is None:
            minimum_memory_required = extra_mem
        else:
            minimum_memory_required = max(self.minimum_inference_memory(),
                                          minimum_memory_required + self.extra_reserved_memory())
        entries = [self._entry_for(m) for m in self._with_patch_models(models)]
        for entry in entries:
            self._pop_clones(entry)
        self._free_for(entries, extra_mem, minimum_memory_required)
        for entry in entries:
            entry.model_load(self._weight_grant(entry, minimum_memory_required, force_full_load),
                             force_patch_weights=force_patch_weights)
            self.current_loaded_models.insert(0, entry)  # MM:705: the only place entries are added

    def load_model_gpu(self, model):
        return self.load_models_gpu([model])

    def _with_patch_models(self, models):
        # MM:634-640: a set of the models and the models their patches bring (so the order is by hash).
        found = set()
        for m in models:
            found.add(m)
            found.update(m.model_patches_models())
        return found

    def _entry_for(self, patcher):
        # MM:644-656: an already listed patcher reuses its entry (marked currently used).
        entry = self.LoadedModel(patcher)
        if entry in self.current_loaded_models:
            listed = self.current_loaded_models[self.current_loaded_models.index(entry)]
            listed.currently_used = True
            return listed
        log.info("Requested to load %s", name_of(patcher))
        return entry

    def _pop_clones(self, entry):
        # MM:658-666: every entry whose patcher shares the module (the entry itself included) leaves the
        # list before anything is freed, detached with unpatch_all=False (its weights stay).
        clones = [i for i, other in enumerate(self.current_loaded_models) if entry.model.is_clone(other.model)]
        for i in reversed(clones):
            gone = self.current_loaded_models.pop(i)
            self._fake.log.append(("detach", name_of(gone.model), False))
            gone.model.detach(unpatch_all=False)
            gone.model_finalizer.detach()

    def _free_for(self, entries, extra_mem, minimum_memory_required):
        # MM:668-680: 1.1 x what each device still needs + extra_mem, then up to the minimum if short.
        needed = {}
        for entry in entries:
            needed[entry.device] = needed.get(entry.device, 0) + entry.model_memory_required(entry.device)
        for device, n in needed.items():
            if device != CPU:
                self.free_memory(n * 1.1 + extra_mem, device)
        for device in needed:
            if device != CPU and self.get_free_memory(device) < minimum_memory_required:
                unloaded = self.free_memory(minimum_memory_required, device)
                log.info("%d models unloaded.", len(unloaded))

    def _weight_grant(self, entry, minimum_memory_required, force_full_load):
        # MM:682-701: what model_load may add. NORMAL/LOW_VRAM: room beyond the minimum (or a ratio of
        # it) less what is loaded, and it can be negative; 0 becomes 0.1. NO_VRAM: 0.1. HIGH_VRAM, CPU
        # or force_full_load: 0, which model_load turns into "everything" (1e32).
        device = entry.model.load_device
        state = VRAMState.DISABLED if self.is_device_cpu(device) else self.vram_state
        grant = 0
        if self.lowvram_available and state in (VRAMState.LOW_VRAM, VRAMState.NORMAL_VRAM) and not force_full_load:
            loaded = entry.model_loaded_memory()
            room = self.get_free_memory(device) + loaded
            grant = max(0, room - minimum_memory_required,
                        min(room * self.MIN_WEIGHT_MEMORY_RATIO, room - self.minimum_inference_memory())) - loaded
            if grant == 0:
                grant = 0.1
        if state == VRAMState.NO_VRAM:
            grant = 0.1
        return grant

    def unload_all_models(self):
        # MM:1552: free "everything" on get_torch_device() only: entries on another device stay.
        self._fake.log.append(("unload_all_models",))
        self.free_memory(1e30, self.get_torch_device())

    # -- pinned memory (MM:1116-1206): the budget and its bookkeeping, no real cudaHostRegister --

    def pin_memory(self, tensor):
        # MM:1139: only tensors whose type is *named* Parameter or QuantizedTensor (a plain Tensor is
        # refused), on the CPU, not yet pinned, contiguous, within MAX_PINNED_MEMORY.
        size = tensor.nbytes
        if self.MAX_PINNED_MEMORY <= 0 or type(tensor).__name__ not in self.PINNING_ALLOWED_TYPES:
            return False
        if not self.is_device_cpu(tensor.device) or tensor.data_ptr() in self.PINNED_MEMORY:
            return False  # the fake pins nothing for real, so "already pinned" is its own record
        if not tensor.is_contiguous() or self.TOTAL_PINNED_MEMORY + size > self.MAX_PINNED_MEMORY:
            return False
        if tensor.data_ptr() == 0:
            return False
        self.PINNED_MEMORY[tensor.data_ptr()] = size
        self.TOTAL_PINNED_MEMORY += size
        return True

    def unpin_memory(self, tensor):
        # MM:1177: no type check; the same pointer with the same size it was pinned with.
        if self.MAX_PINNED_MEMORY <= 0 or not self.is_device_cpu(tensor.device):
            return False
        stored = self.PINNED_MEMORY.get(tensor.data_ptr())
        if stored is None or stored != tensor.nbytes:
            log.warning("Tried to unpin tensor not pinned by ComfyUI, or of another size")
            return False
        self.TOTAL_PINNED_MEMORY -= self.PINNED_MEMORY.pop(tensor.data_ptr())
        if not self.PINNED_MEMORY:
            self.TOTAL_PINNED_MEMORY = 0
        return True

    # -- interruption (MM:1569-1587) ----------------------------------------------------------

    def interrupt_current_processing(self, value=True):
        self.interrupt_processing = value

    def processing_interrupted(self):
        return self.interrupt_processing

    def throw_exception_if_processing_interrupted(self):
        if self.interrupt_processing:
            self.interrupt_processing = False
            raise self.InterruptProcessingException()
        return False


# ---------------------------------------------------------------------------------------------
# The host around them
# ---------------------------------------------------------------------------------------------


class FakeComfy:
    """The installed fake: the two modules (`.mm`, `.mp`), the GPU ledger, the log, the prompt worker."""

    def __init__(self, total_bytes: int, vram_state: VRAMState | str, smart_memory: bool, ram_bytes: int) -> None:
        self.total_bytes = total_bytes
        self.other_used = 0  # device bytes held outside the manager (other processes, loose tensors)
        self.cached = 0  # torch's cached-but-unused bytes: free to ComfyUI, not to other processes
        self.ram_free = ram_bytes
        self.log: list[tuple] = []
        self.empty_cache_calls = 0
        self.on_reset = None  # called by the cache reset of POST /free {"free_memory": true}
        self.natives: list[ModelPatcher] = []  # strong refs, as ComfyUI's node cache holds its models
        self._patchers = weakref.WeakSet()
        self._modules = weakref.WeakSet()
        state = VRAMState[vram_state] if isinstance(vram_state, str) else vram_state
        self.mm = FakeModelManagement(self, state, smart_memory, max_pinned=ram_bytes * 0.95)
        self.mp = types.ModuleType("comfy.model_patcher")
        self.mp.ModelPatcher = ModelPatcher
        self.comfy = types.ModuleType("comfy")
        self.comfy.__path__ = []  # a package, so `import comfy.model_management` resolves its children
        self.comfy.model_management, self.comfy.model_patcher = self.mm, self.mp

    @classmethod
    def install(cls, monkeypatch, total_bytes: int = 24 * GiB, vram_state: VRAMState | str = "NORMAL_VRAM",
                smart_memory: bool = True, ram_bytes: int = 64 * GiB) -> FakeComfy:
        """Put the fake into sys.modules for one test (monkeypatch undoes it) and return it.

        Code that bound `comfy.model_management` at its own import (nodes/host.py) still holds the old
        value: point it at `fake.mm` with monkeypatch.setattr as well.
        """
        fake = cls(total_bytes, vram_state, smart_memory, ram_bytes)
        for name, module in (("comfy", fake.comfy), ("comfy.model_management", fake.mm),
                             ("comfy.model_patcher", fake.mp)):
            monkeypatch.setitem(sys.modules, name, module)
        monkeypatch.setattr(sys.modules[__name__], "_active", fake)
        return fake

    @property
    def device(self):
        return self.mm.get_torch_device()

    def _track(self, patcher: ModelPatcher) -> None:
        self._patchers.add(patcher)
        self._modules.add(patcher.model)

    def device_bytes(self) -> int:
        """Bytes on the fake GPU: live patchers' loaded_size() once per module, plus what modules whose
        patchers died still hold there (the `is_dead` case)."""
        per_module = {}
        for patcher in list(self._patchers):
            if _on_gpu(patcher.current_loaded_device()):
                key = id(patcher.model)
                per_module[key] = max(per_module.get(key, 0), patcher.loaded_size())
        for module in list(self._modules):
            if id(module) not in per_module and _on_gpu(getattr(module, "device", None)):
                per_module[id(module)] = module.model_loaded_weight_memory
        return sum(per_module.values())

    def native_model(self, nbytes: int, name: str, blocks: int = 8) -> ModelPatcher:
        """A ComfyUI-native model (an upscaler, an image model) of `nbytes` in `blocks` equal modules,
        loadable with load_models_gpu and evictable; the fake keeps it alive."""
        patcher = ModelPatcher(stub_module(nbytes, name, blocks), load_device=self.device, offload_device=CPU)
        self.natives.append(patcher)
        return patcher

    def between_prompts(self, unload_models: bool = False, free_memory: bool = False) -> None:
        """What follows a prompt until the next one: execution.py:746-747 (with --disable-smart-memory
        every prompt ends with unload_all_models), then prompt_worker with POST /free's flags
        (server.py:956-961 sets only the true ones; main.py:253-273): `unload_models`, which defaults
        to `free_memory`, unloads all; `free_memory` also resets the node output caches; either makes
        the worker gc.collect, empty the cache and restore hook-broken functions."""
        if self.mm.DISABLE_SMART_MEMORY:
            self.mm.unload_all_models()
        flags = {k: v for k, v in (("unload_models", unload_models), ("free_memory", free_memory)) if v}
        if flags.get("unload_models", flags.get("free_memory", False)):
            self.mm.unload_all_models()
        if flags.get("free_memory", False):
            self.reset_caches()
        if flags:  # last_gc_collect = 0, so the 10 s gc interval has passed
            gc.collect()
            self.mm.soft_empty_cache()
            self.log.append(("restore_functions",))

    def reset_caches(self) -> None:
        """PromptExecutor.reset (execution.py:630): the node output caches go, and with them the
        pipelines they held."""
        self.log.append(("reset_caches",))
        if self.on_reset is not None:
            self.on_reset()

    def after_oom(self) -> None:
        """execution.py:602-606: a node raised an OOM error: unload all models."""
        self.mm.unload_all_models()

    def entries(self) -> list[str]:
        """current_loaded_models by name, newest first."""
        return [name_of(m.model) for m in self.mm.current_loaded_models]

    def free_bytes(self) -> int:
        return self.mm.get_free_memory(self.device)

    def calls(self, kind: str) -> list[tuple]:
        """The log entries of one kind, e.g. calls("free_memory")."""
        return [c for c in self.log if c[0] == kind]
