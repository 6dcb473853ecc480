"""A once-per-process check that the compiled Triton KDA kernels compute KDA on this device.

Triton 3.4 to 3.7.0 miscompiles some gated-attention backward kernels on Hopper, and a launch
config that is fine on the CPU interpreter can be miscompiled on the GPU (our intra backward at 4
warps gave dk, db and the gate gradients relative RMS errors of 0.06 to 4.7 on an H200 while o, dq
and dv were right).
Such a kernel trains without any error, on wrong gradients. So before the first training step the
trainer runs the kernels once on a small random case with the model's own heads, head dim, gate and
dtype (the same compiled variants the step launches: only T differs, which is not compiled in) and
compares the output and every gradient with the fp32 PyTorch chunk reference.

The bounds sit 5-7x above what correct bf16 kernels measure on the CPU interpreter (~4e-3 for o / dq /
dk / dv / db, 0.008-0.010 for df, 0.01-0.03 for the summed dA_log / ddt_bias at this size) and well
below what the miscompile gave. Cost: one forward + backward at 200 tokens per layer shape.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

BOUNDS = {"o": 2e-2, "dq": 2e-2, "dk": 2e-2, "dv": 2e-2, "db": 2e-2, "df": 5e-2, "dA_log": 0.2, "ddt_bias": 0.2}
"""Relative RMS error bounds against the fp32 reference (fp32 kernels are held to the same bounds)."""
CHECK_TOKENS = 200
"""Tokens of the check case: three full chunks, so the state recurrence and its gradient are exercised,
and a partial fourth of 8 rows, so the kernels' paths for short chunks and empty sub-chunks are too."""

_passed: set[tuple] = set()


class KernelCheckError(RuntimeError):
    """The compiled Triton KDA kernels disagree with the reference on this device."""


def _rel_rms(got: Tensor, ref: Tensor) -> float:
    ref = ref.double()
    return float((got.double() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30))


def _run(impl: str, inputs: dict[str, Tensor], do: Tensor, gate_form: str, lower_bound: float,
         keep_states: bool = False) -> dict[str, Tensor]:
    from kimik3.ops.kda import kda

    leaves = {n: t.detach().clone().requires_grad_() for n, t in inputs.items()}
    o, _ = kda(leaves["q"], leaves["k"], leaves["v"], leaves["f"], leaves["b"], leaves["A_log"], leaves["dt_bias"],
               impl=impl, gate_form=gate_form, lower_bound=lower_bound, keep_states=keep_states)
    grads = torch.autograd.grad(o, list(leaves.values()), do.to(o.dtype))
    return {"o": o.detach(), **{f"d{n}": g for n, g in zip(leaves, grads)}}


def check_triton_kda(heads: int, head_dim: int, dtype: torch.dtype, device: torch.device, *,
                     gate_form: str = "softplus", lower_bound: float = -5.0,
                     keep_states: bool = False) -> dict[str, float]:
    """Compare the Triton kernels (inputs in `dtype`) with the fp32 chunk reference on one random case.
    keep_states: as the training step will call them (it compiles another recurrence variant).

    Returns the relative RMS errors; raises KernelCheckError naming every tensor over its bound.
    A configuration that passed once is not checked again in this process.
    """
    key = (heads, head_dim, dtype, str(device), gate_form, lower_bound, keep_states)
    if key in _passed:
        return {}
    gen = torch.Generator().manual_seed(0)
    shape = (1, CHECK_TOKENS, heads, head_dim)
    raw = {n: torch.randn(*shape, generator=gen) for n in ("q", "k", "v", "f")}
    raw["b"] = torch.randn(*shape[:3], generator=gen)
    raw["A_log"] = torch.empty(heads).uniform_(0, math.log(16), generator=gen)
    raw["dt_bias"] = torch.randn(heads * head_dim, generator=gen) * 0.5 - 2.0
    do = torch.randn(*shape, generator=gen).to(device)
    low = {n: (t.to(dtype) if t.dim() > 1 else t).to(device) for n, t in raw.items()}
    ref_inputs = {n: t.float() for n, t in low.items()}  # the same rounded values, in fp32
    got = _run("triton", low, do, gate_form, lower_bound, keep_states)
    ref = _run("chunk", ref_inputs, do, gate_form, lower_bound)
    errors = {n: _rel_rms(got[n], ref[n]) for n in BOUNDS}
    bad = {n: e for n, e in errors.items() if not e <= BOUNDS[n]}  # NaN counts as bad
    if bad:
        where = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        listed = ", ".join(f"{n} {e:.3g} (bound {BOUNDS[n]:g})" for n, e in bad.items())
        raise KernelCheckError(
            f"the Triton KDA kernels fail their check against the fp32 reference on {where} "
            f"(H={heads}, K={head_dim}, {str(dtype).removeprefix('torch.')}, gate {gate_form}): {listed}; "
            "this Triton build miscompiles them here, train with model.kda_implementation=chunk instead")
    _passed.add(key)
    return errors
