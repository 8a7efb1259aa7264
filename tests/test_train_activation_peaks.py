"""The training planner's activation peaks against traces of the step at the block count asked for.

Wan 2.2 TI2V 5B's real config on the meta device (its per-token timestep projection is the input
every block shares, the case that made the first block's inputs count), at a small video size so
each trace takes a fraction of a second. The planner traces one, two and three blocks and
extrapolates; here the step is traced with four and five blocks, without offload and with activation
offload (its copies back to the device made as fresh tensors, as on a GPU), and the extrapolated
figures must be those bytes exactly.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import replace

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from vidmem.memory.accounting import Attention, TensorLedger
from vidmem.memory.activation_offload import ActivationOffload, ActivationPool, InlineCopies, checkpointing_switched
from vidmem.memory.plan import train as planner
from vidmem.memory.plan.types import VideoShape
from vidmem.pipelines.configs import load_model, workloads
from vidmem.training.inference import training_mode

TARGETS = ("to_q", "to_k", "to_v", "to_out.0")
RANK = 16


@pytest.fixture(scope="module")
def ti2v():
    model = load_model("wan2.2-ti2v-5b")
    module = model.module("transformer")
    run = workloads.denoise_step(model, "transformer", VideoShape(640, 352, 41, cfg=False), module)
    with training_mode():
        peaks = planner.trace_activations(module, module.blocks, run, RANK, TARGETS, True)
    return module, run, peaks


def traced_step(module, run, blocks: int) -> int:
    """The planner's own trace of the step with `blocks` checkpointed blocks (every block re-run in full)."""
    with training_mode(), planner._training_view(module, module.blocks, blocks, RANK, TARGETS, True, Attention.FUSED):
        return planner._trace_step(run, Attention.FUSED)


class _FreshCopies(InlineCopies):
    """Meta copies back to the device as new tensors: the ledger sees what a GPU allocates for them."""

    def to_device(self, host):
        return host.clone(), None


def traced_offloaded_step(module, run, blocks: int, prefetch: int) -> int:
    """The step with every block's inputs offloaded (the streamed tiers' layout) as the run does it:
    `ActivationOffload.saving` around each checkpoint call, `begin_backward` before the backward.
    The first step makes the pool's buffers (host memory, not counted); the second is measured."""
    offload = ActivationOffload(_FreshCopies(torch.device("meta")),
                                ActivationPool(lambda n: torch.empty(n, dtype=torch.uint8, device="meta"), 1 << 62),
                                prefetch)

    def checkpointed(block, *args, **kwargs):
        with offload.saving(args):
            return checkpoint(block.__call__, *args, use_reentrant=False, context_fn=planner._attention_contexts,
                              **kwargs)

    peaks = []
    with training_mode(), planner._training_view(module, module.blocks, blocks, RANK, TARGETS, False), \
            checkpointing_switched(planner._switches(module), True, checkpointed):
        for _ in range(2):
            ledger = TensorLedger()
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
            peaks.append(ledger.peak)
    return peaks[-1]


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


@pytest.mark.parametrize("blocks,prefetch", [(4, 1), (5, 2)])
def test_offloaded_peak_is_the_traced_one(ti2v, blocks, prefetch):
    """The prefetched inputs peak when they reach the first block: its shared inputs come back while
    the originals are still alive."""
    module, run, peaks = ti2v
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
