"""One forward's module order for the full-size component, from a trace of two blocks.

The sequential tier's schedule is learned from the order modules run in. The trace runs two
blocks; the order of the real count is the traced one with the last traced block's modules
repeated, block index renamed (blocks are identical and run in index order).
"""

from __future__ import annotations


def expand_blocks(events: list[tuple[bool, str]], path: str, traced: int, count: int) -> list[tuple[bool, str]]:
    """`events` ((starts, module name), ...) with blocks `traced`..`count - 1` inserted."""
    indices = [_block_index(name, path) for _, name in events]
    inside = [i for i, index in enumerate(indices) if index is not None]
    if not inside:
        return list(events)
    first, last = inside[0], inside[-1]
    if any(index is None for index in indices[first : last + 1]):
        return list(events)  # something runs between blocks: keep what was traced rather than guess
    old = f"{path}.{traced - 1}"
    template = [(start, name[len(old):]) for (start, name), index in zip(events, indices) if index == traced - 1]
    extra = [(start, f"{path}.{k}{rest}") for k in range(traced, count) for start, rest in template]
    return [*events[: last + 1], *extra, *events[last + 1 :]]


def _block_index(name: str, path: str) -> int | None:
    if not name.startswith(f"{path}."):
        return None
    return int(name[len(path) + 1 :].split(".")[0])
