"""bench/vae_decode.py's LTX-2 and HunyuanVideo 1.5 rows: built from the shipped VAE configs, at
sizes their VAEs accept, with blend bands on their own pixel grid. The decodes themselves are the
bench's job (minutes); this checks the set-up on a tiny stand-in."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import vae_decode  # noqa: E402

NEW = ("ltx2", "hunyuanvideo1.5")


@pytest.mark.parametrize("family", NEW)
def test_the_geometry_is_the_shipped_configs(family):
    from vidmem.pipelines.configs import load_model

    name = {"ltx2": "ltx2-t2v-19b", "hunyuanvideo1.5": "hunyuanvideo1.5-t2v-720p"}[family]
    assert vae_decode.geometry_of(family) == load_model(name).geometry


@pytest.mark.parametrize("family", NEW)
def test_the_default_size_divides_by_the_vae_factor(family):
    height, width = vae_decode.SIZES.get(family, (480, 720))
    factor = vae_decode.geometry_of(family).spatial_factor
    assert height % factor == 0 and width % factor == 0, (family, height, width, factor)


def test_ltx2_is_built_with_the_published_config_not_the_constructor_defaults(monkeypatch):
    """The class defaults say decoder_causal True and derive 64x compression; the config says otherwise."""
    import diffusers

    seen = {}

    class StandIn(torch.nn.Module):
        def __init__(self, **config):
            super().__init__()
            seen.update(config)

    monkeypatch.setattr(diffusers, "AutoencoderKLLTX2Video", StandIn, raising=False)
    assert isinstance(vae_decode.build_vae("ltx2"), StandIn)
    assert seen["decoder_causal"] is False and seen["spatial_compression_ratio"] == 32


def test_blend_bands_use_the_family_grid():
    """At 32x (LTX-2) a 256 px tile is 8 latent pixels; the bands must fall on that grid, not on 8x's."""
    geometry = vae_decode.geometry_of("ltx2")
    shape = (1, geometry.latent_channels, 2, 16, 24)
    band = vae_decode.blend_bands(shape, geometry, vae_decode.OURS)
    assert band.shape == (16 * 32, 24 * 32)
    assert band.any() and not band.all()
    row = band[0].int()
    starts = (torch.diff(row, prepend=torch.zeros(1, dtype=row.dtype)) == 1).nonzero().flatten()
    assert len(starts) >= 2 and all(int(x) % 32 == 0 for x in starts), starts  # latent pixels of 32 px
