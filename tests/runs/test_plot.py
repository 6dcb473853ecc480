import json

import pytest

from kimik3.runs import plot, report
from kimik3.runs.plot import (expand_runs, main, metric_series, plot_curves, plot_sweep,
                              run_labels)

pytest.importorskip("matplotlib")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_labels_show_only_the_settings_that_differ(tmp_path, make_run):
    a = make_run(tmp_path / "d" / "a", overrides=["model=smoke", "train.lr=1e-3"])
    b = make_run(tmp_path / "d" / "b", overrides=["model=smoke", "train.lr=3e-3", "train.seed=2"])
    c = make_run(tmp_path / "d" / "c", overrides=["model=smoke", "train.lr=3e-3", "train.seed=2"])
    on_default_lr = make_run(tmp_path / "d" / "e", overrides=["model=smoke"], lr=0.003)
    assert run_labels([a, on_default_lr]) == ["train.lr=1e-3", "train.lr=0.003"]  # from its recipe
    # train.seed is in no recipe of these fixtures: "default".
    assert run_labels([a, b]) == ["train.lr=1e-3, train.seed=default", "train.lr=3e-3, train.seed=2"]
    assert run_labels([b]) == ["model=smoke, train.lr=3e-3, train.seed=2"]  # a lone run: all
    assert run_labels([b, c]) == ["d/b", "d/c"]  # nothing differs: the dirs name the runs
    # b and c repeat the same overrides: still two legend entries.
    assert run_labels([a, b, c])[1:] == ["train.lr=3e-3, train.seed=2 (d/b)",
                                         "train.lr=3e-3, train.seed=2 (d/c)"]


def test_series_drops_points_superseded_by_a_resume():
    events = [{"event": "train", "step": s, "tokens": 10 * s, "loss": float(s)} for s in (1, 2, 3)]
    events += [{"event": "resume", "step": 2, "tokens": 20, "from": "checkpoints/step_2"},
               {"event": "skip", "step": 3, "tokens": 30, "loss": 7.0, "reason": "non-finite grad norm"},
               {"event": "train", "step": 3, "tokens": 30, "loss": 0.5},
               {"event": "end", "step": 3, "tokens": 30, "loss": 99.0}]
    assert metric_series(events, "loss", "tokens") == ([10.0, 20.0, 30.0], [1.0, 2.0, 0.5])
    assert metric_series(events, "loss", "step") == ([1.0, 2.0, 3.0], [1.0, 2.0, 0.5])


def test_elapsed_of_a_resumed_session_continues_from_the_session_before():
    """Each session's events count `elapsed` from its own start: session 2 (resumed from step 2)
    must not be drawn back at x = 0."""
    def event(kind, step, elapsed, **fields):
        return {"event": kind, "step": step, "tokens": 10 * step, "elapsed": elapsed, **fields}

    events = [event("start", 0, 0.1), event("train", 1, 1.0, loss=4.0), event("train", 2, 2.0, loss=3.0),
              event("train", 3, 3.0, loss=2.9), event("end", 3, 3.5, status="interrupted"),
              event("start", 2, 0.1), event("resume", 2, 0.1), event("train", 3, 1.0, loss=2.5),
              event("eval", 3, 1.2, val_loss=2.4)]
    assert metric_series(events, "loss", "elapsed") == ([1.0, 2.0, 4.5], [4.0, 3.0, 2.5])
    assert metric_series(events, "val_loss", "elapsed") == ([4.7], [2.4])


def test_curves_one_line_per_run_per_panel(tmp_path, make_run):
    runs = [make_run(tmp_path / name, overrides=[f"train.lr={lr}"], lr=lr)
            for name, lr in [("a", 1e-3), ("b", 3e-3), ("c", 1e-2)]]
    # A run that never evaluated has no val_loss line.
    runs.append(make_run(tmp_path / "d", overrides=["train.lr=0.1"], val_losses=()))
    fig = plot_curves(runs)
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in axes] == ["loss", "val_loss", "lr", "tokens_per_s"]
    assert [len(ax.lines) for ax in axes] == [4, 3, 4, 4]
    assert [line.get_label() for line in axes[0].lines] == [
        "train.lr=0.001", "train.lr=0.003", "train.lr=0.01", "train.lr=0.1"]
    # The same run keeps its colour in every panel.
    assert axes[0].lines[3].get_color() == axes[2].lines[3].get_color()
    assert list(axes[0].lines[0].get_xdata()) == [1024.0, 2048.0, 3072.0]
    assert len(fig.legends[0].get_texts()) == 4


def test_single_metric_and_unknown_axis(tmp_path, make_run):
    run = make_run(tmp_path / "a")
    fig = plot_curves([run], metrics=["grad_norm"], x="step")
    assert len(fig.axes) == 1 and fig.axes[0].get_xlabel() == "step"
    with pytest.raises(ValueError, match="'wall' is not one of tokens, step, elapsed"):
        plot_curves([run], x="wall")


def test_sweep_plot_objective_vs_param_with_log_axis(tmp_path, make_sweep):
    sweep = make_sweep(tmp_path / "sweep", lrs=[1e-2, 1e-4, 1e-3, 3e-3],
                       objectives=[3.4, 3.9, 2.8, None])
    fig = plot_sweep(expand_runs([sweep]), "train.lr")
    ax = fig.axes[0]
    trials, best = ax.lines
    assert list(trials.get_xdata()) == [1e-4, 1e-3, 1e-2]  # sorted; the failed trial left out
    assert list(trials.get_ydata()) == [3.9, 2.8, 3.4]
    assert (list(best.get_xdata()), list(best.get_ydata())) == ([1e-3], [2.8])
    assert ax.get_xscale() == "log"
    assert trials.get_linestyle() == "-"  # only train.lr differs: a curve
    assert best.get_label() == "best: train.lr=0.001, objective=2.8000"


@pytest.mark.parametrize("second_session", ["failed", "running"])
def test_sweep_plot_takes_the_objective_of_the_last_session_only(tmp_path, make_sweep, second_session):
    """Trial 0 finished with the best objective, was resumed, and that session failed (or still runs):
    it has no objective now (kimik3-runs shows '-'), so it is neither plotted nor starred."""
    sweep = make_sweep(tmp_path / "sweep", lrs=[1e-3, 3e-3], objectives=[2.0, 2.9])
    events = [{"event": "start", "step": 3, "tokens": 3072, "time": 0.0, "elapsed": 0.0},
              {"event": "resume", "step": 3, "tokens": 3072, "time": 0.0, "elapsed": 0.0}]
    if second_session == "failed":
        events.append({"event": "end", "step": 3, "tokens": 3072, "time": 1.0, "elapsed": 1.0,
                       "status": "failed", "objective": None})
    with open(sweep / "0" / "metrics.jsonl", "a") as f:
        f.writelines(json.dumps(e) + "\n" for e in events)
    trials, best = plot_sweep(expand_runs([sweep]), "train.lr").axes[0].lines
    assert list(trials.get_xdata()) == [3e-3] and list(best.get_ydata()) == [2.9]
    assert [r.objective for r in report.load_runs(sweep)] == [None, 2.9]


def test_sweep_points_not_joined_when_another_setting_varies(tmp_path, make_run):
    runs = [make_run(tmp_path / str(i), overrides=[f"train.lr={lr}", f"train.warmup_steps={w}"],
                     lr=lr, val_losses=(v,))
            for i, (lr, w, v) in enumerate([(1e-3, 10, 3.0), (2e-3, 50, 2.5), (3e-3, 10, 2.7)])]
    [trials, _] = plot_sweep(runs, "train.lr").axes[0].lines
    assert trials.get_linestyle() == "None" and len(trials.get_xdata()) == 3


def test_sweep_plot_linear_axis_within_a_decade(tmp_path, make_sweep):
    sweep = make_sweep(tmp_path / "sweep", lrs=[1e-3, 3e-3], objectives=[3.0, 2.9])
    fig = plot_sweep(expand_runs([sweep]), "train.lr", metric="val_loss")
    assert fig.axes[0].get_xscale() == "linear"
    with pytest.raises(ValueError, match="no run has both 'train.nope'"):
        plot_sweep(expand_runs([sweep]), "train.nope")


def test_cli_writes_png(tmp_path, make_sweep, make_run, capsys):
    sweep = make_sweep(tmp_path / "sweep", lrs=[1e-4, 1e-3, 1e-2], objectives=[3.5, 2.9, 3.1])
    single = make_run(tmp_path / "single")
    out = tmp_path / "curves.png"
    assert main([str(sweep), str(single), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG_MAGIC
    assert "(4 runs)" in capsys.readouterr().out
    out = tmp_path / "sweep.png"
    assert main([str(sweep), "--x", "train.lr", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_cli_errors_are_one_line(tmp_path, capsys, monkeypatch):
    assert main([str(tmp_path / "missing")]) == 1
    assert capsys.readouterr().err.strip().endswith("is not a directory (expected a run dir, "
                                                    "a sweep dir or outputs/)")
    assert main([str(tmp_path)]) == 1
    assert "no runs under" in capsys.readouterr().err
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "metrics.jsonl").write_text("")
    assert main([str(tmp_path / "r"), "--out", str(tmp_path / "no" / "such" / "dir.png")]) == 1
    assert "No such file or directory" in capsys.readouterr().err
    monkeypatch.setattr(plot, "matplotlib_available", lambda: False)
    assert main([str(tmp_path / "r")]) == 1
    assert capsys.readouterr().err == (
        "kimik3-plot: matplotlib is not installed: pip install 'kimik3[viz]'\n")


def test_sweep_plot_reads_yaml11_numbers_and_text_values(tmp_path, make_run):
    runs = [make_run(tmp_path / str(i), overrides=[f"train.lr={lr}", f"train.schedule={sched}"],
                     val_losses=(v,))
            for i, (lr, sched, v) in enumerate([("1e-3", "cosine", 3.0), ("1e-2", "wsd", 2.5)])]
    for run, (lr, sched) in zip(runs, [("1e-3", "cosine"), ("1e-2", "wsd")]):
        # PyYAML reads 1e-3 (no dot) as text: still a number on the axis.
        (run / "config_resolved.yaml").write_text(f"train:\n  lr: {lr}\n  schedule: {sched}\n")
    ax = plot_sweep(runs, "train.lr").axes[0]
    assert list(ax.lines[0].get_xdata()) == [1e-3, 1e-2] and ax.get_xscale() == "log"
    ax = plot_sweep(runs, "train.schedule").axes[0]
    assert list(ax.lines[0].get_xdata()) == ["cosine", "wsd"]
    assert ax.lines[1].get_label() == "best: train.schedule=wsd, objective=2.5000"
