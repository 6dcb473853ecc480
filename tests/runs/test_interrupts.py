"""runs/interrupts.py: a stop that arrives while a checkpoint is written waits for the write."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from kimik3.checkpoint import latest_checkpoint, load_checkpoint
from kimik3.runs.interrupts import Terminated, interrupt_cause, interrupts_held, raise_terminated
from kimik3.runs.metrics import read_events
from kimik3.train import run


@pytest.fixture
def sigterm_raises():
    previous = signal.signal(signal.SIGTERM, raise_terminated)
    yield
    signal.signal(signal.SIGTERM, previous)


@pytest.mark.parametrize("signum, stop", [(signal.SIGTERM, Terminated), (signal.SIGINT, KeyboardInterrupt)],
                         ids=["SIGTERM", "Ctrl-C"])
def test_a_signal_inside_the_block_is_raised_after_it(sigterm_raises, signum, stop):
    """The block runs to its end, then the signal's own handler raises (Terminated for SIGTERM, Python's
    KeyboardInterrupt for SIGINT), and the handlers are the ones from before the block again."""
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    finished = []
    with pytest.raises(stop) as raised:
        with interrupts_held():
            os.kill(os.getpid(), signum)
            finished.append(True)  # still running after the signal arrived
    assert finished == [True]
    assert interrupt_cause(raised.value) == ("SIGTERM" if signum == signal.SIGTERM else "Ctrl-C")
    assert {s: signal.getsignal(s) for s in before} == before


def test_only_the_first_of_several_signals_is_raised(sigterm_raises):
    with pytest.raises(Terminated):
        with interrupts_held():
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGINT)


def test_a_block_without_a_signal_changes_nothing(sigterm_raises):
    with interrupts_held():
        value = 1
    assert value == 1 and signal.getsignal(signal.SIGTERM) is raise_terminated


def test_sigterm_during_a_checkpoint_write_stops_the_run_as_interrupted_with_that_checkpoint(
        compose, tiny_train, tmp_path, monkeypatch, sigterm_raises):
    """SIGTERM in the middle of torch.save (a SLURM time limit hitting a save) made torch.save raise
    `RuntimeError: ... unexpected pos`, recorded as a failed session, and the checkpoint was lost: now
    the write finishes, the run ends interrupted (SIGTERM), and the checkpoint it wrote loads."""
    real_save = torch.save

    def save_with_a_signal_midway(obj, f, *args, **kwargs):
        f.write(b"")  # the write has begun
        if obj["train_state"]["step"] == 4:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save_with_a_signal_midway)
    run_dir = tmp_path / "run"
    with pytest.raises(Terminated):
        run(compose(["model=smoke", *tiny_train, "train.max_steps=8", "train.checkpoint_interval=2"]), run_dir,
            run_id="a")
    end = read_events(run_dir)[-1]
    assert end["event"] == "end" and end["status"] == "interrupted" and end["error"] == "interrupted (SIGTERM)"
    assert latest_checkpoint(run_dir).name == "step-000004.pt"
    assert load_checkpoint(latest_checkpoint(run_dir))["train_state"]["step"] == 4


def test_any_signal_the_job_made_raise_terminated_is_held(sigterm_raises):
    """submitit's preemption signal is configurable (SUBMITIT_PREEMPT_SIGNAL): whichever signal runs/job.py
    gave raise_terminated is held too, not only SIGTERM and a fixed list."""
    previous = signal.signal(signal.SIGUSR1, raise_terminated)
    try:
        finished = []
        with pytest.raises(Terminated) as raised:
            with interrupts_held():
                os.kill(os.getpid(), signal.SIGUSR1)
                finished.append(True)
        assert finished == [True] and interrupt_cause(raised.value) == "SIGUSR1"
    finally:
        signal.signal(signal.SIGUSR1, previous)
