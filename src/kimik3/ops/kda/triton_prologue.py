"""Triton device helpers for KDA's pointwise prologue and tile I/O, forward and backward.

Every kernel of the Triton KDA path fuses these instead of running them as separate passes:
q/k L2 norm, the decay gate (both forms of gate.py), beta = sigmoid(b), and the masked loads and
stores of one chunk's rows. The math matches gate.py / l2_normalize, computed in fp32.

Tiles: C rows (one chunk of tokens), X columns (a head's K or V channels). Tensors live token-major,
[tokens, H, X] contiguous, so row t of head h sits at ((bos + t) * H + h) * X.
"""

from __future__ import annotations

import triton
import triton.language as tl

SOFTPLUS = 0
BOUNDED = 1
GATE_FORMS = {"softplus": SOFTPLUS, "bounded": BOUNDED}
L2_EPS = 1e-6  # same eps as gate.l2_normalize


@triton.jit
def load_rows(ptr, bos, n_rows, h, H: tl.constexpr, X: tl.constexpr, C: tl.constexpr,
              BX: tl.constexpr, col0):
    """[C, BX] tile (stored dtype) of rows bos..bos+C of head h, columns col0..col0+BX; zeros past n_rows."""
    rows = tl.arange(0, C)
    cols = col0 + tl.arange(0, BX)
    offs = ((bos + rows).to(tl.int64) * H + h)[:, None] * X + cols[None, :]
    return tl.load(ptr + offs, mask=(rows < n_rows)[:, None], other=0.0)


@triton.jit
def load_shifted(ptr, bos, n_rows, h, shift, H: tl.constexpr, X: tl.constexpr, C: tl.constexpr,
                 BX: tl.constexpr, col0):
    """[C, BX] fp32 tile whose row t is chunk row t + shift (zeros where that row is outside the chunk)."""
    rows = tl.arange(0, C) + shift
    offs = ((bos + rows).to(tl.int64) * H + h)[:, None] * X + (col0 + tl.arange(0, BX))[None, :]
    mask = ((rows >= 0) & (rows < n_rows))[:, None]
    return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def store_rows(ptr, val, bos, n_rows, h, H: tl.constexpr, X: tl.constexpr, C: tl.constexpr,
               BX: tl.constexpr, col0):
    """Store a [C, BX] tile (cast to ptr's dtype) to rows bos..bos+n_rows of head h."""
    rows = tl.arange(0, C)
    cols = col0 + tl.arange(0, BX)
    offs = ((bos + rows).to(tl.int64) * H + h)[:, None] * X + cols[None, :]
    tl.store(ptr + offs, val.to(ptr.dtype.element_ty), mask=(rows < n_rows)[:, None])


@triton.jit
def load_vec(ptr, bos, n_rows, h, H: tl.constexpr, C: tl.constexpr):
    """[C] fp32 per-token scalar (beta logits) of head h; zeros past n_rows."""
    rows = tl.arange(0, C)
    return tl.load(ptr + (bos + rows).to(tl.int64) * H + h, mask=rows < n_rows, other=0.0).to(tl.float32)


@triton.jit
def store_vec(ptr, val, bos, n_rows, h, H: tl.constexpr, C: tl.constexpr):
    rows = tl.arange(0, C)
    tl.store(ptr + (bos + rows).to(tl.int64) * H + h, val.to(ptr.dtype.element_ty), mask=rows < n_rows)


@triton.jit
def l2norm_fwd(x):
    """Row-wise x / sqrt(sum x^2 + eps) of a [C, X] fp32 tile; also returns the [C] inverse norm."""
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 1) + 1e-6)
    return x * rstd[:, None], rstd


@triton.jit
def l2norm_bwd(xn, rstd, dxn):
    """Gradient through the L2 norm: rstd * (dxn - xn * <xn, dxn>)."""
    return rstd[:, None] * (dxn - xn * tl.sum(xn * dxn, 1)[:, None])


@triton.jit
def gate_fwd(f, a_log, dt_bias, FORM: tl.constexpr, lower_bound):
    """Log decay g [C, K] from the pre-activation f [C, K], per-head a_log and per-channel dt_bias [K]."""
    x = f + dt_bias[None, :]
    rate = tl.exp(a_log)
    if FORM == 0:  # softplus: -exp(A_log) * softplus(x), torch's threshold of 20
        sp = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
        g = -rate * sp
    else:  # bounded: lower_bound * sigmoid(exp(A_log) * x)
        g = lower_bound * tl.sigmoid(rate * x)
    return g


@triton.jit
def gate_bwd(dg, f, a_log, dt_bias, FORM: tl.constexpr, lower_bound):
    """(df [C, K], per-element dA_log terms [C, K]) for g = gate_fwd(f, ...); df is also d dt_bias."""
    x = f + dt_bias[None, :]
    rate = tl.exp(a_log)
    if FORM == 0:
        df = -dg * rate * tl.sigmoid(x)
        sp = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
        da = -dg * rate * sp  # dg * g
    else:
        s = tl.sigmoid(rate * x)
        dz = dg * lower_bound * s * (1.0 - s)
        df = dz * rate
        da = df * x
    return df, da
