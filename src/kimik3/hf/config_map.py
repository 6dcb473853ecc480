"""transformers' Kimi Linear `config.json` <-> kimik3 `ModelConfig`, field by field, both directions.

The reference is transformers 5.17's `KimiLinearConfig` (`model_type: kimi_linear`), read the way it
reads a checkpoint: explicit `layer_types` / `mlp_layer_types` first, then the released
`linear_attn_config` (1-based `full_attn_layers` / `kda_layers`, `head_dim`, `num_heads`,
`short_conv_kernel_size`) and `first_k_dense_replace`, then its defaults. Both sides meet in one
normal form, the *architecture* (`architecture_of`): every field that decides a weight's shape or a
forward's value, resolved (explicit layer types, MLA head count, ...). Export writes it as a config
that transformers loads and that also carries the released keys; import builds a `ModelConfig` from
it; `check_same_architecture` compares two of them for `model.init_from`.

Anything one side cannot express is refused with one line naming the field, never approximated:
RoPE in MLA, the MLA output gate, the bounded KDA gate (export), tied embeddings (transformers'
KimiLinearForCausalLM ignores `tie_word_embeddings`, so import reads lm_head as its own weight),
GQA-style `num_key_value_heads`,
a non-sigmoid router, MTP layers, an interleaved dense/MoE pattern, ... Training-only fields
(z-loss, aux loss, bias update rate) and runtime fields (kda_implementation, chunk size) are not
part of the architecture and are taken from the user's config.

Only json and kimik3 are needed here: a checkpoint's config maps without transformers installed.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping, Optional

from kimik3.config.schema import ModelConfig
from kimik3.models.blocks import is_moe_layer, resolve_layer_types

HF_MODEL_TYPE = "kimi_linear"
HF_ARCHITECTURE = "KimiLinearForCausalLM"
HF_FULL, HF_LINEAR = "full_attention", "linear_attention"
HF_DENSE, HF_SPARSE = "dense", "sparse"
_OURS_TO_HF_LAYER = {"mla": HF_FULL, "kda": HF_LINEAR}
_HF_TO_OURS_LAYER = {v: k for k, v in _OURS_TO_HF_LAYER.items()}

# KimiLinearConfig (transformers 5.17) keeps some values under other names in config.json
# (`attribute_map`): key as written by save_pretrained and the release -> the attribute alias.
_HF_ALIASES = {
    "model_max_length": "max_position_embeddings",
    "moe_renormalize": "norm_topk_prob",
    "num_expert_group": "n_group",
    "num_experts": "num_local_experts",
    "num_experts_per_token": "num_experts_per_tok",
    "num_shared_experts": "n_shared_experts",
}

# KimiLinearConfig's defaults for every key this module reads: a config.json that leaves a key out
# means what transformers would make of it.
_HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 163840,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "moe_intermediate_size": 1024,
    "num_hidden_layers": 27,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "num_shared_experts": 1,
    "routed_scaling_factor": 2.446,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "num_expert_group": 1,
    "topk_group": 1,
    "num_experts_per_token": 8,
    "moe_renormalize": True,
    "hidden_act": "silu",
    "model_max_length": 1048576,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-5,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "num_experts": 256,
    "linear_head_dim": 128,
    "linear_num_heads": 32,
    "linear_conv_kernel_dim": 4,
}

# Keys of released / remote-code configs that change the math; the value kimik3 (and transformers
# 5.17) implements. Any other value is refused on import.
_HF_REQUIRED_VALUES: dict[str, Any] = {
    "hidden_act": "silu",
    "attention_bias": False,
    "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid",
    "moe_layer_freq": 1,
    "num_nextn_predict_layers": 0,
    "mla_use_nope": True,
    "mla_use_output_gate": False,
}
_HF_LINEAR_REQUIRED_VALUES: dict[str, Any] = {  # the same, inside `linear_attn_config`
    "use_full_rank_gate": False,
    "kda_layer_index_base": 1,
}

# ModelConfig fields that make up the architecture (weight shapes and forward values), in the order
# errors list them. `layer_types` is always the resolved per-layer list.
ARCH_FIELDS = (
    "arch", "vocab_size", "hidden_size", "num_layers", "layer_types", "norm_eps", "tie_embeddings",
    "num_heads", "head_dim", "conv_size", "gate_form", "gate_lower_bound",
    "mla_num_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
    "v_head_dim", "mla_use_rope", "mla_output_gate",
    "intermediate_size", "num_experts", "top_k", "num_shared_experts", "moe_intermediate_size",
    "first_k_dense", "routed_scaling_factor", "n_group", "topk_group",
)


class HFConfigError(ValueError):
    """A config one side cannot express; the message is one line naming the field."""


def architecture_of(cfg: ModelConfig, vocab_size: Optional[int] = None) -> dict[str, Any]:
    """The normal form two configs are compared in: ARCH_FIELDS, resolved.

    MoE-only fields collapse when no layer is MoE, and the bounded gate's lower bound only counts
    in that form, so configs that build the same model compare equal.
    """
    arch = {name: getattr(cfg, name) for name in ARCH_FIELDS}
    arch["vocab_size"] = vocab_size if vocab_size is not None else cfg.vocab_size
    arch["layer_types"] = resolve_layer_types(cfg)
    arch["mla_num_heads"] = cfg.mla_num_heads if cfg.mla_num_heads is not None else cfg.num_heads
    first_dense = sum(1 for i in range(cfg.num_layers) if not is_moe_layer(cfg, i))
    arch["first_k_dense"] = first_dense
    if first_dense == cfg.num_layers:
        for name in ("num_experts", "top_k", "num_shared_experts", "moe_intermediate_size",
                     "routed_scaling_factor", "n_group", "topk_group"):
            arch[name] = None
    if cfg.gate_form != "bounded":
        arch["gate_lower_bound"] = None
    if "mla" not in arch["layer_types"]:
        for name in ("mla_num_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                     "qk_rope_head_dim", "v_head_dim", "mla_use_rope", "mla_output_gate"):
            arch[name] = None
    if "kda" not in arch["layer_types"]:
        for name in ("num_heads", "head_dim", "conv_size", "gate_form", "gate_lower_bound"):
            arch[name] = None
    return arch


def check_same_architecture(ours: ModelConfig, theirs: ModelConfig, *, vocab_size: Optional[int],
                            source: str) -> None:
    """Raise one line listing every architecture field where `ours` differs from checkpoint `theirs`."""
    a, b = architecture_of(ours, vocab_size), architecture_of(theirs)
    if a["vocab_size"] is None:
        a["vocab_size"] = b["vocab_size"]
    diffs = [f"model.{k}={a[k]!r} but the checkpoint has {b[k]!r}" for k in ARCH_FIELDS if a[k] != b[k]]
    if diffs:
        raise HFConfigError(f"{source} does not match the model config: " + "; ".join(diffs))


# --------------------------------------------------------------------------- HF -> kimik3


def _get(hf: Mapping[str, Any], key: str) -> Any:
    """Value of `key` under its config.json name or its transformers alias, else the HF default."""
    alias = _HF_ALIASES.get(key)
    if key in hf and alias in hf and hf[key] != hf[alias]:
        raise HFConfigError(f"config.json {key}={hf[key]!r} disagrees with its alias {alias}={hf[alias]!r}")
    if key in hf:
        return hf[key]
    if alias is not None and alias in hf:
        return hf[alias]
    return _HF_DEFAULTS[key]


def _hf_layer_types(hf: Mapping[str, Any], n: int, linear: Mapping[str, Any]) -> list[str]:
    """transformers' precedence: layer_types > linear_attn_config lists (1-based) > every 4th (0-based i>0)."""
    if hf.get("layer_types") is not None:
        types = list(hf["layer_types"])
    elif "full_attn_layers" in linear and "kda_layers" in linear:
        types = [None] * n
        for layer in linear["full_attn_layers"]:
            types[layer - 1] = HF_FULL
        for layer in linear["kda_layers"]:
            types[layer - 1] = HF_LINEAR
    else:
        types = [HF_FULL if i and i % 4 == 0 else HF_LINEAR for i in range(n)]
    if len(types) != n or any(t not in _HF_TO_OURS_LAYER for t in types):
        raise HFConfigError(
            f"config.json layer types {types} are not {n} entries of {sorted(_HF_TO_OURS_LAYER)}")
    return [_HF_TO_OURS_LAYER[t] for t in types]


def _hf_first_k_dense(hf: Mapping[str, Any], n: int) -> int:
    """Number of leading dense FFN layers; kimik3 has no other dense/MoE pattern."""
    if hf.get("mlp_layer_types") is None:
        return min(int(hf.get("first_k_dense_replace", 1)), n)
    types = list(hf["mlp_layer_types"])
    k = sum(1 for t in types if t == HF_DENSE)
    if len(types) != n or types != [HF_DENSE] * k + [HF_SPARSE] * (n - k):
        raise HFConfigError(
            f"config.json mlp_layer_types={types} is not k 'dense' then 'sparse' layers "
            f"(kimik3 expresses only model.first_k_dense)")
    return k


def _check_hf_supported(hf: Mapping[str, Any], linear: Mapping[str, Any]) -> None:
    if hf.get("model_type", HF_MODEL_TYPE) != HF_MODEL_TYPE:
        raise HFConfigError(f"config.json model_type={hf['model_type']!r} is not {HF_MODEL_TYPE!r}")
    required = [(key, want, _get(hf, key) if key in _HF_DEFAULTS else hf.get(key, want))
                for key, want in _HF_REQUIRED_VALUES.items()]
    required += [(f"linear_attn_config.{key}", want, linear.get(key, want))
                 for key, want in _HF_LINEAR_REQUIRED_VALUES.items()]
    for key, want, got in required:
        if got != want and not (got is None and want is False):
            raise HFConfigError(f"config.json {key}={got!r} is not supported (kimik3 implements {want!r})")
    if float(_get(hf, "attention_dropout")) != 0.0:
        raise HFConfigError(
            f"config.json attention_dropout={hf['attention_dropout']!r} is not supported (kimik3 has none)")
    heads, kv_heads = _get(hf, "num_attention_heads"), _get(hf, "num_key_value_heads")
    if kv_heads is not None and kv_heads != heads:  # None: transformers takes num_attention_heads
        raise HFConfigError(
            f"config.json num_key_value_heads={kv_heads} != num_attention_heads={heads} "
            f"(MLA expands keys per head; kimik3 has no shared-KV form)")


def model_config_from_hf(hf: Mapping[str, Any], *, base: Optional[ModelConfig] = None) -> ModelConfig:
    """A kimik3 ModelConfig with the architecture of HF `config.json` dict `hf`.

    Fields outside the architecture (kda_implementation, training-only weights, name) come from
    `base` (default: ModelConfig()); `name` becomes 'kimi_linear_import' unless base sets one.
    """
    linear = dict(hf.get("linear_attn_config") or {})
    _check_hf_supported(hf, linear)
    n = int(_get(hf, "num_hidden_layers"))
    layer_types = _hf_layer_types(hf, n, linear)
    first_k_dense = _hf_first_k_dense(hf, n)
    num_experts = int(_get(hf, "num_experts")) if first_k_dense < n else 0
    bounded = linear.get("gate_lower_bound") is not None
    fields: dict[str, Any] = dict(
        arch="kimi_k3",
        vocab_size=int(_get(hf, "vocab_size")),
        max_seq_len=int(_get(hf, "model_max_length")),
        hidden_size=int(_get(hf, "hidden_size")),
        num_layers=n,
        layer_types=layer_types,
        norm_eps=float(_get(hf, "rms_norm_eps")),
        tie_embeddings=False,  # KimiLinearForCausalLM never ties (no _tied_weights_keys): lm_head is its own
        init_std=float(_get(hf, "initializer_range")),
        num_heads=int(linear.get("num_heads", _get(hf, "linear_num_heads"))),
        head_dim=int(linear.get("head_dim", _get(hf, "linear_head_dim"))),
        conv_size=int(linear.get("short_conv_kernel_size", _get(hf, "linear_conv_kernel_dim"))),
        gate_form="bounded" if bounded else "softplus",
        mla_num_heads=int(_get(hf, "num_attention_heads")),
        q_lora_rank=_get(hf, "q_lora_rank"),
        kv_lora_rank=int(_get(hf, "kv_lora_rank")),
        qk_nope_head_dim=int(_get(hf, "qk_nope_head_dim")),
        qk_rope_head_dim=int(_get(hf, "qk_rope_head_dim")),
        v_head_dim=int(_get(hf, "v_head_dim")),
        mla_use_rope=False,
        mla_output_gate=False,
        intermediate_size=int(_get(hf, "intermediate_size")),
        num_experts=num_experts,
        top_k=int(_get(hf, "num_experts_per_token")),
        num_shared_experts=int(_get(hf, "num_shared_experts")),
        moe_intermediate_size=int(_get(hf, "moe_intermediate_size")),
        first_k_dense=first_k_dense,
        routed_scaling_factor=float(_get(hf, "routed_scaling_factor")),
        n_group=int(_get(hf, "num_expert_group")),
        topk_group=int(_get(hf, "topk_group")),
    )
    if bounded:
        fields["gate_lower_bound"] = float(linear["gate_lower_bound"])
    base = base if base is not None else ModelConfig(name="kimi_linear_import")
    return dataclasses.replace(base, **fields)


def read_json(path: Path) -> Any:
    """A JSON file's value; a file that does not parse (truncated, an HTML error page or a Git LFS
    pointer saved in its place) is a ValueError naming it, which json's own message does not."""
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from err


def read_hf_config(hf_dir: str | Path) -> dict[str, Any]:
    """The config.json of a transformers checkpoint dir, as a dict."""
    path = Path(hf_dir) / "config.json"
    if not Path(hf_dir).is_dir():  # a mistyped path: say so, rather than that a config is missing
        raise FileNotFoundError(f"{hf_dir} does not exist or is not a directory (expected a transformers "
                                f"checkpoint dir)")
    if not path.is_file():
        raise FileNotFoundError(f"{hf_dir} has no config.json (not a transformers checkpoint dir)")
    return read_json(path)


def config_from_hf_dir(hf_dir: str | Path, *, base: Optional[ModelConfig] = None) -> ModelConfig:
    """ModelConfig of a transformers Kimi Linear checkpoint dir (reads only its config.json)."""
    return model_config_from_hf(read_hf_config(hf_dir), base=base)


# --------------------------------------------------------------------------- kimik3 -> HF


def _refuse_unexportable(cfg: ModelConfig, arch: Mapping[str, Any]) -> None:
    if cfg.arch != "kimi_k3":
        raise HFConfigError(f"model.arch={cfg.arch!r} has no transformers counterpart (only 'kimi_k3')")
    if arch["gate_form"] == "bounded":
        raise HFConfigError("model.gate_form='bounded' is not expressible in transformers' Kimi Linear "
                            "(softplus gate only)")
    if arch["mla_use_rope"]:
        raise HFConfigError("model.mla_use_rope=True is not expressible in transformers' Kimi Linear (NoPE MLA)")
    if arch["mla_output_gate"]:
        raise HFConfigError("model.mla_output_gate=True is not expressible in transformers' Kimi Linear")
    if cfg.tie_embeddings:
        raise HFConfigError("model.tie_embeddings=True is not expressible in transformers' Kimi Linear "
                            "(KimiLinearForCausalLM never ties lm_head to the embedding)")
    if arch["num_shared_experts"] == 0:
        raise HFConfigError("model.num_shared_experts=0 is not expressible in transformers' Kimi Linear "
                            "(every MoE layer has a shared expert)")


def hf_config_from_model_config(cfg: ModelConfig, vocab_size: int, *, dtype: str = "float32") -> dict[str, Any]:
    """config.json for transformers' KimiLinearConfig, plus the released keys (`linear_attn_config`,
    `first_k_dense_replace`, ...) so that remote-code and serving stacks read it the same way."""
    arch = architecture_of(cfg, vocab_size)
    _refuse_unexportable(cfg, arch)
    n = cfg.num_layers
    layers = arch["layer_types"]
    first_dense = arch["first_k_dense"]
    moe = first_dense < n
    # An all-MLA (or all-KDA) model still needs valid dims on the absent side; the defaults are inert.
    kda_dims = {k: arch[k] if arch[k] is not None else getattr(cfg, k) for k in ("num_heads", "head_dim", "conv_size")}
    mla_heads = arch["mla_num_heads"] if arch["mla_num_heads"] is not None else cfg.num_heads
    return {
        "architectures": [HF_ARCHITECTURE],
        "model_type": HF_MODEL_TYPE,
        "vocab_size": vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": n,
        "layer_types": [_OURS_TO_HF_LAYER[t] for t in layers],
        "mlp_layer_types": [HF_DENSE] * first_dense + [HF_SPARSE] * (n - first_dense),
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": False,
        "initializer_range": cfg.init_std,
        "model_max_length": cfg.max_seq_len,
        "hidden_act": "silu",
        "linear_num_heads": kda_dims["num_heads"],
        "linear_head_dim": kda_dims["head_dim"],
        "linear_conv_kernel_dim": kda_dims["conv_size"],
        "linear_attn_config": {
            "full_attn_layers": [i + 1 for i, t in enumerate(layers) if t == "mla"],
            "kda_layers": [i + 1 for i, t in enumerate(layers) if t == "kda"],
            "num_heads": kda_dims["num_heads"],
            "head_dim": kda_dims["head_dim"],
            "short_conv_kernel_size": kda_dims["conv_size"],
        },
        "num_attention_heads": mla_heads,
        "num_key_value_heads": mla_heads,
        "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "mla_use_nope": True,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "intermediate_size": cfg.intermediate_size,
        "first_k_dense_replace": first_dense,
        "moe_layer_freq": 1,
        "num_experts": cfg.num_experts if moe else 0,
        "num_experts_per_token": cfg.top_k,
        "num_shared_experts": cfg.num_shared_experts,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "num_expert_group": cfg.n_group,
        "topk_group": cfg.topk_group,
        "num_nextn_predict_layers": 0,
        # kimik3 trains on its own tokenizers: no special ids (transformers' defaults index a 163840 vocab).
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "use_cache": True,
        "dtype": dtype,
    }
