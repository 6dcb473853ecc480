"""tests/interpreter_memcheck.py, the memcheck every test runs the CPU interpreter under: it must catch
a read or write past a kernel's tensors and a race between two programs, and let masked-off lanes and
disjoint programs be."""

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
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(src_ptr + offs, mask=offs < n, other=0.0) if MASKED else tl.load(src_ptr + offs)
    tl.store(dst_ptr + offs + STORE_PAST, x, mask=offs < n)


@triton.jit
def _shared_row_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr, READ_OTHER: tl.constexpr):
    """Program 0 writes row 0 of x; program 1 writes row 0 too (READ_OTHER=False) or reads it (True)."""
    offs = tl.arange(0, BLOCK)
    if tl.program_id(0) == 0:
        tl.store(x_ptr + offs, tl.full((BLOCK,), 1.0, tl.float32))
    elif READ_OTHER:
        tl.store(y_ptr + offs, tl.load(x_ptr + offs))
    else:
        tl.store(x_ptr + offs, tl.full((BLOCK,), 2.0, tl.float32))


def _copy(n: int, block: int, programs: int = 1, masked: bool = True, store_past: int = 0) -> torch.Tensor:
    src, dst = torch.arange(n, dtype=torch.float32), torch.zeros(n)
    _copy_kernel[(programs,)](src, dst, n, BLOCK=block, MASKED=masked, STORE_PAST=store_past)
    return dst


def test_masked_tails_and_disjoint_programs_pass() -> None:
    assert torch.equal(_copy(5, 8), torch.arange(5, dtype=torch.float32))
    assert torch.equal(_copy(13, 4, programs=4), torch.arange(13, dtype=torch.float32))


@pytest.mark.parametrize("masked,store_past,message", [
    (False, 0, "load out of bounds in _copy_kernel: 3 of 8 lanes"),  # lanes 5-7 of a 5-element tensor
    (True, 1, "store out of bounds in _copy_kernel: 1 of 5 lanes"),  # the shifted last element
], ids=["read-past-the-end", "write-past-the-end"])
def test_access_past_the_tensors_fails_naming_the_kernel(masked, store_past, message) -> None:
    """(CPU tensors are 64-byte aligned, so the 20-byte tensors here never abut and a stray lane
    cannot land inside the other argument.)"""
    with pytest.raises(Exception, match=message):
        _copy(5, 8, masked=masked, store_past=store_past)


@pytest.mark.parametrize("read_other,message", [
    (False, "race in _shared_row_kernel: 4 addresses stored by two programs"),
    (True, r"race in _shared_row_kernel: program \(1, 0, 0\) loads 4 addresses another program"),
], ids=["write-write", "write-read"])
def test_two_programs_touching_one_address_is_a_race(read_other, message) -> None:
    x, y = torch.zeros(4), torch.zeros(4)
    with pytest.raises(Exception, match=message):
        _shared_row_kernel[(2,)](x, y, BLOCK=4, READ_OTHER=read_other)
