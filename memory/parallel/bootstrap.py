"""The first code a spawned rank runs (through `runpy.run_path`): make the pack importable, then serve.

Why not start `rank_main` directly: inside ComfyUI the pack is imported under a module name made
from its folder's path, which a fresh process cannot import by name, and its root `__init__`
registers nodes, which imports `comfy.model_management`, which initialises CUDA. So this file
uses the standard library only until it has (1) restricted CUDA to the rank's GPU, and (2) put
an empty package module under the coordinator's name for the pack's folder, so every module
(and every pickled job) resolves by the same name as in the coordinator, and the root
`__init__` never runs here.

Run as `runpy.run_path(this file, init_globals=..., run_name=RUN_NAME)`; the pool gives the
globals PACKAGE, ROOT, RANK, GPU (str or None), SETUP (pickled RankSetup), JOBS, EVENTS, STOP.
Imported as a module (the wheel test imports every module) it does nothing.
"""

import importlib
import os
import pickle
import sys
import types

RUN_NAME = "__vidmem_rank__"


def serve(package_name: str, root: str, rank: int, gpu: str | None, setup: bytes, jobs, events, stop) -> None:
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    if package_name not in sys.modules:
        package = types.ModuleType(package_name)
        package.__path__ = [root]
        package.__file__ = os.path.join(root, "__init__.py")
        package.__package__ = package_name
        sys.modules[package_name] = package
    module = importlib.import_module(package_name + ".memory.parallel.rank")
    module.rank_main(rank, pickle.loads(setup), jobs, events, stop)


if __name__ == RUN_NAME:
    serve(PACKAGE, ROOT, RANK, GPU, SETUP, JOBS, EVENTS, STOP)  # noqa: F821 - given by the pool
