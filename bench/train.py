"""Training benchmark: what gradient checkpointing and each optimizer cost, on the CPU.

Setup: a Wan 2.1 1.3B transformer at its real width (1536, 12 heads of 128, FFN 8960, text 4096)
cut to `--blocks` blocks, fp32, random weights, frozen; a rank-32 LoRA on the q, k, v and output
projections of both attentions of every block (vidmem.training's adapters, float32); one training
step's forward and backward of Wan's flow-matching loss on a latent of 16 x 4 x 32 x 32 (1024
video tokens: 13 frames at 256 x 256) with 512 text tokens (umt5's length).

- `checkpointing.grads_equal`: every LoRA gradient of one step with per-block checkpointing equals
  the one without, bit for bit (same initial LoRA, same batch and noise). Checkpointing as Train
  LoRA does it with the blocks resident (training/autograd.py): every block but the last re-runs
  in the backward, each keeping its self-attention output (selective checkpointing). The last
  block's share of the saving is 1/blocks: with 4 blocks it is a quarter of the re-run, with a
  real model's 30-40 blocks a few percent.
- `checkpointing.time_ratio`: median step time with / without, samples interleaved after the
  first (warm-up) step of each; `min_time_ratio`: fastest with / fastest without;
  `cpu_time_ratio`: the same with this process's CPU time (other jobs' load moves it least).
- `checkpointing.flop_ratio`: FLOPs of a step with / without (FlopCounterMode): the extra work
  itself, which machine load cannot move.
- `checkpointing.peak_activation_ratio`: peak RSS growth of a step with / without, measured in a
  child process whose glibc returns every large block when freed (MALLOC_MMAP_THRESHOLD_), with
  the peak reset through /proc/self/clear_refs; the growth is the step's activations, LoRA
  gradients and temporaries (the weights are resident before it starts).
- `activation_offload`: the same step with Train LoRA's activation offload
  (memory/activation_offload.py; blocks then re-run in full, no selective checkpointing):
  `grads_equal` against the plain step, `time_ratio` / `cpu_time_ratio` against checkpointing
  without it, `offloaded_bytes` per step and the peak RSS growth. On the CPU the "device" is the
  host, so the copies land in the same RAM: the peak does not drop here and the row shows what the
  copies and bookkeeping cost; the device-side drop is the planner's (`vidmem plan --train
  --activation-offload`) and, on a GPU, `torch.cuda.max_memory_allocated`.
- `optimizers.<name>.state_bytes`: bytes of every state tensor after one optimizer step on this
  LoRA (adamw_8bit needs bitsandbytes; skipped with a note when it is missing).

    python bench/train.py --json bench/results/train.json

About 3-4 minutes on 2 shared cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
from bench.support.checkout import use_this_checkout  # noqa: E402

use_this_checkout()  # `import vidmem` is this clone, installed or not

import diffusers  # noqa: E402
import torch  # noqa: E402

from vidmem.memory.activation_offload import ActivationOffload, ActivationPool, InlineCopies  # noqa: E402
from vidmem.training.adapters import AttachedLora, build_layers, find_targets  # noqa: E402
from vidmem.training.autograd import frozen_saved_by_storage, gradient_checkpointing  # noqa: E402
from vidmem.training.batches import step_generator  # noqa: E402
from vidmem.training.objective import Batch, FlowMatching  # noqa: E402
from vidmem.training.optim import OptimizerName, OptimizerSettings, make_optimizer, state_bytes  # noqa: E402
from bench.support.memwatch import peak_growth, rss_in_child  # noqa: E402

WAN_1_3B = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
                text_dim=4096, freq_dim=256, ffn_dim=8960, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                eps=1e-6, rope_max_seq_len=1024)
LATENT = (1, 16, 4, 32, 32)
TEXT_TOKENS = 512
RANK = 32
TARGETS = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0")


def build(blocks: int):
    torch.manual_seed(0)
    model = diffusers.WanTransformer3DModel(num_layers=blocks, **WAN_1_3B).eval().requires_grad_(False)
    layers = build_layers(model, find_targets(model, "transformer", TARGETS, "blocks"), RANK, float(RANK), seed=0)
    with torch.no_grad():  # a trained-looking LoRA: up is zero at the start, which would hide nothing but is untypical
        for layer in layers.values():
            layer.up.normal_(0.0, 0.01, generator=torch.Generator().manual_seed(1))
    generator = torch.Generator().manual_seed(2)
    batch = Batch(torch.randn(LATENT, generator=generator), torch.randn(1, TEXT_TOKENS, 4096, generator=generator))
    return model, layers, batch


def step(model, layers, batch, checkpointing: bool, offload: ActivationOffload | None = None) -> None:
    """Forward + backward of one training step (the optimizer step is measured apart)."""
    for parameter in layers.parameters():
        parameter.grad = None
    # as Train LoRA checkpoints resident blocks: the last block kept, self-attention outputs kept
    # (re-run in full with activation offload, as the trainer does)
    try:
        with AttachedLora(model, layers), gradient_checkpointing(model, checkpointing, model.blocks[-1],
                                                                 selective=offload is None, offload=offload):
            with frozen_saved_by_storage():
                loss = FlowMatching(3.0).loss(model, batch, step_generator(0, 0), torch.device("cpu"))
            if offload is not None:
                offload.begin_backward()
            loss.backward()
    finally:
        if offload is not None:
            offload.close()


def cpu_offload() -> ActivationOffload:
    pool = ActivationPool(lambda nbytes: torch.empty(nbytes, dtype=torch.uint8), 1 << 62)
    return ActivationOffload(InlineCopies(torch.device("cpu")), pool, prefetch=1)


def offload_times(model, layers, batch, samples: int) -> dict:
    """Checkpointing with activation offload against checkpointing without it, interleaved."""
    offload = cpu_offload()
    step(model, layers, batch, False)
    plain = grads(layers)
    step(model, layers, batch, True, offload)  # warm-up: the pool's buffers are made here
    moved = grads(layers)
    per_step = offload.offloaded_bytes
    times, cpu = {False: [], True: []}, {False: [], True: []}
    for round_ in range(samples):
        for flag in ((False, True) if round_ % 2 == 0 else (True, False)):
            wall, used = timed_both(lambda: step(model, layers, batch, True, offload if flag else None))
            times[flag].append(wall)
            cpu[flag].append(used)
    return {
        "grads_equal": all(torch.equal(a, b) for a, b in zip(plain, moved)),
        "time_ratio": statistics.median(times[True]) / statistics.median(times[False]),
        "cpu_time_ratio": statistics.median(cpu[True]) / statistics.median(cpu[False]),
        "step_seconds": {"checkpointing": statistics.median(times[False]), "offload": statistics.median(times[True])},
        "offloaded_bytes": per_step,
        "host_buffer_bytes": offload.pool.pinned_bytes,
    }


def grads(layers) -> list[torch.Tensor]:
    return [p.grad.clone() for p in layers.parameters()]


def timed(call) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def timed_both(call) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds): CPU time is far less moved by other jobs' load."""
    wall, cpu = time.perf_counter(), time.process_time()
    call()
    return time.perf_counter() - wall, time.process_time() - cpu


def checkpointing_times(model, layers, batch, samples: int) -> dict:
    step(model, layers, batch, False)  # warm-up of both, and the gradients to compare
    plain = grads(layers)
    step(model, layers, batch, True)
    checked = grads(layers)
    times, cpu = {False: [], True: []}, {False: [], True: []}
    for round_ in range(samples):
        for flag in ((False, True) if round_ % 2 == 0 else (True, False)):
            wall, used = timed_both(lambda: step(model, layers, batch, flag))
            times[flag].append(wall)
            cpu[flag].append(used)
    return {
        "grads_equal": all(torch.equal(a, b) for a, b in zip(plain, checked)),
        "time_ratio": statistics.median(times[True]) / statistics.median(times[False]),
        "min_time_ratio": min(times[True]) / min(times[False]),
        "cpu_time_ratio": statistics.median(cpu[True]) / statistics.median(cpu[False]),
        "step_seconds": {"plain": statistics.median(times[False]), "checkpointing": statistics.median(times[True])},
    }


def cpu_attention_flops() -> dict:
    """FlopCounterMode has no formula for the CPU flash-attention kernels (it counts them as 0,
    which would hide the attention a re-run repeats): torch's own SDPA formulas, mapped to them."""
    from torch.utils import flop_counter

    aten = torch.ops.aten

    def forward(query, key, value, *args, out_shape=None, **kwargs):
        return flop_counter.sdpa_flop_count(query, key, value)

    def backward(grad_out, query, key, value, *args, out_shape=None, **kwargs):
        return flop_counter.sdpa_backward_flop_count(grad_out, query, key, value)

    return {aten._scaled_dot_product_flash_attention_for_cpu: forward,
            aten._scaled_dot_product_flash_attention_for_cpu_backward: backward}


def flop_ratio(model, layers, batch) -> float:
    """FLOPs of a checkpointed step over a plain one (torch's FlopCounterMode, backward re-runs
    included; outputs selective checkpointing keeps are not recomputed, so not counted): the
    share of extra work no machine load can move. The LoRA's small matmuls are counted too."""
    from torch.utils.flop_counter import FlopCounterMode

    totals = []
    for flag in (False, True):
        with FlopCounterMode(display=False, custom_mapping=cpu_attention_flops()) as counter:
            step(model, layers, batch, flag)
        totals.append(counter.get_total_flops())
    return totals[1] / totals[0]


def measure_rss(args) -> None:
    model, layers, batch = build(args.blocks)
    result = {name: peak_growth(lambda: step(model, layers, batch, flag)) for name, flag in (("plain", False), ("checkpointing", True))}
    offload = cpu_offload()
    step(model, layers, batch, True, offload)  # the pool's buffers exist before the measured step, as from step 2 on
    result["offload"] = peak_growth(lambda: step(model, layers, batch, True, offload))
    args.rss_only.write_text(json.dumps(result))


def optimizer_states(layers) -> dict:
    found = {}
    for name in OptimizerName:
        params = [torch.nn.Parameter(p.detach().clone()) for p in layers.parameters()]
        try:
            optimizer = make_optimizer(params, OptimizerSettings(name, 1e-4, 1e-4))
        except ValueError as error:  # TrainingError: the library is missing
            found[name.value] = {"state_bytes": None, "note": str(error)}
            continue
        generator = torch.Generator().manual_seed(3)
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator)
        seconds = timed(optimizer.step)
        found[name.value] = {"state_bytes": state_bytes(optimizer), "step_seconds": seconds}
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--samples", type=int, default=2, help="timed steps per variant after the warm-up")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rss-only", type=Path, help=argparse.SUPPRESS)  # the child of rss_in_child
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.rss_only:
        return measure_rss(args)
    rss = rss_in_child(__file__, args)
    model, layers, batch = build(args.blocks)
    checkpointing = checkpointing_times(model, layers, batch, args.samples)
    checkpointing.update(peak_activation_ratio=rss["checkpointing"] / rss["plain"], peak_rss_growth_bytes=rss,
                         flop_ratio=flop_ratio(model, layers, batch))
    offload = offload_times(model, layers, batch, args.samples)
    offload["peak_rss_growth_bytes"] = {"checkpointing": rss["checkpointing"], "offload": rss["offload"]}
    optimizers = optimizer_states(layers)
    lora_weights = sum(p.numel() for p in layers.parameters())
    result = {
        "setup": {"blocks": args.blocks, "width": 1536, "ffn": 8960, "video_tokens": LATENT[2] * LATENT[3] * LATENT[4] // 4,
                  "text_tokens": TEXT_TOKENS, "rank": RANK, "lora_layers": len(layers), "lora_weights": lora_weights,
                  "threads": args.threads, "dtype": "float32"},
        "checkpointing": checkpointing,
        "activation_offload": offload,
        "optimizers": optimizers,
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
