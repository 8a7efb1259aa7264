"""Receipts as text for the node UI: one figure per line, bytes in GiB/MiB."""

from __future__ import annotations

from ..memory.units import human_bytes  # noqa: F401 (the nodes' formatter, public here)


def format_receipt(title: str, receipt: dict) -> str:
    lines = [title]
    for key in ("strategy", "device", "sampler"):
        if key in receipt:
            lines.append(f"{key}: {receipt[key]}")
    if receipt.get("lora") and receipt["lora"] != "no LoRA":
        lines.append(receipt["lora"])
    for rung in receipt.get("oom_ladder", []):
        lines.append(f"out of memory at step {rung['at_step']} under {rung['failed']}: resumed after step "
                     f"{rung['resumed_from_step']} with {rung['next']} (chosen by the {rung['chosen_by']})")
    if "device_weight_bytes" in receipt:
        lines.append(f"weights on device at peak: {human_bytes(receipt['device_weight_bytes'])}")
    if "text_encode" in receipt:
        lines.append(prompt_line(receipt["text_encode"]))
    for stage in receipt.get("stages", []):
        peak = f"peak RSS {human_bytes(stage.get('peak_rss_bytes'))}"
        if "peak_allocated_bytes" in stage:
            peak = f"peak VRAM {human_bytes(stage['peak_allocated_bytes'])}, " + peak
        lines.append(f"{stage['stage']}: {stage['seconds']:.2f} s, {peak}")
    if "swap" in receipt:
        swap = receipt["swap"]
        lines.append(
            f"swap cost: {swap['swap_cost']:.1%} of step time ({human_bytes(swap['bytes_moved'])} moved, "
            f"copies {swap['copy_s']:.2f} s, waited {swap['wait_s']:.2f} s, {swap['groups']} streamed groups)"
        )
    if "plan" in receipt:
        lines.append(receipt["plan"])
    if "saved_latents" in receipt:
        lines.append(f"latents saved to input/{receipt['saved_latents']} (core Load Latent lists it)")
    if "decode_summary" in receipt:
        lines.append("VAE: " + receipt["decode_summary"])
    if "note" in receipt:  # Memory Strategy values this tier ignores (nodes/strategy.py strategy_notes)
        lines.append("note: " + receipt["note"])
    return "\n".join(lines)


def prompt_line(text_encode: dict) -> str:
    """One line: tokens per text (and how many the encoder cut), and what the embeddings cache did."""
    parts = []
    for role, label in (("prompt", "prompt"), ("negative_prompt", "negative")):
        counts = text_encode.get(role)
        if isinstance(counts, dict):
            cut = f", {counts['cut']} cut (the encoder reads {counts['max_sequence_length']})" if counts.get("cut") else ""
            parts.append(f"{label}: {counts['tokens']} tokens{cut}")
    parts.append(f"embeddings cache: {text_encode.get('cache', 'off')}")
    return "; ".join(parts)
