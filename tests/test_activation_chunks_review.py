"""Activation chunks, the review's findings (pipelines/activation_chunks.py, memory/plan/stages.py):
slices that keep the CPU attention kernel's query blocks, Wan 2.2 TI2V's per-token modulation built a slice at
a time, the slices that ran in the receipt, the sequential tier's copies counted as they run, and the
planner passing a chunk refusal on unchanged.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vidmem.memory import MemoryStrategy
from vidmem.pipelines.activation_chunks import (MIN_SLICE_TOKENS, activation_chunks, query_block, token_slices,
                                                wan_block_forward)

# Token counts whose equal slices leave a query block of 1-3 rows (1540 / 2: 770 = 3 x 256 + 2), and ones
# where the whole run itself ends in such a block (1025 = 4 x 256 + 1).
UNEVEN = ((1540, 2), (2306, 3), (4100, 4), (1025, 4), (1027, 3), (769, 2), (193, 2), (35, 3))


def _sliced_attention(tokens: int, chunks: int, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(tokens)
    q, k, v = (torch.randn(1, 2, tokens, 64, dtype=dtype) for _ in range(3))
    whole = F.scaled_dot_product_attention(q, k, v)
    slices = token_slices(tokens, chunks)
    sliced = torch.cat([F.scaled_dot_product_attention(q[:, :, rows], k, v) for rows in slices], 2)
    return whole, sliced


@pytest.mark.parametrize("tokens, chunks", UNEVEN)
def test_slices_keep_the_cpu_attention_bit_identical_in_float32(tokens, chunks):
    whole, sliced = _sliced_attention(tokens, chunks)
    assert torch.equal(sliced, whole)


def _assert_wan_block_chunks_bit_identical(tokens: int, per_token_temb: bool) -> None:
    """A diffusers Wan block against wan_block_forward at 2, 3, 4 and 8 chunks, float32."""
    from diffusers.models.transformers.transformer_wan import WanTransformerBlock

    torch.manual_seed(0)
    channels = 64
    block = WanTransformerBlock(channels, 128, 2, "rms_norm_across_heads", True, 1e-6).eval()
    hidden, text = torch.randn(1, tokens, channels), torch.randn(1, 8, channels)
    # per token, as Wan 2.2 TI2V hands it; else one row broadcast over the tokens
    temb = torch.randn(1, tokens, 6, channels) if per_token_temb else torch.randn(1, 6, channels)
    rope = (torch.randn(1, tokens, 1, 32), torch.randn(1, tokens, 1, 32))
    with torch.no_grad():
        reference = block(hidden, text, temb, rope)
        for chunks in (2, 3, 4, 8):
            assert torch.equal(wan_block_forward(block, chunks, hidden, text, temb, rope), reference), chunks


def test_a_wan_block_chunked_at_an_uneven_size_is_bit_identical():
    """The same through the whole chunked block (float32: the kernel's blocks show there, not in bf16)."""
    _assert_wan_block_chunks_bit_identical(1540, per_token_temb=False)


# (video tokens, text tokens): even; equal video slices leaving a 1-3 row block (1540 / 2); the video alone ending
# in a 1-row block (1025 = 4 x 256 + 1: followed by text, its rows do not end the run); the whole run ending
# in a 2-row block (733 + 37 = 770 = 3 x 256 + 2) the text's 37 rows alone would not end in (`_text_lead`: 29).
HUNYUAN_SIZES = ((96, 40), (1540, 37), (1025, 40), (733, 37))


@pytest.mark.parametrize("video, text", HUNYUAN_SIZES)
@pytest.mark.parametrize("keys_only", [False, True], ids=["diffusers_mask", "keys_only_mask"])
def test_a_hunyuanvideo15_block_chunked_is_bit_identical_with_either_mask(video, text, keys_only, monkeypatch):
    """HunyuanVideo 1.5's joint attention over query slices against diffusers' block, float32, a batch of two
    with the text padded differently per row: every output row bit for bit, video and text, under diffusers'
    own processor (padded text rows attend to nothing: zeros) and under vidmem's keys-only wrapper (padded rows
    hold values nothing reads: the same values here too); and again with queries not parked (another dtype than
    the output's: made again in the second pass, the text's lead too)."""
    from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15TransformerBlock

    from vidmem.pipelines import activation_chunks as chunking
    from vidmem.pipelines.activation_chunks import _text_lead, hunyuan_video15_block_forward
    from vidmem.pipelines.hunyuan_video15_attention import KeyMaskedAttention

    torch.manual_seed(video)
    block = HunyuanVideo15TransformerBlock(2, 64, mlp_ratio=2.0).eval()  # head dim 64: 32 hides the lead's need
    if keys_only:
        block.attn.processor = KeyMaskedAttention(block.attn.processor, exact_mask_bytes=0)
    hidden, context, temb = torch.randn(2, video, 128), torch.randn(2, text, 128), torch.randn(2, 128)
    mask = torch.zeros(2, text)
    mask[0], mask[1, : text // 2] = 1, 1  # the first prompt fills the text: its last rows are valid
    rope = (torch.randn(video, 64), torch.randn(video, 64))
    assert (_text_lead(video, text) > 0) == (video == 733)
    with torch.no_grad():
        reference = block(hidden, context, temb, mask, rope)
        for chunks in (2, 3, 4):
            chunked = hunyuan_video15_block_forward(block, chunks, hidden, context, temb, mask, rope)
            assert torch.equal(chunked[0], reference[0]) and torch.equal(chunked[1], reference[1]), chunks
        project, parked = chunking._slice_projections, []

        def not_parked(run, step, block, hidden, slices, out, *args):
            found = project(run, step, block, hidden, slices, out.double(), *args)
            parked.append(found[2])
            return found

        monkeypatch.setattr(chunking, "_slice_projections", not_parked)
        chunked = hunyuan_video15_block_forward(block, 3, hidden, context, temb, mask, rope)
        assert parked == [False] and torch.equal(chunked[0], reference[0]) and torch.equal(chunked[1], reference[1])


def test_token_slices_keep_their_other_guarantees():
    for tokens in [*range(1, 300), 1025, 1540, 2306, 4100, 17550, 27280, 75521, 75600]:
        for chunks in (1, 2, 3, 4, 7, 16, 64):
            slices = token_slices(tokens, chunks)
            sizes = [rows.stop - rows.start for rows in slices]
            assert slices[0].start == 0 and slices[-1].stop == tokens
            assert all(a.stop == b.start for a, b in zip(slices, slices[1:]))
            assert len(slices) <= chunks and (min(sizes) >= MIN_SLICE_TOKENS or len(slices) == 1)
            # near an even share: the last slice moves by at most half a 256-row block to end as the whole run does
            assert max(sizes) <= -(-tokens // len(slices)) + query_block(256 * 3) // 2 + MIN_SLICE_TOKENS
    assert token_slices(13, 3) == [slice(0, 4), slice(4, 8), slice(8, 13)]  # equal slices where they are exact
    assert len(token_slices(75600, 64)) == 64 and len(token_slices(1540, 2)) == 2  # real sizes: every slice asked


# --- Wan 2.2 TI2V: per-token modulation ------------------------------------------------------------------

def test_ti2v_per_token_modulation_is_bit_identical():
    _assert_wan_block_chunks_bit_identical(64, per_token_temb=True)


def test_ti2v_per_token_modulation_is_sliced_too():
    """One real-size TI2V-5B block at 1280x704x121 on meta: built whole, the modulation's float32 copy and sum
    (1.9 GiB each) stayed through the block and chunks barely lowered its peak (3.75 GiB at 4 slices, 3.80
    unchunked); a slice at a time, the peak is that of broadcast modulation."""
    from diffusers.models.transformers.transformer_wan import WanTransformerBlock

    from vidmem.memory.accounting import Attention, trace

    tokens, channels = 31 * 22 * 40, 3072
    with torch.device("meta"):
        block = WanTransformerBlock(channels, 14336, 24, "rms_norm_across_heads", True, 1e-6).to(torch.bfloat16)
    block.scale_shift_table.data = block.scale_shift_table.data.float()  # diffusers keeps it in float32
    hidden = torch.empty(1, tokens, channels, dtype=torch.bfloat16, device="meta")
    text = torch.empty(1, 512, channels, dtype=torch.bfloat16, device="meta")
    rope = tuple(torch.empty(1, tokens, 1, 128, device="meta") for _ in range(2))
    per_token = torch.empty(1, tokens, 6, channels, dtype=torch.bfloat16, device="meta")
    broadcast = torch.empty(1, 6, channels, dtype=torch.bfloat16, device="meta")

    def peak(fn) -> int:
        return trace(fn, Attention.FUSED).peak_bytes

    unchunked = peak(lambda: block(hidden, text, per_token, rope))
    chunked = peak(lambda: wan_block_forward(block, 4, hidden, text, per_token, rope))
    assert chunked <= peak(lambda: wan_block_forward(block, 4, hidden, text, broadcast, rope)) * 1.02
    assert chunked < unchunked / 3, (chunked, unchunked)


# --- the receipt: slices that ran --------------------------------------------------------------------------

def test_the_receipt_says_how_many_slices_ran():
    from diffusers.models.transformers.transformer_wan import WanTransformerBlock

    torch.manual_seed(0)
    block = WanTransformerBlock(32, 64, 2, "rms_norm_across_heads", False, 1e-6).eval()
    hidden, text, temb = torch.randn(1, 40, 32), torch.randn(1, 8, 32), torch.randn(1, 6, 32)
    for asked, ran in ((7, 7), (64, 10)):  # 40 tokens: at most 10 slices of MIN_SLICE_TOKENS
        with torch.no_grad(), activation_chunks({"t": block}, {"t": [block]}, asked) as applied:
            assert "slices" not in applied.as_dict()  # nothing ran yet
            block(hidden, text, temb, None)
        assert applied.as_dict()["chunks"] == asked and applied.as_dict()["slices"] == [ran]


def test_the_receipt_counts_the_slices_hunyuanvideo15_cuts():
    """HunyuanVideo 1.5's video slices are followed by the text's queries, so they keep their own rule
    (`token_slices(followed=True)`): 33 video tokens in 2 chunks run 2 slices there, where the unfollowed rule would
    leave 1 (a 1-row last query block otherwise). The receipt counts what the forward ran."""
    from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15TransformerBlock

    from vidmem.pipelines import activation_chunks as chunking

    assert (len(token_slices(33, 2)), len(token_slices(33, 2, followed=True))) == (1, 2)
    torch.manual_seed(0)
    block = HunyuanVideo15TransformerBlock(2, 64, mlp_ratio=2.0).eval()
    hidden, context, temb = torch.randn(1, 33, 128), torch.randn(1, 8, 128), torch.randn(1, 128)
    rope = (torch.randn(33, 64), torch.randn(33, 64))
    cut = []
    original = chunking._slice_projections

    def counting(run, step, block, hidden, slices, *args):
        cut.append(len(slices))
        return original(run, step, block, hidden, slices, *args)

    with torch.no_grad(), activation_chunks({"t": block}, {"t": [block]}, 2) as applied:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(chunking, "_slice_projections", counting)
            block(hidden, context, temb, torch.ones(1, 8), rope)
    assert cut == [2] and applied.as_dict()["slices"] == [2]


def test_a_sampled_receipt_names_the_slices_that_ran(tiny_loaded):
    from backends import StrictBackend
    from test_tiers import request_for
    from vidmem.pipelines.sample import sample

    loaded = tiny_loaded("wan2.1-t2v")
    receipt = sample(loaded, MemoryStrategy(offload="none", activation_chunks=64), request_for("wan2.1-t2v"),
                     backend=StrictBackend()).receipt["activation_chunks"]
    assert receipt["chunks"] == 64 and len(receipt["slices"]) == 1 and receipt["slices"][0] < 64


# --- the planner ----------------------------------------------------------------------------------------

def test_the_planner_passes_a_chunk_refusal_on_unchanged(capsys):
    """A family whose blocks cannot chunk: the advice is activation_chunks', not "change width, height or frames"."""
    from vidmem.cli import main

    assert main(["plan", "--model", "ltx2-t2v-19b", "--vram", "8", "--ram", "64", "--activation-chunks", "4"]) == 2
    error = capsys.readouterr().err
    assert "cannot be chunked" in error and "Set activation_chunks to 'off'" in error
    assert "change width, height or frames" not in error


@pytest.mark.parametrize("name", ["cogvideox-5b", "wan2.1-t2v-1.3b"])
def test_sequential_traffic_counts_the_copies_that_run(name):
    """Sequential copies a layer per call. Chunked, a block calls its per-token layers once per slice (CogVideoX's
    feed-forward and norm2's norm once more, for the text tokens, where diffusers' norm2 called it twice), but
    CogVideoX's attention once, Wan's cross-attention keys and values once (the text's, the same for every slice), and
    the layers outside the blocks once: the extra bytes are those layers', not every streamed layer's."""
    from vidmem.memory.plan.stages import component_weights, denoise_stage
    from vidmem.memory.plan.types import Allocator, PlanOptions, VideoShape
    from vidmem.pipelines.configs import load_model

    model = load_model(name)
    options = PlanOptions(allocator=Allocator.NATIVE, device="cuda")
    shape = VideoShape(720, 480, 49) if name.startswith("cogvideox") else VideoShape(832, 480, 81)
    per_pass = {n: denoise_stage(model, shape, MemoryStrategy(offload="sequential", activation_chunks=n), options)
                .work[-1].traffic.per_pass_bytes for n in (1, 4)}
    table = component_weights(model, model.layout.denoisers[0], options).table
    _, units, heads = table.units(MemoryStrategy(offload="sequential"))
    block_of = dict(zip(table.modules, table.block))
    if name.startswith("cogvideox"):
        def extra(head): return 4 if ".ff." in head else 3 if head.endswith(".norm2.norm") else 0
    else:
        def extra(head):  # "blocks.7": its own table; cross-attention's keys and values are made once per call
            once = any(f".attn2.{layer}" in head for layer in ("to_k", "to_v", "norm_k", "add_k_proj", "add_v_proj",
                                                                 "norm_added_k"))
            return 3 if block_of[head] >= 0 and head.count(".") > 1 and not once else 0
    expected = sum(extra(head) * sum(table.nbytes(units[unit])) for head, unit in heads.items())
    assert per_pass[4] - per_pass[1] == expected > 0
