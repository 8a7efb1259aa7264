"""The run-time free figures against the plan (review s-r35).

`free_device_bytes` and `budgeted_free_bytes` give the bytes left for new allocations, the CUDA context already
made; a planned footprint includes CUDA_CONTEXT_BYTES. The out-of-memory ladder's fit check and
activation_chunks=auto add the context back (`device_room_for_plan`), so a strategy within 512 MiB of the budget
fits and auto runs the plan's slice count.

With a vram_budget_gb, the Decode gives back what the Sampler's warm store kept (the transformer under tiers none
and model) where the decode's room lacks it within the budget: the planner's decode phase holds only the VAE and the
latent, and on a card larger than the budget ComfyUI evicts nothing. CUDA's figures are faked (tests/cuda_fake.py).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from cuda_fake import FakeCuda
from test_tiers import request_for
from vidmem.memory import MemoryStrategy
from vidmem.memory.accounting import Attention
from vidmem.memory.device import CudaBackend
from vidmem.memory.plan.candidates import fewest_chunks
from vidmem.memory.plan.costs import CUDA_CONTEXT_BYTES
from vidmem.memory.plan.stages import denoise_stage
from vidmem.memory.plan.types import PlanOptions, VideoShape
from vidmem.memory.telemetry import budgeted_free_bytes, free_device_bytes
from vidmem.memory.units import GiB, MiB
from vidmem.pipelines import decode as decode_module
from vidmem.pipelines.family import denoiser_blocks
from vidmem.pipelines.hooks import RunHooks
from vidmem.pipelines.loader import load_pipeline
from vidmem.pipelines.planning import plan_options, sampling_model
from vidmem.pipelines.prompt_cache import PromptCache
from vidmem.pipelines.room import RoomRequest
from vidmem.pipelines.sample import sample
from vidmem.pipelines.sample_chunks import _auto_count
from vidmem.pipelines.sample_ladder import planner_fits

VARIANT = "wan2.1-t2v"
CUDA = torch.device("cuda")
# The tiny Wan at a size where the math kernel's slice counts need different room (tests/test_attention_resolved.py).
SLICED = VideoShape(256, 256, 33, cfg=True)


# --- the ladder's fit and auto chunks: the free figure plus the context, as the plan counts it ---------------------


def test_the_ladder_fits_a_strategy_whose_footprint_less_the_context_is_free(tiny_loaded):
    loaded, strategy = tiny_loaded(VARIANT), MemoryStrategy(offload="none")
    planned = denoise_stage(sampling_model(loaded), SLICED, strategy, plan_options(loaded, PlanOptions(steps=2)))
    free = planned.device_bytes - CUDA_CONTEXT_BYTES + MiB  # what the host reports: the context is made already
    assert planner_fits(loaded, SLICED, 2, free)(strategy)
    assert not planner_fits(loaded, SLICED, 2, 0)(strategy)


def test_auto_chunks_the_plans_slice_count_from_the_free_figure(tiny_loaded):
    loaded = tiny_loaded(VARIANT)
    strategy = MemoryStrategy(offload="none", activation_chunks="auto")
    model, options = sampling_model(loaded), plan_options(loaded, PlanOptions(attention=Attention.MATH))
    two_slices = denoise_stage(model, SLICED, replace(strategy, activation_chunks=2), options).device_bytes
    plan_budget = two_slices + MiB  # the plan's VRAM budget: the whole device, context included
    planned = fewest_chunks(model, SLICED, strategy, options, plan_budget).activation_chunks
    assert planned == 2  # the math kernel unsliced needs more: the slice count tells the figures apart
    free = plan_budget - CUDA_CONTEXT_BYTES  # the same device as the run's free figure reads it
    blocks = denoiser_blocks(loaded.pipe, loaded.spec)
    assert _auto_count(loaded, strategy, SLICED, free, blocks, Attention.MATH, {}) == (planned, "")


# --- the Decode within the budget: the Sampler's kept copies give way -----------------------------------------------


class LiveCard(dict):
    """The fake GPU's figures, with torch's allocated bytes following what the Sampler's warm store keeps."""

    def __init__(self, store, base_allocated: int, free: int, total: int) -> None:
        super().__init__(free=free, total=total)
        self.store, self.base = store, base_allocated

    def __getitem__(self, key):
        if key in ("allocated", "reserved"):
            return self.base + self.store.held_bytes
        return super().__getitem__(key)


ACTIVATIONS = 256 << 10  # the decode's predicted activations (the stand-in CPU device predicts none)
BASE_ALLOCATED = 1 * GiB  # torch's allocations beside the kept copies


@pytest.fixture
def sampled_then_decoded(tiny_folder, tmp_path, monkeypatch):
    """budget_bytes -> (bytes the Sampler's store kept after the Sampler, bytes it kept when the decode measured its
    free figure, that figure): the tiny Wan sampled under tier none, then decoded with the Decode node's budgeted
    figure on a fake 24 GiB card with 20 GiB free (0: no budget)."""
    fake = FakeCuda().install(monkeypatch)
    loaded = load_pipeline(tiny_folder(VARIANT), "fp32")  # its own: its warm stores start empty
    backend, strategy = CudaBackend(torch.device("cpu")), MemoryStrategy(offload="none")
    sampled = sample(loaded, strategy, request_for(VARIANT), RunHooks(prompt_cache=PromptCache(tmp_path / "p")),
                     backend=backend)
    store = loaded.warm_store("sample", backend)
    fake.device_bytes = LiveCard(store, BASE_ALLOCATED, free=20 * GiB, total=24 * GiB)
    # The stand-in device is the CPU (tensors stay there): the figures are read as the CUDA device's.
    monkeypatch.setattr(decode_module, "free_device_bytes", lambda device: free_device_bytes(CUDA))
    monkeypatch.setattr(decode_module, "decode_room", lambda loaded, shape, strategy, weight_bytes, device:
                        RoomRequest(weight_bytes, ACTIVATIONS, predicted=True))
    measured, real_free_for_rungs = [], decode_module._free_for_rungs
    monkeypatch.setattr(decode_module, "_free_for_rungs", lambda hooks, device: measured.append(
        (store.held_bytes, hooks.device_budget(device))) or real_free_for_rungs(hooks, device))

    def run(budget_bytes: int) -> tuple[int, int, int]:
        kept = store.held_bytes
        budget = budgeted_free_bytes(budget_bytes)
        decode_module.decode(loaded, sampled.latent, strategy, backend=backend,
                             hooks=RunHooks(device_budget=lambda device: budget(CUDA)))
        return (kept, *measured[-1])

    return run


def test_a_budget_that_binds_releases_the_samplers_copies_before_the_decode_measures(sampled_then_decoded):
    """The budget leaves the decode half the kept copies short of its room: they go before the ladder measures,
    and the figure it measures holds the decode's activations, as the plan's decode phase does."""
    free = budgeted_free_bytes(0)
    probe = sampled_then_decoded(0)  # no budget: what the Sampler's store keeps beside the VAE, taken over
    kept = probe[1]
    assert kept > ACTIVATIONS // 4  # the tiny transformer and text encoder
    budget = CUDA_CONTEXT_BYTES + BASE_ALLOCATED + kept + ACTIVATIONS - kept // 2
    before, at_measure, figure = sampled_then_decoded(budget)
    assert before == kept and at_measure < kept  # given back before the decode measured
    assert kept - at_measure >= kept // 2  # at least what the room lacked
    assert at_measure > 0  # only that: a copy the decode's room did not need stays for the next Sampler call
    assert figure >= ACTIVATIONS and figure < free(CUDA)


@pytest.mark.parametrize("budget_bytes", [0, 64 * GiB])
def test_no_budget_or_one_above_the_card_releases_nothing(sampled_then_decoded, budget_bytes):
    before, at_measure, figure = sampled_then_decoded(budget_bytes)
    assert before > 0 and at_measure == before
    assert figure == free_device_bytes(CUDA)
