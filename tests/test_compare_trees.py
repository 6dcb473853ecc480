"""benchmarks/compare_trees.py: alternated runs of several trees, their summary, and its errors."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import shutil
import subprocess

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location("compare_trees", REPO / "benchmarks" / "compare_trees.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_leaves_label_kda_rows_by_shape_and_skip_flags() -> None:
    ct = _load()
    result = {"bench": [{"B": 1, "T": 8192, "H": 32, "D": 128, "triton": {"fwd_ms": 1.5, "note": None}},
                        {"B": 4, "T": 4096, "H": 32, "D": 128, "triton": {"fwd_ms": 2.7}}],
              "check": [{"impl": "triton", "B": 1, "T": 64, "H": 2, "D": 16, "form": "bounded", "ok": True,
                         "rel_rms": {"o": 3e-3}}]}
    got = dict(ct.leaves(result))
    assert got["bench.1x8192x32x128.triton.fwd_ms"] == 1.5
    assert got["bench.4x4096x32x128.triton.fwd_ms"] == 2.7
    assert got["check.1x64x2x16-bounded-triton.rel_rms.o"] == 3e-3
    assert not any(k.endswith(".ok") for k in got)  # booleans are not measurements
    sweep = {"sweep": [{"override": {}, "fwdbwd_ms": 5.7}, {"override": {"dwy_warps": 8}, "fwdbwd_ms": 5.9}]}
    assert dict(ct.leaves(sweep)) == {"sweep.default.fwdbwd_ms": 5.7, "sweep.dwy_warps=8.fwdbwd_ms": 5.9}


def test_summarize_averages_rounds_and_divides_by_the_first_tree() -> None:
    ct = _load()
    runs = {"base": [{"ours": {"tokens_per_s": 100.0, "step_ms": 10.0}}, {"ours": {"tokens_per_s": 110.0,
                                                                              "step_ms": 9.0}}],
            "new": [{"ours": {"tokens_per_s": 126.0, "step_ms": 8.0}}, {"ours": {"tokens_per_s": 126.0,
                                                                             "step_ms": 8.0}}]}
    table = ct.summarize(runs, ["ours.tokens_per_s"])
    assert list(table) == ["ours.tokens_per_s"]  # step_ms not asked for
    assert table["ours.tokens_per_s"]["base"] == {"rounds": [100.0, 110.0], "mean": 105.0, "vs_first": 1.0}
    assert table["ours.tokens_per_s"]["new"]["vs_first"] == pytest.approx(1.2)
    text = ct.format_table(table, ["base", "new"])
    assert "126 (1.200x)" in text and "105" in text


def test_runs_each_tree_alternately_and_reports_the_trainer_step(tmp_path: pathlib.Path) -> None:
    """Two trees (this checkout under two names) through benchmarks/train_step.py on the CPU, two rounds."""
    ct = _load()
    out = tmp_path / "compare.json"
    assert ct.main(["--tree", "a=" + str(REPO), "--tree", "b=" + str(REPO), "--rounds", "2",
                    "--workdir", str(tmp_path / "work"), "--out", str(out), "--", "train_step.py",
                    "--model", "kimi_k3_tiny", "--seq", "64", "--warmup", "1", "--steps", "1",
                    "train.device=cpu"]) == 0
    report = json.loads(out.read_text())
    assert [len(report["runs"][t]) for t in ("a", "b")] == [2, 2]
    tokens = report["summary"]["ours.tokens_per_s"]
    for tree in ("a", "b"):
        rounds = [r["ours"]["tokens_per_s"] for r in report["runs"][tree]]
        assert tokens[tree]["rounds"] == rounds and tokens[tree]["mean"] == pytest.approx(sum(rounds) / 2)
    assert tokens["b"]["vs_first"] == pytest.approx(tokens["b"]["mean"] / tokens["a"]["mean"])
    # ABBA: round 0 runs a then b, round 1 b then a, each writing its JSON and log
    logs = sorted((tmp_path / "work").glob("*.log"), key=lambda p: p.stat().st_mtime_ns)
    assert [p.stem for p in logs] == ["a-round0", "b-round0", "b-round1", "a-round1"]


def test_a_failing_run_stops_with_its_log_tail(tmp_path: pathlib.Path, capsys) -> None:
    ct = _load()
    code = ct.main(["--tree", "a=" + str(REPO), "--tree", "b=" + str(REPO), "--rounds", "1",
                    "--workdir", str(tmp_path), "--", "train_step.py", "--steps", "0"])
    err = capsys.readouterr().err
    assert code == 1
    assert "train_step.py in" in err and "exited with status 2" in err and "--steps=0" in err


@pytest.mark.parametrize("trees,message", [
    (["base", "b=."], "expected NAME=PATH or NAME=REV"),
    (["a=."], "need two or more --tree"),
    (["a=.", "a=."], "--tree names must differ"),
    (["a=no-such-rev-or-dir", "b=."], "neither a directory nor a git revision"),
])
def test_bad_tree_specs_are_one_line_errors(trees, message, capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(REPO)
    args = [a for t in trees for a in ("--tree", t)]
    with pytest.raises(SystemExit) as exit_info:
        _load().main([*args, "--workdir", str(tmp_path), "--", "train_step.py"])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("git") is None or not (REPO / ".git").exists(), reason="needs this git checkout")
def test_export_only_writes_the_revision_tree(tmp_path: pathlib.Path) -> None:
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    assert _load().main(["--tree", f"head={head}", "--workdir", str(tmp_path), "--export-only"]) == 0
    exported = tmp_path / "head"
    committed = subprocess.run(["git", "-C", str(REPO), "show", f"{head}:pyproject.toml"], capture_output=True,
                               text=True, check=True).stdout
    assert (exported / "pyproject.toml").read_text() == committed
    assert (exported / "src" / "kimik3" / "__init__.py").is_file() and (exported / "benchmarks").is_dir()
    assert (exported / "conf" / "model").is_dir() and not (exported / "tests").exists()
    with pytest.raises(SystemExit):  # the tree is there already: refused, not overwritten
        _load().main(["--tree", f"head={head}", "--workdir", str(tmp_path), "--export-only"])
