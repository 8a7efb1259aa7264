"""A LoRA file gone since it was applied: the ranks cannot reapply it, said by name before any rank starts."""

from __future__ import annotations

import pytest

from vidmem.pipelines.family import ModelError
from vidmem.pipelines.parallel.source import LoraSource


def test_a_deleted_lora_file_is_named(tmp_path):
    gone = tmp_path / "style.safetensors"
    with pytest.raises(ModelError, match=r"LoRA 'style' was applied from .*style.safetensors, which the ranks cannot "
                                         r"read now.*context_parallel to off"):
        LoraSource.of("style", str(gone), 1.0, "transformer")


def test_a_present_lora_file_is_identified_by_size_and_time(tmp_path):
    present = tmp_path / "style.safetensors"
    present.write_bytes(b"12345")
    assert LoraSource.of("style", str(present), 1.0, "transformer").size == 5
