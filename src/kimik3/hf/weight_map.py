"""The one table between KimiK3 tensor names and the safetensors names of Kimi Linear checkpoints.

HF names are the on-disk layout of the released Kimi-Linear-48B-A3B (and of what transformers 5.17's
`save_pretrained` writes): per-expert `w1/w2/w3`, separate `q/k/v_conv1d`, the forget gate's
`f_a_proj/f_b_proj/A_log/dt_bias` directly under `self_attn`, MoE layers under `block_sparse_moe`
and dense ones under `mlp`. transformers fuses some of these at load time (its
`conversion_mapping.py`); KimiK3 keeps its own fused forms, so a rule says how one KimiK3 tensor is
made of one or more HF tensors:

    ours = view(cat(hf_1, ..., hf_m, dim=0))                          (op "cat"; m = 1: a rename)
    ours = stack_e(cat(hf_1[e], ..., hf_m[e], dim=0))                 (op "experts", {e} in hf names)

Both directions are exact (concatenation, stacking and views only), so import then export gives the
same bytes. The router's score-correction bias is a persistent buffer on both sides and is mapped
like any weight. `rules_for` returns the full table for one config; `check_complete` fails on any
KimiK3 tensor without a rule and on any rule without a KimiK3 tensor.

Legend: i layer index, e expert index, E experts, H hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import torch

from kimik3.config.schema import ModelConfig
from kimik3.models.blocks import is_moe_layer, resolve_layer_types

_CAT, _EXPERTS = "cat", "experts"


@dataclass(frozen=True)
class Rule:
    """One KimiK3 tensor and the HF tensors it is made of (see module docstring for `op`)."""

    ours: str
    hf: tuple[str, ...]
    op: str = _CAT
    hf_shape: tuple[int, ...] | None = None
    """Shape of the single HF tensor when it differs from ours by a view (A_log: [1, 1, H, 1])."""
    num_experts: int = 0

    def hf_names(self) -> list[str]:
        """Every HF tensor name this rule reads or writes, in the order to_ours consumes them."""
        if self.op == _EXPERTS:
            return [name.format(e=e) for e in range(self.num_experts) for name in self.hf]
        return list(self.hf)

    def hf_shapes(self, shape: Sequence[int]) -> list[tuple[int, ...]]:
        """The shape of each HF tensor (in hf_names order) that our tensor of `shape` splits into (to_hf's split)."""
        if self.op == _EXPERTS:
            return [(shape[1] // len(self.hf), *shape[2:])] * (self.num_experts * len(self.hf))
        if len(self.hf) == 1:
            return [tuple(self.hf_shape if self.hf_shape is not None else shape)]
        return [(shape[0] // len(self.hf), *shape[1:])] * len(self.hf)

    def to_ours(self, tensors: Mapping[str, torch.Tensor], shape: Sequence[int]) -> torch.Tensor:
        """Assemble our tensor of `shape` from the HF tensors (by name).

        Each HF tensor must have the shape `hf_shapes` gives it, up to size-1 dims (A_log is [H] in
        some checkpoints, [1, 1, H, 1] in others): an element count alone would take a transposed
        matrix as valid and reshape it into scrambled weights.
        """
        parts = {}
        for name, want in zip(self.hf_names(), self.hf_shapes(shape)):
            got = tuple(tensors[name].shape)
            if _without_ones(got) != _without_ones(want):
                raise ValueError(f"{name} has shape {got} in the checkpoint, but KimiK3's {self.ours} "
                                 f"{tuple(shape)} needs {want}")
            parts[name] = tensors[name].reshape(want)
        if self.op == _EXPERTS:
            rows = [torch.cat([parts[n.format(e=e)] for n in self.hf], dim=0) for e in range(self.num_experts)]
            out = torch.stack(rows)
        else:
            out = parts[self.hf[0]] if len(self.hf) == 1 else torch.cat([parts[n] for n in self.hf], dim=0)
        return out.reshape(shape)

    def to_hf(self, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """Split our tensor into (HF name, tensor) pairs; exact inverse of to_ours."""
        if self.op == _EXPERTS:
            return [(n.format(e=e), part.contiguous())
                    for e in range(self.num_experts)
                    for n, part in zip(self.hf, tensor[e].chunk(len(self.hf), dim=0))]
        if len(self.hf) == 1:
            shape = self.hf_shape if self.hf_shape is not None else tensor.shape
            return [(self.hf[0], tensor.reshape(shape).contiguous())]
        return [(n, part.contiguous()) for n, part in zip(self.hf, tensor.chunk(len(self.hf), dim=0))]


def _without_ones(shape: Sequence[int]) -> tuple[int, ...]:
    return tuple(s for s in shape if s != 1)


# ----------------------------------------------------------------------------------------- table
# Left: KimiK3 (models/kimi_k3.py and its blocks); right: HF checkpoint names. One line per tensor.


def _kda_rules(ours: str, hf: str, cfg: ModelConfig) -> list[Rule]:
    H = cfg.num_heads
    return [
        Rule(f"{ours}.q_proj.weight", (f"{hf}.q_proj.weight",)),
        Rule(f"{ours}.k_proj.weight", (f"{hf}.k_proj.weight",)),
        Rule(f"{ours}.v_proj.weight", (f"{hf}.v_proj.weight",)),
        Rule(f"{ours}.conv.weight", (f"{hf}.q_conv1d.weight", f"{hf}.k_conv1d.weight", f"{hf}.v_conv1d.weight")),
        Rule(f"{ours}.f_a_proj.weight", (f"{hf}.f_a_proj.weight",)),
        Rule(f"{ours}.f_b_proj.weight", (f"{hf}.f_b_proj.weight",)),
        Rule(f"{ours}.A_log", (f"{hf}.A_log",), hf_shape=(1, 1, H, 1)),
        Rule(f"{ours}.dt_bias", (f"{hf}.dt_bias",)),
        Rule(f"{ours}.b_proj.weight", (f"{hf}.b_proj.weight",)),
        Rule(f"{ours}.g_a_proj.weight", (f"{hf}.g_a_proj.weight",)),
        Rule(f"{ours}.g_b_proj.weight", (f"{hf}.g_b_proj.weight",)),
        Rule(f"{ours}.o_norm.weight", (f"{hf}.o_norm.weight",)),
        Rule(f"{ours}.o_proj.weight", (f"{hf}.o_proj.weight",)),
    ]


def _mla_rules(ours: str, hf: str, cfg: ModelConfig) -> list[Rule]:
    if cfg.q_lora_rank is None:
        q = [Rule(f"{ours}.q_proj.weight", (f"{hf}.q_proj.weight",))]
    else:
        q = [
            Rule(f"{ours}.q_a_proj.weight", (f"{hf}.q_a_proj.weight",)),
            Rule(f"{ours}.q_a_norm.weight", (f"{hf}.q_a_layernorm.weight",)),
            Rule(f"{ours}.q_b_proj.weight", (f"{hf}.q_b_proj.weight",)),
        ]
    return q + [
        Rule(f"{ours}.kv_a_proj.weight", (f"{hf}.kv_a_proj_with_mqa.weight",)),
        Rule(f"{ours}.kv_a_norm.weight", (f"{hf}.kv_a_layernorm.weight",)),
        Rule(f"{ours}.kv_b_proj.weight", (f"{hf}.kv_b_proj.weight",)),
        Rule(f"{ours}.o_proj.weight", (f"{hf}.o_proj.weight",)),
    ]


def _dense_rules(ours: str, hf: str) -> list[Rule]:
    return [
        Rule(f"{ours}.gate_proj.weight", (f"{hf}.gate_proj.weight",)),
        Rule(f"{ours}.up_proj.weight", (f"{hf}.up_proj.weight",)),
        Rule(f"{ours}.down_proj.weight", (f"{hf}.down_proj.weight",)),
    ]


def _moe_rules(ours: str, hf: str, cfg: ModelConfig) -> list[Rule]:
    E = cfg.num_experts
    return [
        Rule(f"{ours}.router.weight", (f"{hf}.gate.weight",)),
        Rule(f"{ours}.router.e_score_correction_bias", (f"{hf}.gate.e_score_correction_bias",)),
        Rule(f"{ours}.experts.gate_up_proj", (f"{hf}.experts.{{e}}.w1.weight", f"{hf}.experts.{{e}}.w3.weight"),
             op=_EXPERTS, num_experts=E),
        Rule(f"{ours}.experts.down_proj", (f"{hf}.experts.{{e}}.w2.weight",), op=_EXPERTS, num_experts=E),
        *_dense_rules(f"{ours}.shared_experts", f"{hf}.shared_experts"),
    ]


def rules_for(cfg: ModelConfig) -> list[Rule]:
    """The full table for one config: every KimiK3 tensor (weights and persistent buffers)."""
    rules = [Rule("embed.weight", ("model.embed_tokens.weight",))]
    for i, kind in enumerate(resolve_layer_types(cfg)):
        ours, hf = f"layers.{i}", f"model.layers.{i}"
        rules += [
            Rule(f"{ours}.attn_norm.weight", (f"{hf}.input_layernorm.weight",)),
            Rule(f"{ours}.ffn_norm.weight", (f"{hf}.post_attention_layernorm.weight",)),
        ]
        mixer = _kda_rules if kind == "kda" else _mla_rules
        rules += mixer(f"{ours}.attn", f"{hf}.self_attn", cfg)
        if is_moe_layer(cfg, i):
            rules += _moe_rules(f"{ours}.ffn", f"{hf}.block_sparse_moe", cfg)
        else:
            rules += _dense_rules(f"{ours}.ffn", f"{hf}.mlp")
    rules.append(Rule("norm.weight", ("model.norm.weight",)))
    rules.append(Rule("lm_head.weight", ("lm_head.weight",)))  # never tied in transformers' Kimi Linear
    return rules


# transformers' save_pretrained writes dense FFNs under `block_sparse_moe` too (it reverses its
# `block_sparse_moe -> mlp` load-time renaming on every layer); both spellings are read.
_HF_SYNONYMS = ((".block_sparse_moe.gate_proj.", ".mlp.gate_proj."),
                (".block_sparse_moe.up_proj.", ".mlp.up_proj."),
                (".block_sparse_moe.down_proj.", ".mlp.down_proj."))


def canonical_hf_name(name: str) -> str:
    """The table's spelling of an HF tensor name read from a checkpoint."""
    for alt, canonical in _HF_SYNONYMS:
        name = name.replace(alt, canonical)
    return name


def check_complete(rules: Iterable[Rule], our_names: Iterable[str]) -> None:
    """Fail unless the rules cover exactly our tensors (names from state_dict: params + persistent buffers)."""
    mapped = {r.ours for r in rules}
    ours = set(our_names)
    if ours - mapped:
        raise ValueError(f"KimiK3 tensors without an HF mapping: {sorted(ours - mapped)}")
    if mapped - ours:
        raise ValueError(f"mapping rules name tensors KimiK3 does not have: {sorted(mapped - ours)}")
