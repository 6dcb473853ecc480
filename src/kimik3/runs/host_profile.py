"""Where a step's host time goes: the collector's pauses, the heaviest functions, Triton launches by call site.

Why: where the host sets a step's pace (kimik3.runs.gpu_idle finds the GPU waiting for launches),
kernel times say nothing about the step's speed; the host's own time does. This runs a few steps
under cProfile with a hook on Python's garbage collector and reports, per step:

- the collections of each generation, and how long they paused the host (a full collection walks
  every tracked object: trainer.freeze_startup_objects keeps the start-up ones out of it);
- the functions with the most time of their own, and the kimik3 functions with the most time
  including what they call;
- the Triton kernel launches by the call site that issued them (Triton's Python launcher is a
  large share of a launch's host cost), so a fused or batched launch shows up as fewer of them.

cProfile slows Python code down (a step took ~1.4x as long under it on the H100 machine's host),
so its milliseconds rank the costs rather than measure them; time the step without it for that
(`benchmarks/train_step.py` at a short sequence, where the host alone sets the pace).
"""

from __future__ import annotations

import cProfile
import gc
import pstats
import time
from collections import defaultdict
from pathlib import PurePath
from typing import Callable

_TRITON_LAUNCHERS = (("runtime", "jit.py"), ("runtime", "interpreter.py"))
"""Files (last two path parts) whose `run` launches a Triton kernel: JITFunction.run on a GPU,
InterpretedFunction.run under TRITON_INTERPRET=1. Both are reached through `kernel[grid](...)`."""

FunctionKey = tuple[str, int, str]  # pstats' (file, line, function name)


def _in_package(key: FunctionKey, package: str) -> bool:
    return package in PurePath(key[0]).parts


def _label(key: FunctionKey) -> str:
    """'ops/cast_kernels.py:59(_cast)': the path from the package directory on, or the bare file."""
    parts = PurePath(key[0]).parts
    start = next((i + 1 for i, part in enumerate(parts) if part in ("kimik3", "triton", "torch")), len(parts) - 1)
    return f"{'/'.join(parts[start:]) or key[0]}:{key[1]}({key[2]})"


def _launch_sites(stats: dict) -> dict[FunctionKey, int]:
    """Triton launches per call site outside the triton package: each launcher's callers are walked
    up through triton's own frames (the `kernel[grid]` lambda) to the first frame outside it."""
    sites: dict[FunctionKey, int] = defaultdict(int)

    def charge(key: FunctionKey, seen: frozenset) -> None:
        for caller, (_, calls, _, _) in stats.get(key, (0, 0, 0, 0, {}))[4].items():
            if not _in_package(caller, "triton"):
                sites[caller] += calls
            elif caller not in seen:
                charge(caller, seen | {caller})

    for key in stats:
        if key[2] == "run" and PurePath(key[0]).parts[-2:] in _TRITON_LAUNCHERS and _in_package(key, "triton"):
            charge(key, frozenset({key}))
    return sites


def host_profile(step: Callable[[int], None], first: int, steps: int, top: int = 12) -> dict:
    """Run step(first) .. step(first + steps - 1) under cProfile and a collector hook; the per-step
    report the module docstring describes (milliseconds and counts per step)."""
    pauses: dict[int, list[float]] = defaultdict(list)
    started: dict[str, float] = {}

    def on_collect(phase: str, info: dict) -> None:
        if phase == "start":
            started["t"] = time.perf_counter()
        elif "t" in started:
            pauses[info["generation"]].append(time.perf_counter() - started.pop("t"))

    profiler = cProfile.Profile()
    gc.callbacks.append(on_collect)
    t0 = time.perf_counter()
    try:
        profiler.enable()
        for i in range(steps):
            step(first + i)
        profiler.disable()
    finally:
        gc.callbacks.remove(on_collect)
    wall = time.perf_counter() - t0
    stats = pstats.Stats(profiler).stats
    ms = lambda seconds: round(seconds * 1e3 / steps, 3)  # noqa: E731
    per_step = lambda n: round(n / steps, 2)  # noqa: E731

    def rows(keys: list[FunctionKey]) -> list[dict]:
        return [{"function": _label(k), "calls": per_step(stats[k][1]), "own_ms": ms(stats[k][2]),
                 "cumulative_ms": ms(stats[k][3])} for k in keys]

    own = sorted(stats, key=lambda k: -stats[k][2])[:top]
    ours = sorted((k for k in stats if _in_package(k, "kimik3")), key=lambda k: -stats[k][3])[:top]
    sites = _launch_sites(stats)
    return {
        "steps": steps,
        "profiled_ms": ms(wall),
        "collections": {f"gen{g}": {"count": per_step(len(p)), "ms": ms(sum(p)), "max_ms": round(max(p) * 1e3, 3)}
                        for g, p in sorted(pauses.items())},
        "top_own_time": rows(own),
        "top_kimik3_cumulative": rows(ours),
        "triton_launches": per_step(sum(sites.values())),
        "triton_launch_sites": [{"site": _label(k), "launches": per_step(n)}
                                for k, n in sorted(sites.items(), key=lambda kv: -kv[1])[:top]],
    }


def format_report(report: dict) -> str:
    """A few readable lines of host_profile's report."""
    gcs = ", ".join(f"{g} {c['count']:g}x {c['ms']:.2f} ms (max {c['max_ms']:.1f})"
                    for g, c in report["collections"].items()) or "none"
    lines = [f"host under cProfile {report['profiled_ms']:.1f} ms/step; collections per step: {gcs}; "
             f"Triton launches per step {report['triton_launches']:g}"]
    lines += [f"  {s['launches']:8g} launches  {s['site']}" for s in report["triton_launch_sites"][:5]]
    lines += [f"  {f['cumulative_ms']:8.2f} ms cumulative  {f['function']}" for f in report["top_kimik3_cumulative"][:5]]
    return "\n".join(lines)
