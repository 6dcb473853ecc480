"""Bounds-checked memory access for Triton's CPU interpreter: a test-time memcheck for our kernels.

Under TRITON_INTERPRET=1 a load is a NumPy read at a raw address, so a kernel that reads past the
tensors it was given does not fault: it reads stray memory, its masked stores usually hide the
result, and the same kernel on the GPU reads (or writes) out of bounds. This check makes every
masked-in lane of every load and store lie inside the storage of one of the launch's tensor
arguments, and raises naming the kernel otherwise. It found the empty sub-chunks of the KDA score
kernels reading up to 15 rows past a partial last chunk.

Kernels that reach tensors through a table of addresses (not launch arguments) cannot be checked
this way and are listed in POINTER_TABLE_KERNELS.
"""

from __future__ import annotations

import numpy as np
import pytest

POINTER_TABLE_KERNELS = {"_adamw_kernel"}
"""ops/adamw.py: one launch updates many tensors found through an int64 table of offsets."""


class _Launch:
    """The running kernel's name and the [start, end) byte ranges of its tensor arguments' storages."""

    kernel = "?"
    ranges: list[tuple[int, int]] = []


def _record_arguments(init_args):
    def wrapped(self, args_dev, kwargs):
        args_hst, kwargs_hst = init_args(self, args_dev, kwargs)
        _Launch.kernel = getattr(self.fn, "__name__", "?")
        _Launch.ranges = [(s.data_ptr(), s.data_ptr() + s.nbytes())
                          for s in (a.untyped_storage() for a in (*args_hst, *kwargs_hst.values())
                                    if hasattr(a, "untyped_storage"))]
        return args_hst, kwargs_hst
    return wrapped


def _check(interpreter, what: str, ptrs, mask) -> None:
    if _Launch.kernel in POINTER_TABLE_KERNELS:
        return
    addresses = ptrs.data[np.broadcast_to(mask.data, ptrs.data.shape).astype(bool)]
    if addresses.size == 0:
        return
    size = np.dtype(interpreter._get_np_dtype(ptrs.get_element_ty())).itemsize
    inside = np.zeros(addresses.shape, dtype=bool)
    for start, end in _Launch.ranges:
        inside |= (addresses >= start) & (addresses + size <= end)
    if not inside.all():
        raise AssertionError(f"{what} out of bounds in {_Launch.kernel}: {int((~inside).sum())} of "
                             f"{addresses.size} lanes outside every tensor argument")


def install(monkeypatch: pytest.MonkeyPatch) -> None:
    """Check every interpreted load and store until monkeypatch undoes it."""
    from triton.runtime import interpreter

    executor, builder = interpreter.GridExecutor, interpreter.InterpreterBuilder
    load, store = builder.create_masked_load, builder.create_masked_store

    def checked_load(self, ptrs, mask, other, *args):
        _check(interpreter, "load", ptrs, mask)
        return load(self, ptrs, mask, other, *args)

    def checked_store(self, ptrs, value, mask, *args):
        _check(interpreter, "store", ptrs, mask)
        return store(self, ptrs, value, mask, *args)

    monkeypatch.setattr(executor, "_init_args_hst", _record_arguments(executor._init_args_hst))
    monkeypatch.setattr(builder, "create_masked_load", checked_load)
    monkeypatch.setattr(builder, "create_masked_store", checked_store)
