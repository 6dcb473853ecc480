"""KDA mixer (Kimi Delta Attention layer, Kimi Linear arXiv:2510.26692, sec. 3-4).

Shapes: B batch, T time, D hidden, H heads, K head dim (keys and values share it), W conv kernel.

    q, k, v = SiLU(causal depthwise conv_W([W_q x, W_k x, W_v x]))     [B, T, H, K] each
    f = f_b(f_a(x)) (low rank D -> K -> H*K): gate pre-activation; b = b_proj(x): beta logits
    o, _ = ops.kda.kda(q, k, v, f, b, A_log, dt_bias)   (L2 norm of q/k, gate, sigmoid(b) inside;
                                                         model.kda_implementation=fla: fla's chunk_kda)
    out = o_proj(RMSNorm_K(o) * sigmoid(g_b(g_a(x))))

Parameters map 1:1 to transformers' KimiLinearDeltaAttention: q/k/v/o_proj, conv.weight ==
conv1d.weight ([3*H*K, 1, W], channels ordered q|k|v), f_a/f_b_proj == forget_gate.f_a/f_b_proj,
dt_bias == forget_gate.dt_bias, A_log [H] == forget_gate.A_log.view(H) ([1, 1, H, 1] there),
b_proj, g_a/g_b_proj, o_norm.weight.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import math
import os
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kimik3.config.schema import ModelConfig
from kimik3.models.blocks import Linear, stacked_linear, takes_fused_norm
from kimik3.models.recompute import RecomputeSaved
from kimik3.ops import SHORT_CONV_MAX_TAPS
from kimik3.ops.kda import kda

log = logging.getLogger(__name__)

KEEP_KDA_STATES_MAX_BYTES = 128 * 2**20
"""Under train.recompute_kda_states=null a KDA layer keeps its chunk states for the backward while they
take at most this much. Keeping skips one pass of the recurrence (measured 2.6% of a kda_dense_1b 8K
step on the H100); the states grow with the tokens of a micro-batch like every other activation, so
the cap keeps the long-context steps, whose memory is what limits them, as they were (dense 32K
would need 256 MiB x 24 layers more)."""


class GatedRMSNorm(nn.Module):
    """Per-head output norm: weight * RMSNorm(o) * sigmoid(gate), all in fp32 (as fla/transformers)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:  # x, gate: [..., K]
        if takes_fused_norm(x, gate) and gate.dtype == x.dtype:  # fused Triton, same math
            from kimik3.ops.norm import gated_rms_norm

            return gated_rms_norm(x, gate, self.weight, self.eps)
        dtype = torch.promote_types(x.dtype, torch.float32)
        xf = x.to(dtype)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.to(dtype) * xf * torch.sigmoid(gate.to(dtype))).to(x.dtype)


def causal_short_conv(x: Tensor, weight: Tensor) -> Tensor:
    """Causal depthwise conv over time + SiLU, without a loop over time.

    x: [B, T, C]; weight: [C, 1, W]. Output t sees inputs t-W+1..t (zeros before the start).
    """
    W = weight.shape[-1]
    y = F.conv1d(F.pad(x.transpose(1, 2), (W - 1, 0)), weight, groups=weight.shape[0])  # [B, C, T]
    return F.silu(y).transpose(1, 2)


def short_conv_silu(x: Tensor, weight: Tensor, parts: int) -> tuple[Tensor, ...]:
    """SiLU(causal depthwise conv(x)) split into `parts` equal channel groups: on CUDA one Triton pass
    that writes each part contiguous (ops/conv.py; kernels up to SHORT_CONV_MAX_TAPS taps), elsewhere
    the eager `causal_short_conv` (views of one output). The one place that choice is made, so the
    layer and `benchmarks/memory_bound_ops.py` always time and run the same implementation.

    x: [B, T, C] with unit channel stride; weight: [C, 1, W]; C divisible by parts.
    """
    if x.is_cuda and weight.shape[-1] <= SHORT_CONV_MAX_TAPS:
        from kimik3.ops.conv import causal_conv_silu  # imports Triton: CUDA only

        return causal_conv_silu(x, weight, parts=parts)
    return causal_short_conv(x, weight).chunk(parts, dim=-1)


def resolve_kda_impl(impl: str, device: torch.device) -> str:
    """The implementation to run: `triton` on a non-CUDA tensor (without TRITON_INTERPRET) runs
    `chunk` instead, logged once, so CPU runs of a GPU config still work; never on CUDA."""
    if impl == "triton" and device.type != "cuda" and not os.environ.get("TRITON_INTERPRET"):
        if not getattr(resolve_kda_impl, "_warned", False):
            log.warning("model.kda_implementation=triton needs CUDA (or TRITON_INTERPRET=1); "
                        "running the PyTorch 'chunk' implementation on %s instead", device.type)
            resolve_kda_impl._warned = True  # type: ignore[attr-defined]
        return "chunk"
    return impl


def check_fla_backend(gate_form: str) -> None:
    """ValueError unless model.kda_implementation=fla can run here: the softplus gate and an installed
    flash-linear-attention. Config validation calls it too, so that a run that cannot start is refused
    in one line before the data is prepared and a run dir made, not at its first forward."""
    if gate_form != "softplus":
        # fla's bounded gate (safe_gate) failed our comparison test on an H200 (cause not
        # yet diagnosed), so only the softplus form, which passed it, is offered.
        raise ValueError(f"model.kda_implementation=fla supports gate_form='softplus' only, got {gate_form!r}")
    if importlib.util.find_spec("fla") is None:
        raise ValueError("model.kda_implementation=fla needs flash-linear-attention (pip install "
                         "flash-linear-attention), which is not installed; use triton or chunk")


def fla_kda(q: Tensor, k: Tensor, v: Tensor, f: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor, *,
            gate_form: str) -> Tensor:
    """fla-core's chunk_kda on the same raw projections (a comparison backend, CUDA only; fla fixes
    its chunk size at 64). Returns o [B, T, H, V]."""
    check_fla_backend(gate_form)
    try:
        from fla.ops.kda import chunk_kda
    except ImportError as err:
        raise ImportError(
            "model.kda_implementation=fla needs flash-linear-attention (pip install flash-linear-attention); "
            f"importing fla.ops.kda failed: {err}"
        ) from err
    o, _ = chunk_kda(
        q, k, v, f, b, A_log=A_log, dt_bias=dt_bias, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True,
    )
    return o


class KDAMixer(nn.Module):
    """Kimi Delta Attention token mixer (see the module docstring)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        D, H, K = cfg.hidden_size, cfg.num_heads, cfg.head_dim
        self.num_heads, self.head_dim = H, K
        self.impl = cfg.kda_implementation
        self.chunk_size = cfg.kda_chunk_size
        self.gate_form = cfg.gate_form
        self.gate_lower_bound = cfg.gate_lower_bound
        self.q_proj = Linear(D, H * K, bias=False)
        self.k_proj = Linear(D, H * K, bias=False)
        self.v_proj = Linear(D, H * K, bias=False)
        self.conv = nn.Conv1d(3 * H * K, 3 * H * K, cfg.conv_size, groups=3 * H * K, bias=False)
        self.f_a_proj = Linear(D, K, bias=False)
        self.f_b_proj = Linear(K, H * K, bias=False)
        self.A_log = nn.Parameter(torch.zeros(H))
        self.dt_bias = nn.Parameter(torch.zeros(H * K))
        self.b_proj = Linear(D, H, bias=False)
        self.g_a_proj = Linear(D, K, bias=False)
        self.g_b_proj = Linear(K, H * K, bias=False)
        self.o_norm = GatedRMSNorm(K, cfg.norm_eps)
        self.o_proj = Linear(H * K, D, bias=False)
        self.recompute_conv = False
        """train.recompute_conv, set by the trainer: on CUDA the KDA op's saved q, k, v are recomputed in
        backward from the conv's input (models/recompute.py) instead of kept."""
        self.recompute_kda_states: Optional[bool] = None
        """train.recompute_kda_states, set by the trainer: whether the Triton KDA op reruns its recurrence
        in the backward (true), keeps the chunk states from the forward (false), or decides by their
        size (None; keeps_kda_states)."""

    def keeps_kda_states(self, batch: int, seq_len: int, element_size: int) -> bool:
        """Whether this forward keeps the Triton op's chunk states (ops.kda.kda's keep_states)."""
        if self.recompute_kda_states is not None:
            return not self.recompute_kda_states
        kept = batch * math.ceil(seq_len / self.chunk_size) * self.num_heads * self.head_dim**2 * element_size
        return kept <= KEEP_KDA_STATES_MAX_BYTES

    def forward(self, x: Tensor) -> Tensor:  # [B, T, D] -> [B, T, D]
        B, T, _ = x.shape
        H, K = self.num_heads, self.head_dim
        projections = (self.q_proj, self.k_proj, self.v_proj, self.f_a_proj, self.g_a_proj, self.b_proj)
        qkv, f_a, g_a, b = stacked_linear(x, projections).split([3 * H * K, K, K, H], dim=-1)  # b: [B, T, H]
        keep_qkv: contextlib.AbstractContextManager = contextlib.nullcontext()

        def conv() -> tuple[Tensor, ...]:
            return tuple(t.view(B, T, H, K) for t in short_conv_silu(qkv, self.conv.weight, parts=3))

        q, k, v = conv()
        if qkv.is_cuda and self.recompute_conv:
            keep_qkv = RecomputeSaved(conv, (q, k, v))
        f = self.f_b_proj(f_a).view(B, T, H, K)
        impl = resolve_kda_impl(self.impl, x.device)
        if impl == "fla":
            o = fla_kda(q, k, v, f, b, self.A_log, self.dt_bias, gate_form=self.gate_form)
        else:
            # The op computes in fp32 itself; autocast must not push its inner matmuls to bf16.
            with torch.autocast(device_type=x.device.type, enabled=False), keep_qkv:
                o, _ = kda(
                    q, k, v, f, b, self.A_log, self.dt_bias,
                    impl=impl, gate_form=self.gate_form, lower_bound=self.gate_lower_bound,
                    chunk_size=self.chunk_size, keep_states=self.keeps_kda_states(B, T, q.element_size()),
                )  # [B, T, H, K]
        gate = self.g_b_proj(g_a).view(B, T, H, K)
        return self.o_proj(self.o_norm(o, gate).reshape(B, T, H * K))
