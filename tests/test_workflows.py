"""The workflow templates: they are what generate.py writes, every node and widget lines up with the
nodes' INPUT_TYPES, UI and API files describe the same graph, and every API workflow runs end to end
in-process with tiny models saved under the workflows' model folder names (no ComfyUI needed)."""

from __future__ import annotations

import importlib.util
import json
import re
import sys

import pytest
import torch

try:
    from . import model_files, tiny_loras
    from . import workflow_runner as wr
except ImportError:  # tests/ is not a package: pytest put this folder on sys.path
    import model_files
    import tiny_loras
    import workflow_runner as wr

from vidmem.nodes import NODE_CLASS_MAPPINGS
from vidmem.pipelines.tiny import tiny_spec

UI_FILES = wr.ui_files()
API_FILES = wr.api_files()
KNOWN_TYPES = set(NODE_CLASS_MAPPINGS) | set(wr.CORE_NODES) | set(wr.VIRTUAL_NODES)


def by_name(paths):
    return pytest.mark.parametrize("path", paths, ids=[p.stem for p in paths])


@pytest.fixture(scope="session")
def tiny_models_dir(tmp_path_factory):
    """A models/diffusers folder with a tiny model under every folder name the workflows use."""
    root = tmp_path_factory.mktemp("models") / "diffusers"
    wr.place_tiny_models(root)
    return root


@pytest.fixture(scope="session")
def tiny_files_root(tmp_path_factory):
    """A ComfyUI models folder with tiny files under every file name the single-file templates use."""
    root = tmp_path_factory.mktemp("comfy_models")
    model_files.place_tiny_model_files(root)
    return root


@pytest.fixture(scope="session")
def tiny_loras_dir(tmp_path_factory):
    """A models/loras folder with a tiny LoRA under every name the LoRA templates load."""
    folder = tmp_path_factory.mktemp("loras")
    tiny_loras.place_tiny_loras(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_clips(tmp_path_factory):
    """Tiny captioned clips for the train templates' Prepare Training Data."""
    return tiny_loras.place_tiny_clips(tmp_path_factory.mktemp("clips"))


@pytest.fixture
def models_root(tiny_models_dir, tiny_files_root, tiny_loras_dir, tmp_path, monkeypatch):
    """The host's model lookups pointed at the tiny folders and files (as ComfyUI's folder_paths would list
    them); trained LoRAs and training caches go to a fresh folder, the tiny LoRAs are listed beside them."""
    from vidmem.nodes import host

    trained = tmp_path / "loras"
    trained.mkdir()

    def resolve_lora(name):
        path = next((folder / name for folder in (tiny_loras_dir, trained) if (folder / name).is_file()), None)
        if path is None:
            raise FileNotFoundError(f"lora '{name}' is not among the tiny LoRAs")
        return path

    monkeypatch.setattr(host, "lora_names", lambda: sorted(p.name for d in (tiny_loras_dir, trained) for p in d.glob("*.safetensors")))
    monkeypatch.setattr(host, "resolve_lora", resolve_lora)
    monkeypatch.setattr(host, "loras_folder", lambda: trained)
    monkeypatch.setattr(host, "training_folder", lambda: tmp_path / "vidmem_training")

    def folder(role):
        return tiny_files_root / host.MODEL_FILE_FOLDERS[role][0]

    def resolve(role, name):
        path = folder(role) / name
        if not path.is_file():
            raise FileNotFoundError(f"{role} '{name}' is not among the tiny files in {folder(role)}")
        return path

    monkeypatch.setattr(host, "_diffusers_roots", lambda: [str(tiny_models_dir)])
    monkeypatch.setattr(host, "model_file_names", lambda role: sorted(p.name for p in folder(role).glob("*.safetensors")))
    monkeypatch.setattr(host, "resolve_model_file", resolve)
    monkeypatch.setattr(host, "model_config_dirs", lambda: [tiny_files_root / model_files.CONFIGS])
    return tiny_models_dir


def test_every_template_has_both_formats_a_readable_title_and_a_thumbnail():
    assert {"cogvideox_t2v.json", "wan21_t2v_blockswap.json"} <= {p.name for p in API_FILES}
    assert sorted(wr.api_twin(p).name for p in UI_FILES) == [p.name for p in API_FILES]
    for path in UI_FILES:  # the Templates browser shows the file name as title and description
        assert len(path.stem) <= 36, "the card's bold title shows about 36 characters on one line"
        assert " " in path.stem and "_" not in path.stem, path.stem
        assert re.search(r"(\d+ GB card|small card, block swap|\d+ GB, \d+ GB RAM)$", path.stem), path.stem
        assert re.fullmatch(r"[A-Za-z0-9 .,()-]+", path.stem), "characters a URL path keeps as they are"
        image = wr.thumbnail(path)
        assert image.is_file(), f"{image.name} missing: run tests/test_web_browser.py with VIDMEM_THUMBNAILS=1"
        data = image.read_bytes()
        assert data[:3] == b"\xff\xd8\xff" and 5_000 < len(data) < 120_000, (image.name, len(data))


def test_every_card_says_the_model_what_it_is_made_for_its_steps_files_and_when_to_pick_it():
    """The Templates browser shows a pack's template with its file name as title and description: the
    card image (drawn from extra.vidmem.card by tests/browser/template_cards.mjs) says the rest."""
    from PIL import Image

    for path in UI_FILES:
        card = wr.load_json(path)["extra"]["vidmem"]["card"]
        assert set(card) == {"model", "family", "variant", "vram_gb", "ram_gb", "shot", "speed", "files", "pick"}, path.stem
        assert card["model"] in path.stem and card["family"] in ("wan21", "wan22", "cogvideox", "hunyuan15", "ltx2")
        assert re.fullmatch(r"(trains \d+ steps, samples \d+|(\d+ of )?\d+ steps, [12] pass(es)? each \(cfg( 1)?\))", card["speed"]), card
        assert 10 <= len(card["pick"]) <= 60 and card["pick"] not in path.stem, card["pick"]
        with Image.open(wr.thumbnail(path)) as image:
            assert image.width == image.height, f"{path.stem}: the browser's card slot is square"


def test_every_template_opens_with_its_note_below_the_workflows_name():
    """The frontend draws the workflow's name over the canvas's top left, 42-90 px from the top
    (ComfyUI 0.8.0, frontend 1.35): the saved view puts the note's title bar below it."""
    for path in UI_FILES:
        ui = wr.load_json(path)
        note = next(n for n in ui["nodes"] if n["type"] == "Note")
        scale, (_, offset_y) = ui["extra"]["ds"]["scale"], ui["extra"]["ds"]["offset"]
        assert (note["pos"][1] - 30 + offset_y) * scale >= 100, path.stem


def test_generate_check_flags_a_template_file_that_is_not_generated(tmp_path, monkeypatch):
    generator = load_generator(monkeypatch)
    stray = wr.WORKFLOWS_DIR / "not_a_template.json"
    stray.write_text("{}")
    try:
        assert generator.main(["--check"]) == 1
    finally:
        stray.unlink()
    assert generator.main(["--check"]) == 0


def load_generator(monkeypatch):
    location = wr.WORKFLOWS_DIR / "generate.py"
    spec = importlib.util.spec_from_file_location("vidmem_workflow_generator", location)
    generator = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, generator)  # dataclasses look their module up there
    spec.loader.exec_module(generator)
    return generator


def test_files_are_what_generate_writes(monkeypatch):
    generator = load_generator(monkeypatch)
    stale = [str(path.relative_to(wr.REPO)) for path, text in generator.render().items()
             if not path.is_file() or path.read_text() != text]
    assert not stale, f"out of date (run `python workflows/generate.py`): {stale}"


@by_name(UI_FILES)
def test_every_node_type_exists(path):
    ui = wr.load_json(path)
    unknown = {node["type"] for node in ui["nodes"]} - KNOWN_TYPES
    assert not unknown, f"{path.name}: node types neither vidmem's nor listed core nodes: {unknown}"
    chain = {"VidMemMemoryStrategy", "VidMemVideoSampler", "VidMemVAEDecode"}
    assert chain <= {node["type"] for node in ui["nodes"]}, "the whole chain appears"
    assert any(node["type"].startswith("VidMemLoad") for node in ui["nodes"]), "a vidmem loader starts it"


# Core nodes that write what a template makes (ComfyUI runs a prompt for its output nodes).
SAVE_NODES = ("CreateVideo", "SaveVideo", "SaveAnimatedWEBP")


@by_name(API_FILES)
def test_no_template_frees_vram_before_its_outputs(path):
    """Free VRAM is never cached (its IS_CHANGED is NaN) and drops the weights kept on the GPU: in a
    template's chain it would make every queue cold and run every node after it again, rewriting the
    same video. The save nodes take the Decode's frames straight."""
    api = wr.load_json(path)
    decode = next(nid for nid, node in api.items() if node["class_type"] == "VidMemVAEDecode")
    for nid, node in api.items():
        if node["class_type"] not in SAVE_NODES:
            continue
        before = _ancestors(api, nid)
        assert not any(api[a]["class_type"] == "VidMemFreeVRAM" for a in before), f"{path.stem}: node {nid}"
        assert decode in before, f"{path.stem}: {node['class_type']} (node {nid}) does not save the Decode's frames"


def _ancestors(api: dict, nid: str) -> set[str]:
    """Every node whose output reaches node `nid` (what ComfyUI runs, and keys its cache on, before it)."""
    found, frontier = set(), [nid]
    while frontier:
        for value in api[frontier.pop()]["inputs"].values():
            if wr.is_link(value) and value[0] not in found:
                found.add(value[0])
                frontier.append(value[0])
    return found


@by_name(UI_FILES)
def test_ui_widget_values_line_up_with_input_types(path, models_root):
    problems = []
    for node in wr.load_json(path)["nodes"]:
        spec = wr.node_spec(node["type"])
        names, values = wr.widget_names(spec), node.get("widgets_values", [])
        if len(names) != len(values):
            problems.append(f"node {node['id']} {node['type']}: {len(values)} widget values for {names}")
            continue
        configs = {name: (t, config) for name, t, config, _optional in spec.ordered_inputs()}
        for name, value in zip(names, values):
            if name == "control_after_generate":
                problem = None if value in wr.SEED_CONTROLS else f"{value!r} not in {wr.SEED_CONTROLS}"
            else:
                problem = wr.value_problem(*configs[name], value)
            if problem:
                problems.append(f"node {node['id']} {node['type']}.{name}: {problem}")
    assert not problems, "\n".join(problems)


@by_name(UI_FILES)
def test_ui_slots_and_links_agree(path):
    ui = wr.load_json(path)
    nodes = {node["id"]: node for node in ui["nodes"]}
    assert ui["version"] == 0.4 and ui["last_node_id"] >= max(nodes)
    assert ui["last_link_id"] >= max(link[0] for link in ui["links"]) and len({l[0] for l in ui["links"]}) == len(ui["links"])
    for node in ui["nodes"]:
        spec = wr.node_spec(node["type"])
        assert [(s["name"], s["type"]) for s in node["inputs"]] == [(n, t) for n, t, _o in wr.socket_inputs(spec)]
        assert [(o["name"], o["type"]) for o in node["outputs"]] == list(zip(spec.output_names, spec.outputs))
        for slot, optional in zip(node["inputs"], [o for _n, _t, o in wr.socket_inputs(spec)]):
            assert optional or slot["link"] is not None, f"{node['type']}.{slot['name']} is required but unconnected"
        if node["type"] != "Note":
            assert node["properties"]["Node name for S&R"] == node["type"]
    linked_in = {s["link"] for n in ui["nodes"] for s in n["inputs"] if s["link"] is not None}
    linked_out = {i for n in ui["nodes"] for o in n["outputs"] for i in o["links"]}
    assert linked_in == linked_out == {link[0] for link in ui["links"]}
    for link_id, src, src_slot, dst, dst_slot, link_type in ui["links"]:
        output, target = nodes[src]["outputs"][src_slot], nodes[dst]["inputs"][dst_slot]
        assert link_id in output["links"] and target["link"] == link_id
        assert wr.types_match(output["type"], link_type) and wr.types_match(link_type, target["type"])


@by_name(UI_FILES)
def test_ui_explains_its_memory_choice_in_a_note(path):
    ui = wr.load_json(path)
    notes = [n["widgets_values"][0] for n in ui["nodes"] if n["type"] == "Note"]
    strategy = next(n for n in ui["nodes"] if n["type"] == "VidMemMemoryStrategy")
    offload = strategy["widgets_values"][0]
    files = ui["extra"]["vidmem"].get("files", [])
    where = [f"models/{f['folder']}/{f['name']}" for f in files] + [f["repo"] for f in files] or ["models/diffusers"]
    loras = ui["extra"]["vidmem"].get("loras", [])
    where += [f"models/loras/{f['name']}" for f in loras] + [f["repo"] for f in loras if f["repo"]]
    assert notes and any(offload in text and all(w in text for w in where) for text in notes), (offload, where)


@by_name(UI_FILES)
def test_ui_and_api_describe_the_same_graph(path):
    api = wr.load_json(wr.api_twin(path))
    assert wr.ui_to_api(wr.load_json(path)) == api


@by_name(API_FILES)
def test_api_inputs_are_valid(path, models_root):
    api = wr.load_json(path)
    problems = []
    for nid, node in api.items():
        spec = wr.node_spec(node["class_type"])
        for name, input_type, config, optional in spec.ordered_inputs():
            value = node["inputs"].get(name)
            if value is None:
                problems += [] if optional else [f"{nid}.{name}: missing"]
            elif wr.is_link(value):
                sent = wr.node_spec(api[value[0]]["class_type"]).outputs[value[1]]
                problems += [] if wr.types_match(sent, input_type) else [f"{nid}.{name}: {sent} into {input_type}"]
            elif wr.is_widget(input_type) and wr.value_problem(input_type, config, value):
                problems.append(f"{nid}.{name}: {wr.value_problem(input_type, config, value)}")
        extra = set(node["inputs"]) - {name for name, *_ in spec.ordered_inputs()}
        problems += [f"{nid}: unknown inputs {extra}"] if extra else []
    assert not problems, "\n".join(problems)


@by_name(API_FILES)
def test_api_models_are_referenced_by_name(path):
    api = wr.load_json(path)
    loaders = [node for node in api.values() if node["class_type"] in (wr.FOLDER_LOADER, wr.FILES_LOADER)]
    assert len(loaders) == 1
    inputs = loaders[0]["inputs"]
    if loaders[0]["class_type"] == wr.FOLDER_LOADER:
        assert inputs["path"] == "", "no machine-specific paths"
    names = [inputs[role] for role in model_files.FOLDERS if inputs.get(role, model_files.UNUSED) != model_files.UNUSED]
    assert names and all("/" not in name and "\\" not in name for name in names), names
    assert wr.tiny_variant_for(inputs["model"])


SINGLE_FILE_UI = [p for p in UI_FILES if "files" in wr.load_json(p)["extra"]["vidmem"]]
ROLE_FOLDERS = {"model": "diffusion_models", "model_2": "diffusion_models", "text_encoder": "text_encoders", "vae": "vae",
                "clip_vision": "clip_vision"}


def test_a_single_file_template_per_wan_family():
    loaders = {wr.load_json(wr.api_twin(p))["1"]["inputs"]["model"] for p in SINGLE_FILE_UI}
    assert {wr.tiny_variant_for(name) for name in loaders} >= {"wan2.1-t2v", "wan2.2-a14b"}
    assert any("fp8" in name and "14B" in name for name in loaders)


@by_name(SINGLE_FILE_UI)
def test_single_file_template_names_comfy_orgs_files_in_their_folders(path):
    ui = wr.load_json(path)
    files = {f["name"]: f for f in ui["extra"]["vidmem"]["files"]}
    loader = wr.load_json(wr.api_twin(path))["1"]
    assert loader["class_type"] == wr.FILES_LOADER
    named = {role: loader["inputs"][role] for role in ROLE_FOLDERS if loader["inputs"][role] != model_files.UNUSED}
    assert sorted(named.values()) == sorted(files), "the loader names exactly the files the note lists"
    for role, name in named.items():
        file = files[name]
        assert file["folder"] == ROLE_FOLDERS[role], (role, file)
        assert file["repo"] in ("Comfy-Org/Wan_2.1_ComfyUI_repackaged", "Comfy-Org/Wan_2.2_ComfyUI_Repackaged")
        assert file["url"] == f"https://huggingface.co/{file['repo']}/resolve/main/split_files/{file['folder']}/{name}"
    assert loader["inputs"]["weights_on_disk"] is True and loader["inputs"]["weight_dtype"] == "default"
    assert ("model_2" in named) == wr.tiny_variant_for(named["model"]).endswith("a14b"), "A14B takes both experts"
    clip_readers = ("wan2.1-i2v", "wan2.1-flf2v")
    assert ("clip_vision" in named) == (wr.tiny_variant_for(named["model"]) in clip_readers), "Wan 2.1 I2V and FLF2V read CLIP"


MACHINE_UI = [p for p in UI_FILES if "machine" in wr.load_json(p)["extra"]["vidmem"]]


def test_a_cogvideox_template_stores_its_weights_in_fp8():
    loaders = [wr.load_json(wr.api_twin(p))["1"]["inputs"] for p in MACHINE_UI]
    assert any(wr.tiny_variant_for(l["model"]).startswith("cogvideox") and l.get("weight_dtype", "").startswith("fp8")
               for l in loaders), loaders


def _template_plan(path, blocks_to_swap=None, stored=None):
    """The planner's row for a machine template: at its full size, on the machine it names, with the
    weights' storage (as the files' names state it, or as the folder loader's weight_dtype lowers it),
    its step count and the state its Step Cache keeps on the GPU, for PyTorch's native allocator as the
    note's `vidmem plan` line plans it (the Strategy node in ComfyUI on CUDA plans for cudaMallocAsync).
    `blocks_to_swap` and `stored` (one storage for every weight) replan it with those changed."""
    from vidmem.memory.plan.planner import PlanOptions, VideoShape, plan_run
    from vidmem.memory.plan.types import Allocator
    from vidmem.nodes.strategy import WIDGETS, build_strategy
    from vidmem.pipelines.configs import load_model

    machine = wr.load_json(path)["extra"]["vidmem"]["machine"]
    api = wr.load_json(wr.api_twin(path))
    by_type = {node["class_type"]: node["inputs"] for node in api.values()}
    sampler = by_type["VidMemVideoSampler"]
    if wr.FILES_LOADER in by_type:
        loader = by_type[wr.FILES_LOADER]
        stated = {"transformer": loader["model"], "transformer_2": loader["model_2"], "text_encoder": loader["text_encoder"]}
        assert machine["weights"] == {c: model_files.storage_named(n) for c, n in stated.items() if n != model_files.UNUSED}
        on_disk = loader["weights_on_disk"]
    else:  # a diffusers folder, lowered at load or held at the compute dtype ("default"): the weights live in RAM
        loader = by_type[wr.FOLDER_LOADER]
        held = loader["dtype"] if loader["weight_dtype"] == "default" else loader["weight_dtype"]
        assert set(machine["weights"].values()) == {held}, (machine["weights"], loader["weight_dtype"])
        on_disk = False
    model = load_model(machine["plan_model"], loader["dtype"])
    widgets = {name: by_type["VidMemMemoryStrategy"][name] for name in WIDGETS}
    if blocks_to_swap is not None:
        widgets["blocks_to_swap"] = blocks_to_swap
    strategy = build_strategy(**widgets)
    shape = VideoShape(sampler["width"], sampler["height"], sampler["frames"], cfg=sampler["cfg"] > 1.0)
    storage = {component: stored for component in machine["weights"]} if stored else machine["weights"]
    options = PlanOptions(storage=storage, on_disk=on_disk, steps=sampler["steps"], allocator=Allocator.NATIVE,
                          cache_state=_cache_state(by_type.get("VidMemStepCache"), model))
    plan = plan_run(model, shape, strategy, options, vram_budget_bytes=int(machine["vram_gb"] * 2**30),
                    ram_budget_bytes=int(machine["ram_gb"] * 2**30))
    return plan, strategy, machine


def _cache_state(cache: dict | None, model) -> dict:
    """What the template's Step Cache keeps on the GPU per denoiser (as nodes/plan_route.py plans it)."""
    if cache is None:
        return {}
    from vidmem.pipelines.step_cache import StepCache

    return StepCache(cache["method"], cache["threshold"], cache["retention"], cache["max_skip_steps"],
                     calibrate=True).planned_state(model.layout.denoisers)


@by_name(MACHINE_UI)
def test_template_strategy_fits_its_machine_per_the_planner(path):
    plan, strategy, machine = _template_plan(path)
    peaks = f"peak VRAM {plan.peak_vram_bytes / 2**30:.2f} GiB, RAM {plan.peak_ram_bytes / 2**30:.2f} GiB"
    assert plan.fits, f"{path.stem}: {strategy.describe()} does not fit {machine}: {peaks}"
    print(f"\n{path.stem}: {strategy.describe()}: {peaks}, slowdown x{plan.est_slowdown:.2f}")


LTX2_UI = [p for p in MACHINE_UI if wr.load_json(p)["extra"]["vidmem"]["machine"]["plan_model"].startswith("ltx2")]


class _Plans:
    """A machine template's plans, its own and replanned with another blocks_to_swap or storage, each made once."""

    def __init__(self, path):
        self.path, self.made = path, {}

    def __call__(self, blocks_to_swap=None, stored=None):
        key = (blocks_to_swap, stored)
        if key not in self.made:
            self.made[key] = _template_plan(self.path, blocks_to_swap, stored)[0]
        return self.made[key]

    def fewest_that_fit(self, up_to: int) -> int | None:
        return next((n for n in range(1, up_to + 1) if self(blocks_to_swap=n).fits), None)

    def stage(self, name: str) -> int:
        return next(stage.device_bytes for stage in self().stages if stage.name == name)


def _gib(value: float, quoted: str) -> str:
    """`value` bytes in GiB, written with as many decimals as `quoted` has."""
    return f"{value / 2**30:.{len(quoted.partition('.')[2])}f}"


# The phrases a machine template's note quotes the planner in, each bound to the figure it names: the
# template's own plan (its widgets, machine, steps and Step Cache) unless the phrase names a change. Each
# yields (quoted, what the planner says), compared as written (as many decimals as quoted). Earlier
# phrases are taken out of the text first (a "GiB of RAM" inside the bf16 phrase is that phrase's).
NOTE_FIGURES = (
    (r"in bf16 the planner predicts (\d+) GiB of RAM", lambda p, m: [(m[1], _gib(p(stored="bf16").peak_ram_bytes, m[1]))]),
    (r"(\d+) is the fewest that fit \(([\d.]+) GiB",
     lambda p, m: [(m[1], str(p.fewest_that_fit(int(m[1])))), (m[2], _gib(p(int(m[1])).peak_vram_bytes, m[2]))]),
    (r"(\d+) blocks swapped: ([\d.]+) GiB", lambda p, m: [(m[2], _gib(p(int(m[1])).peak_vram_bytes, m[2]))]),
    (r"([\d.]+) GiB VRAM at the\s+peak|peak VRAM ([\d.]+) GiB",
     lambda p, m: [(m[1] or m[2], _gib(p().peak_vram_bytes, m[1] or m[2]))]),
    (r"the denoise ([\d.]+) GiB", lambda p, m: [(m[1], _gib(p.stage("denoise"), m[1]))]),
    (r"([\d.]+)\s+GiB while it encodes", lambda p, m: [(m[1], _gib(p.stage("text_encode"), m[1]))]),
    (r"([\d.]+) GiB while it decodes", lambda p, m: [(m[1], _gib(p.stage("decode"), m[1]))]),
    (r"([\d.]+) GiB of RAM|own RAM:? (?:about )?([\d.]+) GiB",
     lambda p, m: [(m[1] or m[2], _gib(p().peak_ram_bytes, m[1] or m[2]))]),
    (r"(?<![\dx])x(\d\.\d\d)\b", lambda p, m: [(m[1], f"{p().est_slowdown:.2f}")]),
    (r"no predicted slowdown|predicts no slowdown", lambda p, m: [("x1.00", f"x{p().est_slowdown:.2f}")]),
)
# Not the planner's: what a block, a component or a pass's copies weigh as stored, and the machine's budget.
NOT_PLANNED = re.compile(r"[\d.]+ GiB (?:each )?in (?:fp8|bf16|fp16)|[\d.]+ GiB of (?:bf16 weights|PCIe copies)"
                          r"|blocks of [\d.]+ GiB|transformer \([\d.]+ GiB\)|on a \d+ GiB budget")


def _note_figures(path) -> tuple[list[tuple[str, str, str]], str]:
    """(phrase, quoted, planned) for every planner figure the template's note quotes, and the note's
    text with those phrases taken out."""
    text, plans, found = " ".join(_note_texts(path).split()), _Plans(path), []
    for pattern, planned in NOTE_FIGURES:
        for match in re.finditer(pattern, text):
            found += [(match[0], quoted, figure) for quoted, figure in planned(plans, match)]
        text = re.sub(pattern, "#", text)
    return found, text


@by_name(MACHINE_UI)
def test_the_notes_quote_the_planners_figures(path):
    """Every planner figure a machine template's note quotes (peak VRAM, a stage's peak, RAM, slowdown, the
    fewest blocks that fit and what another block count predicts) is the plan's for the template's own
    widgets and machine, so a planner change cannot leave a note promising old numbers; and every other
    GiB figure in the note is a weight size, so no planner figure goes unchecked."""
    found, rest = _note_figures(path)
    assert found, f"{path.stem} quotes no planner figure"
    wrong = [f"'{phrase}': {quoted}, the planner says {planned}" for phrase, quoted, planned in found if quoted != planned]
    assert not wrong, f"{path.stem}:\n" + "\n".join(wrong)
    unchecked = re.findall(r"(?:\S+ ){0,3}[\d.]+ GiB(?: \S+){0,3}", NOT_PLANNED.sub("#", rest))
    assert not unchecked, f"{path.stem}: GiB figures no check binds to the plan: {unchecked}"


@by_name(LTX2_UI)
def test_the_ltx2_notes_say_how_guidance_and_the_decode_differ(path):
    notes = " ".join(_note_texts(path).split())
    assert "Guidance differs from LTX2Pipeline's defaults" in notes and "stg" in notes and "modality" in notes
    assert "LTX-2's decoder is not causal" in notes


def test_every_ltx2_template_is_checked():
    assert len(LTX2_UI) == 4, [p.stem for p in LTX2_UI]


def _note_texts(path) -> str:
    """The text of the template's Note nodes."""
    return "\n".join(str(value) for node in wr.load_json(path)["nodes"] if node["type"] in ("Note", "MarkdownNote")
                     for value in node.get("widgets_values", []))


@by_name(API_FILES)
def test_api_workflow_runs_end_to_end_with_tiny_models(path, models_root, tiny_clips, tmp_path, monkeypatch):
    monkeypatch.setenv("VIDMEM_CACHE_DIR", str(tmp_path / "cache"))  # prompt embeddings, calibrated MagCache ratios
    original = wr.load_json(path)
    api = wr.shrink_for_tiny(original, clips=tiny_clips)
    run = wr.run_api(api)

    variant = wr.tiny_variant_for(next(iter(wr.loader_models(api).values())))
    spec = tiny_spec(variant)
    ids = {node["class_type"]: nid for nid, node in api.items()}
    if wr.FILES_LOADER in ids:  # the loader's own settings took effect on the files
        loaded, inputs = run.outputs[ids[wr.FILES_LOADER]][0], api[ids[wr.FILES_LOADER]]["inputs"]
        assert loaded.on_disk is inputs["weights_on_disk"]
        assert loaded.storage["transformer"] == model_files.storage_named(inputs["model"]), loaded.storage
        assert loaded.storage["text_encoder"] == model_files.storage_named(inputs["text_encoder"]), loaded.storage
    latent = run.outputs[ids["VidMemVideoSampler"]][0]
    assert isinstance(latent, dict) and latent["samples"].ndim == 5
    frames = run.outputs[ids["VidMemVAEDecode"]][0]
    assert frames.shape == (spec.frames, spec.height, spec.width, 3) and frames.dtype == torch.float32
    for save in ("CreateVideo", "SaveAnimatedWEBP"):
        assert run.core_inputs[ids[save]]["images"] is frames, f"{save} gets the Decode's frames"
    strategy_text = run.ui[ids["VidMemMemoryStrategy"]]["text"][0]
    assert f"offload={original[ids['VidMemMemoryStrategy']]['inputs']['offload']}" in strategy_text
    applied = [node["inputs"]["lora_name"] for node in api.values() if node["class_type"] == tiny_loras.LORA_NODE]
    if wr.TRAIN_NODE in ids:  # the trained LoRA was written and the Sampler sampled with it
        pipeline, name = run.outputs[ids[wr.TRAIN_NODE]]
        assert name == api[ids[wr.TRAIN_NODE]]["inputs"]["lora_name"] + ".safetensors"
        from vidmem.nodes import host

        assert (host.loras_folder() / name).is_file() and pipeline.loras[-1].name == name
        applied.append(name)
    sampler_text = run.ui[ids["VidMemVideoSampler"]]["text"][0]
    assert all(name in sampler_text for name in applied), (applied, sampler_text[:800])

    if "VidMemDecodeAudio" in ids:  # LTX-2's sound, into Create Video beside the frames
        audio = run.outputs[ids["VidMemDecodeAudio"]][0]
        assert run.core_inputs[ids["CreateVideo"]]["audio"] is audio
        pipe = run.outputs[ids[wr.FOLDER_LOADER]][0].pipe
        assert pipe.audio_vae is None and pipe.vocoder is None, "the audio parts were freed, not kept on the pipeline"
    assert run.core_inputs, "the graph ends in core save nodes"
    for nid, inputs in run.core_inputs.items():
        assert not wr.core_input_problems(api[nid]["class_type"], inputs), (nid, api[nid]["class_type"])
        if "images" in inputs:
            assert inputs["images"].shape[0] == spec.frames


def test_shrink_keeps_a_partial_block_swap():
    api = wr.shrink_for_tiny(wr.load_json(wr.API_DIR / "wan21_t2v_blockswap.json"), seed=7)
    strategy = next(n for n in api.values() if n["class_type"] == "VidMemMemoryStrategy")["inputs"]
    sampler = next(n for n in api.values() if n["class_type"] == "VidMemVideoSampler")["inputs"]
    layers = tiny_spec("wan2.1-t2v").transformer_config["num_layers"]
    assert strategy["offload"] == "block_swap" and 1 <= strategy["blocks_to_swap"] < layers
    assert sampler["seed"] == 7 and sampler["steps"] == wr.TINY_STEPS


def test_core_input_check_catches_bad_frames():
    bad = torch.zeros(2, 8, 8, 4)
    assert wr.core_input_problems("CreateVideo", {"images": bad, "fps": 8.0})
    assert wr.core_input_problems("SaveVideo", {"video": wr.CoreValue("IMAGE", "x"), "filename_prefix": "a",
                                                "format": "auto", "codec": "auto"})
    assert not wr.core_input_problems("CreateVideo", {"images": torch.rand(2, 8, 8, 3), "fps": 8.0})


TIER_TEMPLATES = {
    "wan21_t2v_1_3b_8gb": "wan2.1-t2v", "wan21_t2v_1_3b_12gb": "wan2.1-t2v", "wan21_t2v_14b_24gb": "wan2.1-t2v",
    "cogvideox_2b_t2v_8gb": "cogvideox-t2v", "wan22_ti2v_5b_12gb": "wan2.2-ti2v",
}


def test_one_template_per_vram_tier_runs_on_its_tiny_stand_in():
    """A 14B or TI2V folder name maps to the matching tiny variant, so every template runs above."""
    names = {p.stem for p in API_FILES}
    assert set(TIER_TEMPLATES) <= names
    for name, variant in TIER_TEMPLATES.items():
        models = set(wr.loader_models(wr.load_json(wr.API_DIR / f"{name}.json")).values())
        assert [wr.tiny_variant_for(m) for m in models] == [variant], name


def test_ti2v_template_keeps_the_models_shape_rules():
    api = wr.load_json(wr.API_DIR / "wan22_ti2v_5b_12gb.json")
    sampler = next(n["inputs"] for n in api.values() if n["class_type"] == "VidMemVideoSampler")
    assert (sampler["width"], sampler["height"], sampler["frames"]) == (1280, 704, 121)
    assert sampler["width"] % 32 == 0 and sampler["height"] % 32 == 0 and (sampler["frames"] - 1) % 4 == 0
    assert wr.loader_models(api) == {"1": "Wan2.2-TI2V-5B-Diffusers"}


def test_tier_templates_differ_mainly_in_their_memory_strategy():
    strategies = {}
    for name in TIER_TEMPLATES:
        api = wr.load_json(wr.API_DIR / f"{name}.json")
        strategies[name] = next(n["inputs"] for n in api.values() if n["class_type"] == "VidMemMemoryStrategy")
    assert strategies["wan21_t2v_1_3b_8gb"]["text_encoder"] == "cpu"
    assert strategies["wan21_t2v_1_3b_12gb"]["text_encoder"] == "offload_after_encoding"
    assert strategies["wan21_t2v_14b_24gb"]["offload"] == "block_swap" and strategies["wan21_t2v_14b_24gb"]["blocks_to_swap"] < 40
    same_model = [strategies["wan21_t2v_1_3b_8gb"], strategies["wan21_t2v_1_3b_12gb"]]
    assert len({json.dumps(s, sort_keys=True) for s in same_model}) == 2, "one model, two tiers, two strategies"


LORA_UI = [p for p in UI_FILES if "loras" in wr.load_json(p)["extra"]["vidmem"]]
TRAIN_UI = [p for p in UI_FILES if "trains" in wr.load_json(p)["extra"]["vidmem"]]
LORA_REPOS = ("Kijai/WanVideo_comfy", "Comfy-Org/Wan_2.2_ComfyUI_Repackaged", "Lightricks/LTX-2-19b-LoRA-Camera-Control-Dolly-In")


def nodes_of(api: dict, class_type: str) -> list[dict]:
    return [node["inputs"] for node in api.values() if node["class_type"] == class_type]


def test_a_lora_template_per_family_with_a_distill_lora_where_one_exists():
    variants = {}
    for path in LORA_UI:
        api = wr.load_json(wr.api_twin(path))
        variants[tiny_loras.loader_variant(api, "3")] = path
    assert set(variants) >= {"wan2.1-t2v", "wan2.2-a14b", "cogvideox-t2v", "ltx2-t2v", "hunyuanvideo1.5-t2v"}, variants
    for variant in ("wan2.1-t2v", "wan2.2-a14b"):  # lightx2v's distill LoRAs: 4 steps, no guidance, flow shift 5
        api = wr.load_json(wr.api_twin(variants[variant]))
        (sampler,) = nodes_of(api, "VidMemVideoSampler")
        assert (sampler["steps"], sampler["cfg"], sampler["scheduler"], sampler["shift"]) == (4, 1.0, "flow_match_euler", 5.0)
        assert sampler.get("cfg_2", -1.0) in (-1.0, 1.0), "no negative pass on either expert"
        assert api["1"]["class_type"] == wr.FILES_LOADER and "fp8" in api["1"]["inputs"]["model"]
    experts = [lora["expert"] for lora in nodes_of(wr.load_json(wr.api_twin(variants["wan2.2-a14b"])), tiny_loras.LORA_NODE)]
    assert experts == ["high_noise", "low_noise"], "one Lightning LoRA per expert"
    cog_note = next(n["widgets_values"][0] for n in wr.load_json(variants["cogvideox-t2v"])["nodes"] if n["type"] == "Note")
    assert "No step-distill LoRA exists for CogVideoX" in cog_note, "the CogVideoX template says why it has a style LoRA"


@by_name(LORA_UI)
def test_lora_template_names_its_files_and_chains_them_into_the_sampler(path):
    ui, api = wr.load_json(path), wr.load_json(wr.api_twin(path))
    listed = ui["extra"]["vidmem"]["loras"]
    loras = nodes_of(api, tiny_loras.LORA_NODE)
    assert [lora["lora_name"] for lora in loras] == [f["name"] for f in listed]
    assert [lora["expert"] for lora in loras] == [f["expert"] for f in listed]
    for file in listed:
        assert "/" not in file["name"] and file["name"].endswith(".safetensors")
        if file["repo"]:  # a download: a known repository, the file's URL
            assert file["repo"] in LORA_REPOS and file["url"].startswith(f"https://huggingface.co/{file['repo']}/resolve/main/")
            assert file["url"].endswith("/" + file["name"])
    chain = {nid: node for nid, node in api.items() if node["class_type"] == tiny_loras.LORA_NODE}
    (sampler,) = nodes_of(api, "VidMemVideoSampler")
    last = sampler["pipeline"][0]
    seen = []
    while last in chain:  # Sampler <- last LoRA <- ... <- loader
        seen.append(last)
        last = chain[last]["inputs"]["pipeline"][0]
    assert api[last]["class_type"] in (wr.FOLDER_LOADER, wr.FILES_LOADER) and len(seen) == len(chain)


def test_a_train_template_per_family():
    variants = {tiny_loras.loader_variant(wr.load_json(wr.api_twin(p)), "3") for p in TRAIN_UI}
    assert variants >= {"wan2.1-t2v", "cogvideox-t2v"}, variants


@by_name(TRAIN_UI)
def test_train_template_trains_then_samples_with_the_lora(path):
    ui, api = wr.load_json(path), wr.load_json(wr.api_twin(path))
    ids = {node["class_type"]: nid for nid, node in api.items()}
    prepare, train, sampler = (api[ids[t]]["inputs"] for t in (wr.PREPARE_NODE, wr.TRAIN_NODE, "VidMemVideoSampler"))
    assert train["data"] == [ids[wr.PREPARE_NODE], 0] and sampler["pipeline"] == [ids[wr.TRAIN_NODE], 0]
    assert prepare["pipeline"] == train["pipeline"] == ["1", 0], "data and LoRA for the loaded model"
    assert train["gradient_checkpointing"] is True and train["lora_name"] == ui["extra"]["vidmem"]["trains"]
    variant = tiny_loras.loader_variant(api, ids["VidMemVideoSampler"])
    step = 8 if variant.startswith("cogvideox") else 4
    assert all((int(f) - 1) % step == 0 for f in prepare["frame_buckets"].split(",")), prepare["frame_buckets"]
    note = next(n["widgets_values"][0] for n in ui["nodes"] if n["type"] == "Note")
    assert prepare["folder"] in note or "FULL path" in note, "the note says what to put in folder"
    assert f"models/loras/{train['lora_name']}.safetensors" in note and "Load LoRA" in note


CACHE_API = [p for p in API_FILES if any(n["class_type"] == wr.STEP_CACHE_NODE for n in wr.load_json(p).values())]


def test_fast_variants_of_wan_1_3b_and_a14b_carry_a_step_cache():
    assert {p.stem for p in CACHE_API} >= {"wan21_t2v_1_3b_files_magcache", "wan22_t2v_a14b_fp8_magcache"}


@by_name(CACHE_API)
def test_a_cached_template_runs_magcache_as_its_ratios_were_published(path):
    """mag_ratios auto at the published step count, retention and K; for A14B a shift that gives each
    expert the steps its ratios were measured over (the boundary timestep splits the schedule)."""
    from diffusers import UniPCMultistepScheduler

    from vidmem.pipelines.configs import load_model
    from vidmem.pipelines.step_cache import layout_key, mag_schedule, published_cache

    api = wr.load_json(path)
    (cache_id, cache), = [(nid, n["inputs"]) for nid, n in api.items() if n["class_type"] == wr.STEP_CACHE_NODE]
    sampler = next(n["inputs"] for n in api.values() if n["class_type"] == "VidMemVideoSampler")
    assert sampler["cache"] == [cache_id, 0]
    assert cache["method"] == "mag_cache" and cache["mag_ratios"] == "auto" and cache["threshold"] == 0.0
    model = load_model(wr.load_json(wr.ui_twin(path))["extra"]["vidmem"]["machine"]["plan_model"])
    denoisers = {name: (c.config["num_layers"], c.config) for name, c in model.components.items() if name.startswith("transformer")}
    published = published_cache(layout_key(model.pipeline_class, denoisers))
    assert published is not None, "no published ratios for this model"
    assert (cache["retention"], cache["max_skip_steps"]) == (published.retention, published.max_skip_steps)
    assert sampler["steps"] == published.ratio_steps
    for name in denoisers:
        assert any(not computed for computed in mag_schedule(published, sampler["steps"], name)), f"{name} skips nothing"
    if published.per_expert:
        boundary = model.pipeline_config["boundary_ratio"]
        scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                            num_train_timesteps=1000, flow_shift=sampler["shift"])
        scheduler.set_timesteps(sampler["steps"])
        high = sum(int(t >= boundary * 1000) for t in scheduler.timesteps)
        assert high == len(published.ratios_for("transformer")), (high, sampler["shift"])


def test_shrink_calibrates_a_step_cache_the_tiny_models_have_no_ratios_for():
    api = wr.shrink_for_tiny(wr.load_json(wr.API_DIR / "wan21_t2v_1_3b_files_magcache.json"))
    cache = next(n for n in api.values() if n["class_type"] == wr.STEP_CACHE_NODE)["inputs"]
    assert cache["method"] == "mag_cache" and cache["mag_ratios"] == "calibrate"


I2V_VARIANTS = {"wan2.2-i2v-a14b", "wan2.1-i2v", "wan2.1-flf2v", "cogvideox-i2v"}


def test_the_sound_template_feeds_decode_audio_into_create_video():
    """Issue 27: LTX-2's sound reaches Save Video through core Create Video's audio input; the video-only
    LTX-2 templates have no Decode Audio (their graphs never load the audio parts)."""
    for name in ("ltx2_t2v_fp8_sound", "ltx2_t2v_fp8_sequential", "ltx2_t2v_fp8_blockswap"):
        api = wr.load_json(wr.API_DIR / f"{name}.json")
        audio = [nid for nid, node in api.items() if node["class_type"] == "VidMemDecodeAudio"]
        (create,) = nodes_of(api, "CreateVideo")
        if name != "ltx2_t2v_fp8_sound":
            assert not audio and "audio" not in create, name
            continue
        (nid,) = audio
        (sampler,) = [i for i, node in api.items() if node["class_type"] == "VidMemVideoSampler"]
        assert create["audio"] == [nid, 0] and create["fps"] == 24.0  # LTX-2's frame rate: the sound's length
        assert api[nid]["inputs"]["latent"] == [sampler, 0]


def test_image_to_video_templates_start_from_core_load_image():
    """Every I2V model has a template; its API twin says _i2v_ (first-last-frame: _flf2v_) in its
    name, and a core Load Image (on example.png, which ships in ComfyUI/input) feeds the Sampler's
    image input; a first-last-frame model's second one feeds last_image."""
    found = set()
    for path in API_FILES:
        api = wr.load_json(path)
        variant = wr.tiny_variant_for(next(iter(wr.loader_models(api).values())))
        spec = tiny_spec(variant)
        if not spec.needs_image:
            continue
        found.add(variant)
        assert ("_flf2v_" if spec.last_image else "_i2v_") in path.stem, path.stem
        images = sorted(nid for nid, node in api.items() if node["class_type"] == "LoadImage")
        sampler = next(node["inputs"] for node in api.values() if node["class_type"] == "VidMemVideoSampler")
        ends = ["image", "last_image"] if spec.last_image else ["image"]
        assert len(images) == len(ends) and [sampler[end] for end in ends] == [[nid, 0] for nid in images], path.stem
        assert all(api[nid]["inputs"] == {"image": "example.png"} for nid in images)
    assert found == I2V_VARIANTS


FAMILY_TEMPLATES = {  # issue 27: an 8 GB and a 24 GB template per family, each planned on its machine
    "hunyuan15_t2v_480p_fp8": "hunyuanvideo1.5-t2v", "hunyuan15_t2v_720p": "hunyuanvideo1.5-t2v",
    "ltx2_t2v_fp8_sequential": "ltx2-t2v", "ltx2_t2v_fp8_blockswap": "ltx2-t2v", "ltx2_t2v_fp8_sound": "ltx2-t2v",
    "hunyuan15_t2v_480p_style_lora": "hunyuanvideo1.5-t2v", "ltx2_t2v_camera_lora": "ltx2-t2v",  # and their LoRA templates
}


@pytest.mark.parametrize("name", sorted(FAMILY_TEMPLATES))
def test_family_templates_keep_the_models_frame_rule_and_grid_and_run_on_their_stand_in(name):
    """Frames k x the VAE's temporal factor + 1, width and height on the VAE x patch grid (what the
    Sampler checks at run time), read from the family's declaration and the real config; the
    folder name maps to the family's tiny stand-in, and the machine is named so the planner test plans it."""
    from vidmem.pipelines.configs import load_model
    from vidmem.pipelines.loader import family_for

    api = wr.load_json(wr.API_DIR / f"{name}.json")
    (sampler,) = nodes_of(api, "VidMemVideoSampler")
    (loader,) = nodes_of(api, wr.FOLDER_LOADER)
    assert wr.tiny_variant_for(loader["model"]) == FAMILY_TEMPLATES[name]
    ui = next(p for p in UI_FILES if wr.api_twin(p).stem == name)
    model = load_model(wr.load_json(ui)["extra"]["vidmem"]["machine"]["plan_model"])
    spec = family_for(model.pipeline_class)
    assert spec.frames_error(sampler["frames"]) is None, spec.frames_error(sampler["frames"])
    vae = model.components["vae"].config
    assert vae["temporal_compression_ratio"] == spec.frame_step
    grid = vae["spatial_compression_ratio"] * model.components["transformer"].config["patch_size"]
    assert sampler["width"] % grid == 0 and sampler["height"] % grid == 0, (sampler["width"], sampler["height"], grid)


def test_a_train_workflow_saved_with_the_old_boolean_activation_offload_still_validates():
    """activation_offload was a BOOLEAN before off/on/auto: ComfyUI skips its list check for a combo the
    node's VALIDATE_INPUTS names, and the node reads true/false as on/off; anything else is refused."""
    from vidmem.nodes.train import VidMemTrainLoRA

    spec = wr.node_spec("VidMemTrainLoRA")
    input_type, config = next((t, c) for name, t, c, _optional in spec.ordered_inputs() if name == "activation_offload")
    assert isinstance(input_type, list) and {"off", "on", "auto"} <= set(input_type)
    for saved in (True, False, "auto"):
        assert wr.value_problem(input_type, config, saved) is None
        assert VidMemTrainLoRA.VALIDATE_INPUTS(activation_offload=saved) is True
    assert "activation_offload" in str(VidMemTrainLoRA.VALIDATE_INPUTS(activation_offload="sometimes"))
