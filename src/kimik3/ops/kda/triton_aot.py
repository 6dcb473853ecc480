"""Compile the Triton KDA kernels for Hopper (sm_90) on a machine without a GPU, and report resources.

    python -m kimik3.ops.kda.triton_aot [--head-dim 128] [--json]

CI has no GPU and the interpreter (TRITON_INTERPRET=1) never runs Triton's GPU compiler, so this is
the only CPU-side check that the kernels compile for the H200 with the launch configs function.py
uses. ptxas' resource usage (registers, spilled stack bytes) is read from the cubin with the cuobjdump
bundled in Triton's wheel; pointer arguments are marked 16-byte aligned as a real launch specialises
them, which makes the numbers match a launch on the device (checked for the recurrence kernels).
Must run without TRITON_INTERPRET (interpreted kernels cannot be compiled).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kimik3.ops.kda import function, triton_bwd, triton_fwd

_FP32_PTRS = {"a_log_ptr", "dt_bias_ptr", "gl_ptr", "G_ptr", "h0_ptr", "ht_ptr", "dht_ptr", "dh0_ptr", "dxw_ptr",
              "akk_ptr", "dqn_ptr", "dkn_ptr", "kn_ptr", "qn_ptr", "da_part_ptr", "ddt_part_ptr", "dakk_ptr",
              "daqk_ptr", "dG_ptr", "dbeta_ptr", "dqg_ptr", "dkd_ptr", "dgl_ptr"}
_INT_PTRS = {"chunk_bos_ptr", "chunk_eos_ptr", "seq_chunks_ptr"}
_FLOAT_ARGS = {"scale", "lower_bound"}


def _signature(fn, constexprs: dict, io: str = "*bf16") -> tuple[dict, dict]:
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = "*fp32" if name in _FP32_PTRS else "*i32" if name in _INT_PTRS else io
        else:
            sig[name] = "fp32" if name in _FLOAT_ARGS else "i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if sig[n].startswith("*")}
    return sig, attrs


def _resources(cubin: bytes) -> dict:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(cubin)
        fh.flush()
        out = subprocess.run([tool, "--dump-resource-usage", fh.name], capture_output=True, text=True,
                             check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return {"regs": int(found.group(1)), "stack_bytes": int(found.group(2))}


_DTYPES = {"bfloat16": (tl.bfloat16, "*bf16"), "float32": (tl.float32, "*fp32")}


def compile_for_hopper(head_dim: int = 128, heads: int = 32, dtype: str = "bfloat16") -> list[dict]:
    """Compile every kernel variant one training step launches (inputs in `dtype`, softplus gate) for sm_90."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("triton_aot needs TRITON_INTERPRET unset (interpreted kernels cannot be compiled)")
    dt, io = _DTYPES[dtype]
    K = V = head_dim
    common = dict(H=heads, K=K, C=function.CHUNK)
    bv, state_warps = function._state_config(V, heads)
    state = {"num_warps": state_warps, "num_stages": function._state_stages(dt)}
    block = function._block
    dwy_bk, terms_bk = block("dwy", K, V), block("dstate_terms", K, V)
    jobs = [
        (triton_fwd.chunk_prologue_kernel, dict(common, BK=block("prologue", K), FORM=0), function._launch("prologue")),
        (triton_fwd.chunk_scores_kernel, dict(common, BK=block("scores", K), BC=function.SUB_CHUNK, DT=dt),
         function._launch("scores")),
        *((triton_fwd.chunk_wy_kernel, dict(common, V=V, BK=block("wy", K, V), BC=function.SUB_CHUNK, INVERT=invert,
                                            DT=dt), function._launch("wy")) for invert in (True, False)),
        (triton_fwd.chunk_state_kernel,
         dict(common, V=V, BV=bv, HAS_H0=True, STORE_O=True, STORE_STATES=False, STORE_FINAL=True, DT=dt), state),
        (triton_bwd.chunk_dstate_kernel, dict(common, V=V, BV=bv, HAS_DHT=True, HAS_H0=True, DT=dt), state),
        (triton_bwd.chunk_dwy_kernel, dict(common, V=V, BK=dwy_bk, BV=dwy_bk, DT=dt), function._launch("dwy")),
        *((getattr(triton_bwd, f"chunk_{stage}_kernel"), dict(common, BK=block(stage, K), BC=function.SUB_CHUNK, DT=dt),
           function._launch(stage)) for stage in ("dscores_key", "dscores_query")),
        (triton_bwd.chunk_dstate_terms_kernel, dict(common, V=V, BK=terms_bk, BV=terms_bk, DT=dt),
         function._launch("dstate_terms")),
        (triton_bwd.chunk_dprologue_kernel, dict(common, BK=block("dprologue", K), FORM=0), function._launch("dprologue")),
    ]
    rows = []
    for fn, constexprs, options in jobs:
        sig, attrs = _signature(fn, constexprs, io)
        kernel = triton.compile(ASTSource(fn, sig, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                                options=options)
        name = fn.__name__ + ("[rerun]" if constexprs.get("INVERT") is False else "")
        rows.append({"kernel": name, "warps": options["num_warps"], "stages": kernel.metadata.num_stages,
                     "shared_bytes": kernel.metadata.shared,
                     **_resources(kernel.asm["cubin"])})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16", help="the inputs' dtype")
    p.add_argument("--json", action="store_true", help="print one JSON list instead of a table")
    args = p.parse_args(argv)
    rows = compile_for_hopper(args.head_dim, dtype=args.dtype)
    if args.json:
        print(json.dumps(rows))
    else:
        for r in rows:
            print(f"{r['kernel']:26s} warps={r['warps']:2d} stages={r['stages']} regs={r['regs']:3d} "
                  f"spilled_stack={r['stack_bytes']:4d}B "
                  f"shared={r['shared_bytes']}B")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
