"""HF config.json <-> ModelConfig: the released 48B-A3B shape, round trips, and refusals."""

import dataclasses
import json
from pathlib import Path

import pytest

pytest.importorskip("safetensors", reason="needs pip install 'kimik3[hf]'")  # kimik3.hf imports it

from kimik3.config.schema import ModelConfig  # noqa: E402
from kimik3.hf.config_map import (  # noqa: E402
    HFConfigError,
    architecture_of,
    check_same_architecture,
    config_from_hf_dir,
    hf_config_from_model_config,
    model_config_from_hf,
)

RELEASED = Path(__file__).parent / "data" / "kimi_linear_48b_a3b_config.json"


def _released() -> dict:
    return json.loads(RELEASED.read_text())


def _tiny(**over) -> ModelConfig:
    base = dict(hidden_size=32, num_layers=4, num_heads=2, head_dim=8, kv_lora_rank=16, qk_nope_head_dim=8,
                qk_rope_head_dim=4, v_head_dim=8, intermediate_size=48, num_experts=4, top_k=2,
                moe_intermediate_size=16, n_group=2, topk_group=1, vocab_size=64, mla_every=2)
    return ModelConfig(**{**base, **over})


def test_released_48b_a3b_maps_field_by_field(tmp_path):
    (tmp_path / "config.json").write_text(RELEASED.read_text())
    cfg = config_from_hf_dir(tmp_path)
    mla_layers = [i + 1 for i, t in enumerate(cfg.layer_types) if t == "mla"]
    assert mla_layers == [4, 8, 12, 16, 20, 24, 27]
    expected = dict(
        vocab_size=163840, max_seq_len=1048576, hidden_size=2304, num_layers=27, norm_eps=1e-5,
        tie_embeddings=False, init_std=0.02, num_heads=32, head_dim=128, conv_size=4, gate_form="softplus",
        mla_num_heads=32, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, mla_use_rope=False, mla_output_gate=False, intermediate_size=9216, num_experts=256,
        top_k=8, num_shared_experts=1, moe_intermediate_size=1024, first_k_dense=1,
        routed_scaling_factor=2.446, n_group=1, topk_group=1,
    )
    assert {k: getattr(cfg, k) for k in expected} == expected
    # The layer pattern of the release is kimik3's mla_every=4 rule (every 4th and the last layer).
    assert architecture_of(cfg) == architecture_of(dataclasses.replace(cfg, layer_types=None, mla_every=4))


@pytest.mark.parametrize("over", [{}, {"q_lora_rank": 12}, {"mla_every": 0}, {"mla_every": 1},
                                  {"num_experts": 0}, {"first_k_dense": 0}])
def test_round_trip_keeps_the_architecture(over):
    cfg = _tiny(**over)
    hf = hf_config_from_model_config(cfg, vocab_size=64)
    back = model_config_from_hf(json.loads(json.dumps(hf)))
    assert architecture_of(back) == architecture_of(cfg, 64)


def test_export_loads_in_transformers_like_the_release():
    transformers = pytest.importorskip("transformers")
    released = _released()
    ours = model_config_from_hf(released)
    exported = hf_config_from_model_config(ours, vocab_size=ours.vocab_size)
    a = transformers.KimiLinearConfig(**released)
    b = transformers.KimiLinearConfig(**exported)
    keys = ["vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "n_shared_experts", "routed_scaling_factor",
            "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim", "n_group",
            "topk_group", "num_experts_per_tok", "norm_topk_prob", "hidden_act", "max_position_embeddings",
            "rms_norm_eps", "num_local_experts", "layer_types", "mlp_layer_types",
            "linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim"]
    assert {k: getattr(b, k) for k in keys} == {k: getattr(a, k) for k in keys}


def test_hf_defaults_and_aliases_follow_transformers():
    cfg = model_config_from_hf({"model_type": "kimi_linear", "num_hidden_layers": 6, "n_group": 2,  # 32 heads
                                "num_experts_per_tok": 3, "max_position_embeddings": 512})
    assert (cfg.n_group, cfg.top_k, cfg.max_seq_len) == (2, 3, 512)
    # transformers' default pattern: 0-based layer i > 0 with i % 4 == 0 is full attention.
    assert cfg.layer_types == ["kda", "kda", "kda", "kda", "mla", "kda"]
    assert cfg.first_k_dense == 1 and cfg.hidden_size == 2304


def test_bounded_gate_imports_but_does_not_export():
    hf = _released()
    hf["linear_attn_config"]["gate_lower_bound"] = -5.0
    cfg = model_config_from_hf(hf)
    assert (cfg.gate_form, cfg.gate_lower_bound) == ("bounded", -5.0)
    with pytest.raises(HFConfigError, match=r"^model.gate_form='bounded' is not expressible"):
        hf_config_from_model_config(cfg, vocab_size=cfg.vocab_size)


@pytest.mark.parametrize("over,field", [
    ({"mla_use_rope": True}, "model.mla_use_rope"),
    ({"mla_output_gate": True}, "model.mla_output_gate"),
    ({"num_shared_experts": 0}, "model.num_shared_experts"),
    ({"tie_embeddings": True}, "model.tie_embeddings"),
    ({"arch": "smoke_test_lm"}, "model.arch"),
])
def test_export_refuses_what_transformers_cannot_express(over, field):
    with pytest.raises(HFConfigError, match=f"^{field}="):
        hf_config_from_model_config(_tiny(**over), vocab_size=64)


@pytest.mark.parametrize("patch,field", [
    ({"num_key_value_heads": 8}, "num_key_value_heads"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"mla_use_nope": False}, "mla_use_nope"),
    ({"num_nextn_predict_layers": 1}, "num_nextn_predict_layers"),
    ({"moe_renormalize": False}, "moe_renormalize"),
    ({"moe_router_activation_func": "softmax"}, "moe_router_activation_func"),
    ({"attention_dropout": 0.1}, "attention_dropout"),
    ({"model_type": "deepseek_v3"}, "model_type"),
    ({"num_expert_group": 2, "n_group": 4}, "num_expert_group"),
    ({"mlp_layer_types": ["dense", "sparse"] * 13 + ["dense"]}, "mlp_layer_types"),
    ({"linear_attn_config": {"use_full_rank_gate": True}}, "linear_attn_config.use_full_rank_gate"),
])
def test_import_refuses_what_kimik3_cannot_express(patch, field):
    hf = {**_released(), **patch}
    with pytest.raises(HFConfigError, match=f"^config.json {field}") as err:
        model_config_from_hf(hf)
    assert "\n" not in str(err.value)


def test_architecture_mismatch_lists_every_field():
    cfg = model_config_from_hf(_released())
    other = dataclasses.replace(cfg, hidden_size=1024, num_experts=64)
    with pytest.raises(HFConfigError) as err:
        check_same_architecture(other, cfg, vocab_size=None, source="model.init_from='x'")
    msg = str(err.value)
    assert msg.startswith("model.init_from='x' does not match the model config:")
    assert "model.hidden_size=1024 but the checkpoint has 2304" in msg
    assert "model.num_experts=64 but the checkpoint has 256" in msg
    check_same_architecture(dataclasses.replace(cfg, kda_implementation="naive", z_loss_weight=1e-4),
                            cfg, vocab_size=163840, source="x")  # runtime/training fields do not count


def test_preset_kimi_linear_48b_a3b_is_the_release():
    from omegaconf import OmegaConf

    preset = OmegaConf.load(Path(__file__).resolve().parents[2] / "conf" / "model" / "kimi_linear_48b_a3b.yaml")
    preset.pop("defaults")
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), preset))
    check_same_architecture(cfg, model_config_from_hf(_released()), vocab_size=None, source="the preset")
    assert hf_config_from_model_config(cfg, cfg.vocab_size)["linear_attn_config"] == {
        k: v for k, v in _released()["linear_attn_config"].items()}


def test_a_config_json_that_does_not_parse_is_one_error_naming_it(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "kimi_linear",')  # a truncated download
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'config.json'} is not valid JSON: "):
        config_from_hf_dir(tmp_path)
