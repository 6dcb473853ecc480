"""KimiK3 vs transformers' KimiLinearForCausalLM on CPU in fp32: import, logits, one training step,
export, re-import, greedy generation.

transformers runs its own PyTorch fallbacks here (no CUDA: `chunk_kda` / `causal_conv1d` reference
paths), which are what the GPU kernels are tested against upstream.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from hf_models import HF_CONFIGS, VOCAB, transformers
from kimik3.config.schema import ModelConfig
from kimik3.convert import export_hf, import_hf
from kimik3.hf.config_map import config_from_hf_dir
from kimik3.hf.init_from import load_initial_weights, read_kimik3_meta
from kimik3.hf.safetensors_io import INDEX_FILE, iter_tensors
from kimik3.models import build_model

REL_TOL = 1e-4  # max |ours - theirs| / max |theirs| (fp32)


def _ids(T: int = 70, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(seed))


def _ours_from_hf(hf_dir, impl: str = "chunk") -> torch.nn.Module:
    # chunk 16 with T = 70: several full chunks and a partial one.
    cfg = dataclasses.replace(config_from_hf_dir(hf_dir), kda_implementation=impl, kda_chunk_size=16)
    model = build_model(cfg, cfg.vocab_size)
    load_initial_weights(model, cfg, hf_dir)
    return model.eval()


def _rel_err(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


@pytest.mark.parametrize("impl", ["naive", "chunk"])
@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_logits_match_transformers(hf_dirs, name, impl):
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dirs[name]).eval()
    ours = _ours_from_hf(hf_dirs[name], impl)
    with torch.no_grad():
        theirs = hf(_ids(), use_cache=False).logits
        mine = ours(_ids()).logits
    assert _rel_err(mine, theirs) < REL_TOL


# (KimiK3 name, transformers runtime name) of weights whose gradients are compared after one step.
_GRAD_PAIRS = {
    "hybrid_moe": [
        ("embed.weight", "model.embed_tokens.weight"),
        ("layers.0.attn.A_log", "model.layers.0.self_attn.forget_gate.A_log"),
        ("layers.0.attn.conv.weight", "model.layers.0.self_attn.conv1d.weight"),
        ("layers.0.attn.dt_bias", "model.layers.0.self_attn.forget_gate.dt_bias"),
        ("layers.1.attn.kv_b_proj.weight", "model.layers.1.self_attn.kv_b_proj.weight"),
        ("layers.2.ffn.router.weight", "model.layers.2.mlp.gate.weight"),
        ("layers.3.ffn.experts.gate_up_proj", "model.layers.3.mlp.experts.gate_up_proj"),
        ("lm_head.weight", "lm_head.weight"),
    ],
    "hybrid_ngroup": [
        ("layers.2.attn.q_a_norm.weight", "model.layers.2.self_attn.q_a_layernorm.weight"),
        ("layers.1.attn.o_norm.weight", "model.layers.1.self_attn.o_norm.weight"),
        ("layers.0.ffn.experts.down_proj", "model.layers.0.mlp.experts.down_proj"),
        ("layers.0.ffn.shared_experts.up_proj.weight", "model.layers.0.mlp.shared_experts.up_proj.weight"),
    ],
}


@pytest.mark.parametrize("name", list(_GRAD_PAIRS))
def test_training_step_loss_and_grads_match(hf_dirs, name):
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dirs[name]).train()
    ours = _ours_from_hf(hf_dirs[name]).train()
    ids, targets = _ids(40), _ids(40, seed=4)
    theirs_loss = F.cross_entropy(hf(ids, use_cache=False).logits.flatten(0, 1), targets.flatten())
    theirs_loss.backward()
    out = ours(ids, targets)
    out.loss.backward()
    assert abs(out.loss.item() - theirs_loss.item()) < REL_TOL * theirs_loss.item()
    ours_params, hf_params = dict(ours.named_parameters()), dict(hf.named_parameters())
    for our_name, hf_name in _GRAD_PAIRS[name]:
        g_ours, g_hf = ours_params[our_name].grad, hf_params[hf_name].grad.reshape(ours_params[our_name].shape)
        assert _rel_err(g_ours, g_hf) < REL_TOL, our_name


def test_import_writes_the_same_tensors_as_direct_loading(hf_dirs, tmp_path):
    out = import_hf(hf_dirs["hybrid_ngroup"], tmp_path / "k3", max_shard_bytes=4096)
    assert (out / INDEX_FILE).is_file()  # sharded past the size, with an index
    cfg, vocab = read_kimik3_meta(out)
    assert vocab == VOCAB and cfg.n_group == 4 and cfg.topk_group == 2
    direct = _ours_from_hf(hf_dirs["hybrid_ngroup"]).state_dict()
    imported = dict(iter_tensors(out))
    assert imported.keys() == direct.keys()
    assert all(torch.equal(imported[k], direct[k]) for k in direct)
    via_weights = build_model(cfg, vocab)
    load_initial_weights(via_weights, cfg, out)
    assert all(torch.equal(v, direct[k]) for k, v in via_weights.state_dict().items())


def _random_kimik3(seed: int = 0) -> tuple[ModelConfig, torch.nn.Module]:
    cfg = ModelConfig(
        name="interop_test", hidden_size=32, num_layers=4, mla_every=2, num_heads=2, head_dim=8, conv_size=4,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, q_lora_rank=12,
        intermediate_size=48, num_experts=4, top_k=2, moe_intermediate_size=16, n_group=2, topk_group=1,
        routed_scaling_factor=2.0, first_k_dense=1, norm_eps=1e-5, init_std=0.1, kda_chunk_size=16,
    )
    torch.manual_seed(seed)
    model = build_model(cfg, VOCAB)
    with torch.no_grad():  # move the constant-initialised tensors so that a swap would show
        for name, t in model.state_dict().items():
            if "norm" in name or name.endswith("e_score_correction_bias"):
                t.add_(0.1 * torch.randn_like(t))
    return cfg, model.eval()


def _save_kimik3_weights(cfg: ModelConfig, model: torch.nn.Module, path) -> None:
    from kimik3.hf.init_from import KIMIK3_META, write_kimik3_meta
    from kimik3.hf.safetensors_io import ShardedWriter

    with ShardedWriter(path) as w:
        for k, v in model.state_dict().items():
            w.add(k, v)
        w.extra_files[KIMIK3_META] = write_kimik3_meta(cfg, VOCAB, source="test")


def test_export_loads_in_transformers_and_reimports_bitwise(tmp_path):
    cfg, model = _random_kimik3()
    _save_kimik3_weights(cfg, model, tmp_path / "k3")
    hf_dir = export_hf(tmp_path / "k3", tmp_path / "hf", max_shard_bytes=8192)
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        assert _rel_err(model(_ids()).logits, hf(_ids(), use_cache=False).logits) < REL_TOL
    back = import_hf(hf_dir, tmp_path / "k3_again")
    again = dict(iter_tensors(back))
    original = model.state_dict()
    assert again.keys() == original.keys()
    assert all(again[k].dtype == original[k].dtype and torch.equal(again[k], original[k]) for k in original)


def test_greedy_generation_matches_transformers(tmp_path):
    cfg, model = _random_kimik3(seed=1)
    _save_kimik3_weights(cfg, model, tmp_path / "k3")
    hf = transformers.AutoModelForCausalLM.from_pretrained(export_hf(tmp_path / "k3", tmp_path / "hf")).eval()
    prompt = _ids(T=12, seed=5)[:1]
    theirs = hf.generate(prompt, max_new_tokens=16, do_sample=False, use_cache=True)
    ours = prompt
    with torch.no_grad():
        for _ in range(16):  # cache-free: rerun the whole prefix each step
            ours = torch.cat([ours, model(ours).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(ours, theirs)


def test_unmapped_hf_tensor_is_refused(hf_dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    src = hf_dirs["mla_only"]
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    tensors["model.layers.0.self_attn.extra_gate.weight"] = torch.zeros(2)
    del tensors["model.layers.1.self_attn.kv_b_proj.weight"]
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="no KimiK3 counterpart: \\['model.layers.0.self_attn.extra_gate.weight'\\]"):
        import_hf(bad, tmp_path / "out")
    del tensors["model.layers.0.self_attn.extra_gate.weight"]
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing from the checkpoint: \\['model.layers.1.self_attn.kv_b_proj.weight'\\]"):
        import_hf(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_import_streams_without_holding_the_model(hf_dirs, tmp_path, monkeypatch):
    """Each KimiK3 tensor is handed on as soon as its HF parts are read: what is pending never
    exceeds one layer's experts (safetensors sorts names, so w1/w2/w3 of a layer interleave)."""
    import kimik3.hf.transfer as transfer
    from kimik3.hf.weight_map import rules_for

    sharded = export_hf(import_hf(hf_dirs["hybrid_ngroup"], tmp_path / "k3"), tmp_path / "hf", max_shard_bytes=2048)
    read, pending_peak = [], []
    real_iter = transfer.iter_tensors

    def counting_iter(path):
        for name, t in real_iter(path):
            read.append(name)
            yield name, t

    monkeypatch.setattr(transfer, "iter_tensors", counting_iter)
    cfg = config_from_hf_dir(sharded)
    rules = rules_for(cfg)
    parts = {r.ours: len(r.hf_names()) for r in rules}
    shapes = {k: v.shape for k, v in build_model(cfg, cfg.vocab_size).state_dict().items()}
    consumed = []

    def sink(name, tensor):
        consumed.append(parts[name])
        pending_peak.append(len(read) - sum(consumed[:-1]))

    transfer.stream_from_hf(rules, sharded, shapes, sink)
    assert len(consumed) == len(rules) and sum(consumed) == len(read) > 100
    assert max(pending_peak) <= 3 * cfg.num_experts  # w1, w2, w3 of one layer's experts
