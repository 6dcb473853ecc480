"""KimiK3: a Kimi Linear-style hybrid LM (KDA + MLA mixers, sparse MoE FFNs). Read this file first.

Shapes: B batch, T time, D hidden, V vocab.

    embed -> L x Block(pre-norm mixer, pre-norm FFN) -> RMSNorm -> lm_head
    mixer: KDA (kda.py) or MLA (mla.py) by the layer pattern (blocks.resolve_layer_types)
    FFN:   dense SwiGLU for the first `first_k_dense` layers (or all, without experts), else MoE (moe.py)

Numerics and parameters follow transformers' KimiLinearForCausalLM (Kimi Linear,
arXiv:2510.26692), so its checkpoints load by a name/reshape mapping: embed == model.embed_tokens,
layers.i.{attn_norm, attn, ffn_norm, ffn} == model.layers.i.{input_layernorm, self_attn,
post_attention_layernorm, mlp}, norm == model.norm, lm_head == lm_head (see each mixer's docstring).
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from kimik3.config.schema import ModelConfig
from kimik3.models.base import LanguageModel, LMOutput
from kimik3.models.blocks import RMSNorm, SwiGLU, is_moe_layer, resolve_layer_types
from kimik3.models.kda import KDAMixer
from kimik3.models.loss import linear_cross_entropy
from kimik3.models.mla import MLA
from kimik3.models.moe import MoE


class Block(nn.Module):
    """Pre-norm residual block: x + mixer(norm(x)), then x + ffn(norm(x)).

    Each residual add is left to the next norm, which fuses it into its kernel on CUDA
    (RMSNorm.add_forward: the fp32 residual stream is read and written once per norm, not once more
    per add): forward(x, r) takes the residual stream x and the previous block's FFN output r, not
    yet added (None for the first block), and returns (x, ffn output, aux) with the FFN output
    likewise pending; KimiK3's final norm adds the last one. aux is the FFN's weighted auxiliary loss
    (None for a dense FFN or when the aux loss is off).
    """

    def __init__(self, cfg: ModelConfig, layer_idx: int, layer_type: str) -> None:
        super().__init__()
        self.layer_type = layer_type
        moe = is_moe_layer(cfg, layer_idx)
        # Both mixers and the dense FFN read their input in one GEMM (blocks.stacked_linear), so their
        # norms may hand it over in autocast's dtype; the MoE's router reads it in fp32.
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, feeds_matmul=True)
        self.attn: nn.Module = KDAMixer(cfg) if layer_type == "kda" else MLA(cfg)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, feeds_matmul=not moe)
        self.ffn: nn.Module = MoE(cfg) if moe else SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: Tensor, r: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Optional[Tensor]]:  # [B, T, D]
        x, h = self.attn_norm.add_forward(x, r)
        x, h = self.ffn_norm.add_forward(x, self.attn(h))
        if isinstance(self.ffn, MoE):
            y, aux = self.ffn(h)
            return x, y, aux
        return x, self.ffn(h), None


class KimiK3(LanguageModel):
    """The KimiK3 language model (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, vocab_size: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.layer_types = resolve_layer_types(cfg)
        self.embed = nn.Embedding(vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i, t) for i, t in enumerate(self.layer_types))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, vocab_size, bias=False)
        self.checkpoint_blocks = False
        """Activation checkpointing per block (train.activation_checkpointing, set by the trainer): a
        training forward keeps only each block's inputs (the residual stream and the previous FFN output,
        not yet added: one [B, T, D] tensor more than a block that adds its own output) and reruns the
        block in backward."""
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialise every weight (a no-op on the meta device).

        Matrices ~ N(0, init_std); output projections (o_proj, down_proj) ~ N(0, init_std /
        sqrt(2 L)) so the residual stream's variance does not grow with depth (GPT-2); norms 1;
        KDA decay as fla/transformers: A_log = log U(1, 16), dt_bias = softplus^-1 of a
        log-uniform dt in [1e-3, 1e-1]; short convs keep PyTorch's default init; the router bias 0.
        """
        std = self.cfg.init_std
        out_std = std / math.sqrt(2 * self.cfg.num_layers)
        for name, p in self.named_parameters():
            parts = name.split(".")
            leaf = parts[-2] if parts[-1] == "weight" else parts[-1]  # owning module, or the parameter
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(1.0, 16.0).log())
            elif name.endswith("dt_bias"):
                dt = torch.empty_like(p).uniform_(math.log(1e-3), math.log(1e-1)).exp().clamp_min(1e-4)
                p.copy_(dt + torch.log(-torch.expm1(-dt)))
            elif "norm" in leaf:
                p.fill_(1.0)
            elif "conv" in leaf:
                continue
            elif leaf in ("o_proj", "down_proj"):
                p.normal_(0.0, out_std)
            else:
                p.normal_(0.0, std)
        for module in self.modules():
            if isinstance(module, MoE):
                module.router.e_score_correction_bias.zero_()

    def forward(self, input_ids: Tensor, targets: Optional[Tensor] = None) -> LMOutput:
        """input_ids, targets: [B, T] int64. Without targets returns logits [B, T, V]."""
        if input_ids.shape[1] > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {input_ids.shape[1]} > model.max_seq_len={self.cfg.max_seq_len}")
        x, r = self.embed(input_ids), None  # [B, T, D]; r: the last block's FFN output, not yet added
        aux_losses = []
        for layer in self.layers:
            if self.checkpoint_blocks and torch.is_grad_enabled():
                # The backward's rerun repeats the block's tracker updates: max logits are idempotent,
                # and MoE stats are counted once, by commit_stats after this forward (the rerun's stay
                # pending and the next forward drops them).
                x, r, aux = checkpoint(layer, x, r, use_reentrant=False)
            else:
                x, r, aux = layer(x, r)
            if aux is not None:
                aux_losses.append(aux)
        for _, moe in self.moe_layers():
            moe.commit_stats()
        _, x = self.norm.add_forward(x, r)
        if targets is None:
            return LMOutput(logits=self.lm_head(x))
        loss, lm_loss, _ = linear_cross_entropy(x.flatten(0, 1), self.lm_head.weight, targets.flatten(),
                                                self.cfg.z_loss_weight)
        if aux_losses:
            loss = loss + torch.stack(aux_losses).sum()
        return LMOutput(loss=loss, lm_loss=lm_loss.detach())

    def moe_layers(self) -> list[tuple[int, MoE]]:
        return [(i, layer.ffn) for i, layer in enumerate(self.layers) if isinstance(layer.ffn, MoE)]

    def mla_layers(self) -> list[tuple[int, MLA]]:
        return [(i, layer.attn) for i, layer in enumerate(self.layers) if isinstance(layer.attn, MLA)]

    def on_step_end(self, applied: Union[bool, Tensor]) -> None:
        """Router-bias update (when applied) and reset of the per-step MoE and max-logit trackers."""
        for _, moe in self.moe_layers():
            moe.end_step(applied)
        for _, mla in self.mla_layers():
            mla.end_step()

    def diagnostics(self) -> dict[str, float]:
        """Per-layer MoE balance ("moe/layer{i}/...") and MLA max logits ("mla/layer{i}/max_logit")."""
        out: dict[str, float] = {}
        for i, moe in self.moe_layers():
            out.update(moe.diagnostics(f"moe/layer{i}"))
        for i, mla in self.mla_layers():
            value = mla.max_logits.max()
            if not torch.isfinite(value):  # reset already: report the last finished step
                value = mla.last_max_logits.max()
            if torch.isfinite(value):  # tracked at all
                out[f"mla/layer{i}/max_logit"] = value.item()
        return out
