"""The wheel carries every package of the source tree: pyproject.toml lists them by hand."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTSIDE_THE_WHEEL = {"tests", "bench", "workflows", "web", "docs", "build", "dist"}


def test_every_source_package_is_listed_in_pyproject():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {"vidmem"}
    for init in ROOT.rglob("__init__.py"):
        parts = init.parent.relative_to(ROOT).parts
        if parts and parts[0] not in OUTSIDE_THE_WHEEL and not any(p.startswith(".") or p.endswith(".egg-info") for p in parts):
            found.add(".".join(("vidmem", *parts)))
    assert found == listed
