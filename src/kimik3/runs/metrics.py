"""metrics.jsonl: one JSON event per line, plus the MFU arithmetic with a named peak.

Every event carries "event", "step" (optimizer steps done, skipped ones included), "tokens" (train
tokens seen), "time" (unix seconds) and "elapsed" (seconds since this session started). Lines are
flushed as they are written, so a crash leaves every earlier event readable; a resumed session
appends to the same file, after first cutting a torn last line a killed writer left (so its first
event does not merge into the fragment). Non-finite floats (a diverged loss) are written as null, so
every line is strict JSON. Each event is also handed to the sinks (e.g. TensorBoardSink) as the
same dict.

`read_events` is the one reader of the file (report, plot, tests): it drops a line that does not
parse, which is what a live writer's half-written last line, or a crash's torn one, looks like.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Optional, Protocol, Sequence

from kimik3.write_errors import writing

if TYPE_CHECKING:  # torch is imported where used: kimik3-runs and kimik3-plot read events without it
    import torch

# Dense bf16 tensor-core peaks (FLOP/s) from the vendors' datasheets, matched as substrings of
# torch.cuda.get_device_name. An unknown device has no peak and therefore no MFU (never a guess).
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,  # SXM; the PCIe card (756e12) reports "H100 PCIe" and is matched first below
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 70e12,
}
_PCIE_PEAKS = {"H100 PCIe": 756e12}
_SCAN_CHUNK = 1 << 16
"""Bytes read at a time when looking back for the last newline (a train event with per-layer
diagnostics of a deep model is a few KB)."""


class Sink(Protocol):
    """Anything that mirrors metrics events (TensorBoardSink)."""

    def write(self, event: dict) -> None: ...

    def close(self) -> None: ...


class MetricsWriter:
    """Appends events to `<run_dir>/metrics.jsonl` and forwards them to `sinks`."""

    def __init__(self, run_dir: Path, sinks: Sequence[Sink] = ()) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.sinks = list(sinks)
        self.started = time.time()
        if self.path.is_file():
            _cut_torn_line(self.path)
        self._file = open(self.path, "a", encoding="utf-8")

    def log(self, event: str, step: int, tokens: int, fields: Optional[Mapping[str, object]] = None) -> dict:
        """Write one event; `fields` holds the event's own keys (loss, val_loss, reason, ...)."""
        now = time.time()
        record = {"event": event, "step": step, "tokens": tokens, "time": round(now, 3),
                  "elapsed": round(now - self.started, 3)}
        record.update({k: _json_value(v) for k, v in (fields or {}).items()})
        with writing(self.path):
            self._file.write(json.dumps(record, allow_nan=False) + "\n")
            self._file.flush()
        for sink in self.sinks:
            sink.write(record)
        return record

    def close(self) -> None:
        """Close the file and every sink (a sweep's next job must not inherit open writers)."""
        if not self._file.closed:
            with writing(self.path):  # a line a full disk refused is still in the buffer
                self._file.close()
        for sink in self.sinks:
            sink.close()
        self.sinks = []

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_events(run_dir: Path) -> list[dict]:
    """The events of `<run_dir>/metrics.jsonl`, in order; [] when the file does not exist (yet).

    A line that is not a JSON event is dropped rather than raised: a writer killed mid-line (or
    still writing, when a live run is read) leaves a torn last line, and the events before it
    are still good.
    """
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    with open(path, encoding="utf-8", errors="replace") as f:
        return [event for event in map(_parse_event, f) if event is not None]


def peak_flops(device: torch.device) -> Optional[tuple[str, float]]:
    """(device name, dense bf16 peak FLOP/s) for a known accelerator, else None (CPU included)."""
    if device.type != "cuda":
        return None
    import torch

    name = torch.cuda.get_device_name(device)
    for table in (_PCIE_PEAKS, PEAK_BF16_FLOPS):
        for key, value in table.items():
            if key in name:
                return name, value
    return None


def mfu(flops_per_token: Optional[float], tokens_per_s: float, peak: Optional[tuple[str, float]],
        world_size: int = 1) -> Optional[float]:
    """Model FLOPs utilisation = flops_per_token * tokens/s / (peak * world_size); None when unknown."""
    if flops_per_token is None or peak is None:
        return None
    return flops_per_token * tokens_per_s / (peak[1] * world_size)


def _parse_event(line: str | bytes) -> Optional[dict]:
    """The event a line holds, or None for a blank, torn or otherwise non-event line."""
    try:
        event = json.loads(line)
    except ValueError:  # JSONDecodeError, or UnicodeDecodeError for bytes cut inside a character
        return None
    return event if isinstance(event, dict) and "event" in event else None


def _cut_torn_line(path: Path) -> None:
    """Make `path` end on a whole line: a fragment after the last newline (a writer killed
    mid-line) is cut off, or just terminated when it is a whole event that lost only its newline."""
    with open(path, "rb+") as f:
        end = f.seek(0, os.SEEK_END)
        if end == 0:
            return
        f.seek(end - 1)
        if f.read(1) == b"\n":
            return
        start = end
        while start > 0:  # scan back chunk by chunk for the last newline
            size = min(_SCAN_CHUNK, start)
            f.seek(start - size)
            newline = f.read(size).rfind(b"\n")
            if newline >= 0:
                start -= size - newline - 1
                break
            start -= size
        f.seek(start)
        if _parse_event(f.read()) is not None:
            f.write(b"\n")
        else:
            f.truncate(start)


def _json_value(value: object) -> object:
    torch = sys.modules.get("torch")  # a tensor value means torch is loaded; no import for plain values
    if torch is not None and isinstance(value, torch.Tensor):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
