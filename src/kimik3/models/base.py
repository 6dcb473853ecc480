"""What the trainer needs from any language model: `LMOutput` and the `LanguageModel` hooks.

The trainer talks to every architecture through this small surface, so it never imports a model
class: forward -> LMOutput, `on_step_end` after each optimizer attempt, `diagnostics` at log steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from torch import Tensor, nn


@dataclass
class LMOutput:
    """Result of a forward pass.

    loss: the objective to backpropagate (lm_loss plus any auxiliary terms), when targets were given.
    lm_loss: mean next-token cross-entropy alone (what is reported as train/val loss).
    logits: [B, T, vocab] when no targets were given (training never materialises them in full).
    """

    loss: Optional[Tensor] = None
    lm_loss: Optional[Tensor] = None
    logits: Optional[Tensor] = None


class LanguageModel(nn.Module):
    """Base of kimik3 models: default (no-op) trainer hooks."""

    def on_step_end(self, applied: Union[bool, Tensor]) -> None:
        """Called once per optimizer attempt, after `optimizer.step()` (applied) or a skip. The
        trainer passes a 0-dim bool tensor (its skip decision stays on the device: no host sync).

        Models with per-step state (the MoE router bias, QK-Clip logit trackers) update or reset
        it here, so that state moves once per optimizer step and never on a skipped one.
        """

    def diagnostics(self) -> dict[str, float]:
        """Scalar statistics for metrics.jsonl at log steps (e.g. MoE load); empty by default."""
        return {}
