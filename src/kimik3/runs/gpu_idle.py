"""Where the GPU waits on the host: idle gaps of a torch.profiler Chrome trace, attributed to host code.

A step is host-bound where the GPU runs out of queued work: it finishes a kernel before the host has
launched the next. Summing kernel durations (the benchmark's breakdown) cannot see that time; the
timeline can. This reads the trace `train.profile` writes (or `benchmarks/train_step.py --profile`)
and splits the GPU's idle time between its first and last kernel into gaps:

- **host-late**: the kernel after the gap was launched after the gap began (its launch call, matched
  by the trace's correlation id, ended after the previous kernel finished). The GPU waited for the
  host; the gap is charged to what launched that kernel: the innermost profiler range (a module scope,
  `Optimizer.step`, a `kimik3::` range) and the innermost operator around the launch.
- **other**: the kernel was queued in time and still started late (waits on events or other streams,
  copies from pageable memory, the profiler's own flushes).

The profiler's CPU side slows the host (every operator and range is recorded), so in a trace with CPU
activity the host looks later than it is. A trace of CUDA activity alone (`ProfilerActivity.CUDA`:
kernels and their launch calls, little host cost) gives the truer idle figure; it has no ranges or
operators, so its gaps are charged to the kernel that ended them (`kernel <name>`), which still
says where in the step the host fell behind.

    python -m kimik3.runs.gpu_idle outputs/<run>/profile/trace_steps11-12.json
"""

from __future__ import annotations

import argparse
import bisect
import json
from collections import defaultdict
from pathlib import Path
from typing import Optional

GPU_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
LAUNCH_CATEGORIES = frozenset({"cuda_runtime", "cuda_driver"})
"""Kernel launches: the runtime API (cudaLaunchKernel, what aten uses) and the driver API
(cuLaunchKernel, what Triton's launcher calls)."""
RANGE_CATEGORY = "user_annotation"
OP_CATEGORY = "cpu_op"


def _span(event: dict) -> tuple[float, float]:
    return float(event["ts"]), float(event["ts"]) + float(event.get("dur", 0.0))


class _Enclosing:
    """The innermost event of one category and thread around a time. Events on one thread nest, so
    each has a parent (the innermost event open when it started); the event enclosing a time t is the
    last one to start before t or one of its ancestors."""

    def __init__(self, events: list[dict]) -> None:
        grouped: dict[tuple, list[dict]] = defaultdict(list)
        for ev in events:
            grouped[(ev.get("pid"), ev.get("tid"))].append(ev)
        self._by_thread: dict[tuple, tuple[list[float], list[float], list[int], list[str]]] = {}
        for key, evs in grouped.items():
            evs.sort(key=lambda e: float(e["ts"]))
            starts, ends, parents, open_ = [], [], [], []
            for i, ev in enumerate(evs):
                start, end = _span(ev)
                while open_ and ends[open_[-1]] < start:
                    open_.pop()
                starts.append(start)
                ends.append(end)
                parents.append(open_[-1] if open_ else -1)
                open_.append(i)
            self._by_thread[key] = (starts, ends, parents, [e["name"] for e in evs])

    def name_at(self, thread: tuple, t: float) -> Optional[str]:
        starts, ends, parents, names = self._by_thread.get(thread, ([], [], [], []))
        i = bisect.bisect_right(starts, t) - 1
        while i >= 0 and ends[i] < t:
            i = parents[i]
        return names[i] if i >= 0 else None


def gpu_idle(trace: dict, top: int = 10, min_gap_us: float = 0.0, per: int = 1) -> Optional[dict]:
    """Idle time of the GPU in `trace` (a Chrome trace dict), split as the module docstring says.

    Returns None for a trace without GPU activity (a CPU run); else a dict with the window's span,
    the GPU activities in it (kernels, memsets and copies: each one the host launched), the busy and
    idle milliseconds, the host-late and other idle milliseconds and gap counts, and the
    `top` (range, operator) pairs by host-late idle time, every figure divided by `per` (the number
    of steps the trace holds, for per-step figures). Gaps shorter than `min_gap_us` are counted as
    idle but not attributed (the launch latency between back-to-back kernels).
    """
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "ts" in e]
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATEGORIES), key=lambda e: float(e["ts"]))
    if not gpu:
        return None
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})}
    ranges = _Enclosing([e for e in events if e.get("cat") == RANGE_CATEGORY])
    op_events = [e for e in events if e.get("cat") == OP_CATEGORY]
    ops, has_ops = _Enclosing(op_events), bool(op_events)

    busy_end = _span(gpu[0])[1]
    busy = idle = host_late = 0.0
    gaps = late_gaps = 0
    by_site: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    busy_start = float(gpu[0]["ts"])
    for ev in gpu[1:]:
        start, end = _span(ev)
        if start <= busy_end:  # overlaps or abuts the busy stretch (another stream, or no gap)
            busy_end = max(busy_end, end)
            continue
        busy += busy_end - busy_start
        gap = start - busy_end
        idle += gap
        gaps += 1
        launch = launches.get(ev.get("args", {}).get("correlation"))
        if launch is not None and _span(launch)[1] > busy_end:
            host_late += gap
            late_gaps += 1
            if gap >= min_gap_us:
                thread, when = (launch.get("pid"), launch.get("tid")), float(launch["ts"])
                operator = ops.name_at(thread, when) or ("(no operator)" if has_ops else f"kernel {ev['name'][:80]}")
                site = (ranges.name_at(thread, when) or "(no range)", operator)
                by_site[site][0] += gap
                by_site[site][1] += 1
        busy_start, busy_end = start, end
    busy += busy_end - busy_start
    sites = sorted(by_site.items(), key=lambda kv: -kv[1][0])[:top]
    ms = lambda us: round(us / 1e3 / per, 4)  # noqa: E731
    count = lambda n: round(n / per, 1)  # noqa: E731
    return {
        "window_ms": ms(busy_end - float(gpu[0]["ts"])),
        "kernels": count(len(gpu)),
        "busy_ms": ms(busy),
        "idle_ms": ms(idle),
        "host_late_ms": ms(host_late),
        "other_idle_ms": ms(idle - host_late),
        "gaps": count(gaps),
        "host_late_gaps": count(late_gaps),
        "top_host_late": [{"range": r, "operator": o, "ms": ms(us), "gaps": count(n)} for (r, o), (us, n) in sites],
    }


def format_report(report: Optional[dict]) -> str:
    """A few readable lines of gpu_idle's report."""
    if report is None:
        return "no GPU activity in the trace (a CPU run): nothing to attribute"
    lines = [f"GPU window {report['window_ms']:.1f} ms ({report['kernels']:g} kernels, memsets and copies): "
             f"busy {report['busy_ms']:.1f}, idle {report['idle_ms']:.1f} "
             f"({report['gaps']:g} gaps), of which the host launched late {report['host_late_ms']:.1f} "
             f"({report['host_late_gaps']:g} gaps), other {report['other_idle_ms']:.1f}"]
    for site in report["top_host_late"]:
        lines.append(f"  {site['ms']:8.2f} ms  {site['gaps']:7g} gaps  {site['range']}  >  {site['operator']}")
    return "\n".join(lines)


def _positive_int(text: str) -> int:
    """--per's type: a step count of 0 divided every figure by zero (a traceback), a negative one
    printed negative milliseconds."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a number of steps (1 or more)")
    return value


def main(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", type=Path, help="a Chrome trace from torch.profiler (train.profile writes them)")
    parser.add_argument("--top", type=int, default=10, help="host-late sites to list")
    parser.add_argument("--min-gap-us", type=float, default=0.0, help="attribute only gaps at least this long")
    parser.add_argument("--per", type=_positive_int, default=1, help="divide the figures by this (profiled steps)")
    args = parser.parse_args(argv)
    try:
        trace = json.loads(args.trace.read_text())
    except (OSError, json.JSONDecodeError) as err:
        parser.error(f"cannot read a Chrome trace from {args.trace}: {err}")
    report = gpu_idle(trace, top=args.top, min_gap_us=args.min_gap_us, per=args.per)
    print(format_report(report))
    return report or {}


if __name__ == "__main__":
    main()
