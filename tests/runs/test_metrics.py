"""metrics.jsonl events, sinks and the MFU arithmetic."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kimik3.runs.metrics import MetricsWriter, mfu, peak_flops, read_events


class RecordingSink:
    def __init__(self) -> None:
        self.events: list[dict] = []
        self.closed = False

    def write(self, event: dict) -> None:
        self.events.append(event)

    def close(self) -> None:
        self.closed = True


def test_events_are_strict_json_lines_with_the_common_fields(tmp_path):
    sink = RecordingSink()
    with MetricsWriter(tmp_path, [sink]) as metrics:
        metrics.log("start", 0, 0)
        metrics.log("train", 10, 640, {"loss": 2.5, "lr": 1e-3, "grad_norm": torch.tensor(0.5)})
        metrics.log("skip", 11, 704, {"reason": "non-finite loss", "loss": math.nan, "grad_norm": math.inf})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    events = [json.loads(line, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c))) for line in lines]
    assert [e["event"] for e in events] == ["start", "train", "skip"]
    for e in events:
        assert {"event", "step", "tokens", "time", "elapsed"} <= set(e) and e["elapsed"] >= 0
    assert events[1]["grad_norm"] == 0.5 and events[2]["loss"] is None and events[2]["grad_norm"] is None
    assert sink.events == events and sink.closed


def test_a_resumed_session_appends(tmp_path):
    for step in (1, 2):
        with MetricsWriter(tmp_path) as metrics:
            metrics.log("start", step, 0)
    assert [e["step"] for e in read_events(tmp_path)] == [1, 2]


def test_reader_skips_torn_lines_and_a_missing_file(tmp_path):
    assert read_events(tmp_path) == []
    (tmp_path / "metrics.jsonl").write_text('{"event": "start", "step": 0}\n\n[1, 2]\n{"step": 1}\n'
                                            '{"event": "train", "step": 1}\n{"event": "tr')
    assert read_events(tmp_path) == [{"event": "start", "step": 0}, {"event": "train", "step": 1}]


@pytest.mark.parametrize("pad", [0, 100_000], ids=["short", "longer_than_a_scan_chunk"])
def test_a_resumed_session_cuts_the_torn_line_a_crash_left(tmp_path, pad):
    with MetricsWriter(tmp_path) as metrics:
        metrics.log("start", 0, 0)
        metrics.log("train", 1, 64, {"loss": 3.0, "note": "x" * pad})
    path = tmp_path / "metrics.jsonl"
    with open(path, "a", encoding="utf-8") as f:
        f.write('{"event": "train", "step": 2, "note": "' + "y" * pad)  # killed mid-line
    with MetricsWriter(tmp_path) as metrics:
        metrics.log("start", 1, 64)
    lines = path.read_text().splitlines()
    assert [json.loads(line)["event"] for line in lines] == ["start", "train", "start"]


@pytest.mark.parametrize("pad", [0, 100_000], ids=["short", "longer_than_a_scan_chunk"])
def test_a_whole_last_event_that_lost_only_its_newline_is_kept(tmp_path, pad):
    last = json.dumps({"event": "train", "step": 1, "note": "x" * pad})
    (tmp_path / "metrics.jsonl").write_text('{"event": "start", "step": 0}\n' + last)
    with MetricsWriter(tmp_path) as metrics:
        metrics.log("start", 1, 0)
    assert [e["event"] for e in read_events(tmp_path)] == ["start", "train", "start"]


def test_a_torn_first_line_leaves_an_empty_file(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"event": "sta')
    MetricsWriter(tmp_path).close()
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_mfu_needs_both_flops_and_a_named_peak():
    assert peak_flops(torch.device("cpu")) is None
    assert mfu(None, 1000.0, ("H100", 989e12)) is None
    assert mfu(6e9, 1000.0, None) is None
    assert math.isclose(mfu(6e9, 1e4, ("X", 1e15), world_size=2), 6e13 / 2e15)


def test_progress_plain_lines_off_a_tty_and_a_bar_on_one(caplog, capsys):
    from kimik3.runs.progress import Progress

    with caplog.at_level("INFO", logger="kimik3"):
        plain = Progress(total=20, initial=0, tty=False)
        for _ in range(10):
            plain.advance()
        plain.report(10, 2.5, 1e-3, 12_345.0)
        plain.close()
    assert caplog.messages == ["step 10/20 | loss 2.5000 | lr 1.00e-03 | 12.3k tok/s | eta 0m00s"]

    bar = Progress(total=4, initial=2, tty=True)  # a resumed session: the bar starts at step 2
    bar.advance()
    bar.report(3, 1.5, 2e-3, 900.0)
    bar.close()
    err = capsys.readouterr().err
    assert "3/4" in err and "loss 1.5000" in err and "900 tok/s" in err
