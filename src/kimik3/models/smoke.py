"""SmokeTestLM: embedding -> linear output head. A plumbing check for the launcher, data and trainer.

It has no sequence mixing at all (each token predicts the next from itself alone), so its losses
say nothing about KimiK3 and are never reported as model results.
"""

from __future__ import annotations

from typing import Optional

import torch.nn.functional as F
from torch import Tensor, nn

from kimik3.models.base import LanguageModel, LMOutput

PLUMBING_LABEL = "smoke_test_lm (plumbing check, not a model result)"


class SmokeTestLM(LanguageModel):
    """Bigram model: logits[b, t] = lm_head(embed(tokens[b, t])).

    The output head is named `lm_head`, as in every kimik3 model: optim/groups.py sends it to AdamW
    by that name (under any other name, a 2-D weight would go to Muon).
    """

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, hidden_size)
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)

    def forward(self, input_ids: Tensor, targets: Optional[Tensor] = None) -> LMOutput:
        logits = self.lm_head(self.embed(input_ids))  # [B, T, vocab]
        if targets is None:
            return LMOutput(logits=logits)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        return LMOutput(loss=loss, lm_loss=loss)
