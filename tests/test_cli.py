"""kimik3-train end to end: bad input, run dirs, resume in place, reproduce, sweeps.

Most cases call `kimik3.train.main()` in this process (no interpreter start-up per case); the
console script itself, reproduce and a sweep run as real subprocesses.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from kimik3.models import build_model
from kimik3.runs.metrics import read_events
from kimik3.runs.session import compile_blocks
from kimik3.train import main, run, seed_everything


def kimik3_train(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """Run main() with `args` as the command line; (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["kimik3-train", *args])
    try:
        main()
        code = 0
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def losses(run_dir: Path) -> list[float]:
    return [e["loss"] for e in read_events(run_dir) if e["event"] == "train"]


@pytest.fixture
def smoke(tiny_train, embedded_data) -> list[str]:
    return ["model=smoke", *tiny_train]


@pytest.mark.parametrize("args, message", [
    (["train.lrr=1"], "Could not override 'train.lrr'.* Key 'lrr' not in 'TrainConfig'"),
    (["train.lr=abc"], "Value 'abc' of type 'str' could not be converted to Float"),
    (["train.lr=[1"], "no viable alternative at input"),
    (["model=nope"], "Could not find 'model/nope'"),
    (["train.seq_len=5000"], "train.seq_len=5000 exceeds model.max_seq_len=4096"),
    (["train.precision=fp16"], r"train.precision='fp16' is not one of \['auto', 'fp32', 'bf16'\]"),
    (["data.prepared_dir=/nonexistent/prepared"], "prepared dir /nonexistent/prepared does not exist"),
    (["model.vocab_size=300"], "model.vocab_size=300 does not match the dataset vocab 257"),
    (["train.resume=/nonexistent/run"], "train.resume=/nonexistent/run: no such checkpoint file or run dir"),
], ids=["typo-key", "bad-type", "bad-grammar", "unknown-group-option", "seq-len", "choice", "missing-data",
        "wrong-vocab", "missing-checkpoint"])
def test_bad_input_is_one_line_and_leaves_no_run_dir(monkeypatch, capsys, tmp_path, smoke, args, message):
    run_dir = tmp_path / "run"
    code, _, err = kimik3_train(monkeypatch, capsys, *smoke, *args, f"hydra.run.dir={run_dir}")
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kimik3-train: error: "), err
    assert re.search(message, lines[0]), lines[0]
    assert not run_dir.exists()


@pytest.mark.parametrize("args, key", [([], "hydra.run.dir"), (["-m", "train.lr=1e-3,2e-3"], "hydra.sweep.dir")],
                         ids=["run", "sweep"])
def test_an_output_dir_that_cannot_be_written_is_one_line_before_hydra_makes_it(monkeypatch, capsys, tmp_path, smoke,
                                                                               args, key):
    """A read-only mount (or, for anyone but root, a dir without write permission) where the run or sweep
    dir would go: one line naming it, not Hydra's mkdir traceback. The probe is a nameless temp file,
    which fails here as on a read-only mount (this test may run as root, whom mode bits do not stop)."""
    locked = tmp_path / "locked"
    locked.mkdir()
    real = tempfile.TemporaryFile

    def temporary_file(*a, dir=None, **kw):
        if dir is not None and Path(dir).resolve() == locked:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        return real(*a, dir=dir, **kw)

    monkeypatch.setattr(tempfile, "TemporaryFile", temporary_file)
    code, _, err = kimik3_train(monkeypatch, capsys, *args, *smoke, f"{key}={locked}/new/run")
    assert code == 1 and err.splitlines() == [
        f"kimik3-train: error: {key}={locked}/new/run: cannot write in {locked} (Read-only file system); "
        f"pick a writable {key}"], err
    assert list(locked.iterdir()) == []


def test_data_without_a_val_split_is_one_line_naming_val_fraction(monkeypatch, capsys, tmp_path, smoke):
    """kimik3-prepare accepts data.val_fraction=0 (all tokens to train); training, which evaluates on
    the val split, refuses it at launch, naming the setting (not the batch size)."""
    text = tmp_path / "c.txt"
    text.write_text("the quick brown fox\n" * 100)
    run_dir = tmp_path / "run"
    code, _, err = kimik3_train(monkeypatch, capsys, *smoke, f"data.source={text}", "data.val_fraction=0",
                                f"data.prepared_dir={tmp_path / 'data'}", f"hydra.run.dir={run_dir}")
    assert code == 1 and err.splitlines()[-1] == (  # after the preparation's progress bar
        f"kimik3-train: error: the val split of {tmp_path / 'data'} is empty (prepared with data.val_fraction=0.0) "
        "and training evaluates on it; prepare the data with data.val_fraction > 0 (the default is 0.05)")
    assert not run_dir.exists()


def test_unreadable_checkpoint_is_one_line(monkeypatch, capsys, tmp_path, smoke):
    bad = tmp_path / "step-000001.pt"
    bad.write_bytes(b"\x00garbage")
    code, _, err = kimik3_train(monkeypatch, capsys, *smoke, f"train.resume={bad}", f"hydra.run.dir={tmp_path / 'r'}")
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and lines[0].startswith(f"kimik3-train: error: cannot read checkpoint {bad}: ")
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("damage, problem", [
    (lambda text: text[:200], "not readable JSON (Expecting ',' delimiter)"),
    (lambda text: "[]", "not a run manifest (a JSON object with run_id and sessions)"),
], ids=["cut-off", "not-a-manifest"])
def test_a_damaged_run_json_is_one_line_naming_it_and_the_way_on(monkeypatch, capsys, tmp_path, smoke, damage,
                                                                 problem):
    """run.json cut off or edited: resuming the run is refused with one line naming the file (json's
    own error names neither it nor a way on), the run dir is left as it was, and the way on the line
    gives (a new run from one of its checkpoints) works."""
    run = tmp_path / "run"
    code, _, err = kimik3_train(monkeypatch, capsys, *smoke, "train.max_steps=2", f"hydra.run.dir={run}")
    assert code == 0, err
    manifest = run / "run.json"
    manifest.write_text(damage(manifest.read_text()))
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    code, _, err = kimik3_train(monkeypatch, capsys, f"train.resume={run}")
    assert code == 1 and err.splitlines() == [
        f"kimik3-train: error: {manifest} is {problem}; restore it, or start a new run from one of the run's "
        f"checkpoints (train.resume={run}/checkpoints/<step> hydra.run.dir=<new dir>)"], err
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before
    code, _, err = kimik3_train(monkeypatch, capsys, f"train.resume={run}/checkpoints/step-000002.pt",
                                "train.max_steps=4", f"hydra.run.dir={tmp_path / 'new'}")
    assert code == 0, err


def test_default_run_dirs_resume_in_place_and_refuse_reuse(monkeypatch, capsys, tmp_path, smoke):
    monkeypatch.chdir(tmp_path)
    code, out, _ = kimik3_train(monkeypatch, capsys, *smoke, "train.max_tokens=256")  # stops after step 4
    assert code == 0 and "plumbing check" in out
    (first,) = (tmp_path / "outputs").iterdir()
    code, _, _ = kimik3_train(monkeypatch, capsys, *smoke)
    (second,) = set((tmp_path / "outputs").iterdir()) - {first}  # same second or not: a dir of its own
    saved_overrides = (first / ".hydra" / "overrides.yaml").read_text()

    code, _, err = kimik3_train(monkeypatch, capsys, "train.resume=" + str(first), "train.max_tokens=null")
    assert code == 0, err
    manifest = json.loads((first / "run.json").read_text())
    assert [s["step"] for s in manifest["sessions"]] == [4, 8]
    assert manifest["sessions"][1]["resumed_from"].endswith("checkpoints/step-000004.pt")
    assert (first / ".hydra" / "overrides.yaml").read_text() == saved_overrides  # first session's record kept
    session_2 = OmegaConf.load(first / ".hydra" / "session-2" / "overrides.yaml")
    assert "model=smoke" in session_2 and f"train.resume={first}" in session_2
    assert losses(first) == losses(second)  # 4 + 4 steps == 8 straight

    code, _, err = kimik3_train(monkeypatch, capsys, *smoke, f"hydra.run.dir={second}")
    assert code == 1 and "already holds a run" in err
    assert json.loads((second / "run.json").read_text())["sessions"][0]["step"] == 8


def test_sweep_jobs_share_nothing_and_a_failed_job_does_not_stop_the_sweep(monkeypatch, capsys, tmp_path, smoke):
    sweep = tmp_path / "sweep"
    code, _, err = kimik3_train(monkeypatch, capsys, "-m", *smoke, "train.lr=-1,3e-3,3e-3",
                                f"hydra.sweep.dir={sweep}", "train.deterministic=true")
    assert code == 1 and err.splitlines()[-1] == (
        f"kimik3-train: error: 1 of 3 trial(s) of the sweep failed: 0 in {sweep} "
        "(the reason is in each trial's error.txt or train.log)")
    assert "kimik3-train: error: train.lr=-1.0 must be > 0" in err
    failed = read_events(sweep / "0")
    assert failed[-1]["event"] == "end" and failed[-1]["status"] == "failed"
    assert "train.lr=-1.0" in (sweep / "0" / "error.txt").read_text()
    assert losses(sweep / "1") == losses(sweep / "2")  # same recipe in one process: same trajectory
    ids = {json.loads((sweep / j / "run.json").read_text())["run_id"] for j in ("1", "2")}
    assert ids == {"sweep_1", "sweep_2"}
    seed_everything(0, False)
    assert not torch.are_deterministic_algorithms_enabled()


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    script = Path(sys.executable).with_name("kimik3-train")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "kimik3.train"]
    return subprocess.run([*cmd, *args], cwd=cwd, capture_output=True, text=True, timeout=300, env=os.environ.copy())


@pytest.mark.slow
def test_reproduce_from_saved_hydra_dir_gives_the_same_recipe_and_losses(monkeypatch, capsys, tmp_path, smoke):
    monkeypatch.chdir(tmp_path)
    code, _, err = kimik3_train(monkeypatch, capsys, *smoke, "train.lr=2e-3", "hydra.run.dir=a")
    assert code == 0, err
    again = _cli("--config-path", "a/.hydra", "--config-name", "config", "hydra.run.dir=b", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    a, b = tmp_path / "a", tmp_path / "b"
    assert (a / "config_resolved.yaml").read_text() == (b / "config_resolved.yaml").read_text()
    assert losses(a) == losses(b) and len(losses(a)) == 4
    assert json.loads((a / "run.json").read_text())["config_hash"] == json.loads((b / "run.json").read_text())["config_hash"]
    code, _, err = kimik3_train(monkeypatch, capsys, "--config-path", "a/.hydra", "--config-name", "config",
                                "train.lr=1e-2", "hydra.run.dir=c")
    assert code == 1 and not (tmp_path / "c").exists()
    assert err.strip() == f"kimik3-train: error: reproduce from {a}: the recipe differs at train.lr (saved 0.002, now 0.01)"


@pytest.mark.slow
def test_two_job_sweep_in_sweep_subdirs(tmp_path, smoke):
    done = _cli("-m", *smoke, "train.lr=1e-3,3e-3", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    (sweep,) = (tmp_path / "multirun").iterdir()
    for job, lr in (("0", 1e-3), ("1", 3e-3)):
        assert OmegaConf.load(sweep / job / "config_resolved.yaml").train.lr == lr
        assert read_events(sweep / job)[-1]["status"] == "finished"
    assert (sweep / "multirun.yaml").is_file()


def test_resume_into_another_dir_is_a_new_run_and_naming_the_same_dir_stays_in_place(monkeypatch, capsys, tmp_path,
                                                                                       smoke):
    a, b = tmp_path / "a", tmp_path / "b"
    code, _, err = kimik3_train(monkeypatch, capsys, *smoke, "train.max_tokens=128", f"hydra.run.dir={a}")
    assert code == 0, err
    code, _, err = kimik3_train(monkeypatch, capsys, f"train.resume={a}", "train.max_tokens=256", f"hydra.run.dir={b}")
    assert code == 0, err
    new = json.loads((b / "run.json").read_text())
    assert new["run_id"] == "b" and new["sessions"][0]["resumed_from"].endswith("a/checkpoints/step-000002.pt")
    assert read_events(b)[-1]["step"] == 4 and json.loads((a / "run.json").read_text())["sessions"][-1]["step"] == 2

    saved = (a / ".hydra" / "overrides.yaml").read_text()
    code, _, err = kimik3_train(monkeypatch, capsys, f"train.resume={a}", "train.max_tokens=null", f"hydra.run.dir={a}")
    assert code == 0, err
    assert (a / ".hydra" / "overrides.yaml").read_text() == saved and (a / ".hydra" / "session-2").is_dir()
    assert [s["step"] for s in json.loads((a / "run.json").read_text())["sessions"]] == [2, 8]


def test_a_sweep_from_a_runs_checkpoint_trains_that_runs_recipe_in_new_runs(monkeypatch, capsys, tmp_path, smoke):
    """`-m train.resume=<run> key=a,b`: each trial is a new run in the sweep dir that starts from the
    run's checkpoint with the run's own overrides under the trial's (model=smoke here: without them the
    trials composed the default model and each was refused at its checkpoint), as a single
    `train.resume=<run> hydra.run.dir=<new dir>` does; the source run is left as it was."""
    a, sweep = tmp_path / "a", tmp_path / "sweep"
    code, _, err = kimik3_train(monkeypatch, capsys, *smoke, "train.max_tokens=128", f"hydra.run.dir={a}")
    assert code == 0, err
    before = (a / "run.json").read_text()
    code, _, err = kimik3_train(monkeypatch, capsys, "-m", f"train.resume={a}", "train.max_tokens=256",
                                "train.lr=1e-3,2e-3", f"hydra.sweep.dir={sweep}")
    assert code == 0, err
    for trial, lr in zip(("0", "1"), ("0.001", "0.002")):
        record = json.loads((sweep / trial / "run.json").read_text())
        assert record["sessions"][0]["resumed_from"].endswith("a/checkpoints/step-000002.pt")
        assert read_events(sweep / trial)[-1]["step"] == 4
        saved = OmegaConf.load(sweep / trial / ".hydra" / "overrides.yaml")
        assert "model=smoke" in saved and f"train.lr={lr}" in saved
    assert (a / "run.json").read_text() == before


@pytest.mark.parametrize("plan, line", [
    ("train.max_steps=4", "train.max_steps=4 is at or below step 4 of the checkpoint {ckpt}: a run started from it "
                          "would train no step; raise train.max_steps past step 4"),
    ("train.max_tokens=192", "train.max_tokens=192 (3 steps) is at or below step 4 of the checkpoint {ckpt}: a run "
                             "started from it would train no step; raise train.max_tokens past step 4"),
], ids=["max_steps", "max_tokens"])
def test_a_new_run_from_a_checkpoint_at_or_past_its_plan_is_one_line(monkeypatch, capsys, tmp_path, smoke, plan, line):
    """It would end at once as a finished run of no steps; refused before the new run dir is made."""
    a, b = tmp_path / "a", tmp_path / "b"
    code, _, err = kimik3_train(monkeypatch, capsys, *smoke, "train.max_steps=4", f"hydra.run.dir={a}")
    assert code == 0, err
    code, _, err = kimik3_train(monkeypatch, capsys, f"train.resume={a}", plan, f"hydra.run.dir={b}")
    ckpt = a / "checkpoints" / "step-000004.pt"
    assert code == 1 and err == f"kimik3-train: error: {line.format(ckpt=ckpt)}\n"
    assert not b.exists()


def test_resume_applies_a_changed_lr_and_says_so_but_refuses_another_batch_geometry(monkeypatch, capsys, tmp_path,
                                                                                      smoke):
    """The optimizer's state_dict carries base_lr: loading it must not put the checkpoint's lr back."""
    a, b = tmp_path / "a", tmp_path / "b"
    code, _, err = kimik3_train(monkeypatch, capsys, *smoke, "train.checkpoint_interval=4", f"hydra.run.dir={a}")
    assert code == 0, err
    step_4 = a / "checkpoints" / "step-000004.pt"
    code, _, err = kimik3_train(monkeypatch, capsys, *smoke, f"train.resume={step_4}", "train.lr=6e-3",
                                "train.weight_decay=0.0", f"hydra.run.dir={b}")
    assert code == 0, err
    lr_a, lr_b = ({e["step"]: e["lr"] for e in read_events(r) if e["event"] == "train"} for r in (a, b))
    assert sorted(lr_b) == [6, 8] and all(lr_b[s] == pytest.approx(2 * lr_a[s]) for s in lr_b)
    changed = next(e for e in read_events(b) if e["event"] == "resume")["changed"]
    assert changed == {"train.lr": {"checkpoint": 3e-3, "now": 6e-3},
                       "train.weight_decay": {"checkpoint": 0.1, "now": 0.0}}
    assert ("resume: 2 field(s) differ from the checkpoint's recipe, this session's values apply: "
            "train.lr 0.003 -> 0.006, train.weight_decay 0.1 -> 0.0") in (b / "train.log").read_text()

    code, _, err = kimik3_train(monkeypatch, capsys, *smoke, f"train.resume={step_4}", "train.seq_len=16",
                                f"hydra.run.dir={tmp_path / 'c'}")
    assert code == 1 and err.strip() == (f"kimik3-train: error: cannot resume from {step_4}: "
                                         "train.seq_len is 32 in the checkpoint but 16 now")


def test_reproduce_of_a_run_started_from_a_checkpoint_is_a_new_run_that_leaves_the_source_alone(
        monkeypatch, capsys, tmp_path, smoke):
    """The saved recipe holds train.resume=<another run's checkpoint>: reproducing it must start from
    that checkpoint in a new run dir, not resume (and overwrite) the run the checkpoint came from."""
    monkeypatch.chdir(tmp_path)
    code, _, err = kimik3_train(monkeypatch, capsys, *smoke, "train.checkpoint_interval=2", "hydra.run.dir=src")
    assert code == 0, err
    src = tmp_path / "src"
    before = {p.name: p.read_bytes() for p in (src / "checkpoints").iterdir()}
    manifest = (src / "run.json").read_text()
    code, _, err = kimik3_train(monkeypatch, capsys, "train.resume=src/checkpoints/step-000002.pt", "train.lr=6e-3",
                                "hydra.run.dir=ft")
    assert code == 0, err
    code, _, err = kimik3_train(monkeypatch, capsys, "--config-path", "ft/.hydra", "--config-name", "config")
    assert code == 0, err
    (again,) = (tmp_path / "outputs").iterdir()  # a run dir of its own, at Hydra's default place
    assert {p.name: p.read_bytes() for p in (src / "checkpoints").iterdir()} == before
    assert (src / "run.json").read_text() == manifest
    assert losses(again) == losses(tmp_path / "ft") and len(losses(again)) == 3  # steps 3-8 from step 2

    code, _, err = kimik3_train(monkeypatch, capsys, *smoke, "train.resume=src", "train.max_tokens=null")
    assert code == 0, err
    session_2 = src / ".hydra" / "session-2"
    code, _, err = kimik3_train(monkeypatch, capsys, "--config-path", str(session_2), "--config-name", "config")
    assert code == 1 and err.strip() == (
        f"kimik3-train: error: {session_2} records session-2 of {src}, a resume of that run; reproduce takes "
        f"a run's first session: --config-path {src}/.hydra (to redo a later session, start from one of its "
        f"checkpoints in a new run: train.resume={src}/checkpoints/<step> hydra.run.dir=<new dir>)")


def test_continuing_a_run_in_place_from_an_older_checkpoint_is_refused(monkeypatch, capsys, tmp_path, smoke):
    """Its newer checkpoints would stay beside the new branch's steps, and resuming the run later would
    pick them (a silent switch back to the abandoned trajectory)."""
    run = tmp_path / "run"
    code, _, err = kimik3_train(monkeypatch, capsys, *smoke, "train.checkpoint_interval=2", f"hydra.run.dir={run}")
    assert code == 0, err
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    older = run / "checkpoints" / "step-000004.pt"
    code, _, err = kimik3_train(monkeypatch, capsys, f"train.resume={older}", "train.lr=1e-2")
    assert code == 1 and err.strip() == (
        f"kimik3-train: error: train.resume={older} is not the newest checkpoint of {run} (step-000008.pt is): "
        f"continuing the run from it would leave step-000008.pt beside the new steps; start a new run from it "
        f"(add hydra.run.dir=<new dir>) or resume the run itself (train.resume={run})")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before
    assert len(json.loads((run / "run.json").read_text())["sessions"]) == 1
    code, _, err = kimik3_train(monkeypatch, capsys, f"train.resume={older}", f"hydra.run.dir={tmp_path / 'branch'}")
    assert code == 0, err  # the same checkpoint into a new run dir is a new run


def test_resume_with_another_split_of_the_global_batch_ignores_the_val_cursor(monkeypatch, capsys, tmp_path, smoke):
    """1 x 2 accumulated sequences -> 2 x 1: the val cursor after an eval of one batch (32 tokens) is no
    multiple of the new 64-token step, and need not be (every eval rewinds the val loader). The resumed
    run continues the trajectory: per-step losses within 1e-5 of a straight 2 x 1 run."""
    split = ["train.eval_steps=1", "train.eval_interval=2", "train.checkpoint_interval=2"]
    a, b, straight = tmp_path / "a", tmp_path / "b", tmp_path / "straight"
    code, _, err = kimik3_train(monkeypatch, capsys, *smoke, *split, "train.batch_size=1", "train.grad_accum_steps=2",
                                "train.max_steps=4", f"hydra.run.dir={a}")
    assert code == 0, err
    code, _, err = kimik3_train(monkeypatch, capsys, f"train.resume={a / 'checkpoints' / 'step-000002.pt'}",
                                "train.batch_size=2", "train.grad_accum_steps=1", "train.max_steps=8",
                                f"hydra.run.dir={b}")
    assert code == 0, err
    code, _, err = kimik3_train(monkeypatch, capsys, *smoke, *split, f"hydra.run.dir={straight}")
    assert code == 0, err
    assert losses(b) == pytest.approx(losses(straight)[1:], rel=1e-5)  # steps 4, 6, 8


def test_reproduce_refuses_other_data_behind_the_same_source_name(monkeypatch, capsys, tmp_path, tiny_train,
                                                                  kimik3_cache):
    """data.source names a file; edited since, it would prepare into another dataset: refused, naming
    the dataset field that differs, before any run dir is made."""
    monkeypatch.chdir(tmp_path)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(400)))
    code, _, err = kimik3_train(monkeypatch, capsys, "model=smoke", *tiny_train, "train.max_steps=2",
                                f"data.source={corpus}", "hydra.run.dir=a")
    assert code == 0, err
    corpus.write_text(corpus.read_text().replace("fox", "cat"))
    code, _, err = kimik3_train(monkeypatch, capsys, "--config-path", "a/.hydra", "--config-name", "config",
                                "hydra.run.dir=b")
    assert code == 1 and not (tmp_path / "b").exists()
    assert re.fullmatch(rf"kimik3-train: error: reproduce from {tmp_path / 'a'}: the recipe differs at "
                        r"dataset.source_sha256 \(saved '[0-9a-f]{64}', now '[0-9a-f]{64}'\)",
                        err.strip().splitlines()[-1]), err  # (above it: the new data's tokenize bar)


@pytest.mark.parametrize("command, damage, line", [
    ("resume", {".hydra/overrides.yaml": "a: [1\n"}, "{run}/.hydra/overrides.yaml is not readable YAML (expected ',' "
     "or ']', but got '<stream end>' at line 2, column 1); restore it from a copy of the run"),
    ("resume", {".hydra/overrides.yaml": "a: 1\n"}, "{run}/.hydra/overrides.yaml is not a list of overrides (one "
     "`key=value` string per item, as Hydra writes it); restore it from a copy of the run"),
    ("reproduce", {"config_resolved.yaml": "train: {lr: [1\n"}, "{run}/config_resolved.yaml is not readable YAML "
     "(expected ',' or ']', but got '<stream end>' at line 2, column 1); restore it from a copy of the run"),
    ("reproduce", {".hydra/hydra.yaml": None}, "--config-path {run}/.hydra is a run's Hydra dir without hydra.yaml, "
     "which a reproduce reads (with overrides.yaml); restore it from a copy of the run"),
    ("reproduce", {".hydra/config.yaml": None}, None),
], ids=["resume-bad-yaml", "resume-not-a-list", "reproduce-bad-resolved", "reproduce-no-hydra-yaml",
        "reproduce-no-config-yaml"])
def test_damaged_saved_config_files_are_one_line_naming_the_file(monkeypatch, capsys, tmp_path, smoke, command,
                                                                 damage, line):
    """A run's saved YAML cut off or edited (None: deleted): resume and reproduce say which file in one
    line, not yaml's four-line error under a traceback, and leave no run dir; Hydra's config.yaml,
    which a reproduce does not read, may go missing."""
    run = tmp_path / "run"
    code, _, err = kimik3_train(monkeypatch, capsys, *smoke, "train.max_steps=2", f"hydra.run.dir={run}")
    assert code == 0, err
    for name, text in damage.items():
        if text is None:
            (run / name).unlink()
        else:
            (run / name).write_text(text)
    args = ([f"train.resume={run}", "train.max_steps=4"] if command == "resume" else
            ["--config-path", str(run / ".hydra"), "--config-name", "config", f"hydra.run.dir={tmp_path / 'new'}"])
    code, _, err = kimik3_train(monkeypatch, capsys, *args)
    if line is None:
        assert code == 0, err
        return
    assert code == 1 and err.splitlines() == [f"kimik3-train: error: {line.format(run=run)}"], err
    assert not (tmp_path / "new").exists() and not (run / ".hydra" / "session-2").exists()


def test_cfg_prints_a_reproduced_recipe(monkeypatch, capsys, tmp_path, smoke):
    monkeypatch.chdir(tmp_path)
    code, _, err = kimik3_train(monkeypatch, capsys, *smoke, "train.lr=2e-3", "hydra.run.dir=a")
    assert code == 0, err
    code, out, err = kimik3_train(monkeypatch, capsys, "--config-path", "a/.hydra", "--config-name", "config",
                                  "--cfg", "job", "--package", "train")
    assert code == 0, err
    assert out.startswith("# @package train") and OmegaConf.create(out).lr == 2e-3


@pytest.mark.parametrize("args, message", [
    (["train.lrr=1e-3,3e-3"], "Could not override 'train.lrr'.* Key 'lrr' not in 'TrainConfig'"),
    (["train.lr=1e-3,abc"], "Value 'abc' of type 'str' could not be converted to Float"),
    (["train.warmup_steps=choice(1,x)"], "Value 'x' of type 'str' could not be converted to Integer"),
    (["train.lr=tag(log,interval(1e-4,1e-2))", "model=nope"], "Could not find 'model/nope'"),
    (["hydra/sweeper=optuna_seeded", "hydra.sweeper.n_trials=0", "train.lr=interval(1e-4,1e-2)"],
     "^kimik3-train: error: hydra.sweeper.n_trials=0 runs no trial: give 1 or more$"),
], ids=["typo-key", "bad-second-value", "bad-choice", "unknown-option", "no-trials"])
def test_sweep_with_a_bad_override_is_one_line_and_leaves_no_sweep_dir(monkeypatch, capsys, tmp_path, smoke, args,
                                                                       message):
    monkeypatch.chdir(tmp_path)
    code, _, err = kimik3_train(monkeypatch, capsys, "-m", *smoke, *args)
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and lines[0].startswith("kimik3-train: error: "), err
    assert re.search(message, lines[0]), lines[0]
    assert not list(tmp_path.iterdir())  # no multirun/ (nor outputs/)


def test_full_error_adds_the_traceback_to_a_launch_error(monkeypatch, capsys, smoke):
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    code, _, err = kimik3_train(monkeypatch, capsys, *smoke, "train.lrr=1")
    assert code == 1 and err.startswith("Traceback (most recent call last)")
    assert "ConfigCompositionException" in err
    assert err.strip().splitlines()[-1].startswith("kimik3-train: error: Could not override 'train.lrr'.")


def test_a_first_run_that_fails_before_it_starts_leaves_no_outputs_dir(monkeypatch, capsys, tmp_path, smoke):
    monkeypatch.chdir(tmp_path)
    code, _, err = kimik3_train(monkeypatch, capsys, *smoke, "data.prepared_dir=/nonexistent/prepared")
    assert code == 1 and "prepared dir /nonexistent/prepared does not exist" in err
    assert not list(tmp_path.iterdir())
    (tmp_path / "outputs").mkdir()  # the user's own (empty) outputs/ stays
    code, _, _ = kimik3_train(monkeypatch, capsys, *smoke, "data.prepared_dir=/nonexistent/prepared")
    assert code == 1 and (tmp_path / "outputs").is_dir() and not list((tmp_path / "outputs").iterdir())


@pytest.mark.parametrize("cause, code", [("Ctrl-C", 130), ("SIGTERM", 143)])
def test_ctrl_c_or_sigterm_marks_the_run_interrupted_and_says_how_to_continue(monkeypatch, capsys, tmp_path, smoke,
                                                                             cause, code):
    """Ctrl-C (or SIGTERM: a SLURM time limit, torchrun stopping the ranks) after the step-2
    checkpoint: exit 130 (143), one line, error.txt, status "interrupted"; the run then resumes in place
    to the same trajectory as an uninterrupted one."""
    from kimik3.runs.metrics import MetricsWriter

    log = MetricsWriter.log

    def interrupt_after_checkpoint(self, event, step, *args, **kwargs):
        log(self, event, step, *args, **kwargs)
        if event == "checkpoint" and step == 2:
            if cause == "SIGTERM":
                os.kill(os.getpid(), signal.SIGTERM)  # delivered before kill returns (to this thread)
            raise KeyboardInterrupt

    run, straight = tmp_path / "run", tmp_path / "straight"
    with monkeypatch.context() as patch:
        patch.setattr(MetricsWriter, "log", interrupt_after_checkpoint)
        exit_code, _, err = kimik3_train(monkeypatch, capsys, *smoke, "train.checkpoint_interval=2",
                                         f"hydra.run.dir={run}")
    line = f"interrupted ({cause}); continue with train.resume={run}"
    assert exit_code == code and err.strip().splitlines()[-1] == f"kimik3-train: {line}"
    assert line in (run / "error.txt").read_text()
    end = read_events(run)[-1]
    assert end["status"] == "interrupted" and end["error"] == f"interrupted ({cause})"
    assert json.loads((run / "run.json").read_text())["sessions"][-1]["status"] == "interrupted"
    code, _, err = kimik3_train(monkeypatch, capsys, f"train.resume={run}")
    assert code == 0, err
    code, _, err = kimik3_train(monkeypatch, capsys, *smoke, "train.checkpoint_interval=2", f"hydra.run.dir={straight}")
    assert code == 0, err
    assert losses(run) == losses(straight)


class _FullDiskFile:
    """What an open file of a full disk does: every write, flush or close fails with ENOSPC, naming no file."""

    closed = False

    def write(self, *args: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    flush = close = write


def test_a_full_disk_mid_run_is_one_line_and_keeps_the_earlier_checkpoints(monkeypatch, capsys, tmp_path, smoke):
    """The disk fills while the step-4 checkpoint is written: torch.save's RuntimeError (raised while
    handling the ENOSPC, and saying only "unexpected pos") becomes one line naming the checkpoint; the
    failing session's own records (its end event, metrics.jsonl's close, run.json, error.txt), which
    the full disk refuses too, add no traceback; the step-2 checkpoint stays, no temp file is left,
    and once there is room the run resumes in place to the uninterrupted run's losses."""
    import kimik3.checkpoint as ckpt
    from kimik3.runs import run_dir as rundir
    from kimik3.runs.metrics import MetricsWriter

    full = False
    real_save, real_log, real_write_text, real_mark = torch.save, MetricsWriter.log, Path.write_text, rundir.mark_failed

    def save(obj, f, *args, **kwargs):
        nonlocal full
        full = full or obj["train_state"]["step"] == 4
        if not full:
            return real_save(obj, f, *args, **kwargs)
        f.write(b"half a checkpoint")
        try:
            _FullDiskFile().write()
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 798784 vs 798736")

    def log(self, *args, **kwargs):
        if full and not isinstance(self._file, _FullDiskFile):
            self._file.close()
            self._file = _FullDiskFile()
        return real_log(self, *args, **kwargs)

    def refused(real):
        def write(*args, **kwargs):
            if full:
                _FullDiskFile().write()
            return real(*args, **kwargs)
        return write

    run, straight = tmp_path / "run", tmp_path / "straight"
    with monkeypatch.context() as patch:
        patch.setattr(ckpt.torch, "save", save)
        patch.setattr(MetricsWriter, "log", log)
        patch.setattr(Path, "write_text", refused(real_write_text))
        patch.setattr(rundir, "mark_failed", refused(real_mark))
        code, _, err = kimik3_train(monkeypatch, capsys, *smoke, "train.checkpoint_interval=2", f"hydra.run.dir={run}")
    assert code == 1 and err.splitlines() == [
        f"kimik3-train: error: cannot write {run}/checkpoints/step-000004.pt: No space left on device; the "
        f"checkpoints written before are kept: continue with train.resume={run}"], err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000002.pt"]
    assert ckpt.load_checkpoint(run / "checkpoints" / "step-000002.pt")["train_state"]["step"] == 2
    assert [p.name for p in run.iterdir() if p.name.startswith(".")] == [".hydra"]  # no temp file beside run.json
    code, _, err = kimik3_train(monkeypatch, capsys, f"train.resume={run}")
    assert code == 0, err
    code, _, err = kimik3_train(monkeypatch, capsys, *smoke, "train.checkpoint_interval=2", f"hydra.run.dir={straight}")
    assert code == 0, err
    assert losses(run)[-3:] == losses(straight)[-3:]  # steps 4, 6, 8 (step 2 was logged before the failure too)


@pytest.mark.parametrize("rank", [0, 1])
def test_under_torchrun_only_rank_0_prints_the_interrupted_line(monkeypatch, capsys, tmp_path, smoke, rank):
    """Every rank gets the Ctrl-C and exits 130; one line for the job, from rank 0 (which alone
    writes the run dir), not one per rank."""
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("kimik3.runs.job.run", interrupted)
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "2")
    run_dir = tmp_path / "run"
    code, _, err = kimik3_train(monkeypatch, capsys, *smoke, f"hydra.run.dir={run_dir}")
    assert code == 130
    assert err == ("kimik3-train: interrupted (Ctrl-C)\n" if rank == 0 else ""), err
    if rank == 0:
        assert not run_dir.exists()  # the run never started: rank 0 leaves nothing behind
    else:  # no record of its own beside rank 0's (Hydra's empty log file, which rank 0 discards, aside)
        assert [p.name for p in run_dir.iterdir()] == ["train.log"] and not (run_dir / "train.log").stat().st_size


def test_train_compile_compiles_each_block_in_place(monkeypatch, caplog, compose, tmp_path, smoke):
    """train.compile is wired: regional nn.Module.compile (in place, so state_dict keys stay as they are).
    torch.compile itself is stubbed: a real CPU compile of even the smoke model takes over a minute here."""
    compiled: list[str] = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, *a, **k: compiled.append(type(self).__name__))
    run(compose([*smoke, "train.max_steps=2"]), tmp_path / "off", run_id="off")
    assert compiled == []
    with caplog.at_level(logging.INFO, logger="kimik3"):
        run(compose([*smoke, "train.max_steps=2", "train.compile=true"]), tmp_path / "on", run_id="on")
    assert compiled == ["SmokeTestLM"]  # no blocks: the whole model
    assert "train.compile: torch.compile on the whole SmokeTestLM" in caplog.messages
    compiled.clear()
    model = build_model(compose(["model=kimi_k3_tiny"]).model, 257)
    assert compile_blocks(model) == f"torch.compile on each of {len(model.layers)} blocks"
    assert compiled == [type(model.layers[0]).__name__] * len(model.layers) and len(model.layers) > 1


def test_start_summary_under_torchrun_counts_the_global_batch(smoke_cfg, tmp_path):
    """train.batch_size is per rank: with 2 ranks the summary names them and multiplies them in."""
    from types import SimpleNamespace

    from kimik3.runs.summary import format_summary

    t = smoke_cfg.train  # batch_size 2, seq_len 32, grad_accum_steps 1
    ds = SimpleNamespace(identity={"name": "corpus"}, num_tokens=10_000, vocab_size=257)

    def budget(world_size: int) -> str:
        text = format_summary(smoke_cfg, run_id="r", run_dir=tmp_path, info={"params_total": 1, "params_activated": 1},
                              device="cpu", precision="fp32", groups=[], train_ds=ds, val_ds=ds, steps=t.max_steps,
                              tokens_per_step=world_size * t.batch_size * t.seq_len, start_step=0, resumed_from=None,
                              world_size=world_size)
        (line,) = [x for x in text.splitlines() if x.lstrip().startswith("budget")]
        return line.split(None, 1)[1]

    assert budget(1) == "2 seqs x 32 tokens x 1 accum = 64 tokens/step; 8 steps = 512 tokens = 0.05 epochs of the train split"
    assert budget(2) == ("global batch 2 seqs per rank x 2 ranks x 1 accum = 4 seqs x 32 tokens = 128 tokens/step; "
                         "8 steps = 1,024 tokens = 0.10 epochs of the train split")


def test_warmup_as_long_as_the_run_is_one_warning_line_naming_both_values(smoke_cfg):
    from kimik3.runs.summary import warmup_warning

    t = smoke_cfg.train  # warmup_steps 2, lr 3e-3, cosine
    assert warmup_warning(t, 8) is None
    assert warmup_warning(t, 2) == ("warning: train.warmup_steps=2 is not below the 2 planned steps: the lr rises for "
                                    "the whole run, to 100% of train.lr=0.003 at the last step, and the cosine phase "
                                    "never starts")
    t.warmup_steps = 10
    assert warmup_warning(t, 5) == ("warning: train.warmup_steps=10 is not below the 5 planned steps: the lr rises for "
                                    "the whole run, to 50% of train.lr=0.003 at the last step, and the cosine phase "
                                    "never starts")


def test_a_token_cap_before_max_steps_warns_that_the_schedule_is_cut(smoke_cfg):
    """train.max_tokens can end the run before train.max_steps, which the schedule spans."""
    from kimik3.runs.summary import schedule_cut_warning

    t = smoke_cfg.train  # max_steps 8, warmup 2, cosine, min ratio 0.1
    assert schedule_cut_warning(t, 8) is None
    t.max_tokens, t.schedule = 256, "wsd"
    assert schedule_cut_warning(t, 4) == (
        "warning: train.max_tokens=256 ends the run after 4 steps, before train.max_steps=8 that the wsd schedule "
        "spans: the last step trains at 100% of train.lr=0.003 (set train.max_steps=4 to decay within the run)")
    t.schedule = "constant"
    assert schedule_cut_warning(t, 4) is None
