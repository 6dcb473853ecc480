"""TensorBoard sink: mirrors metrics.jsonl events as scalars in `<run_dir>/tb/`.

`MetricsWriter` forwards every event dict to `write`; metrics.jsonl stays the source of truth and
this is a view of it (`tensorboard --logdir outputs/` compares runs side by side). The x axis is
the optimizer step; tokens seen are logged as `train/tokens` to convert.

Tags:
  train event    train/{loss,lr,grad_norm,tokens,skipped}, perf/{tokens_per_s,mfu}, and every
                 diagnostics key that has a '/' as is (moe/layer1/load_max, mla/layer3/max_logit)
  eval event     val/loss
  qk_clip events per MLA layer and step: qk_clip/<layer>/{clipped_heads,max_logit,min_factor}
                 (the max logit and the strongest scaling over the heads clipped at that step)
  skip event     train/skip_reason (text)
  epoch event    data/epoch
  resume event   hides the points an earlier session logged after the resumed step
  end event      final/{val_loss,train_loss,objective}
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Optional

INSTALL_HINT = "pip install 'kimik3[viz]'"
MISSING_PACKAGE = f"train.logger=tensorboard needs the tensorboard package: {INSTALL_HINT} (or set train.logger=none)"
"""The one-line error for an explicit tensorboard logger without the package (config validation
raises it before the run dir is made; the sink raises it too when built directly)."""

# Event key -> tag, per event kind. Keys absent from an event (mfu with no known peak) are skipped.
_TAGS = {
    "train": {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
              "tokens": "train/tokens", "skipped": "train/skipped",
              "tokens_per_s": "perf/tokens_per_s", "mfu": "perf/mfu", "peak_mem_gib": "perf/peak_mem_gib"},
    "eval": {"val_loss": "val/loss"},
    "epoch": {"epoch": "data/epoch"},
    "end": {"val_loss": "final/val_loss", "train_loss": "final/train_loss",
            "objective": "final/objective"},
}


def tensorboard_available() -> bool:
    """Whether the tensorboard package is importable: `train.logger=auto` turns the sink on then."""
    return importlib.util.find_spec("tensorboard") is not None


class TensorBoardSink:
    """Writes scalars for each metrics event under `<run_dir>/tb/` (rank 0 only: the caller's job)."""

    def __init__(self, run_dir: Path | str):
        if not tensorboard_available():
            raise ModuleNotFoundError(MISSING_PACKAGE)
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(run_dir) / "tb"
        self._writer_class = SummaryWriter
        # Each session adds its own event file beside the earlier ones; TensorBoard merges them.
        self._writer = SummaryWriter(log_dir=str(self.log_dir))
        # QK-Clip events of one step (one per clipped head), summed per layer until the step ends:
        # layer -> [clipped heads, max logit, min factor]; written with _clip_time at _clip_step.
        self._clips: dict[str, list[float]] = {}
        self._clip_step, self._clip_time = 0, None

    def write(self, event: dict) -> None:
        kind = event["event"]
        step = int(event["step"])
        when = event.get("time")  # the event's own wall time, so TensorBoard's time axis is true
        if self._clips and (kind != "qk_clip" or step != self._clip_step):
            self._flush_clips()
        for key, tag in _TAGS.get(kind, {}).items():
            self._scalar(tag, event.get(key), step, when)
        if kind == "train":
            for key, value in event.items():
                if "/" in key:
                    self._scalar(key, value, step, when)
        elif kind == "qk_clip":
            self._add_clip(event, step, when)
        elif kind == "skip":
            self._writer.add_text("train/skip_reason", str(event.get("reason", "")), step, when)
        elif kind == "resume":
            # A crashed session may have logged steps past the checkpoint; purge_step hides those
            # points so each curve shows the trajectory the resumed model really took.
            self._writer.close()
            self._writer = self._writer_class(log_dir=str(self.log_dir), purge_step=step + 1)
        if kind in ("eval", "end"):
            self._writer.flush()  # eval results matter most to a watching user: show them now

    def close(self) -> None:
        self._flush_clips()
        self._writer.close()

    def _add_clip(self, event: dict, step: int, when: Optional[float]) -> None:
        # The layer is a module name ("layers.3.attn") or an index; either reads well in a tag.
        layer = str(event["layer"]) if not isinstance(event["layer"], int) else f"layer{event['layer']}"
        heads, max_logit, min_factor = self._clips.get(layer, [0, float("-inf"), float("inf")])
        self._clips[layer] = [heads + 1, max(max_logit, float(event["max_logit"])),
                              min(min_factor, float(event["factor"]))]
        self._clip_step, self._clip_time = step, when

    def _flush_clips(self) -> None:
        for layer, (heads, max_logit, min_factor) in self._clips.items():
            for name, value in (("clipped_heads", heads), ("max_logit", max_logit),
                                ("min_factor", min_factor)):
                self._scalar(f"qk_clip/{layer}/{name}", value, self._clip_step, self._clip_time)
        self._clips = {}

    def _scalar(self, tag: str, value, step: int, when: Optional[float]) -> None:
        # None (how metrics.jsonl writes a non-finite value) and text are left out; a diverged
        # step shows in train/skipped instead.
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            self._writer.add_scalar(tag, float(value), step, walltime=when)
