"""Activation chunks (pipelines/activation_chunks.py): denoiser blocks over token slices.

Chunked latents equal unchunked ones bit for bit on the CPU, per family and tier (the strict backend
poisons evicted weights, so a slice computed with weights the engine had already evicted would show),
with a LoRA and with the step cache; every block is left as found, after success and after an error;
bad input is refused by name before any block changes. The planner traces the chunked blocks: more
slices lower real-size Wan 14B's predicted denoise peak at 1280x720x81, and that is what makes the
issue's case (fp8 scaled weights, 8 GiB VRAM, 32 GiB RAM) fit.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from backends import StrictBackend
from test_lora import peft_keys, random_lora, write
from test_lora_sampling import lora_file
from test_step_cache import FIRST_BLOCK, MAG, TAYLOR
from test_tiers import block_count, hooks_of, request_for, storage_map
from vidmem.memory import MemoryStrategy
from vidmem.memory.strategy import MAX_ACTIVATION_CHUNKS, StrategyError
from vidmem.pipelines.activation_chunks import CHUNK_HOOK, ChunkError, activation_chunks, token_slices
from vidmem.pipelines.family import denoiser_blocks
from vidmem.pipelines.hooks import RunHooks
from vidmem.pipelines.lora import load_lora, with_lora
from vidmem.pipelines.sample import sample
from vidmem.pipelines.sample_chunks import chunks_for_call

VARIANTS = ("wan2.1-t2v", "wan2.1-i2v", "wan2.2-ti2v", "wan2.2-a14b", "cogvideox-t2v", "cogvideox1.5-t2v", "hunyuanvideo1.5-t2v",
            "hunyuanvideo1.5-i2v")


def latent(loaded, strategy, variant, hooks=RunHooks(), **changes):
    result = sample(loaded, strategy, replace(request_for(variant), **changes), hooks, backend=StrictBackend())
    return result.latent["samples"], result.receipt


def tiers(loaded) -> dict[str, MemoryStrategy]:
    return {"none": MemoryStrategy(offload="none"),
            "block_swap": MemoryStrategy(offload="block_swap", blocks_to_swap=block_count(loaded))}


def blocks_as_found(loaded) -> list[tuple]:
    """What chunking touches on each block: an instance forward, a hook registry, the hooks in it."""
    return [("forward" in b.__dict__, getattr(b, "_diffusers_hook", None),
             tuple(getattr(b, "_diffusers_hook", None).hooks) if hasattr(b, "_diffusers_hook") else ())
            for group in denoiser_blocks(loaded.pipe, loaded.spec).values() for b in group]


@pytest.mark.parametrize("variant", VARIANTS)
def test_chunked_latents_equal_unchunked_bit_for_bit(variant, tiny_loaded):
    loaded = tiny_loaded(variant)
    latent(loaded, MemoryStrategy(), variant)  # transformers adds hooks of its own on first use: snapshot after it
    before, hooks_before, blocks_before = storage_map(loaded.pipe), hooks_of(loaded.pipe), blocks_as_found(loaded)
    for label, strategy in tiers(loaded).items():
        reference, _ = latent(loaded, strategy, variant)
        for chunks in (2, 3):
            chunked, receipt = latent(loaded, replace(strategy, activation_chunks=chunks), variant)
            assert torch.equal(chunked, reference), f"{variant} {label} chunks={chunks} differs from unchunked"
            applied = receipt["activation_chunks"]
            blocks = sum(map(len, denoiser_blocks(loaded.pipe, loaded.spec).values()))
            assert applied["chunks"] == chunks and applied["blocks"] == blocks and max(applied["slices"]) > 1
    assert storage_map(loaded.pipe) == before
    assert hooks_of(loaded.pipe) == hooks_before
    assert blocks_as_found(loaded) == blocks_before


def test_the_chunked_forward_really_runs(tiny_loaded, monkeypatch):
    """Equal latents prove nothing if the hook never ran: count the slices the feed-forward sees."""
    loaded = tiny_loaded("wan2.1-t2v")
    block = denoiser_blocks(loaded.pipe, loaded.spec)["transformer"][0]
    rows = []
    hook = block.ffn.register_forward_pre_hook(lambda m, args: rows.append(args[0].shape[1]))
    try:
        latent(loaded, MemoryStrategy(offload="none", activation_chunks=3), "wan2.1-t2v")
    finally:
        hook.remove()
    tokens = sum(rows[:3])
    assert rows[:3] == [s.stop - s.start for s in token_slices(tokens, 3)] and len(set(rows[:3])) >= 1
    assert max(rows) < tokens


def test_hunyuanvideo15_runs_its_whole_block_in_video_slices_and_its_text_once(tiny_loaded):
    """The joint attention's projections and the video's feed-forward see one slice of the video tokens at a time
    (its attention module's forward, which runs every token at once, never runs); the text's projections and
    feed-forward see all of the text once per block call."""
    loaded = tiny_loaded("hunyuanvideo1.5-t2v")
    block = denoiser_blocks(loaded.pipe, loaded.spec)["transformer"][0]
    rows = {"attn": [], "attn.to_q": [], "attn.to_k": [], "attn.add_q_proj": [], "ff": [], "ff_context": []}
    hooks = [block.get_submodule(name).register_forward_pre_hook(
        lambda m, args, kwargs, name=name: rows[name].append((args or (kwargs["hidden_states"],))[0].shape[1]),
        with_kwargs=True) for name in rows]
    try:
        latent(loaded, MemoryStrategy(offload="none", activation_chunks=3), "hunyuanvideo1.5-t2v")
    finally:
        for hook in hooks:
            hook.remove()
    calls = len(rows["ff_context"])
    video = sum(rows["ff"][:3])
    assert rows["attn"] == [] and calls > 0
    assert rows["ff"][:3] == [s.stop - s.start for s in token_slices(video, 3, followed=True)]
    assert max(rows["ff"]) < video
    assert rows["attn.to_q"] == rows["attn.to_k"] == rows["ff"]  # queries made once, in the first pass
    assert len(rows["ff"]) == 3 * calls and len(rows["attn.add_q_proj"]) == calls


def test_queries_are_made_once_and_a_query_of_another_dtype_is_made_again_in_the_second_pass(tiny_loaded, monkeypatch):
    """The first pass parks each slice's queries in the output tensor (every token normalised once, not twice:
    the H200 measured the second normalisation in chunking's cost). Queries that would change dtype there are
    not parked: the second pass makes them again, and the latents stay the same either way."""
    from vidmem.pipelines import activation_chunks as chunking

    loaded = tiny_loaded("wan2.1-t2v")
    strategy = MemoryStrategy(offload="none", activation_chunks=3)
    reference, _ = latent(loaded, MemoryStrategy(offload="none"), "wan2.1-t2v")
    make, project = chunking._wan_query, chunking._wan_projections
    queries, parked, other_dtype = [], [], []

    def query(*args):
        queries.append(1)
        return make(*args)

    def projections(block, hidden, temb, rope, slices, out, run):
        found = project(block, hidden, temb, rope, slices, out.double() if other_dtype else out, run)
        parked.append(found[2])
        return found

    monkeypatch.setattr(chunking, "_wan_query", query)
    monkeypatch.setattr(chunking, "_wan_projections", projections)
    chunked, _ = latent(loaded, strategy, "wan2.1-t2v")
    assert torch.equal(chunked, reference) and parked and all(parked)
    assert len(queries) == 3 * len(parked)  # one per slice of each block call
    queries.clear(), parked.clear(), other_dtype.append(True)
    again, _ = latent(loaded, strategy, "wan2.1-t2v")
    assert torch.equal(again, reference) and parked and not any(parked)
    assert len(queries) == 4 * len(parked)  # the first slice's in the first pass, then each slice's in the second


def test_cross_attention_keys_and_values_are_made_once_per_block_call(tiny_loaded):
    """The text's keys and values do not depend on the slice: made once per block call, as unchunked, not once
    per slice. Its queries are per slice. Same latents either way."""
    loaded = tiny_loaded("wan2.1-t2v")
    attn = denoiser_blocks(loaded.pipe, loaded.spec)["transformer"][0].attn2
    calls = {}
    handles = [getattr(attn, name).register_forward_pre_hook(
        lambda m, args, name=name: calls.setdefault(name, []).append(args[0].shape[1])) for name in ("to_q", "to_k", "to_v")]
    try:
        reference, _ = latent(loaded, MemoryStrategy(offload="none"), "wan2.1-t2v")
        unchunked = {name: len(found) for name, found in calls.items()}
        calls.clear()
        chunked, _ = latent(loaded, MemoryStrategy(offload="none", activation_chunks=3), "wan2.1-t2v")
    finally:
        for handle in handles:
            handle.remove()
    assert torch.equal(chunked, reference)
    assert len(calls["to_q"]) == 3 * unchunked["to_q"]  # one query projection per slice
    assert len(calls["to_k"]) == len(calls["to_v"]) == unchunked["to_k"] == unchunked["to_q"]


def test_image_tokens_cross_attention_of_wan21_i2v_is_chunked_bit_for_bit():
    """Wan 2.1 I2V's cross-attention also attends to the CLIP image tokens through its own projections
    (`add_k_proj`, `add_v_proj`; the tiny I2V pipeline's latents are checked above, this is one block at a time).
    Their keys and values too are made once per block call, and the block's output equals diffusers' bit for bit."""
    from diffusers.models.transformers.transformer_wan import WanTransformerBlock

    from vidmem.pipelines.activation_chunks import wan_block_forward

    torch.manual_seed(0)
    block = WanTransformerBlock(32, 64, 2, cross_attn_norm=True, added_kv_proj_dim=32).eval()
    hidden, context = torch.randn(1, 96, 32), torch.randn(1, 257 + 512, 32)  # the processor takes the last 512 as text
    temb, rope = torch.randn(1, 6, 32), (torch.randn(1, 96, 1, 16), torch.randn(1, 96, 1, 16))
    calls = []
    handles = [getattr(block.attn2, name).register_forward_pre_hook(lambda m, args, name=name: calls.append(name))
               for name in ("add_k_proj", "add_v_proj", "to_k", "to_v")]
    try:
        with torch.no_grad():
            reference = block(hidden, context, temb, rope)
            calls.clear()
            chunked = wan_block_forward(block, 3, hidden, context, temb, rope)
    finally:
        for handle in handles:
            handle.remove()
    assert torch.equal(chunked, reference)
    assert sorted(calls) == ["add_k_proj", "add_v_proj", "to_k", "to_v"]


def test_fused_cross_attention_projections_are_refused(tiny_loaded, monkeypatch):
    """Fused (to_kv), the processor projects keys and values in one GEMM, which the chunked forward does not
    call: refused by name rather than computed another way."""
    from vidmem.pipelines.activation_chunks import chunk_problem

    loaded = tiny_loaded("wan2.1-t2v")
    block = denoiser_blocks(loaded.pipe, loaded.spec)["transformer"][0]
    monkeypatch.setattr(block.attn2, "fused_projections", True, raising=False)  # undone as found: absent
    assert chunk_problem(block) == "its cross-attention projections are fused (fuse_qkv_projections)"


def test_a_hunyuanvideo15_block_with_another_attention_processor_is_refused():
    """Its slices make the processor's arithmetic themselves (projections, masks, attention): a block whose
    attention runs another processor would compute differently, so it is refused by name."""
    from diffusers.models.attention_processor import AttnProcessor2_0
    from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15TransformerBlock

    from vidmem.pipelines.activation_chunks import chunk_problem

    block = HunyuanVideo15TransformerBlock(2, 8, mlp_ratio=2.0)
    block.attn.processor = AttnProcessor2_0()
    assert chunk_problem(block) == "its attn runs AttnProcessor2_0, not diffusers' HunyuanVideo15AttnProcessor2_0"


@pytest.mark.parametrize("variant", ["wan2.1-t2v", "hunyuanvideo1.5-t2v", "hunyuanvideo1.5-i2v"])
def test_sequential_copies_each_layer_once_per_slice_and_stays_identical(variant, tiny_loaded):
    from backends import Recorder

    loaded = tiny_loaded(variant)
    events, results = {}, {}
    for chunks in (1, 2, 3):
        recorder = Recorder()
        request = request_for(variant)
        strategy = MemoryStrategy(offload="sequential", activation_chunks=chunks)
        result = sample(loaded, strategy, request, backend=StrictBackend(), observer=recorder)
        results[chunks] = result.latent["samples"]
        events[chunks] = sum(1 for kind, _ in recorder.events if kind in ("onload", "prefetch"))
    assert torch.equal(results[2], results[1]) and torch.equal(results[3], results[1])
    assert events[1] < events[2] < events[3]  # what memory/plan/stages.py `_chunked_copies` counts


# HunyuanVideo 1.5's LoRA on the layers its slices call: the modulations, the video's and the text's projections,
# both outputs, both feed-forwards
HY15_LORA = [f"transformer_blocks.{i}.{name}" for i in range(2) for name in (
    "attn.to_q", "attn.to_v", "attn.add_k_proj", "attn.to_out.0", "attn.to_add_out", "ff.net.0.proj",
    "ff_context.net.2", "norm1.linear", "norm1_context.linear")]


@pytest.mark.parametrize("variant", ["wan2.1-t2v", "hunyuanvideo1.5-t2v"])
def test_chunks_with_a_lora(variant, tiny_loaded, tmp_path):
    base = tiny_loaded(variant)
    transformer = base.pipe.transformer
    path = (lora_file(tmp_path, transformer) if variant.startswith("wan") else
            write(tmp_path / "style.safetensors", peft_keys(random_lora(transformer, HY15_LORA, seed=1), None)))
    styled = with_lora(base, load_lora(path, base.pipe, 0.8))
    plain, _ = latent(base, MemoryStrategy(offload="none"), variant)
    for strategy in tiers(base).values():
        reference, _ = latent(styled, strategy, variant)
        chunked, _ = latent(styled, replace(strategy, activation_chunks=2), variant)
        assert not torch.equal(reference, plain)  # the LoRA is on
        assert torch.equal(chunked, reference)


@pytest.mark.parametrize("variant, cache", [("wan2.1-t2v", FIRST_BLOCK), ("wan2.1-t2v", MAG), ("cogvideox-t2v", MAG),
                                            ("wan2.1-t2v", TAYLOR), ("cogvideox-t2v", TAYLOR),
                                            ("hunyuanvideo1.5-t2v", FIRST_BLOCK)],
                         ids=["wan-first_block_cache", "wan-mag_cache", "cogvideox-mag_cache", "wan-taylor_seer",
                              "cogvideox-taylor_seer", "hunyuanvideo15-first_block_cache"])
def test_chunks_under_the_step_cache(variant, cache, tiny_loaded):
    """The cache's hooks wrap the chunked forward (it is applied first): same skips, same latents."""
    loaded = tiny_loaded(variant)
    for strategy in tiers(loaded).values():
        reference, receipt = latent(loaded, strategy, variant, cache=cache, steps=10)
        blocks_before = blocks_as_found(loaded)  # diffusers' disable_cache leaves an empty registry of its own
        chunked, chunked_receipt = latent(loaded, replace(strategy, activation_chunks=2), variant, cache=cache,
                                          steps=10)
        assert torch.equal(chunked, reference)
        assert chunked_receipt["cache"]["blocks_skipped"] == receipt["cache"]["blocks_skipped"] > 0
        assert blocks_as_found(loaded) == blocks_before


def test_blocks_restored_after_an_error_mid_run(tiny_loaded):
    loaded = tiny_loaded("wan2.1-t2v")
    latent(loaded, MemoryStrategy(), "wan2.1-t2v")
    before, blocks_before = storage_map(loaded.pipe), blocks_as_found(loaded)
    calls = []

    def interrupt():
        calls.append(1)
        if len(calls) > 3:  # inside the denoise loop, chunked blocks applied
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        latent(loaded, MemoryStrategy(offload="block_swap", blocks_to_swap=1, activation_chunks=2), "wan2.1-t2v",
               RunHooks(check_interrupt=interrupt))
    assert blocks_as_found(loaded) == blocks_before
    assert storage_map(loaded.pipe) == before
    # and the next run is the plain one
    assert torch.equal(latent(loaded, MemoryStrategy(offload="none"), "wan2.1-t2v")[0],
                       latent(loaded, MemoryStrategy(offload="none", activation_chunks=2), "wan2.1-t2v")[0])


def test_an_error_inside_a_slice_restores_every_block(tiny_loaded):
    loaded = tiny_loaded("wan2.1-t2v")
    blocks = denoiser_blocks(loaded.pipe, loaded.spec)
    denoisers = {name: getattr(loaded.pipe, name) for name in blocks}
    before = blocks_as_found(loaded)
    broken = blocks["transformer"][1].ffn
    hook = broken.register_forward_pre_hook(lambda m, args: 1 / 0)
    try:
        with pytest.raises(ZeroDivisionError), activation_chunks(denoisers, blocks, 2):
            assert blocks["transformer"][0]._diffusers_hook.get_hook(CHUNK_HOOK) is not None
            latent(loaded, MemoryStrategy(offload="none"), "wan2.1-t2v")
    finally:
        hook.remove()
    assert blocks_as_found(loaded) == before


def test_bad_chunk_counts_are_refused_by_name():
    for bad, words in ((0, "'auto', 'off' (or 1) or 2..64"), (MAX_ACTIVATION_CHUNKS + 1, "2..64"),
                      ("many", "'auto', 'off' or a whole number"), (2.5, "whole number"), (True, "whole number")):
        with pytest.raises(StrategyError, match="activation_chunks=") as error:
            MemoryStrategy(activation_chunks=bad)
        assert words in str(error.value)
    assert MemoryStrategy(activation_chunks="off").activation_chunks == 1
    assert MemoryStrategy(activation_chunks="8").activation_chunks == 8
    assert MemoryStrategy(activation_chunks="auto").chunks_auto
    assert "activation_chunks=4" in MemoryStrategy(activation_chunks=4).describe()
    assert "activation_chunks" not in MemoryStrategy().describe()


def test_a_block_that_cannot_chunk_is_refused_before_anything_changes(tiny_loaded):
    from diffusers.models.attention_processor import AttnProcessor2_0

    loaded = tiny_loaded("wan2.1-t2v")
    blocks = denoiser_blocks(loaded.pipe, loaded.spec)
    before = blocks_as_found(loaded)
    attn = blocks["transformer"][1].attn1
    original = attn.processor
    attn.processor = AttnProcessor2_0()
    try:
        with pytest.raises(ChunkError, match=r"activation_chunks=2: transformer block 1 cannot be chunked: its attn1 "
                                             r"runs AttnProcessor2_0.*Set activation_chunks to 'off'"):
            latent(loaded, MemoryStrategy(offload="none", activation_chunks=2), "wan2.1-t2v")
        assert blocks_as_found(loaded) == before  # block 0 passed the check but was never hooked
        # auto leaves it off and says why, instead of failing the run
        with chunks_for_call(loaded, MemoryStrategy(activation_chunks="auto"), request_for("wan2.1-t2v"), True,
                             1 << 30) as applied:
            assert applied.chunks == 1 and "AttnProcessor2_0" in applied.note
    finally:
        attn.processor = original


def test_chunking_after_the_step_cache_is_refused(tiny_loaded):
    """Wrapped after the cache, the chunked forward would bypass the cache's decision: refuse, say the order."""
    loaded = tiny_loaded("wan2.1-t2v")
    transformer = loaded.pipe.transformer
    transformer.enable_cache(FIRST_BLOCK.diffusers_config(10))
    try:
        blocks = denoiser_blocks(loaded.pipe, loaded.spec)
        with pytest.raises(ChunkError, match="must be applied before them"):
            with activation_chunks({"transformer": transformer}, blocks, 2):
                pass
    finally:
        transformer.disable_cache()


def test_auto_without_a_budget_chunks_nothing(tiny_loaded):
    loaded = tiny_loaded("wan2.1-t2v")
    reference, _ = latent(loaded, MemoryStrategy(offload="none"), "wan2.1-t2v")
    chunked, receipt = latent(loaded, MemoryStrategy(offload="none", activation_chunks="auto"), "wan2.1-t2v")
    assert torch.equal(chunked, reference) and "activation_chunks" not in receipt


def test_auto_asks_the_planner_with_the_runs_shape_and_budget(tiny_loaded, monkeypatch):
    """The wiring: the run hands auto's choice to the planner (whose choice is tested at real size below;
    the tiny models' activations are too small next to a CUDA context to tell slice counts apart)."""
    from vidmem.memory.plan import candidates

    asked = []

    def fewest(model, shape, strategy, options, vram):
        asked.append((shape, strategy.offload.value, vram))
        return replace(strategy, activation_chunks=2)

    monkeypatch.setattr(candidates, "fewest_chunks", fewest)
    loaded, request = tiny_loaded("wan2.1-t2v"), request_for("wan2.1-t2v")
    reference, _ = latent(loaded, MemoryStrategy(offload="none"), "wan2.1-t2v")
    chunked, receipt = latent(loaded, MemoryStrategy(offload="none", activation_chunks="auto"), "wan2.1-t2v",
                              RunHooks(device_budget=lambda device: 123 << 20))
    assert torch.equal(chunked, reference) and receipt["activation_chunks"]["chunks"] == 2
    shape, tier, vram = asked[0]
    assert (shape.width, shape.height, shape.frames, shape.cfg) == (request.width, request.height, request.frames, True)
    assert tier == "none" and vram >= 123 << 20  # plus what the warm store kept (the test below)


def test_auto_counts_the_warm_stores_copies_as_room_on_a_second_run(tiny_folder, tmp_path, monkeypatch):
    """The copies the warm store kept are this call's own weights (the planner counts them beside the
    activations) and are missing from the free figure: a warm second run must ask the planner with the
    same room as the first, not choose more slices."""
    from cuda_fake import FakeCuda
    from vidmem.memory.device import CudaBackend
    from vidmem.memory.plan import candidates
    from vidmem.memory.plan.costs import CUDA_CONTEXT_BYTES
    from vidmem.pipelines.loader import load_pipeline
    from vidmem.pipelines.prompt_cache import PromptCache

    asked, free = [], 1 << 30
    monkeypatch.setattr(candidates, "fewest_chunks", lambda model, shape, strategy, options, vram:
                        asked.append(vram) or replace(strategy, activation_chunks=1))
    FakeCuda().install(monkeypatch)
    loaded = load_pipeline(tiny_folder("wan2.1-t2v"), "fp32")  # its own: its warm store starts empty
    hooks = RunHooks(prompt_cache=PromptCache(tmp_path / "prompts"), device_budget=lambda device: free)
    backend, strategy = CudaBackend(torch.device("cpu")), MemoryStrategy(offload="none", activation_chunks="auto")
    first = sample(loaded, strategy, request_for("wan2.1-t2v"), hooks, backend=backend)
    sample(loaded, strategy, request_for("wan2.1-t2v"), hooks, backend=backend)
    kept = first.receipt["warm"]["kept_bytes"]
    assert kept > 0 and asked == [free + CUDA_CONTEXT_BYTES, free + kept + CUDA_CONTEXT_BYTES]  # the plan counts the context


def test_auto_leaves_chunking_off_under_sageattention_1_and_says_why(tiny_loaded, monkeypatch):
    """SageAttention 1.x cannot run in slices: auto runs unchunked with the reason in the receipt (an
    explicit count is refused by name), where it stopped the run blaming the user's auto."""
    from test_attention import SAGE1_RESOLVED, fake_sageattention, head_widths
    from vidmem.memory.plan import candidates
    from vidmem.pipelines import sample as sample_module
    from vidmem.pipelines.speed import ResolvedSpeed

    loaded = tiny_loaded("wan2.1-t2v")
    fake_sageattention(monkeypatch, widths=head_widths(loaded))
    monkeypatch.setattr(sample_module, "resolve_speed", lambda speed, *args, **kwargs: ResolvedSpeed(speed, SAGE1_RESOLVED))
    monkeypatch.setattr(candidates, "fewest_chunks", lambda model, shape, strategy, options, vram:
                        replace(strategy, activation_chunks=2))  # what the planner would say at a real size
    _, receipt = latent(loaded, MemoryStrategy(offload="none", activation_chunks="auto"), "wan2.1-t2v",
                        RunHooks(device_budget=lambda device: 1 << 30))
    assert receipt["activation_chunks"]["chunks"] == 1
    assert "sageattention 1.x cannot run in slices" in receipt["activation_chunks"]["note"]
    with pytest.raises(StrategyError, match="sageattention 1.x cannot run with activation_chunks=2"):
        latent(loaded, MemoryStrategy(offload="none", activation_chunks=2), "wan2.1-t2v")


def test_token_slices():
    assert token_slices(12, 3) == [slice(0, 4), slice(4, 8), slice(8, 12)]
    assert token_slices(13, 3) == [slice(0, 4), slice(4, 8), slice(8, 13)]
    assert token_slices(10, 3) == [slice(0, 5), slice(5, 10)]  # three slices would make one of 3 tokens
    assert token_slices(12, 64) == [slice(0, 4), slice(4, 8), slice(8, 12)]  # never under MIN_SLICE_TOKENS
    assert token_slices(3, 2) == [slice(0, 3)]


# --- the planner, real size on meta ------------------------------------------------------------------

SHAPE_720P = (1280, 720, 81)


@pytest.fixture(scope="module")
def wan14b():
    from vidmem.pipelines.configs import load_model

    return load_model("wan2.1-t2v-14b")


def _options(model):
    from vidmem.memory.plan.types import Allocator, PlanOptions

    return PlanOptions(storage=model.layout.stored_as("fp8_scaled"), allocator=Allocator.NATIVE, device="cuda")


def test_more_chunks_lower_the_predicted_denoise_peak_of_wan14b_at_720p(wan14b):
    from vidmem.memory.plan.stages import denoise_stage
    from vidmem.memory.plan.types import VideoShape

    shape, options = VideoShape(*SHAPE_720P), _options(wan14b)
    peaks = [denoise_stage(wan14b, shape, MemoryStrategy(offload="sequential", activation_chunks=n), options)
             .allocated_bytes for n in (1, 2, 4, 8)]
    assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == 4, peaks
    assert peaks[-1] < peaks[0] / 1.8  # slicing removes most of the block's full-size temporaries


def test_wan14b_720p_fits_8gib_with_chunks_and_not_without(wan14b):
    from vidmem.memory.plan.candidates import candidate_plans, recommended
    from vidmem.memory.plan.types import VideoShape
    from vidmem.memory.units import GiB

    shape, options = VideoShape(*SHAPE_720P), _options(wan14b)
    budgets = (8 * GiB, 32 * GiB)
    off = candidate_plans(wan14b, shape, *budgets, MemoryStrategy(activation_chunks="off"), options,
                          consider_disk=False)
    assert recommended(off) is None  # the starting point: activations overrun 8 GiB under every tier
    plans = candidate_plans(wan14b, shape, *budgets, MemoryStrategy(activation_chunks="auto"), options,
                            consider_disk=False)
    best = recommended(plans)
    assert best is not None, "\n".join(p.describe() for p in plans)
    chosen = plans[best]
    assert chosen.fits and chosen.strategy.activation_chunks > 1 and chosen.peak_vram_bytes <= 8 * GiB


@pytest.fixture(scope="module")
def hunyuan720p():
    from vidmem.pipelines.configs import load_model

    return load_model("hunyuanvideo1.5-t2v-720p")


def _hunyuan720p_denoise(model, strategy: MemoryStrategy, chunks: int):
    from vidmem.memory.plan.stages import denoise_stage
    from vidmem.memory.plan.types import VideoShape

    shape = VideoShape(1280, 720, 121)
    return denoise_stage(model, shape, replace(strategy, activation_chunks=chunks), _options(model))


def test_hunyuanvideo15_720p_block_swap_fits_8gib_once_its_block_is_sliced(hunyuan720p):
    """At 1280x720x121 (113,585 tokens with the text) the feed-forward's 8,192-wide intermediate and its GELU
    output are the block's largest tensors (1.7 GiB each), and they need segments of their own from the native
    allocator: sliced, the reservation under block swap of every block falls from 11.3 to 7.5 GiB (7.9 when
    only the feed-forward was sliced), and block swap fits 8 GiB, where only sequential did."""
    from vidmem.memory.units import GiB

    swap_all = MemoryStrategy(offload="block_swap", blocks_to_swap=hunyuan720p.weights("transformer").block_count)
    whole, sliced = (_hunyuan720p_denoise(hunyuan720p, swap_all, n) for n in (1, 2))
    assert sliced.allocated_bytes <= whole.allocated_bytes
    assert sliced.footprint(8 * GiB) <= 7.5 * GiB < 11 * GiB < whole.footprint(8 * GiB)


def test_hunyuanvideo15_720p_fits_6gib_once_its_attention_half_is_sliced(hunyuan720p):
    """The attention half over query slices too (its projections per slice, keys and values of every token, each
    slice's queries against them): the bytes allocated fall with the count (6.22 GB unchunked; 4.85, 3.71, 3.14 GB
    at 2, 4, 8 under block swap of every block, where slicing the feed-forward alone left 6.21 at every count),
    and 6 GiB fits: block swap of every block at 4 slices (5.3 GiB reserved), sequential at 2 (5.5 GiB)."""
    from vidmem.memory.units import GiB

    swap_all = MemoryStrategy(offload="block_swap", blocks_to_swap=hunyuan720p.weights("transformer").block_count)
    allocated = [_hunyuan720p_denoise(hunyuan720p, swap_all, n).allocated_bytes for n in (1, 2, 4, 8)]
    assert allocated == sorted(allocated, reverse=True) and allocated[-1] < 3.2e9 < 6.2e9 < allocated[0]
    assert _hunyuan720p_denoise(hunyuan720p, swap_all, 4).footprint(6 * GiB) <= 5.4 * GiB
    sequential = MemoryStrategy(offload="sequential")
    assert _hunyuan720p_denoise(hunyuan720p, sequential, 2).footprint(6 * GiB) <= 5.6 * GiB
    assert _hunyuan720p_denoise(hunyuan720p, sequential, 1).footprint(6 * GiB) > 6 * GiB


def test_fewest_chunks_is_the_fewest_that_fit(wan14b):
    from vidmem.memory.plan.candidates import CHUNK_STEPS, fewest_chunks
    from vidmem.memory.plan.stages import denoise_stage
    from vidmem.memory.plan.types import VideoShape
    from vidmem.memory.units import GiB

    shape, options, vram = VideoShape(*SHAPE_720P), _options(wan14b), 8 * GiB
    strategy = MemoryStrategy(offload="sequential", activation_chunks="auto")
    chosen = fewest_chunks(wan14b, shape, strategy, options, vram).activation_chunks
    fits = {n: denoise_stage(wan14b, shape, replace(strategy, activation_chunks=n), options).fits(vram)
            for n in CHUNK_STEPS if n <= chosen}
    assert chosen > 1 and fits[chosen] and not any(fits[n] for n in fits if n < chosen), fits
    assert fewest_chunks(wan14b, shape, strategy, options, None).activation_chunks == 1  # no budget: nothing chunked


def test_auto_chunks_at_the_users_own_blocks_to_swap(wan14b):
    """An explicit blocks_to_swap is what runs: auto's slices are chosen at it, not at every block swapped
    (which chose 1 slice where 20 swapped blocks need 2: the plan said "does not fit" and the run ran out
    of memory). The planner's own tier rows still probe the leanest blocks, choosing blocks afterwards."""
    from vidmem.memory.plan.candidates import fewest_chunks, plan_run
    from vidmem.memory.plan.types import Allocator, PlanOptions, VideoShape
    from vidmem.memory.units import GiB

    shape, options, vram = VideoShape(*SHAPE_720P), PlanOptions(allocator=Allocator.NATIVE, device="cuda"), 24 * GiB
    strategy = MemoryStrategy(offload="block_swap", blocks_to_swap=20, activation_chunks="auto")  # bf16 weights
    plan = plan_run(wan14b, shape, strategy, options, vram, 128 * GiB)
    assert plan.strategy.activation_chunks > 1 and plan.stage("denoise").fits(vram)
    assert fewest_chunks(wan14b, shape, strategy, options, vram, leanest_blocks=True).activation_chunks == 1


def test_the_advice_names_activation_chunks(wan14b):
    from vidmem.memory.plan.advice import nothing_fits_message, over_budget_lines
    from vidmem.memory.plan.candidates import candidate_plans, plan_run
    from vidmem.memory.plan.types import VideoShape
    from vidmem.memory.units import GiB

    shape, options, budgets = VideoShape(*SHAPE_720P), _options(wan14b), (8 * GiB, 32 * GiB)
    off = MemoryStrategy(activation_chunks="off")
    plans = candidate_plans(wan14b, shape, *budgets, off, options, consider_disk=False)
    message = nothing_fits_message(wan14b, shape, plans, off, options, consider_disk=False)
    assert "With activation_chunks auto (--activation-chunks auto" in message, message
    assert "activation_chunks=" in message.split("With activation_chunks auto")[1]  # the plan that fits, with its count
    plan = plan_run(wan14b, shape, MemoryStrategy(offload="block_swap", blocks_to_swap=40), options, *budgets)
    lines = over_budget_lines(wan14b, plan)
    assert any(line.startswith("denoise:") and "fix: activation_chunks " in line for line in lines), lines


# --- the node and its plan route -------------------------------------------------------------------------

def test_the_node_passes_activation_chunks_and_keeps_it_last():
    from vidmem.nodes.strategy import CHUNK_CHOICES, WIDGETS, VidMemMemoryStrategy

    optional = VidMemMemoryStrategy.INPUT_TYPES()["optional"]
    assert list(optional)[-1] == "activation_chunks"  # saved workflows' positional values keep their meaning
    assert "activation_chunks" not in WIDGETS
    assert list(optional["activation_chunks"][0]) == list(CHUNK_CHOICES) and optional["activation_chunks"][1]["default"] == "auto"
    widgets = {name: spec[1].get("default") for name, spec in VidMemMemoryStrategy.INPUT_TYPES()["required"].items()}
    choice = VidMemMemoryStrategy().build(**widgets, activation_chunks="8")["result"][0]
    assert choice.strategy.activation_chunks == 8
    default = VidMemMemoryStrategy().build(**widgets)["result"][0]
    assert default.strategy.chunks_auto


def test_the_plan_route_reads_activation_chunks(tiny_folder, monkeypatch):
    from vidmem.nodes import host, plan_files
    from vidmem.nodes.plan_route import PlanRequestError, parse_request, plan_answer
    from vidmem.pipelines.configs import load_model
    from vidmem.pipelines.loader import DTYPES

    path = tiny_folder("wan2.1-t2v")
    monkeypatch.setattr(host, "resolve_model_folder", lambda name, given: path)
    plan_files._folder_storage.cache_clear()
    query = {"model": "Wan-tiny", "dtype": "fp32", "width": "32", "height": "32", "frames": "9", "offload": "none",
             "activation_chunks": "2"}
    answer = plan_answer(parse_request(query, ["Wan-tiny"], list(DTYPES)), lambda name, dtype: load_model(str(path), dtype),
                         (8 * 2**30, 32 * 2**30))
    assert answer["status"] == "ok", answer
    mine = answer["rows"][answer["chosen"]]
    assert mine["label"] == "your settings" and "activation_chunks=2" in mine["strategy"]
    assert all(row["label"].endswith("chunks 2") for row in answer["rows"][:-1])
    with pytest.raises(PlanRequestError, match="activation_chunks='3' must be one of auto, off, 2, 4") as error:
        parse_request({**query, "activation_chunks": "3"}, ["Wan-tiny"], list(DTYPES))
    assert error.value.name == "activation_chunks"
