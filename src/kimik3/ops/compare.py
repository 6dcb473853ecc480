"""Error measures shared by tests and benchmarks, so every comparison reports the same numbers.

`rel_rms_error` is the headline measure (scale-free, robust to a few large elements); `max_abs_error`
catches a single bad element that an RMS would average away. Both compute in fp64.
"""

from __future__ import annotations

from torch import Tensor


def rel_rms_error(actual: Tensor, expected: Tensor) -> float:
    """||actual - expected||_rms / ||expected||_rms (0 when both are exactly zero)."""
    if actual.shape != expected.shape:
        raise ValueError(f"shape mismatch: actual {tuple(actual.shape)} vs expected {tuple(expected.shape)}")
    a, e = actual.detach().double(), expected.detach().double()
    diff = (a - e).pow(2).mean().sqrt().item()
    ref = e.pow(2).mean().sqrt().item()
    if ref == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return diff / ref


def max_abs_error(actual: Tensor, expected: Tensor) -> float:
    """max |actual - expected| over all elements."""
    if actual.shape != expected.shape:
        raise ValueError(f"shape mismatch: actual {tuple(actual.shape)} vs expected {tuple(expected.shape)}")
    return (actual.detach().double() - expected.detach().double()).abs().max().item()


def assert_rel_close(name: str, actual: Tensor, expected: Tensor, bound: float) -> None:
    """Raise AssertionError naming `name` when rel_rms_error exceeds `bound` (or is not finite)."""
    err = rel_rms_error(actual, expected)
    if not err <= bound:
        raise AssertionError(
            f"{name}: relative RMS error {err:.3e} > bound {bound:.1e} "
            f"(max abs error {max_abs_error(actual, expected):.3e})"
        )
