"""How a session is stopped from outside: Ctrl-C, SIGTERM and submitit's time-limit signal.

runs/job.py installs a handler raising `Terminated` for SIGTERM (and in a submitit trial for its
preemption signal); Python raises KeyboardInterrupt for Ctrl-C. Both unwind the session through the
same path: its end recorded as interrupted, its writers closed, the exit status by `interrupt_cause`.

`interrupts_held` keeps such a signal from landing inside a checkpoint write: torch.save turns an
exception raised in the middle of its write into `RuntimeError: [enforce fail at inline_container.cc]
... unexpected pos`, so a stop that arrived while a checkpoint was being written (a SLURM time limit
hitting a save) was recorded as a failed session with that line, and the checkpoint was lost. Held,
the signal waits until the write is done (seconds), and the run stops with the checkpoint on disk.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Callable, Iterator


class Terminated(KeyboardInterrupt):
    """SIGTERM (or, in a submitit trial, submitit's preemption signal), raised where the job is
    (runs.job installs the handler) like Ctrl-C's KeyboardInterrupt, so the session ends through the
    same path: its end recorded, its writers closed."""

    def __init__(self, signal_name: str = "SIGTERM") -> None:
        super().__init__(signal_name)
        self.signal_name = signal_name


def raise_terminated(signum: int, frame: object) -> None:
    """The handler runs/job.py installs for SIGTERM (and submitit's preemption signal in its trials)."""
    raise Terminated(signal.Signals(signum).name)


def _stopping_signals() -> list[int]:
    """The signals that stop a session now: SIGINT while a Python handler (KeyboardInterrupt's) is on it,
    and every signal whose handler is raise_terminated (which ones depends on the job: submitit's
    preemption signal is configurable, SUBMITIT_PREEMPT_SIGNAL)."""
    return [s for s in signal.valid_signals()
            if (h := signal.getsignal(s)) is raise_terminated or (s == signal.SIGINT and callable(h))]


def interrupt_cause(e: KeyboardInterrupt) -> str:
    """What stopped the session, for its end event and the job's line (and exit status): the signal's
    name (SIGTERM, SIGUSR2) or Ctrl-C, by the exception's type (a KeyboardInterrupt raised with a
    message is still Ctrl-C)."""
    return e.signal_name if isinstance(e, Terminated) else "Ctrl-C"


@contextmanager
def interrupts_held() -> Iterator[None]:
    """Run the block with the stopping signals (_stopping_signals) held, then hand the first that came to
    its own handler, which raises KeyboardInterrupt or Terminated there. Other signals are left alone,
    and so is everything off the main thread, where Python runs no signal handler anyway."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[tuple[Callable, int]] = []
    handlers = {s: signal.getsignal(s) for s in _stopping_signals()}

    def hold(signum: int, frame: object) -> None:
        arrived.append((handlers[signum], signum))

    for signum in handlers:
        signal.signal(signum, hold)
    try:
        yield
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    if arrived:
        handler, signum = arrived[0]
        handler(signum, None)


__all__ = ["Terminated", "interrupt_cause", "interrupts_held", "raise_terminated"]
