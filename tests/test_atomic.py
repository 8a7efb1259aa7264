"""Files written whole or not at all, with the mode any new file gets (not mkstemp's private 0600)."""

from __future__ import annotations

import os
import stat

import pytest

from vidmem.pipelines.atomic import atomic_path, write_bytes_atomically


def test_a_finished_file_gets_the_usual_mode(tmp_path):
    target = write_bytes_atomically(tmp_path / "lora.safetensors", b"data")
    plain = tmp_path / "plain"
    plain.write_bytes(b"data")  # created as any file is: 0666 less the umask
    assert stat.S_IMODE(os.stat(target).st_mode) == stat.S_IMODE(os.stat(plain).st_mode)


def test_an_error_leaves_the_target_as_it_was_and_no_partial_file(tmp_path):
    target = tmp_path / "latent.safetensors"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError):
        with atomic_path(target) as temporary:
            temporary.write_bytes(b"half")
            raise RuntimeError("disk full")
    assert target.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["latent.safetensors"]


def test_a_target_held_open_is_named_with_the_fix_and_nothing_is_written(tmp_path, monkeypatch):
    """Windows refuses to replace a file that is open or memory-mapped (a LoRA vidmem has mapped, saved over by
    training): PermissionError from os.replace. Said with the file and the fix; the old file stays whole."""
    from vidmem.pipelines import atomic

    target = tmp_path / "my_lora.safetensors"
    target.write_bytes(b"old")

    def refuse(source, destination):
        raise PermissionError(13, "Access is denied")

    monkeypatch.setattr(atomic.os, "replace", refuse)
    with pytest.raises(atomic.FileInUse, match=r"my_lora\.safetensors could not be replaced: it is open .*"
                                               r"choose another file name; nothing was written") as refused:
        write_bytes_atomically(target, b"new")
    assert isinstance(refused.value, PermissionError) and refused.value.filename == str(target)
    assert target.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["my_lora.safetensors"]
