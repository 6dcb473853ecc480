"""Building blocks shared by the mixers and the FFNs: RMSNorm, SwiGLU, and the layer pattern.

Shapes: B batch, T time, D hidden size, F FFN width.

Numerics follow transformers' KimiLinear modules (RMSNorm in fp32, weight applied after casting
back to the input dtype), so that its weights load by a name/reshape mapping with logits parity.
On CUDA the norms run as fused Triton kernels with the same roundings (kimik3.ops.norm), and
RMSNorm.add_forward fuses the residual add before a norm into its kernel (one read and write of the
residual stream fewer per norm, each way).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kimik3.config.schema import LAYER_TYPES, ModelConfig
from kimik3.ops import TRITON_FLOAT_DTYPES
from kimik3.ops.cast import autocast_dtype, autocast_stacked, autocast_weight
from kimik3.ops.swiglu import swiglu


def takes_fused_norm(*tensors: Tensor) -> bool:
    """Whether the norms (RMSNorm, KDA's GatedRMSNorm) run kimik3.ops.norm's kernels on these
    inputs: all on CUDA, in ops.TRITON_FLOAT_DTYPES."""
    return all(t.is_cuda and t.dtype in TRITON_FLOAT_DTYPES for t in tensors)


class RMSNorm(nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)), normalised in fp32, cast back before the weight.

    feeds_matmul: the output's only reader is one matmul (the owner knows). Under autocast the norm
    then returns autocast's dtype, the very values autocast would cast its output to, so the fp32
    output and the cast (a pass each way) never happen; the gradient it gets back is the matmul's, in
    that dtype, exactly what the cast's backward would have widened."""

    def __init__(self, dim: int, eps: float, feeds_matmul: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.feeds_matmul = feeds_matmul

    def _out_dtype(self, x_dtype: torch.dtype, device: torch.device) -> torch.dtype:
        """The eager module's output dtype for an input of x_dtype, or autocast's where feeds_matmul
        lets it (autocast leaves fp64 alone, and so does this)."""
        dtype = torch.promote_types(self.weight.dtype, x_dtype)
        matmul_dtype = autocast_dtype(device.type) if self.feeds_matmul and dtype != torch.float64 else None
        return matmul_dtype or dtype

    def forward(self, x: Tensor) -> Tensor:
        if takes_fused_norm(x):  # one Triton kernel each way, same numerics
            from kimik3.ops.norm import rms_norm

            return rms_norm(x, self.weight, self.eps, self._out_dtype(x.dtype, x.device))
        xf = x.to(torch.promote_types(x.dtype, torch.float32))  # fp32 (fp64 stays fp64)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf.to(x.dtype)).to(self._out_dtype(x.dtype, x.device))

    def add_forward(self, x: Tensor, r: Optional[Tensor]) -> tuple[Tensor, Tensor]:
        """(h, self(h)) for h = x + r, the residual stream after a pending branch output r is added
        (h = x when r is None). On CUDA the add runs inside the norm's kernel, forward and backward."""
        if r is None:
            return x, self(x)
        if takes_fused_norm(x, r):
            from kimik3.ops.norm import add_rms_norm

            out_dtype = self._out_dtype(torch.promote_types(x.dtype, r.dtype), x.device)
            return add_rms_norm(x, r, self.weight, self.eps, out_dtype)
        h = x + r
        return h, self(h)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}" + (", feeds_matmul=True" if self.feeds_matmul else "")


class Linear(nn.Linear):
    """nn.Linear whose weight goes through `ops.cast.autocast_weight`: under bf16 autocast the
    same bf16 copy autocast would make, with its fp32 gradient cast by a vectorised kernel on CUDA
    (the model's projections; parameters and state-dict names are nn.Linear's)."""

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, autocast_weight(self.weight), self.bias)


def stacked_linear(x: Tensor, projections: Sequence[nn.Linear]) -> Tensor:
    """x through several bias-free projections of the same input at once: one GEMM on their stacked
    weights, outputs side by side in the order given.

    Why: x is read (and, under autocast, cast) once, and its gradient comes out of one GEMM instead of
    one per projection that autograd then sums. Under autocast the weights are cast and stacked in one
    pass (ops.cast.autocast_stacked), and their gradients return to fp32 through the vectorised cast."""
    return F.linear(x, autocast_stacked([p.weight for p in projections]))


class SwiGLU(nn.Module):
    """Dense FFN: down(silu(gate(x)) * up(x)); used for dense layers and shared experts. gate and up
    are one GEMM on their stacked weights, and the activation reads its [gate | up] output in one
    pass (ops.swiglu: a Triton kernel each way on CUDA)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:  # [..., D] -> [..., D]
        return self.down_proj(swiglu(stacked_linear(x, (self.gate_proj, self.up_proj))))


def resolve_layer_types(cfg: ModelConfig) -> list[str]:
    """The mixer of each layer, 'kda' or 'mla'.

    cfg.layer_types wins when given (its length must be num_layers). Otherwise mla_every: layer i
    (1-based) is MLA when i % mla_every == 0, and the last layer is always MLA (so the final
    representation has seen full attention); mla_every=0 is KDA only, mla_every=1 MLA only.
    """
    L = cfg.num_layers
    if cfg.layer_types is not None:
        types = list(cfg.layer_types)
        if len(types) != L:
            raise ValueError(f"model.layer_types has {len(types)} entries but model.num_layers={L}")
        bad = sorted({t for t in types if t not in LAYER_TYPES})
        if bad:
            raise ValueError(f"model.layer_types contains {bad}; accepted values are {list(LAYER_TYPES)}")
        return types
    if cfg.mla_every < 0:
        raise ValueError(f"model.mla_every={cfg.mla_every} must be >= 0 (0 = KDA only, 1 = MLA only)")
    if cfg.mla_every == 0:
        return ["kda"] * L
    return ["mla" if (i + 1) % cfg.mla_every == 0 or i == L - 1 else "kda" for i in range(L)]


def is_moe_layer(cfg: ModelConfig, layer_idx: int) -> bool:
    """A layer's FFN is a MoE unless experts are off or it is one of the first_k_dense layers."""
    return cfg.num_experts > 0 and layer_idx >= cfg.first_k_dense

