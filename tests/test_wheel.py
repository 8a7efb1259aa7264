"""The built wheel is the package users get from pip: it installs, every module imports from it,
and the `vidmem` command runs without the source tree (configs ship as package data)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The wheel built from this tree and unpacked with pip into a folder of its own."""
    out = tmp_path_factory.mktemp("wheel")
    # Built from a copy: setuptools writes build/ and *.egg-info into the tree it builds.
    source = shutil.copytree(ROOT, out / "source", ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "*.egg-info", "__pycache__", ".venv", "results", "screenshots"))
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "--no-deps", "-w", str(out / "dist"), str(source)], check=True, capture_output=True)
    (wheel,) = (out / "dist").glob("vidmem-*.whl")
    target = out / "site"
    subprocess.run([*pip, "install", "--no-deps", "--target", str(target), str(wheel)], check=True, capture_output=True)
    return wheel, target


def run(target: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(target), "HF_HUB_OFFLINE": "1"}
    return subprocess.run(args, env=env, cwd=target, capture_output=True, text=True, timeout=300)


def test_every_module_imports_from_the_installed_wheel(installed):
    wheel, target = installed
    names = sorted(n[:-3].replace("/", ".").removesuffix(".__init__") for n in zipfile.ZipFile(wheel).namelist()
                   if n.endswith(".py"))
    assert "vidmem.memory.offload" in names and not any(n.startswith(("vidmem.tests", "vidmem.bench")) for n in names)
    code = ("import importlib, sys\n"
            f"for name in {names!r}:\n"
            "    module = importlib.import_module(name)\n"
            f"    assert module.__file__.startswith({str(target)!r}), module.__file__\n"
            "assert 'comfy' not in sys.modules\n")
    result = run(target, sys.executable, "-c", code)
    assert result.returncode == 0, result.stderr


def test_the_console_script_plans_from_shipped_configs(installed):
    _, target = installed
    script = target / "bin" / "vidmem"
    assert run(target, str(script), "--help").returncode == 0
    listed = run(target, str(script), "plan", "--list-models")
    assert listed.returncode == 0, listed.stderr
    assert "wan2.1-t2v-14b" in listed.stdout and "cogvideox-2b" in listed.stdout


def test_the_configs_data_files_ship_in_the_wheel(installed):
    """Every JSON the code reads beside its configs (MagCache's published ratios, measured speed-ups) is in the
    wheel: without them `mag_ratios auto` and the plan's measured speed-ups would silently find nothing."""
    wheel, _ = installed
    shipped = set(zipfile.ZipFile(wheel).namelist())
    for data in sorted((ROOT / "pipelines" / "configs").glob("*.json")):
        assert f"vidmem/pipelines/configs/{data.name}" in shipped, data.name
