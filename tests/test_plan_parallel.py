"""Plans per GPU: context-parallel ranks and balanced placement, against hand counts and the one-GPU plan."""

from __future__ import annotations

import json
import re

import pytest
import torch

from vidmem.memory.accounting import Attention, trace
from vidmem.memory.plan.parallel import (INTERCONNECTS, MultiGpu, ParallelError, comm_bytes, plan_parallel,
                                         plan_seconds, sequence_tokens)
from vidmem.memory.plan.parallel_trace import ring_attention, ulysses_attention
from vidmem.memory.plan.planner import VideoShape, plan_run
from vidmem.memory.strategy import MemoryStrategy, OffloadTier
from vidmem.pipelines.configs import load_model
from vidmem.cli.plan import main as plan_main

SMALL = VideoShape(480, 320, 33)  # Wan: 9 latent frames x 20 x 30 patches = 5400 tokens


@pytest.fixture(scope="module")
def wan():
    return load_model("wan2.1-t2v-1.3b")  # 12 heads, 30 blocks; traces are memoised on the model


def test_ranks_split_activations_and_keep_every_weight(wan):
    plans = {n: plan_parallel(wan, SMALL, MemoryStrategy(), MultiGpu(n)) for n in (1, 2, 4)}
    ranks = {n: plan.gpus[0] for n, plan in plans.items()}
    assert [len(plans[n].gpus) for n in (1, 2, 4)] == [1, 2, 4]
    assert ranks[1].weights_bytes == ranks[2].weights_bytes == ranks[4].weights_bytes > 0
    activations = [ranks[n].denoise_activation_bytes for n in (1, 2, 4)]
    assert activations[0] > activations[1] > activations[2]
    assert activations[2] > activations[0] / 4  # embeddings and the gathered output stay whole on every rank
    seconds = [plans[n].seconds for n in (1, 2, 4)]
    assert seconds[0] > seconds[1] > seconds[2]
    assert 1 < plans[2].speedup < 2 and 2 < plans[4].speedup < 4


def test_image_to_video_splits_the_transformer_not_the_image_encoders():
    model = load_model("wan2.1-i2v-14b-480p")
    one, two = (plan_parallel(model, SMALL, MemoryStrategy(), MultiGpu(n)).gpus[0] for n in (1, 2))
    assert two.denoise_activation_bytes < one.denoise_activation_bytes
    assert two.weights_bytes == one.weights_bytes
    conditioning = lambda gpu: [p.peak.allocated - sum(p.resident)  # noqa: E731
                                for p in gpu.stage("denoise").phases if "(image)" in p.label]
    assert conditioning(one) and conditioning(two) == conditioning(one)  # replicated, not split


def test_one_gpu_is_the_single_gpu_plan(wan):
    strategy = MemoryStrategy(offload="block_swap", blocks_to_swap=10)
    single = plan_run(wan, SMALL, strategy, vram_budget_bytes=6 << 30, ram_budget_bytes=32 << 30)
    one = plan_parallel(wan, SMALL, strategy, MultiGpu(1), vram_budget_bytes=6 << 30, ram_budget_bytes=32 << 30)
    assert one.gpus[0].stages == single.stages
    assert one.per_gpu_peak_bytes == single.peak_vram_bytes
    assert one.seconds == plan_seconds(single) and one.speedup == 1.0
    assert one.comm.total == 0 and one.gpus[0].comm_bytes == 0 and one.host_bytes == single.peak_ram_bytes


def test_block_swap_on_every_rank_keeps_the_swapped_residency(wan):
    swap = MemoryStrategy(offload="block_swap", blocks_to_swap=20)
    resident, swapped = (plan_parallel(wan, SMALL, s, MultiGpu(2)).gpus[0] for s in (MemoryStrategy(), swap))
    assert swapped.weights_bytes < resident.weights_bytes
    assert swapped.denoise_activation_bytes == resident.denoise_activation_bytes


def test_comm_bytes_by_hand(tiny_folder):
    model = load_model(str(tiny_folder("wan2.1-t2v")), "fp32")
    shape = VideoShape(32, 32, 9)
    # tiny Wan: patch (1, 2, 2), 2 heads of 12, 2 blocks, 16 output channels; VAE 8x spatial, 4x temporal
    # latent 3 frames x 4 x 4 -> tokens 3 x 2 x 2 = 12; on 2 GPUs 6 each; fp32
    assert sequence_tokens(model, shape) == 12
    local = 1 * 6 * 2 * 12 * 4  # one of q/k/v/out on one rank: 576 bytes
    gather = 6 * (16 * 1 * 2 * 2) * 4 * 1  # proj_out's share, sent to the one peer: 1536 bytes
    ulysses = comm_bytes(model, shape, "transformer", 2, "ulysses")
    assert (ulysses.attention_bytes, ulysses.gather_bytes) == (2 * 4 * local // 2, gather)  # keeps half of each
    assert ulysses.collectives == 2 * 4 + 1
    ring = comm_bytes(model, shape, "transformer", 2, "ring")
    assert (ring.attention_bytes, ring.collectives) == (2 * 2 * local, 2 + 1)  # receives the peer's k and v
    assert comm_bytes(model, shape, "transformer", 1, "ulysses").total == 0


def _meta(*shape):
    return torch.empty(shape, dtype=torch.bfloat16, device="meta")


def test_ulysses_holds_six_local_tensors_at_its_peak():
    """q, k, v as the caller holds them (not counted here) plus: their per-peer copies and the all-to-all
    outputs (6 local tensors), then those outputs and the head-split copies (6 again); attention adds
    its output and logsumexp after three are gone."""
    batch, local, heads, dim, degree = 1, 256, 8, 64, 4
    q, k, v = (_meta(batch, local, heads, dim) for _ in range(3))
    held = trace(lambda: ulysses_attention(q, k, v, degree, {}), Attention.FUSED)
    one = batch * local * heads * dim * 2
    assert held.peak_bytes == 6 * one
    assert held.flops == pytest.approx(2 * batch * (heads // degree) * (local * degree) ** 2 * 2 * dim)


@pytest.mark.parametrize("degree", [2, 4])
def test_rank_trace_is_diffusers_own_context_parallel_forward(wan, monkeypatch, degree):
    """diffusers' real Ulysses path (enable_parallelism, its hooks and TemplatedUlyssesAttention) runs on
    meta under a fake process group: one denoise step holds the same peak, the same allocator footprint
    and the same FLOPs as the planner's per-rank trace."""
    import torch.distributed as dist
    from unittest import mock

    from diffusers import ContextParallelConfig
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from vidmem.memory.plan.allocator import replay
    from vidmem.memory.plan.parallel_trace import context_parallel_trace
    from vidmem.memory.plan.types import Call
    from vidmem.pipelines.configs import workloads
    from vidmem.pipelines.configs.meta import build_meta

    call = Call("denoise", "transformer", SMALL)
    with context_parallel_trace(wan.traced_module("transformer"), degree, "ulysses"):
        ours = trace(workloads.workload_for(wan, call), Attention.FUSED)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=degree)
    try:
        theirs_module = build_meta(wan.components["transformer"], wan.dtype, 2)
        mesh = init_device_mesh("cpu", (1, degree), mesh_dim_names=("ring", "ulysses"))
        with mock.patch.object(torch.accelerator, "device_count", return_value=1):  # as the runtime does on CPU
            theirs_module.enable_parallelism(config=ContextParallelConfig(ulysses_degree=degree, mesh=mesh))
        monkeypatch.setattr(wan, "traced_module", lambda name: theirs_module)
        theirs = trace(workloads.workload_for(wan, call), Attention.FUSED)
    finally:
        dist.destroy_process_group()
    assert ours.peak_bytes == theirs.peak_bytes and ours.flops == theirs.flops
    weights = (1 << 30,)
    assert replay(weights, ours.events).reserved == replay(weights, theirs.events).reserved
    whole = wan.trace(call, Attention.FUSED)
    assert ours.peak_bytes < whole.peak_bytes


def test_ring_holds_every_rank_keys_and_values():
    batch, local, heads, dim, degree = 1, 256, 8, 64, 4
    q, k, v = (_meta(batch, local, heads, dim) for _ in range(3))
    held = trace(lambda: ring_attention(q, k, v, degree, {}), Attention.FUSED)
    one = batch * local * heads * dim * 2
    assert held.peak_bytes >= 2 * one + 2 * degree * one  # its own k, v concatenated, then all of them
    assert held.flops == pytest.approx(degree * 2 * batch * heads * local * local * 2 * dim)


def test_cogvideox_is_refused_context_parallelism_but_balanced_works(tiny_folder):
    model = load_model(str(tiny_folder("cogvideox-t2v")), "fp32")
    shape = VideoShape(32, 32, 9)
    with pytest.raises(ParallelError, match="CogVideoXPipeline has no context-parallel plan.*different GPUs"):
        plan_parallel(model, shape, MemoryStrategy(), MultiGpu(2))
    balanced = plan_parallel(model, shape, MemoryStrategy(offload="none"), MultiGpu(2, "balanced"))
    home, encoder = balanced.gpus
    assert (home.components, encoder.components) == (("transformer", "vae"), ("text_encoder",))
    assert not home.stage("text_encode").phases and not encoder.stage("denoise").phases
    assert [p.weights_bytes for p in encoder.stage("text_encode").phases] == [model.weights("text_encoder").nbytes]
    assert home.weights_bytes == model.weights("transformer").nbytes  # tier none, and no text encoder beside it


@pytest.mark.parametrize("variant, shape, degree, mode", [
    ("cogvideox-t2v", VideoShape(32, 32, 9), 2, "ulysses"),  # no context-parallel plan
    ("wan2.1-t2v", VideoShape(32, 32, 9), 4, "ulysses"),  # 2 heads do not divide by 4
    ("wan2.1-t2v", VideoShape(48, 32, 9), 4, "ring"),  # 3 x 2 x 3 = 18 tokens do not divide by 4
])
def test_refusals_are_the_runtime_s_own_words(tiny_folder, tiny_loaded, variant, shape, degree, mode):
    from vidmem.memory.strategy import ContextParallel, Parallelism
    from vidmem.pipelines.family import ModelError
    from vidmem.pipelines.parallel import check_context_parallel

    model = load_model(str(tiny_folder(variant)), "fp32")
    with pytest.raises(ParallelError) as planned:
        plan_parallel(model, shape, MemoryStrategy(), MultiGpu(degree, mode))
    parallel = Parallelism(context_parallel=ContextParallel(mode), degree=degree)
    with pytest.raises(ModelError) as refused:
        check_context_parallel(tiny_loaded(variant), shape.width, shape.height, shape.frames, parallel, degree, "cuda")
    assert str(planned.value) == str(refused.value)


def test_balanced_placement_keeps_the_experts_together(tiny_folder):
    """As the runtime places them: both experts on the roomiest GPU, the prompt encoder on another."""
    model = load_model(str(tiny_folder("wan2.2-a14b")), "fp32")
    shape = VideoShape(32, 32, 9)
    single = plan_run(model, shape, MemoryStrategy(offload="none", text_encoder="device"))
    three = plan_parallel(model, shape, MemoryStrategy(offload="none"), MultiGpu(3, "balanced"))
    assert [g.components for g in three.gpus] == [("transformer", "transformer_2", "vae"), ("text_encoder",), ()]
    assert three.gpus[0].weights_bytes == model.weights("transformer").nbytes + model.weights("transformer_2").nbytes
    assert three.gpus[2].peak_bytes == 0
    allocated = lambda stages: max(stage.allocated_bytes for stage in stages)  # noqa: E731 - tiny: below segment size
    assert max(allocated(g.stages) for g in three.gpus) < allocated(single.stages)


def test_uneven_sequence_names_sizes_that_split(wan):
    shape = VideoShape(480, 480, 81)  # 21 x 30 x 30 = 18900 tokens: not a multiple of 8
    with pytest.raises(ParallelError, match="18900 video tokens.*8 ranks") as refused:
        plan_parallel(wan, shape, MemoryStrategy(), MultiGpu(4 * 2, "ring"))
    found = dict(re.findall(r"(width|height|frames) ([\d, ]+\d)", str(refused.value)))
    assert set(found) == {"width", "height", "frames"}
    candidates = [VideoShape(int(w), 480, 81) for w in found["width"].split(", ")]
    candidates += [VideoShape(480, int(h), 81) for h in found["height"].split(", ")]
    candidates += [VideoShape(480, 480, int(f)) for f in found["frames"].split(", ")]
    for candidate in candidates:
        wan.check_shape(candidate)
        assert sequence_tokens(wan, candidate) % 8 == 0


def test_ulysses_needs_the_heads_to_divide(wan):
    with pytest.raises(ParallelError, match="12 attention heads.*8 ranks; use 2, 3, 4, 6 or 12 GPUs.*or on CUDA GPUs context_parallel=ring"):
        plan_parallel(wan, VideoShape(512, 512, 81), MemoryStrategy(), MultiGpu(8))


def test_faster_interconnect_less_comm_time(wan):
    slow, fast = (plan_parallel(wan, SMALL, MemoryStrategy(), MultiGpu(4, interconnect=INTERCONNECTS[name]))
                  for name in ("pcie4", "nvlink"))
    assert slow.comm == fast.comm and slow.comm.total > 0
    assert fast.comm_seconds < slow.comm_seconds and fast.seconds < slow.seconds
    ring = plan_parallel(wan, SMALL, MemoryStrategy(), MultiGpu(4, "ring"))
    assert ring.comm.attention_bytes == slow.comm.attention_bytes * 4 // 2  # 2(N-1) vs 4(N-1)/N local tensors


def test_plan_command_gpus_json(capsys, wan):
    args = ["plan", "--model", "wan2.1-t2v-1.3b", "--size", "480x320", "--frames", "33", "--vram", "8", "--ram", "64"]
    assert plan_main(args + ["--gpus", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["gpus"] == 2 and out["cp"] == "ulysses" and out["interconnect"]["gbps"] == 25
    assert out["single_gpu"]["peak_vram_bytes"] > 0
    best = out["strategies"][out["recommended"]]
    assert set(best) >= {"per_gpu_peak_bytes", "speedup", "all_to_all_bytes_per_pass", "ranks", "fits", "tier"}
    assert len(best["ranks"]) == 2 and best["fits"] and best["per_gpu_peak_bytes"] <= 8 << 30
    assert best["ranks"][0]["peak_bytes"] == best["per_gpu_peak_bytes"]
    assert plan_main(args + ["--gpus", "2"]) == 0
    table = capsys.readouterr().out
    assert "<- recommended" in table and "Per GPU" in table and "GB sent per GPU" in table
    assert plan_main(args + ["--gpus", "1", "--json"]) == 0  # one GPU: the ordinary plan
    assert "gpus" not in json.loads(capsys.readouterr().out)


def test_plan_command_gpus_refusals(capsys):
    assert plan_main(["plan", "--model", "cogvideox-2b", "--vram", "24", "--ram", "64", "--gpus", "2"]) == 2
    err = capsys.readouterr().err
    assert "no context-parallel plan" in err and err.rstrip().endswith("vidmem plan --gpus 2 --cp balanced.")
    assert plan_main(["plan", "--model", "wan2.1-t2v-1.3b", "--vram", "24", "--ram", "64", "--gpus", "0"]) == 2
    assert "--gpus 0" in capsys.readouterr().err
    assert plan_main(["plan", "--model", "wan2.1-t2v-1.3b", "--vram", "24", "--ram", "64", "--gpus", "2",
                      "--interconnect-gbps", "0"]) == 2
    assert "--interconnect-gbps" in capsys.readouterr().err
    assert plan_main(["plan", "--model", "wan2.1-t2v-1.3b", "--vram", "24", "--ram", "64", "--gpus", "2",
                      "--interconnect", "infiniband"]) == 2
    assert "pcie4, pcie5, nvlink" in capsys.readouterr().err


def test_layout_from_the_memory_strategy():
    from vidmem.memory.strategy import Parallelism

    assert MultiGpu.of(Parallelism(context_parallel="ulysses"), 4) == MultiGpu(4, "ulysses")
    assert MultiGpu.of(Parallelism(gpus=(0, 2), context_parallel="ring"), 4) == MultiGpu(2, "ring")
    assert MultiGpu.of(Parallelism(gpus=(0, 1)), 8) == MultiGpu(2, "balanced")
    with pytest.raises(ParallelError, match="at least 2 GPUs"):
        MultiGpu.of(Parallelism(), 1)


def test_context_parallel_plans_only_what_the_ranks_run(capsys, wan):
    """Ranks reopen the diffusers folder at its own dtype (pipelines.parallel.source): no disk rows,
    no --weights/--disk plans, and the RAM holds one copy per rank plus the coordinator's."""
    from vidmem.memory.plan.parallel import RANK_STORAGE, parallel_candidates
    from vidmem.memory.plan.planner import PlanOptions

    ram = 24 << 30  # one copy of the pipeline fits, three do not: the one-GPU planner would add disk rows
    plans, _ = parallel_candidates(wan, SMALL, 8 << 30, ram, MultiGpu(2))
    assert len(plans) == len(OffloadTier) and not any(p.page_cache_bytes for p in plans)
    assert not any(p.fits for p in plans)
    for options in (PlanOptions(on_disk=True), PlanOptions(storage=wan.layout.stored_as("fp8_scaled"))):
        with pytest.raises(ParallelError, match="diffusers folder at its own dtype only"):
            parallel_candidates(wan, SMALL, 8 << 30, ram, MultiGpu(2), options=options)
    args = ["plan", "--model", "wan2.1-t2v-1.3b", "--size", "480x320", "--frames", "33", "--vram", "8", "--ram", "24",
            "--gpus", "2"]
    assert plan_main(args + ["--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["recommended"] is None and out["rank_weights"] == RANK_STORAGE
    assert plan_main(args + ["--disk"]) == 2
    assert "drop --disk/--weights" in capsys.readouterr().err
    assert plan_main(args + ["--cp", "balanced", "--disk"]) in (0, 1)  # balanced runs the pipeline as loaded
