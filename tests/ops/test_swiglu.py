"""ops.swiglu (Triton, run by the CPU interpreter here) against the eager silu(gate) * up it replaces on CUDA."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of the kernels

from kimik3.ops.swiglu import swiglu  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs CUDA or the Triton interpreter")


def _eager(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def _inputs(shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = (torch.randn(*shape, generator=gen) * 4).to(DEVICE, dtype).requires_grad_()
    da = torch.randn(*shape[:-1], shape[-1] // 2, generator=gen).to(DEVICE, dtype)
    return h, da


def _ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|got - want| in units of want's last place (bf16: 8 significant bits)."""
    exponent = torch.frexp(want.float().abs().clamp_min(1e-30)).exponent
    return (got.float() - want.float()).abs() / torch.ldexp(torch.ones_like(want.float()), exponent - 8)


@pytest.mark.parametrize("shape", [(3, 5, 96), (7, 2 * 600), (1, 2 * 512)],
                         ids=["rows15-I48", "I600-past-one-block", "I512-one-block"])
def test_fp32_matches_eager_forward_and_backward(shape):
    h, da = _inputs(shape, torch.float32)
    got, want = swiglu(h, fused=True), _eager(h)
    assert got.shape == want.shape == (*shape[:-1], shape[-1] // 2)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    (dh_got,), (dh_want,) = torch.autograd.grad(got, h, da), torch.autograd.grad(want, h, da)
    torch.testing.assert_close(dh_got, dh_want, rtol=1e-5, atol=1e-6)


def test_bf16_rounds_as_the_eager_form():
    """The roundings of eager bf16 (silu's output, the product, both product gradients, silu's gradient)
    are reproduced: nearly every element is bit-identical, none more than one ulp off (the two exps
    may differ in fp32's last bit, which can flip a bf16 rounding)."""
    h, da = _inputs((64, 2 * 600), torch.bfloat16, seed=1)
    got, want = swiglu(h, fused=True), _eager(h)
    (dh_got,), (dh_want,) = torch.autograd.grad(got, h, da), torch.autograd.grad(want, h, da)
    for name, a, b in (("a", got, want), ("dh", dh_got, dh_want)):
        assert a.dtype == torch.bfloat16
        assert (a == b).float().mean() > 0.999, name
        assert _ulps(a, b).max() <= 1.0, name


def test_keeps_only_h_for_backward():
    """The fused form saves h alone; the eager form also keeps silu(gate) (and views of h)."""
    h, _ = _inputs((4, 64), torch.float32)
    saved = {"fused": [], "eager": []}
    for name, fn in (("fused", lambda x: swiglu(x, fused=True)), ("eager", _eager)):
        with torch.autograd.graph.saved_tensors_hooks(lambda t, name=name: saved[name].append(t) or t, lambda t: t):
            fn(h)
    assert len(saved["fused"]) == 1 and saved["fused"][0].data_ptr() == h.data_ptr()
    assert any(t.data_ptr() != h.data_ptr() for t in saved["eager"])  # the eager silu(gate) buffer


def test_strided_input_and_cpu_default():
    """A non-contiguous h is read correctly; without `fused`, a CPU tensor takes the eager form."""
    h, da = _inputs((2 * 40, 6), torch.float32)
    wide = h.detach().t().requires_grad_()  # [6, 80], strided
    torch.testing.assert_close(swiglu(wide, fused=True), _eager(wide), rtol=1e-6, atol=1e-6)
    if DEVICE == "cpu":
        assert swiglu(wide).grad_fn.name() == "MulBackward0"


def test_rejects_an_odd_last_dim():
    with pytest.raises(ValueError, match=r"even last dim .* \(3, 5\)"):
        swiglu(torch.zeros(3, 5))


@pytest.mark.parametrize("ffn", ["dense", "experts"])
def test_the_ffns_run_it(monkeypatch, ffn):
    """The dense FFN (and shared experts) and the routed experts take their activation from ops.swiglu:
    with the kernels forced on, output and weight gradients equal the module's eager run."""
    import kimik3.models.blocks as blocks
    import kimik3.models.moe as moe

    torch.manual_seed(0)
    if ffn == "dense":
        module, owner = blocks.SwiGLU(16, 24).to(DEVICE), blocks
        run = lambda x: module(x)  # noqa: E731
    else:
        module, owner = moe.Experts(3, 16, 24).to(DEVICE), moe
        torch.nn.init.normal_(module.gate_up_proj)
        torch.nn.init.normal_(module.down_proj)
        run = lambda x: module._looped(x, torch.tensor([2, 0, 5]))  # noqa: E731
    x = torch.randn(7, 16, device=DEVICE)

    def out_and_grads():
        out = run(x)
        return out.detach(), torch.autograd.grad(out.square().sum(), list(module.parameters()))

    want, want_grads = out_and_grads()
    calls = []
    monkeypatch.setattr(owner, "swiglu", lambda h: calls.append(h.shape) or swiglu(h, fused=True))
    got, got_grads = out_and_grads()
    assert calls  # the module went through ops.swiglu
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(got_grads, want_grads):  # sums of fp32 terms that cancel: held to the tensor's scale
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5 * w.abs().max().item())


def test_the_launch_grid_fits_cuda_at_the_moe_32k_shape():
    """kimi_3b_a1b's routed experts at T=32768 give h [262144, 1024]: 65,536 row blocks, one more than
    CUDA's second grid axis takes, so the grid is 1-D (recorded, not run: the tensors stay untouched)."""
    from kimik3.ops.triton_aot import CUDA_GRID_LIMITS, recorded_launches

    h = torch.empty(32768 * 8, 2 * 512, dtype=torch.bfloat16, device=DEVICE, requires_grad=True)
    with recorded_launches() as launches:
        a = swiglu(h, fused=True)
        torch.autograd.grad(a, h, torch.empty_like(a))
    assert [launch.kernel.__name__ for launch in launches] == ["_swiglu_fwd_kernel", "_swiglu_bwd_kernel"]
    for launch in launches:
        assert all(n <= limit for n, limit in zip(launch.grid, CUDA_GRID_LIMITS)), launch.grid
