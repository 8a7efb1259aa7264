"""`vidmem` console script.

`vidmem demo --out DIR` runs the node code path end to end on a small model it builds itself
(no downloads, no ComfyUI) and writes a video and its receipt; `vidmem queue` runs an
API-format workflow on a ComfyUI server; `vidmem plan` predicts, before any run, the peak
VRAM and RAM of every strategy for a model and shape, and recommends the fastest that fits."""

from __future__ import annotations

import argparse
import logging
import sys

from .demo import add_demo_parser, run_demo
from .plan import add_plan_parser, in_flag_spelling, run_plan
from .queue import add_queue_parser, run_queue  # standard library only: cheap to import


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vidmem", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    add_demo_parser(commands).set_defaults(run=run_demo)
    add_queue_parser(commands).set_defaults(run=run_queue)
    add_plan_parser(commands).set_defaults(run=run_plan)
    args = parser.parse_args(argv)
    quiet_foreign_notices()
    try:
        return args.run(args)
    except ValueError as error:  # bad input: one clear line, no traceback
        print(f"vidmem: {in_flag_spelling(str(error))}", file=sys.stderr)
        return 2


# Warnings other packages print on import that concern nothing the command does. bitsandbytes (which peft
# imports, and diffusers imports peft while `vidmem plan` builds a model on meta) tells every CPU with AVX512-BF16
# that an optional 4-bit kernel package is missing: the first line a user read above their plan.
FOREIGN_NOTICES = ("bitsandbytes.backends.cpu.ops",)


def quiet_foreign_notices() -> None:
    for name in FOREIGN_NOTICES:
        logging.getLogger(name).setLevel(logging.ERROR)
