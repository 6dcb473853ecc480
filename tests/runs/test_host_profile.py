"""runs.host_profile: per-step collector pauses, heaviest functions and Triton launches by call site."""

from __future__ import annotations

import gc
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of the kernels

from kimik3.ops.cast_kernels import downcast_fp32  # noqa: E402
from kimik3.runs import host_profile as hp  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs CUDA or the Triton interpreter")


def _cast_twice(x: torch.Tensor) -> None:
    downcast_fp32(x)
    downcast_fp32(x)


def test_reports_launches_by_call_site_collections_and_kimik3_functions() -> None:
    x = torch.randn(64, device=DEVICE)
    calls = []

    def step(i: int) -> None:
        calls.append(i)
        _cast_twice(x)
        downcast_fp32(x)
        gc.collect()  # one full collection per step

    report = hp.host_profile(step, first=5, steps=3)
    assert calls == [5, 6, 7]
    # the launches are charged to the frame that wrote kernel[grid](...), past Triton's own frames
    assert report["triton_launches"] == 3
    (site,) = report["triton_launch_sites"]
    assert site["launches"] == 3 and site["site"].startswith("ops/cast_kernels.py:") and site["site"].endswith("(_cast)")
    assert report["collections"]["gen2"]["count"] == 1 and report["collections"]["gen2"]["max_ms"] > 0
    names = [f["function"] for f in report["top_kimik3_cumulative"]]
    assert any(n.endswith("(downcast_fp32)") for n in names)
    cast = next(f for f in report["top_kimik3_cumulative"] if f["function"].endswith("(downcast_fp32)"))
    assert cast["calls"] == 3 and cast["cumulative_ms"] >= cast["own_ms"] >= 0
    text = hp.format_report(report)
    assert "Triton launches per step 3" in text and "(_cast)" in text and "gen2 1x" in text
