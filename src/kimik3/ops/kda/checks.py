"""Argument checks shared by the three KDA implementations, so bad input gives every one of them the
same one-line ValueError instead of a deep traceback, silent garbage or (Triton) reads past a tensor.

Checks on host metadata (shapes, dtypes) cost nothing; checks on cu_seqlens' values need its numbers on
the host: the PyTorch paths read them anyway, and the Triton path reads a 'bad' flag together with the
chunk count it already syncs on (function._chunk_tables), so no call gains a sync.
"""

from __future__ import annotations

from typing import Optional


def cu_seqlens_error(bounds: list[int], tokens: int) -> Optional[str]:
    """Why `bounds` (cu_seqlens as a list) cannot split `tokens` packed tokens, or None if it can.

    The kernels index tokens by these boundaries without bounds checks: a last entry past the tokens
    reads and writes past the buffers, and a decreasing one gives a negative chunk count."""
    if bounds[0] != 0:
        return f"cu_seqlens must start at 0, got {bounds[0]} (cu_seqlens={bounds})"
    if any(end < start for start, end in zip(bounds[:-1], bounds[1:])):
        return f"cu_seqlens must be non-decreasing, got {bounds}"
    if bounds[-1] != tokens:
        return f"cu_seqlens must end at the {tokens} packed tokens (B * T), got {bounds[-1]} (cu_seqlens={bounds})"
    return None


def check_cu_seqlens_values(bounds: list[int], tokens: int) -> None:
    """Raise cu_seqlens_error's message, if any, as a ValueError."""
    if (error := cu_seqlens_error(bounds, tokens)) is not None:
        raise ValueError(error)
