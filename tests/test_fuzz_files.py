"""Fuzz the loader nodes with bad and malicious files, as ComfyUI runs them (validation, then the
node): each is refused by ComfyUI's validation or with an error of the pack's own type naming the
file; no pickle is ever unpickled (torch.load and pickle raise if reached); nothing is written.

Cases that fail today because the fix belongs to a file another helper owns are marked
`xfail(strict=True)` naming the owner.
"""

from __future__ import annotations

import json
import pickle
import re
import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch

from fuzz_support import PACK_ERRORS, Case, Fixtures, comfy_refusal, tiny_comfy_module, tree
from vidmem.nodes import NODE_CLASS_MAPPINGS
from vidmem.nodes.loader import NO_MODELS

NAN = float("nan")
LORA_OWNER = "the LoRA helper owns pipelines/lora and memory/lora.py"


class Unpickled(AssertionError):
    """Raised by torch.load / pickle when a case reaches them: never a pack error, so the case fails."""


def xfail(owner: str, why: str):
    return (pytest.mark.xfail(strict=True, reason=f"{owner}: {why}"),)


# --- bad files, built from a real tiny model ----------------------------------------------------------

def pickled(path: Path) -> Path:
    torch.save({"weight": torch.zeros(2, 2)}, path)  # a torch pickle, as a .bin or .pt would hold
    return path


def model_folder(fx, change=None, variant: str = "wan2.1-t2v") -> Path:
    """A copy of the tiny model's diffusers folder, changed by `change(folder)`."""
    folder = fx.root / "models" / f"{variant}-{len(list((fx.root / 'models').glob('*'))) if (fx.root / 'models').exists() else 0}"
    shutil.copytree(fx.base_folder(variant), folder)
    if change is not None:
        change(folder)
    return folder


def edit_json(relative: str, edit):
    def change(folder: Path) -> None:
        path = folder / relative
        path.write_text(edit(json.loads(path.read_text())) if callable(edit) else edit)
    return change


def truncate(relative: str, keep: float = 0.5):
    def change(folder: Path) -> None:
        path = folder / relative
        data = path.read_bytes()
        path.write_bytes(data[: int(len(data) * keep)])
    return change


def replace_weights_with_pickle(component: str):
    def change(folder: Path) -> None:
        for f in (folder / component).glob("*.safetensors"):
            f.unlink()
        pickled(folder / component / "diffusion_pytorch_model.bin")
    return change


def remove(relative: str):
    return lambda folder: shutil.rmtree(folder / relative)


def L(change=None, variant="wan2.1-t2v", **inputs):  # Load Video Pipeline inputs
    def build(fx):
        given = {"model": NO_MODELS, "dtype": "fp32"}
        if "path" not in inputs:
            given["path"] = str(model_folder(fx, change, variant))
        return {**given, **inputs}
    return build


def single_file(make):
    """Load Video Pipeline with a transformer_file made by `make(path)`, listed as ComfyUI would."""
    def build(fx):
        folder = model_folder(fx)
        name = "transformer." + make.__name__.split("_as_")[-1]
        path = fx.root / "diffusion_models" / name
        path.parent.mkdir(exist_ok=True)
        make(path, fx)
        fx.list_single_files({name: path})
        return {"model": NO_MODELS, "dtype": "fp32", "path": str(folder), "transformer_file": name}
    return build


def pickle_as_sft(path, fx):
    pickled(path)


def pickle_as_safetensors(path, fx):
    pickled(path)


def text_as_safetensors(path, fx):
    path.write_text("these are not weights")


def empty_as_safetensors(path, fx):
    path.write_bytes(b"")


def header_lies_as_safetensors(path, fx):
    path.write_bytes((10**12).to_bytes(8, "little") + b"{}")  # claims a 1 TB header


def truncated_as_safetensors(path, fx):
    source = next((fx.base_folder("wan2.1-t2v") / "transformer").glob("*.safetensors")).read_bytes()
    path.write_bytes(source[: len(source) // 2])


def vae_as_safetensors(path, fx):
    shutil.copy(next((fx.base_folder("wan2.1-t2v") / "vae").glob("*.safetensors")), path)


def real_as_sft(path, fx):
    shutil.copy(next((fx.base_folder("wan2.1-t2v") / "transformer").glob("*.safetensors")), path)


# --- LoRA files ------------------------------------------------------------------------------------------

def lora(make, **inputs):
    def build(fx):
        path = fx.root / "loras" / "style.safetensors"
        path.parent.mkdir(exist_ok=True)
        make(path, fx)
        fx.list_loras({"style.safetensors": path})
        return {"pipeline": fx.pipeline(inputs.pop("variant", "wan2.1-t2v")), "lora_name": "style.safetensors",
                "strength": 1.0, "expert": "both", **inputs}
    return build


def good_lora(path, fx, down=(4, 24), up=(24, 4), key="blocks.0.attn1.to_q", value=0.01):
    tensors = {}
    if down:
        tensors[f"transformer.{key}.lora_A.weight"] = torch.full(down, value)
    if up:
        tensors[f"transformer.{key}.lora_B.weight"] = torch.full(up, value)
    safetensors.torch.save_file(tensors, str(path))


CASES = [
    # --- Load Video Pipeline: ComfyUI's combo checks ------------------------------------------------------
    Case("loader-model-not-listed", "VidMemLoadPipeline", lambda fx: {"model": "Wan2.1-T2V-1.3B", "dtype": "fp32"},
         "Value not in list: model"),
    Case("loader-dtype-int8", "VidMemLoadPipeline", L(dtype="int8"), "Value not in list: dtype"),
    Case("loader-dtype-fp8", "VidMemLoadPipeline", L(dtype="fp8"), "Value not in list: dtype"),
    Case("loader-transformer-file-not-listed", "VidMemLoadPipeline", L(transformer_file="evil.bin"),
         "Value not in list: transformer_file"),
    Case("loader-missing-dtype", "VidMemLoadPipeline", lambda fx: {"model": NO_MODELS}, "Required input is missing: dtype"),
    # --- Load Video Pipeline: folders --------------------------------------------------------------------
    Case("loader-path-missing", "VidMemLoadPipeline", L(path="/nonexistent/vidmem/model"), "does not exist"),
    Case("loader-path-is-a-file", "VidMemLoadPipeline",
         lambda fx: {"model": NO_MODELS, "dtype": "fp32", "path": str(model_folder(fx) / "model_index.json")},
         "is a file|not a folder"),
    Case("loader-no-model-index", "VidMemLoadPipeline", L(lambda f: (f / "model_index.json").unlink()), "no model_index.json"),
    Case("loader-index-not-json", "VidMemLoadPipeline", L(edit_json("model_index.json", "{not json")), "model_index.json"),
    Case("loader-index-a-list", "VidMemLoadPipeline", L(edit_json("model_index.json", "[1, 2]")), "model_index.json"),
    Case("loader-index-no-class", "VidMemLoadPipeline", L(edit_json("model_index.json", lambda d: json.dumps(
         {k: v for k, v in d.items() if k != "_class_name"}))), "_class_name"),
    Case("loader-index-other-family", "VidMemLoadPipeline",
         L(edit_json("model_index.json", lambda d: json.dumps({**d, "_class_name": "StableDiffusionPipeline"}))),
         "StableDiffusionPipeline', which vidmem does not run"),
    Case("loader-pickle-weights", "VidMemLoadPipeline", L(replace_weights_with_pickle("transformer")), "safetensors"),
    Case("loader-truncated-weights", "VidMemLoadPipeline", L(truncate("transformer/diffusion_pytorch_model.safetensors")),
         r"^(?!.*\.bin).*diffusion_pytorch_model\.safetensors"),
    Case("loader-empty-weights", "VidMemLoadPipeline", L(truncate("vae/diffusion_pytorch_model.safetensors", 0.0)),
         r"^(?!.*\.bin).*diffusion_pytorch_model\.safetensors"),
    Case("loader-missing-component", "VidMemLoadPipeline", L(remove("vae")), "vae"),
    Case("loader-config-not-json", "VidMemLoadPipeline", L(edit_json("transformer/config.json", "{oops")), "config.json"),
    Case("loader-absurd-config", "VidMemLoadPipeline",
         L(edit_json("transformer/config.json", lambda c: json.dumps({**c, "ffn_dim": 2**40}))), "ffn_dim|RAM|bytes"),
    Case("loader-no-model-no-path", "VidMemLoadPipeline", lambda fx: {"model": NO_MODELS, "dtype": "fp32", "path": "  "},
         "models/diffusers"),
    # --- Load Video Pipeline: single-file transformers ------------------------------------------------------
    Case("single-pickle-named-sft", "VidMemLoadPipeline", single_file(pickle_as_sft), "pickle"),
    Case("single-pickle-named-safetensors", "VidMemLoadPipeline", single_file(pickle_as_safetensors), "pickle"),
    Case("single-text-file", "VidMemLoadPipeline", single_file(text_as_safetensors), "not a safetensors"),
    Case("single-empty-file", "VidMemLoadPipeline", single_file(empty_as_safetensors), "not a safetensors"),
    Case("single-header-lies", "VidMemLoadPipeline", single_file(header_lies_as_safetensors), "not a safetensors"),
    Case("single-truncated", "VidMemLoadPipeline", single_file(truncated_as_safetensors), "truncated"),
    Case("single-vae-as-transformer", "VidMemLoadPipeline", single_file(vae_as_safetensors), "VAE"),
    Case("single-file-for-cogvideox", "VidMemLoadPipeline",
         lambda fx: {**single_file(real_as_sft)(fx),
                     "path": str(model_folder(fx, variant="cogvideox-t2v"))},
         "transformer_file is not supported for cogvideox"),
    # --- Load LoRA -----------------------------------------------------------------------------------------
    Case("lora-not-listed", "VidMemLoadLoRA", lambda fx: {**lora(good_lora)(fx), "lora_name": "other.safetensors"},
         "Value not in list: lora_name"),
    Case("lora-strength-too-high", "VidMemLoadLoRA", lora(good_lora, strength=5.0), "strength=5.0 must be from -4.0 to 4.0"),
    Case("lora-strength-too-low", "VidMemLoadLoRA", lora(good_lora, strength=-5.0), "strength=-5.0 must be from -4.0 to 4.0"),
    Case("lora-strength-text", "VidMemLoadLoRA", lora(good_lora, strength="strong"), "convert an input value to a FLOAT"),
    Case("lora-strength-nan", "VidMemLoadLoRA", lora(good_lora, strength=NAN), "strength=nan is not a finite number"),
    Case("lora-expert-unknown", "VidMemLoadLoRA", lora(good_lora, expert="middle"), "Value not in list: expert"),
    Case("lora-expert-on-one-transformer", "VidMemLoadLoRA", lora(good_lora, expert="high_noise"), "needs a two-expert model"),
    Case("lora-pickle", "VidMemLoadLoRA", lora(lambda p, fx: pickled(p)), "pickle"),
    Case("lora-text", "VidMemLoadLoRA", lora(text_as_safetensors), "cannot be used"),
    Case("lora-empty-file", "VidMemLoadLoRA", lora(empty_as_safetensors), "cannot be used"),
    Case("lora-truncated", "VidMemLoadLoRA",
         lora(lambda p, fx: (good_lora(p, fx), p.write_bytes(p.read_bytes()[:-40]))), "cannot be used"),
    Case("lora-keys-match-nothing", "VidMemLoadLoRA", lora(lambda p, fx: good_lora(p, fx, key="not.a.layer")), "none of its"),
    Case("lora-wrong-size", "VidMemLoadLoRA", lora(lambda p, fx: good_lora(p, fx, down=(4, 48), up=(48, 4))), "do not fit"),
    Case("lora-down-without-up", "VidMemLoadLoRA", lora(lambda p, fx: good_lora(p, fx, up=None)), "no .* matrix"),
    Case("lora-no-tensors", "VidMemLoadLoRA", lora(lambda p, fx: safetensors.torch.save_file({}, str(p))), "none of its|no"),
    Case("lora-nan-values", "VidMemLoadLoRA", lora(lambda p, fx: good_lora(p, fx, value=NAN)), "holds NaN or infinite values"),
    Case("lora-strength-inf", "VidMemLoadLoRA", lora(good_lora, strength=float("inf")), "strength=inf is not a finite number"),
    Case("lora-pipeline-none", "VidMemLoadLoRA", lambda fx: {**lora(good_lora)(fx), "pipeline": None},
         r"pipeline \(Load LoRA\) got nothing \(None\), not a vidmem pipeline"),
    Case("lora-pipeline-latent", "VidMemLoadLoRA", lambda fx: {**lora(good_lora)(fx), "pipeline": {"samples": torch.zeros(1)}},
         r"pipeline \(Load LoRA\) got a LATENT \(a dict with 'samples'\)"),
]


def model_files(model=None, text_encoder=None, vae=None, variant="wan2.1-t2v", **inputs):
    """Load Video Model Files inputs from tiny Comfy-layout files; `model`/`text_encoder`/`vae`
    replace a file with a bad one made by `make(path, fx)`."""
    def build(fx):
        good = fx.comfy_files(variant).files
        listed = {}
        for role, make in (("model", model), ("text_encoder", text_encoder), ("vae", vae)):
            path = getattr(good, role)
            if make is not None:
                path = fx.root / "bad" / f"{role}.safetensors"
                path.parent.mkdir(exist_ok=True)
                make(path, fx)
            listed[role] = {path.name: path}
        fx.list_model_files(listed)
        given = {role: next(iter(names)) for role, names in listed.items()}
        return {**given, "dtype": "fp32", "vae_dtype": "same as dtype", "weight_dtype": "default",
                "weights_on_disk": True, **inputs}
    return build


def comfy_file(role: str):
    def make(path, fx):
        shutil.copy(getattr(fx.comfy_files("wan2.1-t2v").files, role), path)
    return make


def no_tokenizer_text_encoder(path, fx):
    shutil.copy(tiny_comfy_module().save_tiny_comfy_files("wan2.1-t2v", fx.root / "no-tok", with_tokenizer=False).files.text_encoder, path)
    shutil.rmtree(fx.root / "no-tok")


MODEL_FILE_CASES = [
    Case("files-model-not-listed", "VidMemLoadModelFiles", lambda fx: {**model_files()(fx), "model": "wan_14B.safetensors"},
         "Value not in list: model"),
    Case("files-dtype-int8", "VidMemLoadModelFiles", model_files(dtype="int8"), "Value not in list: dtype"),
    Case("files-vae-dtype-unknown", "VidMemLoadModelFiles", model_files(vae_dtype="fp64"), "Value not in list: vae_dtype"),
    Case("files-weight-dtype-unknown", "VidMemLoadModelFiles", model_files(weight_dtype="int4"), "Value not in list: weight_dtype"),
    Case("files-model-2-not-listed", "VidMemLoadModelFiles", model_files(model_2="low_noise.safetensors"),
         "Value not in list: model_2"),
    Case("files-missing-vae", "VidMemLoadModelFiles", lambda fx: {k: v for k, v in model_files()(fx).items() if k != "vae"},
         "Required input is missing: vae"),
    Case("files-model-pickle", "VidMemLoadModelFiles", model_files(model=lambda p, fx: pickled(p)), "pickle"),
    Case("files-model-text", "VidMemLoadModelFiles", model_files(model=text_as_safetensors), "not a safetensors"),
    Case("files-model-empty", "VidMemLoadModelFiles", model_files(model=empty_as_safetensors), "not a safetensors"),
    Case("files-model-truncated", "VidMemLoadModelFiles", model_files(model=truncated_as_safetensors), "truncated"),
    Case("files-vae-as-model", "VidMemLoadModelFiles", model_files(model=comfy_file("vae")), "VAE"),
    Case("files-model-as-vae", "VidMemLoadModelFiles", model_files(vae=comfy_file("model")), "vae"),
    Case("files-text-encoder-pickle", "VidMemLoadModelFiles", model_files(text_encoder=lambda p, fx: pickled(p)), "pickle"),
    Case("files-text-encoder-is-vae", "VidMemLoadModelFiles", model_files(text_encoder=comfy_file("vae")), "text_encoder|text encoder"),
    Case("files-text-encoder-without-tokenizer", "VidMemLoadModelFiles", model_files(text_encoder=no_tokenizer_text_encoder),
         "tokenizer"),
]


class FileFixtures(Fixtures):
    def __init__(self, tiny_loaded, tiny_folder, root, monkeypatch) -> None:
        super().__init__(tiny_loaded, root, monkeypatch)
        self.base_folder = tiny_folder

    def list_single_files(self, files: dict) -> None:
        from vidmem.nodes import host

        self.monkeypatch.setattr(host, "single_file_transformer_names", lambda: list(files))
        self.monkeypatch.setattr(host, "resolve_single_file", lambda name: files[name])

    def comfy_files(self, variant: str):
        if variant not in COMFY_FILES:  # built once per session, outside the watched folder
            COMFY_FILES[variant] = tiny_comfy_module().save_tiny_comfy_files(variant, self.session_root / f"comfy-{variant}")
        return COMFY_FILES[variant]

    def list_model_files(self, listed: dict) -> None:
        from vidmem.nodes import host

        import vidmem.nodes.load_files as node_module
        from vidmem.pipelines.comfy_files import load_model_files

        tiny_catalogue = tiny_comfy_module().tiny_catalogue

        self.monkeypatch.setattr(host, "model_file_names", lambda role: list(listed.get(role, {})))
        self.monkeypatch.setattr(host, "resolve_model_file", lambda role, name: listed[role][name])
        # The shipped catalogue knows real model sizes only: recognise the tiny files as their tests do.
        if hasattr(node_module, "shipped_catalogue"):
            self.monkeypatch.setattr(node_module, "shipped_catalogue", lambda *args, **kwargs: tiny_catalogue())
        else:
            self.monkeypatch.setattr(node_module, "load_model_files",
                                     lambda files, options, *rest: load_model_files(files, options, tiny_catalogue()))

    def list_loras(self, files: dict) -> None:
        from vidmem.nodes import host

        self.monkeypatch.setattr(host, "lora_names", lambda: list(files))
        self.monkeypatch.setattr(host, "resolve_lora", lambda name: files[name])


COMFY_FILES: dict = {}


@pytest.fixture(scope="session")
def comfy_root(tmp_path_factory):
    return tmp_path_factory.mktemp("comfy-files")


@pytest.fixture
def fx(tiny_loaded, tiny_folder, tmp_path, monkeypatch, comfy_root):
    def refuse(*args, **kwargs):
        raise Unpickled("a pickle was about to be unpickled")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    fixtures = FileFixtures(tiny_loaded, tiny_folder, tmp_path, monkeypatch)
    fixtures.session_root = comfy_root
    return fixtures


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=c.marks) for c in CASES + MODEL_FILE_CASES])
def test_bad_file_or_input_is_refused_and_leaves_nothing(case, fx):
    node_cls = NODE_CLASS_MAPPINGS[case.node]
    inputs = case.inputs(fx)
    before = tree(fx.root)
    reasons, converted = comfy_refusal(node_cls, inputs)
    if reasons:
        assert re.search(case.message, "\n".join(reasons)), reasons
    else:
        with pytest.raises(PACK_ERRORS) as error:
            getattr(node_cls(), node_cls.FUNCTION)(**converted)
        assert re.search(case.message, str(error.value), re.DOTALL), str(error.value)
    assert tree(fx.root) == before, "a file or folder was written"


def test_good_model_files_load_through_the_same_path(fx):
    """The model-files cases are moot unless the same inputs with good files load."""
    inputs = model_files()(fx)
    reasons, converted = comfy_refusal(NODE_CLASS_MAPPINGS["VidMemLoadModelFiles"], inputs)
    assert reasons == []
    (pipeline,) = NODE_CLASS_MAPPINGS["VidMemLoadModelFiles"]().load(**converted)
    assert pipeline.class_name == "WanPipeline"


def test_the_unpickling_guard_would_catch_a_pickle(fx):
    """The guard is live: the fuzz cases above would fail if a loader reached torch.load."""
    path = pickled(fx.root / "x.bin")
    with pytest.raises(Unpickled):
        torch.load(path)


def test_a_real_safetensors_file_named_sft_loads(fx):
    """Safetensors by content, not by name: the issue found this failing with a raw OSError."""
    inputs = single_file(real_as_sft)(fx)
    (pipeline,) = NODE_CLASS_MAPPINGS["VidMemLoadPipeline"]().load(**inputs)
    assert pipeline.pipe.transformer is not None
