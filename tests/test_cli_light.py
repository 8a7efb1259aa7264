"""The `vidmem` command stays light: `vidmem queue` talks to a server and never imports torch
(seconds at every call), and `vidmem --help` neither."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from vidmem.cli import main

PACKAGE_PARENT = str(Path(__import__("vidmem").__file__).parent.parent)  # unresolved: a linked checkout stays linked


def torch_loaded_after(argv: list[str]) -> str:
    code = ("import sys\nfrom vidmem.cli import main\ntry:\n    main(%r)\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules)" % (argv,))
    # the parent of the checkout is where `import vidmem` finds it (the repository root is the package)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), PACKAGE_PARENT) if p)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    return done.stdout.strip().splitlines()[-1]


def test_queue_and_help_do_not_import_torch(tmp_path):
    assert torch_loaded_after(["queue", str(tmp_path / "missing.json"), "--server", "http://127.0.0.1:9"]) == "False"
    assert torch_loaded_after(["--help"]) == "False"


def test_an_unknown_weights_storage_is_refused_naming_the_flag(capsys):
    assert main(["plan", "--model", "wan2.1-t2v-1.3b", "--vram", "8", "--ram", "16", "--weights", "fp4"]) == 2
    err = capsys.readouterr().err
    assert "--weights 'fp4' is not a storage vidmem knows; use one of" in err and "fp8_scaled" in err


def test_a_foreign_import_notice_stays_out_of_the_plan(capsys):
    """bitsandbytes, imported by peft when the planner builds a model, warns on AVX512-BF16 CPUs that an optional
    4-bit kernel package is missing: the first line above a user's plan. The command quiets that notice only."""
    import logging

    notice = logging.getLogger("bitsandbytes.backends.cpu.ops")
    before = notice.level
    try:
        notice.setLevel(logging.NOTSET)
        assert main(["plan", "--list-models"]) == 0
        assert not notice.isEnabledFor(logging.WARNING) and notice.isEnabledFor(logging.ERROR)
        assert logging.getLogger("vidmem").isEnabledFor(logging.WARNING)  # vidmem's own warnings still show
    finally:
        notice.setLevel(before)
    assert "wan2.1-t2v-1.3b" in capsys.readouterr().out
