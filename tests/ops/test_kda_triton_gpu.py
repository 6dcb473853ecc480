"""Triton KDA kernels on CUDA in bf16 against the fp32 PyTorch chunk reference (skipped without CUDA).

Uses the accuracy check of benchmarks/kda_kernels.py (relative RMS of o, final state and every
gradient, bounds in its TOLERANCE) at shapes small enough for a test run; the full training-shape
check is `python benchmarks/kda_kernels.py --check` (results in the README). Compiled kernels are
compared because Triton 3.4-3.7.0 miscompiles some gated backward kernels on Hopper.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

REPO = pathlib.Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("kda_kernels", REPO / "benchmarks" / "kda_kernels.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "case",
    [(2, 2048, 4, 128, "softplus", None), (1, 4096, 2, 64, "bounded", None),
     (1, 3000, 4, 128, "softplus", (1000, 64, 1, 1935))],
    ids=["B2-T2048-D128", "T4096-D64-bounded", "packed-4-docs"],
)
def test_bf16_kernels_match_fp32_reference(case):
    bench = _bench()
    (row,) = bench.check([case], "cuda", torch.bfloat16, {"triton": bench._ours})
    assert row["ok"], row["rel_rms"]


def test_kept_chunk_states_match_the_rerun_bit_for_bit():
    """keep_states=True takes the forward's chunk states where the recomputing backward reruns the
    recurrence on w and u~ rebuilt from the same stored M: the compiled kernels give the same
    gradients to the bit at the training head dim, packed documents and a partial last chunk
    included (the CPU suite checks this under the interpreter only)."""
    from kimik3.ops.kda import kda

    gen = torch.Generator(device="cuda").manual_seed(0)
    T, H, D = 1000, 4, 128
    r = lambda *s: torch.randn(*s, generator=gen, device="cuda")  # noqa: E731
    inputs = [r(1, T, H, D).bfloat16(), r(1, T, H, D).bfloat16(), r(1, T, H, D).bfloat16(), r(1, T, H, D).bfloat16(),
              r(1, T, H).bfloat16(), torch.zeros(H, device="cuda"), r(H * D) * 0.5]
    cu = torch.tensor([0, 300, 937, T], dtype=torch.int32, device="cuda")
    do = r(1, T, H, D).bfloat16()

    def grads(keep: bool) -> list[torch.Tensor]:
        leaves = [t.clone().requires_grad_() for t in inputs]
        o, _ = kda(*leaves, impl="triton", cu_seqlens=cu, keep_states=keep)
        return [o.detach(), *torch.autograd.grad(o, leaves, do)]

    for kept, rerun in zip(grads(True), grads(False)):
        assert torch.equal(kept, rerun)
