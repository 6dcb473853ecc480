"""Compile every Triton kernel of kimik3.ops for Hopper (sm_90) on a machine without a GPU, and report
each variant's resources.

    python -m kimik3.ops.triton_aot [--head-dim 128] [--heads 16] [--dtype bfloat16] [--json]

Why: CI has no GPU and the interpreter (TRITON_INTERPRET=1) never runs Triton's GPU compiler, so this
is the only CPU-side check that the kernels compile for the H200 (with the CI's Triton, pinned to the
GPU machine's 3.6) in the variants and launch configs the ops use. It also reads ptxas' resource
usage (registers, spilled stack bytes) from each cubin with the cuobjdump bundled in Triton's wheel.

How: each op's entry point runs forward and backward on small CPU tensors with the training step's
widths and dtypes while `JITFunction.run` is replaced by a recorder, so nothing is launched (the
kernels' outputs stay uninitialised; no op reads them on the host). Each recorded launch goes through
Triton's own argument binder for an sm_90 target, the signature, constexprs, launch options and
16-byte divisibility specialisation a launch on the device would compute, and each distinct variant
is compiled once. Must run without TRITON_INTERPRET (interpreted kernels cannot be compiled).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import pkgutil
import re
import subprocess
import tempfile
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

import kimik3.ops

HOPPER = GPUTarget("cuda", 90, 32)
EXERCISE_TOKENS = (128, 1)
"""Token counts the ops are exercised at for compiling: a few chunks, and one token, since Triton
compiles an integer argument equal to 1 as a constant (a kernel calling a method on it fails to build
only then: the router's entropy kernel did)."""
CUDA_GRID_LIMITS = (2**31 - 1, 65535, 65535)
"""The most programs a CUDA launch may have along each grid axis."""


@dataclass(frozen=True)
class Launch:
    """One `kernel[grid](*args, **kwargs)` call, as recorded_launches saw it."""

    kernel: JITFunction
    args: tuple
    kwargs: dict
    grid: tuple


@contextlib.contextmanager
def recorded_launches() -> Iterator[list[Launch]]:
    """Within the block, `kernel[grid](*args, **kwargs)` appends a Launch instead of launching (also
    under TRITON_INTERPRET=1, whose kernels are the interpreter's functions)."""
    from triton.runtime.interpreter import InterpretedFunction

    launches: list[Launch] = []
    runs = {cls: cls.run for cls in (JITFunction, InterpretedFunction)}

    def record(self, *args, grid, warmup, **kwargs):  # noqa: ANN001 (JITFunction.run's signature)
        launches.append(Launch(self, args, kwargs, tuple(grid)))

    for cls in runs:
        cls.run = record
    try:
        yield launches
    finally:
        for cls, run in runs.items():
            cls.run = run


def _compile(launch: Launch, backend) -> tuple[tuple, Callable[[], dict]]:  # noqa: ANN001
    """(the variant's key, a thunk compiling it for HOPPER): Triton's binder and argument packing, as
    JITFunction.run does them on a device."""
    fn, args, kwargs = launch.kernel, launch.args, launch.kwargs
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    names = [p.name for p in fn.params]
    named = {names[path[0]]: value if isinstance(value, (bool, int, float, str)) else str(value)  # tl dtypes
             for path, value in constexprs.items() if len(path) == 1}
    key = (fn.__name__, tuple(signature.items()), tuple(sorted(named.items())), repr(sorted(attrs.items())),
           options.num_warps, options.num_stages, getattr(options, "maxnreg", None))

    def build() -> dict:
        kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=HOPPER, options=options.__dict__)
        return {"kernel": fn.__name__, "constexprs": named, "warps": options.num_warps,
                "stages": kernel.metadata.num_stages, "shared_bytes": kernel.metadata.shared,
                **_resources(kernel.asm["cubin"])}

    return key, build


def _resources(cubin: bytes) -> dict:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(cubin)
        fh.flush()
        out = subprocess.run([tool, "--dump-resource-usage", fh.name], capture_output=True, text=True,
                             check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return {"regs": int(found.group(1)), "stack_bytes": int(found.group(2))}


def _grad(out, *inputs: torch.Tensor) -> None:
    """Run the backward of out (a tensor or tuple) with an (uninitialised) output gradient."""
    outs = [o for o in (out if isinstance(out, tuple) else (out,)) if o is not None and o.requires_grad]
    torch.autograd.grad(outs, inputs, [torch.empty_like(o) for o in outs], allow_unused=True)


def _exercise_ops(head_dim: int, heads: int, dtype: torch.dtype, tokens: int = 128) -> None:
    """Forward and backward of every op with Triton kernels, in the variants a training step (or the
    op's documented options) uses: kimi_3b_a1b's widths, `tokens` tokens (top-8 expert rows: 8 times
    that), activations in `dtype`. The tensors are left uninitialised: nothing is launched."""
    from kimik3.ops import cast_kernels, conv, cross_entropy, max_logit, moe_rows, norm, router, swiglu
    from kimik3.ops.adamw import adamw_update_
    from kimik3.ops.kda.function import triton_kda

    T, D, k = tokens, 2048, 8

    def act(*shape: int) -> torch.Tensor:
        return torch.empty(*shape, dtype=dtype).requires_grad_()

    def fp32(*shape: int) -> torch.Tensor:
        return torch.empty(*shape).requires_grad_()

    for form, extras in (("softplus", {}), ("softplus", {"keep_states": True}),
                         ("bounded", {"initial_state": torch.zeros(1, heads, head_dim, head_dim),
                                      "output_final_state": True})):
        qkvf = [act(1, T, heads, head_dim) for _ in range(4)]
        b, a_log, dt_bias = act(1, T, heads), fp32(heads), fp32(heads * head_dim)
        o, ht = triton_kda(*qkvf[:3], qkvf[3], b, a_log, dt_bias, gate_form=form, **extras)
        _grad(o if ht is None else (o, ht), *qkvf, b, a_log, dt_bias)
    x, r, w = fp32(T, D), act(T, D), fp32(D)
    _grad(norm.rms_norm(x, w, 1e-5, dtype), x, w)
    _grad(norm.add_rms_norm(x, r, w, 1e-5, dtype), x, r, w)
    xg, g, wg = act(T, heads * head_dim), act(T, heads * head_dim), fp32(heads * head_dim)
    _grad(norm.gated_rms_norm(xg, g, wg, 1e-5), xg, g, wg)
    qkv, conv_w = act(1, T, 3 * heads * head_dim), fp32(3 * heads * head_dim, 1, 4)
    _grad(conv.causal_conv_silu(qkv, conv_w, parts=3), qkv, conv_w)
    h = act(T * k, 2 * 512)
    _grad(swiglu.swiglu(h, fused=True), h)
    logits = fp32(T, 32)
    scores, _, weights = router.route(logits, torch.zeros(32), k, scale=2.446, fused=True)
    _grad((scores, weights), logits)
    router.entropy_sum(scores.detach(), fused=True)
    expert_of = torch.randint(0, 32, (T * k,))
    moe_rows.sort_by_expert(expert_of, 32, fused=True)
    order, slot_of, _ = moe_rows.sort_by_expert(expert_of, 32, fused=False)  # real indices: dispatch reads them
    tokens, routed, weights, shared = act(T, D), act(T * k, D), fp32(T, k), act(T, D)
    _grad(moe_rows.dispatch_rows(tokens, order, slot_of, k, fused=True), tokens)
    _grad(moe_rows.combine_rows(routed, order, slot_of, weights, plus=shared, out_dtype=torch.float32, fused=True),
          routed, weights, shared)
    cross_entropy.xent_rows(torch.empty(4, 32000, dtype=dtype), torch.zeros(4, dtype=torch.long),
                            torch.tensor(4.0), 1e-4, -100, write_grad=True)
    mla = torch.empty(1, heads, T, 192, dtype=dtype)
    max_logit.causal_max_logits(mla, mla, 192**-0.5)
    weight, grad_bf16 = torch.empty(64, 64), torch.empty(64, 64, dtype=torch.bfloat16)
    cast_kernels.downcast_fp32(weight)
    cast_kernels.upcast_bf16(grad_bf16)
    cast_kernels.sum_bf16([grad_bf16, grad_bf16])
    stack = [torch.empty(64, 64), torch.empty(32, 64)]
    layout = cast_kernels.stack_layout(stack)
    cast_kernels.downcast_stacked(stack, layout)
    cast_kernels.upcast_stacked(torch.empty(96, 64, dtype=torch.bfloat16), layout)
    params = [torch.empty(64, 64) for _ in range(4)]
    adamw_update_(params[:1], params[1:2], params[2:3], params[3:], [torch.ones(())], lr=1e-3, weight_decay=0.1,
                  beta1=0.9, beta2=0.95, eps=1e-8, clip_coef=torch.ones(()), skip=torch.zeros((), dtype=torch.bool))


def grid_overflows(tokens: int, head_dim: int = 128, heads: int = 16) -> list[str]:
    """The launches of the exercised ops at `tokens` tokens whose grid exceeds CUDA's limits along an
    axis (CUDA_GRID_LIMITS), as 'kernel grid' lines; [] when every launch fits."""
    with recorded_launches() as launches:
        _exercise_ops(head_dim, heads, torch.bfloat16, tokens)
    return [f"{launch.kernel.__name__} {launch.grid}" for launch in launches
            if any(n > limit for n, limit in zip(launch.grid, CUDA_GRID_LIMITS))]


def package_kernels() -> set[str]:
    """Names of every Triton kernel (a @triton.jit function named *_kernel) in kimik3.ops and below."""
    names = set()
    for info in pkgutil.walk_packages(kimik3.ops.__path__, "kimik3.ops."):
        if info.name.endswith(".triton_aot"):
            continue
        module = importlib.import_module(info.name)
        names |= {obj.__name__ for obj in vars(module).values()
                  if isinstance(obj, JITFunction) and obj.__name__.endswith("_kernel")}
    return names


def compile_for_hopper(head_dim: int = 128, heads: int = 16, dtype: str = "bfloat16") -> list[dict]:
    """Compile each distinct kernel variant the ops launch (module docstring) for sm_90; one row each:
    kernel, variant (the constexprs that tell it from the kernel's other variants), its constexprs,
    warps, pipelining stages, shared memory, registers and spilled stack bytes per thread."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("triton_aot needs TRITON_INTERPRET unset (interpreted kernels cannot be compiled)")
    with recorded_launches() as launches:
        for tokens in EXERCISE_TOKENS:
            _exercise_ops(head_dim, heads, getattr(torch, dtype), tokens)
    backend = make_backend(HOPPER)
    variants = dict(_compile(launch, backend) for launch in launches)
    rows = [build() for build in variants.values()]
    for row in rows:  # name a variant by the constexprs that tell it from the kernel's other variants
        others = [r["constexprs"] for r in rows if r["kernel"] == row["kernel"]]
        row["variant"] = ",".join(f"{k}={v}" for k, v in row["constexprs"].items()
                                  if any(o.get(k) != v for o in others))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--head-dim", type=int, default=128, help="KDA's head dim")
    p.add_argument("--heads", type=int, default=16, help="KDA's heads (a constexpr of its kernels)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="the activations' dtype")
    p.add_argument("--json", action="store_true", help='print {"variants": [rows], "missed": [kernels]} instead')
    args = p.parse_args(argv)
    rows = compile_for_hopper(args.head_dim, args.heads, args.dtype)
    missed = sorted(package_kernels() - {r["kernel"] for r in rows})
    if args.json:
        print(json.dumps({"variants": rows, "missed": missed}))
    else:
        for r in rows:
            name = r["kernel"] + (f"[{r['variant']}]" if r["variant"] else "")
            print(f"{name:64s} warps={r['warps']:2d} stages={r['stages']} regs={r['regs']:3d} "
                  f"spilled_stack={r['stack_bytes']:4d}B shared={r['shared_bytes']}B")
        print(f"{len(rows)} variants of {len({r['kernel'] for r in rows})} kernels compiled for sm_90"
              + (f"; never launched by the exercised ops, so not compiled: {', '.join(missed)}" if missed else ""))
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
