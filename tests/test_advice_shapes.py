"""When the device is what runs out, the advice offers a shorter video first: a frame count the
model's own frame rule takes (LTX-2 runs 8k+1 frames, Wan 4k+1), never one its shape check refuses."""

from __future__ import annotations

import pytest

from vidmem.memory.plan.advice import _smaller_shapes
from vidmem.memory.plan.stages import VideoShape
from vidmem.pipelines.configs import load_model


@pytest.mark.parametrize("name, shape", [
    ("ltx2-t2v-19b", VideoShape(768, 512, 121)),  # half would be 61, which 8k+1 refuses
    ("wan2.1-t2v-1.3b", VideoShape(832, 480, 81)),
    ("cogvideox-2b", VideoShape(720, 480, 49)),
])
def test_fewer_frames_come_first_at_about_half_and_the_model_takes_them(name, shape):
    model = load_model(name, "bf16")
    first = next(iter(_smaller_shapes(model, shape)))
    assert (first.width, first.height) == (shape.width, shape.height)
    assert shape.frames // 2 - 8 < first.frames <= (shape.frames + 1) // 2
    model.check_shape(first)  # raises if the model's frame rule refuses the count
