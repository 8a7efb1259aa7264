"""The node text of a sampler receipt names the sampler, the LoRAs, every out-of-memory rung and what activation
chunks did."""

from __future__ import annotations

from vidmem.nodes.receipts import format_receipt


def test_sampler_lora_and_ladder_lines():
    receipt = {
        "strategy": "offload=sequential", "device": "cuda:0", "sampler": "unipc, shift 3.0",
        "lora": "LoRA: style.safetensors x0.8 (+1.0 MiB beside the layers)",
        "oom_ladder": [{"failed": "offload=block_swap blocks_to_swap=10", "at_step": 4, "resumed_from_step": 3,
                        "next": "offload=sequential", "chosen_by": "planner", "cleanup": {}}],
        "text_encode": {"prompt": {"tokens": 600, "kept": 512, "cut": 88, "max_sequence_length": 512}, "cache": "used"},
    }
    text = format_receipt("Video Sampler", receipt)
    assert "sampler: unipc, shift 3.0" in text and "style.safetensors x0.8" in text
    assert ("out of memory at step 4 under offload=block_swap blocks_to_swap=10: resumed after step 3 "
            "with offload=sequential (chosen by the planner)") in text
    assert "prompt: 600 tokens, 88 cut (the encoder reads 512); embeddings cache: used" in text
    assert "LoRA" not in format_receipt("Video Sampler", {"lora": "no LoRA"})


def test_a_rung_taken_while_placing_the_weights_says_it_started_again():
    """at_step 0: the weights did not fit while being placed, no step had run (pipelines/sample.py)."""
    receipt = {"oom_ladder": [{"failed": "offload=none", "at_step": 0, "resumed_from_step": 0,
                               "next": "offload=model", "chosen_by": "fixed ladder", "cleanup": {}}]}
    text = format_receipt("Video Sampler", receipt)
    assert ("out of memory before the first step under offload=none: started again with offload=model "
            "(chosen by the fixed ladder)") in text
    assert "resumed after step" not in text


def test_activation_chunks_say_what_ran_and_why_auto_left_them_off():
    ran = {"activation_chunks": {"chunks": 4, "blocks": 40, "slices": [4], "family": "wan"}}
    assert "activation chunks: 40 wan blocks in 4 token slices" in format_receipt("Video Sampler", ran)
    off = {"activation_chunks": {"chunks": 1, "blocks": 0, "note": "ltx2 blocks cannot be chunked"}}
    assert "activation chunks: off (ltx2 blocks cannot be chunked)" in format_receipt("Video Sampler", off)
    assert "activation chunks" not in format_receipt("Video Sampler", {"activation_chunks": {"chunks": 1, "blocks": 0}})
