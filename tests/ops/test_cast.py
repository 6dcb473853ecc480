"""ops.cast: the bf16 <-> fp32 casts and the bf16 gradient sum (Triton; the CPU interpreter here) are
bit-identical to torch's, bf16_weight trains as weight.to(bf16) does, and bf16_uses as one autocast
cast per consumer does."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of the kernels

import torch.nn.functional as F  # noqa: E402

from kimik3.ops.cast import _BF16Stacked, autocast_stacked, bf16_uses, bf16_weight  # noqa: E402
from kimik3.ops.cast_kernels import (downcast_fp32, downcast_stacked, stack_layout, sum_bf16, upcast_bf16,  # noqa: E402
                                     upcast_stacked)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs CUDA or the Triton interpreter")


@pytest.mark.parametrize("shape", [(1,), (4095,), (4096,), (3, 4097), (2, 33, 65)])
def test_upcast_is_bit_identical_to_float(shape):
    """Sizes below, at and just past the kernel's 4096-element block, infs, NaNs, -0.0 and subnormals."""
    gen = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(*shape, generator=gen) * 1e3).to(torch.bfloat16)
    specials = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0, 1e-40], dtype=torch.bfloat16)
    flat = x.view(-1)
    flat[: min(flat.numel(), specials.numel())] = specials[: flat.numel()]
    x = x.to(DEVICE)
    got, want = upcast_bf16(x), x.float()
    assert got.dtype == torch.float32 and got.shape == x.shape and got.is_contiguous()
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # bits, so NaN == NaN


@pytest.mark.parametrize("shape", [(1,), (4095,), (4096,), (3, 4097), (2, 33, 65)])
def test_downcast_rounds_bit_identically_to_torch(shape):
    """Random values at every exponent scale, ties (both parities), values that round up to inf,
    infs, signed zeros and subnormals: the same bits as `Tensor.to(bf16)`; NaNs stay NaN."""
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=gen) * torch.exp2(torch.randint(-140, 128, shape, generator=gen).float())
    ties = torch.tensor([0x3F808000, 0x3F818000, 0x7F7FFFFF, 0xFF7FF000], dtype=torch.int64).to(torch.int32)
    specials = torch.cat([ties.view(torch.float32), torch.tensor([float("inf"), float("-inf"), -0.0, 0.0, 1e-40,
                                                                   -3e-39])])
    flat = x.view(-1)
    flat[: min(flat.numel(), specials.numel())] = specials[: flat.numel()]
    flat[-1] = float("nan")
    x = x.to(DEVICE)
    got, want = downcast_fp32(x), x.to(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape and got.is_contiguous()
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan])


@pytest.mark.parametrize("cast, dtype", [(upcast_bf16, torch.bfloat16), (downcast_fp32, torch.float32)])
def test_casts_refuse_what_they_cannot_read(cast, dtype):
    with pytest.raises(ValueError, match=f"contiguous {dtype}"):
        cast(torch.zeros(4, 4, dtype=dtype, device=DEVICE).t())
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    with pytest.raises(ValueError, match=f"contiguous {dtype}"):
        cast(torch.zeros(4, dtype=other, device=DEVICE))


@pytest.mark.parametrize("transposed", [False, True])
def test_bf16_weight_gradient_matches_autograd_cast(transposed):
    """A matmul through bf16_weight gives the fp32 weight the gradient a plain .to(bf16) gives,
    bit for bit, also when the bf16 copy is used transposed (as the grouped GEMMs do)."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3, 48, 32, generator=gen).to(DEVICE).requires_grad_()
    x = torch.randn(3, 16, 48 if transposed else 32, generator=gen).to(DEVICE, torch.bfloat16)
    dy = torch.randn(3, 16, 32 if transposed else 48, generator=gen).to(DEVICE, torch.bfloat16)
    grads = []
    for cast in (lambda t: t.to(torch.bfloat16), bf16_weight):
        wb = cast(w)
        y = torch.bmm(x, wb) if transposed else torch.bmm(x, wb.transpose(-2, -1))
        assert wb.dtype == torch.bfloat16
        (g,) = torch.autograd.grad(y, w, dy)
        grads.append(g)
    assert grads[1].dtype == torch.float32 and torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("parts, shape", [(2, (4095,)), (2, (3, 4097)), (3, (2, 33, 65))])
def test_sum_bf16_adds_in_fp32_left_to_right(parts, shape):
    """Bit-identical to `a.float() + b.float() + ...` at sizes around the block; the values span
    exponents so that the fp32 sums round, with signed zeros and infs among them."""
    gen = torch.Generator().manual_seed(parts + sum(shape))
    xs = [(torch.randn(*shape, generator=gen) * torch.exp2(torch.randint(-20, 20, shape, generator=gen).float()))
          .to(torch.bfloat16) for _ in range(parts)]
    xs[0].view(-1)[:3] = torch.tensor([-0.0, float("inf"), 1.0], dtype=torch.bfloat16)
    xs[1].view(-1)[:3] = torch.tensor([-0.0, 2.0, -1.0], dtype=torch.bfloat16)
    xs = [x.to(DEVICE) for x in xs]
    want = xs[0].float()
    for x in xs[1:]:
        want = want + x.float()
    got = sum_bf16(xs)
    assert got.dtype == torch.float32 and got.shape == xs[0].shape
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_sum_bf16_refuses_what_it_cannot_add():
    a = torch.zeros(4, 4, dtype=torch.bfloat16, device=DEVICE)
    for bad in ([a], [a, a.t()], [a, a.float()], [a, a[:2]]):
        with pytest.raises(ValueError, match="two or more contiguous bf16"):
            sum_bf16(bad)


@pytest.mark.parametrize("used", [(0, 1), (0,), (1,), (0, 1, 2)], ids=["both", "first", "second", "three"])
def test_bf16_uses_give_autocast_values_and_fp32_summed_gradients(used):
    """Each alias holds x.to(bf16); the gradient of x is the fp32 sum of the consumers' bf16
    gradients, bit for bit what one cast per consumer gives (autograd sums those in fp32); an unused
    alias adds nothing. The aliases share one copy."""
    uses = max(used) + 1
    gen = torch.Generator().manual_seed(uses)
    x = torch.randn(6, 40, generator=gen).to(DEVICE).requires_grad_()
    ws = [torch.randn(40, 40, generator=gen).to(DEVICE, torch.bfloat16) for _ in range(uses)]

    def loss(operands):
        return sum((operands[i] @ ws[i]).float().pow(2).sum() for i in used)

    aliases = bf16_uses(x, uses)
    assert len(aliases) == uses and all(a.dtype == torch.bfloat16 for a in aliases)
    assert all(torch.equal(a, x.detach().to(torch.bfloat16)) for a in aliases)
    assert len({a.data_ptr() for a in aliases}) == 1
    (got,) = torch.autograd.grad(loss(aliases), x)
    (want,) = torch.autograd.grad(loss([x.to(torch.bfloat16) for _ in range(uses)]), x)
    assert got.dtype == torch.float32 and torch.equal(got, want)


def test_bf16_uses_takes_fp32_only():
    with pytest.raises(ValueError, match="fp32 tensor, got torch.bfloat16"):
        bf16_uses(torch.zeros(3, dtype=torch.bfloat16, device=DEVICE), 2)


def _stack_weights(rows=(3, 4096 // 32 + 1, 1, 5), cols=32, seed=0):
    """fp32 weights of one column count: a part below a block, one just past it (a partial second
    block), single-row parts; values across exponents with a tie, infs, -0.0, a subnormal and a NaN."""
    gen = torch.Generator().manual_seed(seed)
    ws = []
    for r in rows:
        w = torch.randn(r, cols, generator=gen) * torch.exp2(torch.randint(-140, 128, (r, cols), generator=gen).float())
        ws.append(w)
    specials = torch.tensor([float("inf"), float("-inf"), -0.0, 1e-40, float("nan")])
    ws[1].view(-1)[:5] = specials
    ws[0].view(-1)[0] = torch.tensor(0x3F808000, dtype=torch.int32).view(torch.float32)  # a tie: rounds to even
    return [w.to(DEVICE) for w in ws]


def test_stacked_casts_equal_per_weight_casts_and_return_aligned_views_of_one_buffer():
    ws = _stack_weights()
    layout = stack_layout(ws)
    got, want = downcast_stacked(ws, layout), torch.cat([w.to(torch.bfloat16) for w in ws])
    assert got.shape == want.shape == (sum(w.shape[0] for w in ws), 32) and got.dtype == torch.bfloat16
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan) and torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan])
    grad = torch.randn(got.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE, torch.bfloat16)
    grads = upcast_stacked(grad, layout)
    for g, w, part in zip(grads, ws, grad.split([w.shape[0] for w in ws])):
        assert g.shape == w.shape and g.dtype == torch.float32 and g.is_contiguous()
        assert torch.equal(g.view(torch.int32), part.float().view(torch.int32))
        assert g.data_ptr() % 16 == 0  # ops.adamw takes them
    assert len({g.untyped_storage().data_ptr() for g in grads}) == 1
    with pytest.raises(ValueError, match=r"contiguous bf16 \[\d+, 32\] gradient"):
        upcast_stacked(grad.float(), layout)


def test_stack_layout_is_built_once_per_set_of_weights_and_refuses_what_the_kernels_cannot_take():
    ws = _stack_weights()
    assert stack_layout(ws) is stack_layout(list(ws))  # cached: a step builds and copies no table
    assert stack_layout(ws[:2]) is not stack_layout(ws)
    flat = torch.zeros(8 * 32 + 1, device=DEVICE)
    for bad in ([ws[0], ws[1].t().contiguous()],  # another column count
                [ws[0], ws[1].t()],  # not contiguous
                [ws[0], ws[1].half()],  # not fp32
                [ws[0], flat[1:].view(8, 32)],  # not 16-byte aligned
                [torch.zeros(3, 3, device=DEVICE), torch.zeros(1, 3, device=DEVICE)],  # a stacked offset of 9
                [ws[0], ws[1].view(-1)]):  # not 2-D
        assert stack_layout(bad) is None


def test_stacked_weight_trains_as_per_weight_casts_do():
    """A projection through the stacked cast gives each fp32 weight the gradient of the per-weight
    path (cast each, stack, multiply), bit for bit; autocast_stacked picks the kernels on CUDA under
    bf16 autocast and the per-weight path elsewhere, with equal values."""
    ws = [w.clamp(-1e3, 1e3).nan_to_num().requires_grad_() for w in _stack_weights(rows=(4, 8, 2), seed=2)]
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(3)).to(DEVICE, torch.bfloat16)

    def grads(stacked):
        return torch.autograd.grad(F.linear(x, stacked).float().pow(2).sum(), ws)

    want = grads(torch.cat([w.to(torch.bfloat16) for w in ws]))
    got = grads(_BF16Stacked.apply(stack_layout(ws), *ws))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        auto = autocast_stacked(ws)
    assert auto.dtype == torch.bfloat16 and torch.equal(auto, torch.cat([w.to(torch.bfloat16) for w in ws]))
    assert (auto.grad_fn.name() == "_BF16StackedBackward") == (DEVICE == "cuda")
