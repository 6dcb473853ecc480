"""Keep a recipe instead of chosen activations that autograd would save, and recompute them in backward.

The KDA op saves its inputs q, k, v for the backward: three [B, T, H*K] tensors per layer, 2.25 GiB
over the 24 layers of kda_dense_1b at T=8192 in bf16. They are the outputs of the short convolution,
whose own backward already keeps the convolution's input, so they can be recomputed from it by one
more conv forward (a pass over ~100 MB per layer) when the KDA backward asks for them.

`RecomputeSaved(fn, outputs)` is a context: while it is open, every tensor autograd saves that is
one of `outputs` (same storage, offset, shape, strides and dtype) is packed as a reference to the
recipe; the first unpack in the backward runs fn() without grad once for all of them, and the cache
is dropped once each packed output has been unpacked. fn must return the outputs in the same
layout (shape, strides, storage offset; checked) and bit for bit (our Triton conv is
deterministic). Other saved tensors pass through untouched.

It stays off inside another saved-tensor policy (activation checkpointing, save_on_cpu): that
policy already decides what is kept, and a recipe would pin fn's inputs that it means to free. And
off while torch.compile traces (train.compile=true), for the reason given in __init__.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor


def _key(t: Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype,
            t.device)


class RecomputeSaved(contextlib.AbstractContextManager):
    """See the module docstring."""

    def __init__(self, fn: Callable[[], Sequence[Tensor]], outputs: Sequence[Tensor]) -> None:
        # Under torch.compile the compiler decides what to save (its partitioner already recomputes
        # cheap ops), and tracing the hooks would break the graph.
        self.active = not torch.compiler.is_compiling() and not saved_tensor_policy_active()
        self._fn = fn
        self._index = {_key(t): i for i, t in enumerate(outputs)} if self.active else {}
        self._cache: Optional[Sequence[Tensor]] = None
        self._packed: set[int] = set()
        self._unpacked: set[int] = set()
        self._hooks: Optional[torch.autograd.graph.saved_tensors_hooks] = None

    def __enter__(self) -> "RecomputeSaved":
        if self.active:
            self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._hooks is not None:
            self._hooks.__exit__(*exc)
            # The hooks hold bound methods of self: kept, they would make a reference cycle that pins
            # fn's inputs (a layer's projection output) until Python's cycle collector runs, steps later.
            self._hooks = None

    def _pack(self, t: Tensor):
        i = self._index.get(_key(t))
        if i is None:
            return t
        self._packed.add(i)
        return _Recipe(i, t)

    def _unpack(self, packed):
        if not isinstance(packed, _Recipe):
            return packed
        if self._cache is None:
            with torch.no_grad():
                self._cache = self._fn()
        out = self._cache[packed.index]
        if _key(out)[1:] != packed.layout[1:]:  # everything but the (new) storage address
            raise RuntimeError(f"RecomputeSaved: output {packed.index} was recomputed as {tuple(out.shape)} "
                               f"stride {out.stride()}, not as saved ({packed.layout[2]}, {packed.layout[3]})")
        self._unpacked.add(packed.index)
        if self._unpacked >= self._packed:  # every saved output has been handed back: free the cache
            self._cache, self._unpacked = None, set()
        return out


class _Recipe:
    """What is kept of a recomputed saved tensor: which output of fn it is, and its layout."""

    __slots__ = ("index", "layout")

    def __init__(self, index: int, t: Tensor) -> None:
        self.index, self.layout = index, _key(t)


def saved_tensor_policy_active() -> bool:
    """Whether saved-tensor hooks are already installed (activation checkpointing, save_on_cpu).
    torch has no public query; torch.utils.checkpoint itself reads this one."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
