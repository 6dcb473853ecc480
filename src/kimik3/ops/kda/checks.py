"""Argument checks shared by the three KDA implementations, so bad input gives every one of them the
same one-line ValueError instead of a deep traceback, silent garbage or (Triton) reads past a tensor.

Checks on host metadata (shapes, dtypes) cost nothing; checks on cu_seqlens' values need its numbers on
the host: the PyTorch paths read them anyway, and the Triton path reads a 'bad' flag together with the
chunk count it already syncs on (function._chunk_tables), so no call gains a sync.
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor


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


def check_initial_state(initial_state: Optional[Tensor], q: Tensor, v: Tensor, cu_seqlens: Optional[Tensor]) -> None:
    """initial_state must be [N, H, K, V], N = B or len(cu_seqlens) - 1: the Triton recurrence indexes it
    by sequence and head without bounds checks, so a smaller one is read past its end and a transposed
    or broadcastable one is read in the wrong layout."""
    if initial_state is None:
        return
    B, _, H, K = q.shape
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    expected = (N, H, K, v.shape[-1])
    if tuple(initial_state.shape) != expected:
        raise ValueError(f"initial_state has shape {tuple(initial_state.shape)}, expected [N, H, K, V] = {expected} "
                         f"(N = {'len(cu_seqlens) - 1' if cu_seqlens is not None else 'B'})")
