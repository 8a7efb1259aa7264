"""Balanced placement: the choice on made-up devices, and the run on CPU devices."""

from __future__ import annotations

import pytest
import torch

from vidmem.memory import MemoryStrategy
from vidmem.memory.units import GiB
from vidmem.pipelines.family import ModelError
from vidmem.pipelines.parallel import DeviceRoom, Placement, balanced_placement, component_bytes, sample_balanced
from vidmem.pipelines.sample import SampleRequest, sample

WAN14B = {"transformer": 28 * GiB, "text_encoder": 11 * GiB}
A14B = {"transformer": 28 * GiB, "transformer_2": 28 * GiB, "text_encoder": 11 * GiB}


@pytest.mark.parametrize("sizes, rooms, offload, expected", [
    (WAN14B, [DeviceRoom("cuda:1", 40 * GiB), DeviceRoom("cuda:0", 24 * GiB)], "none", Placement("cuda:1", "cuda:0")),
    (WAN14B, [DeviceRoom("a", 80 * GiB), DeviceRoom("b", 12 * GiB), DeviceRoom("c", 16 * GiB)], "none",
     Placement("a", "b")),
    (A14B, [DeviceRoom("a", 30 * GiB), DeviceRoom("b", 80 * GiB)], "model", Placement("a", "b")),  # one expert at a time
    (A14B, [DeviceRoom("a", 8 * GiB), DeviceRoom("b", 12 * GiB)], "block_swap", Placement("a", "b")),  # streamed
])
def test_transformers_go_to_the_first_listed_gpu_and_the_encoder_to_the_second(sizes, rooms, offload, expected):
    """As the planner plans it (memory.plan.parallel_layout: GPU 0 and GPU 1), whatever the GPUs hold."""
    assert balanced_placement(sizes, rooms, offload) == expected


@pytest.mark.parametrize("sizes, rooms, offload, message", [
    (WAN14B, [DeviceRoom("a", 80 * GiB)], "none", "needs two or more GPUs"),
    (A14B, [DeviceRoom("a", 48 * GiB), DeviceRoom("b", 80 * GiB)], "none",
     "offload=none the transformers need 56.0 GiB on the first listed GPU .*block_swap"),
    (A14B, [DeviceRoom("a", 24 * GiB), DeviceRoom("b", 80 * GiB)], "model", "offload=model the transformers need 28.0"),
    (WAN14B, [DeviceRoom("a", 40 * GiB), DeviceRoom("b", 8 * GiB)], "none", "text encoder needs 11.0 GiB on the second"),
])
def test_what_cannot_be_placed_is_named(sizes, rooms, offload, message):
    with pytest.raises(ModelError, match=message):
        balanced_placement(sizes, rooms, offload)


def test_component_bytes_count_weights(tiny_loaded):
    sizes = component_bytes(tiny_loaded("wan2.2-a14b").pipe)
    assert set(sizes) == {"transformer", "transformer_2", "text_encoder"}
    assert sizes["transformer"] == sizes["transformer_2"] > 0


def test_a_balanced_run_gives_the_frames_of_a_plain_run_and_restores_the_encoder(tiny_loaded):
    loaded = tiny_loaded("wan2.1-t2v")
    encoder = loaded.pipe.text_encoder
    request = SampleRequest("a cat", "a dog", 32, 32, 9, steps=2, cfg=5.0, seed=1)
    strategy = MemoryStrategy(offload="none")
    plain = sample(loaded, strategy, request, device=torch.device("cpu")).latent["samples"]
    calls = []
    hook = encoder.register_forward_pre_hook(lambda module, args, kwargs: calls.append(1), with_kwargs=True)
    try:
        result = sample_balanced(loaded, strategy, request, Placement("cpu", "cpu"))
    finally:
        hook.remove()
    assert result.latent["samples"].equal(plain)
    assert calls, "the placed encoder ran"
    assert result.receipt["placement"] == "balanced: transformers on cpu, text encoder on cpu"
    assert "text_encoder=offload_after_encoding" in result.receipt["strategy"]  # the user's, not the call's
    assert len(encoder._forward_pre_hooks) == 0


def test_the_encoder_goes_back_to_its_own_weights_not_a_copy():
    """Restored by pointing every tensor back at what it held (memory-mapped weights stay mapped):
    placed on `meta`, a `.to(home)` could not even come back; the pointers must be the same ones."""
    from types import SimpleNamespace

    from vidmem.pipelines.parallel.balanced import placed_encoder

    encoder = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    before = [t.data_ptr() for t in (*encoder.parameters(), *encoder.buffers())]
    with placed_encoder(SimpleNamespace(text_encoder=encoder), torch.device("meta")):
        assert all(t.is_meta for t in (*encoder.parameters(), *encoder.buffers()))
    assert [t.data_ptr() for t in (*encoder.parameters(), *encoder.buffers())] == before
    assert not any(t.is_meta for t in encoder.parameters())
