"""The web folder: a help page per node that covers every input, the tier table agreeing with the
tier templates, the extension's hygiene (namespaced, official hooks, imports that resolve where
ComfyUI serves it), and the JS unit tests under Node's built-in runner when `node` is installed."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urljoin

import pytest

try:
    from . import workflow_runner as wr
except ImportError:  # tests/ is not a package: pytest put this folder on sys.path
    import workflow_runner as wr

from vidmem.nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

REPO = Path(__file__).resolve().parents[1]
WEB = REPO / "web"
DOCS = WEB / "docs"
EXTENSION = WEB / "js" / "vidmem.js"
FORMAT = WEB / "js" / "vidmem_format.js"
# ComfyUI serves WEB_DIRECTORY at /extensions/<custom node folder>/; the help panel fetches
# /extensions/<folder>/docs/<NodeId>/<locale>.md, then /extensions/<folder>/docs/<NodeId>.md.
SERVED_AT = "/extensions/vidmem/js/vidmem.js"


def node_ids():
    return pytest.mark.parametrize("node_id", sorted(NODE_CLASS_MAPPINGS))


@node_ids()
def test_every_node_has_a_help_page_covering_each_input(node_id):
    page = (DOCS / f"{node_id}.md").read_text()
    assert page.startswith(f"# {NODE_DISPLAY_NAME_MAPPINGS[node_id]}\n")
    inputs = [name for section in NODE_CLASS_MAPPINGS[node_id].INPUT_TYPES().values() for name in section]
    missing = [name for name in inputs if f"`{name}`" not in page]
    assert not missing, f"{node_id}.md does not explain {missing}"
    assert "trade-off" in page


def tier_table() -> dict[str, dict[int, str]]:
    """model row -> {card GB: cell} from the strategy page's 'Which tier for my card' table."""
    page = (DOCS / "VidMemMemoryStrategy.md").read_text()
    section = page.split("## Which tier for my card", 1)[1]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| model")]
    table = {}
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        if len(cells) == 5 and cells[0][:3] in ("Wan", "Cog"):
            table[cells[0].split(" (")[0]] = dict(zip((8, 12, 16, 24), cells[1:]))
    return table


ROW_FOR_MODEL = {
    "Wan2.1-T2V-1.3B-Diffusers": "Wan 2.1 T2V 1.3B",
    "Wan2.1-T2V-14B-Diffusers": "Wan 2.1 T2V 14B",
    "Wan2.2-TI2V-5B-Diffusers": "Wan 2.2 TI2V-5B",
    "CogVideoX-2b": "CogVideoX-2b",
}
TIER_TEMPLATES = {"cogvideox_t2v": 12}  # the CogVideoX-2b template that predates the tier names


def tier_of(name: str) -> int | None:
    match = re.search(r"_(\d+)gb$", name)
    return int(match.group(1)) if match else TIER_TEMPLATES.get(name)


def test_tier_table_covers_every_model_and_card():
    table = tier_table()
    assert set(table) >= {"Wan 2.1 T2V 1.3B", "Wan 2.1 T2V 14B", "CogVideoX-2b", "CogVideoX-5b", "Wan 2.2 TI2V-5B"}
    assert all(set(cells) == {8, 12, 16, 24} for cells in table.values())


def folder_template(path) -> bool:
    """A template of the table's models: a diffusers folder (the files templates state their own machine)."""
    return any(n["class_type"] == "VidMemLoadPipeline" for n in wr.load_json(path).values())


@pytest.mark.parametrize("path", [p for p in wr.api_files() if tier_of(p.stem) and folder_template(p)],
                         ids=lambda p: p.stem)
def test_tier_templates_use_the_tables_choice(path):
    api = wr.load_json(path)
    model = next(n["inputs"]["model"] for n in api.values() if n["class_type"] == "VidMemLoadPipeline")
    strategy = next(n["inputs"] for n in api.values() if n["class_type"] == "VidMemMemoryStrategy")
    cell = tier_table()[ROW_FOR_MODEL[model]][tier_of(path.stem)]
    offload = strategy["offload"] + (f" {strategy['blocks_to_swap']}" if strategy["offload"] == "block_swap" else "")
    assert cell.startswith(f"`{offload}`, TE `{strategy['text_encoder']}`"), (path.stem, cell)
    ui_note = next(n["widgets_values"][0] for n in wr.load_json(wr.ui_twin(path))["nodes"] if n["type"] == "Note")
    assert f"{tier_of(path.stem)} GB card" in ui_note


def test_strategy_help_names_only_inputs_choices_commands_and_templates_that_exist():
    """Every `name` the Memory Strategy page promises is real: an input of the node or of the Sampler
    and Load Pipeline it plans with, a choice of an input, a `vidmem` command (it points to
    `vidmem plan`), an API workflow, or the torch device the plan is built on."""
    from vidmem.cli import main

    strategy, sampler = NODE_CLASS_MAPPINGS["VidMemMemoryStrategy"], NODE_CLASS_MAPPINGS["VidMemVideoSampler"]
    inputs = {**_inputs(strategy), **_inputs(sampler), **_inputs(NODE_CLASS_MAPPINGS["VidMemLoadPipeline"])}
    choices = {c for spec in _inputs(strategy).values() if isinstance(spec[0], (list, tuple)) for c in spec[0]}
    templates = {path.stem for path in (REPO / "workflows" / "api").glob("*.json")}
    page = (DOCS / "VidMemMemoryStrategy.md").read_text()
    names = set(re.findall(r"`([^`]+)`", page))
    assert "vidmem plan" in names
    unknown = []
    for name in sorted(names):
        word = name.split(" ")[0] if re.fullmatch(r"\w+ \d+", name) else name  # `block_swap 39`: a choice and a count
        if name.startswith("vidmem "):
            with pytest.raises(SystemExit) as exit_code:
                main([name.split(" ")[1], "--help"])
            if exit_code.value.code != 0:
                unknown.append(name)
        elif not (word in inputs or word in choices or word in templates or word == "meta"
                  or (word.endswith("/") and (REPO / word).is_dir())):
            unknown.append(name)
    assert not unknown, f"VidMemMemoryStrategy.md names {unknown}, which the nodes, the CLI and workflows/ do not have"


def _inputs(node) -> dict:
    return {name: spec for section in node.INPUT_TYPES().values() for name, spec in section.items()}


def js(path: Path) -> str:
    return re.sub(r"//[^\n]*", "", path.read_text())  # code without comments


def test_extension_imports_resolve_where_comfyui_serves_them():
    code = js(EXTENSION)
    imports = dict((name, target) for name, target in re.findall(r'import \{ (\w+) \} from "([^"]+)"', code))
    assert urljoin(SERVED_AT, imports["app"]) == "/scripts/app.js"
    assert urljoin(SERVED_AT, imports["api"]) == "/scripts/api.js"
    assert urljoin(SERVED_AT, "./vidmem_format.js") == "/extensions/vidmem/js/vidmem_format.js"
    assert "from \"./vidmem_format.js\"" in code


def test_extension_is_namespaced_and_uses_official_hooks_only():
    code = js(EXTENSION)
    assert re.findall(r'registerExtension\(\{\s*name: "([^"]+)"', code) == ["vidmem.ui"]
    assert code.count("app.registerExtension(") == 1
    patched = re.findall(r"\.prototype\.(\w+)\s*=", code)
    assert patched == ["onExecuted"], "only the documented onExecuted chaining touches a prototype"
    assert "onExecuted?.apply(this, arguments)" in code, "the previous onExecuted is chained, not replaced"
    assert re.findall(r'"(/[a-z/]+)"', js(FORMAT)) == ["/vidmem/memory", "/vidmem/plan"]
    ids = re.findall(r'const \w+_(?:SETTING|COMMAND) = "([^"]+)"', code)
    assert ids == ["VidMem.Meter.IntervalSeconds", "vidmem.freeVram"], "setting and command ids are namespaced"
    assert re.findall(r'fetchApi\("(/\w+)"', code) == ["/free"]
    assert "window.comfyAPI" not in code and "LiteGraph" not in code


def test_the_format_module_is_pure():
    code = js(FORMAT)
    assert not re.search(r"\b(document|window|fetch|app|api)\b\s*[.(]", code)
    assert "import " not in code


@pytest.mark.skipif(shutil.which("node") is None, reason="Node.js is not installed")
def test_js_unit_tests_pass_under_node():
    result = subprocess.run(["node", "--test", "tests/js/"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


@pytest.mark.skipif(shutil.which("node") is None, reason="Node.js is not installed")
def test_the_extension_parses(tmp_path):
    """vidmem.js imports ComfyUI's own scripts, so Node cannot load it; it can still parse it as a module
    (a syntax error would otherwise show only in a browser, where the whole extension fails to load)."""
    module = tmp_path / "vidmem.mjs"
    module.write_text(EXTENSION.read_text())
    result = subprocess.run(["node", "--check", str(module)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
