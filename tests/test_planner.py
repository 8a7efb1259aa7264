"""The memory planner: its accounting against measurement, its schedule against the engine's,
its predictions against published figures, and its answers when nothing fits."""

from __future__ import annotations

import ctypes
import json
import re

import pytest
import torch

from vidmem.memory import MemoryStrategy, VaeTiling
from vidmem.memory.accounting import Attention, OpCache, trace
from vidmem.memory.device import CpuBackend
from vidmem.memory.plan.planner import (Allocator, Call, GiB, PlanError, PlanOptions, Runtime, VideoShape, candidate_plans,
                                   choose_strategy, plan_run)
from vidmem.memory.plan.allocator import CachingAllocatorModel, replay
from vidmem.memory.plan.schedule import resident_tensors
from vidmem.pipelines.configs import load_model, model_names
from vidmem.pipelines.configs.meta import ComponentConfig, build_meta
from vidmem.pipelines.configs.streams import expand_blocks
from vidmem.pipelines.family import ModelError
from vidmem.pipelines.sample import SampleRequest, sample
from vidmem.pipelines.tiny import tiny_spec
from vidmem.cli.plan import main as plan_main

MiB = 1 << 20
TINY_DIT = dict(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=32, in_channels=16, out_channels=16,
                text_dim=64, freq_dim=256, ffn_dim=256, num_layers=2, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", rope_max_seq_len=64)
TINY_VAE = dict(base_dim=16, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[False, True], attn_scales=[])


@pytest.fixture(scope="module")
def cogvideox_2b():
    return load_model("cogvideox-2b")  # traces are memoised on the model: share it across tests


# --- accounting ------------------------------------------------------------------------------


def _malloc_in_use():
    """glibc's bytes in use (arena + mmapped chunks): the CPU allocator's own count."""
    libc = ctypes.CDLL("libc.so.6")
    if not hasattr(libc, "mallinfo2"):
        pytest.skip("needs glibc >= 2.33 (mallinfo2)")

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                   "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc.mallinfo2.restype = MallInfo2

    def used() -> int:
        info = libc.mallinfo2()
        return info.uordblks + info.hblkhd
    return used


class _MallocPeak(torch.utils._python_dispatch.TorchDispatchMode):
    """Peak of glibc's in-use bytes between ops while a real CPU forward runs."""

    def __init__(self, used) -> None:
        super().__init__()
        self.used, self.base, self.peak = used, used(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, self.used() - self.base)
        return out


def _cpu_peak(fn, used) -> int:
    fn()  # warm up: first-call allocations of kernels and caches
    with torch.no_grad(), _MallocPeak(used) as meter:
        out = fn()
    del out
    return meter.peak


@pytest.mark.parametrize("workload", ["transformer", "vae_decode"])
def test_meta_ledger_matches_the_cpu_allocator(workload):
    """The same module and inputs on meta (ledger) and on the CPU (glibc's counters) agree."""
    used = _malloc_in_use()
    from diffusers import AutoencoderKLWan, WanTransformer3DModel

    torch.manual_seed(0)
    if workload == "transformer":
        real, inputs = WanTransformer3DModel(**TINY_DIT).eval(), ((1, 16, 5, 48, 48), (1, 64, 64))
        with torch.device("meta"):
            meta = WanTransformer3DModel(**TINY_DIT).eval()

        def run(module, device):
            x, text = (torch.zeros(s, device=device) for s in inputs)
            step = torch.zeros(1, dtype=torch.long, device=device)
            return module(hidden_states=x, timestep=step, encoder_hidden_states=text, return_dict=False)[0]
    else:
        real = AutoencoderKLWan(**TINY_VAE).eval()
        with torch.device("meta"):
            meta = AutoencoderKLWan(**TINY_VAE).eval()

        def run(module, device):
            return module.decode(torch.zeros(1, 4, 3, 32, 32, device=device)).sample
    predicted = trace(lambda: run(meta, "meta")).peak_bytes
    measured = _cpu_peak(lambda: run(real, "cpu"), used)
    assert predicted > 2 * MiB
    assert abs(measured - predicted) / predicted < 0.03, (predicted, measured)


def test_fused_attention_holds_output_and_logsumexp_only():
    q = torch.empty(1, 8, 4096, 64, device="meta", dtype=torch.float16)
    run = lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q)  # noqa: E731
    fused, math = trace(run, Attention.FUSED), trace(run, Attention.MATH)
    output, logsumexp = q.numel() * 2, 8 * 4096 * 4
    assert fused.peak_bytes == output + logsumexp
    assert math.peak_bytes >= 8 * 4096 * 4096 * 2  # the score matrix


def test_views_and_in_place_ops_allocate_nothing_and_frees_are_recorded():
    x = torch.empty(1024, 1024, device="meta")

    def run():
        y = x.t()
        y.add_(1)
        z = x * 2  # 4 MiB, freed at once
        del z
        return x + 1

    result = trace(run)
    assert result.peak_bytes == 4 * MiB and result.live_bytes == 4 * MiB
    assert result.events == (4 * MiB, -1, 4 * MiB)


def test_an_op_handing_back_its_input_allocates_nothing_cached_or_not():
    """A batched matmul reshapes its result with aten._unsafe_view, whose schema claims a fresh tensor but
    which returns its input's storage: counted as an allocation, the first trace held the result twice
    and a cached one once, so a plan depended on what the process had traced before."""
    x, w = torch.empty(2, 512, 256, device="meta"), torch.empty(256, 1024, device="meta")
    cache = OpCache()
    first, second = (trace(lambda: x @ w, cache=cache) for _ in range(2))
    assert first.peak_bytes == second.peak_bytes == 2 * 512 * 1024 * 4 == first.live_bytes


def test_op_cache_gives_the_same_trace():
    from diffusers import AutoencoderKLWan

    with torch.device("meta"):
        vae = AutoencoderKLWan(**TINY_VAE).eval()
    z = torch.empty(1, 4, 9, 32, 32, device="meta")
    cache = OpCache()
    first, second = (trace(lambda: vae.decode(z).sample, cache=cache) for _ in range(2))
    assert trace(lambda: vae.decode(z).sample) == first == second and cache.hits > 0


# --- allocator model --------------------------------------------------------------------------


def test_allocator_model_follows_the_caching_allocator_rules():
    model = CachingAllocatorModel()
    model.malloc(0, 100)  # small: 512 bytes out of a 2 MiB segment
    model.malloc(1, 5 * MiB)  # 1-10 MiB: out of a 20 MiB segment, 15 MiB left free in it
    model.malloc(2, 16 * MiB + 1)  # large: its own segment, rounded up to 2 MiB
    assert (model.allocated, model.reserved) == (512 + 5 * MiB + 16 * MiB + 512, (2 + 20 + 18) * MiB)
    model.free(2)
    model.malloc(3, 10 * MiB)  # best fit: the 15 MiB rest of the 20 MiB segment, not the free 18 MiB
    assert model.reserved == 40 * MiB
    model.free(3)
    model.malloc(4, 24 * MiB)  # 15 + 18 MiB are free, but in two segments: a new one (fragmentation)
    assert model.reserved == 64 * MiB and model.peak_allocated == 512 + 5 * MiB + 24 * MiB


def test_allocator_model_releases_cached_segments_before_running_out():
    events = (12 * MiB, -1, 14 * MiB)  # the 12 MiB segment cannot hold 14 MiB
    assert replay([], events).reserved == 26 * MiB
    assert not replay([], events, capacity=16 * MiB).out_of_memory  # released, then retried
    assert replay([], events, capacity=12 * MiB).out_of_memory


# --- blocks and schedule ----------------------------------------------------------------------


def test_two_traced_blocks_stand_for_all_blocks():
    """Weights come from the full-size meta model; activations of 2 blocks equal those of 6."""
    config = ComponentConfig("transformer", "diffusers", "WanTransformer3DModel", dict(TINY_DIT, num_layers=6))
    full, two = build_meta(config, torch.float32), build_meta(config, torch.float32, max_blocks=2)
    assert len(full.blocks) == 6 and len(two.blocks) == 2

    def run(module):
        x, text = torch.empty(1, 16, 9, 64, 64, device="meta"), torch.empty(1, 64, 64, device="meta")
        return lambda: module(hidden_states=x, timestep=torch.zeros(1, dtype=torch.long, device="meta"),
                              encoder_hidden_states=text, return_dict=False)[0]
    six, two_blocks = trace(run(full)), trace(run(two))
    assert six.peak_bytes == two_blocks.peak_bytes
    assert replay([], six.events).reserved == replay([], two_blocks.events).reserved
    events = []
    hooks = [m.register_forward_pre_hook(lambda m, a, n=n: events.append((True, n))) for n, m in full.named_modules()
             if next(m.children(), None) is None and any(True for _ in m.parameters(recurse=False))]
    run(full)()
    traced = []
    hooks += [m.register_forward_pre_hook(lambda m, a, n=n: traced.append((True, n))) for n, m in two.named_modules()
              if next(m.children(), None) is None and any(True for _ in m.parameters(recurse=False))]
    run(two)()
    for handle in hooks:
        handle.remove()
    assert expand_blocks(traced, "blocks", 2, 6) == events


class _ResidentBytes:
    """Observer: the most bytes of one component's groups on the device at once, in a real run."""

    def __init__(self, component: str) -> None:
        self.component, self.bytes, self.peak, self.on = component, 0, 0, set()

    def __call__(self, kind: str, group) -> None:
        if group.name.split(".")[0] != self.component:
            return
        if kind in ("onload", "prefetch") and group.name not in self.on:
            self.on.add(group.name)
            self.bytes += group.nbytes
        elif kind == "evict" and group.name in self.on:
            self.on.discard(group.name)
            self.bytes -= group.nbytes
        self.peak = max(self.peak, self.bytes)


@pytest.mark.parametrize("strategy", [
    MemoryStrategy(offload="model"),
    MemoryStrategy(offload="block_swap", blocks_to_swap=1, prefetch_blocks=1),
    MemoryStrategy(offload="block_swap", blocks_to_swap=2, prefetch_blocks=0),
    MemoryStrategy(offload="sequential", prefetch_blocks=0),
    MemoryStrategy(offload="sequential", prefetch_blocks=1),
    MemoryStrategy(offload="sequential", prefetch_blocks=3),
], ids=lambda s: s.describe())
def test_planned_residency_is_what_the_engine_holds(strategy, tiny_loaded, tiny_folder):
    variant = "wan2.1-t2v"
    spec = tiny_spec(variant)
    meter = _ResidentBytes("transformer")
    request = SampleRequest("a cat", "", spec.width, spec.height, spec.frames, 2, 5.0, 0)
    sample(tiny_loaded(variant), strategy, request, backend=CpuBackend(), observer=meter)
    model = load_model(str(tiny_folder(variant)), "fp32")
    call = Call("denoise", "transformer", VideoShape(spec.width, spec.height, spec.frames))
    model.trace(call, Attention.FUSED)
    planned = resident_tensors(model.module("transformer"), model.blocks("transformer"), strategy,
                               model.stream_order(call))
    assert sum(planned) == meter.peak


class _CopyingBackend(CpuBackend):
    """A stand-in device on the CPU: an onload copies the weights (fresh memory, as a GPU copy is),
    an eviction points them back at the host originals (nothing allocated)."""

    def copy_group(self, hosts, non_blocking, side_stream, timed):
        return [host.clone() for host in hosts], None


def test_sequential_phase_holds_the_leaves_live_at_the_activation_peak():
    """Measured on the CPU with glibc's counters: under sequential, the peak is the activations'
    own peak plus the leaves the engine holds then, not plus the most it holds anywhere in the pass
    (an embedder's leaf while activations are small: H200, Wan 14B, 1.10x allocated before)."""
    from vidmem.memory.offload import StageComponents, apply_strategy
    from vidmem.memory.plan.schedule import Streaming, slot_table, stream_timeline, table_resident_tensors
    from diffusers import WanTransformer3DModel

    used = _malloc_in_use()
    config = dict(TINY_DIT, num_attention_heads=8, attention_head_dim=64, ffn_dim=1024, text_dim=512)  # embedders dominate
    torch.manual_seed(0)
    real = WanTransformer3DModel(**config).eval()
    with torch.device("meta"):
        meta = WanTransformer3DModel(**config).eval()

    def run(module, device):
        x, text = torch.zeros(1, 16, 2, 32, 32, device=device), torch.zeros(1, 64, 512, device=device)
        step = torch.zeros(1, dtype=torch.long, device=device)
        return module(hidden_states=x, timestep=step, encoder_hidden_states=text, return_dict=False)[0]

    strategy = MemoryStrategy(offload="sequential", prefetch_blocks=1)
    stage = StageComponents({"transformer": real}, {"transformer": real.blocks})
    with torch.no_grad(), apply_strategy(stage, strategy, _CopyingBackend()):
        for _ in range(2):  # the first pass learns the order; from the second on, leaves are prefetched
            run(real, "cpu")
        meter = _MallocPeak(used)  # the base: resident parents and the leaves prefetched for the next pass
        with meter:
            run(real, "cpu")

    traced = trace(lambda: run(meta, "meta"), module=meta)
    table = slot_table(meta, meta.blocks)
    stays, _, _ = table.units(strategy)
    order = tuple((start, name) for _, start, name in traced.marks)
    whole = table_resident_tensors(table, strategy, order)
    timeline = stream_timeline(Streaming(table, strategy, True, tuple(whole[len(stays):])), traced.marks)
    at_base = sum(table.nbytes(stays)) + sum(sum(timeline.groups[g]) for g, held in timeline.start if not held)
    planned = replay(table.nbytes(stays), traced.events, timeline=timeline).allocated - at_base
    pinned = replay(whole, traced.events).allocated - at_base  # the tier's peak held throughout, as before
    assert planned > 4 * MiB
    assert abs(meter.peak - planned) / planned < 0.03, (planned, meter.peak)
    assert pinned > 1.3 * meter.peak, (pinned, meter.peak)


def test_a_stored_layer_holds_its_upcast_workspace_only_while_it_computes():
    """Under sequential a leaf is on the device around its forward and its stored weight's upcast
    (plain fp8 widened to bf16: Wan 14B's 300 MiB time projection) only during it, so a later
    activation peak sees neither (H200, Wan 14B fp8: 3.552 GiB allocated, 3.550 planned; the largest
    workspace held throughout planned 4.00)."""
    from vidmem.memory.plan.schedule import SlotTable, Streaming, stream_timeline

    table = SlotTable(sizes=(64 * MiB, 8 * MiB), modules=("embed", "block"), slots=((0,), (1,)), leaf=(True, True),
                      block=(-1, -1), block_count=0, workspace=(128 * MiB, 0))
    marks = ((0, True, "embed"), (2, False, "embed"), (2, True, "block"), (5, False, "block"))
    events = (4 * MiB, 16 * MiB, -1, -2, 256 * MiB)  # small while the embedder runs, large in the block
    for copy_stream in (True, False):  # vidmem's side stream, accelerate's compute stream
        streaming = Streaming(table, MemoryStrategy(offload="sequential", prefetch_blocks=0), copy_stream, (64 * MiB, 128 * MiB))
        peak = replay((), events, timeline=stream_timeline(streaming, marks))
        assert peak.allocated == 256 * MiB + 8 * MiB  # the block's activation and leaf: no embedder, no workspace
        assert peak.active >= 64 * MiB + 128 * MiB + 20 * MiB  # the embedder's forward: leaf, workspace, activations


def test_a_trace_marks_where_each_module_ran():
    layers = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 128)).to("meta")
    x = torch.empty(64, 256, device="meta")
    traced = trace(lambda: layers(x), module=layers)
    assert [(start, name) for _, start, name in traced.marks] == [(True, "0"), (False, "0"), (True, "2"), (False, "2")]
    # Linear 0's output, ReLU's, Linear 0's freed, Linear 2's, ReLU's freed
    assert traced.events == (64 * 512 * 4, 64 * 512 * 4, -1, 64 * 128 * 4, -2)
    assert [position for position, _, _ in traced.marks] == [0, 1, 3, 4]


def test_a_copy_stream_keeps_its_own_blocks_and_a_held_block_is_reserved_until_freed():
    """Streamed weights are copied on a side stream: the allocator hands their freed blocks only to
    that stream's requests; a block evicted while the GPU may read it leaves `allocated` at once."""
    model = CachingAllocatorModel()
    model.malloc(0, 64 * MiB, stream=1)
    model.hold(0)
    assert (model.allocated, model.reserved) == (0, 64 * MiB)
    model.malloc(1, 32 * MiB)  # the compute stream: a segment of its own, the held block not reused
    assert model.reserved == 96 * MiB and model.peak_active == 96 * MiB
    model.free(0)
    model.malloc(2, 32 * MiB)  # the copy stream's block is free now, but not for the compute stream
    assert model.reserved == 128 * MiB
    model.malloc(3, 48 * MiB, stream=1)  # ... and serves the copy stream
    assert model.reserved == 128 * MiB and model.allocated == 112 * MiB


def test_held_blocks_take_segments_but_are_not_allocated():
    """An evicted block the GPU may still read: reserved by the allocator, not in torch's allocated."""
    plain = replay((64 * MiB,), (8 * MiB, -1))
    held = replay((64 * MiB,), (8 * MiB, -1), held=(64 * MiB,))
    assert held.allocated == plain.allocated
    assert held.reserved == plain.reserved + 64 * MiB


@pytest.mark.parametrize("prefetch, live", [(0, 1), (1, 1), (2, 2), (3, 3)])
def test_blocks_live_while_a_block_computes(prefetch, live, cogvideox_2b):
    """Prefetches are queued when a block's forward has been queued: while block i computes, the
    blocks live are i .. i+prefetch-1 (i alone without a prefetch), and one evicted block is held
    (measured on an H200: counting prefetch + 1 live put Wan 14B's allocated peak a block high)."""
    from vidmem.memory.plan.schedule import computing_residency, tensor_sizes
    from vidmem.memory.residency import own_slots

    module, blocks = cogvideox_2b.module("transformer"), cogvideox_2b.blocks("transformer")
    strategy = MemoryStrategy(offload="block_swap", blocks_to_swap=len(blocks), prefetch_blocks=prefetch)
    block = sum(tensor_sizes([slot for m in blocks[0].modules() for slot in own_slots(m)]))
    core = sum(resident_tensors(module, blocks, MemoryStrategy(offload="block_swap", blocks_to_swap=len(blocks), prefetch_blocks=0)))
    live_tensors, held = computing_residency(module, blocks, strategy)
    assert sum(held) == (block if prefetch else 0)
    assert sum(live_tensors) == core - block + live * block  # resident_tensors(prefetch 0) holds one block


def test_streamed_copies_overlap_compute_with_the_measured_exposed_share():
    """Measured on an H200 (docs/gpu.md): copies hide behind compute even without a prefetch (the host
    runs a block ahead), leaving a small share exposed, larger without a prefetch and for leaves."""
    from vidmem.memory.plan.costs import DeviceRates, Traffic, exposed_copy_share, stage_seconds

    rates = DeviceRates(flops_per_s=1e12, copy_bytes_per_s=1e9)
    compute, copy = 1e12, int(0.5e9)  # one second of compute, half a second of copies per pass
    cost = lambda share: stage_seconds(compute, 1, Traffic(copy, 0, exposed_share=share), rates=rates) - 1.0  # noqa: E731
    with_prefetch, without, leaves = (exposed_copy_share(False, 1), exposed_copy_share(False, 0), exposed_copy_share(True, 1))
    assert 0 < cost(with_prefetch) < cost(without) < cost(leaves) < 0.5 * 0.5  # never the whole copy added
    assert cost(with_prefetch) == pytest.approx(0.5 * with_prefetch)
    copy_bound = stage_seconds(compute, 1, Traffic(int(3e9), 0, exposed_share=with_prefetch), rates=rates)
    assert copy_bound == pytest.approx(3.0 * (1 + with_prefetch))  # a slow link: the copy sets the pace


def test_a_plain_fp8_upcast_costs_a_fraction_of_a_scaled_one_on_a_gpu(cogvideox_2b):
    """Plain fp8 only widens (1 byte read, 2 written); scaled fp8 computes through float32
    temporaries. On the H200 plain fp8 ran no slower than bf16 (docs/gpu.md)."""
    shape, strategy = VideoShape(720, 480, 49), MemoryStrategy(offload="none")
    seconds = {name: plan_run(cogvideox_2b, shape, strategy, PlanOptions(storage={"transformer": name} if name else {}))
               .stage("denoise").seconds() for name in ("", "fp8_e4m3fn", "fp8_scaled")}  # "": as the model computes
    assert seconds[""] < seconds["fp8_e4m3fn"] < seconds["fp8_scaled"]
    widening, scaled = seconds["fp8_e4m3fn"] - seconds[""], seconds["fp8_scaled"] - seconds[""]
    assert widening == pytest.approx(scaled * 3 / 23, rel=0.01)


# --- published figures -----------------------------------------------------------------------

# diffusers CogVideoX docs, "Memory optimization" (added in huggingface/diffusers#9150, sequential
# note in #9296): CogVideoX-2b, 720x480, 49 frames, 50 steps, guidance 6, fp16 (the model's
# dtype; the PR's script loads torch.float16), figures from torch.cuda peak statistics in GiB
# (the script divides by 1024**3), so the CUDA context is not in them.
PUBLISHED = {
    "none": (MemoryStrategy(offload="none", text_encoder="device"), 33),  # pipe.to("cuda")
    "model": (MemoryStrategy(offload="model"), 19),  # enable_model_cpu_offload
    "model+tiling": (MemoryStrategy(offload="model", vae_tiling=VaeTiling()), 11),  # + vae.enable_tiling()
}


@pytest.mark.parametrize("case", PUBLISHED)
def test_cogvideox_2b_against_the_published_figures(case, cogvideox_2b):
    strategy, published_gib = PUBLISHED[case]
    plan = plan_run(cogvideox_2b, VideoShape(720, 480, 49), strategy, PlanOptions(runtime=Runtime.DIFFUSERS))
    reserved = max(stage.reserved_bytes for stage in plan.stages) / GiB  # torch.cuda.max_memory_reserved
    assert abs(reserved - published_gib) / published_gib < 0.15, (case, reserved)


def test_cogvideox_2b_sequential_offload_stays_under_4_gib(cogvideox_2b):
    """"under 4 GB" with enable_sequential_cpu_offload (accelerate: no prefetch) and VAE tiling."""
    strategy = MemoryStrategy(offload="sequential", prefetch_blocks=0, vae_tiling=VaeTiling())
    plan = plan_run(cogvideox_2b, VideoShape(720, 480, 49), strategy, PlanOptions(runtime=Runtime.DIFFUSERS))
    assert max(stage.allocated_bytes for stage in plan.stages) < 4 * GiB  # torch.cuda.max_memory_allocated


# --- choosing ---------------------------------------------------------------------------------


def test_choose_takes_the_fastest_tier_that_fits(cogvideox_2b):
    shape = VideoShape(720, 480, 49)
    roomy = choose_strategy(cogvideox_2b, shape, 80 * GiB, 64 * GiB)
    assert roomy.strategy.offload.value == "none" and roomy.strategy.vae_tiling is None
    tight = choose_strategy(cogvideox_2b, shape, 12 * GiB, 64 * GiB)
    assert tight.strategy.offload.value == "model" and tight.strategy.vae_tiling is not None
    assert tight.fits and tight.peak_vram_bytes <= 12 * GiB


def test_block_swap_uses_the_fewest_blocks_that_fit(cogvideox_2b):
    shape, base = VideoShape(720, 480, 49), MemoryStrategy(text_encoder="cpu")
    plans = candidate_plans(cogvideox_2b, shape, 5 * GiB, 64 * GiB, base)
    swap = next(p for p in plans if p.strategy.offload.value == "block_swap")
    assert swap.fits and swap.strategy.blocks_to_swap > 1
    fewer = plan_run(cogvideox_2b, shape, MemoryStrategy(offload="block_swap", blocks_to_swap=swap.strategy.blocks_to_swap - 1,
                                                         text_encoder="cpu"))
    assert not fewer.stage("denoise").fits(5 * GiB)


def test_nothing_fits_says_what_would(cogvideox_2b):
    shape = VideoShape(720, 480, 49)
    with pytest.raises(PlanError, match="give at least .* of RAM"):
        choose_strategy(cogvideox_2b, shape, 24 * GiB, 8 * GiB, consider_disk=False)  # weights kept in RAM
    vram = int(1.5 * GiB)  # the device is what runs out: a smaller video is suggested, and it fits
    with pytest.raises(PlanError, match="nothing fits") as error:
        choose_strategy(cogvideox_2b, shape, vram, 64 * GiB)
    found = re.search(r"What fits: (\d+)x(\d+)x(\d+) with", str(error.value))
    assert found, str(error.value)
    smaller = VideoShape(*map(int, found.groups()))
    assert choose_strategy(cogvideox_2b, smaller, vram, 64 * GiB).fits


def test_each_stage_over_a_budget_gets_the_change_that_makes_it_fit():
    """The fixes are planned: applied, the stage they are for fits its budget."""
    from dataclasses import replace

    from vidmem.memory.plan.advice import over_budget_lines
    from vidmem.memory.plan.stages import decode_stage, denoise_stage, text_encode_stage

    model, shape = load_model("wan2.1-t2v-14b"), VideoShape(832, 480, 81)
    mine = plan_run(model, shape, MemoryStrategy(offload="block_swap", blocks_to_swap=30), PlanOptions(),
                    vram_budget_bytes=8 * GiB, ram_budget_bytes=32 * GiB)
    lines = over_budget_lines(model, mine)
    assert len(lines) == 3 and all("; fix: " in line for line in lines), lines
    blocks = int(re.search(r"blocks_to_swap (\d+)", lines[1]).group(1))
    fixed = replace(mine.strategy, blocks_to_swap=blocks, text_encoder="cpu")
    on_disk = PlanOptions(on_disk=True)
    assert text_encode_stage(model, shape, fixed, PlanOptions()).fits(8 * GiB)
    assert denoise_stage(model, shape, fixed, PlanOptions()).fits(8 * GiB)
    assert not denoise_stage(model, shape, replace(fixed, blocks_to_swap=blocks - 1), PlanOptions()).fits(8 * GiB)
    assert all(stage(model, shape, fixed, on_disk).host_bytes <= 32 * GiB for stage in (text_encode_stage, denoise_stage, decode_stage))
    assert over_budget_lines(model, replace(mine, vram_budget_bytes=80 * GiB, ram_budget_bytes=80 * GiB)) == []
    untiled = plan_run(model, shape, MemoryStrategy(offload="model", text_encoder="cpu"), vram_budget_bytes=4 * GiB)
    decode = next(line for line in over_budget_lines(model, untiled) if line.startswith("decode"))
    assert re.search(r"fix: VAE tiling, tile_size \d+", decode), decode



def test_the_planner_never_advises_a_tile_below_the_familys_smallest():
    """LTX-2 decodes with seams below 512 px tiles: the tiling the planner picks, and the fix its
    advice offers (advice.py asks the same `tiling_that_fits`), shorten the chunks instead."""
    from vidmem.memory.plan.candidates import tiling_that_fits
    from vidmem.memory.plan.stages import decode_stage

    model, shape, strategy = load_model("ltx2-t2v-19b"), VideoShape(1024, 768, 25), MemoryStrategy(offload="model")
    untiled = decode_stage(model, shape, strategy, PlanOptions()).allocated_bytes
    for vram in (untiled * 2 // 3, 3 * GiB):  # without the floor: 64 px and 256 px tiles
        tiling = tiling_that_fits(model, shape, strategy, PlanOptions(), vram).vae_tiling
        assert tiling is not None and tiling.tile_size >= model.vae_min_tile == 512, (vram, tiling)


def test_the_frame_wide_output_is_parked_on_the_host_one_group_at_a_time():
    """A tiled decode parks the mid-block's output on the host (memory.vae); sliced, a batch of two parks one item's
    at a time, since the decode lets go of it before making the next; in one piece nothing is parked."""
    from vidmem.memory.plan.stages import decode_calls, parked_context_bytes

    model, options = load_model("wan2.1-t2v-1.3b"), PlanOptions()
    shape = VideoShape(832, 480, 33, batch=2)
    latent = model.latent_shape(shape)
    item = model.trace(Call("decode_context", "vae", shape, (1, *latent[1:])), options.attention).live_bytes
    tiled = VaeTiling(tile_size=256)
    parked = {slicing: parked_context_bytes(model, decode_calls(model, shape, MemoryStrategy(
        vae_tiling=tiled, vae_slicing=slicing)), options) for slicing in (True, False)}
    assert item > 0 and parked == {True: item, False: pytest.approx(2 * item, rel=0.01)}
    assert parked_context_bytes(model, decode_calls(model, shape, MemoryStrategy(vae_slicing=True)), options) == 0


def test_times_the_model_cannot_tell_apart_are_not_reported():
    from vidmem.memory.plan.candidates import times_differ

    big, small = load_model("wan2.1-t2v-14b"), load_model("wan2.1-t2v-1.3b")
    shape = VideoShape(832, 480, 81)
    assert not times_differ(candidate_plans(big, shape, 8 * GiB, 32 * GiB))  # the copies hide behind compute
    # the 1.3B's text encoder on the CPU (to fit 8 GB beside the transformer) is a real cost
    assert times_differ(candidate_plans(small, shape, 8 * GiB, 32 * GiB))


def test_bad_requests_get_a_fix():
    with pytest.raises(ModelError, match="wan2.1-t2v-14b"):
        load_model("wan-14b")
    model = load_model("wan2.1-t2v-1.3b")
    with pytest.raises(ValueError, match="4k\\+1"):
        plan_run(model, VideoShape(832, 480, 80), MemoryStrategy())
    with pytest.raises(ValueError, match="multiple of 16"):
        plan_run(model, VideoShape(830, 480, 81), MemoryStrategy())
    with pytest.raises(ValueError, match="720x480"):
        load_model("cogvideox-5b-i2v").check_shape(VideoShape(1280, 720, 49))


def test_every_shipped_model_builds_and_counts_its_weights():
    sizes = {name: sum(load_model(name).weights(c).nbytes for c in load_model(name).layout.denoisers) for name in model_names()}
    assert 26 * GiB < sizes["wan2.1-t2v-14b"] < 28 * GiB  # 14.3 B parameters in bf16
    assert sizes["wan2.2-t2v-a14b"] == 2 * sizes["wan2.1-t2v-14b"]
    # 1.7 B in fp16, plus the float64 sinusoidal pos_embedding diffusers leaves uncast (0.25 GiB)
    assert 3.3 * GiB < sizes["cogvideox-2b"] < 3.5 * GiB


def test_async_allocator_counts_live_bytes_only(cogvideox_2b):
    shape, strategy = VideoShape(720, 480, 49), MemoryStrategy(offload="model")
    native = plan_run(cogvideox_2b, shape, strategy).stage("decode")
    pooled = plan_run(cogvideox_2b, shape, strategy, PlanOptions(allocator=Allocator.ASYNC)).stage("decode")
    assert pooled.device_bytes < native.device_bytes


# --- command line -----------------------------------------------------------------------------


def test_plan_command_json(capsys, cogvideox_2b):
    code = plan_main(["plan", "--model", "cogvideox-2b", "--vram", "12", "--ram", "64", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["recommended"] == 1
    row = out["strategies"][out["recommended"]]
    assert set(row) >= {"tier", "blocks_to_swap", "vae_tiling", "peak_vram_bytes", "peak_ram_bytes", "stages",
                        "est_slowdown", "fits"}
    assert set(row["stages"]) == {"text_encode", "denoise", "decode"} and row["tier"] == "model"


def test_plan_command_table_and_errors(capsys):
    assert plan_main(["plan", "--model", "cogvideox-2b", "--vram", "12", "--ram", "1"]) == 1
    out = capsys.readouterr().out
    assert "+disk" in out and "give at least" in out  # disk rows were tried: RAM runs out anyway
    need = re.search(r"give at least ([\d.]+) GiB of RAM: (.+) needs the least", out)
    rows = [line.split() for line in out.splitlines() if "+disk" in line and line.split()[-1] in ("yes", "no")]
    ram_column = [float(row[row.index("GiB") + 1]) for row in rows]  # peak VRAM "x GiB", then peak RAM
    assert need and float(need.group(1)) == min(ram_column), out  # the row it names, not the leanest one's
    assert plan_main(["plan", "--model", "nope", "--vram", "12"]) == 2
    assert "unknown model 'nope'" in capsys.readouterr().err
    # checked by run_plan (argparse choices would import the engine for every command): one line naming the formats
    assert plan_main(["plan", "--model", "cogvideox-2b", "--vram", "12", "--weights", "fp7"]) == 2
    assert "fp8_scaled" in capsys.readouterr().err
    assert plan_main(["plan", "--model", "cogvideox-2b", "--vram", "12", "--disk-gbps", "0"]) == 2
    assert "--disk-gbps 0.0 must be a positive" in capsys.readouterr().err
