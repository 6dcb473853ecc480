"""runs.gpu_idle: the GPU's idle gaps in a Chrome trace, split into host-late and other, and attributed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kimik3.runs import gpu_idle as gi

HOST = {"pid": 1, "tid": 1}


def _x(cat: str, name: str, ts: float, dur: float, correlation: int | None = None, **where) -> dict:
    event = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, **(where or HOST)}
    if correlation is not None:
        event["args"] = {"correlation": correlation}
    return event


def _kernel(ts: float, dur: float, correlation: int, stream: int = 7) -> dict:
    return _x("kernel", f"k{correlation}", ts, dur, correlation, pid=0, tid=stream)


def _trace() -> dict:
    """Kernels 5-15 | gap 15 (host-late, launched inside kda > aten::mm) | 30-40 | gap 10 (launched early:
    other) | 50-55 and 52-62 on another stream (no gap) | gap 38 (host-late, launched in `outer` after
    its child `inner` closed) | 100-105."""
    return {"traceEvents": [
        _x("user_annotation", "k3bench::kda", 0, 100),
        _x("cpu_op", "aten::mm", 10, 20),
        _x("cuda_runtime", "cudaLaunchKernel", 1, 1, correlation=1),
        _x("cuda_runtime", "cudaLaunchKernel", 25, 2, correlation=2),
        _x("cuda_driver", "cuLaunchKernel", 12, 1, correlation=3),
        _x("cuda_runtime", "cudaLaunchKernel", 13, 1, correlation=5),
        _x("user_annotation", "outer", 101, 200, tid=2),
        _x("user_annotation", "inner", 102, 5, tid=2),
        _x("cuda_runtime", "cudaLaunchKernel", 120, 1, correlation=4, tid=2),
        _kernel(5, 10, 1), _kernel(30, 10, 2), _kernel(50, 5, 3), _kernel(52, 10, 5, stream=8),
        _kernel(100, 5, 4),
        {"ph": "s", "cat": "ac2g", "name": "flow", "ts": 1, "id": 1, **HOST},  # non-X events are ignored
    ]}


def test_splits_idle_into_host_late_and_other_and_names_the_launch_site() -> None:
    report = gi.gpu_idle(_trace())
    assert report["window_ms"] == pytest.approx(0.100) and report["kernels"] == 5
    assert report["busy_ms"] == pytest.approx(0.037)  # 10 + 10 + 12 (two streams) + 5
    assert report["idle_ms"] == pytest.approx(0.063) and report["gaps"] == 3
    assert report["host_late_ms"] == pytest.approx(0.053) and report["host_late_gaps"] == 2
    assert report["other_idle_ms"] == pytest.approx(0.010)
    # kernel 4's launch sits after `inner` closed: `outer` encloses it, on the launching thread only
    assert [(s["range"], s["operator"], s["ms"], s["gaps"]) for s in report["top_host_late"]] == [
        ("outer", "(no operator)", pytest.approx(0.038), 1), ("k3bench::kda", "aten::mm", pytest.approx(0.015), 1)]


def test_per_step_figures_and_short_gaps_left_unattributed() -> None:
    report = gi.gpu_idle(_trace(), min_gap_us=20, per=2)
    assert report["kernels"] == 2.5
    assert report["idle_ms"] == pytest.approx(0.0315) and report["host_late_ms"] == pytest.approx(0.0265)
    assert [s["range"] for s in report["top_host_late"]] == ["outer"]  # the 15 us gap counts, unnamed


def test_a_trace_without_gpu_activity_has_nothing_to_attribute() -> None:
    trace = {"traceEvents": [_x("cpu_op", "aten::mm", 0, 5)]}
    assert gi.gpu_idle(trace) is None
    assert "CPU run" in gi.format_report(None)


def test_torch_profiler_traces_use_the_categories_read_here(tmp_path: Path) -> None:
    """A real (CPU) trace: record_function ranges are `user_annotation`, operators `cpu_op`, and the
    innermost of each around an operator's middle is found."""
    a = torch.randn(64, 64)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with torch.profiler.record_function("k3bench::outer"):
            with torch.profiler.record_function("k3bench::inner"):
                a @ a
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]
    mm = next(e for e in events if e.get("cat") == gi.OP_CATEGORY and e["name"] == "aten::mm")
    middle = mm["ts"] + mm["dur"] / 2
    ranges = gi._Enclosing([e for e in events if e.get("cat") == gi.RANGE_CATEGORY])
    ops = gi._Enclosing([e for e in events if e.get("cat") == gi.OP_CATEGORY])
    thread = (mm["pid"], mm["tid"])
    assert ranges.name_at(thread, middle) == "k3bench::inner"
    assert ops.name_at(thread, middle) in {"aten::mm", "aten::matmul"}  # innermost op on the way down
    assert ops.name_at(thread, mm["ts"] + mm["dur"] + 1e6) is None


def test_cli_prints_the_report_and_rejects_a_bad_file(tmp_path: Path, capsys) -> None:
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(_trace()))
    assert gi.main([str(path), "--top", "1"])["host_late_gaps"] == 2
    out = capsys.readouterr().out
    assert "host launched late 0.1 (2 gaps)" in out and "outer  >  (no operator)" in out and "aten::mm" not in out
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(SystemExit) as err:
        gi.main([str(tmp_path / "bad.json")])
    assert err.value.code == 2 and "cannot read a Chrome trace" in capsys.readouterr().err


@pytest.mark.parametrize("per", ["0", "-2", "two"])
def test_cli_refuses_a_per_that_is_not_a_step_count(tmp_path: Path, capsys, per: str) -> None:
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(_trace()))
    with pytest.raises(SystemExit) as err:
        gi.main([str(path), "--per", per])
    lines = capsys.readouterr().err.strip().splitlines()
    assert err.value.code == 2 and "error: argument --per: " in lines[-1]


def test_a_cuda_only_trace_charges_gaps_to_the_kernel_that_ended_them() -> None:
    """No CPU operators or ranges (ProfilerActivity.CUDA alone): the sites name the next kernel."""
    trace = _trace()
    trace["traceEvents"] = [e for e in trace["traceEvents"] if e.get("cat") not in ("cpu_op", "user_annotation")]
    sites = gi.gpu_idle(trace)["top_host_late"]
    assert [(s["range"], s["operator"]) for s in sites] == [("(no range)", "kernel k4"), ("(no range)", "kernel k2")]
