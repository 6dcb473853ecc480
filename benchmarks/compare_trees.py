"""Time two or more source trees of kimik3 with one benchmark script, alternated in one call.

    python benchmarks/compare_trees.py --tree base=facabc4 --tree new=. --rounds 2 \\
        -- kda_kernels.py --no-fla --ref-max-tokens 0 --iters 20
    python benchmarks/compare_trees.py --tree base=/tmp/base --tree new=. -- train_step.py --model kda_dense_1b

Why: the H200's speed drifts by a few percent between calls (the dense 8K step read 35,459 and
36,242 tokens/s for one build in two calls), as much as most changes are worth. So a change is only
judged beside the version it replaces, in the same call, each build run in turn in its own process
(`ABBA` order over rounds, so neither always runs first on a cold card). Every figure of the README
that says "alternated in one call" was taken this way.

A tree is NAME=PATH (a directory holding `src/kimik3` and `benchmarks/`) or NAME=REV (a git revision
of this checkout, exported with `git archive` into --workdir; `--export-only` stops there, to carry
the exported trees to a machine without the repository's history). Each run is
`python <tree>/benchmarks/SCRIPT ARGS --out <json>` with `<tree>/src` first on PYTHONPATH and the tree
as working directory; its output goes to a log file beside the JSON. The summary takes every numeric
leaf of the JSON that matches --keys (defaults per script below), averages it over rounds per tree,
and prints each tree's mean as a ratio to the first tree's.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

REPO = Path(__file__).resolve().parents[1]
DEFAULT_KEYS = {
    "kda_kernels.py": ["bench.*.triton.fwd_ms", "bench.*.triton.fwdbwd_ms", "bench.*.triton.fwd_queued_ms",
                       "check.*.rel_rms.*", "profile.kernel_ms.*.ms_per_iteration", "sweep.*.fwdbwd_ms"],
    "train_step.py": ["ours.tokens_per_s", "ours.step_ms", "ours.peak_gib", "ours.first_step_s"],
    "memory_bound_ops.py": ["ops.*.fwd_ms", "ops.*.bwd_ms", "ops.*.per_step_ms"],
}
"""Which JSON leaves the summary reports, per script (fnmatch patterns over dotted paths)."""


_LABELS = {"B", "T", "H", "D", "override"}
"""Keys that name a row (its shape, its launch-config override) rather than measure it."""


def leaves(node: Any, path: str = "") -> Iterator[tuple[str, float]]:
    """(dotted path, value) for every number in a JSON tree. A list element that names a KDA shape
    (keys B, T, H, D) is labelled by it, e.g. `bench.1x8192x32x128.triton.fwd_ms`, so rows line up
    by shape rather than by position; a check row also by its gate form and implementation, a sweep
    row by its launch-config override (`sweep.dwy_warps=8.fwdbwd_ms`)."""
    if isinstance(node, bool):
        return
    if isinstance(node, (int, float)):
        yield path, float(node)
    elif isinstance(node, dict):
        for key, value in node.items():
            if key not in _LABELS:
                yield from leaves(value, f"{path}.{key}" if path else str(key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            label = str(i)
            if isinstance(value, dict) and all(k in value for k in "BTHD"):
                label = "x".join(str(value[k]) for k in "BTHD")
                label += "".join(f"-{value[k]}" for k in ("form", "impl") if k in value)
            elif isinstance(value, dict) and isinstance(value.get("override"), dict):  # a --sweep row
                label = ",".join(f"{k}={v}" for k, v in value["override"].items()) or "default"
            yield from leaves(value, f"{path}.{label}")


def summarize(runs: dict[str, list[dict]], patterns: list[str]) -> dict[str, dict]:
    """{key: {tree: {"rounds": [...], "mean": m, "vs_first": m / first tree's mean}}} over the leaves
    matching `patterns`."""
    trees = list(runs)
    table: dict[str, dict] = {}
    for tree in trees:
        for result in runs[tree]:
            for key, value in leaves(result):
                if any(fnmatch.fnmatchcase(key, p) for p in patterns):
                    table.setdefault(key, {}).setdefault(tree, {"rounds": []})["rounds"].append(value)
    for key, per_tree in table.items():
        for entry in per_tree.values():
            entry["mean"] = statistics.fmean(entry["rounds"])
        first = per_tree.get(trees[0], {}).get("mean")
        for entry in per_tree.values():
            entry["vs_first"] = entry["mean"] / first if first else None
    return table


def format_table(table: dict[str, dict], trees: list[str]) -> str:
    """One line per metric: each tree's mean over rounds, and for the others their ratio to the first's."""
    lines = [f"{'metric':56s}" + "".join(f"{t:>22s}" for t in trees)]
    for key, per_tree in table.items():
        cells = []
        for i, tree in enumerate(trees):
            entry = per_tree.get(tree)
            text = "-" if entry is None else f"{entry['mean']:.4g}"
            if i > 0 and entry is not None and entry["vs_first"] is not None:
                text += f" ({entry['vs_first']:.3f}x)"
            cells.append(f"{text:>22s}")
        lines.append(f"{key:56s}" + "".join(cells))
    return "\n".join(lines)


def parse_tree(spec: str) -> tuple[str, str]:
    name, sep, where = spec.partition("=")
    if not sep or not name or not where:
        raise ValueError(f"--tree {spec!r}: expected NAME=PATH or NAME=REV, e.g. base=facabc4 or new=.")
    return name, where


def resolve_tree(name: str, where: str, workdir: Path) -> Path:
    """The tree's directory: `where` itself when it is one, else the git revision `where` exported."""
    path = Path(where)
    if path.is_dir():
        if not (path / "src" / "kimik3").is_dir() or not (path / "benchmarks").is_dir():
            raise ValueError(f"--tree {name}={where}: {path} holds no src/kimik3 and benchmarks/ (a kimik3 tree)")
        return path.resolve()
    rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", "--quiet", f"{where}^{{commit}}"],
                         capture_output=True, text=True)
    if rev.returncode != 0:
        raise ValueError(f"--tree {name}={where}: neither a directory nor a git revision of {REPO}")
    out = workdir / name
    if out.exists():
        raise ValueError(f"--tree {name}={where}: {out} exists already; pick another --workdir or remove it")
    out.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev.stdout.strip(), "src", "benchmarks", "conf",
                              "pyproject.toml"], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    return out


def run_once(tree: Path, script: str, args: list[str], out_json: Path, log: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tree / "src"), env.get("PYTHONPATH")) if p)
    with open(log, "w") as fh:
        done = subprocess.run([sys.executable, str(tree / "benchmarks" / script), *args, "--out", str(out_json)],
                              cwd=tree, env=env, stdout=fh, stderr=subprocess.STDOUT)
    if done.returncode != 0 or not out_json.exists():
        tail = "".join(log.read_text().splitlines(keepends=True)[-15:])
        raise RuntimeError(f"{script} in {tree} exited with status {done.returncode}; last lines of {log}:\n{tail}")
    return json.loads(out_json.read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                usage="%(prog)s --tree NAME=PATH|REV [--tree ...] [options] -- SCRIPT [ARGS ...]")
    p.add_argument("--tree", action="append", default=[], help="NAME=PATH or NAME=REV; the first is the baseline")
    p.add_argument("--rounds", type=int, default=2, help="runs of each tree, alternated ABBA")
    p.add_argument("--keys", nargs="+", default=None, help="fnmatch patterns of the JSON leaves to report")
    p.add_argument("--workdir", type=Path, default=None, help="exported trees, JSON and logs (default: a temp dir)")
    p.add_argument("--export-only", action="store_true", help="export the revisions into --workdir and stop")
    p.add_argument("--out", type=Path, default=None, help="write the runs and the summary as JSON here")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- SCRIPT [ARGS]: a script under benchmarks/")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.export_only and args.workdir is None:
        p.error("--export-only needs --workdir (where the exported trees should stay)")
    if not args.export_only and (not command or command[0] not in DEFAULT_KEYS and args.keys is None):
        p.error(f"after --, name the benchmark script: one of {sorted(DEFAULT_KEYS)} (or any other with --keys)")
    if len(args.tree) < (1 if args.export_only else 2):
        p.error(f"need two or more --tree to compare, got {len(args.tree)}")
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="compare_trees_"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        specs = [parse_tree(s) for s in args.tree]
        if len({n for n, _ in specs}) != len(specs):
            raise ValueError(f"--tree names must differ, got {[n for n, _ in specs]}")
        trees = {name: resolve_tree(name, where, workdir) for name, where in specs}
    except (ValueError, subprocess.CalledProcessError) as e:
        p.error(str(e))
    if args.export_only:
        print("\n".join(f"{name}: {path}" for name, path in trees.items()))
        return 0
    script, script_args = command[0], command[1:]
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    names = list(trees)
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else reversed(names):
            started = time.time()
            stem = workdir / f"{name}-round{r}"
            try:
                result = run_once(trees[name], script, script_args, stem.with_suffix(".json"), stem.with_suffix(".log"))
            except RuntimeError as e:
                print(f"compare_trees: {e}", file=sys.stderr)
                return 1
            runs[name].append(result)
            print(f"round {r} {name}: {time.time() - started:.0f} s", file=sys.stderr, flush=True)
    table = summarize(runs, args.keys or DEFAULT_KEYS[script])
    print(format_table(table, names))
    if args.out is not None:
        args.out.write_text(json.dumps({"trees": {n: str(t) for n, t in trees.items()}, "script": script,
                                        "args": script_args, "rounds": args.rounds, "summary": table,
                                        "runs": runs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
