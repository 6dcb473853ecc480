"""Make Triton 3.6's CPU interpreter (TRITON_INTERPRET=1) run loops with runtime bounds under NumPy 2.

The interpreter holds every scalar as a 1-element array and converts loop bounds with
`int(array)`, which NumPy >= 2.3 rejects ("only 0-dimensional arrays can be converted"), so any
`for i in range(n)` with a runtime n fails on CPU. We re-register `tensor.__index__` with `.item()`.
Only the interpreter is touched (compiled kernels never see this); it is a no-op otherwise.
"""

from __future__ import annotations

import os


def patch_interpreter_scalar_index() -> None:
    """Idempotently fix `__index__` of interpreted scalars when TRITON_INTERPRET=1."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_kimik3_patched", False):
        return

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    patched._kimik3_patched = True
    interpreter._patch_lang_tensor = patched
