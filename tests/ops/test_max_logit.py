"""ops.max_logit on the CPU (TRITON_INTERPRET=1) against the masked fp32 logits, and MLA's use of it."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of the kernel

from kimik3.ops.max_logit import causal_max_logits  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(), reason="needs CUDA or the interpreter"
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """Every causal logit in fp32, masked, max over batch and pairs: [H]."""
    logits = (q.float() @ k.float().transpose(-1, -2)) * scale  # [B, H, T, T]
    T = q.shape[2]
    future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    return logits.masked_fill(future, float("-inf")).amax(dim=(0, 2, 3))


@pytest.mark.parametrize("B,H,T,D", [(2, 3, 200, 48), (1, 2, 130, 192), (1, 1, 7, 16)], ids=["T200-D48", "T130-D192", "T7-D16"])
def test_matches_masked_logits(B, H, T, D):
    gen = torch.Generator().manual_seed(0)
    # [B, T, H, D] storage viewed as [B, H, T, D]: the strided layout MLA passes in
    q = torch.randn(B, T, H, D, generator=gen).to(DEVICE).transpose(1, 2)
    k = torch.randn(B, T, H, D, generator=gen).to(DEVICE).transpose(1, 2)
    q[:, :, 0] += 5.0  # a large logit on the first query row: only the (0, 0) pair is causal for it
    torch.testing.assert_close(causal_max_logits(q, k, 0.3), reference(q, k, 0.3), rtol=1e-5, atol=1e-5)


def test_future_pairs_are_ignored():
    """A huge logit that only a future key would give must not count."""
    q = torch.zeros(1, 1, 64, 16, device=DEVICE)
    k = torch.zeros(1, 1, 64, 16, device=DEVICE)
    q[0, 0, 10, 0] = 1.0
    k[0, 0, 11, 0] = 100.0  # pair (10, 11) is in the future
    k[0, 0, 3, 0] = 2.0  # pair (10, 3) is causal
    assert causal_max_logits(q, k, 1.0).item() == 2.0


def test_rejects_odd_head_dim():
    q = torch.zeros(1, 1, 8, 20)
    with pytest.raises(ValueError, match="D a multiple of 16"):
        causal_max_logits(q, q, 1.0)
