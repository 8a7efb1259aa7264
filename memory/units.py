"""Units and names every layer shares, declared once: bytes per GiB, the compute dtypes by name."""

from __future__ import annotations

import torch

GiB = 1 << 30
MiB = 1 << 20
KiB = 1 << 10

# The dtypes a pipeline computes in, by the names the nodes, the CLI and the configs use.
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def human_bytes(n: int | None) -> str:
    """Bytes as people read them in receipts and logs: GiB/MiB/KiB with two decimals, else B."""
    if n is None:
        return "n/a"
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"
