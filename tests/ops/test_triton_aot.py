"""Every Triton kernel of kimik3.ops compiles for Hopper (sm_90) with Triton's GPU compiler, which the CPU
interpreter never runs, in the variants the ops launch (kimik3.ops.triton_aot), within the H200's resources."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

H200_SHARED_BYTES = 232448
"""Shared memory one block may use on an H200 (227 KB); a launch asking for more fails (OutOfResources)."""
NO_SPILLS = ("chunk_state_kernel", "chunk_dstate_kernel", "chunk_dstate_terms_kernel", "_swiglu_fwd_kernel",
             "_swiglu_bwd_kernel", "_rms_fwd_kernel", "_rms_bwd_kernel", "_adamw_kernel", "_conv_dz_kernel",
             "_conv_dx_kernel")
"""Kernels that must not spill: the two recurrences carry the state in registers across the whole
sequence, the state-terms kernel was kept to its two matmuls for it (it spilled 280 B when it also
applied the decays), the short conv's dz kernel keeps its four dweight accumulators in registers
(128 at its 16 x 64 tiles on 4 warps), and the streaming kernels have no reason to. Some per-chunk KDA kernels spill a
few bytes at D=128 (their launch configs were still the fastest on the H200)."""


def _compile(*args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "kimik3.ops.triton_aot", *args, "--json"], capture_output=True,
                         text=True, env=env, timeout=600)
    assert out.returncode in (0, 1), out.stderr[-2000:]
    return json.loads(out.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("head_dim,dtype", [(128, "bfloat16"), (64, "bfloat16"), (128, "float32")])
def test_every_kernel_compiles_for_hopper_within_its_resources(head_dim, dtype):
    """All of the package's kernels are launched by the exercised ops (none is missed) and each variant
    compiles for sm_90 within the H200's shared memory (fp32 KDA inputs used to ask 245-311 KB in the
    recurrence kernels), with KDA's training and initial/final-state variants both present."""
    result = _compile("--head-dim", str(head_dim), "--dtype", dtype)
    assert result["missed"] == []
    rows = result["variants"]
    assert all(r["shared_bytes"] <= H200_SHARED_BYTES for r in rows), [r for r in rows if r["shared_bytes"] >
                                                                        H200_SHARED_BYTES]
    states = {r["variant"] for r in rows if r["kernel"] == "chunk_state_kernel"}
    assert any("STORE_O=True" in v and "HAS_H0=True" in v for v in states)  # forward with an initial state
    assert any("STORE_STATES=True" in v and "HAS_H0=False" in v for v in states)  # the backward's rerun
    for r in rows:
        if dtype == "bfloat16" and r["kernel"] in NO_SPILLS:
            assert r["stack_bytes"] == 0, r


def test_a_kernel_no_op_launches_is_reported_missed(monkeypatch, capsys):
    """A kernel added to the package without an op exercise in triton_aot fails the run (exit 1, named)."""
    from kimik3.ops import triton_aot

    monkeypatch.setattr(triton_aot, "compile_for_hopper", lambda *a: [
        {"kernel": "_swiglu_fwd_kernel", "variant": "", "constexprs": {}, "warps": 4, "stages": 3, "regs": 32,
         "stack_bytes": 0, "shared_bytes": 0}])
    monkeypatch.setattr(triton_aot, "package_kernels", lambda: {"_swiglu_fwd_kernel", "_new_kernel"})
    assert triton_aot.main([]) == 1
    assert "not compiled: _new_kernel" in capsys.readouterr().out


def test_every_launch_grid_fits_cuda_at_the_longest_preset_sequence():
    """At kimi_3b_a1b's max_seq_len (65,536 tokens: 524,288 routed-expert rows) no op launches more
    programs along a grid axis than CUDA takes (the second and third axes stop at 65,535; the fused
    SwiGLU's first, 2-D grid passed it at 32K tokens). The launches are recorded, not run."""
    from kimik3.ops.triton_aot import grid_overflows

    assert grid_overflows(65536) == []
