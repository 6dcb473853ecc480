"""Cross-field checks of a composed RootConfig, run once before anything is built.

Hydra and the dataclass schemas already reject unknown keys and wrong types at compose time; this
module checks what a type cannot express (choices, positive sizes, device vs precision, seq_len vs
the model, the profiler window). Every failure is a `ConfigError` whose message is
one line naming the fields, their values and what would be accepted.

`validate(cfg)` needs only the config; `validate_vocab` and `validate_val_split` run once the dataset
is open.
`resolve_device` / `resolve_precision` turn the `auto` values into what actually runs.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from omegaconf import DictConfig, OmegaConf

from kimik3.config.schema import (
    DATA_END_POLICIES,
    GATE_FORMS,
    KDA_IMPLEMENTATIONS,
    LAYER_TYPES,
    LOGGERS,
    MODEL_ARCHS,
    OBJECTIVES,
    OPTIMIZERS,
    PARALLELISMS,
    PRECISIONS,
    SCHEDULES,
    TOKENIZERS,
    ModelConfig,
    RootConfig,
    TrainConfig,
)
from kimik3.ops.kda import KERNEL_CHUNK
from kimik3.runs.tensorboard import MISSING_PACKAGE as TENSORBOARD_MISSING, tensorboard_available


FIXED_CHUNK_KDA = ("triton", "fla")
"""kda_implementation values whose chunk is ops.kda.KERNEL_CHUNK whatever model.kda_chunk_size says."""


class ConfigError(ValueError):
    """A composed config that cannot run; the message is one line naming the fields."""


def validate(cfg: RootConfig) -> None:
    """Raise ConfigError for the first problem found; silent when the config can run."""
    _check_choices(cfg)
    _check_sizes(cfg)
    _check_train_fields(cfg.train)
    resolve_precision(cfg.train.precision, resolve_device(cfg.train.device))
    if cfg.train.seq_len > cfg.model.max_seq_len:
        raise ConfigError(
            f"train.seq_len={cfg.train.seq_len} exceeds model.max_seq_len={cfg.model.max_seq_len}"
        )


def check_known_keys(node: DictConfig, prefix: str = "") -> None:
    """Refuse keys the schema does not have. Hydra's `+key=value` adds a key even to a structured
    node, and OmegaConf.to_object would then drop it silently: a typo would go unnoticed."""
    schema = OmegaConf.get_type(node)
    fields = {f.name for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else None
    for key in node.keys():
        if fields is not None and key not in fields:
            raise ConfigError(f"{prefix}{key} is not a field of {schema.__name__} (added with '+'?); "
                              f"fields: {', '.join(sorted(fields))}")
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            check_known_keys(child, f"{prefix}{key}.")


def validate_vocab(model: ModelConfig, data_vocab: int, data_path: str) -> None:
    """model.vocab_size (when set) must equal the prepared dataset's vocab."""
    if model.vocab_size is not None and model.vocab_size != data_vocab:
        raise ConfigError(
            f"model.vocab_size={model.vocab_size} does not match the dataset vocab {data_vocab} of "
            f"{data_path}; set model.vocab_size=null to take the dataset's"
        )


def validate_val_split(val_tokens: int, val_fraction: Optional[float], data_path: str) -> None:
    """Training evaluates on the val split (eval events, the final val_loss, train.objective=val_loss),
    so a dataset prepared with data.val_fraction=0 (kimik3-prepare accepts it: all tokens to train)
    cannot be trained on. Said here, naming the cause; the val loader would only report a split
    shorter than one batch and point at the batch size."""
    if val_tokens == 0:
        raise ConfigError(
            f"the val split of {data_path} is empty (prepared with data.val_fraction={val_fraction}) and training "
            "evaluates on it; prepare the data with data.val_fraction > 0 (the default is 0.05)"
        )


def resolve_device(name: str) -> torch.device:
    """auto -> cuda when available, else cpu; an explicit cuda device must exist."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda" or (name.startswith("cuda:") and name[5:].isdigit()):
        if not torch.cuda.is_available():
            raise ConfigError(f"train.device={name} but CUDA is not available; use train.device=cpu or auto")
        index = int(name[5:]) if ":" in name else 0
        if index >= torch.cuda.device_count():
            raise ConfigError(f"train.device={name} but only {torch.cuda.device_count()} CUDA device(s) exist")
        return torch.device(name)
    raise ConfigError(f"train.device={name!r} is not one of auto, cpu, cuda, cuda:<index>")


def resolve_precision(precision: str, device: torch.device) -> str:
    """auto -> bf16 on a CUDA device that supports it, fp32 elsewhere (CPU bf16 autocast works but is
    slower than fp32 on most CPUs); an explicit bf16 is honoured on CPU and refused on a CUDA device
    without bf16."""
    if precision not in PRECISIONS:
        raise ConfigError(f"train.precision={precision!r} is not one of {list(PRECISIONS)}")
    cuda_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    if precision == "auto":
        return "bf16" if cuda_bf16 else "fp32"
    if precision == "bf16" and device.type == "cuda" and not cuda_bf16:
        raise ConfigError(
            f"train.precision=bf16 but {torch.cuda.get_device_name(device)} has no bf16 support; use train.precision=fp32"
        )
    return precision


def _check_choices(cfg: RootConfig) -> None:
    choices = [
        ("model.arch", cfg.model.arch, MODEL_ARCHS),
        ("model.kda_implementation", cfg.model.kda_implementation, KDA_IMPLEMENTATIONS),
        ("model.gate_form", cfg.model.gate_form, GATE_FORMS),
        ("train.optimizer", cfg.train.optimizer, OPTIMIZERS),
        ("train.schedule", cfg.train.schedule, SCHEDULES),
        ("train.precision", cfg.train.precision, PRECISIONS),
        ("train.parallel", cfg.train.parallel, PARALLELISMS),
        ("train.logger", cfg.train.logger, LOGGERS),
        ("train.objective", cfg.train.objective, OBJECTIVES),
        ("train.data_end", cfg.train.data_end, DATA_END_POLICIES),
        ("data.tokenizer", cfg.data.tokenizer, TOKENIZERS),
    ]
    choices += [(f"model.layer_types[{i}]", t, LAYER_TYPES) for i, t in enumerate(cfg.model.layer_types or [])]
    for name, value, accepted in choices:
        if value not in accepted:
            raise ConfigError(f"{name}={value!r} is not one of {list(accepted)}")


def _check_sizes(cfg: RootConfig) -> None:
    m, t = cfg.model, cfg.train
    positive = {
        "model.hidden_size": m.hidden_size, "model.num_layers": m.num_layers, "model.num_heads": m.num_heads,
        "model.head_dim": m.head_dim, "model.max_seq_len": m.max_seq_len, "model.kda_chunk_size": m.kda_chunk_size,
        "train.batch_size": t.batch_size, "train.seq_len": t.seq_len, "train.grad_accum_steps": t.grad_accum_steps,
        "train.max_steps": t.max_steps, "train.eval_interval": t.eval_interval, "train.eval_steps": t.eval_steps,
        "train.log_interval": t.log_interval, "train.checkpoint_interval": t.checkpoint_interval,
    }
    optional = {"model.vocab_size": m.vocab_size, "train.max_tokens": t.max_tokens}
    positive.update({k: v for k, v in optional.items() if v is not None})
    for name, value in positive.items():
        if value < 1:
            raise ConfigError(f"{name}={value} must be >= 1")
    if m.layer_types is not None and len(m.layer_types) != m.num_layers:
        raise ConfigError(
            f"model.layer_types has {len(m.layer_types)} entries but model.num_layers={m.num_layers}"
        )
    if m.arch == "kimi_k3":
        _check_kimi_k3_sizes(m)
        _check_kimi_k3_values(m)
        _check_kda_chunk(m)
        _check_fla(m)


def _check_kimi_k3_sizes(m: ModelConfig) -> None:
    """The mixer and FFN widths of kimi_k3. Why here: a zero width builds empty layers that train
    silently (kv_lora_rank=0, v_head_dim=0, intermediate_size=0: their outputs are all zeros), or fails
    with a traceback mid-step after the run dir exists (conv_size=0, top_k=0); and mla_num_heads=0 /
    q_lora_rank=0 would read as unset (num_heads; a full-rank query) or as a zero-width query."""
    at_least = {"model.conv_size": (m.conv_size, 1), "model.kv_lora_rank": (m.kv_lora_rank, 1),
                "model.qk_nope_head_dim": (m.qk_nope_head_dim, 1), "model.qk_rope_head_dim": (m.qk_rope_head_dim, 0),
                "model.v_head_dim": (m.v_head_dim, 1), "model.num_experts": (m.num_experts, 0),
                "model.first_k_dense": (m.first_k_dense, 0)}
    if m.num_experts == 0 or m.first_k_dense > 0:  # a dense SwiGLU layer exists
        at_least["model.intermediate_size"] = (m.intermediate_size, 1)
    if m.num_experts > 0:
        at_least.update({"model.top_k": (m.top_k, 1), "model.num_shared_experts": (m.num_shared_experts, 0),
                         "model.moe_intermediate_size": (m.moe_intermediate_size, 1)})
    optional = {"model.mla_num_heads": m.mla_num_heads, "model.q_lora_rank": m.q_lora_rank}
    at_least.update({k: (v, 1) for k, v in optional.items() if v is not None})
    for name, (value, low) in at_least.items():
        if value < low:
            hint = " (or null)" if name in optional else ""
            raise ConfigError(f"{name}={value} must be >= {low}{hint}")


def _check_kda_chunk(m: ModelConfig) -> None:
    """The Triton kernels and fla chunk by KERNEL_CHUNK tokens; any other kda_chunk_size would be a silent
    no-op there, yet still change the KDA FLOPs behind MFU (models/flops.py) and the size at which
    train.recompute_kda_states=null stops keeping the chunk states (models/kda.py)."""
    if m.kda_implementation in FIXED_CHUNK_KDA and m.kda_chunk_size != KERNEL_CHUNK:
        raise ConfigError(f"model.kda_chunk_size={m.kda_chunk_size} does not apply to model.kda_implementation="
                          f"{m.kda_implementation}, whose kernels use {KERNEL_CHUNK}-token chunks: set "
                          f"{KERNEL_CHUNK}, or kda_implementation=chunk or naive for another size")


def _check_fla(m: ModelConfig) -> None:
    """kda_implementation=fla with the bounded gate or without the package failed at the first forward,
    with a traceback and a failed run dir; models.kda.check_fla_backend holds the rule."""
    if m.kda_implementation != "fla":
        return
    from kimik3.models.blocks import resolve_layer_types
    from kimik3.models.kda import check_fla_backend

    if "kda" in resolve_layer_types(m):
        try:
            check_fla_backend(m.gate_form)
        except ValueError as e:
            raise ConfigError(str(e)) from None


def _check_kimi_k3_values(m: ModelConfig) -> None:
    """The kimi_k3 scalars a type cannot bound. Why here: out of range they diverge or stop late, after
    the data is prepared and the run dir made: rope_theta <= 0 gives NaN angles (a run 'diverged' at
    step 1), an odd rotary dim was refused only by the first forward, a negative init_std by a
    traceback; a gate_lower_bound >= 0 makes the bounded gate grow the KDA state instead of decaying it;
    negative loss weights or bias rate reward imbalance and large logits."""
    non_negative = {"model.init_std": m.init_std, "model.norm_eps": m.norm_eps,
                    "model.z_loss_weight": m.z_loss_weight, "model.aux_loss_weight": m.aux_loss_weight,
                    "model.bias_update_rate": m.bias_update_rate}
    for name, value in non_negative.items():
        if not value >= 0:
            raise ConfigError(f"{name}={value} must be >= 0")
    if m.gate_form == "bounded" and not m.gate_lower_bound < 0:
        raise ConfigError(f"model.gate_lower_bound={m.gate_lower_bound} must be < 0 with model.gate_form=bounded "
                          "(the log decay g lies in (gate_lower_bound, 0))")
    if m.mla_use_rope and not m.rope_theta > 0:
        raise ConfigError(f"model.rope_theta={m.rope_theta} must be > 0 with model.mla_use_rope=true")
    if m.mla_use_rope and m.qk_rope_head_dim % 2:
        raise ConfigError(f"model.qk_rope_head_dim={m.qk_rope_head_dim} must be even with model.mla_use_rope=true "
                          "(RoPE rotates pairs of dims)")


def _check_train_fields(t: TrainConfig) -> None:
    # The optimizer's and the schedule's own rules live with them (optim/): one definition, checked here
    # before the data is prepared.
    from kimik3.optim import check_optimizer

    positive_floats = {"train.lr": t.lr, "train.grad_clip": t.grad_clip, "train.qk_clip_threshold": t.qk_clip_threshold}
    for name, value in positive_floats.items():
        if value is not None and not value > 0:
            raise ConfigError(f"{name}={value} must be > 0 (or null where optional)")
    step_tokens = t.batch_size * t.seq_len * t.grad_accum_steps
    if t.max_tokens is not None and t.max_tokens < step_tokens:
        raise ConfigError(
            f"train.max_tokens={t.max_tokens} is less than one step of batch_size*seq_len*grad_accum_steps={step_tokens} tokens"
        )
    if t.logger == "tensorboard" and not tensorboard_available():
        raise ConfigError(TENSORBOARD_MISSING)
    try:
        check_optimizer(t)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    p = t.profile
    if p.wait < 0 or p.warmup < 0 or p.active < 1:
        raise ConfigError(
            f"train.profile wait={p.wait}, warmup={p.warmup}, active={p.active}: need wait >= 0, warmup >= 0, active >= 1"
        )
    window = p.wait + p.warmup + p.active
    steps = planned_steps(t, step_tokens)  # one process's plan; more ranks share max_tokens in fewer steps
    if p.enabled and window > steps:
        plan = (f"train.max_steps={t.max_steps}" if steps == t.max_steps
                else f"the {steps} steps of train.max_tokens={t.max_tokens}")
        raise ConfigError(f"train.profile window wait+warmup+active={window} exceeds {plan}: "
                          f"the trace would never be written")


def planned_steps(cfg: TrainConfig, tokens_per_step: int) -> int:
    """Steps a recipe runs: max_steps, or fewer when the max_tokens budget runs out first."""
    if cfg.max_tokens is None:
        return cfg.max_steps
    return min(cfg.max_steps, cfg.max_tokens // tokens_per_step)
