"""ops.adamw: one Triton launch updating several tensors (the CPU interpreter here) agrees with
torch.optim.AdamW to fp32 rounding over several steps, with weight decay, the clip factor and each
tensor's own step count; a skip flag leaves everything as it was; the gradients are never written;
and MuonAdamW sends exactly the large CUDA tensors to it."""

from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of the kernels

from kimik3.ops.adamw import adamw_update_  # noqa: E402
from kimik3.optim.muon import TRITON_ADAMW_MIN_NUMEL, MuonAdamW, takes_triton_adamw  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs CUDA or the Triton interpreter")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

HYPER = dict(lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
TOL = dict(rtol=2e-6, atol=1e-8)
"""fp32 rounding: torch forms lr * wd and the bias corrections in fp64, the kernel in fp32. Parameters
are ~1 here and each update ~lr, so a wrong term (a bias correction, the decay) is off by >= 1e-4."""


def _state(opt: torch.optim.Optimizer, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    s = opt.state[p]
    return s["exp_avg"], s["exp_avg_sq"], s["step"]


SIZES = [1, 4095, 4096, 3 * 4097, 40_003, 70]
"""Below, at and past the kernel's 4096-element block and its 4-block program span, in one launch: each
program must find its tensor and its span."""


@pytest.mark.parametrize("clip", [None, 0.37])
def test_matches_torch_adamw_over_steps(clip):
    """Four steps, each with new gradients, on tensors of SIZES whose step counts differ (the last one
    joins after two steps): params and both moments against torch's AdamW (foreach off, fp32); the
    gradients are left as they were."""
    gen = torch.Generator().manual_seed(7)
    starts = [torch.randn(n, generator=gen) for n in SIZES]
    refs = [torch.nn.Parameter(p.clone()) for p in starts]
    opts = [torch.optim.AdamW([r], foreach=False, **HYPER) for r in refs]
    ours = [p.clone().to(DEVICE) for p in starts]
    ms, vs = [torch.zeros_like(p) for p in ours], [torch.zeros_like(p) for p in ours]
    steps = [torch.zeros((), device=DEVICE) for _ in ours]
    coef = None if clip is None else torch.tensor(clip, device=DEVICE)
    for i in range(4):
        live = range(len(SIZES)) if i >= 2 else range(len(SIZES) - 1)
        grads = {j: torch.randn(SIZES[j], generator=gen) * 10 for j in live}
        for j, g in grads.items():
            refs[j].grad = g * clip if clip is not None else g.clone()
            opts[j].step()
            steps[j] += 1
        on_device = {j: g.to(DEVICE) for j, g in grads.items()}
        adamw_update_([ours[j] for j in live], [on_device[j] for j in live], [ms[j] for j in live],
                      [vs[j] for j in live], [steps[j] for j in live], lr=HYPER["lr"],
                      weight_decay=HYPER["weight_decay"], beta1=HYPER["betas"][0], beta2=HYPER["betas"][1],
                      eps=HYPER["eps"], clip_coef=coef)
        for j, g in grads.items():
            assert torch.equal(on_device[j].cpu(), g)
    for j, ref in enumerate(refs):
        want_m, want_v, _ = _state(opts[j], ref)
        torch.testing.assert_close(ours[j].cpu(), ref.detach(), **TOL)
        # m is a signed sum (torch lerps it, the kernel adds two products): rounding relative to its scale.
        torch.testing.assert_close(ms[j].cpu(), want_m, rtol=2e-6, atol=2e-6 * want_m.abs().max().item())
        torch.testing.assert_close(vs[j].cpu(), want_v, rtol=2e-6, atol=0.0)
        assert (ours[j].cpu() - starts[j]).abs().max() > 1e-3  # it moved


@pytest.mark.parametrize("beta2", [0.999, 0.9999])
def test_first_steps_match_torch_at_betas_near_one(beta2):
    """The first updates at beta2 = 0.999 / 0.9999 (torch's default, and common for long runs), where
    1 - beta2^t cancels: each step's update against torch's AdamW to fp32 rounding. (The bias
    corrections formed in fp32 once made them 7e-6 / 8e-5 too large.)"""
    gen = torch.Generator().manual_seed(3)
    ref = torch.nn.Parameter(torch.zeros(300))
    opt = torch.optim.AdamW([ref], lr=1e-2, betas=(0.9, beta2), weight_decay=0.0, eps=1e-8, foreach=False)
    p = torch.zeros(300, device=DEVICE)
    m, v, step = torch.zeros_like(p), torch.zeros_like(p), torch.zeros((), device=DEVICE)
    for _ in range(3):
        grad = torch.randn(300, generator=gen)
        ref.grad = grad.clone()
        opt.step()
        step += 1
        adamw_update_([p], [grad.to(DEVICE)], [m], [v], [step], lr=1e-2, weight_decay=0.0, beta1=0.9, beta2=beta2,
                      eps=1e-8)
        # p ~ the sum of updates of ~lr each: 1e-6 of an update is 1e-8, and fp32 rounding of p below that
        torch.testing.assert_close(p.cpu(), ref.detach(), rtol=1e-6, atol=1e-8)


def test_skip_reads_and_writes_nothing():
    """skip=True with NaN gradients and a NaN clip factor: param and moments keep their bits."""
    p = torch.randn(5000, device=DEVICE)
    m, v = torch.randn_like(p), torch.rand_like(p)
    before = [t.clone() for t in (p, m, v)]
    grad = torch.full_like(p, math.nan)
    adamw_update_([p], [grad], [m], [v], [torch.ones((), device=DEVICE)], lr=1e-2, weight_decay=0.1, beta1=0.9,
                  beta2=0.95, eps=1e-8, clip_coef=torch.tensor(math.nan, device=DEVICE),
                  skip=torch.tensor(True, device=DEVICE))
    for got, want in zip((p, m, v), before):
        assert torch.equal(got, want)


def test_refuses_non_contiguous_misaligned_or_non_fp32():
    """One line naming the tensor, its index and what is wanted; nothing written."""
    p = torch.zeros(8, 8, device=DEVICE)
    ok = dict(lr=1e-2, weight_decay=0.0, beta1=0.9, beta2=0.95, eps=1e-8)
    z = torch.zeros_like
    step = [torch.ones((), device=DEVICE)]
    with pytest.raises(ValueError, match="grad 0 must be a contiguous, 16-byte-aligned fp32 tensor"):
        adamw_update_([p], [z(p).t()], [z(p)], [z(p)], step, **ok)
    with pytest.raises(ValueError, match="exp_avg 0 must be .* got torch.bfloat16"):
        adamw_update_([p], [z(p)], [z(p, dtype=torch.bfloat16)], [z(p)], step, **ok)
    flat = torch.zeros(65, device=DEVICE)
    with pytest.raises(ValueError, match="param 0 must be a contiguous, 16-byte-aligned"):
        adamw_update_([flat[1:]], [flat[1:].clone()], [z(flat[1:])], [z(flat[1:])], step, **ok)
    with pytest.raises(ValueError, match="step 0 must be an fp32 tensor"):
        adamw_update_([p], [z(p)], [z(p)], [z(p)], [torch.ones((), dtype=torch.int64, device=DEVICE)], **ok)
    assert not p.any()


def test_takes_triton_adamw_refuses_cpu_small_and_non_fp32():
    big = torch.zeros(TRITON_ADAMW_MIN_NUMEL)
    step = torch.zeros(())
    row = (big, big, big, big, step)
    assert not takes_triton_adamw(*row)  # CPU
    if torch.cuda.is_available():
        cuda_row = tuple(t.cuda() for t in row)
        assert takes_triton_adamw(*cuda_row)
        small = torch.zeros(TRITON_ADAMW_MIN_NUMEL - 1, device="cuda")
        assert not takes_triton_adamw(small, small, small, small, cuda_row[4])
        half = cuda_row[0].bfloat16()
        assert not takes_triton_adamw(cuda_row[0], half, *cuda_row[2:])
        shifted = torch.zeros(TRITON_ADAMW_MIN_NUMEL + 1, device="cuda")[1:]  # 4 bytes past an allocation
        assert not takes_triton_adamw(shifted, *cuda_row[1:])


@cuda
def test_muon_adamw_sends_large_cuda_tensors_to_the_kernel_and_matches_torch():
    """A fused group with one large and one small CUDA parameter, three clipped steps and one skipped:
    both match torch.optim.AdamW (fused) on the same gradients, and only the large one's p.grad is left
    unscaled (ops.adamw never writes it; torch's fused kernel stores g / (1/c))."""
    torch.manual_seed(0)
    shapes = [(1024, TRITON_ADAMW_MIN_NUMEL // 1024), (64, 32)]
    ours = [torch.nn.Parameter(torch.randn(s, device="cuda")) for s in shapes]
    refs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt = MuonAdamW([dict(params=ours, name="adamw", kind="adamw", base_lr=HYPER["lr"], **HYPER)])
    ref_opt = torch.optim.AdamW(refs, fused=True, **HYPER)
    c = torch.tensor(0.5, device="cuda")
    for i in range(4):
        skip = i == 2
        grads = [torch.randn_like(p) for p in ours]
        for p, r, g in zip(ours, refs, grads):
            p.grad, r.grad = g.clone(), g * c
        opt.step(skip=torch.tensor(skip, device="cuda"), clip_coef=c)
        if not skip:
            ref_opt.step()
        assert torch.equal(ours[0].grad, grads[0])
        assert skip or not torch.equal(ours[1].grad, grads[1])
    for p, r in zip(ours, refs):
        torch.testing.assert_close(p.detach(), r.detach(), **TOL)
        assert torch.equal(opt.state[p]["step"], ref_opt.state[r]["step"])
