"""benchmarks/train_step.py keeps working: a tiny CPU run through the real trainer step, with the profile."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location("train_step_bench", REPO / "benchmarks" / "train_step.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_train_step_benchmark_tiny_cpu(tmp_path: pathlib.Path) -> None:
    bench = _load()
    out = tmp_path / "bench.json"
    result = bench.main(["--model", "kimi_k3_tiny", "--batch", "1", "--seq", "64", "--warmup", "1", "--steps", "1",
                         "--profile", "--out", str(out), "train.device=cpu", "train.optimizer=muon"])
    assert json.loads(out.read_text()) == result
    ours = result["ours"]
    assert ours["tokens_per_s"] > 0 and ours["step_ms"] > 0 and ours["first_step_s"] > 0
    assert ours["applied"] and ours["loss"] > 0  # a real optimizer step ran
    assert result["flops_per_token"] > 6 * result["params_activated"]  # + attention and KDA terms
    assert 0 < ours["mfu_measured_matmul"]
    components = ours["profile"]["components_ms"]
    # the tiny preset has KDA, MLA and MoE layers: each must be attributed, and the optimizer too
    for part in ("kda pointwise", "attention (MLA/SDPA)", "moe experts", "optimizer", "loss (head + CE)"):
        assert components.get(part, 0) > 0, (part, components)


def test_rejects_zero_steps() -> None:
    with pytest.raises(SystemExit):
        _load().main(["--steps", "0"])
