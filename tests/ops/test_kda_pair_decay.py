"""The dyadic levels of triton_pair_decay.level_factors rebuild every pair decay of a sub-chunk once.

A test kernel sums, over the four levels, each level's products up[t] * lo[j] on the pairs it owns
(`same`), per channel. For t > j that must be exp(G_t - G_j) (each pair in exactly one level, never an
exponent above 0, so nothing overflows even where G falls by hundreds inside the sub-chunk); for
t <= j and on pad rows of a partial sub-chunk it must be 0.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of the kernels

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kimik3.ops.kda.triton_pair_decay import level_factors  # noqa: E402
from kimik3.ops.kda.triton_prologue import load_rows  # noqa: E402
from kimik3.ops.triton_interpret import patch_interpreter_scalar_index  # noqa: E402

patch_interpreter_scalar_index()
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs CUDA or the Triton interpreter")
BC, BK = 16, 16


@triton.jit
def _rebuild_kernel(G_ptr, out_ptr, n_i, BC: tl.constexpr, BK: tl.constexpr):
    """out[t, j, c] = sum over levels of same[t, j] up[t, c] lo[j, c] (one head, one column block)."""
    G = load_rows(G_ptr, 0, n_i, 0, 1, BK, BC, BK, 0)
    total = tl.zeros((BC, BC, BK), dtype=tl.float32)
    for level in range(4):
        up, lo, same = level_factors(G_ptr, G, 0, n_i, 0, 1, BK, BC, BK, 0, level)
        total += tl.where(same[:, :, None], up[:, None, :] * lo[None, :, :], 0.0)
    t = tl.arange(0, BC)
    offs = (t[:, None, None] * BC + t[None, :, None]) * BK + tl.arange(0, BK)[None, None, :]
    tl.store(out_ptr + offs, total)


def _cumulative_decay(seed: int) -> torch.Tensor:
    """[BC, BK] non-increasing G: per-channel log decays from ~0 to -300 per token."""
    gen = torch.Generator().manual_seed(seed)
    rate = torch.logspace(-3, 2.5, BK)  # 1e-3 .. ~316 per token, one rate per channel
    g = -rate * torch.rand(BC, BK, generator=gen)
    return g.cumsum(0).to(DEVICE)


@pytest.mark.parametrize("n_i", [BC, 11, 1], ids=["full", "partial", "one-row"])
def test_levels_rebuild_each_pair_decay_once(n_i):
    G = _cumulative_decay(seed=n_i)
    out = torch.full((BC, BC, BK), float("nan"), device=DEVICE)
    _rebuild_kernel[(1,)](G, out, n_i, BC=BC, BK=BK)
    assert torch.isfinite(out).all()
    t = torch.arange(BC, device=DEVICE)
    owned = ((t[:, None] > t[None, :]) & (t[:, None] < n_i))[:, :, None].expand(BC, BC, BK)  # per channel
    want = torch.where(owned, (G[:, None, :] - G[None, :, :]).clamp(max=0).exp(), 0.0)
    assert torch.equal(out[~owned], want[~owned])  # exact zeros off the owned pairs
    tiny = want <= 1e-30
    assert (out[owned & tiny] <= 1e-30).all()  # decays that underflow stay (near) zero
    rel = ((out - want).abs() / want.clamp(min=1e-30))[owned & ~tiny]
    assert rel.numel() == 0 or rel.max() < 1e-5, rel.max()  # two exps and a product in fp32
    assert rel.numel() > 0 or n_i == 1
