import json

import pytest

from kimik3.runs.report import (config_value, find_runs, format_table, load_runs, main, matches, run_status,
                                sort_records)


def test_status_rule_end_event_else_file_age():
    end = [{"event": "train"}, {"event": "end", "status": "failed"}]
    assert run_status(end, last_write=0.0, now=1e9, stale_after=600) == "failed"
    live = [{"event": "start"}, {"event": "train"}]
    assert run_status(live, last_write=1000.0, now=1100.0, stale_after=600) == "running"
    assert run_status(live, last_write=1000.0, now=1700.0, stale_after=600) == "crashed"
    assert run_status([], last_write=1000.0, now=5000.0, stale_after=600) == "crashed"


def test_resumed_after_end_reads_as_running():
    events = [{"event": "end", "status": "finished"}, {"event": "start"}, {"event": "resume"}]
    assert run_status(events, last_write=1000.0, now=1001.0, stale_after=600) == "running"


def test_load_runs_summarises_each_run(tmp_path, make_run):
    make_run(tmp_path / "2026-01-01" / "a", overrides=["model=smoke"], losses=(4.0, 3.0),
             val_losses=(3.1,))
    make_run(tmp_path / "2026-01-01" / "b", losses=(5.0, 4.5, 4.2), val_losses=(4.4,),
             status=None, age_s=0)
    make_run(tmp_path / "2026-01-02" / "c", status=None, age_s=3600)
    records = {r.name: r for r in load_runs(tmp_path)}
    assert set(records) == {"2026-01-01/a", "2026-01-01/b", "2026-01-02/c"}
    a = records["2026-01-01/a"]
    assert (a.status, a.steps, a.tokens, a.model, a.run_id) == ("finished", 2, 2048, "smoke", "id-a")
    assert (a.train_loss, a.val_loss, a.overrides) == (3.0, 3.1, ["model=smoke"])
    # Without an end event the last train / eval events give the losses.
    b = records["2026-01-01/b"]
    assert (b.status, b.train_loss, b.val_loss, b.steps) == ("running", 4.2, 4.4, 3)
    assert records["2026-01-02/c"].status == "crashed"
    assert all(r.sweep is None and not r.best for r in records.values())


def test_a_torn_last_line_is_skipped_in_the_listing(tmp_path, make_run):
    run = make_run(tmp_path / "r", status=None, losses=(4.0, 3.5, 3.0), val_losses=(3.2,))
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"event": "train", "step": 4, "tok')
    [record] = load_runs(tmp_path)
    assert (record.status, record.steps, record.train_loss, record.val_loss) == ("running", 3, 3.0, 3.2)


@pytest.mark.parametrize("content", [b"[]", b"null", b"\xff\xfe garbled"], ids=["list", "null", "not-utf8"])
def test_a_damaged_run_json_is_listed_from_its_metrics(tmp_path, make_run, capsys, content):
    """run.json that parses to no object, or is not text at all: the run is still listed (from
    metrics.jsonl and .hydra/) by kimik3-runs and plotted, not a traceback."""
    from kimik3.runs.plot import run_labels

    run = make_run(tmp_path / "r", overrides=["train.lr=0.01"], losses=(4.0, 3.0))
    labels = run_labels([run])
    (run / "run.json").write_bytes(content)
    [record] = load_runs(tmp_path)
    assert (record.status, record.train_loss, record.overrides) == ("finished", 3.0, ["train.lr=0.01"])
    assert main([str(tmp_path)]) == 0 and "finished" in capsys.readouterr().out
    assert run_labels([run]) == labels


def test_find_runs_orders_trials_numerically(tmp_path, make_sweep):
    sweep = make_sweep(tmp_path / "s", lrs=[1e-3] * 12, objectives=[3.0] * 12)
    assert [p.name for p in find_runs(sweep)] == [str(i) for i in range(12)]


def test_overrides_fall_back_to_hydra_dir(tmp_path, make_run):
    run = make_run(tmp_path / "r", overrides=["train.lr=0.01"])
    (run / "run.json").unlink()
    assert find_runs(tmp_path) == [run]
    [record] = load_runs(tmp_path)
    assert record.overrides == ["train.lr=0.01"]
    assert record.model == "smoke"  # from .hydra/config.yaml


def test_sweep_best_trial_is_lowest_finite_objective(tmp_path, make_sweep):
    sweep = make_sweep(tmp_path / "sweep", lrs=[1e-4, 1e-3, 1e-2], objectives=[3.5, 2.9, None])
    records = sort_records(load_runs(sweep), "objective")
    assert [r.name for r in records] == ["1", "0", "2"]  # the failed trial (no objective) last
    assert [r.best for r in records] == [True, False, False]
    assert [r.status for r in records] == ["finished", "finished", "failed"]
    assert all(r.sweep == sweep for r in records)
    table = format_table(records).splitlines()
    assert table[0] == "overrides of every run: model=smoke"  # factored out of the rows
    assert "objective" in table[1]
    assert table[2].startswith("1 *") and table[2].endswith("2.9000     train.lr=0.001")


def test_best_marked_per_sweep_when_listing_outputs(tmp_path, make_sweep, make_run):
    make_sweep(tmp_path / "multirun" / "s1", lrs=[1e-3, 3e-3], objectives=[3.0, 3.2])
    make_sweep(tmp_path / "multirun" / "s2", lrs=[1e-3, 3e-3], objectives=[2.5, 2.4])
    make_run(tmp_path / "single", val_losses=(1.0,))
    best = sorted(r.name for r in load_runs(tmp_path) if r.best)
    assert best == ["multirun/s1/0", "multirun/s2/1"]


def test_sort_descending_and_bad_key(tmp_path, make_run):
    for name, loss in [("a", 3.0), ("b", 1.0), ("c", 2.0)]:
        make_run(tmp_path / name, val_losses=(loss,))
    records = load_runs(tmp_path)
    assert [r.name for r in sort_records(records, "val_loss")] == ["b", "c", "a"]
    assert [r.name for r in sort_records(records, "-val_loss")] == ["a", "c", "b"]
    with pytest.raises(ValueError, match="'loss' is not a column; accepted: run, "):
        sort_records(records, "loss")


def test_cli_sort_takes_a_descending_key_as_its_own_word(tmp_path, make_run, capsys):
    """`--sort -val_loss` as the README writes it (argparse alone reads -val_loss as an option)."""
    for name, loss in [("a", 3.0), ("b", 1.0), ("c", 2.0)]:
        make_run(tmp_path / name, val_losses=(loss,))
    for argv in (["--sort", "-val_loss"], ["--sort=-val_loss"]):
        assert main([str(tmp_path), *argv, "--json"]) == 0
        assert [r["name"] for r in json.loads(capsys.readouterr().out)] == ["a", "c", "b"]


def test_filters_on_column_override_and_substring(tmp_path, make_run):
    make_run(tmp_path / "a", overrides=["model=smoke", "train.lr=1e-3"])
    make_run(tmp_path / "b", overrides=["model=smoke", "train.lr=3e-3"], status=None, age_s=5000)
    a, b = sorted(load_runs(tmp_path), key=lambda r: r.name)
    assert matches(a, "train.lr=0.001") and not matches(b, "train.lr=0.001")  # numeric compare
    assert matches(a, "train.warmup_steps=10")  # not overridden: the recipe's value
    assert not matches(a, "train.nope=1")
    assert matches(b, "status=crashed") and not matches(a, "status=crashed")
    assert matches(a, "1e-3") and not matches(b, "1e-3")  # substring of an override
    assert not matches(a, "lr=1e")  # key=value is an equality, not a substring


def test_cli_table_json_and_filter(tmp_path, make_sweep, capsys):
    sweep = make_sweep(tmp_path / "sweep", lrs=[1e-4, 1e-3], objectives=[3.5, 2.9])
    assert main([str(sweep), "--json", "--filter", "status=finished"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["name"], r["best"], r["objective"]) for r in rows] == [("1", True, 2.9),
                                                                      ("0", False, 3.5)]
    assert main([str(sweep), "--filter", "train.lr=1e-4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and lines[1].startswith("0 ")  # one run: no shared-overrides line


def test_cli_says_when_filters_match_no_run(tmp_path, make_run, capsys):
    """A filter that leaves nothing is named, with the runs it left out: not "no runs", as if the
    directory were empty."""
    make_run(tmp_path / "a", overrides=["train.lr=1e-3"])
    make_run(tmp_path / "b")
    assert main([str(tmp_path), "--filter", "train.lr=5", "--filter", "status=finished"]) == 0
    out, err = capsys.readouterr()
    assert out == ""
    assert err.strip() == f"no run matches --filter train.lr=5 --filter status=finished (2 runs under {tmp_path})"
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty"), "--filter", "x y"]) == 0
    assert capsys.readouterr().err.strip() == f"no runs under {tmp_path / 'empty'}"


def test_cli_on_an_optuna_sweep_prints_its_best(tmp_path, make_sweep, capsys):
    sweep = make_sweep(tmp_path / "sweep", lrs=[1e-4, 1e-3, 3e-3], objectives=[3.5, 2.9, 3.0],
                       optuna=True)
    assert not (sweep / "multirun.yaml").exists()  # the Optuna sweeper writes none
    assert all(r.sweep == sweep for r in load_runs(sweep))  # trials known from .hydra/hydra.yaml
    assert main([str(sweep)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].startswith("1 *")
    assert lines[-1] == "optimization_results.yaml: best_value=2.9 at train.lr=0.001"


def test_cli_prints_the_error_line_of_failed_runs(tmp_path, make_run, capsys):
    make_run(tmp_path / "ok")
    failed = make_run(tmp_path / "bad", status="failed")
    (failed / "error.txt").write_text("ValueError: train.seq_len=1000 exceeds model.max_seq_len=512\n")
    assert main([str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4
    assert lines[-1] == "bad: ValueError: train.seq_len=1000 exceeds model.max_seq_len=512"


def test_cli_rejects_missing_dir(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main([str(tmp_path / "nope")])
    assert "nope is not a directory" in capsys.readouterr().err


def test_config_value_prefers_the_resolved_recipe(tmp_path, make_run):
    run = make_run(tmp_path / "r", lr=1e-3)
    assert config_value(run, "train.lr") == 1e-3  # .hydra/config.yaml
    (run / "config_resolved.yaml").write_text("train:\n  lr: 0.002\n  seed: 7\n")
    assert (config_value(run, "train.lr"), config_value(run, "train.seed")) == (0.002, 7)
    assert config_value(run, "train.nope") is None


def test_id_column_only_when_ids_differ_from_dir_names(tmp_path, make_run):
    make_run(tmp_path / "r")  # fixture run ids are "id-<dir name>"
    assert format_table(load_runs(tmp_path)).split()[:2] == ["run", "id"]
    manifest = json.loads((tmp_path / "r" / "run.json").read_text())
    (tmp_path / "r" / "run.json").write_text(json.dumps({**manifest, "run_id": "r"}))
    assert format_table(load_runs(tmp_path)).split()[:2] == ["run", "model"]


def test_cli_default_scans_outputs_and_multirun(tmp_path, make_run, make_sweep, monkeypatch, capsys):
    make_run(tmp_path / "outputs" / "r1")
    make_sweep(tmp_path / "multirun" / "s", lrs=[1e-3, 1e-2], objectives=[3.0, 2.0])
    make_run(tmp_path / "elsewhere" / "r2")
    monkeypatch.chdir(tmp_path)
    assert main(["--json"]) == 0
    names = sorted(r["name"] for r in json.loads(capsys.readouterr().out))
    assert names == ["multirun/s/0", "multirun/s/1", "outputs/r1"]
    monkeypatch.chdir(tmp_path / "elsewhere")
    with pytest.raises(SystemExit):
        main([])
    assert "no outputs or multirun dir here" in capsys.readouterr().err


def test_error_line_is_the_last_sessions_and_only_while_it_failed(tmp_path, make_run, capsys):
    """error.txt keeps one line per failed or interrupted session, also after a resume that finished."""
    resumed = make_run(tmp_path / "resumed", status="finished")
    (resumed / "error.txt").write_text("2026-01-01T00:00:00+0000 interrupted (SIGTERM); continue with ...\n")
    failed_twice = make_run(tmp_path / "twice", status="failed")
    (failed_twice / "error.txt").write_text("2026-01-01T00:00:00+0000 first failure\n"
                                            "2026-01-02T00:00:00+0000 second failure\n")
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "twice: 2026-01-02T00:00:00+0000 second failure"
    assert not any(line.startswith("resumed:") for line in out)
    assert {r.name: r.error for r in load_runs(tmp_path)}["resumed"] is None


def test_a_diverged_loss_keeps_its_column_narrow(tmp_path, make_run):
    make_run(tmp_path / "ok", losses=(4.0, 3.5))
    make_run(tmp_path / "diverged", losses=(4.0, 1.5875282322204455e35), status="failed")
    header, *lines = format_table(load_runs(tmp_path)).splitlines()
    column = header.split().index("train_loss")
    rows = {line.split()[0]: line.split() for line in lines}
    assert rows["diverged"][column] == "1.588e+35" and rows["ok"][column] == "3.5000"
