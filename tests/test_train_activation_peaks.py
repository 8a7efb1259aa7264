"""The training planner's activation peaks against traces of the step at the block count asked for.

Real configs on the meta device at small video sizes, so each trace takes a fraction of a second:
Wan 2.2 TI2V 5B (its per-token timestep projection is the input every block shares, the case that
made the first block's inputs count), Wan 2.1 1.3B (a block's copied-back input dies before its
backward's peak) and CogVideoX-2b (each block gets a new text state). The planner traces one, two
and three blocks and extrapolates; here the step is traced with four and five blocks, without
offload and with activation offload (its copies back to the device made as fresh tensors, as on a
GPU), and the extrapolated figures must be those bytes exactly.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.checkpoint import checkpoint

from vidmem.memory.accounting import Attention, TensorLedger
from vidmem.memory.activation_offload import ActivationOffload, ActivationPool, InlineCopies, checkpointing_switched
from vidmem.memory.plan import train as planner
from vidmem.memory.plan.types import VideoShape
from vidmem.pipelines.configs import load_model, workloads
from vidmem.training.inference import training_mode

TARGETS = ("to_q", "to_k", "to_v", "to_out.0")
RANK = 16


CASES = {"wan2.2-ti2v-5b": VideoShape(640, 352, 41, cfg=False), "wan2.1-t2v-1.3b": VideoShape(480, 320, 17, cfg=False),
         "cogvideox-2b": VideoShape(480, 320, 9, cfg=False)}


def _traced(name: str):
    model = load_model(name)
    module = model.module("transformer")
    run = workloads.denoise_step(model, "transformer", CASES[name], module, per_sample_timesteps=True)  # the trainer's call
    with training_mode():
        peaks = planner.trace_activations(module, _blocks(module), run, RANK, TARGETS, True)
    return module, run, peaks


def _blocks(module):
    return getattr(module, "blocks", None) or module.transformer_blocks


@pytest.fixture(scope="module")
def ti2v():
    return _traced("wan2.2-ti2v-5b")


@pytest.fixture(scope="module", params=list(CASES))
def family(request):
    return _traced(request.param)


def traced_step(module, run, blocks: int) -> int:
    """The planner's own trace of the step with `blocks` checkpointed blocks (every block re-run in full)."""
    with training_mode(), planner._training_view(module, _blocks(module), blocks, RANK, TARGETS, True, Attention.FUSED):
        return planner._trace_step(run, Attention.FUSED)


class _FreshCopies(InlineCopies):
    """Meta copies back to the device as new tensors: the ledger sees what a GPU allocates for them."""

    def to_device(self, host, filled):
        return host.clone(), None


def _host_buffer(nbytes: int) -> torch.Tensor:
    with _disable_current_modes():  # host memory: not the ledger's to count
        return torch.empty(nbytes, dtype=torch.uint8, device="meta")


def traced_offloaded_step(module, run, blocks: int, prefetch: int) -> int:
    """The step with every block's inputs offloaded (the streamed tiers' layout) as the run does it:
    `ActivationOffload.saving` around each checkpoint call, `begin_backward` before the backward.
    The planner's LoRA stand-ins drop their gradients as they are made (the plan counts them apart)."""
    offload = ActivationOffload(_FreshCopies(torch.device("meta")), ActivationPool(_host_buffer, 1 << 62), prefetch)

    def checkpointed(block, *args, **kwargs):
        with offload.saving(args):
            return checkpoint(block.__call__, *args, use_reentrant=False, context_fn=planner._attention_contexts,
                              **kwargs)

    ledger = TensorLedger()
    with training_mode(), planner._training_view(module, _blocks(module), blocks, RANK, TARGETS, False), \
            checkpointing_switched(planner._switches(module), True, checkpointed):
        planner._COUNTERS.append(planner._SelfAttentionOutputs())
        try:
            with ExitStack() as stack, torch.enable_grad():
                stack.enter_context(ledger)
                stack.enter_context(planner._FusedTrainingAttention())
                loss = run().float().square().mean()
                offload.begin_backward()
                loss.backward()
                del loss
        finally:
            planner._COUNTERS.pop()
            offload.close()
    ledger.stop()
    return ledger.peak


def test_the_first_step_up_holds_a_one_time_cost(ti2v):
    """Two blocks add more than three do: the second block's input gradient, computed once."""
    _, _, peaks = ti2v
    assert peaks.two_blocks - peaks.one_block > peaks.three_blocks - peaks.two_blocks > 0
    assert peaks.per_block == sum(peaks.offloaded[1])  # past the second, a block adds the input offload moves
    assert peaks.once > 0


@pytest.mark.parametrize("blocks", [4, 5])
def test_extrapolated_peak_is_the_traced_one(ti2v, blocks):
    module, run, peaks = ti2v
    rerun = replace(peaks, kept_per_block=0)  # the traced blocks re-run in full: nothing kept beyond the input
    assert rerun.at(blocks) == traced_step(module, run, blocks)


@pytest.mark.parametrize("blocks,prefetch", [(4, 1), (5, 2), (5, 3)])
def test_offloaded_peak_is_the_traced_one(family, blocks, prefetch):
    """The prefetched inputs peak when they reach the first block: its shared inputs come back while
    the originals are still alive. A sum of the plain traces missed it both ways (Wan 2.1 1.3B:
    high by most of a hidden state; CogVideoX-2b: low by a text state), hence the traced step."""
    module, run, peaks = family
    rerun = replace(peaks, kept_per_block=0)
    assert rerun.offloaded_at(blocks, prefetch) == traced_offloaded_step(module, run, blocks, prefetch)


def test_the_plan_extrapolates_from_three_traced_blocks(ti2v):
    """The plan traces the full-size module cut to three blocks (the two-block module the sampling
    planner traces has no third), and a streamed tier's activations are the step traced at all 30."""
    from vidmem.memory.plan.train_plan import TrainRequest
    from vidmem.training.plan import plan_training_step

    module, run, _ = ti2v
    model = load_model("wan2.2-ti2v-5b")
    with training_mode():
        plans, _ = plan_training_step(model, "transformer", VideoShape(640, 352, 41, cfg=False), 80 << 30, 256 << 30,
                                      TrainRequest(rank=RANK, targets=TARGETS))
    sequential = next(plan for plan in plans if plan.tier == "sequential")
    assert sequential.activation_bytes == traced_step(module, run, len(module.blocks))
