"""`triton_kda`: the Triton KDA path as a torch.autograd.Function (forward and backward kernels).

Shapes: B batch, T time, H heads, K key dim, V value dim, N sequences (B, or len(cu_seqlens) - 1),
NT chunks in all sequences, C = 64 chunk size.

Forward = 5 launches (triton_fwd.py): per-chunk prologue, per-sub-chunk scores, the UT inverse, the WY
factors, then the state recurrence emitting o. The raw inputs are saved, plus the UT inverse M and the
scores A_qk (2 x [Ttot, H, C]); the backward reruns the prologue, the WY factors from the saved M and
the recurrence (storing chunk states instead of o), walks the state gradient backwards, and computes
every input gradient in five launches over chunks, sub-chunks or channel blocks (triton_bwd.py): dwy,
dscores key and query roles, the state terms, then dprologue.
Gradients: q, k, v, f, b, A_log, dt_bias, initial_state.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from kimik3.ops.kda import KERNEL_CHUNK
from kimik3.ops.kda.checks import check_arguments, check_cu_seqlens_values
from kimik3.ops.kda.chunk import no_tokens
from kimik3.ops.triton_interpret import patch_interpreter_scalar_index
from kimik3.ops.kda.triton_bwd import (chunk_dprologue_kernel, chunk_dscores_key_kernel, chunk_dscores_query_kernel,
                                       chunk_dstate_kernel, chunk_dstate_terms_kernel, chunk_dwy_kernel)
from kimik3.ops.kda.triton_fwd import (chunk_inverse_kernel, chunk_prologue_kernel, chunk_scores_kernel, chunk_state_kernel,
                                       chunk_wy_kernel)
from kimik3.ops.kda.triton_prologue import GATE_FORMS

patch_interpreter_scalar_index()

CHUNK = KERNEL_CHUNK
SUB_CHUNK = 16
"""Rows of one program of chunk_scores_kernel and the chunk_dscores kernels, and of the UT inverse's diagonal blocks."""
_DOT_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@dataclass(frozen=True)
class _Chunks:
    """Chunk tables for a (possibly packed) batch; every chunk lies inside one sequence."""

    bos: Tensor  # [NT] int32 first token of each chunk (flattened token index)
    eos: Tensor  # [NT] int32 one past its last token
    seq_chunks: Tensor  # [N + 1] int32 chunk index range of each sequence
    num_seqs: int

    @property
    def num_chunks(self) -> int:
        return self.bos.numel()


def _chunk_tables(B: int, T: int, cu_seqlens: Optional[Tensor], device: torch.device) -> _Chunks:
    if cu_seqlens is None:
        return _batch_chunk_tables(B, T, device)
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    lens = cu[1:] - cu[:-1]
    counts = (lens.clamp_min(0) + CHUNK - 1) // CHUNK
    seq_chunks = torch.cat([cu.new_zeros(1), counts.cumsum(0)])
    bad = (cu[0] != 0) | (cu[-1] != B * T) | (lens < 0).any()
    total, invalid = torch.stack([seq_chunks[-1], bad.long()]).tolist()  # one host sync: the grid size
    if invalid:  # the error path may sync again, for the message
        check_cu_seqlens_values(cu.tolist(), B * T)
    seq_of_chunk = torch.repeat_interleave(torch.arange(len(lens), device=device), counts, output_size=total)
    within = torch.arange(total, device=device) - seq_chunks[seq_of_chunk]
    bos = cu[seq_of_chunk] + within * CHUNK
    eos = torch.minimum(bos + CHUNK, cu[seq_of_chunk + 1])
    return _Chunks(bos.int(), eos.int(), seq_chunks.int(), len(lens))


@functools.lru_cache(maxsize=32)
def _batch_chunk_tables(B: int, T: int, device: torch.device) -> _Chunks:
    """The tables of B unpacked sequences of T tokens. Cached: every layer of every step asks for the
    same few, and building them costs the host ~10 small launches per call (the kernels only read
    them)."""
    per_seq = triton.cdiv(T, CHUNK)
    idx = torch.arange(B * per_seq, device=device, dtype=torch.int32)
    seq_start = (idx // per_seq) * T
    bos = seq_start + (idx % per_seq) * CHUNK
    eos = torch.minimum(bos + CHUNK, seq_start + T)
    seq_chunks = torch.arange(B + 1, device=device, dtype=torch.int32) * per_seq
    return _Chunks(bos, eos, seq_chunks, B)


@dataclass(frozen=True)
class StageLaunch:
    """How one per-chunk kernel is launched."""

    warps: int
    block: Optional[int] = None
    """Column block: the kernel walks K (and V, where it reads V) in blocks this wide, capped at those dims
    (None for a kernel that walks no columns)."""
    stages: Optional[int] = None
    """Software-pipelining stages of its loops (None: Triton's default, 3)."""


LAUNCH = {"prologue": StageLaunch(8, 32), "scores": StageLaunch(1, 32, stages=2), "inverse": StageLaunch(1),
          "wy": StageLaunch(4, 64),
          "dwy": StageLaunch(4, 64), "dscores_key": StageLaunch(4, 64), "dscores_query": StageLaunch(4, 32),
          "dstate_terms": StageLaunch(4, 64), "dprologue": StageLaunch(16, 128)}
"""Launch configs of the per-chunk kernels, from `benchmarks/kda_kernels.py --sweep` on the H200 at
(1, 8192, 32, 128) bf16; the neighbours of each were slower or within noise. The two non-default
options (scores in 2 pipelining stages, dwy on 64-wide blocks) were then timed together over 30
iterations at all four benchmark shapes: fwd+bwd 3.5-4.8% faster at each. dstate_terms on 64-wide
blocks with 4 warps (instead of 32-wide with 8), timed the same way beside the previous config:
fwd+bwd 2.5-3.3% faster at each shape, and `--check`ed on the device. With the dyadic levels inside
sub-chunks (triton_pair_decay.py) the scores kernels' optimum moved: scores on 1 warp and 32-wide
blocks, dscores_query on 32-wide blocks (1.62-1.67 / 6.06-6.09 ms fwd / fwd+bwd at that shape against
1.87-1.89 / 6.37-6.50 on the old configs, two alternated rounds in one process). chunk_dprologue_kernel
on 16 warps over whole 128-wide rows, its one-pass path (no dkn write-back and re-read; 8 warps on
32-wide blocks before): 0.47 ms per call against 0.57, fwd+bwd 1.6-2.2% faster at each of the four
shapes (two alternated rounds of 20 iterations in one call; since then it also applies the state
terms' decays, 0.69 ms, and chunk_dstate_terms_kernel shrank to its two matmuls). chunk_inverse_kernel on
1 warp: 2 or 4 were within noise at (1, 8192, 16, 128) on an H100, and so were register caps (maxnreg)
on the scores, dwy and dscores_key kernels (2026-12-07).

A launch config is only adopted after `--check` passes on the device: Triton 3.6 miscompiled an
earlier fused backward kernel at 4 warps on the H200 (dk, db and the gate gradients off by relative
errors of 0.06 to 4.7 while the CPU interpreter matched the reference), and ops/kda/device_check.py
guards every training run against such a kernel."""
TUNING: dict[str, Optional[int]] = {
    **{f"{stage}_{option}": None for stage, launch in LAUNCH.items() for option in ("warps", "block", "stages", "maxnreg")
       if option != "block" or launch.block is not None},  # no block key for a kernel that walks no columns
    "state_bv": None, "state_warps": None}
"""Launch-config overrides (None = LAUNCH / the heuristics below); benchmarks/kda_kernels.py --sweep and
--tuning set them."""


def _launch(stage: str) -> dict[str, int]:
    """Launch options of a per-chunk kernel: LAUNCH[stage] unless TUNING overrides it, and `maxnreg` (a
    register cap that trades spills for more programs per SM) only when TUNING sets `<stage>_maxnreg`."""
    options = {"num_warps": TUNING[f"{stage}_warps"] or LAUNCH[stage].warps}
    stages = TUNING[f"{stage}_stages"] or LAUNCH[stage].stages
    if stages:
        options["num_stages"] = stages
    if TUNING[f"{stage}_maxnreg"]:
        options["maxnreg"] = TUNING[f"{stage}_maxnreg"]
    return options


def _block(stage: str, *dims: int) -> int:
    """The column block of a per-chunk kernel (LAUNCH[stage].block unless TUNING overrides it), capped at
    the head dims it walks."""
    return min(*dims, TUNING[f"{stage}_block"] or LAUNCH[stage].block)


def chunk_grid(num_chunks: int, parts: int, H: int) -> tuple[int]:
    """The 1-D grid of a per-chunk kernel with `parts` programs per (chunk, head) (column blocks or
    sub-chunks); triton_prologue.chunk_grid_place says why parts, then heads, vary fastest."""
    return (num_chunks * parts * H,)


def _state_stages(dt) -> int:
    """Software-pipelining stages of the recurrence kernels: Triton's default for 16-bit inputs; 1 for
    fp32, whose [C, K] tiles in 2+ stages need 262-311 KB of shared memory at K = 128 (the H200 has
    227 KB per block; compiled for sm_90 with ops/triton_aot.py: 98 KB with one stage)."""
    return 1 if dt == tl.float32 else 3


def _state_config(V: int, programs_per_v: int) -> tuple[int, int]:
    """(BV, num_warps) for the recurrence kernels: split V until ~one program per SM is reached."""
    if TUNING["state_bv"]:
        return TUNING["state_bv"], TUNING["state_warps"] or 4
    bv = min(V, 64)
    while bv > 16 and programs_per_v * (V // bv) < 128:
        bv //= 2
    return bv, TUNING["state_warps"] or 4


def _check(q: Tensor, v: Tensor, cu_seqlens: Optional[Tensor]) -> None:
    """What only the Triton path needs besides checks.check_arguments: head dims, dtype, packed B == 1."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    for name, d in (("K", K), ("V", V)):
        if d < 16 or d > 256 or d & (d - 1):
            raise ValueError(f"triton_kda needs head dim {name} a power of two in [16, 256], got {d}")
    if q.dtype not in _DOT_DTYPES:
        raise ValueError(f"triton_kda dtype {q.dtype} is not one of {list(_DOT_DTYPES)}")
    if cu_seqlens is not None and B != 1:
        raise ValueError(f"cu_seqlens needs batch size 1, got B={B}")


def _forward_stages(q, k, v, f, b, A_log, dt_bias, h0, chunks: _Chunks, scale: float, form: int,
                    lower_bound: float, *, saved: Optional[tuple[Tensor, Tensor, Optional[Tensor]]],
                    output_final_state: bool, keep_states: bool = False):
    """Run the intra stage and the recurrence. Returns (o, ht, intra dict) in packed [Ttot, H, *] layout.

    saved: None in the forward, which computes the UT inverse M and the scores A_qk (kept in the
    dict: the backward saves them, 2 x [Ttot, H, C] in the inputs' dtype); the backward passes them
    back, and its rerun then skips the pairwise scores and the inverse (most of the intra stage's
    time) and stores each chunk's start state instead of o.

    keep_states: the forward also stores each chunk's start state (`hs`, [NT, H, K, V] in the inputs'
    dtype), and the backward passes it back as saved's third item, so its rerun skips the recurrence
    too. The states are the ones the rerun would compute, bit for bit: both runs multiply the same
    stored M, so w, u~ and every state agree."""
    for_backward = saved is not None
    B, T, H, K = q.shape
    V = v.shape[-1]
    dt = _DOT_DTYPES[q.dtype]
    NT, N = chunks.num_chunks, chunks.num_seqs
    tok = B * T
    new = lambda *shape, dtype=q.dtype: q.new_empty(*shape, dtype=dtype)  # noqa: E731
    wq = new(2, tok, H, K)  # w, then qg: chunk_state_kernel loads a chunk's rows of both as one tile
    x = dict(w=wq[0], ut=new(tok, H, V), qg=wq[1], kd=new(tok, H, K), kbg=new(tok, H, K),
             gl=new(NT, H, K, dtype=torch.float32), qg_offset=wq.stride(0))  # elements from w to qg
    x["m"], x["aqk"], hs = saved if for_backward else (new(tok, H, CHUNK), new(tok, H, CHUNK), None)
    # fp32 scratch: the sub-chunk loops read rows of normalised q / k and of G back from it, and the
    # current row is the kernel's fp32 value, so both halves of each pair term see the same numbers
    x["kn"], x["qn"], x["G"] = (new(tok, H, K, dtype=torch.float32) for _ in range(3))
    pk = _block("prologue", K)  # the prologue's grid splits K into blocks
    chunk_prologue_kernel[chunk_grid(NT, K // pk, H)](
        q, k, f, b, A_log, dt_bias, chunks.bos, chunks.eos, x["qg"], x["kd"], x["gl"], x["kn"], x["qn"], x["G"],
        x["kbg"], scale, lower_bound, H=H, K=K, C=CHUNK, BK=pk, FORM=form, **_launch("prologue"))
    if not for_backward:
        akk = new(tok, H, CHUNK, dtype=torch.float32)
        chunk_scores_kernel[chunk_grid(NT, CHUNK // SUB_CHUNK, H)](
            x["kn"], x["qn"], x["G"], b, chunks.bos, chunks.eos, x["aqk"], akk, scale,
            H=H, K=K, C=CHUNK, BC=SUB_CHUNK, BK=_block("scores", K), DT=dt, **_launch("scores"))
        chunk_inverse_kernel[chunk_grid(NT, 1, H)](
            akk, x["m"], chunks.bos, chunks.eos, H=H, C=CHUNK, BC=SUB_CHUNK, **_launch("inverse"))
    chunk_wy_kernel[chunk_grid(NT, 1, H)](
        x["kbg"], v, b, chunks.bos, chunks.eos, x["m"], x["w"], x["ut"],
        H=H, K=K, V=V, C=CHUNK, BK=_block("wy", K, V), DT=dt, **_launch("wy"))
    if for_backward and hs is not None:  # the forward kept the states: no recurrence to rerun
        x["hs"] = hs
        return None, None, x
    o = None if for_backward else new(tok, H, V)
    ht = q.new_empty(N, H, K, V, dtype=torch.float32) if output_final_state else None
    hs = new(NT, H, K, V) if for_backward or keep_states else None
    bv, warps = _state_config(V, N * H)
    dummy = x["gl"]
    chunk_state_kernel[(N, H, V // bv)](
        x["w"], x["ut"], x["qg_offset"], x["kd"], x["aqk"], x["gl"],
        h0 if h0 is not None else dummy, o if o is not None else dummy,
        hs if hs is not None else dummy, ht if ht is not None else dummy,
        chunks.seq_chunks, chunks.bos, chunks.eos,
        H=H, K=K, V=V, C=CHUNK, BV=bv, HAS_H0=h0 is not None, STORE_O=not for_backward,
        STORE_STATES=hs is not None, STORE_FINAL=output_final_state, DT=dt, num_warps=warps,
        num_stages=_state_stages(dt),
    )
    x["hs"] = hs
    return o, ht, x


class TritonKDAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, f, b, A_log, dt_bias, initial_state, cu_seqlens, scale, form, lower_bound,
                output_final_state, keep_states):
        B, T, H, K = q.shape
        chunks = _chunk_tables(B, T, cu_seqlens, q.device)
        o, ht, x = _forward_stages(q, k, v, f, b, A_log, dt_bias, initial_state, chunks, scale, form, lower_bound,
                                   saved=None, output_final_state=output_final_state, keep_states=keep_states)
        ctx.save_for_backward(q, k, v, f, b, A_log, dt_bias, initial_state, x["m"], x["aqk"], x["hs"])
        ctx.chunks, ctx.scale, ctx.form, ctx.lower_bound = chunks, scale, form, lower_bound
        return o.view(B, T, H, -1), ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, f, b, A_log, dt_bias, h0, m, aqk, hs = ctx.saved_tensors
        chunks: _Chunks = ctx.chunks
        B, T, H, K = q.shape
        V = v.shape[-1]
        dt = _DOT_DTYPES[q.dtype]
        NT, N = chunks.num_chunks, chunks.num_seqs
        _, _, x = _forward_stages(q, k, v, f, b, A_log, dt_bias, h0, chunks, ctx.scale, ctx.form,
                                  ctx.lower_bound, saved=(m, aqk, hs), output_final_state=False)
        do = do.contiguous()
        dh = torch.empty_like(x["hs"])
        du = torch.empty_like(v)
        dh0 = torch.empty(N, H, K, V, device=q.device, dtype=torch.float32) if h0 is not None else None
        bv, warps = _state_config(V, N * H)
        dummy = x["gl"]
        chunk_dstate_kernel[(N, H, V // bv)](
            do, x["qg_offset"], x["w"], x["kd"], x["aqk"], x["gl"],
            dht.contiguous() if dht is not None else dummy, dh, du, dh0 if dh0 is not None else dummy,
            chunks.seq_chunks, chunks.bos, chunks.eos,
            H=H, K=K, V=V, C=CHUNK, BV=bv, HAS_DHT=dht is not None, HAS_H0=h0 is not None, DT=dt,
            num_warps=warps, num_stages=_state_stages(dt),
        )
        dq, dk, dv, df = (torch.empty_like(t) for t in (q, k, v, f))
        db = torch.empty_like(b)
        da_part = q.new_empty(NT, H, dtype=torch.float32)
        ddt_part = q.new_empty(NT, H, K, dtype=torch.float32)
        tok = B * T
        f32 = lambda *shape: q.new_empty(*shape, dtype=torch.float32)  # noqa: E731
        g = dict(u=torch.empty_like(v).view(tok, H, V), dxw=f32(tok, H, K), dakk=f32(tok, H, CHUNK),
                 daqk=f32(tok, H, CHUNK), dbeta=f32(tok, H), dkn=f32(tok, H, K), dqn=f32(tok, H, K), lkk=f32(tok, H, K))
        bd = _block("dwy", K, V)
        chunk_dwy_kernel[chunk_grid(NT, 1, H)](
            v, b, chunks.bos, chunks.eos, x["w"], x["ut"], x["m"], x["hs"], du, do,
            g["u"], g["dxw"], g["dakk"], g["daqk"], g["dbeta"], dv, ctx.scale,
            H=H, K=K, V=V, C=CHUNK, BK=bd, BV=bd, DT=dt, **_launch("dwy"))
        sub_chunks = chunk_grid(NT, CHUNK // SUB_CHUNK, H)
        # each role's sums go to their own buffer once: R to dkn, L_qk to dqn, L_kk to lkk
        chunk_dscores_key_kernel[sub_chunks](
            x["kn"], x["qn"], x["G"], b, chunks.bos, chunks.eos, g["dakk"], g["daqk"], g["dkn"],
            H=H, K=K, C=CHUNK, BC=SUB_CHUNK, BK=_block("dscores_key", K), DT=dt, **_launch("dscores_key"))
        chunk_dscores_query_kernel[sub_chunks](
            x["kn"], x["G"], chunks.bos, chunks.eos, g["dakk"], g["daqk"], g["lkk"], g["dqn"],
            H=H, K=K, C=CHUNK, BC=SUB_CHUNK, BK=_block("dscores_query", K), DT=dt, **_launch("dscores_query"))
        bd = _block("dstate_terms", K, V)
        # the raw state terms go to the normalised q / k and e^{G_last} scratch, which nothing reads again
        # (chunk_dprologue_kernel renormalises q and k from the inputs)
        d_qg, d_kd, d_gl = x["qn"], x["kn"], x["gl"]
        chunk_dstate_terms_kernel[chunk_grid(NT, K // bd, H)](
            chunks.bos, chunks.eos, x["hs"], dh, do, g["u"], d_qg, d_kd, d_gl,
            H=H, K=K, V=V, C=CHUNK, BK=bd, BV=bd, DT=dt, **_launch("dstate_terms"))
        chunk_dprologue_kernel[chunk_grid(NT, 1, H)](
            q, k, f, b, A_log, dt_bias, chunks.bos, chunks.eos,
            x["G"], g["dxw"], d_qg, d_kd, d_gl, g["dkn"], g["dqn"], g["lkk"], g["dbeta"], dq, dk, df, db, da_part,
            ddt_part, ctx.scale, ctx.lower_bound, H=H, K=K, C=CHUNK, BK=_block("dprologue", K), FORM=ctx.form,
            **_launch("dprologue"))
        dA_log = da_part.sum(0).to(A_log.dtype)
        ddt_bias = ddt_part.sum(0).view(-1).to(dt_bias.dtype)
        return dq, dk, dv, df, db, dA_log, ddt_bias, dh0, None, None, None, None, None, None


def triton_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    f: Tensor,
    b: Tensor,
    A_log: Tensor,
    dt_bias: Tensor,
    *,
    gate_form: str = "softplus",
    lower_bound: float = -5.0,
    scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[Tensor] = None,
    keep_states: bool = False,
) -> tuple[Tensor, Optional[Tensor]]:
    """KDA from raw projections with the prologue fused into Triton kernels (see kimik3.ops.kda.kda).

    Args:
        q, k: [B, T, H, K] raw queries / keys (L2-normalised inside); v: [B, T, H, V].
        f: [B, T, H, K] gate pre-activation; b: [B, T, H] beta logits; A_log: [H]; dt_bias: [H * K].
        gate_form: 'softplus' or 'bounded' (gate.kda_gate); lower_bound: the bounded form's floor.
        scale: query scale, default K ** -0.5.
        initial_state: [N, H, K, V] fp32 or None; cu_seqlens: [N + 1] packed boundaries (B == 1).
        keep_states: keep each 64-token chunk's start state from the forward for the backward
            ([T / 64, H, K, V] in q's dtype: 64 MiB at 8192 tokens x 16 heads x 128 x 128) instead of
            rerunning the recurrence there; the same gradients, bit for bit.
    Returns:
        o [B, T, H, V] in q's dtype, and the final state [N, H, K, V] fp32 if asked for, else None.
    """
    if gate_form not in GATE_FORMS:
        raise ValueError(f"gate form {gate_form!r} is not one of {sorted(GATE_FORMS)}")
    check_arguments(q, k, v, f, b, A_log, dt_bias, gate_form=gate_form, lower_bound=lower_bound,
                    initial_state=initial_state, cu_seqlens=cu_seqlens)
    _check(q, v, cu_seqlens)
    K = q.shape[-1]
    scale = K**-0.5 if scale is None else float(scale)
    if initial_state is not None:
        initial_state = initial_state.float().contiguous()
    if q.shape[1] == 0:
        return no_tokens(q, v, initial_state, output_final_state, cu_seqlens, q.dtype)
    q, k, v, f, b = (t.contiguous() for t in (q, k, v, f, b))
    return TritonKDAFunction.apply(q, k, v, f, b, A_log.contiguous(), dt_bias.contiguous(), initial_state,
                                   cu_seqlens, scale, GATE_FORMS[gate_form], float(lower_bound),
                                   output_final_state, keep_states)
