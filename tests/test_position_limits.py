"""Sizes beyond a denoiser's positional table are refused by name before anything moves (pipelines/family.py
`positions_error`): Wan's rope_max_seq_len rows, and CogVideoX 1.5's rotary table, which diffusers slices at
sample_height x sample_width latent pixels and cannot grow (beyond it a run failed mid-way with a bare tensor
size mismatch inside get_3d_rotary_pos_embed). CogVideoX 1.0 crops its grid to any size."""

from __future__ import annotations

from dataclasses import replace

import pytest

from test_tiers import request_for
from vidmem.pipelines.configs import load_model
from vidmem.pipelines.family import ModelError, first_denoiser, positions_error
from vidmem.pipelines.sample import sample
from vidmem.pipelines.sample_checks import validate_request
from vidmem.memory import MemoryStrategy


def test_cogvideox_15_refuses_a_width_beyond_its_rotary_table_before_the_run(tiny_loaded):
    loaded = tiny_loaded("cogvideox1.5-t2v")  # sample_width 4 latent px, patches of 2: 2 patches of 16 px
    request = replace(request_for("cogvideox1.5-t2v"), width=64)
    with pytest.raises(ModelError, match=r"width=64 is more than .* can place: its positional embedding covers 2 "
                                         r"patches of 16 px \(32 px\); use width 32 or less"):
        validate_request(loaded, request)
    with pytest.raises(ModelError, match="width=64 is more than"):  # the Sampler's own path, before any weight moves
        sample(loaded, MemoryStrategy(offload="none"), request)


def test_cogvideox_10_crops_its_grid_so_any_size_is_placed(tiny_loaded):
    loaded = tiny_loaded("cogvideox-t2v")
    config = first_denoiser(loaded.pipe).config
    assert positions_error(loaded.spec, config, 8, 4, "tiny", 1024, 1024, 9) is None


def test_the_planner_refuses_cogvideox_15_beyond_2400_px_and_places_up_to_it():
    model = load_model("cogvideox1.5-5b")  # the shipped config: sample 300 x 300 latent px, patches of 2
    config = model.components["transformer"].config
    assert positions_error(model.spec, config, 8, 4, model.name, 2400, 2400, 81) is None
    problem = positions_error(model.spec, config, 8, 4, model.name, 1360, 2416, 81)
    assert problem == ("height=2416 is more than cogvideox1.5-5b can place: its positional embedding covers 150 patches "
                       "of 16 px (2400 px); use height 2400 or less.")
