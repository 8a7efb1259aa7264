"""The `vidmem plan` examples in README.md and docs/planner.md quote the command's real output: every
line quoted under a `$ vidmem plan ...` line is a line that command prints today, so a planner change
that moves a figure cannot leave the docs showing old tables ("..." marks lines left out)."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/planner.md")


def quoted_examples(text: str) -> list[tuple[str, list[str]]]:
    """(command, the lines quoted under it) for each `$ vidmem plan` line inside a fenced block."""
    examples, fenced, current = [], False, None
    for line in text.splitlines():
        if line.startswith("```"):
            fenced, current = not fenced, None
        elif fenced and line.startswith("$ vidmem plan "):
            current = (line[2:], [])
            examples.append(current)
        elif fenced and current is not None and line.strip() not in ("", "..."):
            current[1].append(line.rstrip())
    return examples


EXAMPLES = [(doc, command, lines) for doc in DOCS for command, lines in quoted_examples((ROOT / doc).read_text())]


def test_the_docs_quote_plan_examples():
    assert {doc for doc, _command, _lines in EXAMPLES} == set(DOCS)
    assert all(lines for _doc, _command, lines in EXAMPLES)


@pytest.mark.parametrize("doc, command, lines", EXAMPLES, ids=[f"{doc}:{command.split('--model ')[1].split()[0]}"
                                                               for doc, command, _lines in EXAMPLES])
def test_each_quoted_line_is_what_the_command_prints_today(doc, command, lines, tmp_path):
    # A fresh process, as a reader runs it: plans made earlier in this process can move a figure
    # (a plan at --frames 1 lowers a later 81-frame plan's decode peak by 0.1 GiB).
    run = subprocess.run([sys.executable, "-m", "vidmem.cli", *shlex.split(command)[1:]], cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode in (0, 1), run.stderr
    printed = {line.rstrip() for line in run.stdout.splitlines()}
    stale = [line for line in lines if line not in printed]
    assert not stale, f"{doc}: lines `{command}` no longer prints:\n" + "\n".join(stale)
