"""Model builders: one explicit dict from `model.arch` to a constructor."""

from __future__ import annotations

from typing import Callable

from kimik3.config.schema import ModelConfig
from kimik3.models.base import LanguageModel, LMOutput
from kimik3.models.smoke import SmokeTestLM


def _build_smoke(cfg: ModelConfig, vocab_size: int) -> LanguageModel:
    return SmokeTestLM(vocab_size, cfg.hidden_size)


def _build_kimi_k3(cfg: ModelConfig, vocab_size: int) -> LanguageModel:
    from kimik3.models.kimi_k3 import KimiK3

    return KimiK3(cfg, vocab_size)


BUILDERS: dict[str, Callable[[ModelConfig, int], LanguageModel]] = {
    "smoke_test_lm": _build_smoke,
    "kimi_k3": _build_kimi_k3,
}


def build_model(cfg: ModelConfig, vocab_size: int) -> LanguageModel:
    """Build the model named by cfg.arch for a dataset of `vocab_size` tokens (on the current default device)."""
    if cfg.arch not in BUILDERS:
        raise ValueError(f"model.arch={cfg.arch!r} is not one of {sorted(BUILDERS)}")
    return BUILDERS[cfg.arch](cfg, vocab_size)


__all__ = ["BUILDERS", "LMOutput", "LanguageModel", "build_model"]
