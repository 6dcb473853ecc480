"""Make Triton 3.6's CPU interpreter (TRITON_INTERPRET=1) run our kernels faithfully on CPU tensors.

Three fixes, applied only under the interpreter (compiled kernels never see them):

- runtime loop bounds under NumPy 2: the interpreter holds every scalar as a 1-element array and
  converts loop bounds with `int(array)`, which NumPy >= 2.3 rejects ("only 0-dimensional arrays
  can be converted"), so any `for i in range(n)` with a runtime n fails. `tensor.__index__` uses
  `.item()` instead.
- bf16 `tl.dot`: bf16 tiles are held as their uint16 bit patterns and the interpreter's matmul
  multiplies those integers (garbage). bf16 operands are widened to fp32 first, as the tensor cores
  do (exact products, fp32 accumulation).
- fp32 -> bf16 casts truncate in the interpreter; the GPU (and torch) round to nearest even. We
  round to nearest even, so bf16 error measured on the CPU is the error the GPU makes.
"""

from __future__ import annotations

import os

import numpy as np


def _bf16_bits_to_fp32(bits: np.ndarray) -> np.ndarray:
    return (np.ascontiguousarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def _fp32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round to nearest even (NaN payloads are not preserved; kernels never store NaN on purpose)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def patch_interpreter_scalar_index() -> None:
    """Idempotently apply the interpreter fixes above when TRITON_INTERPRET=1."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_kimik3_patched", False):
        return

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    patched._kimik3_patched = True
    interpreter._patch_lang_tensor = patched

    builder = interpreter.InterpreterBuilder
    create_dot, cast_impl = builder.create_dot, builder.cast_impl

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar != tl.bfloat16:
            return create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        prod = np.matmul(_bf16_bits_to_fp32(a.data), _bf16_bits_to_fp32(b.data), dtype=d.data.dtype)
        return interpreter.TensorHandle(prod + d.data, d.dtype.scalar)

    def cast(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return interpreter.TensorHandle(_fp32_to_bf16_bits(src.data), dst_type.scalar)
        return cast_impl(self, src, dst_type)

    builder.create_dot, builder.cast_impl = dot, cast
