"""Plans for training: byte formulas against real optimizer state, traced activations, tiers, CLI."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vidmem.memory.plan.stages import VideoShape
from vidmem.memory.plan.train import (ActivationPeaks, block_target_shapes, trace_activations, training_bytes)
from vidmem.memory.plan.train_plan import TrainRequest
from vidmem.pipelines.configs import load_model
from vidmem.pipelines.tiny import save_tiny_pipeline
from vidmem.cli.plan import main
from vidmem.training.inference import training_mode
from vidmem.training.optim import OptimizerName, OptimizerSettings, make_optimizer, state_bytes
from vidmem.training.plan import plan_training_step

TARGETS = ("to_q", "to_k", "to_v", "to_out.0")


class Block(nn.Module):
    def __init__(self, dim: int, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.to_q, self.to_k, self.to_v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.to_out = nn.ModuleList([nn.Linear(dim, dim)])
        self.ff = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, n, d = x.shape
        split = lambda t: t.view(b, n, self.heads, d // self.heads).transpose(1, 2)  # noqa: E731
        attended = F.scaled_dot_product_attention(split(self.to_q(x)), split(self.to_k(x)), split(self.to_v(x)))
        x = x + self.to_out[0](attended.transpose(1, 2).reshape(b, n, d))
        return x + self.ff(x)


class Toy(nn.Module):
    def __init__(self, dim: int = 64, blocks: int = 2) -> None:
        super().__init__()
        self.proj_in = nn.Linear(8, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(blocks))
        self.proj_out = nn.Linear(dim, 8)

    def forward(self, x):
        x = self.proj_in(x)
        for block in self.blocks:
            x = block(x)
        return self.proj_out(x)


def toy_peaks(checkpointing: bool, tokens: int = 256, batch: int = 1, rank: int = 4) -> ActivationPeaks:
    with torch.device("meta"):
        toy = Toy(blocks=3)  # the planner traces one, two and three blocks
    return trace_activations(toy, toy.blocks, lambda: toy(torch.empty(batch, tokens, 8, device="meta")), rank,
                             TARGETS, checkpointing)


@pytest.mark.parametrize("name", ["adamw", "adamw_cpu_offload", "adamw_8bit"])
def test_byte_formula_matches_the_optimizer_state_of_a_tiny_model(name):
    if name == "adamw_8bit":
        pytest.importorskip("bitsandbytes")
    toy = Toy(dim=96)
    shapes = block_target_shapes(toy.blocks, TARGETS)
    assert len(shapes) == 8  # four projections in each of two blocks, nothing outside the blocks
    params = [nn.Parameter(torch.randn(16, i) * 0.1) for o, i in shapes] + [nn.Parameter(torch.randn(o, 16) * 0.1)
                                                                          for o, i in shapes]
    optimizer = make_optimizer(params, OptimizerSettings(OptimizerName(name), 1e-3, 0.0))
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    predicted = training_bytes(shapes, 16, name)
    assert predicted.optimizer_states == state_bytes(optimizer)
    assert predicted.trainable == predicted.gradients == sum(p.numel() * 4 for p in params)
    assert (predicted.host > 0) == (name == "adamw_cpu_offload")


def test_checkpointing_lowers_the_activation_peak():
    full, checkpointed = toy_peaks(False), toy_peaks(True)
    per_block_full, per_block_checkpointed = full.per_block, checkpointed.per_block
    assert per_block_checkpointed < 0.3 * per_block_full
    assert checkpointed.at(30) < 0.3 * full.at(30)


def test_larger_batch_and_bucket_raise_the_peak():
    base = toy_peaks(False)
    assert toy_peaks(False, batch=2).at(10) > 1.8 * base.at(10)
    assert toy_peaks(False, tokens=512).at(10) > 1.8 * base.at(10)


def test_tracing_puts_the_module_back():
    with torch.device("meta"):
        toy = Toy()
    blocks = list(toy.blocks)
    trace_activations(toy, toy.blocks, lambda: toy(torch.empty(1, 64, 8, device="meta")), 4, TARGETS, True)
    assert list(toy.blocks) == blocks
    assert all(p.requires_grad for p in toy.parameters())
    assert not any(m._forward_hooks for m in toy.modules())


def test_extrapolation_is_linear_in_blocks_from_the_second():
    """The step from one block to two holds a one-time cost (the second block's input gradient):
    each block past the second adds what the third added (tests/test_train_activation_peaks.py
    holds this against traced steps)."""
    peaks = ActivationPeaks(one_block=100, two_blocks=130, three_blocks=140)
    assert (peaks.per_block, peaks.once) == (10, 20)
    assert (peaks.at(1), peaks.at(2), peaks.at(3), peaks.at(30)) == (100, 130, 140, 130 + 28 * 10)


def test_toy_blocks_past_the_second_add_their_input():
    """A checkpointed block keeps its input (float32, tokens x width) until its backward."""
    tokens, dim = 256, 64
    assert toy_peaks(True, tokens=tokens).per_block == tokens * dim * 4


def plan_json(capsys, *extra: str) -> dict:
    argv = ["plan", "--model", "cogvideox-2b", "--size", "720x480", "--frames", "49", "--vram", "24", "--ram", "64",
            "--train", "--rank", "64", "--json", *extra]
    status = main(argv)
    out = json.loads(capsys.readouterr().out)
    out["status"] = status
    return out


def test_cli_train_plan_on_a_shipped_model(capsys):
    plan = plan_json(capsys)
    assert plan["status"] == 0 and plan["recommended"] == 0
    tiers = [s["tier"] for s in plan["strategies"]]
    assert tiers == ["none", "model", "block_swap", "sequential"]
    none, sequential = plan["strategies"][0], plan["strategies"][3]
    assert sequential["weights_bytes"] < none["weights_bytes"] / 5  # streamed: one layer group at a time
    assert none["lora"]["trainable"] == 30 * 4 * (64 * 1920 + 1920 * 64) * 4  # 2b: 30 blocks, 4 projections


def test_cli_no_checkpointing_costs_more_and_refuses_streaming(capsys):
    with_checkpointing = plan_json(capsys)["strategies"][0]
    without = plan_json(capsys, "--no-checkpointing")
    assert without["strategies"][0]["activation_bytes"] > 3 * with_checkpointing["activation_bytes"]
    assert [s["refused"] for s in without["strategies"]][2:] == ["needs checkpointing"] * 2


def test_cli_batch_and_8bit_change_the_figures(capsys):
    base = plan_json(capsys)["strategies"][0]
    batch = plan_json(capsys, "--batch", "2")["strategies"][0]
    eight = plan_json(capsys, "--optimizer", "adamw_8bit")["strategies"][0]
    assert batch["activation_bytes"] > 1.8 * base["activation_bytes"]
    assert eight["lora"]["optimizer_states"] < 0.3 * base["lora"]["optimizer_states"]


def test_cli_train_bad_input(capsys):
    assert main(["plan", "--model", "cogvideox-2b", "--vram", "24", "--ram", "64", "--train", "--rank", "0"]) == 2
    assert "--rank 0" in capsys.readouterr().err
    assert main(["plan", "--model", "cogvideox-2b", "--vram", "24", "--ram", "64", "--train", "--targets", "nope"]) == 2
    assert "match no linear layer" in capsys.readouterr().err


def test_checkpointed_trace_counts_the_self_attention_output_each_block_keeps():
    """The trainer's selective checkpointing keeps each checkpointed block's self-attention output
    and float32 logsumexp: batch x heads x tokens x (head dim + 1) x 4 bytes for the fp32 toy."""
    tokens, dim, heads = 256, 64, 2
    checkpointed, plain = toy_peaks(True, tokens=tokens), toy_peaks(False, tokens=tokens)
    assert checkpointed.kept_per_block == heads * tokens * (dim // heads) * 4 + heads * tokens * 4
    assert plain.kept_per_block == 0
    assert checkpointed.at(10) == (ActivationPeaks(checkpointed.one_block, checkpointed.two_blocks, checkpointed.three_blocks).at(10)
                                   + 10 * checkpointed.kept_per_block)


def test_a_model_first_built_under_inference_mode_plans_training(tmp_path):
    """ComfyUI runs nodes under inference mode: a Sampler's plan builds (and caches) the meta
    model first; Train LoRA's offload=auto then traces a backward through the same model."""
    folder = save_tiny_pipeline("wan2.1-t2v", tmp_path / "wan")  # its own folder: no model cached before
    with torch.inference_mode():
        model = load_model(str(folder), "fp32")
        model.traced_module("transformer")
        with training_mode():
            plans, best = plan_training_step(model, "transformer", VideoShape(32, 32, 9, cfg=False),
                                             24 << 30, 24 << 30, TrainRequest(rank=4))
    assert plans and best is not None
