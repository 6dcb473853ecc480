"""config/validate.py: every cross-field rule raises one line naming the fields."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kimik3.config.schema import RootConfig
from kimik3.config.validate import ConfigError, resolve_device, resolve_precision, validate, validate_vocab


def root(**train) -> RootConfig:
    cfg = RootConfig()
    cfg.train = dataclasses.replace(cfg.train, **train)
    return cfg


@pytest.mark.parametrize("change, message", [
    (lambda c: setattr(c.model, "arch", "gpt"), r"model.arch='gpt' is not one of \['smoke_test_lm', 'kimi_k3'\]"),
    (lambda c: setattr(c.model, "kda_implementation", "cuda"), "model.kda_implementation='cuda' is not one of"),
    (lambda c: setattr(c.model, "layer_types", ["kda", "mla", "gqa", "kda"]), r"model.layer_types\[2\]='gqa'"),
    (lambda c: setattr(c.model, "layer_types", ["kda"]), "model.layer_types has 1 entries but model.num_layers=4"),
    (lambda c: setattr(c.train, "optimizer", "sgd"), "train.optimizer='sgd' is not one of"),
    (lambda c: setattr(c.train, "schedule", "linear"), "train.schedule='linear' is not one of"),
    (lambda c: setattr(c.train, "data_end", "wrap"), "train.data_end='wrap' is not one of"),
    (lambda c: setattr(c.train, "objective", "accuracy"), "train.objective='accuracy' is not one of"),
    (lambda c: setattr(c.data, "tokenizer", "sentencepiece"), "data.tokenizer='sentencepiece' is not one of"),
    (lambda c: setattr(c.train, "batch_size", 0), "train.batch_size=0 must be >= 1"),
    (lambda c: setattr(c.train, "grad_accum_steps", -1), "train.grad_accum_steps=-1 must be >= 1"),
    (lambda c: setattr(c.model, "hidden_size", 0), "model.hidden_size=0 must be >= 1"),
    (lambda c: setattr(c.train, "lr", 0.0), r"train.lr=0.0 must be > 0"),
    (lambda c: setattr(c.train, "grad_clip", -1.0), r"train.grad_clip=-1.0 must be > 0"),
    (lambda c: setattr(c.train, "max_tokens", 100), "train.max_tokens=100 is less than one step of .*=2048 tokens"),
    (lambda c: setattr(c.train, "warmup_steps", -1), "train.warmup_steps=-1 must be >= 0"),
    (lambda c: setattr(c.train, "beta1", 1.5), r"train.beta1=1.5 must be in \[0, 1\)"),
    (lambda c: setattr(c.train, "beta2", 1.0), r"train.beta2=1.0 must be in \[0, 1\)"),
    (lambda c: setattr(c.train, "eps", -1e-8), "train.eps=-1e-08 must be >= 0"),
    (lambda c: setattr(c.train, "weight_decay", -0.1), "train.weight_decay=-0.1 must be >= 0"),
    (lambda c: setattr(c.train, "muon_momentum", 1.0), r"train.muon_momentum=1.0 must be in \[0, 1\)"),
    (lambda c: (setattr(c.train, "schedule", "wsd"), setattr(c.train, "warmup_steps", 190)),
     "train.warmup_steps=190 overlaps the WSD decay, which starts at step 160"),
    (lambda c: setattr(c.train, "seq_len", 8192), "train.seq_len=8192 exceeds model.max_seq_len=4096"),
    (lambda c: setattr(c.train, "device", "tpu"), "train.device='tpu' is not one of auto, cpu, cuda, cuda:<index>"),
    (lambda c: setattr(c.train, "precision", "fp16"), r"train.precision='fp16' is not one of \['auto', 'fp32', 'bf16'\]"),
    (lambda c: setattr(c.train.profile, "active", 0), "train.profile wait=1, warmup=1, active=0"),
    (lambda c: (setattr(c.train.profile, "enabled", True), setattr(c.train.profile, "wait", 300)),
     "train.profile window wait\\+warmup\\+active=303 exceeds train.max_steps=200"),
    (lambda c: (setattr(c.train.profile, "enabled", True), setattr(c.train, "max_tokens", 4096)),
     "train.profile window wait\\+warmup\\+active=4 exceeds the 2 steps of train.max_tokens=4096"),
])
def test_invalid_configs_fail_with_one_line(change, message):
    cfg = RootConfig()
    change(cfg)
    with pytest.raises(ConfigError, match=message) as e:
        validate(cfg)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("field, value, message", [
    ("conv_size", 0, "model.conv_size=0 must be >= 1"),
    ("kv_lora_rank", 0, "model.kv_lora_rank=0 must be >= 1"),
    ("qk_nope_head_dim", 0, "model.qk_nope_head_dim=0 must be >= 1"),
    ("qk_rope_head_dim", -2, "model.qk_rope_head_dim=-2 must be >= 0"),
    ("v_head_dim", 0, "model.v_head_dim=0 must be >= 1"),
    ("intermediate_size", 0, "model.intermediate_size=0 must be >= 1"),
    ("num_experts", -2, "model.num_experts=-2 must be >= 0"),
    ("first_k_dense", -1, "model.first_k_dense=-1 must be >= 0"),
    ("top_k", 0, "model.top_k=0 must be >= 1"),
    ("num_shared_experts", -1, "model.num_shared_experts=-1 must be >= 0"),
    ("moe_intermediate_size", 0, "model.moe_intermediate_size=0 must be >= 1"),
    ("mla_num_heads", 0, r"model.mla_num_heads=0 must be >= 1 \(or null\)"),  # 0 read as unset: num_heads
    ("q_lora_rank", 0, r"model.q_lora_rank=0 must be >= 1 \(or null\)"),
])
def test_zero_or_negative_kimi_k3_widths_fail_with_one_line(field, value, message):
    """Each of these built a model that trained (zero outputs, or mla_num_heads=0 taken as num_heads)
    or failed with a traceback in the first step, after the run dir was made."""
    cfg = RootConfig()
    setattr(cfg.model, field, value)
    with pytest.raises(ConfigError, match=message) as e:
        validate(cfg)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("fields, message", [
    ({"init_std": -0.02}, "model.init_std=-0.02 must be >= 0"),
    ({"norm_eps": -1e-6}, "model.norm_eps=-1e-06 must be >= 0"),
    ({"z_loss_weight": -1.0}, "model.z_loss_weight=-1.0 must be >= 0"),
    ({"aux_loss_weight": -0.1}, "model.aux_loss_weight=-0.1 must be >= 0"),
    ({"bias_update_rate": float("nan")}, "model.bias_update_rate=nan must be >= 0"),
    ({"gate_form": "bounded", "gate_lower_bound": 1.0}, "model.gate_lower_bound=1.0 must be < 0 with model.gate_form=bounded"),
    ({"mla_use_rope": True, "rope_theta": 0.0}, "model.rope_theta=0.0 must be > 0 with model.mla_use_rope=true"),
    ({"mla_use_rope": True, "qk_rope_head_dim": 15}, "model.qk_rope_head_dim=15 must be even with model.mla_use_rope=true"),
])
def test_out_of_range_kimi_k3_scalars_fail_with_one_line(fields, message):
    """Each of these ran until a NaN, a traceback or the first forward, after the run dir was made."""
    cfg = RootConfig()
    for field, value in fields.items():
        setattr(cfg.model, field, value)
    with pytest.raises(ConfigError, match=message) as e:
        validate(cfg)
    assert "\n" not in str(e.value)


def test_rope_and_bounded_gate_values_matter_only_when_used():
    cfg = RootConfig()
    cfg.model.rope_theta, cfg.model.qk_rope_head_dim, cfg.model.gate_lower_bound = 0.0, 15, 1.0  # NoPE, softplus
    validate(cfg)


def test_widths_of_unused_parts_are_not_checked():
    """No dense layer: intermediate_size is unused; no experts: the MoE widths are; smoke: all."""
    cfg = RootConfig()
    cfg.model.first_k_dense, cfg.model.intermediate_size = 0, 0
    validate(cfg)
    cfg.model.num_experts, cfg.model.first_k_dense, cfg.model.intermediate_size, cfg.model.top_k = 0, 0, 64, 0
    validate(cfg)
    cfg.model.arch, cfg.model.kv_lora_rank = "smoke_test_lm", 0
    validate(cfg)


def test_defaults_validate():
    validate(RootConfig())


@pytest.mark.parametrize("schedule", ["cosine", "wsd", "constant"])
def test_warmup_longer_than_the_run_validates(schedule):
    """`kimik3-train model=smoke train.max_steps=5` keeps the default warmup of 10: accepted (the lr
    never reaches its peak; the session logs a warning, runs/summary.py warmup_warning)."""
    validate(root(schedule=schedule, max_steps=5, warmup_steps=10))


@pytest.mark.parametrize("impl", ["chunk", "naive", "triton"])
def test_seq_len_need_not_be_a_multiple_of_the_kda_chunk(impl):
    """Every KDA form handles a partial last chunk (chunk zero-pads it, tests/ops/test_kda_reference.py
    and the whole model in tests/models/test_kimi_k3.py at T=21, chunk 8); a rule asking for whole chunks
    refused `kimik3-train train.seq_len=100`, which runs."""
    cfg = root(seq_len=100)
    cfg.model.kda_implementation = impl
    validate(cfg)


@pytest.mark.parametrize("impl, ok", [("triton", False), ("fla", False), ("chunk", True), ("naive", True)])
def test_a_kda_chunk_size_the_kernels_would_ignore_is_refused(impl, ok):
    """The Triton kernels and fla always chunk by 64 tokens (ops.kda.KERNEL_CHUNK, function.CHUNK)."""
    cfg = RootConfig()
    cfg.model.kda_implementation, cfg.model.kda_chunk_size = impl, 32
    if ok:
        validate(cfg)
    else:
        with pytest.raises(ConfigError, match=f"model.kda_chunk_size=32 does not apply to model.kda_implementation={impl}, "
                                              "whose kernels use 64-token chunks"):
            validate(cfg)


def test_fla_backend_that_cannot_run_is_refused_before_the_run(monkeypatch):
    """Both failed at the first forward (a traceback, a failed run dir); an MLA-only model never runs KDA."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "fla" else find_spec(name, *a))
    cfg = RootConfig()
    cfg.model.kda_implementation = "fla"
    with pytest.raises(ConfigError, match=r"model.kda_implementation=fla needs flash-linear-attention \(pip install"):
        validate(cfg)
    cfg.model.gate_form = "bounded"
    with pytest.raises(ConfigError, match="model.kda_implementation=fla supports gate_form='softplus' only, got 'bounded'"):
        validate(cfg)
    cfg.model.layer_types = ["mla"] * cfg.model.num_layers
    validate(cfg)


def test_smoke_model_has_no_chunk_rule():
    cfg = root(seq_len=100)
    cfg.model.arch = "smoke_test_lm"
    validate(cfg)


def test_vocab_must_match_the_dataset():
    cfg = RootConfig()
    validate_vocab(cfg.model, 257, "d")  # None takes the dataset's
    cfg.model.vocab_size = 257
    validate_vocab(cfg.model, 257, "d")
    with pytest.raises(ConfigError, match="model.vocab_size=257 does not match the dataset vocab 50000 of d"):
        validate_vocab(cfg.model, 50000, "d")


def test_precision_auto_is_fp32_on_cpu_and_bf16_is_honoured():
    cpu = torch.device("cpu")
    assert resolve_precision("auto", cpu) == "fp32"
    assert resolve_precision("bf16", cpu) == "bf16"
    assert resolve_precision("fp32", cpu) == "fp32"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cuda_requested_without_cuda_is_refused():
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ConfigError, match="train.device=cuda but CUDA is not available"):
        resolve_device("cuda")
    with pytest.raises(ConfigError, match="train.device=cuda:1 but CUDA is not available"):
        validate(root(device="cuda:1"))
