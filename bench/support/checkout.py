"""`import vidmem` gives the checkout a script lives in, installed or not.

The repository root is the `vidmem` package, so a clone imports under that name only once
installed (`pip install -e .`) or through a folder named vidmem on the path; `PYTHONPATH=.` does
not do it. A bench or helper run from a clone (`python bench/planner.py`, `python
tests/workflow_runner.py place-models ...`) calls `use_this_checkout()` first, so it runs that
clone's code even when nothing is installed, or when an editable install points at another clone.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def use_this_checkout() -> None:
    """Register ROOT as the `vidmem` package, unless some `vidmem` is imported already."""
    if "vidmem" in sys.modules:
        return
    spec = importlib.util.spec_from_file_location("vidmem", ROOT / "__init__.py", submodule_search_locations=[str(ROOT)])
    package = importlib.util.module_from_spec(spec)
    sys.modules["vidmem"] = package
    spec.loader.exec_module(package)
