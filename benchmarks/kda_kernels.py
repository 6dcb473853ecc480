"""KDA kernel benchmark and GPU accuracy check: our Triton kernels vs fla's chunk_kda, the PyTorch chunk
reference and causal SDPA, forward and forward+backward, on the same inputs in one process.

    python benchmarks/kda_kernels.py --out kda.json             # H200 shapes, fla if importable
    python benchmarks/kda_kernels.py --check --out check.json   # accuracy vs fp32 at training shapes
    python benchmarks/kda_kernels.py --tiny                     # CPU smoke run (TRITON_INTERPRET=1)
    python benchmarks/kda_kernels.py --profile --shape 1,32768,32,128   # per-kernel times at one shape
    python benchmarks/kda_kernels.py --host 50 --shape 4,4096,32,128    # the host's time per call, and where it goes

Inputs are the raw projections (q, k un-normalised, gate pre-activation f, beta logits b) so every
implementation does the same work: ours and fla fuse L2 norm, gate and sigmoid into their kernels.
TFLOP/s counts the chunk-form matmul FLOPs (`kda_flops`), the same for every KDA implementation.
`triton_kept` is ours with the chunk states kept from the forward (`keep_states`,
train.recompute_kda_states=false): timed and checked beside the default, which reruns the recurrence
in the backward.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Iterable, Optional

import torch
import torch.nn.functional as F

SHAPES = ((1, 8192, 32, 128), (4, 4096, 32, 128), (1, 32768, 32, 128), (2, 16384, 16, 128))
TINY_SHAPE = (1, 40, 1, 16)
"""--tiny's default (B, T, H, D): a partial last chunk, small enough for the CPU interpreter."""
CHECK_CASES = (  # (B, T, H, D, gate form, packed document lengths or None)
    (1, 32768, 4, 128, "softplus", None),
    (2, 4096, 8, 128, "bounded", None),
    (1, 8192, 4, 64, "softplus", None),
    (1, 16384, 4, 128, "softplus", (5000, 64, 7001, 4319)),
)
TOLERANCE = {"o": 1e-2, "ht": 1e-2, "dq": 1e-2, "dk": 1e-2, "dv": 1e-2, "df": 1.5e-2, "db": 1e-2,
             "dA_log": 0.1, "ddt_bias": 0.05, "dh0": 1e-2}
"""Relative RMS error bounds of bf16 kernels against the fp32 reference (stated in the README), about
2x above the largest value measured on the H200 (2026-12-03, --check cases and the GPU tests' cases):
every tensor but the gate gradients 3e-3..5e-3; df 0.006..0.008; dA_log 0.005..0.011 (0.054 at the
tests' 2-4K tokens); ddt_bias 0.009..0.023. dA_log and ddt_bias are sums of signed per-token terms over
all T, so cancellation inflates their relative error, most at short T."""


SPEEDUPS = {"speedup_vs_fla": ("fla", "triton"), "kept_states_speedup_vs_fla": ("fla", "triton_kept"),
            "kept_states_speedup": ("triton", "triton_kept")}
"""Ratios each benchmark row reports: name -> (baseline, timed), baseline time / timed time."""


@dataclass
class Timing:
    fwd_ms: Optional[float] = None
    fwdbwd_ms: Optional[float] = None
    fwd_queued_ms: Optional[float] = None
    """The forward timed behind a queued sleep kernel (CUDA only): the host issues it while the GPU is
    still busy, as in a training step, so this reads the kernels' time without the host's launch
    latency after a sync, which fwd_ms (each iteration after a sync, like the peers' harnesses) includes."""
    peak_mem_gib: Optional[float] = None
    note: str = ""


def make_inputs(B: int, T: int, H: int, D: int, dtype: torch.dtype, device: str, seed: int = 0) -> dict:
    """Raw KDA projections with realistic scales: gate rates exp(A_log) in [1, 16] as in Kimi Linear."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    x = dict(q=rnd(B, T, H, D), k=rnd(B, T, H, D), v=rnd(B, T, H, D), f=rnd(B, T, H, D), b=rnd(B, T, H))
    x = {n: t.to(device=device, dtype=dtype) for n, t in x.items()}
    x["A_log"] = torch.empty(H).uniform_(0, math.log(16), generator=gen).to(device)
    x["dt_bias"] = (rnd(H * D) * 0.5 - 2.0).to(device)
    return x


def kda_flops(B: int, T: int, H: int, D: int, C: int = 64) -> float:
    """Forward matmul FLOPs of the chunk form (K = V = D, full C-wide triangles counted).

    Per token and head: scores A_kk, A_qk and w = M (beta k e^G): 3 x 2CD; u~ = M (beta v) and
    A_qk u: 2 x 2CD; state read w S0, qg S0 and update kd^T u: 3 x 2D^2.
    """
    return float(B * T * H * (10 * C * D + 6 * D * D))


def _ours(x: dict, form: str = "softplus", **kw):
    from kimik3.ops.kda import kda

    return kda(x["q"], x["k"], x["v"], x["f"], x["b"], x["A_log"], x["dt_bias"], impl="triton",
               gate_form=form, **kw)


def _ours_kept(x: dict, form: str = "softplus", **kw):
    """Ours with the chunk states kept from the forward (train.recompute_kda_states=false)."""
    return _ours(x, form, keep_states=True, **kw)


def _chunk_ref(x: dict, form: str = "softplus", **kw):
    from kimik3.ops.kda import kda

    return kda(x["q"], x["k"], x["v"], x["f"], x["b"], x["A_log"], x["dt_bias"], impl="chunk",
               gate_form=form, **kw)


def _fla() -> Optional[Callable]:
    try:
        from fla.ops.kda import chunk_kda
    except Exception:  # optional dependency
        return None

    def run(x: dict, form: str = "softplus", **kw):
        bounded = dict(safe_gate=True, lower_bound=-5.0) if form == "bounded" else {}
        return chunk_kda(x["q"], x["k"], x["v"], x["f"], x["b"], A_log=x["A_log"], dt_bias=x["dt_bias"],
                         use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                         **bounded, **kw)

    return run


def _sdpa(x: dict, **_):
    q, k, v = (x[n].transpose(1, 2) for n in "qkv")
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2), None


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


QUEUED_SLEEP_CYCLES = 20_000_000
"""GPU clock cycles of the sleep kernel queued ahead of a `queued` timing (~12 ms at 1.7 GHz): far
longer than any host needs to issue one forward."""


def _time(fn: Callable[[], None], device: str, warmup: int, iters: int, queued: bool = False) -> float:
    """Median milliseconds of fn (CUDA events on GPU, wall clock on CPU). `queued` (CUDA): each
    iteration starts behind a sleep kernel, so the events time the GPU work alone."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(iters):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if queued:
                torch.cuda._sleep(QUEUED_SLEEP_CYCLES)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def grad_leaves(x: dict) -> dict:
    """Detached copies of the inputs, the floating ones requiring grad."""
    return {n: t.detach().requires_grad_(t.is_floating_point()) for n, t in x.items()}


def forward_backward(run: Callable, leaves: dict, do: torch.Tensor) -> tuple:
    """One forward + backward of `run`, returning the input gradients instead of accumulating them.

    `o.backward` would add each iteration's gradients into the leaves' `.grad`: one extra elementwise
    kernel per input per iteration (0.2 ms at 1 x 8192 x 32 x 128, 0.8 ms at 32K tokens on the H100),
    which is neither side's kernel and would be charged to whichever side a peer's harness skips it for.
    """
    o, _ = run(leaves)
    inputs = [t for t in leaves.values() if t.requires_grad]
    return torch.autograd.grad(o, inputs, do, allow_unused=True)


def repeat_ours(leaves: dict, do: torch.Tensor, runs: int, device: str) -> None:
    """`runs` forward + backward passes of our kernels, then a device sync (--profile's warm-up and
    profiled passes, --plain's)."""
    for _ in range(runs):
        forward_backward(_ours, leaves, do)
    _sync(device)


def bench_one(run: Callable, x: dict, device: str, warmup: int, iters: int) -> Timing:
    grads = grad_leaves(x)
    do = torch.randn_like(x["v"])

    def fwd():
        with torch.no_grad():
            run(x)

    def fwdbwd():
        forward_backward(run, grads, do)

    t = Timing(fwd_ms=_time(fwd, device, warmup, iters))
    if device == "cuda":
        t.fwd_queued_ms = _time(fwd, device, warmup, iters, queued=True)
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    t.fwdbwd_ms = _time(fwdbwd, device, warmup, iters)
    if device == "cuda":
        t.peak_mem_gib = (torch.cuda.max_memory_allocated() - base) / 2**30
    return t


def benchmark(shapes, device: str, dtype: torch.dtype, use_fla: bool, ref_max_tokens: int, warmup: int,
              iters: int) -> list[dict]:
    fla = _fla() if use_fla else None
    rows = []
    for B, T, H, D in shapes:
        x = make_inputs(B, T, H, D, dtype, device)
        impls = {"triton": _ours, "triton_kept": _ours_kept}
        if fla is not None:
            impls["fla"] = fla
        if B * T <= ref_max_tokens:
            impls["chunk"] = _chunk_ref
        if device == "cuda":
            impls["sdpa"] = _sdpa
        row = {"B": B, "T": T, "H": H, "D": D, "dtype": str(dtype).replace("torch.", "")}
        flops = kda_flops(B, T, H, D)
        for name, run in impls.items():
            try:
                t = bench_one(run, x, device, warmup, iters)
            except torch.OutOfMemoryError as e:  # the PyTorch reference at long T
                t = Timing(note=f"OOM: {str(e).splitlines()[0]}")
                torch.cuda.empty_cache()
            r = asdict(t)
            if t.fwdbwd_ms is not None:
                r["fwdbwd_Mtok_s"] = B * T / t.fwdbwd_ms / 1e3
                if name != "sdpa":
                    r["fwd_TFLOPs"] = flops / t.fwd_ms / 1e9
                    r["fwdbwd_TFLOPs"] = 3 * flops / t.fwdbwd_ms / 1e9
            row[name] = r
        for ratio, (base, timed) in SPEEDUPS.items():
            if row.get(base, {}).get("fwd_ms") and row.get(timed, {}).get("fwd_ms"):
                row[ratio] = {mode: row[base][f"{mode}_ms"] / row[timed][f"{mode}_ms"]
                              for mode in ("fwd", "fwdbwd", "fwd_queued") if row[base][f"{mode}_ms"]}
        print(json.dumps(row), flush=True)
        rows.append(row)
        del x
    return rows


def kernel_stats() -> list[dict]:
    """Registers, spills, warps and shared memory of every compiled variant of our kernels."""
    from kimik3.ops.kda import triton_bwd, triton_fwd

    stats = []
    for fn in (triton_fwd.chunk_prologue_kernel, triton_fwd.chunk_scores_kernel, triton_fwd.chunk_inverse_kernel,
               triton_fwd.chunk_wy_kernel,
               triton_fwd.chunk_state_kernel, triton_bwd.chunk_dstate_kernel, triton_bwd.chunk_dwy_kernel,
               triton_bwd.chunk_dscores_key_kernel, triton_bwd.chunk_dscores_query_kernel,
               triton_bwd.chunk_dstate_terms_kernel, triton_bwd.chunk_dprologue_kernel):
        for cache in getattr(fn, "device_caches", {}).values():
            for k in cache[0].values():
                stats.append({"kernel": fn.__name__, "regs": k.n_regs, "spills": k.n_spills,
                              "warps": k.metadata.num_warps, "shared": k.metadata.shared})
    return stats


def kernel_times(events, iterations: int) -> dict[str, dict]:
    """Our kernels' device time per fwd+bwd iteration from profiler averages (`key_averages()`): ms summed
    over the launches of one iteration, and the launches (the forward's kernels run twice: once more in
    the backward's rerun). JSON, so benchmarks/compare_trees.py can line kernels up across trees."""
    return {e.key: {"ms_per_iteration": round(e.device_time_total / 1e3 / iterations, 4),
                    "calls_per_iteration": e.count / iterations}
            for e in events if e.key.startswith("chunk_") and e.key.endswith("_kernel")}


def profile(shape, dtype: torch.dtype) -> dict:
    """Per-kernel CUDA time of our forward+backward (torch.profiler) and the compiled kernels' resources."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    x = make_inputs(*shape, dtype, "cuda")
    leaves = grad_leaves(x)
    do = torch.randn_like(x["v"])
    repeat_ours(leaves, do, 2, "cuda")
    out = {"shape": shape, "kernels": kernel_stats()}
    try:
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            repeat_ours(leaves, do, 3, "cuda")
        averages = prof.key_averages()
        out["table"] = averages.table(sort_by="cuda_time_total", row_limit=12)
        out["kernel_ms"] = kernel_times(averages, iterations=3)
    except Exception as e:  # CUPTI may be unavailable (gVisor)
        out["table"] = f"profiler failed: {e!r}"
    print(out["table"], "\n", json.dumps(out["kernels"]), flush=True)
    return out


PLAIN_LAUNCHES = ("chunk_prologue_kernel", "chunk_scores_kernel", "chunk_inverse_kernel", "chunk_wy_kernel",
                  "chunk_state_kernel", "chunk_prologue_kernel", "chunk_wy_kernel", "chunk_state_kernel",
                  "chunk_dstate_kernel", "chunk_dwy_kernel", "chunk_dscores_key_kernel", "chunk_dscores_query_kernel",
                  "chunk_dstate_terms_kernel", "chunk_dprologue_kernel")
"""Our kernels in launch order in one fwd+bwd with the chunk states recomputed (the forward's five, then the
backward's rerun and its own), for counting launches under a profiler."""


def plain_runs(shape, dtype: torch.dtype, device: str, runs: int) -> dict:
    """`runs` forward + backward passes of our kernels at one shape and nothing else: no timing, no peer, no
    reference, so a profiler that counts launches sees only ours, in order, e.g. on the device
    `ncu -k regex:chunk_ --launch-skip 28 --launch-count 14 python benchmarks/kda_kernels.py --plain 3 --shape
    1,8192,16,128` profiles the third pass's kernels (PLAIN_LAUNCHES, 14 per pass: the states recomputed)."""
    x = make_inputs(*shape, dtype, device)
    repeat_ours(grad_leaves(x), torch.randn_like(x["v"]), runs, device)
    return {"shape": list(shape), "runs": runs}


def host_cost(shape, dtype: torch.dtype, device: str, calls: int, use_fla: bool) -> dict:
    """The host's milliseconds per call (forward, and forward+backward), ours and fla's, and where ours go.

    The synced forward timing charges each call the host time until its first kernel starts (~0.3 ms
    of our 2.6 at (4, 4096, 32, 128) on the H100): Python, allocations and Triton's launch path.
    Here `calls` calls are issued back to back between two syncs, so the GPU never holds the host back
    (its queue only grows) and the wall clock of the loop is the host's cost alone; then the same loop
    of our forward again under cProfile, whose top functions by own time say where it goes (cProfile
    adds ~1 us per Python call, so its total reads higher than the plain figure), and ours by
    cumulative time (each with what it calls: allocations, launches)."""
    import cProfile
    import io
    import pstats

    x = make_inputs(*shape, dtype, device)
    leaves, do = grad_leaves(x), torch.randn_like(x["v"])
    fla = _fla() if use_fla else None
    impls = {"triton": _ours, **({"fla": fla} if fla is not None else {})}

    def forward(run: Callable) -> None:
        with torch.no_grad():
            run(x)

    def host_ms(fn: Callable[[], None]) -> float:
        fn()  # compile / autotune outside the loop
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        elapsed = time.perf_counter() - t0
        _sync(device)
        return elapsed * 1e3 / calls

    out: dict = {"shape": list(shape), "calls": calls}
    for name, run in impls.items():
        out[name] = {"fwd_host_ms": host_ms(lambda: forward(run)),
                     "fwdbwd_host_ms": host_ms(lambda: forward_backward(run, leaves, do))}
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        forward(_ours)
    profiler.disable()
    _sync(device)
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(20)  # the host path's costliest functions, whoever's
    stats.sort_stats("cumulative").print_stats("kimik3", 12)  # our functions, each with what it calls
    out["triton_fwd_cprofile"] = text.getvalue()
    print(json.dumps({k: v for k, v in out.items() if k != "triton_fwd_cprofile"}), "\n", out["triton_fwd_cprofile"],
          flush=True)
    return out


def _options(stage: str, **values: tuple[int, ...]) -> list[dict[str, int]]:
    """One override per value of each option of a stage: {'dwy_stages': 1}, {'dwy_stages': 2}, ..."""
    return [{f"{stage}_{option}": v} for option, vs in values.items() for v in vs]


SWEEP = (*_options("prologue", warps=(4, 16), stages=(1,), block=(16, 64)),
         *_options("scores", warps=(2, 4), stages=(1, 3), block=(64,), maxnreg=(128,)),
         *_options("inverse", warps=(2, 4)),
         *_options("wy", warps=(8,), stages=(1, 2), block=(32,), maxnreg=(128,)),
         *_options("dwy", warps=(8,), stages=(1, 2), block=(32,), maxnreg=(168,)),
         *_options("dscores_key", warps=(2, 8), stages=(1, 2), block=(32,), maxnreg=(128,)),
         *_options("dscores_query", warps=(2, 8), stages=(1, 2), block=(64,), maxnreg=(96,)),
         *_options("dstate_terms", warps=(8, 16), stages=(1, 2), block=(32,), maxnreg=(96,)),
         *_options("dprologue", warps=(8,), stages=(1, 2), block=(64,)),
         {"state_bv": 16}, {"state_bv": 32}, {"state_bv": 64}, {"state_bv": 32, "state_warps": 8})
"""Launch-config overrides --sweep times (function.TUNING). Timing only: a config must also pass --check
on the device before it becomes a default (an earlier fused backward kernel was faster at 4 warps and
miscompiled there on the H200). Each V block is swept, since the heuristic's pick depends on the shape
(64 at (4, 4096, 32): 256 programs of one per SM, two waves; 32 at 8K x 32). Left out: the recurrence on
16-wide V blocks with 8 warps, whose launch ended in an illegal memory access on an H100 (2026-12-07)
and so took the rest of a sweep's process down."""


def sweep_overrides(keys: list[str]) -> list[dict[str, int]]:
    """The overrides of SWEEP that set a key starting with one of `keys` (all of them if it is empty)."""
    return [o for o in SWEEP if not keys or any(k.startswith(tuple(keys)) for k in o)]


def sweep(shape, dtype: torch.dtype, keys: list[str], warmup: int, iters: int) -> list[dict]:
    """Time our kernels at one shape with no override, then under each launch-config override in SWEEP
    (function.TUNING) that sets a key starting with one of `keys` (all of them if `keys` is empty)."""
    from kimik3.ops.kda import function

    x = make_inputs(*shape, dtype, "cuda")
    rows = []
    for override in ({}, *sweep_overrides(keys)):
        saved = dict(function.TUNING)
        function.TUNING.update(override)
        try:
            t = bench_one(_ours, x, "cuda", warmup, iters)
            rows.append({"override": override, "fwd_ms": t.fwd_ms, "fwdbwd_ms": t.fwdbwd_ms})
        except Exception as e:  # a config that does not compile (shared memory, registers)
            rows.append({"override": override, "error": repr(e)[:300]})
        finally:
            function.TUNING.clear()
            function.TUNING.update(saved)
        print(json.dumps(rows[-1]), flush=True)
    return rows


def _rel_rms(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.double(), ref.double()
    return ((a - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def _run_with_grads(run: Callable, x: dict, form: str, cu: Optional[torch.Tensor], h0: torch.Tensor,
                    do: torch.Tensor, dht: torch.Tensor) -> dict:
    leaves = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
    h0 = h0.detach().clone().requires_grad_()
    o, ht = run(leaves, form, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    ((o.float() * do).sum() + (ht * dht).sum()).backward()
    out = {"o": o, "ht": ht, "dh0": h0.grad}
    out.update({"d" + n: t.grad for n, t in leaves.items()})
    return out


def check(cases, device: str, dtype: torch.dtype, impls: dict[str, Callable]) -> list[dict]:
    """Relative RMS error of each implementation (inputs in `dtype`) vs the fp32 chunk reference."""
    results = []
    for B, T, H, D, form, docs in cases:
        x = make_inputs(B, T, H, D, dtype, device, seed=1)
        cu = None
        N = B
        if docs is not None:
            cu = torch.tensor([0, *torch.tensor(docs).cumsum(0).tolist()], device=device, dtype=torch.int32)
            assert int(cu[-1]) == T, f"document lengths sum to {int(cu[-1])}, not T={T}"
            N = len(docs)
        gen = torch.Generator(device="cpu").manual_seed(2)
        h0 = (torch.randn(N, H, D, D, generator=gen) * 0.1).to(device)
        do = torch.randn(B, T, H, D, generator=gen).to(device)
        dht = (torch.randn(N, H, D, D, generator=gen) * 0.1).to(device)
        ref = _run_with_grads(_chunk_ref, {n: t.float() for n, t in x.items()}, form, cu, h0, do, dht)
        for name, run in impls.items():
            got = _run_with_grads(run, x, form, cu, h0, do, dht)
            errs = {n: _rel_rms(got[n], ref[n]) for n in ref if got.get(n) is not None}
            missing = sorted(n for n in ref if got.get(n) is None)  # a gradient never formed is not a pass
            row = {"impl": name, "B": B, "T": T, "H": H, "D": D, "form": form, "docs": docs,
                   "rel_rms": errs, "missing": missing,
                   "ok": not missing and all(e <= TOLERANCE[n] for n, e in errs.items())}
            print(json.dumps(row), flush=True)
            results.append(row)
        del ref, x
        if device == "cuda":
            torch.cuda.empty_cache()
    return results


def _parse_tuning(items: list[str], keys: Iterable[str]) -> dict[str, int]:
    """['dwy_warps=8', ...] -> {'dwy_warps': 8}; one error line naming a bad item and what is accepted."""
    out = {}
    for item in items:
        key, _, value = item.partition("=")
        if key not in keys or not value.isdigit() or int(value) == 0:
            raise ValueError(f"--tuning {item!r}: expected KEY=INT with KEY one of {sorted(keys)} and INT > 0")
        out[key] = int(value)
    return out


def _parse_shape(text: str) -> tuple[int, int, int, int]:
    parts = text.split(",")
    if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: expected B,T,H,D (four positive integers), e.g. 1,32768,32,128")
    return tuple(int(p) for p in parts)


def _run_mode(args: argparse.Namespace, device: str, dtype: torch.dtype) -> dict:
    """The results of the mode the flags pick (tiny, profile/sweep, check or the benchmark)."""
    if args.tiny:
        dtype = torch.float32
    shapes = args.shape or ([TINY_SHAPE] if args.tiny else SHAPES)
    if args.plain:
        result = {"plain": plain_runs(shapes[0], dtype, device, args.plain)}
    elif args.host:
        result = {"host": host_cost(shapes[0], dtype, device, args.host, not args.no_fla)}
    elif args.tiny:
        if args.check:
            result = {"check": check([(1, 100, 2, 16, "softplus", (37, 63))], device, dtype, {"triton": _ours})}
        else:
            result = {"bench": benchmark(shapes, device, dtype, False, 10**9, 0, 1)}
    elif args.profile or args.sweep is not None:
        result = {}
        if args.profile:
            result["profile"] = profile(shapes[0], dtype)
        if args.sweep is not None:
            result["sweep"] = sweep(shapes[0], dtype, args.sweep, args.warmup, args.iters)
    elif args.check:
        impls = {"triton": _ours, "triton_kept": _ours_kept}
        if not args.no_fla and _fla() is not None:
            impls["fla"] = _fla()
        result = {"check": check(CHECK_CASES, device, dtype, impls), "tolerance": TOLERANCE}
    else:
        result = {"bench": benchmark(shapes, device, dtype, not args.no_fla, args.ref_max_tokens, args.warmup,
                                     args.iters)}
    return result


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--tiny", action="store_true", help="one tiny shape (CPU smoke run, TRITON_INTERPRET=1)")
    p.add_argument("--check", action="store_true", help="accuracy vs the fp32 reference instead of timing")
    p.add_argument("--shape", action="append", type=_parse_shape, metavar="B,T,H,D",
                   help="time (or profile/sweep) this shape instead of the H200 list; repeatable; not with --check")
    p.add_argument("--profile", action="store_true", help="per-kernel times and resources at the first shape")
    p.add_argument("--sweep", nargs="*", default=None, metavar="KEY_PREFIX",
                   help="time launch-config overrides at the first shape: all of SWEEP, or those whose keys start "
                        "with a KEY_PREFIX (e.g. --sweep state_ dwy_)")
    p.add_argument("--plain", type=int, default=0, metavar="N",
                   help="only run N untimed fwd+bwd passes of ours at the first shape (a target for ncu; with "
                        "--tiny on the CPU)")
    p.add_argument("--host", type=int, default=0, metavar="N",
                   help="the host's ms per call over N calls issued without a sync (ours, and fla's unless "
                        "--no-fla), and a cProfile of our forward's host path, at the first shape")
    p.add_argument("--no-fla", action="store_true", help="skip fla's chunk_kda even if importable")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--ref-max-tokens", type=int, default=16384, help="skip the PyTorch chunk reference above")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--tuning", nargs="*", default=[], metavar="KEY=INT",
                   help="launch-config overrides (keys of kimik3.ops.kda.function.TUNING) for every mode; "
                        "e.g. --check --tuning dwy_warps=8 checks a launch config on the device before adopting it")
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.tiny:
        p.error("no CUDA device: only --tiny runs on the CPU")
    if args.shape and args.check:
        p.error("--shape picks timing shapes; --check runs its fixed cases (CHECK_CASES)")
    dtype = getattr(torch, args.dtype)
    if args.tiny:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels' first import
    from kimik3.ops.kda import function

    try:
        tuning = _parse_tuning(args.tuning, function.TUNING)
    except ValueError as e:
        p.error(str(e))
    meta = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
            "triton": __import__("triton").__version__, "dtype": args.dtype, "tuning": tuning}
    saved = dict(function.TUNING)
    function.TUNING.update(tuning)
    try:
        result = _run_mode(args, device, dtype)
    finally:
        function.TUNING.update(saved)
    result["meta"] = meta
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
