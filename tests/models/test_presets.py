"""Every model preset composes through Hydra into a ModelConfig that builds (on the meta device)."""

from __future__ import annotations

import torch

from kimik3.models import build_model
from kimik3.models.blocks import resolve_layer_types


def test_preset_composes_and_builds(compose_model, preset_name):
    cfg = compose_model(preset_name)
    assert cfg.name == preset_name and cfg.arch == "kimi_k3"
    with torch.device("meta"):
        model = build_model(cfg, cfg.vocab_size or 256)
    assert len(model.layers) == cfg.num_layers


def test_layer_patterns_of_presets(compose_model):
    assert resolve_layer_types(compose_model("kimi_linear_48b_a3b")).count("mla") == 7  # 4, 8, ..., 24, 27
    assert set(resolve_layer_types(compose_model("kda_dense_1b"))) == {"kda"}
    peer = resolve_layer_types(compose_model("kimi_3b_a1b"))
    assert [i for i, t in enumerate(peer) if t == "mla"] == [4, 8, 12, 16, 20]
    assert resolve_layer_types(compose_model("kimi_k3_tiny")) == ["kda", "kda", "kda", "mla"]
