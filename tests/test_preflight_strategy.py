"""A Memory Strategy whose widgets break a rule between inputs (overlap against tile_size, a GPU
listed twice or alone) is refused before the model loads, by the same build() the node runs,
naming the Strategy node and the input; ComfyUI's own min/max checks stay on (review of the decode)."""

from __future__ import annotations

import inspect

import pytest

from vidmem.memory import StrategyError
from vidmem.nodes.preflight import check_before_loading
from vidmem.nodes.strategy import VidMemMemoryStrategy
from vidmem.pipelines.configs import load_model

WIDGETS = dict(offload="model", blocks_to_swap=0, prefetch_blocks=1, max_pinned_ram_gb=-1.0, non_blocking=True,
               text_encoder="device", vae_slicing=False, vae_tiling=True, tile_size=256, overlap=32, temporal_size=64,
               temporal_overlap=8)


def prompt(**strategy):
    return {"1": {"class_type": "VidMemLoadPipeline", "inputs": {}},
            "2": {"class_type": "VidMemMemoryStrategy", "inputs": WIDGETS | strategy},
            "3": {"class_type": "VidMemVideoSampler", "inputs": {"pipeline": ["1", 0], "strategy": ["2", 0],
                                                                "width": 832, "height": 480, "frames": 81}},
            "4": {"class_type": "VidMemVAEDecode", "inputs": {"pipeline": ["1", 0], "latent": ["3", 0]}},
            "5": {"class_type": "SaveAnimatedWEBP", "inputs": {"images": ["4", 0]}}}


def check(graph):
    check_before_loading(graph, "1", lambda: load_model("wan2.1-t2v-14b", "bf16"))


@pytest.mark.parametrize("bad, refusal", [
    (dict(overlap=128), r"overlap=128 must be between 0 and tile_size/4"),
    (dict(temporal_overlap=40), r"temporal_overlap=40 must be between 0 and temporal_size/2"),
    (dict(gpus="0,0"), r"gpus='0,0' lists a GPU twice"),
    (dict(gpus="1"), r"gpus='1' lists one GPU"),
])
def test_a_strategy_build_refuses_is_refused_before_loading(bad, refusal):
    with pytest.raises(StrategyError, match=r"Memory Strategy \(node 2\), checked before loading the model: " + refusal):
        check(prompt(**bad))


def test_good_linked_or_partial_strategy_widgets_pass():
    check(prompt())
    check(prompt(gpus="0,1", vram_budget_gb=8.0, activation_chunks="off"))
    check(prompt(overlap=["9", 0]))  # linked: known only when the Strategy runs
    partial = prompt(overlap=128)
    del partial["2"]["inputs"]["tile_size"]
    check(partial)  # a graph not understood is left to the run


def test_comfyuis_own_range_checks_stay_on_for_the_tiling_inputs():
    """ComfyUI skips its min/max for any input VALIDATE_INPUTS names: the rules between inputs are not checked there."""
    named = set(inspect.signature(VidMemMemoryStrategy.VALIDATE_INPUTS).parameters)
    assert not named & {"overlap", "temporal_size", "temporal_overlap", "gpus"}
