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
        if rung["at_step"] == 0:  # placing the weights: no step had run
            lines.append(f"out of memory before the first step under {rung['failed']}: started again with "
                         f"{rung['next']} (chosen by the {rung['chosen_by']})")
            continue
        lines.append(f"out of memory at step {rung['at_step']} under {rung['failed']}: resumed after step "
                     f"{rung['resumed_from_step']} with {rung['next']} (chosen by the {rung['chosen_by']})")
    if receipt.get("activation_chunks"):
        line = chunks_line(receipt["activation_chunks"])
        if line:
            lines.append(line)
    if receipt.get("windows", {}).get("summary"):  # context windows (pipelines/context_windows.py)
        lines.append(receipt["windows"]["summary"])
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
            + swap_routes(swap)
        )
    if "warm" in receipt:  # weights a previous call left on the device (docs/warm-runs.md)
        lines.append(receipt["warm"]["summary"])
    if "residency" in receipt and receipt["residency"].get("kept_groups"):
        lines.append(f"kept on the device while memory was free: {receipt['residency']['kept_groups']} streamed groups "
                     f"({human_bytes(receipt['residency']['kept_bytes'])})")
    if "cache" in receipt:
        lines.append(cache_line(receipt["cache"]))
    if "plan" in receipt:
        lines.append(receipt["plan"])
    if "saved_latents" in receipt:
        lines.append(f"latents saved to input/{receipt['saved_latents']} (core Load Latent lists it)")
    if "decode_summary" in receipt:
        lines.append("VAE: " + receipt["decode_summary"])
    if "tiling_note" in receipt:  # the family raised a default tile, or warns of a small one (pipelines/decode.py)
        lines.append("VAE tiles: " + receipt["tiling_note"])
    if "note" in receipt:  # Memory Strategy values this tier ignores (nodes/strategy.py strategy_notes)
        lines.append("note: " + receipt["note"])
    return "\n".join(lines)


def swap_routes(swap: dict) -> str:
    """How streamed bytes crossed (memory/hostpool.py upload_route): pageable ones synchronously."""
    parts = [f"{human_bytes(swap[f'{route}_bytes'])} {route}" for route in ("pinned", "staged", "pageable")
             if swap.get(f"{route}_bytes")]
    return f"; streamed {', '.join(parts)}" if parts else ""


def chunks_line(chunks: dict) -> str:
    """What activation chunks did (pipelines/activation_chunks.py AppliedChunks.as_dict): the blocks and the token
    slices they ran in, which may be fewer than asked for few tokens; why auto left them off; "" when off."""
    if chunks.get("chunks", 1) > 1:
        slices = "/".join(map(str, chunks.get("slices", []))) or str(chunks["chunks"])
        family = f" {chunks['family']}" if chunks.get("family") else ""
        return f"activation chunks: {chunks['blocks']}{family} blocks in {slices} token slices"
    return f"activation chunks: off ({chunks['note']})" if chunks.get("note") else ""


def cache_line(cache: dict) -> str:
    """Step cache: blocks computed of all, and the copies it saved under block swap."""
    total = cache["blocks_computed"] + cache["blocks_skipped"]
    line = f"step cache {cache['method']}: {cache['blocks_computed']} of {total} blocks computed ({cache['blocks_computed_share']:.0%})"
    if cache.get("streamed_copies_skipped"):
        line += f", {cache['streamed_copies_skipped']} streamed copies saved"
    if cache.get("ratios_file"):
        line += f"; ratios saved as {cache['ratios_file']} (pick it in Step Cache's mag_ratios)"
    if cache.get("note"):
        line += f" ({cache['note']})"
    return line


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
