"""Numerical ops (kernels and their references). Imports only torch (and triton where present)."""

import torch

TRITON_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Floating dtypes the elementwise Triton kernels (norms, SwiGLU) take on CUDA; others (fp64) run the
eager forms, which are also the references the kernels are tested against."""

SHORT_CONV_MAX_TAPS = 4
"""Widest short-conv kernel ops/conv.py's Triton backward takes (its per-tap accumulators are written
out; fla and the Kimi Linear configs use 4). Wider kernels run the eager conv (models/kda)."""
