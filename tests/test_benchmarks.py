"""benchmarks/train_step.py keeps working: a tiny CPU run through the real trainer step, with the profile."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


def _load(script: str = "train_step"):
    spec = importlib.util.spec_from_file_location(f"{script}_bench", REPO / "benchmarks" / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_train_step_benchmark_tiny_cpu(tmp_path: pathlib.Path) -> None:
    bench = _load()
    out = tmp_path / "bench.json"
    result = bench.main(["--model", "kimi_k3_tiny", "--batch", "1", "--seq", "64", "--warmup", "1", "--steps", "1",
                         "--profile", "--host-profile", "2", "--out", str(out), "train.device=cpu", "train.optimizer=muon",
                         "train.activation_checkpointing=true"])
    assert json.loads(out.read_text()) == result
    ours = result["ours"]
    assert ours["tokens_per_s"] > 0 and ours["step_ms"] > 0 and ours["first_step_s"] > 0
    assert ours["valid"] and ours["applied"] and ours["loss"] > 0  # a real optimizer step ran
    assert result["flops_per_token"] > 6 * result["params_activated"]  # + attention and KDA terms
    assert 0 < ours["mfu_measured_matmul"]
    components = ours["profile"]["components_ms"]
    # the tiny preset has KDA, MLA and MoE layers: each must be attributed, and the optimizer too
    for part in ("kda pointwise", "attention (MLA/SDPA)", "qk-clip max logit", "moe experts", "optimizer",
                 "loss (head + CE)", "grad norm/clip"):
        assert components.get(part, 0) > 0, (part, components)
    by_component = ours["profile"]["top_kernels_by_component"]
    assert by_component.keys() == components.keys()
    for comp, kernels in by_component.items():  # each component's kernels, largest first, within its total
        times = [k["ms_per_step"] for k in kernels]
        assert 0 < len(kernels) <= 5 and times == sorted(times, reverse=True)
        assert sum(times) <= components[comp] + 0.01 * len(times), comp
    assert ours["profile"]["gpu_idle"] is None  # a CPU run has no GPU timeline to read
    host = ours["host_profile"]
    assert host["steps"] == 2 and host["profiled_ms"] > 0
    assert any(f["function"].endswith("(train_step)") for f in host["top_kimik3_cumulative"])


def test_train_step_times_a_peer_of_the_same_shape_after_ours(tmp_path: pathlib.Path,
                                                                capsys: pytest.CaptureFixture) -> None:
    """--peer llama builds transformers' Llama at the preset's widths in the same process, after our
    step (whose figure is printed before the peer starts, so a peer that autotunes for minutes or
    dies still leaves it seen), and reports the ratios."""
    pytest.importorskip("transformers")
    result = _load().main(["--model", "kda_dense_1b", "--batch", "1", "--seq", "32", "--warmup", "1", "--steps", "1",
                           "--peer", "llama", "--out", str(tmp_path / "peer.json"), "train.device=cpu",
                           "model.hidden_size=64", "model.num_layers=2", "model.num_heads=2", "model.head_dim=32",
                           "model.intermediate_size=96", "model.vocab_size=256"])
    peer = result["peer"]
    assert peer["kind"] == "llama" and peer["tokens_per_s"] > 0
    assert result["ratios"]["tokens_per_s"] == round(result["ours"]["tokens_per_s"] / peer["tokens_per_s"], 3)
    err = capsys.readouterr().err
    assert "timing peer llama next" in err and f"{result['ours']['tokens_per_s']:,.0f} tokens/s" in err


def test_train_step_builds_the_model_as_kimik3_train_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """The timed model comes from runs.session's own build: train.compile=true compiles each block and
    train.deterministic=true sets the determinism switches for our steps, as in kimik3-train. (The
    benchmark built the model itself and reported "compile": true while timing the eager model.)
    torch.compile is stubbed: a real CPU compile takes minutes here."""
    import torch

    bench = _load()
    compiled: list[str] = []
    deterministic: list[bool] = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, *a, **k: compiled.append(type(self).__name__))
    real_step = bench.train_step

    def spying_step(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        deterministic.append(torch.are_deterministic_algorithms_enabled())
        return real_step(*args, **kwargs)

    monkeypatch.setattr(bench, "train_step", spying_step)
    try:
        result = bench.main(["--model", "kimi_k3_tiny", "--batch", "1", "--seq", "64", "--warmup", "1", "--steps", "1",
                             "train.device=cpu", "train.compile=true", "train.deterministic=true"])
    finally:
        torch.use_deterministic_algorithms(False)
    layers = bench.load_config("kimi_k3_tiny", 1, 64, []).model.num_layers
    assert result["compile"] and result["ours"]["valid"]
    assert len(compiled) == layers > 1 and len(set(compiled)) == 1  # each block, regionally
    assert deterministic == [True, True]


def test_train_step_peer_runs_under_our_precision(monkeypatch: pytest.MonkeyPatch) -> None:
    """The peer's forward runs under the autocast train.precision gives ours (here bf16 on the CPU), so the
    ratio compares one precision policy; it was bf16 on CUDA and fp32 elsewhere whatever ours ran."""
    pytest.importorskip("transformers")
    import torch

    bench = _load()
    seen: list[bool] = []
    real_build = bench.build_peer

    def build_peer(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        model = real_build(*args, **kwargs)
        model.register_forward_pre_hook(lambda *_: seen.append(torch.is_autocast_enabled("cpu")))
        return model

    monkeypatch.setattr(bench, "build_peer", build_peer)
    result = bench.main(["--model", "kda_dense_1b", "--batch", "1", "--seq", "32", "--warmup", "1", "--steps", "1",
                         "--peer", "llama", "train.device=cpu", "train.precision=bf16", "model.hidden_size=64",
                         "model.num_layers=2", "model.num_heads=2", "model.head_dim=32", "model.intermediate_size=96",
                         "model.vocab_size=256"])
    assert seen == [True, True]
    assert result["ours"]["precision"] == result["peer"]["precision"] == "bf16"


def test_rejects_zero_steps() -> None:
    with pytest.raises(SystemExit):
        _load().main(["--steps", "0"])


def test_activation_checkpointing_keeps_gradients() -> None:
    """Per-block checkpointing (train.activation_checkpointing) reruns blocks in backward: same loss and grads."""
    import torch

    from kimik3.models import build_model
    from kimik3.trainer import prepare_for_training

    cfg = _load().load_config("kimi_k3_tiny", 2, 64, ["train.device=cpu"])
    grads = []
    for on in (False, True):
        torch.manual_seed(0)
        model = build_model(cfg.model, 256)
        cfg.train.activation_checkpointing = on
        prepare_for_training(model, cfg.train)
        x = torch.randint(0, 256, (2, 65), generator=torch.Generator().manual_seed(1))
        model(x[:, :-1], x[:, 1:]).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-6, msg=name)


def test_activation_checkpointing_needs_blocks() -> None:
    import torch

    from kimik3.config.schema import TrainConfig
    from kimik3.trainer import prepare_for_training

    with pytest.raises(ValueError, match="no blocks to checkpoint"):
        prepare_for_training(torch.nn.Linear(2, 2), TrainConfig(activation_checkpointing=True))


def test_model_fwd_bwd_reads_the_loss_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """benchmarks/model_fwd_bwd.py queues its steps without a host sync: the loss is read once, after the
    timed loop (it was read by .item() in every step, a sync the trainer's step never makes)."""
    import torch

    reads: list[float] = []
    real_item = torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "item", lambda self: reads.append(real_item(self)) or reads[-1])
    _load("model_fwd_bwd").main(["--model", "kimi_k3_tiny", "--batch", "1", "--seq", "64", "--warmup", "2",
                                 "--steps", "3", "--device", "cpu"])
    assert len(reads) == 1


def test_optimizer_step_benchmark_tiny_cpu() -> None:
    """Both variants step the same parameters from the same start; on the CPU both are torch's AdamW, so
    they end bit-identical and nothing goes through ops.adamw (a CUDA kernel)."""
    result = _load("optimizer_step").main(["--model", "kimi_k3_tiny", "--warmup", "1", "--steps", "2"])
    assert result["params"] > 1_000_000 and result["params_via_ops_adamw"] == 0
    assert result["max_param_diff"] == 0.0
    assert result["ours"]["ms"] > 0 and result["torch_fused"]["ms"] > 0
    assert result["ours"]["gb"] == result["torch_fused"]["gb"] == round(32 * result["params"] / 1e9, 2)


def test_memory_bound_ops_benchmark_tiny_cpu(tmp_path: pathlib.Path) -> None:
    """benchmarks/memory_bound_ops.py runs each op forward and backward at a preset's shapes and sets it
    against the copy bandwidth; on the CPU it times the eager forms the model runs there."""
    bench = _load("memory_bound_ops")
    out = tmp_path / "ops.json"
    result = bench.main(["--model", "kimi_k3_tiny", "--seq", "32", "--warmup", "0", "--iters", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert result["copy_GB_s"] > 0
    ops = result["ops"]
    assert set(ops) == {"short conv + SiLU", "residual add + RMSNorm", "gated RMSNorm (KDA output)", "SwiGLU"}
    # kimi_k3_tiny: 4 layers, 3 of them KDA, 1 dense FFN layer (first_k_dense) before the MoE ones
    assert (ops["short conv + SiLU"]["calls_per_step"], ops["residual add + RMSNorm"]["calls_per_step"],
            ops["SwiGLU"]["calls_per_step"]) == (3, 8, 1)
    for row in ops.values():
        assert row["fwd_ms"] > 0 and row["bwd_ms"] > 0 and row["fwd_floor_ratio"] > 0
        assert abs(row["per_step_ms"] - (row["fwd_ms"] + row["bwd_ms"]) * row["calls_per_step"]) < 0.02


def test_memory_bound_ops_times_only_the_ops_backward() -> None:
    """The conv reads its q|k|v slice of the wide projection output with the layer's strides, but the
    timed backward holds neither the slice's backward (a zero fill of the wide gradient and a copy) nor
    AccumulateGrad's copy into .grad: neither is the op's traffic, and both inflated its backward time
    against its floor (by about the floor itself, by the bytes they move)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    bench = _load("memory_bound_ops")
    model = bench.load_model_config("kimi_k3_tiny", [])
    cases = {c.name: c for c in bench.build_cases(model, 32, torch.device("cpu"), torch.float32)}
    conv = cases["short conv + SiLU"]
    (x,) = conv.inputs()
    C, wide = bench._conv_widths(model)
    assert x.shape == (1, 32, C) and x.stride() == (32 * wide, wide, 1)  # a slice, as in the layer
    for case in cases.values():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            bench.time_case(case, torch.device("cpu"), 0, 1)
        events = prof.events()
        assert not any("slice_backward" in e.name for e in events), case.name
        accumulating = [e for e in events if "AccumulateGrad" in e.name and e.cpu_children]
        assert not accumulating, (case.name, [c.name for e in accumulating for c in e.cpu_children])


def test_memory_bound_ops_checks_conv_dz_tiles(tmp_path: pathlib.Path) -> None:
    """--conv-dz-tile times the Triton conv backward per dz launch config and checks each against the
    fp32 eager conv (here under the interpreter, in a fresh process: Triton picks interpreted kernels when
    the module is first imported); the default tile is marked and restored."""
    from kimik3.ops import conv

    default = f"{conv.DZ_BT}x{conv.DZ_BC}x{conv.DZ_WARPS}"
    other = "8x32x2" if default != "8x32x2" else "16x32x2"
    out = tmp_path / "tiles.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "memory_bound_ops.py"), "--model", "kimi_k3_tiny",
                    "--seq", "40", "--warmup", "0", "--iters", "1", "--conv-dz-tile", default, other,
                    "--out", str(out)], env=env, check=True, capture_output=True)
    tiles = json.loads(out.read_text())["conv_dz_tiles"]
    assert list(tiles) == [default, other] and [t["default"] for t in tiles.values()] == [True, False]
    for row in tiles.values():  # fp32 activations on the CPU: the kernel matches the eager conv closely
        assert row["bwd_ms"] > 0 and max(row["rel_y"], row["rel_dx"], row["rel_dweight"]) < 1e-5


def test_memory_bound_ops_rejects_a_bad_tile(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _load("memory_bound_ops").main(["--conv-dz-tile", "16x60x4"])
    assert exit_info.value.code == 2 and "'16x60x4' is not ROWSxCHANNELSxWARPS" in capsys.readouterr().err


@pytest.mark.parametrize("script", ["memory_bound_ops", "model_fwd_bwd", "optimizer_step", "train_step"])
def test_benchmarks_reject_an_unknown_model_preset(script: str, capsys: pytest.CaptureFixture) -> None:
    """A misspelt --model is one argparse line naming the presets (config.paths.model_presets), not a
    Hydra traceback from deep in the run."""
    with pytest.raises(SystemExit) as exit_info:
        _load(script).main(["--model", "kda_dense_1", "--seq", "8"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "invalid choice: 'kda_dense_1'" in err and "'kda_dense_1b'" in err


@pytest.mark.parametrize("argv", [["--iters", "0"], ["--seq", "-4"]])
def test_memory_bound_ops_rejects_bad_counts(argv: list[str], capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _load("memory_bound_ops").main(argv)
    assert exit_info.value.code == 2 and "--seq and --iters must be >= 1" in capsys.readouterr().err
