"""Optimizers: state saved as safetensors resumes bit for bit; 8-bit states are small; the
CPU-offloaded AdamW gives AdamW's result; the planner's byte formula matches what they hold."""

from __future__ import annotations

import pytest
import torch

from vidmem.training import OptimizerName, TrainingError, training_bytes
from vidmem.training.optim import OptimizerSettings, load_state_tensors, make_optimizer, state_bytes, state_to_tensors

SHAPES = [(96, 64), (64, 96)]  # (out, in) of two targeted layers
RANK = 16


def lora_params(seed=0):
    torch.manual_seed(seed)
    params = []
    for out_f, in_f in SHAPES:
        params += [torch.nn.Parameter(torch.randn(RANK, in_f) * 0.1), torch.nn.Parameter(torch.randn(out_f, RANK) * 0.1)]
    return params


def steps(optimizer, params, count, seed):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(count):
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator)
        optimizer.step()
        optimizer.zero_grad()


def available(name):
    if name is OptimizerName.ADAMW_8BIT:
        pytest.importorskip("bitsandbytes")


@pytest.mark.parametrize("name", list(OptimizerName))
def test_state_round_trip_resumes_bit_for_bit(name):
    available(name)
    settings = OptimizerSettings(name, 1e-3, 1e-4)
    params = lora_params()
    optimizer = make_optimizer(params, settings)
    steps(optimizer, params, 3, seed=1)
    tensors, meta = state_to_tensors(optimizer)
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    restored = make_optimizer(copies, settings)
    load_state_tensors(restored, {k: v.clone() for k, v in tensors.items()}, meta)
    steps(optimizer, params, 2, seed=2)
    steps(restored, copies, 2, seed=2)
    assert all(torch.equal(a, b) for a, b in zip(params, copies))


def test_cpu_offload_adamw_is_adamw():
    a, b = lora_params(), lora_params()
    plain = make_optimizer(a, OptimizerSettings(OptimizerName.ADAMW, 1e-3, 1e-4))
    offload = make_optimizer(b, OptimizerSettings(OptimizerName.ADAMW_CPU_OFFLOAD, 1e-3, 1e-4))
    steps(plain, a, 4, seed=3)
    steps(offload, b, 4, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("name", list(OptimizerName))
def test_planner_formula_matches_the_state_held(name):
    available(name)
    params = lora_params()
    optimizer = make_optimizer(params, OptimizerSettings(name, 1e-3, 0.0))
    steps(optimizer, params, 1, seed=4)
    predicted = training_bytes(SHAPES, RANK, name)
    assert predicted.optimizer_states == state_bytes(optimizer)
    assert predicted.trainable == sum(p.numel() * 4 for p in params)


def test_8bit_states_are_under_30_percent_of_adamw():
    pytest.importorskip("bitsandbytes")
    big = [(1536, 1536)] * 4
    assert training_bytes(big, 32, "adamw_8bit").optimizer_states <= 0.3 * training_bytes(big, 32, "adamw").optimizer_states


def test_missing_bitsandbytes_is_a_clear_error(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_bnb(name, *args, **kwargs):
        if name == "bitsandbytes":
            raise ImportError("no bitsandbytes")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_bnb)
    with pytest.raises(TrainingError, match="needs bitsandbytes.*pip install"):
        make_optimizer(lora_params(), OptimizerSettings(OptimizerName.ADAMW_8BIT, 1e-3, 0.0))
