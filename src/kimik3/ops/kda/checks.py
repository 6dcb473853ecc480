"""Argument checks shared by the three KDA implementations, so bad input gives every one of them the
same one-line ValueError instead of a deep traceback, silent garbage or (Triton) reads past a tensor.

Checks on host metadata (shapes, dtypes) cost nothing; checks on cu_seqlens' values need its numbers on
the host: the PyTorch paths read them anyway, and the Triton path reads a 'bad' flag together with the
chunk count it already syncs on (function._chunk_tables), so no call gains a sync.
"""

from __future__ import annotations

from typing import Optional

import torch
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


def check_input_shapes(q: Tensor, k: Tensor, v: Tensor, f: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor) -> None:
    """q, k, f [B, T, H, K], v [B, T, H, V], b [B, T, H], A_log [H], dt_bias [H * K]. The Triton kernels
    index A_log by head and dt_bias by (head, channel) unchecked: a shorter one is read past its end, a
    longer one silently gives other heads' values; the PyTorch paths fail deep in a view or an einsum."""
    if q.dim() != 4:
        raise ValueError(f"kda q must be [B, T, H, K], got shape {tuple(q.shape)}")
    H, K = q.shape[2:]
    if (k.shape != q.shape or f.shape != q.shape or v.dim() != 4 or v.shape[:3] != q.shape[:3]
            or b.shape != q.shape[:3]):
        raise ValueError(f"kda shapes disagree: q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} "
                         f"f {tuple(f.shape)} b {tuple(b.shape)}; expected q, k, f [B, T, H, K], v [B, T, H, V], "
                         "b [B, T, H]")
    if tuple(A_log.shape) != (H,) or tuple(dt_bias.shape) != (H * K,):
        raise ValueError(f"kda A_log {tuple(A_log.shape)} / dt_bias {tuple(dt_bias.shape)}: expected [H] = ({H},) "
                         f"and [H * K] = ({H * K},)")


def check_lower_bound(gate_form: str, lower_bound: float) -> None:
    """The bounded gate needs lower_bound < 0: g = lower_bound * sigmoid(...) is then a decay in
    (lower_bound, 0). At lower_bound >= 0 the PyTorch paths grew the state (g > 0) while the Triton
    kernels gave lower_bound = 0's result, so the implementations disagreed without a word (the model's
    config already refuses model.gate_lower_bound >= 0)."""
    if gate_form == "bounded" and not lower_bound < 0:
        raise ValueError(f"kda lower_bound={lower_bound} must be < 0 with gate_form='bounded' (the log decay g "
                         f"lies in (lower_bound, 0))")


def check_cu_seqlens_form(cu_seqlens: Optional[Tensor]) -> None:
    """cu_seqlens must be a 1-D int32 / int64 tensor of at least two boundaries (one sequence). The
    Triton path casts it to int64 (a float one was truncated silently) and, given a single boundary, ran
    no chunk at all and returned o unwritten; the PyTorch paths failed deep in a slice or a stack."""
    if cu_seqlens is None:
        return
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be an int32 or int64 tensor, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(f"cu_seqlens must be 1-D with N + 1 >= 2 boundaries, got shape {tuple(cu_seqlens.shape)}")


def check_arguments(q: Tensor, k: Tensor, v: Tensor, f: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor, *,
                    gate_form: str, lower_bound: float, initial_state: Optional[Tensor],
                    cu_seqlens: Optional[Tensor]) -> None:
    """Every check above that needs no host read, in the order the implementations share (kda() for the
    PyTorch paths, triton_kda for its own); cu_seqlens' values are checked where each path reads them."""
    check_input_shapes(q, k, v, f, b, A_log, dt_bias)
    check_lower_bound(gate_form, lower_bound)
    check_cu_seqlens_form(cu_seqlens)
    check_initial_state(initial_state, q, v, cu_seqlens)
