import pytest

from kimik3.runs import tensorboard as tb
from kimik3.runs.tensorboard import TensorBoardSink, tensorboard_available

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402


def _event(kind, step, **fields):
    return {"event": kind, "step": step, "tokens": 512 * step, "time": 1.7e9 + step,
            "elapsed": float(step), **fields}


def _read(log_dir):
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return acc


def _scalars(acc):
    return {tag: [(s.step, s.value) for s in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_events_become_scalars(tmp_path):
    sink = TensorBoardSink(tmp_path)
    sink.write(_event("start", 0))
    sink.write(_event("train", 10, loss=3.5, lr=1e-3, grad_norm=0.8, tokens_per_s=1234.0,
                      skipped=1, **{"moe/layer1/load_max": 1.7, "mla/layer3/max_logit": 42.0}))
    sink.write(_event("train", 20, loss=None, lr=2e-3, grad_norm=None, tokens_per_s=1300.0,
                      mfu=0.31, skipped=1))  # metrics.jsonl writes a non-finite loss as null
    sink.write(_event("eval", 20, val_loss=3.25))
    # One event per clipped head: summed per layer and step.
    sink.write(_event("qk_clip", 20, layer="layers.3.attn", head=1, max_logit=130.0, factor=0.77))
    sink.write(_event("qk_clip", 20, layer="layers.3.attn", head=2, max_logit=140.0, factor=0.71))
    sink.write(_event("qk_clip", 20, layer="layers.7.attn", head=0, max_logit=101.0, factor=0.99))
    sink.write(_event("skip", 15, reason="non-finite loss"))
    sink.write(_event("checkpoint", 20, path="checkpoints/step_20"))
    sink.write(_event("end", 20, status="finished", val_loss=3.25, train_loss=3.4, objective=3.25))
    sink.write(_event("qk_clip", 21, layer=3, head=0, max_logit=120.0, factor=0.83))  # flushed by close
    sink.close()

    acc = _read(tmp_path / "tb")
    scalars = _scalars(acc)
    assert scalars["train/loss"] == [(10, 3.5)]
    assert scalars["train/grad_norm"] == [(10, pytest.approx(0.8))]
    assert scalars["train/lr"] == [(10, pytest.approx(1e-3)), (20, pytest.approx(2e-3))]
    assert scalars["train/tokens"] == [(10, 5120.0), (20, 10240.0)]
    assert [s for s, _ in scalars["perf/tokens_per_s"]] == [10, 20]
    assert scalars["perf/mfu"] == [(20, pytest.approx(0.31))]  # only where known
    assert scalars["train/skipped"] == [(10, 1.0), (20, 1.0)]
    assert scalars["moe/layer1/load_max"] == [(10, pytest.approx(1.7))]
    assert scalars["mla/layer3/max_logit"] == [(10, 42.0)]
    assert scalars["val/loss"] == [(20, 3.25)]
    assert scalars["qk_clip/layers.3.attn/clipped_heads"] == [(20, 2.0)]
    assert scalars["qk_clip/layers.3.attn/max_logit"] == [(20, 140.0)]
    assert scalars["qk_clip/layers.3.attn/min_factor"] == [(20, pytest.approx(0.71))]
    assert scalars["qk_clip/layers.7.attn/clipped_heads"] == [(20, 1.0)]
    assert scalars["qk_clip/layer3/max_logit"] == [(21, 120.0)]
    assert scalars["final/objective"] == [(20, 3.25)]
    assert not any(tag.startswith(("checkpoint", "start")) for tag in scalars)
    [reason] = acc.Tensors("train/skip_reason/text_summary")
    assert (reason.step, reason.tensor_proto.string_val) == (15, [b"non-finite loss"])


def test_resume_hides_points_logged_after_the_checkpoint(tmp_path):
    crashed = TensorBoardSink(tmp_path)
    for step in range(1, 6):
        crashed.write(_event("train", step, loss=10.0 - step))
    crashed.close()
    resumed = TensorBoardSink(tmp_path)
    resumed.write(_event("start", 3))
    resumed.write(_event("resume", 3, **{"from": "checkpoints/step_3"}))
    resumed.write(_event("train", 4, loss=0.5))
    resumed.close()
    assert _scalars(_read(tmp_path / "tb"))["train/loss"] == [(1, 9.0), (2, 8.0), (3, 7.0), (4, 0.5)]


def test_available_and_missing_package_message(tmp_path, monkeypatch):
    assert tensorboard_available()
    monkeypatch.setattr(tb, "tensorboard_available", lambda: False)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'kimik3\[viz\]'.*train.logger=none"):
        TensorBoardSink(tmp_path)
    assert not (tmp_path / "tb").exists()
