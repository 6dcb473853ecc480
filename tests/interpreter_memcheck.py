"""A test-time memcheck for our Triton kernels under the CPU interpreter: bounds and races.

Under TRITON_INTERPRET=1 a load is a NumPy read at a raw address and the programs of a launch run
one after another, so two kinds of GPU bugs pass unseen:

- Out-of-bounds access: a kernel reading past the tensors it was given does not fault, it reads stray
  memory, and masked stores usually hide the result. Every masked-in lane of every load and store
  must fall inside the storage of one of the launch's tensor arguments. (This found the empty
  sub-chunks of the KDA score kernels reading up to 15 rows past a partial last chunk.)
- Races between programs: on the GPU the programs of one launch run in no fixed order, so an element
  written by one program and written or read by another is a race; run in sequence it looks fine.
  After each launch, no address may be stored by two programs, or stored by one and loaded by
  another. (Atomics are separate operations and not tracked.)

A kernel that reaches tensors through a table of addresses rather than as launch arguments has a
function in TABLE_RANGES that reads the table and adds those tensors' ranges.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest

def _adamw_ranges(args: list) -> list[tuple[int, int]]:
    """ops/adamw.py's _adamw_kernel(base, offsets, block_tensor, first_block, numel, ...): row i of the
    int64 offsets table holds the element offsets from base of param, grad, exp_avg, exp_avg_sq (numel[i]
    fp32 each) and of the step count (one fp32)."""
    base, offsets, numel = args[0], args[1], args[4]
    start, size = base.data_ptr(), base.element_size()
    return [(start + int(off) * size, start + (int(off) + (int(n) if j < 4 else 1)) * size)
            for row, n in zip(offsets.tolist(), numel.tolist()) for j, off in enumerate(row)]


def _stacked_downcast_ranges(args: list) -> list[tuple[int, int]]:
    """ops/cast_kernels.py's _stacked_downcast_kernel(first_weight, stacked, table, ...): column 0 of each
    table row is a weight's element offset from the first weight, column 3 its numel (fp32 each)."""
    base, table = args[0], args[2]
    start, size = base.data_ptr(), base.element_size()
    return [(start + int(row[0]) * size, start + (int(row[0]) + int(row[3])) * size) for row in table.tolist()]


TABLE_RANGES = {"_adamw_kernel": _adamw_ranges, "_stacked_downcast_kernel": _stacked_downcast_ranges}
"""Kernel name -> the byte ranges of the tensors it reaches through a table in its arguments."""


class _Launch:
    """The running launch: its kernel, its tensor arguments' [start, end) byte ranges, and the
    addresses each program (grid index) has stored and loaded."""

    kernel = "?"
    ranges: list[tuple[int, int]] = []
    stores: dict[tuple, list[np.ndarray]] = defaultdict(list)
    loads: dict[tuple, list[np.ndarray]] = defaultdict(list)

    @classmethod
    def start(cls, kernel: str, args: list) -> None:
        cls.kernel = kernel
        storages = [a.untyped_storage() for a in args if hasattr(a, "untyped_storage")]
        cls.ranges = [(s.data_ptr(), s.data_ptr() + s.nbytes()) for s in storages]
        if kernel in TABLE_RANGES:
            cls.ranges += TABLE_RANGES[kernel](args)
        cls.stores, cls.loads = defaultdict(list), defaultdict(list)


def _lanes(ptrs, mask) -> np.ndarray:
    return ptrs.data[np.broadcast_to(mask.data, ptrs.data.shape).astype(bool)].ravel()


def _check_bounds(interpreter, what: str, ptrs, addresses: np.ndarray) -> None:
    size = np.dtype(interpreter._get_np_dtype(ptrs.get_element_ty())).itemsize
    inside = np.zeros(addresses.shape, dtype=bool)
    for start, end in _Launch.ranges:
        inside |= (addresses >= start) & (addresses + size <= end)
    if not inside.all():
        raise AssertionError(f"{what} out of bounds in {_Launch.kernel}: {int((~inside).sum())} of "
                             f"{addresses.size} lanes outside every tensor argument")


def _check_races() -> None:
    """Stores of each program against the stores and loads of every other program of the launch."""
    if len(_Launch.stores) < 2:
        return
    programs = list(_Launch.stores)
    stored = [np.unique(np.concatenate(_Launch.stores[p])) for p in programs]
    owner = np.concatenate([np.full(a.size, i) for i, a in enumerate(stored)])
    addresses = np.concatenate(stored)
    order = np.argsort(addresses, kind="stable")
    addresses, owner = addresses[order], owner[order]
    if (twice := int((addresses[1:] == addresses[:-1]).sum())):
        raise AssertionError(f"race in {_Launch.kernel}: {twice} addresses stored by two programs")
    index = {p: i for i, p in enumerate(programs)}
    for program, chunks in _Launch.loads.items():
        read = np.unique(np.concatenate(chunks))
        at = np.clip(np.searchsorted(addresses, read), 0, addresses.size - 1)
        foreign = (addresses[at] == read) & (owner[at] != index.get(program, -1))
        if foreign.any():
            raise AssertionError(f"race in {_Launch.kernel}: program {program} loads {int(foreign.sum())} "
                                 "addresses another program of the launch stores")


def install(monkeypatch: pytest.MonkeyPatch) -> None:
    """Check every interpreted launch (bounds per access, races at its end) until monkeypatch undoes it."""
    from triton.runtime import interpreter

    executor, builder = interpreter.GridExecutor, interpreter.InterpreterBuilder
    init_args, call = executor._init_args_hst, executor.__call__
    load, store = builder.create_masked_load, builder.create_masked_store

    def recording_init_args(self, args_dev, kwargs):
        args_hst, kwargs_hst = init_args(self, args_dev, kwargs)
        _Launch.start(getattr(self.fn, "__name__", "?"), [*args_hst, *kwargs_hst.values()])
        return args_hst, kwargs_hst

    def checked_call(self, *args, **kwargs):
        result = call(self, *args, **kwargs)
        _check_races()
        return result

    def checked(access, what: str):
        """create_masked_load(ptrs, mask, ...) or create_masked_store(ptrs, value, mask, ...), checked and
        logged in _Launch.loads / _Launch.stores."""
        def wrapped(self, ptrs, *args):
            lanes = _lanes(ptrs, args[1] if what == "store" else args[0])
            _check_bounds(interpreter, what, ptrs, lanes)
            getattr(_Launch, f"{what}s")[tuple(self.grid_idx)].append(lanes)
            return access(self, ptrs, *args)
        return wrapped

    monkeypatch.setattr(executor, "_init_args_hst", recording_init_args)
    monkeypatch.setattr(executor, "__call__", checked_call)
    monkeypatch.setattr(builder, "create_masked_load", checked(load, "load"))
    monkeypatch.setattr(builder, "create_masked_store", checked(store, "store"))
