"""A diffusers folder's text encoder replaced by a single file (Load Video Pipeline's `text_encoder_file`,
and `text_encoder_2_file` for HunyuanVideo 1.5's ByT5 glyph encoder).

The files users keep in ComfyUI's models/text_encoders, read by their tensors (files.read_weight_file):
Comfy-Org's umt5_xxl_* (Wan) and t5xxl_* (CogVideoX: the same T5 names, so it comes free), the ByT5
glyph encoder (byt5_small_glyphxl_fp16), and the language models in ComfyUI's names (text_encoders.py:
qwen_2.5_vl_7b* for HunyuanVideo 1.5, gemma_3_12B_it* for LTX-2). Stored bf16 / fp16, fp8, fp8 scaled
(either of Comfy-Org's layouts) or GGUF, as the storage engine reads them; formats it cannot read
(nvfp4, int8 blockwise) are refused by name there.

The file must be the folder's text encoder class and fit its config.json field by field, or it is
refused naming the file, what differs and the file to pick, before anything is built (the folder then
needs only config.json in that component's folder: its tokenizer stays the folder's). The encoder is
built empty from the folder's config and given the file's tensors in place, held as the folder's
would be (`weight_dtype` lowers `text_encoder`, never `text_encoder_2`, as in `weight_storage.LOWERED`).
"""

from __future__ import annotations

import json
import logging
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch

from ...memory.storage import StoredTensor, dequantize_into
from ..family import ModelError
from . import detect, text_encoders
from .files import WeightFile, read_weight_file

# component -> Load Video Pipeline's input: the one table the loader, the node and the plan read.
ROLES = {"text_encoder": "text_encoder_file", "text_encoder_2": "text_encoder_2_file"}
FOLDER_CHOICE = "(from the folder)"  # every file input's "use the folder's own" choice (nodes/loader.py reads it)
# (component, the folder's class) -> the files that fit it; a pair not listed takes no file.
PICK = {
    ("text_encoder", "UMT5EncoderModel"): "umt5_xxl_fp8_e4m3fn_scaled.safetensors or umt5_xxl_fp16.safetensors",
    ("text_encoder", "T5EncoderModel"): "t5xxl_fp16.safetensors or t5xxl_fp8_e4m3fn_scaled.safetensors",
    ("text_encoder", "Qwen2_5_VLTextModel"): "qwen_2.5_vl_7b_fp8_scaled.safetensors or qwen_2.5_vl_7b.safetensors",
    ("text_encoder", "Gemma3ForConditionalGeneration"): "gemma_3_12B_it.safetensors or one of its fp8-scaled variants",
    ("text_encoder_2", "T5EncoderModel"): "byt5_small_glyphxl_fp16.safetensors",
}
LISTED = 5  # missing tensors named in a message
log = logging.getLogger("vidmem")


def replaced_components(index: Mapping[str, Any], folder: str | Path, chosen: Mapping[str, Any]) -> dict[str, Any]:
    """component -> the file replacing it, from the loader's inputs `chosen` (input -> path, empty or None for the
    folder's own), each checked to be replaceable (`check_replaceable`) before any file is read."""
    files = {component: chosen[role] for component, role in ROLES.items() if chosen.get(role)}
    for component in files:
        check_replaceable(index, component, folder)
    return files


def check_replaceable(index: Mapping[str, Any], component: str, folder: str | Path) -> str:
    """The class of the folder's `component` when a file may replace it (before any file is read)."""
    role, folder = ROLES[component], Path(folder)
    entry = index.get(component)
    class_name = entry[1] if isinstance(entry, list) and len(entry) == 2 else None
    if class_name is None and component == "text_encoder_2":
        raise ModelError(f"{role}: '{folder.name}' has no second text encoder (only HunyuanVideo 1.5 has one, its ByT5 "
                         f"glyph encoder); leave {role} at {FOLDER_CHOICE}.")
    if (component, class_name) not in PICK:
        raise ModelError(f"{role}: '{folder.name}' has no {component} vidmem reads a single file for (it lists "
                         f"{class_name}); leave {role} at {FOLDER_CHOICE}.")
    return class_name


def read_text_encoder_file(path: str | Path, component: str, class_name: str, config: Mapping[str, Any] | None,
                           folder: str | Path) -> WeightFile:
    """The file at `path`, checked to be the folder's `component` (`class_name` configured by `config`)."""
    role, path, folder = ROLES[component], Path(path), Path(folder)
    fix = f"pick {PICK[(component, class_name)]} from models/text_encoders, or leave {role} at {FOLDER_CHOICE}"
    if config is None:
        raise ModelError(f"{role}: '{folder.name}' has no {component}/config.json, which configures the file; "
                         "re-download the folder's configs.")
    file = read_weight_file(path, role, detect.TEXT_ENCODER, takes=f"a text encoder ({text_encoders.HELD[class_name]})")
    found = file.fields["class"]
    if found != class_name:
        held = text_encoders.HELD
        raise ModelError(f"{role}: '{path.name}' is {held[found]}, but the {component} of '{folder.name}' is "
                         f"{held[class_name]}: {fix}.")
    wanted = _config_fields(class_name, config)
    problems = detect.differences(_rows_padded(file, wanted), wanted)
    if problems:
        raise ModelError(f"{role}: '{path.name}' is not the {component} of '{folder.name}' ({'; '.join(problems)}); {fix}.")
    needed = _needed_names(class_name, _config_key(config))
    missing = [names[0] for names in needed if not any(name in file.tensors for name in names)]
    if missing:
        listed = ", ".join(missing[:LISTED]) + (f" and {len(missing) - LISTED} more" if len(missing) > LISTED else "")
        raise ModelError(f"{role}: '{path.name}' lacks {len(missing)} of the tensors the {component} of '{folder.name}' "
                         f"needs ({listed}); the file is incomplete or of another variant: {fix}.")
    return file


def _cut_token_rows(file: WeightFile, vocab_size: int) -> int:
    """How many token rows a llama.cpp Gemma 3 GGUF lacks against the config's `vocab_size` (0 for any other file).

    Why: llama.cpp's gemma3 converter cuts token_embd to the tokenizer's length (262144 rows where the config says
    262208; some files keep all 262208). The ids past the tokenizer are the image soft token and unused ids, which
    LTX-2 (text only, input_ids from the tokenizer) never looks up, so zero rows there change nothing it computes.
    A table with more rows than the config is never a cut: the check refuses it."""
    if file.llama_cpp != "gemma3":
        return 0
    rows = file.fields.get("vocab_size")
    return vocab_size - rows if isinstance(rows, int) and rows < vocab_size else 0


def _rows_padded(file: WeightFile, wanted: Mapping[str, Any]) -> Mapping[str, Any]:
    """`file.fields` with a cut Gemma 3 token table (`_cut_token_rows`) counted at the rows it is padded to at load."""
    if not _cut_token_rows(file, wanted.get("vocab_size", 0)):
        return file.fields
    return {**file.fields, "vocab_size": wanted["vocab_size"]}


def _cut_table(file: WeightFile, class_name: str, config: Mapping[str, Any]) -> tuple[str, int, int] | None:
    """(the token table's name, the rows it is padded to at load, the rows it lacks) for a cut Gemma 3 table
    (`_cut_token_rows`); None for any other file. The one rule the load (`_token_table_padded`) and the RAM check
    (`held_on_meta`) read."""
    if file.llama_cpp != "gemma3":
        return None
    vocab_size = detect.text_config(class_name, config).vocab_size
    missing = _cut_token_rows(file, vocab_size)
    return (text_encoders.GEMMA3.language + "embed_tokens.weight", vocab_size, missing) if missing else None


def _token_table_padded(file: WeightFile, class_name: str, config: Mapping[str, Any],
                        dtype: torch.dtype) -> Mapping[str, Any]:
    """`file.tensors` with a cut Gemma 3 token table (`_cut_table`) padded with zero rows. The table is
    dequantized at load anyway (tied to lm_head, never kept stored: weight_storage), so padding costs no
    more memory than loading it: its rows are dequantized in chunks straight into the padded table
    (`dequantize_into`), with no whole-table temporary (about 2 GB at Gemma 3 12B's size in bf16). The padded
    table is new RAM at every weight_dtype: `held_on_meta` counts it."""
    cut = _cut_table(file, class_name, config)
    if cut is None:
        return file.tensors
    name, vocab_size, missing = cut
    table = file.tensors[name]
    padded = torch.empty(vocab_size, table.shape[1], dtype=dtype)
    if isinstance(table, StoredTensor):
        dequantize_into(table, padded[:-missing])
    else:
        padded[:-missing].copy_(table)
    padded[-missing:].zero_()
    log.info("vidmem: '%s' has %d token rows for a vocabulary of %d (llama.cpp cuts Gemma's table to its "
             "tokenizer): the %d ids past it get zero rows.", file.name, vocab_size - missing, vocab_size, missing)
    return {**file.tensors, name: padded}


def _needed_names(class_name: str, config_json: str) -> tuple[tuple[str, ...], ...]:
    """The weights a file must hold for `class_name` configured by `config_json`, one tuple of names per
    tensor (tied names share one: a file holding either is whole), the parts `fit_optional` may remove left
    out: so an incomplete file is refused before any component is built rather than in assign_weights,
    after the transformer file."""
    optional = _optional_prefixes(class_name)
    return tuple(names for names in _parameter_names(class_name, config_json) if not names[0].startswith(optional))


def removed_parts(file: WeightFile, class_name: str, config: Mapping[str, Any]) -> tuple[str, ...]:
    """The submodules `fit_optional` removes when `file` (checked by read_text_encoder_file) is loaded: Gemma 3's
    vision tower and projector when the file lacks any of their weights. Read from its names; nothing is built
    but on meta, so the plan can leave them out before a load."""
    if not _optional_prefixes(class_name):
        return ()
    names = _parameter_names(class_name, _config_key(config))
    return text_encoders.LAYOUTS[class_name].optional if _lacks_optional(class_name, names, file.tensors) else ()


def _lacks_optional(class_name: str, names: Iterable[tuple[str, ...]], tensors: Mapping[str, Any]) -> bool:
    """Whether `tensors` lack any weight of `class_name`'s optional parts (`names`: the model's parameters, one
    tuple of tied names per tensor): the one rule `removed_parts` (the plan) and `fit_optional` (the load) decide by."""
    optional = _optional_prefixes(class_name)
    wanted = [group for group in names if group[0].startswith(optional)] if optional else []
    return not all(any(name in tensors for name in group) for group in wanted)


def _config_key(config: Mapping[str, Any]) -> str:
    """`config` as the hashable key the meta builds below are cached by."""
    return json.dumps(dict(config), sort_keys=True)


def _optional_prefixes(class_name: str) -> tuple[str, ...]:
    layout = text_encoders.LAYOUTS.get(class_name)
    return tuple(part + "." for part in layout.optional) if layout else ()


@lru_cache(maxsize=8)
def _parameter_names(class_name: str, config_json: str) -> tuple[tuple[str, ...], ...]:
    """Every parameter of `class_name` configured by `config_json`, one tuple of names per tensor (tied names
    together)."""
    return _tensor_names(_meta_model(class_name, config_json))


@lru_cache(maxsize=4)
def _meta_model(class_name: str, config_json: str) -> torch.nn.Module:
    """`class_name` configured by `config_json`, built on meta: no memory, and not the build
    `load_text_encoder_file` makes (only its structure is read)."""
    import transformers

    cls = getattr(transformers, class_name)
    with torch.device("meta"):
        module = cls(cls.config_class(**json.loads(config_json)))
    module.tie_weights()  # as build.build_empty does: tied weights become one parameter
    return module


def held_weight_dtype(component: str, weight_dtype: str) -> str:
    """The weight_dtype `component`'s file is held at: `weight_dtype` for the components it lowers
    (weight_storage.LOWERED: `text_encoder`), else DEFAULT_WEIGHTS (ByT5's `text_encoder_2` keeps its file's)."""
    from ..weight_storage import DEFAULT_WEIGHTS, LOWERED

    return weight_dtype if component in LOWERED else DEFAULT_WEIGHTS


def held_on_meta(file: WeightFile, class_name: str, config: Mapping[str, Any],
                 dtype: torch.dtype) -> tuple[torch.nn.Module, Mapping[str, Any], torch.Tensor | None]:
    """What `load_text_encoder_file` fills its encoder with, with nothing allocated: (the encoder built on meta, the
    tensors the fill is given, the padded token table among them or None).

    Why: the loader's RAM check counts a text encoder file as it counts a transformer file, by the fill's own
    rules (`weight_check.ram_beyond_mappings`: casts, dequantized copies, what weight_dtype lowers), from the
    tensors the fill really gets: a cut Gemma 3 table as the padded table the load allocates before the fill (a
    meta tensor at `dtype`: about 2 GB at Gemma 3 12B's size in bf16, new RAM at every weight_dtype), and the
    optional parts `fit_optional` leaves out removed."""
    module = _meta_model(class_name, _config_key(config))
    tensors, padded = file.tensors, None
    cut = _cut_table(file, class_name, config)
    if cut is not None:
        name, vocab_size, _missing = cut
        padded = torch.empty(vocab_size, file.tensors[name].shape[1], dtype=dtype, device="meta")
        tensors = {**tensors, name: padded}
    kept, _left_out = _without_optional(class_name, _parameter_names(class_name, _config_key(config)), tensors)
    return module, kept, padded


def _tensor_names(module: torch.nn.Module) -> tuple[tuple[str, ...], ...]:
    """`module`'s parameters, one tuple of names per tensor (tied names together)."""
    by_tensor: dict[int, list[str]] = {}
    for name, parameter in module.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(parameter), []).append(name)
    return tuple(tuple(names) for names in by_tensor.values())


def _config_fields(class_name: str, config: Mapping[str, Any]) -> dict[str, Any]:
    if class_name in text_encoders.LAYOUTS:
        return text_encoders.config_fields(class_name, config)
    return detect.text_encoder_config_fields(class_name, config)


def load_text_encoder_file(file: WeightFile, component: str, class_name: str, config: Mapping[str, Any],
                           folder: str | Path, dtype: torch.dtype, weight_dtype: str):
    """The folder's `component` built from `config` and filled from `file` (see the module doc), computing
    in `dtype`. Returns (module, the format its matrices are held in, report, the submodule paths removed
    from it: `fit_optional`)."""
    from ..configs.meta import ComponentConfig
    from ..weight_storage import hold
    from .build import build_empty

    config_path = str(Path(folder) / component / "config.json")
    module = build_empty(ComponentConfig(component, "transformers", class_name, dict(config), config_path))
    tensors, removed = fit_optional(module, _token_table_padded(file, class_name, config, dtype), file.name)
    report, held = hold(module, tensors, dtype, held_weight_dtype(component, weight_dtype), copy_to_ram=False,
                        source=file.name)
    return module, held, report, removed


def fit_optional(module: torch.nn.Module, tensors: Mapping[str, Any],
                 file_name: str) -> tuple[Mapping[str, Any], tuple[str, ...]]:
    """(`tensors` for `module`, the submodule paths removed from it): its optional parts (Gemma 3's vision
    tower and projector) the file may lack.

    Why: LTX-2 runs Gemma's language model only (LTX2Pipeline passes input_ids, never pixel_values), but
    a part left without weights stays on the meta device, where an offload tier moving the encoder would
    fail; giving it zeros would cost real RAM (about 0.8 GB in bf16 for Gemma 3 12B's SigLIP tower) for
    nothing. So a file that carries the whole vision part has it mapped, as the folder's encoder has it;
    otherwise the part is removed from the module (its submodules set to None, which transformers' forward
    never reaches without images) and any of its tensors the file has are left unread. The removed paths
    go on the LoadedPipeline, so the planner leaves those weights out too."""
    kept, removed = _without_optional(type(module).__name__, _tensor_names(module), tensors)
    for path in removed:
        parent, _, leaf = path.rpartition(".")
        setattr(module.get_submodule(parent), leaf, None)
    if removed:
        log.info("vidmem: '%s' lacks %s's vision part (%s): the text encoder runs without it.", file_name,
                 type(module).__name__, ", ".join(removed))
    return kept, removed


def _without_optional(class_name: str, names: Iterable[tuple[str, ...]],
                      tensors: Mapping[str, Any]) -> tuple[Mapping[str, Any], tuple[str, ...]]:
    """(`tensors` without `class_name`'s optional parts, the parts left out) when `tensors` lack any of their
    weights (`names`: the model's parameters, one tuple of tied names per tensor); else (`tensors`, ()).
    The load (`fit_optional`) and the RAM check (`held_on_meta`) leave out the same tensors."""
    layout = text_encoders.LAYOUTS.get(class_name)
    if layout is None or not _lacks_optional(class_name, names, tensors):
        return tensors, ()
    optional = _optional_prefixes(class_name)
    return {name: t for name, t in tensors.items() if not name.startswith(optional)}, layout.optional
