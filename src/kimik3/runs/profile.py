"""torch.profiler over one window of optimizer attempts, written as a Chrome trace into the run dir.

The window is counted in optimizer attempts of this session (skipped updates count, so a window
that contains a skip still closes): `wait` attempts untouched, `warmup` traced but discarded (the
profiler's own start-up cost), then `active` recorded attempts. The trace lands in
`<run>/profile/trace_steps<first>-<last>.json` (open it in chrome://tracing or ui.perfetto.dev).
A session that ends inside the window anyway (data_end=stop, an interrupt, a short resumed session,
torchrun ranks sharing train.max_tokens; config/validate.py refuses a window past one process's plan)
writes the attempts it recorded, named by them; one that ends before the window
writes no trace and logs a warning.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from kimik3.config.schema import ProfileConfig

log = logging.getLogger("kimik3")


class StepProfiler:
    """Call `step()` after every optimizer attempt and `close()` at the end of the session."""

    def __init__(self, cfg: ProfileConfig, out_dir: Path, device: torch.device, first_step: int) -> None:
        self.out_dir = Path(out_dir)
        self.first_step = first_step
        """Global step of this session's first attempt: names the trace file."""
        self.trace_path: Optional[Path] = None
        self._window = (cfg.wait + cfg.warmup, cfg.wait + cfg.warmup + cfg.active)
        self._attempts = 0
        """Attempts of this session so far: how much of the window was really recorded."""
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self._prof = profile(
            activities=activities,
            schedule=schedule(wait=cfg.wait, warmup=cfg.warmup, active=cfg.active, repeat=1),
            on_trace_ready=self._write,
            record_shapes=True,
        )
        self._prof.start()

    def step(self) -> None:
        self._attempts += 1
        self._prof.step()

    def close(self) -> None:
        """Stop profiling (idempotent); a window cut short by the end of training is written as far as
        it got, and a session that ended before the window is reported."""
        if self._prof is not None:
            self._prof.stop()
            self._prof = None
            if self.trace_path is None:
                log.warning(f"train.profile: the session ended after {self._attempts} optimizer attempt(s), "
                            f"before the profiler's window (attempts {self._window[0] + 1}-{self._window[1]} "
                            f"of the session): no trace written")

    def _write(self, prof: profile) -> None:
        """on_trace_ready: also called when close() stops the profiler inside the window's warm-up,
        where the trace holds only what ran after the last attempt (eval, checkpoint), so none is
        written then; a partly recorded window is named by the attempts it holds."""
        recorded = min(self._attempts, self._window[1]) - self._window[0]
        if recorded <= 0:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        first = self.first_step + self._window[0] + 1
        self.trace_path = self.out_dir / f"trace_steps{first}-{first + recorded - 1}.json"
        prof.export_chrome_trace(str(self.trace_path))
