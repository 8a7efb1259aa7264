"""`shift` on a model whose scheduler shifts by the resolution (LTX-2: use_dynamic_shifting, mu from
the token count): FlowMatchEuler's set_timesteps then never reads `shift`, so a given one is refused
by name instead of being named in the receipt as applied."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from test_tiers import request_for
from vidmem.memory import MemoryStrategy
from vidmem.pipelines.family import ModelError
from vidmem.pipelines.sample import sample
from vidmem.pipelines.tiny import tiny_spec


def test_the_tiny_ltx2_has_the_real_models_scheduler():
    import json
    from pathlib import Path

    import vidmem.pipelines

    shipped = Path(vidmem.pipelines.__file__).parent / "configs" / "models" / "ltx2-t2v-19b.json"
    real = json.loads(shipped.read_text(encoding="utf-8"))["scheduler"]["config"]
    assert real["use_dynamic_shifting"] and dict(tiny_spec("ltx2-t2v").scheduler_config) == real


@pytest.mark.parametrize("shift", [3.0, 12.0])
def test_a_shift_ltx2_would_ignore_is_refused_by_name(tiny_loaded, shift):
    loaded = tiny_loaded("ltx2-t2v")
    with pytest.raises(ModelError, match=r"shift=.* would be ignored: ltx2's scheduler .*use_dynamic_shifting.*"
                                         r"Set shift to 0"):
        sample(loaded, MemoryStrategy(), replace(request_for("ltx2-t2v", steps=2), shift=shift))


def test_the_receipt_says_ltx2s_shift_depends_on_the_resolution(tiny_loaded):
    result = sample(tiny_loaded("ltx2-t2v"), MemoryStrategy(), request_for("ltx2-t2v", steps=2))
    sampler = result.receipt["sampler"]
    assert "shift=resolution-dependent" in sampler and "shift=1" not in sampler, sampler


@pytest.mark.parametrize("variant", ["hunyuanvideo1.5-t2v", "wan2.1-t2v"])
def test_families_whose_scheduler_reads_shift_still_take_it(tiny_loaded, variant):
    """Neither HunyuanVideo 1.5's FlowMatchEuler nor Wan's UniPC shifts dynamically: shift applies."""
    loaded = tiny_loaded(variant)
    assert not loaded.pipe.scheduler.config.get("use_dynamic_shifting")
    result = sample(loaded, MemoryStrategy(), replace(request_for(variant, steps=2), shift=7.0))
    assert "shift=7 " in result.receipt["sampler"]
    default = sample(loaded, MemoryStrategy(), request_for(variant, steps=2))
    assert not torch.equal(result.latent["samples"], default.latent["samples"])  # read, not only named


def test_one_step_on_ltx2s_scheduler_is_refused_by_name(tiny_loaded):
    """Its shift_terminal stretch divides by the distance the last sigma travels, zero for one step:
    diffusers samples NaN (found when the tiny LTX-2 got the real scheduler config)."""
    loaded = tiny_loaded("ltx2-t2v")
    with pytest.raises(ModelError, match=r"steps=1 is too few .*shift_terminal=0.1: one step gives NaN latents. "
                                         r"Use 2 steps or more"):
        sample(loaded, MemoryStrategy(), request_for("ltx2-t2v", steps=1))
    two = sample(loaded, MemoryStrategy(), request_for("ltx2-t2v", steps=2)).latent
    assert two["samples"].isfinite().all() and two["audio_samples"].isfinite().all()
