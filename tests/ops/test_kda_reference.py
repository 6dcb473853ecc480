"""The chunkwise PyTorch KDA (ops/kda/chunk.py) against the token-by-token oracle (ops/kda/naive.py).

Every case compares the output, the final state and the gradients of q, k, v, g, beta and the
initial state under random cotangents. Bounds (relative RMS error): fp64 1e-11 (observed ~1e-15),
fp32 1e-5 (observed ~1e-6).
"""

from __future__ import annotations

import pytest
import torch

from kimik3.ops.compare import assert_rel_close, max_abs_error, rel_rms_error
from kimik3.ops.kda import kda
from kimik3.ops.kda.chunk import chunk_kda
from kimik3.ops.kda.gate import kda_gate, l2_normalize
from kimik3.ops.kda.naive import naive_recurrent_kda

BOUND = {torch.float64: 1e-11, torch.float32: 1e-5}
NAMES = ("o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0")


def _inputs(B, T, H, K, V, dtype, seed=0, decay=1.0, N=None):
    """Leaf tensors q, k (unit norm), v, g (<= 0), beta, h0 ([N or B, H, K, V])."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    q = l2_normalize(rand(B, T, H, K))
    k = l2_normalize(rand(B, T, H, K))
    v = rand(B, T, H, V)
    g = -decay * torch.rand(B, T, H, K, generator=gen, dtype=dtype)
    beta = torch.rand(B, T, H, generator=gen, dtype=dtype)
    h0 = rand(N or B, H, K, V)
    return [t.requires_grad_() for t in (q, k, v, g, beta, h0)]


def _run(fn, inputs, **kwargs):
    """Outputs and input grads of fn under fixed random cotangents for o and the final state."""
    q, k, v, g, beta, h0 = inputs
    o, state = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, **kwargs)
    gen = torch.Generator().manual_seed(123)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype)
    ds = torch.randn(state.shape, generator=gen, dtype=torch.float64).to(state.dtype)
    grads = torch.autograd.grad((o * do).sum() + (state * ds).sum(), inputs)
    return (o, state, *grads)


def _assert_all_close(actual, expected, bound):
    for name, a, e in zip(NAMES, actual, expected):
        assert_rel_close(name, a, e, bound)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize(
    "B,T,H,K,V,C",
    [
        (2, 32, 2, 16, 16, 32),  # a single chunk
        (1, 96, 2, 16, 8, 16),  # many chunks
        (2, 45, 3, 8, 12, 16),  # final partial chunk, K != V
        (1, 40, 1, 12, 4, 24),  # chunk size not a multiple of the 16-token sub-chunk
    ],
    ids=["single-chunk", "many-chunks", "partial-chunk", "odd-chunk-size"],
)
def test_chunk_matches_naive(B, T, H, K, V, C, dtype):
    inputs = _inputs(B, T, H, K, V, dtype)
    expected = _run(naive_recurrent_kda, inputs)
    actual = _run(chunk_kda, inputs, chunk_size=C)
    _assert_all_close(actual, expected, BOUND[dtype])


def test_chunk_is_stable_under_strong_decay():
    """Softplus gates are unbounded below; a whole chunk of strong decay (cumulative log decay
    down to ~-1300, far past fp32's exp range) must not overflow. fp32 chunk vs the fp64 oracle:
    1e-4 (dg is a difference of large, nearly cancelling terms here; observed ~2e-5)."""
    inputs = _inputs(1, 64, 2, 16, 16, torch.float64, decay=40.0)
    expected = _run(naive_recurrent_kda, inputs)
    actual = _run(chunk_kda, [t.detach().float().requires_grad_() for t in inputs], chunk_size=64)
    assert all(torch.isfinite(t).all() for t in actual)
    _assert_all_close(actual, expected, 1e-4)


@pytest.mark.parametrize("fn", [naive_recurrent_kda, chunk_kda], ids=["naive", "chunk"])
def test_final_state_carries_across_halves(fn):
    """Running [0, T/2) then [T/2, T) from the carried state equals running [0, T) at once."""
    q, k, v, g, beta, h0 = (t.detach() for t in _inputs(2, 48, 2, 16, 8, torch.float64))
    whole, s_whole = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    half = lambda t, sl: t[:, sl]  # noqa: E731
    o1, s1 = fn(*(half(t, slice(0, 24)) for t in (q, k, v, g, beta)), initial_state=h0, output_final_state=True)
    o2, s2 = fn(*(half(t, slice(24, 48)) for t in (q, k, v, g, beta)), initial_state=s1, output_final_state=True)
    assert rel_rms_error(torch.cat([o1, o2], dim=1), whole) < 1e-12
    assert rel_rms_error(s2, s_whole) < 1e-12


def test_cu_seqlens_matches_naive_and_separate_runs():
    """Packed sequences restart the state at each boundary: chunk == naive == one run per sequence."""
    lengths = [7, 30, 1, 19]
    cu = torch.tensor([0, 7, 37, 38, 57])
    inputs = _inputs(1, sum(lengths), 2, 8, 8, torch.float64, N=len(lengths))
    expected = _run(naive_recurrent_kda, inputs, cu_seqlens=cu)
    actual = _run(chunk_kda, inputs, cu_seqlens=cu, chunk_size=16)
    _assert_all_close(actual, expected, BOUND[torch.float64])

    q, k, v, g, beta, h0 = (t.detach() for t in inputs)
    o_packed, s_packed = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                   cu_seqlens=cu, chunk_size=16)
    for n, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        o_n, s_n = chunk_kda(*(t[:, start:end] for t in (q, k, v, g, beta)), initial_state=h0[n : n + 1],
                             output_final_state=True, chunk_size=16)
        assert rel_rms_error(o_packed[:, start:end], o_n) < 1e-12
        assert rel_rms_error(s_packed[n : n + 1], s_n) < 1e-12


@pytest.mark.parametrize("form", ["softplus", "bounded"])
def test_kda_entry_chunk_matches_naive_on_raw_inputs(form):
    """kda() from raw projections (L2 norm, gate, sigmoid inside) agrees across impls, both gate forms."""
    gen = torch.Generator().manual_seed(3)
    B, T, H, K = 2, 40, 2, 16
    q, k, v, f = (torch.randn(B, T, H, K, generator=gen, dtype=torch.float64) for _ in range(4))
    b = torch.randn(B, T, H, generator=gen, dtype=torch.float64)
    A_log = torch.rand(H, generator=gen, dtype=torch.float64).mul(2.7).log1p()
    dt_bias = torch.randn(H * K, generator=gen, dtype=torch.float64)
    outs = [kda(q, k, v, f, b, A_log, dt_bias, impl=impl, gate_form=form, chunk_size=16)[0]
            for impl in ("naive", "chunk")]
    assert rel_rms_error(outs[1], outs[0]) < 1e-11


def test_gate_forms_match_their_formulas():
    gen = torch.Generator().manual_seed(4)
    H, K = 3, 4
    f = torch.randn(2, 5, H, K, generator=gen) * 10
    A_log, dt_bias = torch.randn(H, generator=gen), torch.randn(H * K, generator=gen)
    x = f + dt_bias.view(H, K)
    rate = A_log.exp().view(H, 1)
    soft = kda_gate(f, A_log, dt_bias, form="softplus")
    assert torch.allclose(soft, -rate * torch.log1p(torch.exp(x)), rtol=1e-5, atol=1e-5)
    bounded = kda_gate(f, A_log, dt_bias, form="bounded", lower_bound=-5.0)
    assert torch.allclose(bounded, -5.0 * torch.sigmoid(rate * x))
    assert bool((bounded >= -5.0).all() and (bounded <= 0).all())  # (lb, 0), closed by fp32 rounding


def test_bad_chunk_size_is_refused():
    q, k, v, g, beta, _ = (t.detach() for t in _inputs(1, 8, 1, 4, 4, torch.float32))
    with pytest.raises(ValueError, match="chunk_size=0"):
        chunk_kda(q, k, v, g, beta, chunk_size=0)


def test_error_helpers():
    e = torch.tensor([3.0, 4.0])
    assert rel_rms_error(e, e) == 0.0
    assert rel_rms_error(torch.tensor([3.0, 5.0]), e) == pytest.approx((0.5**0.5) / (12.5**0.5))
    assert max_abs_error(torch.tensor([3.0, 5.5]), e) == pytest.approx(1.5)
    with pytest.raises(AssertionError, match="o: relative RMS error"):
        assert_rel_close("o", torch.tensor([3.0, 5.0]), e, 1e-3)
