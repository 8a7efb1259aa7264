"""Which module of the diffusers model a LoRA's module name means.

Trainers name modules four ways: diffusers paths (`blocks.0.attn1.to_q`, PEFT and
CogVideoX-Factory), the original checkpoint paths (Wan's `blocks.0.self_attn.q`: lightx2v, musubi,
ComfyUI; LTX-2's `adaln_single.linear`, `patchify_proj`: Lightricks' LoRAs and ltx-trainer, whose
block layers are named as in diffusers), and either of those flattened with underscores by
kohya-style tools (`blocks_0_self_attn_q`, after a `lora_unet_` prefix). Each file uses one
naming, so one naming is chosen per file (the one that resolves most of its names):
`blocks.0.norm3` is a different layer in diffusers and in the original Wan layout, and a per-key
guess could pick the wrong one.

The original -> diffusers renaming is diffusers' own single-file converter, run on the names,
where diffusers has one (Wan, LTX-2), so those are restated nowhere. HunyuanVideo 1.5 has none in
diffusers 0.42.1: its names are the table comfy_files/hy15.py reads single files with, and its fused
layers (ComfyUI's `img_attn.qkv`) map to several diffusers layers, whose rows resolve.py splits.
"""

from __future__ import annotations

from itertools import product
from typing import Callable, Iterable

from torch import nn

from ...memory.lora import LoraError
from ..comfy_files import hy15

# Heads trainers put before the module path, most specific first.
PREFIXES = ("model.diffusion_model.", "diffusion_model.", "base_model.model.", "transformer.", "lora_unet_", "lora_transformer_", "unet.")
MAX_FLAT_TOKENS = 10  # a flattened name splits into at most 2**(n-1) dotted guesses


def by_converter(converter: str) -> Callable[[Iterable[str]], dict[str, str]]:
    """Original module names -> diffusers names, by the diffusers single-file converter `converter`
    (a function of diffusers.loaders.single_file_utils) run on `<name>.weight` keys. A name the
    converter drops, or cannot take, is left out, so it is reported as unknown."""

    def convert(names: Iterable[str]) -> dict[str, str]:
        from diffusers.loaders import single_file_utils

        run = getattr(single_file_utils, converter)
        names = list(names)
        try:
            return _converted(run, names)
        except Exception:
            # The converter is written for checkpoints: some names make it touch the values (Wan
            # Animate's `face_adapter...linear1_kv` is split by `.shape`), which are names here. Each
            # name alone, then: those that still raise are left out, and the rest convert unaffected.
            return {original: new for name in names for original, new in _converted_alone(run, name).items()}

    return convert


def _converted(run: Callable[[dict], dict], names: list[str]) -> dict[str, str]:
    converted = run({f"{name}.weight": name for name in names})
    return {original: new.removesuffix(".weight") for new, original in converted.items()}


def _converted_alone(run: Callable[[dict], dict], name: str) -> dict[str, str]:
    try:
        return _converted(run, [name])
    except Exception:
        return {}


wan_original_to_diffusers = by_converter("convert_wan_transformer_to_diffusers")


def ltx2_original_to_diffusers(names: Iterable[str]) -> dict[str, str]:
    """LTX-2's original module names -> diffusers', by diffusers' own LTX-2 LoRA converter (the one
    LTX2Pipeline.lora_state_dict runs), which also knows LTX-2.3's renamed prompt modulations; the
    single-file converter does not."""
    from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_ltx2_lora_to_diffusers

    checkpoint = {f"diffusion_model.{name}.weight": name for name in names}
    converted = _convert_non_diffusers_ltx2_lora_to_diffusers(checkpoint)
    return {original: new.removeprefix("transformer.").removesuffix(".weight") for new, original in converted.items()}

# Wan's original names of a block's linear layers (its checkpoints' and ComfyUI's layout). Only
# this side is listed: the diffusers side of each comes from diffusers' converter, as when reading.
WAN_BLOCK_LINEARS = ("self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o", "cross_attn.q", "cross_attn.k",
                     "cross_attn.v", "cross_attn.o", "cross_attn.k_img", "cross_attn.v_img", "ffn.0", "ffn.2")


def wan_diffusers_to_original(paths: Iterable[str]) -> dict[str, str]:
    """Wan block layers' diffusers paths -> original names, by running the converter forwards on
    every original block-layer name; a path it cannot reach is a LoraError (nothing is guessed)."""
    paths = list(paths)
    blocks = {path.split(".")[1] for path in paths if path.startswith("blocks.") and path.count(".") > 1}
    originals = [f"blocks.{block}.{name}" for block in sorted(blocks) for name in WAN_BLOCK_LINEARS]
    reverse = {new: original for original, new in wan_original_to_diffusers(originals).items()}
    missing = [path for path in paths if path not in reverse]
    if missing:
        raise LoraError(f"no original Wan name for {', '.join(missing[:3])}: vidmem writes Wan LoRAs for the blocks' "
                        "attention and feed-forward layers only; choose target_modules among them.")
    return {path: reverse[path] for path in paths}


def trained_key_stems(model: nn.Module, paths: Iterable[str]) -> dict[str, str]:
    """Module path -> the key stem a trained LoRA file uses for it, in the naming every reader maps:
    Wan in its original layout under `diffusion_model.` (the naming ComfyUI maps, and the one
    diffusers' Wan loader converts), other families in diffusers' naming under `transformer.`
    (ComfyUI has no model for them; CogVideoX-Factory writes this)."""
    paths = list(paths)
    if type(model).__name__ == "WanTransformer3DModel":
        return {path: f"diffusion_model.{original}" for path, original in wan_diffusers_to_original(paths).items()}
    return {path: f"transformer.{path}" for path in paths}


# A name in an original layout means one diffusers module, or several (`Target` a tuple) where the
# original fuses them into one layer whose output rows are theirs in order (q, k, v).
Target = str | tuple[str, ...]


def hunyuan15_original_to_diffusers(names: Iterable[str]) -> dict[str, Target]:
    """HunyuanVideo 1.5's original module names -> diffusers name(s), by comfy_files/hy15.py's table
    (the one the file reader uses): Tencent's names (hyvideo's transformer; its train.py saves LoRAs
    under them) and ComfyUI's model's (fused `img_attn.qkv`, `img_mod.lin`, `img_mlp.0`: LoRAs made
    for ComfyUI), a fused layer to its q, k, v, whose rows resolve.py splits. The final modulation is
    left out: diffusers swaps its shift and scale rows, so a LoRA on it is reported, not applied."""
    found = {}
    for name in names:
        parameter = f"{name}.weight"
        targets = hy15.diffusers_targets(parameter)
        if targets is None or hy15.tencent_name(parameter) == f"{hy15.SWAPPED}.weight":
            continue
        modules = tuple(target.removesuffix(".weight") for target in targets)
        found[name] = modules[0] if len(modules) == 1 else modules
    return found


# transformer class name -> how its original checkpoints name modules (absent: diffusers names only)
ORIGINAL_NAMING: dict[str, Callable[[Iterable[str]], dict[str, Target]]] = {
    "WanTransformer3DModel": wan_original_to_diffusers,
    "LTX2VideoTransformer3DModel": ltx2_original_to_diffusers,
    "HunyuanVideo15Transformer3DModel": hunyuan15_original_to_diffusers,
}


def candidates(source: str) -> list[str]:
    """The name itself and the name with each known prefix removed."""
    found = [source]
    for prefix in PREFIXES:
        if source.startswith(prefix):
            found.append(source[len(prefix):])
    return found


def dotted_guesses(flat: str) -> list[str]:
    """Every way to turn some underscores of `flat` back into dots."""
    tokens = flat.split("_")
    if len(tokens) > MAX_FLAT_TOKENS or "." in flat:
        return []
    guesses = []
    for joints in product("._", repeat=len(tokens) - 1):
        guesses.append(tokens[0] + "".join(j + t for j, t in zip(joints, tokens[1:])))
    return guesses


class ModelNames:
    """Every module and parameter-holder name of one model, and the namings that reach them."""

    def __init__(self, model: nn.Module) -> None:
        self.modules = dict(model.named_modules())
        # parameters held directly by a parent (Wan's `scale_shift_table`) are named targets too,
        # so a LoRA touching them is reported as unsupported, not as unknown
        self.parameters = {name for name, _ in model.named_parameters()}
        self.targets = set(self.modules) | self.parameters
        self._flat = {name.replace(".", "_"): name for name in self.targets if name}
        self._original = ORIGINAL_NAMING.get(type(model).__name__)

    def resolve(self, sources: Iterable[str]) -> tuple[dict[str, Target], str]:
        """(source name -> model name for those resolved, the naming used), best naming for the file."""
        sources = list(sources)
        best, label = None, ""
        for name, naming in self._namings():
            found = self._by(naming, sources)
            if best is None or len(found) > len(best):  # equals keep the first
                best, label = found, name
            if len(best) == len(sources):
                break  # a later naming could only tie; the flattened originals are the slow ones to try
        return best, label

    def _namings(self):
        yield "diffusers", lambda names: {n: n for n in names if n in self.targets}
        yield "diffusers (flattened)", lambda names: {n: self._flat[n] for n in names if n in self._flat}
        if self._original is not None:
            yield "original", lambda names: self._known(self._original(names))
            yield "original (flattened)", self._flattened_original

    def _by(self, naming, sources: list[str]) -> dict[str, Target]:
        """Per source, the first of its candidates (prefix removed or not) that the naming resolves."""
        options = {source: candidates(source) for source in sources}
        resolved = naming({c for cs in options.values() for c in cs})
        found = {}
        for source, cs in options.items():
            hit = next((resolved[c] for c in cs if c in resolved), None)
            if hit is not None:
                found[source] = hit
        return found

    def _known(self, mapping: dict[str, Target]) -> dict[str, Target]:
        """The mapped names whose target (every one, for a fused layer) is in the model."""
        return {source: name for source, name in mapping.items()
                if (name in self.targets if isinstance(name, str) else all(n in self.targets for n in name))}

    def _flattened_original(self, names: Iterable[str]) -> dict[str, Target]:
        """Flattened original names: try every dotted guess; keep names with exactly one target."""
        guesses = {g: flat for flat in names for g in dotted_guesses(flat)}
        converted = self._known(self._original(guesses))
        hits: dict[str, set[Target]] = {}
        for guess, target in converted.items():
            hits.setdefault(guesses[guess], set()).add(target)
        return {flat: targets.pop() for flat, targets in hits.items() if len(targets) == 1}
