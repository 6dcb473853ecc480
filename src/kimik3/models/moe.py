"""Sparse MoE FFN: sigmoid router with a balancing bias, SwiGLU experts, sort/permute dispatch.

Shapes: B batch, T time, N = B*T tokens, D hidden, E experts, k top_k, I moe_intermediate_size,
M = N*k routed token copies.

Router (DeepSeek-V3, arXiv:2412.19437, sec. 2.1.2; as transformers' KimiLinearTopkRouter), in fp32 also under
autocast (which runs transformers' router matmul in bf16):
    s = sigmoid(x W_r^T)                                  [N, E] affinity scores
    chosen = top-k of (s + e_score_correction_bias), within the topk_group best of n_group groups
    weights = s[chosen] / sum(s[chosen]) * routed_scaling_factor   (unbiased scores, renormalised)
The bias only steers the choice, never the weights.

Auxiliary-loss-free balancing: training forwards (training mode with grad enabled; never an eval
or no-grad forward) count how many tokens each expert received; after each applied optimizer step,
`end_step` moves each expert's bias by
    bias_e += bias_update_rate * sign(mean_load - load_e)
(overloaded experts become less attractive, underloaded ones more), then the counts reset (also on a
skipped step). Optional sequence-level balance loss (DeepSeek-V3 eq. 17-20) with aux_loss_weight.

Dispatch is dropless: the M (token, expert) pairs are sorted by expert, each expert runs one matmul
on its contiguous slice (torch._grouped_mm for bf16 on sm90+ CUDA, without host sync; else a loop
over experts), and each token sums its k output rows with their weights (ops/moe_rows.py). No token
is dropped.

Parameters map 1:1 to transformers' KimiLinearMoE: router.weight == gate.weight,
router.e_score_correction_bias == gate.e_score_correction_bias, experts.gate_up_proj [E, 2I, D]
(gate rows then up rows) and experts.down_proj [E, D, I], shared_experts.{gate,up,down}_proj.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kimik3.config.schema import ModelConfig
from kimik3.models.blocks import SwiGLU
from kimik3.models.recompute import RecomputeSaved
from kimik3.ops.cast import autocast_dtype, bf16_uses, bf16_weight
from kimik3.ops.moe_rows import combine_rows, dispatch_rows, sort_by_expert
from kimik3.ops.router import entropy_sum, route
from kimik3.ops.swiglu import swiglu


def _check_routing(cfg: ModelConfig) -> None:
    """ValueError unless top_k, n_group and topk_group fit num_experts. Group-limited routing keeps
    topk_group groups of E / n_group experts, each ranked by its two best scores: with fewer than
    top_k experts kept, top-k would take masked-out experts of the dropped groups, and a group of one
    expert has no second score (the top-2 fails at the first forward)."""
    E, k, groups, kept = cfg.num_experts, cfg.top_k, cfg.n_group, cfg.topk_group
    fits = k <= E and groups >= 1 and E % groups == 0 and 1 <= kept <= groups
    if fits and groups > 1:
        fits = E // groups >= 2 and k <= kept * (E // groups)
    if not fits:
        raise ValueError(
            f"model.top_k={k}, n_group={groups}, topk_group={kept} do not fit num_experts={E}: need "
            "top_k <= num_experts, num_experts % n_group == 0, 1 <= topk_group <= n_group and, with n_group > 1, "
            "at least 2 experts per group and top_k <= topk_group * num_experts / n_group"
        )


class Router(nn.Module):
    """Sigmoid top-k router with the aux-loss-free balancing bias (see the module docstring)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        _check_routing(cfg)
        E = cfg.num_experts
        self.top_k, self.n_group, self.topk_group = cfg.top_k, cfg.n_group, cfg.topk_group
        self.routed_scaling_factor = cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(E, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(E))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x: [N, D] -> scores [N, E] fp32, chosen experts [N, k] int64, weights [N, k] fp32."""
        dtype = torch.promote_types(x.dtype, torch.float32)  # fp32 (fp64 stays fp64)
        # fp32 under autocast too: the scores pick the experts and weigh their outputs, and bf16 keeps
        # ~3 significant digits of them. The GEMM is [N, D] x [D, E], small beside the experts'.
        with torch.autocast(x.device.type, enabled=False) if autocast_dtype(x.device.type) else nullcontext():
            logits = F.linear(x.to(dtype), self.weight.to(dtype))
        # the selection after the GEMM: one Triton kernel each way on CUDA (ops/router.py)
        return route(logits, self.e_score_correction_bias, self.top_k, self.n_group, self.topk_group,
                     self.routed_scaling_factor)


class Experts(nn.Module):
    """E SwiGLU experts as 3-D weights [E, out, in], run on expert-sorted tokens."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x: Tensor, counts: Tensor, grouped_weights: Optional[tuple[Tensor, Tensor]] = None) -> Tensor:
        """x: [M, D] sorted by expert, counts: [E] tokens per expert -> [M, D]. grouped_weights: what
        `grouped_weights()` returned, when the caller wants to know the tensors the GEMMs save."""
        if _use_grouped_mm(x):
            return self._grouped(x, counts, grouped_weights or self.grouped_weights())
        return self._looped(x, counts)

    def grouped_weights(self) -> tuple[Tensor, Tensor]:
        """The bf16 operands of the grouped GEMMs: gate_up_proj^T [E, D, 2I] and down_proj^T [E, I, D]
        (their fp32 gradients come back through ops.cast's vectorised kernel)."""
        return (bf16_weight(self.gate_up_proj).transpose(-2, -1), bf16_weight(self.down_proj).transpose(-2, -1))

    def _looped(self, x: Tensor, counts: Tensor) -> Tensor:
        """One matmul pair per expert on its slice: any device and dtype (syncs to read counts)."""
        outs = []
        for e, part in enumerate(x.split(counts.tolist())):
            outs.append(F.linear(swiglu(F.linear(part, self.gate_up_proj[e])), self.down_proj[e]))
        return torch.cat(outs)

    @staticmethod
    def _grouped(x: Tensor, counts: Tensor, weights: tuple[Tensor, Tensor]) -> Tensor:
        """One grouped GEMM per projection; offsets stay on the device (no host sync)."""
        offs = counts.cumsum(0).to(torch.int32)
        gate_up, down = weights
        h = torch._grouped_mm(x.to(torch.bfloat16), gate_up, offs=offs)  # [M, 2I]
        return torch._grouped_mm(swiglu(h), down, offs=offs)


def _use_grouped_mm(x: Tensor) -> bool:
    """torch._grouped_mm applies: CUDA sm90+ and bf16 compute (bf16 input or bf16 autocast)."""
    if not (x.is_cuda and hasattr(torch, "_grouped_mm")):
        return False
    if torch.cuda.get_device_capability(x.device) < (9, 0):
        return False
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else x.dtype
    return dtype == torch.bfloat16


def _bf16_operands(flat: Tensor, grouped: bool, shared: bool) -> tuple[Tensor, Optional[Tensor]]:
    """What the routed experts' dispatch and the shared experts read: with the grouped GEMMs, one bf16
    copy of an fp32 `flat` (cast N rows once, not the M dispatched copies) whose two gradients meet in
    fp32 (ops.cast.bf16_uses); otherwise `flat` itself. The second is None without shared experts."""
    if grouped and flat.dtype == torch.float32:
        uses = bf16_uses(flat, 2 if shared else 1)
        return uses[0], uses[1] if shared else None
    src = flat.to(torch.bfloat16) if grouped else flat
    return src, flat if shared else None


class MoE(nn.Module):
    """Routed experts + shared experts. Keeps the balancing state of its router.

    Buffers (non-persistent): `step_load` [E] tokens routed to each expert by training forwards
    (training mode, grad enabled) since the last optimizer attempt, `step_entropy` (sum of
    per-token router entropies, tokens);
    `last_load` / `last_entropy` the same for the previous attempt (what diagnostics report once
    the step trackers are reset).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        E = cfg.num_experts
        self.num_experts, self.top_k = E, cfg.top_k
        self.bias_update_rate = cfg.bias_update_rate
        self.aux_loss_weight = cfg.aux_loss_weight
        self.router = Router(cfg)
        self.experts = Experts(E, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_experts = (
            SwiGLU(cfg.hidden_size, cfg.moe_intermediate_size * cfg.num_shared_experts)
            if cfg.num_shared_experts > 0 else None
        )
        for name in ("step_load", "last_load"):
            self.register_buffer(name, torch.zeros(E), persistent=False)
        for name in ("step_entropy", "last_entropy"):  # [sum of per-token entropies, tokens]
            self.register_buffer(name, torch.zeros(2), persistent=False)
        self.pending_stats: Optional[tuple[Tensor, Tensor]] = None  # see commit_stats
        self.recompute_experts = False
        """train.recompute_experts, set by the trainer: with the grouped GEMMs, the dispatched rows and
        the bf16 expert weights they save are recomputed in backward (models/recompute.py) instead of kept."""

    def forward(self, x: Tensor) -> tuple[Tensor, Optional[Tensor]]:
        """x: [B, T, D] -> (y [B, T, D], sequence-level aux loss (weighted) or None)."""
        B, T, D = x.shape
        flat = x.reshape(B * T, D)
        scores, chosen, weights = self.router(flat)  # [N, E], [N, k], [N, k]
        # copies grouped by expert, their inverse, tokens per expert [E] (ops.moe_rows)
        order, slot_of, counts = sort_by_expert(chosen.reshape(-1), self.num_experts)
        grouped = _use_grouped_mm(flat)
        src, shared_in = _bf16_operands(flat, grouped, self.shared_experts is not None)
        rows = dispatch_rows(src, order, slot_of, self.top_k)  # [M, D]
        if grouped and self.recompute_experts:
            expert_weights = self.experts.grouped_weights()

            def saved() -> tuple[Tensor, ...]:  # what the grouped GEMMs keep for backward, rebuilt
                return (dispatch_rows(src, order, slot_of, self.top_k), *self.experts.grouped_weights())

            with RecomputeSaved(saved, (rows, *expert_weights)):
                routed = self.experts(rows, counts, expert_weights)
        else:
            routed = self.experts(rows, counts)
        shared = self.shared_experts(shared_in) if self.shared_experts is not None else None
        y = combine_rows(routed, order, slot_of, weights, plus=shared, out_dtype=x.dtype)
        # Only a forward that will be trained on counts. Any other one also clears what a
        # checkpointed backward's rerun left pending, which the model's commit would else add.
        counted = self.training and torch.is_grad_enabled()
        self.pending_stats = self._forward_stats(scores, counts) if counted else None
        aux = self._sequence_aux_loss(scores, chosen, B, T) if self.aux_loss_weight > 0 and self.training else None
        return y.view(B, T, D), aux

    @staticmethod
    @torch.no_grad()
    def _forward_stats(scores: Tensor, counts: Tensor) -> tuple[Tensor, Tensor]:
        """(tokens per expert [E], [sum of router entropies, tokens]) of one forward, on device."""
        return counts, entropy_sum(scores)

    @torch.no_grad()
    def commit_stats(self) -> None:
        """Add the last training forward's load and entropy to the step trackers (no host sync).

        Called by the model once per forward rather than inside `forward`, so that activation
        checkpointing, which reruns `forward` during backward, does not count tokens twice.
        """
        if self.pending_stats is not None:
            counts, entropy = self.pending_stats
            self.step_load += counts
            self.step_entropy += entropy
            self.pending_stats = None

    def _sequence_aux_loss(self, scores: Tensor, chosen: Tensor, B: int, T: int) -> Tensor:
        """aux_loss_weight * mean over sequences of sum_e f_e * P_e (DeepSeek-V3 eq. 17-20):
        f_e = E / (k T) * tokens routed to e, P_e = mean over tokens of normalised scores."""
        E, k = self.num_experts, self.top_k
        hits = torch.zeros(B, T * k, E, device=scores.device).scatter_(2, chosen.view(B, T * k, 1), 1.0)
        f = hits.sum(1) * (E / (k * T))  # [B, E]
        P = (scores / scores.sum(-1, keepdim=True)).view(B, T, E).mean(1)  # [B, E]
        return self.aux_loss_weight * (f * P).sum(-1).mean()

    @torch.no_grad()
    def end_step(self, applied: Union[bool, Tensor]) -> None:
        """After an optimizer attempt: move the bias (if applied and tokens were seen), then reset.
        `applied` may be a 0-dim bool tensor (the trainer's): decided on the device, no host sync."""
        load = self.step_load
        if applied is not False and self.bias_update_rate > 0:
            seen = (load.sum() > 0).to(load.dtype)  # no update (and no sync) when nothing was routed
            if isinstance(applied, Tensor):
                seen = seen * applied.to(load.dtype)
            step = self.bias_update_rate * torch.sign(load.mean() - load) * seen
            self.router.e_score_correction_bias += step
        self.last_load.copy_(load)
        self.last_entropy.copy_(self.step_entropy)
        load.zero_()
        self.step_entropy.zero_()

    def diagnostics(self, prefix: str) -> dict[str, float]:
        """Expert load min and max over the mean load (1.0 = perfectly balanced), mean router
        entropy (of the normalised scores, nats; ln E = uniform) and the bias norm. Reports the
        current step when it has routed tokens, else the last finished one."""
        current = bool(self.step_entropy[1] > 0)
        load = self.step_load if current else self.last_load
        entropy = self.step_entropy if current else self.last_entropy
        out = {f"{prefix}/bias_norm": self.router.e_score_correction_bias.norm().item()}
        if entropy[1] > 0:
            mean = load.mean()
            out[f"{prefix}/load_min"] = (load.min() / mean).item()
            out[f"{prefix}/load_max"] = (load.max() / mean).item()
            out[f"{prefix}/router_entropy"] = (entropy[0] / entropy[1]).item()
        return out
