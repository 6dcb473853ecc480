"""What a person watching the terminal sees while training: a tqdm bar, or plain log lines.

On a TTY (stdout and stderr both): a bar with step/total, ETA and, refreshed at log steps, loss, lr and tokens/s; other
messages (eval, checkpoint, skip) go through `logging` above the bar. Not on a TTY (CI, a job
scheduler, a pipe): no bar, one log line per log step, so log files stay readable.
"""

from __future__ import annotations

import logging
import sys
import time
from contextlib import ExitStack
from typing import Optional

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

log = logging.getLogger("kimik3")


class Progress:
    """Progress of one training session from step `initial` to `total` (optimizer attempts)."""

    def __init__(self, total: int, initial: int, *, tty: Optional[bool] = None) -> None:
        self.total, self.initial = total, initial
        self.started = time.time()
        self._stack = ExitStack()
        use_bar = (sys.stdout.isatty() and sys.stderr.isatty()) if tty is None else tty
        self._bar: Optional[tqdm] = None
        if use_bar:
            self._stack.enter_context(logging_redirect_tqdm())
            self._bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, leave=True)

    def advance(self) -> None:
        """One optimizer attempt done (cheap: no device sync)."""
        if self._bar is not None:
            self._bar.update(1)

    def report(self, step: int, loss: float, lr: float, tokens_per_s: float) -> None:
        """Called at log steps with already-synced numbers."""
        if self._bar is not None:
            self._bar.set_postfix_str(f"loss {loss:.4f} lr {lr:.2e} {_si(tokens_per_s)} tok/s", refresh=True)
            return
        done = step - self.initial
        eta = (time.time() - self.started) / done * (self.total - step) if done else 0.0
        log.info(f"step {step:>{len(str(self.total))}}/{self.total} | loss {loss:.4f} | lr {lr:.2e} | "
                 f"{_si(tokens_per_s)} tok/s | eta {_duration(eta)}")

    def message(self, text: str) -> None:
        log.info(text)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self._stack.close()


def _si(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.0f}"


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s"
