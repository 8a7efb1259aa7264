"""Activation offload for training on a real GPU (skips without CUDA): the CPU suite checks the
schedule under a recording fake (tests/test_training_offload.py); this checks what only a GPU
shows: gradients equal with real streams and pinned buffers, and the step's peak allocated bytes
lower by about the moved inputs, as the training planner models it (one block's activations plus
the prefetched input stay on the device)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

BLOCKS, TOKENS, WIDTH = 8, 16384, 2048  # each block input: 16384 x 2048 x 2 bytes = 64 MiB in bf16


def chain(device):
    torch.manual_seed(0)
    return nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))
                         for _ in range(BLOCKS)).to(device, torch.bfloat16).requires_grad_(False)


def step(blocks, x, offload):
    """Every block checkpointed (as a streamed tier trains); returns the gradient of x and the peak."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    hidden = x * 1.0
    for block in blocks:
        if offload is None:
            hidden = checkpoint(block, hidden, use_reentrant=False)
        else:
            with offload.saving((hidden,)):
                hidden = checkpoint(block, hidden, use_reentrant=False)
    loss = hidden.float().square().mean()
    del hidden
    try:
        if offload is not None:
            offload.begin_backward()
        loss.backward()
    finally:
        if offload is not None:
            offload.close()
    torch.cuda.synchronize()
    return x.grad.clone(), torch.cuda.max_memory_allocated() - start


def test_offloaded_step_matches_and_holds_less(cuda):
    from vidmem.memory.activation_offload import ActivationOffload, ActivationPool, copies_for
    from vidmem.memory.device import CudaBackend

    backend = CudaBackend(cuda)
    blocks = chain(cuda)
    x = torch.randn(TOKENS, WIDTH, device=cuda, dtype=torch.bfloat16, requires_grad=True)
    plain_grad, plain_peak = step(blocks, x, None)
    x.grad = None
    pool = ActivationPool(backend.pin_arena, 4 << 30)
    offload = ActivationOffload(copies_for(backend), pool, prefetch=1)
    step(blocks, x, offload)  # the pool's buffers are pinned here
    x.grad = None
    pinned = pool.pinned_bytes
    grad, peak = step(blocks, x, offload)
    assert torch.equal(grad, plain_grad)
    assert pool.pinned_bytes == pinned and pool.in_use == 0  # reused, all returned
    assert offload.on_demand == 0
    input_bytes = TOKENS * WIDTH * 2
    # the plan: BLOCKS inputs held without offload, about 1 + prefetch with it
    saved = plain_peak - peak
    assert saved == pytest.approx((BLOCKS - 2) * input_bytes, rel=0.25), (plain_peak, peak)
