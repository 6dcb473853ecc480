"""tests/interpreter_bounds.py, the interpreter memcheck every test runs under: it must catch a read
or a write past a kernel's tensors and let masked-off lanes be."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels below are decorated

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="checks the CPU interpreter")


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr, MASKED: tl.constexpr, STORE_PAST: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(src_ptr + offs, mask=offs < n, other=0.0) if MASKED else tl.load(src_ptr + offs)
    if STORE_PAST:
        tl.store(dst_ptr + offs + 1, x, mask=offs < n)
    else:
        tl.store(dst_ptr + offs, x, mask=offs < n)


def _copy(n: int, block: int, masked: bool, store_past: bool = False) -> torch.Tensor:
    src, dst = torch.arange(n, dtype=torch.float32), torch.zeros(n)
    _copy_kernel[(1,)](src, dst, n, BLOCK=block, MASKED=masked, STORE_PAST=store_past)
    return dst


def test_masked_tail_passes() -> None:
    assert torch.equal(_copy(5, 8, masked=True), torch.arange(5, dtype=torch.float32))


@pytest.mark.parametrize("masked,store_past,message", [
    (False, False, "load out of bounds in _copy_kernel: 3 of 8 lanes"),  # lanes 5-7 of a 5-element tensor
    (True, True, "store out of bounds in _copy_kernel: 1 of 5 lanes"),  # the shifted last element
], ids=["read-past-the-end", "write-past-the-end"])
def test_access_past_the_tensors_fails_naming_the_kernel(masked, store_past, message) -> None:
    """(CPU tensors are 64-byte aligned, so the 20-byte tensors here never abut and a stray lane
    cannot land inside the other argument.)"""
    with pytest.raises(Exception, match=message):
        _copy(5, 8, masked=masked, store_past=store_past)
