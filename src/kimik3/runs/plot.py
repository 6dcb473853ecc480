"""kimik3-plot: a PNG comparing runs, read from their metrics.jsonl.

Two kinds of figure:
  curves  (--x tokens|step|elapsed): one panel per metric (default loss, val_loss, lr,
          tokens_per_s), one line per run, the same colour for a run in every panel;
  sweep   (--x <config key>, e.g. train.lr): one point per run, the objective (or the last value
          of --metric) against that key's value in the run's saved config; a log axis when the
          values span a decade or more; the best run is starred.
Any RUN argument that is not itself a run dir (a sweep dir, outputs/) stands for the runs below it.
Legend labels are the overrides that differ between the plotted runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import textwrap
from pathlib import Path
from typing import Optional, Sequence

from kimik3.runs.metrics import read_events
from kimik3.runs.report import (RUN_FILES, as_number, config_value, find_runs, override_dict,
                                read_overrides, setting, shared_overrides)

CURVE_AXES = ("tokens", "step", "elapsed")
DEFAULT_METRICS = ("loss", "val_loss", "lr", "tokens_per_s")
CURVE_EVENTS = ("train", "eval")
"""The periodic events curves are drawn from (a "skip" event's loss is one step's, not a mean)."""
INSTALL_HINT = "pip install 'kimik3[viz]'"


def expand_runs(paths: Sequence[Path | str]) -> list[Path]:
    """Run dirs named by the arguments: a run dir as is, any other dir as the runs below it."""
    runs: list[Path] = []
    for path in map(Path, paths):
        if not path.is_dir():
            raise ValueError(f"{path} is not a directory (expected a run dir, a sweep dir or outputs/)")
        found = [path] if any((path / f).is_file() for f in RUN_FILES) else find_runs(path)
        if not found:
            raise ValueError(f"no runs under {path} (a run dir holds run.json or metrics.jsonl)")
        runs += [r for r in found if r not in runs]
    return runs


def run_labels(runs: Sequence[Path]) -> list[str]:
    """`key=value` for each key some run overrides differently from the others; the dir name
    when no key differs. A run that does not override such a key shows its recipe value
    (`train.lr=0.003` for a run on the default lr), or `default` for a config group."""
    overrides = [read_overrides(r) for r in runs]
    keys = sorted(_differing_keys(overrides))
    labels = [", ".join(f"{k}={_or_default(setting(run, own, k))}" for k in keys) or _short_name(run)
              for own, run in zip(overrides, runs)]
    # Runs with the same overrides (a repeat) still need distinct entries.
    return [f"{label} ({_short_name(run)})" if labels.count(label) > 1 else label
            for label, run in zip(labels, runs)]


def metric_series(events: list[dict], metric: str, x: str) -> tuple[list[float], list[float]]:
    """(xs, ys) of `metric` from the run's train/eval events; points a resume superseded are dropped.

    A session resumed from step s re-logs steps after s, so on each "resume" event the points
    recorded after step s are discarded and the curve is the trajectory the model really took.
    `elapsed` restarts at 0 in each session's events; on the x axis a session's seconds continue from
    the previous session's last event, so a resumed run's curve runs forward instead of back to 0.
    """
    points: list[tuple[int, float, float]] = []  # (step, x, y)
    offset = seconds = 0.0  # elapsed: the sessions before this one, and up to the latest event
    for event in events:
        if event["event"] == "start":
            offset = seconds
        if "elapsed" in event:
            seconds = offset + float(event["elapsed"])
        if event["event"] == "resume":
            points = [p for p in points if p[0] <= event["step"]]
        elif (event["event"] in CURVE_EVENTS and as_number(event.get(metric)) is not None
              and x in event):
            points.append((event["step"], seconds if x == "elapsed" else float(event[x]), float(event[metric])))
    return [p[1] for p in points], [p[2] for p in points]


def plot_curves(runs: Sequence[Path], metrics: Sequence[str] = DEFAULT_METRICS,
                x: str = "tokens"):
    """One panel per metric, one line per run that logged it. Returns the matplotlib Figure."""
    if x not in CURVE_AXES:
        raise ValueError(f"curve x axis {x!r} is not one of {', '.join(CURVE_AXES)}")
    ncols = 1 if len(metrics) == 1 else 2
    nrows = math.ceil(len(metrics) / ncols)
    fig = _figure(figsize=(6.4 * ncols, 4.2 * nrows))
    from matplotlib.ticker import EngFormatter  # matplotlib is optional: imported once known present

    axes = fig.subplots(nrows, ncols, squeeze=False)
    colors = _colors(len(runs))
    labels = run_labels(runs)
    all_events = [read_events(r) for r in runs]
    for ax, metric in zip(axes.flat, metrics):
        for events, label, color in zip(all_events, labels, colors):
            xs, ys = metric_series(events, metric, x)
            if xs:
                # Sparse metrics (eval) get markers so a single point still shows.
                ax.plot(xs, ys, label=label, color=color, marker="o" if len(xs) < 30 else None,
                        markersize=3)
        ax.set_title(metric)
        ax.set_xlabel(x)
        if x == "tokens":
            ax.xaxis.set_major_formatter(EngFormatter())  # 200k, 1.5M: token counts get long
        ax.grid(alpha=0.3)
        if not ax.lines:
            ax.text(0.5, 0.5, f"no run logged {metric!r}", ha="center", va="center",
                    transform=ax.transAxes)
    for ax in list(axes.flat)[len(metrics):]:
        ax.set_visible(False)
    _add_legend(fig, axes.flat)
    return fig


def plot_sweep(runs: Sequence[Path], param: str, metric: str = "objective"):
    """Objective (or the last logged `metric`) against config key `param`; one point per run.

    Runs without the value (still running, crashed before logging it) are left out. Returns the
    matplotlib Figure; its axes holds one line of all points and one for the starred best.
    """
    points = []
    for run in runs:
        value, y = config_value(run, param), _final(read_events(run), metric)
        if value is not None and y is not None and math.isfinite(y):
            points.append((value, y))
    if not points:
        raise ValueError(f"no run has both {param!r} in .hydra/config.yaml and a finite {metric!r}")
    numeric = all(_float_or_none(v) is not None for v, _ in points)
    points = sorted(((_float_or_none(v) if numeric else str(v), y) for v, y in points),
                    key=lambda p: p[0])
    xs = [v for v, _ in points]
    ys = [y for _, y in points]
    fig = _figure(figsize=(6.4, 4.2))
    ax = fig.subplots()
    # A line through the points reads as "metric as a function of param": only true when
    # nothing else differs between the runs.
    joined = numeric and _differing_keys([read_overrides(r) for r in runs]) <= {param}
    ax.plot(xs, ys, marker="o", linestyle="-" if joined else "none", label="runs")
    best = min(range(len(ys)), key=ys.__getitem__)
    shown = f"{xs[best]:.4g}" if numeric else xs[best]
    ax.plot([xs[best]], [ys[best]], marker="*", markersize=14, linestyle="none", color="crimson",
            label=f"best: {param}={shown}, {metric}={ys[best]:.4f}")
    if numeric and min(xs) > 0 and max(xs) / min(xs) >= 10:
        ax.set_xscale("log")
    ax.set_xlabel(param)
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} vs {param} ({len(points)} of {len(runs)} runs)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def matplotlib_available() -> bool:
    """Whether matplotlib (the optional [viz] extra) is importable."""
    return importlib.util.find_spec("matplotlib") is not None


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="kimik3-plot", description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", metavar="RUN", help="run dirs, sweep dirs or outputs/")
    parser.add_argument("--metric", action="append", default=None,
                        help="metric to plot, repeatable (curves default: loss, val_loss, lr, "
                             "tokens_per_s; sweep default: objective)")
    parser.add_argument("--x", default="tokens",
                        help="tokens, step, elapsed, or a config key such as train.lr (sweep plot)")
    parser.add_argument("--out", default="runs.png", help="PNG path to write (default: runs.png)")
    args = parser.parse_args(argv)
    try:
        runs = expand_runs(args.runs)
        if args.x in CURVE_AXES:
            fig = plot_curves(runs, args.metric or DEFAULT_METRICS, args.x)
        elif args.metric and len(args.metric) > 1:
            raise ValueError(f"--x {args.x} plots one metric; got --metric {' '.join(args.metric)}")
        else:
            fig = plot_sweep(runs, args.x, (args.metric or ["objective"])[0])
        fig.savefig(args.out, dpi=120)
    except (ValueError, OSError, ModuleNotFoundError) as err:  # OSError: --out not writable
        print(f"kimik3-plot: {err}", file=sys.stderr)
        return 1
    print(f"wrote {args.out} ({len(runs)} runs)")
    return 0


def _figure(figsize: tuple[float, float]):
    """A bare matplotlib Figure (no pyplot: no display, no global figure list, PNG via Agg)."""
    if not matplotlib_available():
        raise ModuleNotFoundError(f"matplotlib is not installed: {INSTALL_HINT}")
    from matplotlib.figure import Figure

    return Figure(figsize=figsize)


def _final(events: list[dict], metric: str) -> Optional[float]:
    """The last value of `metric` in the run. The objective only counts from the last session's end
    event, as kimik3-runs reads it: a session resumed after one that finished and then failed (or
    still running) has none, rather than the earlier session's."""
    if metric == "objective":
        return as_number(events[-1].get(metric)) if events and events[-1]["event"] == "end" else None
    return next((as_number(e[metric]) for e in reversed(events)
                 if as_number(e.get(metric)) is not None), None)


def _colors(n: int) -> list:
    """Distinct colours: tab10 up to ten runs, then evenly spaced viridis."""
    import matplotlib

    if n <= 10:
        return [matplotlib.colormaps["tab10"](i) for i in range(n)]
    return [matplotlib.colormaps["viridis"](i / (n - 1)) for i in range(n)]


def _add_legend(fig, axes) -> None:
    """One legend below the panels, one entry per run from whichever panels it appears in.

    Short labels share a row (up to 3); long ones get a row each, wrapped to the figure width.
    """
    entries: dict[str, object] = {}
    for ax in axes:
        for line in ax.lines:
            entries.setdefault(line.get_label(), line)
    width_chars = int(fig.get_figwidth() * 13)  # about 13 characters per inch at fontsize 8
    ncol = 1 if any(len(label) > width_chars // 3 for label in entries) else min(len(entries), 3) or 1
    labels = [textwrap.fill(label, width_chars) for label in entries]
    text_rows = sum(label.count("\n") + 1 for label in labels) if ncol == 1 else math.ceil(len(labels) / ncol)
    legend_height = 0.1 + 0.17 * text_rows  # inches: the figure grows by it, the panels keep theirs
    fig.set_figheight(fig.get_figheight() + legend_height)
    fig.legend(list(entries.values()), labels, loc="lower center", ncol=ncol, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, legend_height / fig.get_figheight(), 1, 1))


def _differing_keys(overrides: list[list[str]]) -> set[str]:
    """Config keys some run overrides differently from the others (one override list per run)."""
    shared = shared_overrides(overrides)
    return set(override_dict([o for own in overrides for o in own if o not in shared]))


def _float_or_none(value) -> Optional[float]:
    """A config value as a number ("1e-3" from YAML 1.1 included); None for text and bools."""
    if isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _or_default(value) -> str:
    return "default" if value is None else str(value)


def _short_name(run: Path) -> str:
    return f"{run.parent.name}/{run.name}"


if __name__ == "__main__":
    sys.exit(main())
