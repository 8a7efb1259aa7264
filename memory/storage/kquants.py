"""Quantizers for GGUF's k-quants (Q4_K, Q5_K, Q6_K), which the `gguf` package cannot make.

Plain rounding, per ggml's block layouts (ggml-common.h): a super-block of 256 weights holds 8
sub-blocks of 32 (Q4_K, Q5_K: 6-bit scale and min each, under fp16 super-scales d and dmin) or
16 sub-blocks of 16 (Q6_K: int8 scales under an fp16 d). Unlike llama.cpp's quantizer there is
no importance-weighted search for the best scales, so the error is somewhat larger than a
llama.cpp file of the same type; the blocks are valid and dequantize with any GGUF reader. Used
for the loader's `weight_dtype` choice and to write test and bench files.
"""

from __future__ import annotations

import torch

QK_K = 256


def quantize_k(values: torch.Tensor, kind: str) -> torch.Tensor:
    """`values` (float32, numel a multiple of 256) as raw uint8 blocks [n_blocks, block_bytes]."""
    blocks = values.to(torch.float32).reshape(-1, QK_K)
    if kind == "Q6_K":
        return _q6_k(blocks)
    return _q45_k(blocks, bits=4 if kind == "Q4_K" else 5)


def _fp16_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).reshape(-1, 1).view(torch.uint8)


def _safe_div(x: torch.Tensor, by: torch.Tensor) -> torch.Tensor:
    return torch.where(by > 0, x / torch.where(by > 0, by, torch.ones_like(by)), torch.zeros_like(x))


def _q45_k(blocks: torch.Tensor, bits: int) -> torch.Tensor:
    n = blocks.shape[0]
    sub = blocks.reshape(n, 8, 32)
    low = sub.amin(-1).clamp(max=0)
    scale = (sub.amax(-1).clamp(min=0) - low) / (2**bits - 1)  # [n, 8]
    offset = -low
    d = (scale.amax(-1, keepdim=True) / 63).to(torch.float16).to(torch.float32)
    dmin = (offset.amax(-1, keepdim=True) / 63).to(torch.float16).to(torch.float32)
    sc = _safe_div(scale, d).round().clamp(0, 63).to(torch.uint8)
    mn = _safe_div(offset, dmin).round().clamp(0, 63).to(torch.uint8)
    step = (d * sc.to(torch.float32))[..., None]
    q = _safe_div(sub + (dmin * mn.to(torch.float32))[..., None], step).round().clamp(0, 2**bits - 1).to(torch.uint8)
    scales = torch.cat([
        (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6),
        (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6),
        (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4),
    ], dim=1)
    low_bits = q & 15
    qs = (low_bits[:, 0::2] | (low_bits[:, 1::2] << 4)).reshape(n, 128)
    parts = [_fp16_bytes(d), _fp16_bytes(dmin), scales]
    if bits == 5:
        high = (q >> 4) & 1  # [n, 8, 32]: bit j of qh[l] is sub-block j's fifth bit
        shifts = torch.arange(8, dtype=torch.uint8).reshape(1, 8, 1)
        parts.append((high << shifts).sum(dim=1, dtype=torch.int32).to(torch.uint8))
    return torch.cat([*parts, qs], dim=1)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    sub = blocks.reshape(n, 16, 16)
    scale = sub.abs().amax(-1) / 32  # [n, 16]
    d = (scale.amax(-1, keepdim=True) / 127).to(torch.float16).to(torch.float32)
    sc = _safe_div(scale, d).round().clamp(-128, 127)
    step = (d * sc)[..., None]
    q = (_safe_div(sub, step).round().clamp(-32, 31) + 32).to(torch.uint8).reshape(n, QK_K)
    # Element e sits in row r = e // 32 of 8: ql keeps its low 4 bits at byte (r//4)*64 + (r%2)*32 + l,
    # nibble (r//2)%2; qh keeps its top 2 bits at byte (r//4)*32 + l, shift 2*(r%4).
    rows = q.reshape(n, 2, 2, 2, 32)  # (half, nibble, part, l)
    ql = ((rows[:, :, 0] & 15) | ((rows[:, :, 1] & 15) << 4)).reshape(n, 128)
    high = (q.reshape(n, 2, 4, 32) >> 4) & 3  # (half, shift index, l)
    shifts = (2 * torch.arange(4, dtype=torch.uint8)).reshape(1, 1, 4, 1)
    qh = (high << shifts).sum(dim=2, dtype=torch.int32).to(torch.uint8).reshape(n, 64)
    return torch.cat([ql, qh, sc.to(torch.int8).view(torch.uint8), _fp16_bytes(d)], dim=1)
