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

GATE_FORMS = {"softplus": 0, "bounded": 1}  # FORM constexpr of the kernels


@triton.jit
def chunk_span(chunk_bos_ptr, chunk_eos_ptr, ic):
    """(first token as int64, rows as int32) of chunk ic from the chunk tables (function._chunk_tables);
    the int64 keeps token * H * X offsets from overflowing at long T."""
    bos = tl.load(chunk_bos_ptr + ic).to(tl.int64)
    return bos, (tl.load(chunk_eos_ptr + ic) - bos).to(tl.int32)


@triton.jit
def sequence_chunks(seq_chunks_ptr, chunk_bos_ptr, chunk_eos_ptr, n):
    """(first chunk, one past the last chunk, first token as int64, one past the last token) of
    sequence n. Its chunks are consecutive 64-row spans from its first token, so the recurrence kernels
    place chunk ic at first token + (ic - first chunk) * C with sequence_chunk_span: no table load
    inside their loop, whose tile addresses would otherwise wait on one each chunk."""
    c_first = tl.load(seq_chunks_ptr + n)
    c_end = tl.load(seq_chunks_ptr + n + 1)
    has_chunks = c_end > c_first  # an empty document has none (and no table entries to read)
    seq_bos = tl.load(chunk_bos_ptr + c_first, mask=has_chunks, other=0).to(tl.int64)
    return c_first, c_end, seq_bos, tl.load(chunk_eos_ptr + c_end - 1, mask=has_chunks, other=0).to(tl.int64)


@triton.jit
def sequence_chunk_span(ic, c_first, seq_bos, seq_eos, C: tl.constexpr):
    """(first token as int64, rows as int32) of chunk ic of the sequence sequence_chunks describes."""
    bos = seq_bos + (ic - c_first).to(tl.int64) * C
    return bos, tl.minimum(seq_eos - bos, C).to(tl.int32)


@triton.jit
def load_stacked_rows(ptr, second_offset, bos, n_rows, h, H: tl.constexpr, X: tl.constexpr, C: tl.constexpr):
    """[2C, X] tile: rows 0..C of head h from ptr as load_rows reads them, then the same rows of the
    tensor second_offset elements further on (zeros past n_rows in both halves)."""
    rows = tl.arange(0, 2 * C)
    t = rows % C
    offs = (tl.where(rows < C, 0, second_offset) + ((bos + t).to(tl.int64) * H + h) * X)[:, None] + tl.arange(0, X)[None, :]
    return tl.load(ptr + offs, mask=(t < n_rows)[:, None], other=0.0)


@triton.jit
def split_halves(x, C: tl.constexpr, N: tl.constexpr):
    """The top and bottom [C, N] halves of a [2C, N] tile."""
    return tl.split(tl.permute(tl.reshape(x, (2, C, N)), (1, 2, 0)))


@triton.jit
def stack_halves(top, bottom, C: tl.constexpr, N: tl.constexpr):
    """The [2C, N] tile of two [C, N] tiles, top rows first (split_halves' inverse)."""
    return tl.reshape(tl.permute(tl.join(top, bottom), (2, 0, 1)), (2 * C, N))


@triton.jit
def chunk_grid_place(X: tl.constexpr, H: tl.constexpr):
    """This program's (chunk ic, part x, head h) in a 1-D grid of NT * X * H programs (function.chunk_grid):
    x varies fastest, then h, then ic. So the programs that run at the same time cover whole token rows
    of one chunk (rows are [H, K] contiguous in memory, all heads side by side) rather than one head's
    256-byte slice of rows spread over the sequence, and the X parts of one (chunk, head), which read
    the same rows, run side by side and share them through L2."""
    pid = tl.program_id(0)
    return pid // (X * H), pid % X, (pid // X) % H


@triton.jit
def chunk_head_span(chunk_bos_ptr, chunk_eos_ptr, b_ptr, H: tl.constexpr, C: tl.constexpr):
    """This program's place in a (chunk, head) grid with its chunk's beta: (chunk ic, head h, first
    token and rows as chunk_span gives them, valid-row mask [C], sigmoid(b) [C] with 0 on pad rows)."""
    ic, _, h = chunk_grid_place(1, H)
    bos, n_rows = chunk_span(chunk_bos_ptr, chunk_eos_ptr, ic)
    valid = tl.arange(0, C) < n_rows
    return ic, h, bos, n_rows, valid, tl.where(valid, tl.sigmoid(load_vec(b_ptr, bos, n_rows, h, H, C)), 0.0)


@triton.jit
def sub_chunk_span(chunk_bos_ptr, chunk_eos_ptr, H: tl.constexpr, C: tl.constexpr, BC: tl.constexpr):
    """This program's place in a (chunk, sub-chunk, head) grid: (sub-chunk i, head h, the chunk's
    first token and rows as chunk_span gives them, the sub-chunk's first token and rows from there on).
    The rows from there on are <= 0 for a sub-chunk wholly past the end of a partial last chunk: such a
    program has nothing to do and must return, since its loops over earlier sub-chunks read whole
    16-row blocks unmasked (valid only when the sub-chunk itself has a row)."""
    ic, i, h = chunk_grid_place(C // BC, H)
    bos, n_rows = chunk_span(chunk_bos_ptr, chunk_eos_ptr, ic)
    return i, h, bos, n_rows, bos + i * BC, n_rows - i * BC


@triton.jit
def load_rows(ptr, bos, n_rows, h, H: tl.constexpr, X: tl.constexpr, C: tl.constexpr,
              BX: tl.constexpr, col0):
    """[C, BX] tile (stored dtype) of rows bos..bos+C of head h, columns col0..col0+BX; zeros past n_rows."""
    rows = tl.arange(0, C)
    cols = col0 + tl.arange(0, BX)
    offs = ((bos + rows).to(tl.int64) * H + h)[:, None] * X + cols[None, :]
    return tl.load(ptr + offs, mask=(rows < n_rows)[:, None], other=0.0)


@triton.jit
def load_row(ptr, bos, n_rows, h, row, H: tl.constexpr, X: tl.constexpr, BX: tl.constexpr, col0):
    """[BX] fp32 vector: columns col0..col0+BX of chunk row `row` (zeros when row >= n_rows)."""
    offs = ((bos + row) * H + h) * X + col0 + tl.arange(0, BX)
    return tl.load(ptr + offs, mask=(tl.zeros((BX,), dtype=tl.int32) + row) < n_rows, other=0.0).to(tl.float32)


@triton.jit
def store_rows(ptr, val, bos, n_rows, h, H: tl.constexpr, X: tl.constexpr, C: tl.constexpr,
               BX: tl.constexpr, col0):
    """Store a [C, BX] tile (cast to ptr's dtype) to rows bos..bos+n_rows of head h."""
    store_rows_where(ptr, val, bos, n_rows, h, H, X, C, BX, col0, tl.full((BX,), 1, tl.int1))


@triton.jit
def store_rows_where(ptr, val, bos, n_rows, h, H: tl.constexpr, X: tl.constexpr, C: tl.constexpr,
                     BX: tl.constexpr, col0, keep_cols):
    """store_rows for the columns where keep_cols [BX] is true (the others are left as they are)."""
    rows = tl.arange(0, C)
    cols = col0 + tl.arange(0, BX)
    offs = ((bos + rows).to(tl.int64) * H + h)[:, None] * X + cols[None, :]
    tl.store(ptr + offs, val.to(ptr.dtype.element_ty), mask=(rows < n_rows)[:, None] & keep_cols[None, :])


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
def row_rstd(q_ptr, k_ptr, bos, n_rows, h, H: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr):
    """Inverse L2 norms [C] of the chunk's raw q and k rows, 1 / sqrt(sum x^2 + 1e-6) (gate.l2_normalize),
    summed over K in BK-wide blocks; the kernels then normalise one column block at a time."""
    ssq_q = tl.zeros((C,), dtype=tl.float32)
    ssq_k = tl.zeros((C,), dtype=tl.float32)
    for kb in range(0, K // BK):
        qb = load_rows(q_ptr, bos, n_rows, h, H, K, C, BK, kb * BK).to(tl.float32)
        kb_ = load_rows(k_ptr, bos, n_rows, h, H, K, C, BK, kb * BK).to(tl.float32)
        ssq_q += tl.sum(qb * qb, 1)
        ssq_k += tl.sum(kb_ * kb_, 1)
    return 1.0 / tl.sqrt(ssq_q + 1e-6), 1.0 / tl.sqrt(ssq_k + 1e-6)


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
