"""Dequantization of ggml's block formats in torch, on any device, in float32.

The formulas and their order of operations are those of diffusers' port of city96's
ComfyUI-GGUF dequantizers (`diffusers.quantizers.gguf.utils`), so the bits equal theirs and the
`gguf` package's numpy reference (both checked by the tests). One difference, and the reason this
file exists: diffusers builds its bit-shift constants with `torch.tensor([...], device=...)`, a
synchronous host-to-device copy that stalls the CPU until the GPU has finished all queued work,
on every layer. That would stop block swap from queueing the next block's copy while the current
one computes. Here every shift is a Python integer: dequantizing queues kernels and returns.

Every function takes raw blocks [n_blocks, block_bytes] (uint8) and returns [n_blocks, block_size].
"""

from __future__ import annotations

import torch

QK_K = 256
K_SCALE_SIZE = 12


def _split(blocks: torch.Tensor, *sizes: int) -> tuple[torch.Tensor, ...]:
    return torch.split(blocks, [*sizes, blocks.shape[1] - sum(sizes)], dim=1)


def _half(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.float16).to(torch.float32)


def _nibbles(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """Low nibbles, then high nibbles, stacked along a new axis `dim`."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=dim)


def _bits(packed: torch.Tensor, dim: int, width: int = 1) -> torch.Tensor:
    """Fields of `width` bits (lowest first) of each byte, stacked along a new axis `dim`."""
    mask = (1 << width) - 1
    return torch.stack([(packed >> shift) & mask for shift in range(0, 8, width)], dim=dim)


def _scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The k-quants' eight 6-bit scales and mins, packed in 12 bytes."""
    n = scales.shape[0]
    d, m, m_d = torch.split(scales.reshape(n, 3, 4), 1, dim=1)
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mins = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc.reshape(n, 8), mins.reshape(n, 8)


def q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d, x = _split(blocks, 2)
    return _half(d) * x.view(torch.int8)


def q4_0(blocks: torch.Tensor) -> torch.Tensor:
    d, qs = _split(blocks, 2)
    q = _nibbles(qs, 1).reshape(blocks.shape[0], -1).to(torch.int8) - 8
    return _half(d) * q


def q4_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m, qs = _split(blocks, 2, 2)
    return (_half(d) * _nibbles(qs, 1).reshape(blocks.shape[0], -1)) + _half(m)


def _q5_values(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    n = qs.shape[0]
    high = _bits(qh, 2).reshape(n, 32)  # bit j of the little-endian 32-bit qh, for weight j
    return _nibbles(qs, 1).reshape(n, -1) | (high << 4)


def q5_0(blocks: torch.Tensor) -> torch.Tensor:
    d, qh, qs = _split(blocks, 2, 4)
    return _half(d) * (_q5_values(qh, qs).to(torch.int8) - 16)


def q5_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m, qh, qs = _split(blocks, 2, 2, 4)
    return (_half(d) * _q5_values(qh, qs)) + _half(m)


def _k_scales(d, dmin, scales) -> tuple[torch.Tensor, torch.Tensor]:
    n = scales.shape[0]
    sc, mins = _scale_min(scales)
    return (_half(d) * sc).reshape(n, -1, 1), (_half(dmin) * mins).reshape(n, -1, 1)


def q4_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, dmin, scales, qs = _split(blocks, 2, 2, K_SCALE_SIZE)
    step, low = _k_scales(d, dmin, scales)
    q = _nibbles(qs.reshape(n, -1, 32), 2).reshape(n, -1, 32)
    return (step * q - low).reshape(n, QK_K)


def q5_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, dmin, scales, qh, qs = _split(blocks, 2, 2, K_SCALE_SIZE, QK_K // 8)
    step, low = _k_scales(d, dmin, scales)
    q = _nibbles(qs.reshape(n, -1, 32), 2).reshape(n, -1, 32) | (_bits(qh, 1).reshape(n, -1, 32) << 4)
    return (step * q - low).reshape(n, QK_K)


def q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    ql, qh, scales, d = _split(blocks, QK_K // 2, QK_K // 4, QK_K // 16)
    step = (_half(d) * scales.view(torch.int8).to(torch.float32)).reshape(n, QK_K // 16, 1)
    low = _nibbles(ql.reshape(n, -1, 64), 2).reshape(n, -1, 32)
    high = _bits(qh.reshape(n, -1, 32), 2, width=2).reshape(n, -1, 32)
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, QK_K // 16, -1)
    return (step * q).reshape(n, QK_K)


DEQUANTIZE = {"Q8_0": q8_0, "Q4_0": q4_0, "Q4_1": q4_1, "Q5_0": q5_0, "Q5_1": q5_1,
              "Q4_K": q4_k, "Q5_K": q5_k, "Q6_K": q6_k}
