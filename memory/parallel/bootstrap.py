"""The first code a spawned rank runs (through `runpy.run_path`): make the pack importable, then serve.

Why not start `rank_main` directly: inside ComfyUI the pack is imported under a module name made
from its folder's path, which a fresh process cannot import by name, and its root `__init__`
registers nodes, which imports `comfy.model_management`, which initialises CUDA. So this file
uses the standard library only until it has (1) restricted CUDA to the rank's GPU, and (2) put
an empty package module under the coordinator's name for the pack's folder, so every module
(and every pickled job) resolves by the same name as in the coordinator, and the root
`__init__` never runs here.

Globals given by the pool: PACKAGE, ROOT, RANK, GPU (str or None), SETUP (pickled RankSetup),
JOBS, EVENTS, STOP.
"""

import importlib
import os
import pickle
import sys
import types

if GPU is not None:  # noqa: F821 - given by the pool
    os.environ["CUDA_VISIBLE_DEVICES"] = GPU  # noqa: F821
if PACKAGE not in sys.modules:  # noqa: F821
    package = types.ModuleType(PACKAGE)  # noqa: F821
    package.__path__ = [ROOT]  # noqa: F821
    package.__file__ = os.path.join(ROOT, "__init__.py")  # noqa: F821
    package.__package__ = PACKAGE  # noqa: F821
    sys.modules[PACKAGE] = package  # noqa: F821
rank = importlib.import_module(PACKAGE + ".memory.parallel.rank")  # noqa: F821
rank.rank_main(RANK, pickle.loads(SETUP), JOBS, EVENTS, STOP)  # noqa: F821
