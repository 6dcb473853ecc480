"""Which optimizer and weight decay each parameter gets: one ordered table of name rules.

The first rule that matches a parameter's name (or, for the last rules, its ndim) wins, so every
trainable parameter lands in exactly one rule and one group. Names follow the model contract:
embeddings contain "embed", the output head "lm_head", norms "norm", short convolutions "conv",
the MoE router "router", KDA decay parameters "A_log" / "dt_bias"; expert weights are 3-D
[E, out, in]. Hidden matrices (2-D and 3-D) go to Muon; everything else to AdamW (Moonlight,
arXiv:2502.16982, Sec. 2: Muon only for matrix parameters of the hidden layers).

| rule     | matches                                   | muon run        | adamw run       |
|----------|-------------------------------------------|-----------------|-----------------|
| decay    | "A_log", "dt_bias" in name                | adamw, no decay | adamw, no decay |
| norm     | "norm" in name                            | adamw, no decay | adamw, no decay |
| bias     | name ends with "bias"                     | adamw, no decay | adamw, no decay |
| embed    | "embed" in name                           | adamw           | adamw           |
| lm_head  | "lm_head" in name                         | adamw           | adamw           |
| conv     | "conv" in name                            | adamw           | adamw           |
| router   | "router" in name                          | adamw           | adamw           |
| matrix   | any other parameter with ndim 2 or 3      | muon            | adamw           |
| vector   | any other parameter with ndim 0 or 1      | adamw, no decay | adamw, no decay |

Muon block splits (see muon.py): a fused SwiGLU weight named "gate_up_proj" ([E, 2I, D] experts)
is always orthogonalised as its gate and up row halves, the two matrices of the math (as in
checkpoints that store w1 and w3 apart). With train.muon_per_head, attention projections are
orthogonalised per head: q_proj, k_proj, v_proj, q_b_proj, kv_b_proj by row blocks and o_proj by
column blocks. The head count comes from the module owning the projection: an MLA module's
`max_logits` buffer has one entry per head (the MLA contract); any other attention module (KDA)
must expose an int `num_heads`. Latent projections (q_a_proj, kv_a_proj) and gate projections
are orthogonalised whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn

from kimik3.optim.muon import BlockSplit
from kimik3.optim.qk_clip import is_mla

# Group names; a run has at most these three groups (empty ones are dropped).
MUON = "muon"
ADAMW = "adamw"
ADAMW_NO_DECAY = "adamw_no_decay"


@dataclass(frozen=True)
class Rule:
    """One row of the table: a name, a predicate on (name, ndim), and where matches go."""

    name: str
    matches: Callable[[str, int], bool]
    muon_group: str
    """Group under train.optimizer=muon."""
    adamw_group: str
    """Group under train.optimizer=adamw."""


RULES: tuple[Rule, ...] = (
    Rule("decay", lambda n, d: "A_log" in n or "dt_bias" in n, ADAMW_NO_DECAY, ADAMW_NO_DECAY),
    Rule("norm", lambda n, d: "norm" in n, ADAMW_NO_DECAY, ADAMW_NO_DECAY),
    Rule("bias", lambda n, d: n.endswith("bias"), ADAMW_NO_DECAY, ADAMW_NO_DECAY),
    Rule("embed", lambda n, d: "embed" in n, ADAMW, ADAMW),
    Rule("lm_head", lambda n, d: "lm_head" in n, ADAMW, ADAMW),
    Rule("conv", lambda n, d: "conv" in n, ADAMW, ADAMW),
    Rule("router", lambda n, d: "router" in n, ADAMW, ADAMW),
    Rule("matrix", lambda n, d: d in (2, 3), MUON, ADAMW),
    Rule("vector", lambda n, d: d <= 1, ADAMW_NO_DECAY, ADAMW_NO_DECAY),
)


def match_rule(name: str, ndim: int) -> Rule:
    """The first rule of RULES matching a parameter; a ValueError if none does (e.g. a 4-D weight)."""
    for rule in RULES:
        if rule.matches(name, ndim):
            return rule
    raise ValueError(
        f"parameter {name!r} with ndim={ndim} matches no optimizer rule "
        f"(rules: {[r.name for r in RULES]}; matrices must be 2-D or 3-D [E, out, in])"
    )


def assign_groups(model: nn.Module, optimizer: str) -> dict[str, list[tuple[str, Rule, nn.Parameter]]]:
    """Map group name -> [(param name, rule, param)] over the trainable parameters, in model order.

    `optimizer` is train.optimizer ("muon" or "adamw"). Shared (tied) parameters appear once, under
    their first name, as `named_parameters` yields them.
    """
    if optimizer not in ("muon", "adamw"):
        raise ValueError(f"train.optimizer={optimizer!r} is not one of ['adamw', 'muon']")
    groups: dict[str, list[tuple[str, Rule, nn.Parameter]]] = {MUON: [], ADAMW: [], ADAMW_NO_DECAY: []}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        rule = match_rule(name, param.ndim)
        group = rule.muon_group if optimizer == "muon" else rule.adamw_group
        groups[group].append((name, rule, param))
    return {k: v for k, v in groups.items() if v}


ROW_SPLIT_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "q_b_proj", "kv_b_proj")
COL_SPLIT_PROJECTIONS = ("o_proj",)


FUSED_GATE_UP = "gate_up_proj"


def block_split(model: nn.Module, name: str, per_head: bool) -> BlockSplit:
    """How Muon splits parameter `name` into matrices: (axis, parts), or None for whole matrices."""
    if name.endswith(FUSED_GATE_UP):
        return (0, 2)
    *owner_path, proj, leaf = ["", *name.split(".")]
    if not per_head or leaf != "weight" or proj not in ROW_SPLIT_PROJECTIONS + COL_SPLIT_PROJECTIONS:
        return None
    owner = model.get_submodule(".".join(p for p in owner_path if p))
    heads = owner.max_logits.numel() if is_mla(owner) else getattr(owner, "num_heads", None)
    if not isinstance(heads, int):
        raise ValueError(
            f"train.muon_per_head=true needs the head count of {name}: its module "
            f"{type(owner).__name__} has neither an MLA max_logits buffer nor an int num_heads"
        )
    return (0 if proj in ROW_SPLIT_PROJECTIONS else 1, heads)
