"""README.md is a user's page: what it tells a newcomer to run, download and expect is checked against
the code, the templates and the docs it points to, so a change there cannot leave the README behind.
How the engine works (and every measured figure) belongs in docs/; what moved there must still be there."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

try:
    from . import workflow_runner as wr
except ImportError:  # tests/ is not a package: pytest put this folder on sys.path
    import workflow_runner as wr

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
FLAT = " ".join(README.split())  # the text with its line breaks folded, for phrases that wrap
# The families' names as users read them (pipelines/loader.py FAMILIES), and a shipped model of each.
FAMILY_NAMES = {"cogvideox": "CogVideoX", "wan": "Wan", "hunyuanvideo1.5": "HunyuanVideo 1.5", "ltx2": "LTX-2"}
FAMILY_MODELS = {"cogvideox": "cogvideox-2b", "wan": "wan2.1-t2v-1.3b", "hunyuanvideo1.5": "hunyuanvideo1.5-t2v-480p",
                 "ltx2": "ltx2-t2v-19b"}


def _fenced_blocks(text: str) -> list[list[str]]:
    blocks, current = [], None
    for line in text.splitlines():
        if line.startswith("```"):
            if current is None:
                current = []
            else:
                blocks.append(current)
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def _section(heading: str) -> str:
    start = README.index(f"\n## {heading}") + 1
    end = README.find("\n## ", start)
    return README[start:] if end < 0 else README[start:end]


def _node_row(node_id: str) -> str:
    return next(line for line in README.splitlines() if line.startswith("|") and f"`{node_id}`" in line)


def _api_nodes() -> list[dict]:
    return [node for path in wr.api_files() for node in json.loads(path.read_text()).values()]


def test_the_two_set_up_lines_come_first_with_the_clone_and_venv_right_under_them():
    first = _fenced_blocks(README)[0]
    assert first[0].endswith("  # main job") and first[1].endswith("  # tests"), first
    under = " ".join(README.split("```", 2)[2].split("\n\n", 2)[1].split())
    assert "git clone" in under and "venv" in under and "activate" in under, under
    # .ci/run: sed -n 's/^\(.*\)  *# tests$/\1/p' README.md | head -n 1
    found = next(m[1] for line in README.splitlines() if (m := re.fullmatch(r"(.*?) +# tests", line)))
    assert found == first[1].rsplit("  # tests", 1)[0] and "pytest" in found


def test_the_windows_portable_install_runs_its_own_python_from_custom_nodes():
    assert r"..\..\python_embeded\python.exe -m pip install -r vidmem\requirements.txt" in README
    assert r"ComfyUI\custom_nodes" in README


def test_the_install_names_the_comfyui_verified_and_the_core_nodes_the_templates_save():
    install = " ".join(_section("Install in ComfyUI").split())
    assert "Verified with ComfyUI 0.8.0" in install
    core = {node["class_type"] for node in _api_nodes() if not node["class_type"].startswith("VidMem")}
    missing = [wr.node_spec(name).display for name in sorted(core) if wr.node_spec(name).display not in install]
    assert core and not missing, f"core nodes the templates use that the install section does not name: {missing}"


def test_the_install_names_the_diffusers_hunyuanvideo_and_ltx2_need():
    import diffusers
    from packaging.version import Version

    install = " ".join(_section("Install in ComfyUI").split())
    named = re.search(r"HunyuanVideo 1\.5 needs diffusers ([\d.]+) or newer and\s+LTX-2 ([\d.]+) or newer", install)
    assert named, "the install section no longer says which diffusers HunyuanVideo 1.5 and LTX-2 need"
    floor = re.search(r"diffusers>=([\d.]+)", (ROOT / "requirements.txt").read_text())[1]
    assert all(Version(floor) < Version(v) <= Version(diffusers.__version__) for v in named.groups()), (floor, named.groups())
    assert hasattr(diffusers, "HunyuanVideo15Pipeline") and hasattr(diffusers, "LTX2Pipeline")


def test_every_folder_a_template_loads_is_a_repository_the_readme_names_by_that_name():
    """The templates pick their diffusers folder by exact name: the README names a repository for each,
    and says to name the folder after it."""
    folders = {node["inputs"]["model"] for node in _api_nodes() if node["class_type"] == wr.FOLDER_LOADER}
    repositories = set(re.findall(r"`[\w.-]+/([\w.-]+)`", README))
    assert folders and not folders - repositories, f"no repository named for {sorted(folders - repositories)}"
    assert "name the folder after the repository, as the templates expect" in FLAT


def test_the_decode_row_says_which_families_decode_their_time_chunks_exactly():
    """Exact where the family's VAE streams its caches across chunks (vae_stream_batch), blended where
    each chunk is decoded on its own (LTX-2: docs/decode.md)."""
    from vidmem.pipelines.configs import load_model

    row = _node_row("VidMemVAEDecode")
    exact = re.search(r"exact for ([^(]+?) \(", row)[1]
    blended = re.search(r"blended for ([\w .-]+?) \(", row)[1]
    for family, model in FAMILY_MODELS.items():
        streams = load_model(model).vae_stream_batch is not None
        assert (FAMILY_NAMES[family] in exact, FAMILY_NAMES[family] in blended) == (streams, not streams), family
    assert "`temporal_size`" in row and "docs/decode.md" in row


def test_the_troubleshooting_names_the_chunk_rungs_after_sequential():
    from vidmem.memory.plan.candidates import CHUNK_STEPS

    steps = ", ".join(str(n) for n in CHUNK_STEPS[1:-1])
    assert f"after `sequential` come activation-chunk rungs (sequential with {steps}, then {CHUNK_STEPS[-1]} chunks" in FLAT
    assert "under `sequential` it stops" not in FLAT


def test_the_sampler_row_names_every_optional_input_and_long_videos_are_linked():
    from vidmem.nodes.sampler import VidMemVideoSampler

    row = _node_row("VidMemVideoSampler")
    optional = VidMemVideoSampler.INPUT_TYPES()["optional"]
    assert not [name for name in optional if f"`{name}`" not in row], row
    assert "docs/long-video.md" in row


def test_every_docs_page_is_linked_from_the_readme():
    pages = sorted(path.relative_to(ROOT).as_posix() for path in (ROOT / "docs").glob("*.md"))
    assert not [page for page in pages if f"]({page}" not in README]


def test_the_plan_section_says_which_allocator_the_node_and_the_command_plan_for():
    from vidmem.cli.plan import add_plan_parser

    commands = argparse.ArgumentParser().add_subparsers()
    allocator = next(a for a in add_plan_parser(commands)._actions if a.dest == "allocator")
    assert "cudaMallocAsync" in allocator.choices and allocator.default is None  # native unless told
    plan = " ".join(_section("Predict before you run").split())
    assert "`--allocator cudaMallocAsync`" in plan and "native caching allocator" in plan
    assert "draws the same table" not in plan


def test_the_engine_section_says_where_weights_end_and_what_a_seed_fixes():
    engine = " ".join(_section("How the memory engine works").split())
    assert "back on the storage it started on." not in engine
    assert "that copy becomes their home" in engine and "docs/block-swap.md" in engine
    assert "the same starting noise on any device" in engine and "same video on any device" not in engine


TEMPLATE_ROW = re.compile(r"^\| [^|]+ \| `(\w+)` \|([^|]*)\|$", re.M)


def test_the_template_table_quotes_each_templates_blocks_to_swap():
    rows = {name: text for name, text in TEMPLATE_ROW.findall(_section("Templates")) if "block swap" in text}
    assert len(rows) >= 10
    for name, text in rows.items():
        strategy = next(n["inputs"] for n in json.loads((ROOT / "workflows" / "api" / f"{name}.json").read_text()).values()
                        if n["class_type"] == "VidMemMemoryStrategy")
        assert int(re.search(r"block swap (\d+)", text)[1]) == strategy["blocks_to_swap"], name


def test_the_package_description_names_every_family():
    from vidmem.pipelines.loader import FAMILIES

    description = re.search(r'^description = "(.*)"$', (ROOT / "pyproject.toml").read_text(), re.M)[1]
    assert {spec.name for spec in FAMILIES} == set(FAMILY_NAMES)
    assert not [name for name in FAMILY_NAMES.values() if name not in description], description


# Internals the README used to explain, each with the docs page that explains it now.
MOVED = {"MKL_CBWR": "docs/verification.md", "template_cards.mjs": "docs/layout.md", "PSNR": "docs/speed.md",
         "audio_vae/config.json": "docs/storage.md", "17 of 18": "docs/verification.md",
         "70% zoom (10 px text": "docs/planner.md"}


@pytest.mark.parametrize("phrase, page", MOVED.items())
def test_engine_internals_live_in_docs_not_in_the_readme(phrase, page):
    assert phrase not in FLAT
    assert phrase in " ".join((ROOT / page).read_text().split())


def test_the_verified_section_is_a_short_summary_that_links_the_details():
    section = _section("What was verified, on which hardware")
    assert len(section.splitlines()) <= 14, "keep the lease-by-lease log in docs/verification.md"
    assert "docs/gpu.md" in section and "docs/verification.md" in section
