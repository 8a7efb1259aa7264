"""offload=auto's Decode plans as the Sampler did: at the shape the Sampler recorded in the latent
(cfg and the context window, which the latent's size does not show), and when nothing fits the
whole run it fits the decode stage alone rather than decoding untiled (review of the decode)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vidmem.memory import MemoryStrategy
from vidmem.memory.plan.stages import VideoShape
from vidmem.memory.plan.types import PlanOptions
from vidmem.memory.units import GiB
from vidmem.nodes import decode as decode_node
from vidmem.nodes import sampler as sampler_node
from vidmem.nodes.strategy import StrategyChoice

# Wan 14B at 1280x720x161, cfg 1, window 81/16: the latent is [1, 16, 41, 90, 160].
SHAPE = VideoShape(1280, 720, 161, cfg=False, window=81, window_overlap=16)
LATENT_SHAPE = (1, 16, 41, 90, 160)


@pytest.fixture
def wan14b(monkeypatch):
    """The shipped Wan 14B config, planned for a CUDA host with the choice's budgets as given."""
    monkeypatch.setenv("VIDMEM_PLAN_CACHE", "0")
    monkeypatch.setattr(StrategyChoice, "budgets", lambda self, device: (int(self.vram_budget_gb * GiB),
                                                                         int(self.ram_budget_gb * GiB)))
    monkeypatch.setattr(decode_node.host, "compute_device", lambda: torch.device("cuda"))
    return SimpleNamespace(folder=None, config_name="wan2.1-t2v-14b", dtype_name="bf16", vae_dtype_name=None,
                           removed=(), storage={}, on_disk=False, class_name="WanPipeline", describe=lambda: "wan 14B")


def latent_from_sampler(class_name="WanPipeline"):
    latent = {"samples": torch.zeros(LATENT_SHAPE), "vidmem": {"family": "wan", "class_name": class_name, "frames": 161}}
    return decode_node.record_plan(latent, SHAPE, PlanOptions())


def test_auto_decode_chooses_what_the_sampler_chose_with_a_window_and_cfg_1(wan14b):
    choice = StrategyChoice(MemoryStrategy(), auto=True, vram_budget_gb=12.0, ram_budget_gb=64.0)
    sampled, _line = sampler_node._strategy_for_run(wan14b, choice, SHAPE, torch.device("cuda"), PlanOptions())
    assert sampled.vae_tiling is not None  # 12 GiB: the Sampler's plan tiles the decode
    decoded = decode_node._strategy_for_decode(wan14b, choice, LATENT_SHAPE, latent_from_sampler())
    assert decoded == sampled


def test_a_latent_without_the_record_fits_the_decode_alone_rather_than_untiled(wan14b):
    """An older latent is planned at its size (cfg on, no window): nothing fits the whole run at
    12 GiB, so the decode stage alone is fitted against the budget instead of running untiled."""
    from vidmem.memory.plan.planner import PlanError
    from vidmem.pipelines.planning import choose_for, plan_strategy

    choice = StrategyChoice(MemoryStrategy(), auto=True, vram_budget_gb=12.0, ram_budget_gb=64.0)
    with pytest.raises(PlanError):  # the premise: at the latent's size alone nothing fits
        choose_for(wan14b, VideoShape(1280, 720, 161), choice.strategy, 12 * GiB, 64 * GiB, device="cuda")
    old = {"samples": torch.zeros(LATENT_SHAPE), "vidmem": {"family": "wan", "class_name": "WanPipeline"}}
    decoded = decode_node._strategy_for_decode(wan14b, choice, LATENT_SHAPE, old)
    assert decoded.vae_tiling is not None
    plan = plan_strategy(wan14b, VideoShape(1280, 720, 161), decoded, 12 * GiB, 64 * GiB, device="cuda")
    assert plan.stage("decode").device_bytes <= 12 * GiB


def test_the_record_is_ignored_for_another_model_class_or_an_edited_latent(wan14b):
    record = latent_from_sampler()["vidmem"]["plan"]
    assert decode_node._recorded_plan(wan14b, _model(wan14b), LATENT_SHAPE, latent_from_sampler("Other")) is None
    assert decode_node._recorded_plan(wan14b, _model(wan14b), (1, 16, 21, 90, 160), latent_from_sampler()) is None
    shape, options = decode_node._recorded_plan(wan14b, _model(wan14b), LATENT_SHAPE, latent_from_sampler())
    assert shape == SHAPE and options == PlanOptions() and record["shape"]["window"] == 81


def test_record_plan_copies_the_latent():
    latent = {"samples": torch.zeros(1), "vidmem": {"family": "wan"}}
    recorded = decode_node.record_plan(latent, SHAPE, PlanOptions())
    assert latent == {"samples": latent["samples"], "vidmem": {"family": "wan"}}
    assert recorded["vidmem"]["family"] == "wan" and recorded["vidmem"]["plan"]["shape"]["cfg"] is False


def test_the_sampler_node_records_its_shape_in_the_latent(tiny_loaded):
    from vidmem.nodes.strategy import VidMemMemoryStrategy

    loaded = tiny_loaded("wan2.1-t2v")
    (choice,) = VidMemMemoryStrategy().build(offload="auto", blocks_to_swap=0, prefetch_blocks=1, max_pinned_ram_gb=-1.0,
                                             non_blocking=True, text_encoder="offload_after_encoding", vae_slicing=False,
                                             vae_tiling=False, tile_size=256, overlap=64, temporal_size=64,
                                             temporal_overlap=8)["result"]
    out = sampler_node.VidMemVideoSampler().sample(loaded, choice, "a cat", "", 32, 32, 9, 1, 1.0, 0)
    (latent,) = out["result"]
    assert latent["vidmem"]["plan"]["shape"] == {"width": 32, "height": 32, "frames": 9, "batch": 1, "cfg": False,
                                                 "window": 0, "window_overlap": 0}
    assert decode_node._recorded_plan(loaded, _model(loaded), latent["samples"].shape, latent)[0].cfg is False


def _model(loaded):
    from vidmem.pipelines.planning import planner_model
    return planner_model(loaded)


def test_auto_decode_chooses_with_the_speed_the_sampler_timed_with(wan14b):
    """With compiled blocks measured on this device the Sampler's auto choice moves (sequential loses the compile),
    and the Decode, re-planning from the latent's record, chooses the same strategy as the Sampler each time."""
    from vidmem.memory.plan.costs import MeasuredSpeed

    wan = SimpleNamespace(**dict(vars(wan14b), config_name="wan2.1-t2v-1.3b"))
    shape, latent_shape = VideoShape(832, 480, 81), (1, 16, 21, 60, 104)
    choice = StrategyChoice(MemoryStrategy(), auto=True, vram_budget_gb=8.0, ram_budget_gb=64.0)
    chosen = []
    for speed in (MeasuredSpeed(), MeasuredSpeed(compiled=0.66)):
        options = PlanOptions(speed=speed)
        sampled, _line = sampler_node._strategy_for_run(wan, choice, shape, torch.device("cuda"), options)
        latent = {"samples": torch.zeros(latent_shape), "vidmem": {"family": "wan", "class_name": "WanPipeline"}}
        decoded = decode_node._strategy_for_decode(wan, choice, latent_shape, decode_node.record_plan(latent, shape, options))
        assert decoded == sampled
        chosen.append(sampled)
    assert chosen[0] != chosen[1]  # the premise: the speed changed the Sampler's choice
