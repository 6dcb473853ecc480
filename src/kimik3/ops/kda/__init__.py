"""Kimi Delta Attention ops: one entry point, `kda`, and a plain dict of implementations.

    naive   token-by-token fp32 recurrence (naive.py): the oracle, any device, slow
    chunk   chunkwise PyTorch form with the WY/UT transform (chunk.py): any device, autograd
    triton  fused Triton kernels (function.py): CUDA (or CPU under TRITON_INTERPRET=1)

`kda` takes the raw projections and does the pointwise prologue (q/k L2 norm, gate activation,
beta sigmoid): the Triton path fuses it into its kernels, the PyTorch paths run gate.py first,
so every implementation sees the same inputs and is compared on them.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from kimik3.ops.kda.checks import check_arguments
from kimik3.ops.kda.gate import kda_gate, l2_normalize
from kimik3.ops.kda.naive import naive_recurrent_kda


def _chunk_core() -> Callable:
    from kimik3.ops.kda.chunk import chunk_kda

    return chunk_kda


def _naive_core() -> Callable:
    return naive_recurrent_kda


# impl name -> loader of the core recurrence (loaded lazily so `triton` is only imported when used)
_PYTORCH_CORES: dict[str, Callable[[], Callable]] = {"naive": _naive_core, "chunk": _chunk_core}
IMPLEMENTATIONS = ("naive", "chunk", "triton")
KERNEL_CHUNK = 64
"""Tokens per chunk of the Triton kernels (and of fla's chunk_kda), whatever model.kda_chunk_size says:
defined here, outside function.py, so that config validation can read it without importing triton."""


def kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    f: Tensor,
    b: Tensor,
    A_log: Tensor,
    dt_bias: Tensor,
    *,
    impl: str,
    gate_form: str = "softplus",
    lower_bound: float = -5.0,
    scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[Tensor] = None,
    chunk_size: int = 64,
    keep_states: bool = False,
) -> tuple[Tensor, Optional[Tensor]]:
    """KDA from raw projections.

    Args:
        q, k: [B, T, H, K] raw (not yet normalised) queries / keys.
        v: [B, T, H, V] values.
        f: [B, T, H, K] gate pre-activation (see gate.kda_gate for both forms).
        b: [B, T, H] beta logits (beta = sigmoid(b)).
        A_log: [H] log decay rate; dt_bias: [H * K].
        impl: 'naive', 'chunk' or 'triton'.
        initial_state: [N, H, K, V] fp32; cu_seqlens: [N + 1] packed-sequence boundaries (B == 1).
        keep_states: triton only (the PyTorch paths keep what autograd keeps): the forward keeps each
            chunk's start state for the backward instead of the backward rerunning the recurrence
            (function.triton_kda); train.recompute_kda_states=false sets it.
    Returns:
        o [B, T, H, V] in v's dtype, final state [N, H, K, V] fp32 or None.
    """
    if impl == "triton":
        from kimik3.ops.kda.function import triton_kda

        return triton_kda(
            q, k, v, f, b, A_log, dt_bias,
            gate_form=gate_form, lower_bound=lower_bound, scale=scale,
            initial_state=initial_state, output_final_state=output_final_state,
            cu_seqlens=cu_seqlens, keep_states=keep_states,
        )
    if impl not in _PYTORCH_CORES:
        raise ValueError(f"kda impl {impl!r} is not one of {IMPLEMENTATIONS}")
    check_arguments(q, k, v, f, b, A_log, dt_bias, gate_form=gate_form, lower_bound=lower_bound,
                    initial_state=initial_state, cu_seqlens=cu_seqlens)  # triton_kda checks its own
    g = kda_gate(f, A_log, dt_bias, form=gate_form, lower_bound=lower_bound)
    beta = torch.sigmoid(b.to(torch.promote_types(b.dtype, torch.float32)))
    core = _PYTORCH_CORES[impl]()
    kwargs = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                  cu_seqlens=cu_seqlens)
    if impl == "chunk":
        kwargs["chunk_size"] = chunk_size
    return core(l2_normalize(q), l2_normalize(k), v, g, beta, **kwargs)
