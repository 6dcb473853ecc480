"""The UT-transform inverse (I + A_kk)^-1 of the Triton KDA forward on ill-conditioned chunks.

Nearly parallel keys with almost no decay and beta near 1 make every entry of A_kk O(1): the power
series sum_m (-A)^m that an earlier kernel evaluated by repeated squaring then has terms of order
binomial(64, 32) ~ 1e18 and returned garbage (relative error 1e4 to inf, NaN losses in training on
an H200). The blocked forward substitution must match the fp32 chunk reference to rounding.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of the kernels

from kimik3.ops.kda import kda  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs CUDA or the Triton interpreter")
RTOL = 1e-4 if DEVICE == "cpu" else 1e-2  # GPU: fp32 inputs take tf32 tensor-core dots (measured 4.9e-3)


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref.double()).norm() / ref.double().norm())


@pytest.mark.parametrize("spread", [1.0, 0.01], ids=["random-keys", "near-parallel-keys"])
def test_triton_matches_chunk_when_keys_are_nearly_parallel(spread):
    gen = torch.Generator().manual_seed(0)
    B, T, H, D = 1, 128, 2, 32
    k = torch.randn(D, generator=gen) + spread * torch.randn(B, T, H, D, generator=gen)
    q, v = torch.randn(B, T, H, D, generator=gen), torch.randn(B, T, H, D, generator=gen)
    f = torch.full((B, T, H, D), -8.0)  # softplus(-8) ~ 3e-4: almost no decay inside a chunk
    b = torch.full((B, T, H), 4.0)  # beta ~ 0.98
    A_log, dt_bias = torch.zeros(H), torch.zeros(H * D)
    results = {}
    for impl in ("chunk", "triton"):
        leaves = [t.to(DEVICE).requires_grad_() for t in (q, k, v, f, b)]
        o, _ = kda(*leaves, A_log.to(DEVICE), dt_bias.to(DEVICE), impl=impl)
        o.backward(torch.ones_like(o))
        results[impl] = [o.detach()] + [t.grad for t in leaves]
    for name, got, ref in zip(("o", "dq", "dk", "dv", "df", "db"), results["triton"], results["chunk"]):
        assert torch.isfinite(got).all(), name
        assert _rel(got, ref) < RTOL, (name, _rel(got, ref))
