"""kimik3-convert end to end: a trained kimi_k3_tiny run -> transformers -> back; init_from; the CLI."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from hf_models import transformers
from kimik3.checkpoint import latest_checkpoint, load_checkpoint
from kimik3.config.schema import DataConfig, ModelConfig, RootConfig, TrainConfig
from kimik3.convert import main
from kimik3.hf.init_from import load_initial_weights
from kimik3.hf.safetensors_io import iter_tensors
from kimik3.models import build_model

REPO = Path(__file__).resolve().parents[2]


def _tiny_root(cache_dir: Path, **model_over) -> RootConfig:
    preset = OmegaConf.load(REPO / "conf" / "model" / "kimi_k3_tiny.yaml")
    preset.pop("defaults")
    model = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), preset, model_over))
    train = TrainConfig(batch_size=2, seq_len=64, max_steps=2, warmup_steps=1, eval_interval=2, eval_steps=1,
                        log_interval=1, checkpoint_interval=2, precision="fp32", device="cpu", logger="none")
    return RootConfig(model=model, train=train, data=DataConfig(cache_dir=str(cache_dir), max_source_bytes=200_000))


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    """A kimi_k3_tiny run dir trained for 2 steps on the embedded corpus (CPU, fp32)."""
    from kimik3.train import run

    root = tmp_path_factory.mktemp("run")
    (root / "run").mkdir()
    run(_tiny_root(root / "cache"), root / "run", run_id="interop", tty=False)
    return root / "run"


def test_export_to_a_full_disk_is_one_line_and_exit_2(trained_run, tmp_path, monkeypatch, capsys):
    import kimik3.hf.safetensors_io as io

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(io, "save_file", full)
    assert main(["export", str(trained_run), str(tmp_path / "hf")]) == 2
    assert capsys.readouterr().err == f"kimik3-convert: error: cannot write {tmp_path / 'hf'}: No space left on device\n"
    assert list(tmp_path.iterdir()) == []


def _trained_model(run_dir: Path):
    payload = load_checkpoint(latest_checkpoint(run_dir))
    cfg = ModelConfig(**payload["config"]["model"])
    model = build_model(cfg, payload["recipe"]["vocab_size"])
    model.load_state_dict(payload["model"])
    return cfg, model.eval(), payload["model"]


@pytest.mark.slow
def test_export_trained_run_then_reimport(trained_run, tmp_path, capsys):
    assert main(["export", str(trained_run), str(tmp_path / "hf")]) == 0
    assert "exported" in capsys.readouterr().out
    cfg, model, state = _trained_model(trained_run)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, model.vocab_size, (2, 50), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs, ours = hf(ids, use_cache=False).logits, model(ids).logits
    assert ((ours - theirs).abs().max() / theirs.abs().max()).item() < 1e-4
    assert main(["import", str(tmp_path / "hf"), str(tmp_path / "k3")]) == 0
    again = dict(iter_tensors(tmp_path / "k3"))
    assert again.keys() == state.keys()
    assert all(torch.equal(again[k], v) for k, v in state.items())
    # init_from takes the run dir itself, the HF export and the re-imported weights alike
    for source in (trained_run, tmp_path / "hf", tmp_path / "k3"):
        fresh = build_model(cfg, model.vocab_size)
        load_initial_weights(fresh, cfg, source)
        assert all(torch.equal(fresh.state_dict()[k], v) for k, v in state.items())


@pytest.mark.slow
def test_trainer_refuses_init_from_of_another_architecture(trained_run, tmp_path):
    from kimik3.train import run

    assert main(["export", str(trained_run), str(tmp_path / "hf")]) == 0
    cfg = _tiny_root(trained_run.parent / "cache", hidden_size=64, init_from=str(tmp_path / "hf"))
    (tmp_path / "run").mkdir()
    with pytest.raises(ValueError, match=r"model.hidden_size=64 but the checkpoint has 128"):
        run(cfg, tmp_path / "run", run_id="x", tty=False)


def test_cli_refuses_unexportable_config_in_one_line(tmp_path, capsys):
    from kimik3.hf.init_from import KIMIK3_META, write_kimik3_meta
    from kimik3.hf.safetensors_io import ShardedWriter

    cfg = ModelConfig(hidden_size=16, num_layers=1, mla_every=0, num_heads=2, head_dim=8, num_experts=0, gate_form="bounded")
    with ShardedWriter(tmp_path / "k3") as w:
        w.add("embed.weight", torch.zeros(4, 16))
        w.extra_files[KIMIK3_META] = write_kimik3_meta(cfg, 4, source="test")
    assert main(["export", str(tmp_path / "k3"), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kimik3-convert: error: model.gate_form='bounded' is not expressible") and err.count("\n") == 1
    assert not (tmp_path / "hf").exists()


@pytest.mark.slow
def test_import_runs_without_transformers(hf_dirs, tmp_path):
    code = ("import sys; sys.modules['transformers'] = None; from kimik3.convert import main; "
            f"sys.exit(main(['import', {str(hf_dirs['hybrid_moe'])!r}, {str(tmp_path / 'k3')!r}]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    meta = json.loads((tmp_path / "k3" / "kimik3.json").read_text())
    assert meta["model"]["layer_types"] == ["kda", "mla", "kda", "mla"] and meta["vocab_size"] == 96


@pytest.mark.slow
def test_import_refuses_a_transposed_tensor_in_one_line(hf_dirs, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "hf"
    shutil.copytree(hf_dirs["hybrid_moe"], bad)
    state = load_file(bad / "model.safetensors")
    name = "model.layers.1.block_sparse_moe.experts.0.w1.weight"  # [16, 32]: 16 rows of the fused [32, 32]
    state[name] = state[name].t().contiguous()
    save_file(state, bad / "model.safetensors", metadata={"format": "pt"})
    assert main(["import", str(bad), str(tmp_path / "k3")]) == 2
    err = capsys.readouterr().err
    assert err == (f"kimik3-convert: error: {name} has shape (32, 16) in the checkpoint, but KimiK3's "
                   f"layers.1.ffn.experts.gate_up_proj (4, 32, 32) needs (16, 32)\n")
    assert not (tmp_path / "k3").exists()


@pytest.mark.parametrize("size", ["0", "-1"])
def test_cli_refuses_a_shard_size_that_is_not_positive_naming_the_option(tmp_path, capsys, size):
    with pytest.raises(SystemExit) as err:
        main(["export", str(tmp_path / "run"), str(tmp_path / "hf"), "--max-shard-gb", size])
    assert err.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"kimik3-convert: error: --max-shard-gb {float(size)} must be positive"
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("make", ["missing", "file"])
def test_import_of_a_path_that_is_not_a_directory_says_so_in_one_line(tmp_path, capsys, make):
    """A mistyped source path is named as such, not as a directory without a config.json."""
    src = tmp_path / "nope"
    if make == "file":
        src.write_text("{}")
    assert main(["import", str(src), str(tmp_path / "k3")]) == 2
    assert capsys.readouterr().err == (f"kimik3-convert: error: {src} does not exist or is not a directory "
                                       f"(expected a transformers checkpoint dir)\n")
    assert not (tmp_path / "k3").exists()
