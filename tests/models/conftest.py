"""Fixtures for model tests: Hydra composition of the model presets in conf/model/."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from kimik3.config.schema import ModelConfig
from kimik3.config.store import register_configs

CONF = Path(__file__).resolve().parents[2] / "conf"
PRESETS = ["kimi_k3_tiny", "kimi_k3_small", "kimi_linear_48b_a3b", "kda_dense_1b", "kimi_3b_a1b"]


def _compose_model(name: str) -> ModelConfig:
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[f"model={name}"])
    model = OmegaConf.to_object(cfg.model)
    assert isinstance(model, ModelConfig)
    return model


@pytest.fixture
def compose_model() -> Callable[[str], ModelConfig]:
    """name -> the ModelConfig that `model=<name>` composes to."""
    return _compose_model


@pytest.fixture(params=PRESETS)
def preset_name(request) -> str:
    return request.param
